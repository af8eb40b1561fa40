"""CUDA only: the static decoder (CUDA graphs, fused norm/RoPE/attention/sampler, tuned GEMMs) against
its eager and unfused forms."""
from types import SimpleNamespace

import pytest
import torch

from tests.common import deepgemm_or_skip, same_bytes

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode,small_m,attention", [("bf16", 0, "sdpa"), ("jet", 0, "sdpa"), ("jet", 256, "sdpa"),
                                                    ("jet", 256, "triton"), ("bf16", 0, "triton"),
                                                    ("jet+fp8kv", 0, "triton"), ("fp8_rollout+fp8kv", 256, "triton")])
def test_graph_captured_decode_equals_eager_decode(mode, small_m, attention, tmp_path, megatron_single):
    """The static decoder replaying CUDA graphs draws the same tokens with the same logprobs as the
    same decoder run eagerly, across bucket edges, and keeps doing so after a weight update that
    refreshes the FP8 cache in place (the captured graphs must read the new bytes). With the exact-length Triton
    attention one graph serves every length (it reads the key count from the position tensor); with the FP8 KV
    cache (``+fp8kv``) too."""
    from megatron_jetrl.bench.timing import mode_overrides
    from megatron_jetrl.rollout.base import SamplingParams
    from megatron_jetrl.rollout.local import LocalEngine
    from tests.hf_models import make_hf_model
    from tests.workers import build_loaded

    make_hf_model("qwen3", str(tmp_path))
    _, model, state = build_loaded(str(tmp_path), mode_overrides(mode), backend="auto")
    model = model.bfloat16()
    state.bump()
    state.small_m_max = small_m
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (24,), generator=g)]
    params = SamplingParams(max_new_tokens=40, temperature=1.0)
    engines = {gr: LocalEngine(model, state, pad_id=0, vocab_size=384, seed=3, bucket=16, cuda_graphs=gr,
                               attention=attention) for gr in (False, True)}

    def gen(gr):
        return engines[gr].generate(prompts, params)

    outs = {gr: [gen(gr)] for gr in engines}
    assert engines[True].last_stats["cuda_graphs"] and not engines[False].last_stats["cuda_graphs"]
    ptr = engines[True]._decoder.graphs and next(iter(engines[True]._decoder.graphs))
    with torch.no_grad():  # an "optimizer step": weights change in place, FP8 caches go stale
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda",
                               dtype=p.dtype) * 0.02 * p.float().std().clamp_min(1e-3).to(p.dtype))
    state.bump()
    for gr in engines:
        outs[gr].append(gen(gr))
    assert ptr in engines[True]._decoder.graphs and engines[True].last_stats["graph_capture_s"] == 0.0  # reused
    assert (engines[True]._decoder.k.dtype == torch.float8_e4m3fn) is mode.endswith("+fp8kv")
    assert (len(engines[True]._decoder.graphs) == 1) is (attention == "triton")  # 40 tokens cross 16-key buckets
    for k in range(2):
        for a, b in zip(outs[True][k], outs[False][k]):
            assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs
    assert [x.output_ids for x in outs[True][0]] != [x.output_ids for x in outs[True][1]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,H,G,D,L,pos,splits", [(64, 32, 8, 128, 1152, 639, 1), (64, 32, 8, 128, 1152, 639, 4),
                                                  (5, 32, 8, 128, 4096, 3000, 0), (3, 6, 6, 80, 300, 0, 2),
                                                  (256, 32, 8, 128, 1152, 1000, 1)])
def test_decode_attention_kernel_equals_reference(b, H, G, D, L, pos, splits, dtype):
    """The exact-length decode attention (``kernels/decode_attn.py``) against the fp32 attention over keys
    0..pos with left pads masked (keys past pos marked valid must be ignored), and against SDPA over the
    bucket with the decoder's additive mask: within the cache dtype's rounding (bf16: P is rounded to bf16
    for the PV product, as SDPA's kernels do). ``splits`` 0: the decoder's default for that batch."""
    import torch.nn.functional as F

    from megatron_jetrl.kernels.decode_attn import decode_attention, default_splits

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, H, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, G, L, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, G, L, D, device="cuda", generator=g).to(dtype)
    ok = torch.ones(b, L, dtype=torch.bool, device="cuda")
    ok[::3, : min(17, pos)] = False
    ok[:, pos + 1:] = torch.rand(b, L - pos - 1, device="cuda", generator=g) > 0.5
    valid = ok.clone()
    valid[:, pos + 1:] = False
    splits = splits or default_splits(b, G, L, q.device)
    out = decode_attention(q, k, v, ok, torch.tensor([pos], device="cuda"), D ** -0.5, splits)
    qf = q.float().view(b, G, H // G, D)
    s = torch.matmul(qf, k.float().transpose(-1, -2)) * D ** -0.5
    ref = torch.matmul(s.masked_fill(~valid[:, None, None], float("-inf")).softmax(-1), v.float()).view(b, H, D)
    bias = torch.zeros(b, 1, 1, L, device="cuda", dtype=dtype).masked_fill_(~valid[:, None, None], float("-inf"))
    sdpa = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=bias, scale=D ** -0.5, enable_gqa=H != G)[:, :, 0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err, err_sdpa = (out.float() - ref).abs().max().item(), (sdpa.float() - ref).abs().max().item()
    print(f"decode attention b={b} keys={pos + 1} splits={splits} {dtype}: max diff vs fp32 {err:.2e} (SDPA {err_sdpa:.2e})")
    assert out.dtype == dtype and err < tol and err <= 2 * err_sdpa + tol / 10


def test_decoder_triton_attention_equals_sdpa(tmp_path, megatron_single):
    """The static decoder (fp32 model, CUDA graphs) on the exact-length Triton attention gives the tokens of
    the SDPA decoder, greedy and sampled, with the logprobs to 1e-4. (Unquantized: in jet a last-bit
    difference can move an activation across an E4M3 rounding boundary, test_rl.py's sampling test.)"""
    from megatron_jetrl.rollout.base import SamplingParams
    from megatron_jetrl.rollout.local import LocalEngine
    from tests.hf_models import make_hf_model
    from tests.workers import build_loaded

    make_hf_model("llama", str(tmp_path), seed=2)
    _, model, state = build_loaded(str(tmp_path), ["precision.mode=bf16"], backend="auto")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (20,), generator=g)]
    for temp in (0.0, 1.0):
        params = SamplingParams(max_new_tokens=48, temperature=temp)
        out = {at: LocalEngine(model, state, pad_id=0, vocab_size=384, seed=3, bucket=16, attention=at).generate(prompts, params)
               for at in ("sdpa", "triton")}
        for a, c in zip(out["sdpa"], out["triton"]):
            assert a.output_ids == c.output_ids, temp
            assert max(abs(x - y) for x, y in zip(a.output_logprobs, c.output_logprobs)) < 1e-4, temp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("S,b,H,G,D,rot", [(1, 64, 32, 8, 128, 128), (37, 3, 4, 2, 64, 32), (5, 2, 6, 6, 80, 80)])
def test_rope_and_fp8_cache_kernel_equals_the_rule(S, b, H, G, D, rot, dtype):
    """``precision.kv_cache=fp8``: the decoder's one-kernel RoPE + cache write with per-row RoPE positions (left-
    padded rows rotated from their own first token) writes ``quant.quantize_kv``'s E4M3 bytes and power-of-two
    scales of ``rope_torch``'s keys and of the values (torch's round-to-nearest-even cast), q rotated in place; the
    training forward's one-pass quantize-dequantize (``kv_qdq_triton``) gives the torch statement's values; and
    into exact mode's cache indexed by position (``shift``; V key-major) the decoder's torch write's bytes."""
    from megatron_jetrl.kernels.rope import rope_and_cache, rope_tables, rope_torch
    from megatron_jetrl.precision.quant import kv_qdq, quantize_kv
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.rollout.decode import StaticDecoder

    recipe = FP8Recipe(kv_cache="fp8")
    g = torch.Generator(device="cuda").manual_seed(0)
    hpg = H // G
    qkv = (torch.randn(S, b, G, (hpg + 2) * D, device="cuda", generator=g) * 4).to(dtype)
    q, k, v = torch.split(qkv, [hpg * D, D, D], dim=3)
    q = q.reshape(S, b, H, D)
    L, pos = 64, 7
    idx = pos + torch.arange(S, device="cuda")
    pads = torch.arange(b, device="cuda") % 5
    rp = (idx[:, None] - pads[None]).clamp_min(0)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, device="cuda").float() / rot))
    freqs = torch.outer(torch.arange(L, device="cuda").float(), inv)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :].index_select(0, rp.reshape(-1)).view(S, b, 1, rot)
    cos, sin = rope_tables(freqs, dtype)
    kq, ksc = quantize_kv(rope_torch(k, cos, sin).permute(1, 2, 0, 3), recipe)
    vq, vsc = quantize_kv(v.permute(1, 2, 0, 3), recipe)
    kc = torch.zeros(b, G, L, D, dtype=torch.float8_e4m3fn, device="cuda")
    vc = torch.zeros_like(kc)
    ks, vs = torch.zeros(b, G, L, device="cuda"), torch.zeros(b, G, L, device="cuda")
    q_in = q.clone()
    rope_and_cache(q_in, k, v, cos, sin, kc, vc, idx, ks, vs, recipe)
    assert same_bytes(q_in, rope_torch(q, cos, sin).contiguous())
    assert same_bytes(kc[:, :, idx], kq) and same_bytes(vc[:, :, idx], vq)
    assert torch.equal(ks[:, :, idx], ksc) and torch.equal(vs[:, :, idx], vsc)
    assert same_bytes(kv_qdq(k, recipe), kv_qdq(k, recipe, use_triton=False))
    for got, want in zip(kv_qdq(k, recipe, with_bytes=True), kv_qdq(k, recipe, use_triton=False, with_bytes=True)):
        assert same_bytes(got, want)
    # exact mode's cache, indexed by position (each row's tokens at columns idx - shift, V key-major; a prefill's
    # left pads, at negative columns, not written): the bytes and scales of the decoder's torch write
    shift = pads if S == 1 else pads + pos + 1
    caches = [(torch.zeros_like(kc), torch.zeros(b, G, D, L, dtype=kc.dtype, device="cuda").transpose(-1, -2),
               torch.zeros_like(ks), torch.zeros_like(vs)) for _ in range(2)]
    rope_and_cache(q.clone(), k, v, cos, sin, *caches[0][:2], idx, *caches[0][2:], recipe, shift)
    StaticDecoder._write_kv(SimpleNamespace(kv_recipe=recipe), *caches[1], rope_torch(k, cos, sin), v, idx, shift)
    for a, c in zip(*caches):
        assert same_bytes(a, c)
    assert caches[0][0].view(torch.uint8).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,H,G,D,L,pos,splits", [(64, 32, 8, 128, 1152, 639, 1), (5, 32, 8, 128, 4096, 3000, 0),
                                                  (3, 6, 6, 80, 300, 0, 2)])
def test_fp8_decode_attention_equals_the_dequantized_cache(b, H, G, D, L, pos, splits, dtype):
    """The decode attention over an FP8 KV cache (E4M3 bytes, power-of-two scales per token and KV head folded into
    the scores and the softmax weights; V key-major, as the decoder keeps it on the H200) gives the same kernel's
    output over the dequantized cache in the model's dtype (what the trainer's attention reads): bit for bit in
    fp32, to BF16 rounding on BF16 tensor cores; and the fp32 attention over it within the dtype's rounding. With V
    in [L, d] memory (strided tiles, one loop whose last tile is masked) the same within the dtype's rounding."""
    from megatron_jetrl.kernels.decode_attn import decode_attention, default_splits
    from megatron_jetrl.precision.quant import dequantize_kv, quantize_kv
    from megatron_jetrl.precision.recipe import FP8Recipe

    recipe = FP8Recipe(kv_cache="fp8")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, H, D, device="cuda", generator=g).to(dtype)
    kq, ks = quantize_kv(torch.randn(b, G, L, D, device="cuda", generator=g) * 3, recipe)
    vq, vs = quantize_kv(torch.randn(b, G, L, D, device="cuda", generator=g) / 5, recipe)
    kd, vd = dequantize_kv(kq, ks, dtype), dequantize_kv(vq, vs, dtype)
    ok = torch.ones(b, L, dtype=torch.bool, device="cuda")
    ok[::3, : min(17, pos)] = False
    splits = splits or default_splits(b, G, L, q.device)
    p = torch.tensor([pos], device="cuda")
    key_major = lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)  # noqa: E731 - [b, G, d, L] memory
    valid = ok.clone()
    valid[:, pos + 1:] = False
    s = torch.matmul(q.float().view(b, G, H // G, D), kd.float().transpose(-1, -2)) * D ** -0.5
    ref = torch.matmul(s.masked_fill(~valid[:, None, None], float("-inf")).softmax(-1), vd.float()).view(b, H, D)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    out = decode_attention(q, kq, key_major(vq), ok, p, D ** -0.5, splits, 128, 2, 4, k_scale=ks, v_scale=vs)
    same = decode_attention(q, kd, key_major(vd), ok, p, D ** -0.5, splits, 128, 2, 4)
    err = (out.float() - same.float()).abs().max().item()
    print(f"FP8-KV decode attention b={b} {dtype}: max diff vs the dequantized cache {err:.2e}")
    assert same_bytes(out, same) if dtype == torch.float32 else err < 1e-2
    assert (out.float() - ref).abs().max() < tol
    # V [L, d]: one loop whose last whole tile is masked, where the key-major V's split ends in 32-key tiles; the
    # online softmax groups the last keys apart, so the two round apart
    rows = decode_attention(q, kq, vq, ok, p, D ** -0.5, splits, 128, 2, 4, k_scale=ks, v_scale=vs)
    assert (rows.float() - ref).abs().max() < tol and (rows.float() - out.float()).abs().max() < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("S,b,H,G,D,rot", [(1, 64, 32, 8, 128, 128), (37, 3, 4, 2, 64, 32), (5, 2, 6, 6, 80, 80)])
def test_rope_and_cache_kernel_equals_megatron_rope(S, b, H, G, D, rot, dtype):
    """The decoder's one-kernel RoPE + KV-cache write gives megatron-core's unfused RoPE bytes
    (``apply_rotary_pos_emb`` on q and k) and ``index_copy_`` into the cache, for q/k/v as the strided
    views megatron's fused QKV split returns, partial rotary (rot < head dim), GQA and MHA."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_jetrl.kernels.rope import rope_and_cache, rope_tables

    g = torch.Generator(device="cuda").manual_seed(0)
    hpg = H // G
    qkv = torch.randn(S, b, G, (hpg + 2) * D, device="cuda", generator=g).to(dtype)
    q, k, v = torch.split(qkv, [hpg * D, D, D], dim=3)
    q = q.reshape(S, b, H, D)
    L, pos = 64, 7
    idx = pos + torch.arange(S, device="cuda")
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, device="cuda").float() / rot))
    freqs = torch.outer(torch.arange(L, device="cuda").float(), inv)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :].index_select(0, idx)
    kc_ref = torch.randn(b, G, L, D, device="cuda", generator=g).to(dtype)
    vc_ref = torch.randn(b, G, L, D, device="cuda", generator=g).to(dtype)
    kc, vc = kc_ref.clone(), vc_ref.clone()
    q_ref = _apply_rotary_pos_emb_bshd(q, freqs)
    kc_ref.index_copy_(2, idx, _apply_rotary_pos_emb_bshd(k, freqs).permute(1, 2, 0, 3))
    vc_ref.index_copy_(2, idx, v.permute(1, 2, 0, 3))
    cos, sin = rope_tables(freqs, dtype)
    q_in = q.clone()
    rope_and_cache(q_in, k, v, cos, sin, kc, vc, idx)
    assert same_bytes(q_in, q_ref.contiguous()) and same_bytes(kc, kc_ref) and same_bytes(vc, vc_ref)


@pytest.mark.parametrize("mode,small_m,cublas", [("bf16", 0, False), ("jet", 0, False), ("jet", 256, False),
                                                 ("jet", 0, True)])
def test_decoder_fused_add_norm_quant_equals_unfused(mode, small_m, cublas, tmp_path, megatron_single):
    """The static decoder's fused residual add + RMSNorm (+ the FP8 linear's activation quantization,
    jet with the small-M GEMM; with ``cublas`` also for cuBLAS's GEMM, scales column-major, as
    the decoder's ``norm_quant_cublas`` sets) gives the logits of the same decoder running torch's add, the norm
    module and the linear's own quantizer: identical bytes, prefill and 20 decode steps."""
    from megatron_jetrl.rollout.decode import StaticDecoder
    from tests.hf_models import make_hf_model
    from tests.workers import build_loaded

    make_hf_model("qwen3", str(tmp_path))
    _, model, state = build_loaded(str(tmp_path), [f"precision.mode={mode}"], backend="auto")
    model = model.bfloat16().eval()
    state.bump()
    state.small_m_max = small_m
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 384, (16, 12), generator=g).cuda()
    key_pad = torch.zeros(16, 12, dtype=torch.bool, device="cuda")
    key_pad[:4, :3] = True
    ids = torch.randint(3, 384, (20, 16), generator=g).cuda()
    outs = {}
    with torch.no_grad(), state.rollout_precision():
        for fuse in (True, False):
            dec = StaticDecoder(model, 16, 40, 384, bucket=16, use_graphs=False)
            dec.fuse_add_norm = dec.fuse_norm_quant = fuse
            dec.norm_quant_cublas = fuse and cublas
            outs[fuse] = [dec.prefill(tokens, key_pad)] + [dec.step(ids[t]).clone() for t in range(20)]
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
def test_decoder_attention_quantizes_for_the_output_projection(kv_cache, tmp_path, megatron_single, monkeypatch):
    """jet on the Triton decode attention (head_dim 128, the recipe's group), FP8 KV cache (the key-major kernel;
    the BF16 cache's head-major kernel does not quantize): the output
    projection's activation quantization written by the attention kernel gives the logits of the same decoder
    quantizing in the projection (identical bytes, prefill and 20 decode steps, 16 and 96 rows: the small-M GEMM's
    row-major scales and cuBLAS's column-major ones), and the kernel's bytes and scales are torch's rule's on its
    output."""
    import megatron_jetrl.kernels.decode_attn as da
    from megatron_jetrl.precision.quant import quantize_act
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.rollout.decode import StaticDecoder
    from tests.hf_models import make_hf_model
    from tests.workers import build_loaded

    make_hf_model("llama", str(tmp_path), hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=128)
    _, model, state = build_loaded(str(tmp_path), ["precision.mode=jet"], backend="auto")
    model = model.bfloat16().eval()
    state.bump()
    fused_calls = []
    real = da.decode_attention

    def spy(*a, **kw):
        res = real(*a, **kw)
        if kw.get("quant") is not None and res[1] is not None:
            out, (q8, s8) = res
            qr, sr = quantize_act(out.reshape(out.shape[0], -1).float(), kw["quant"], use_triton=False)
            assert torch.equal(q8.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s8, sr)
            assert s8.stride() == ((1, out.shape[0]) if kw["scale_col_major"] else (out.shape[1], 1))
            fused_calls.append(kw["scale_col_major"])
        return res

    monkeypatch.setattr(da, "decode_attention", spy)
    kv = FP8Recipe(kv_cache="fp8") if kv_cache == "fp8" else None
    for B in (16, 96):
        g = torch.Generator().manual_seed(B)
        tokens = torch.randint(3, 384, (B, 12), generator=g).cuda()
        key_pad = torch.zeros(B, 12, dtype=torch.bool, device="cuda")
        key_pad[:4, :3] = True
        ids = torch.randint(3, 384, (20, B), generator=g).cuda()
        outs = {}
        with torch.no_grad(), state.rollout_precision():
            for fuse in (True, False):
                dec = StaticDecoder(model, B, 40, 384, bucket=16, use_graphs=False, attention="triton", kv_recipe=kv)
                assert dec.triton_attn and dec.attn_splits == 1
                dec.fuse_attn_quant = fuse
                outs[fuse] = [dec.prefill(tokens, key_pad)] + [dec.step(ids[t]).clone() for t in range(20)]
        assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
    # 2 layers x 20 steps per batch with the FP8 cache (the key-major kernel); the BF16 cache's head-major kernel
    # leaves the quantization to the projection
    fused = 20 * 2 if kv_cache == "fp8" else 0
    assert fused_calls.count(False) == fused and fused_calls.count(True) == fused


def test_decoder_deferred_split_sum_equals_sum_kernel(tmp_path, megatron_single):
    """jet with the small-M GEMM on a model wide enough for split-K (hidden 1024, FFN 2048): the
    output projection's and fc2's fp32 partials summed inside the next residual add + RMSNorm kernel, and the fused
    QKV's inside the RoPE + cache kernel, give the logits of the same decoder with the GEMM's own sum kernel, bytes
    identical (prefill and 20 decode steps), and the splits really happened."""
    from megatron_jetrl.rollout.decode import StaticDecoder
    from tests.hf_models import make_hf_model
    from tests.workers import build_loaded

    make_hf_model("llama", str(tmp_path), hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=128)
    _, model, state = build_loaded(str(tmp_path), ["precision.mode=jet"], backend="auto")
    model = model.bfloat16().eval()
    state.bump()
    state.small_m_max = 256
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 384, (16, 12), generator=g).cuda()
    key_pad = torch.zeros(16, 12, dtype=torch.bool, device="cuda")
    key_pad[:4, :3] = True
    ids = torch.randint(3, 384, (20, 16), generator=g).cuda()
    outs, splits = {}, []
    with torch.no_grad(), state.rollout_precision():
        for defer in (True, False):
            dec = StaticDecoder(model, 16, 40, 384, bucket=16, use_graphs=False)
            assert dec.defer_split_sum
            dec.defer_split_sum = defer
            outs[defer] = [dec.prefill(tokens, key_pad)] + [dec.step(ids[t]).clone() for t in range(20)]
            if defer:
                splits = [(layer.self_attention.linear_proj.deferred_splits, layer.self_attention.linear_qkv.deferred_splits)
                          for layer in dec.layers]
    assert min(min(s) for s in splits) > 1, splits  # the output projection's and the fused QKV's partials
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))


def test_fused_sampler_draws_softmax_and_logprobs():
    """The rollout's one-kernel sampler on the GPU: frequencies of softmax(logits / T) over 200k
    draws, log_softmax's logprobs at Llama-3's vocabulary (bf16 logits, batch 64), reproducible per
    seed; and the engine uses it (CUDA, plain temperature)."""
    from megatron_jetrl.rollout.base import SamplingParams, fused_sampling
    from megatron_jetrl.kernels.sample import fused_sample

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(12, device="cuda", generator=g) * 2
    B, T = 200_000, 0.8
    ids, lp = fused_sample(logits[None].expand(B, 12).contiguous(), T, 99)
    p = torch.softmax(logits / T, -1).double()
    freq = torch.bincount(ids, minlength=12).double() / B
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / B).sqrt() + 2e-4).all(), (freq, p)
    x = (torch.randn(64, 128256, device="cuda", generator=g) * 4).bfloat16()
    ids, lp = fused_sample(x, 1.0, 7)
    ref = torch.log_softmax(x.float(), -1).gather(-1, ids[:, None]).squeeze(-1)
    assert (lp - ref).abs().max().item() < 2e-5
    assert torch.equal(fused_sample(x, 1.0, 7)[0], ids) and not torch.equal(fused_sample(x, 1.0, 8)[0], ids)
    assert fused_sampling(x, SamplingParams(temperature=1.0)) and not fused_sampling(x, SamplingParams(top_p=0.9))


def _tiny_tuned_decoder(tmp_path, overrides: list[str], small_m_max: int):
    """The tiny qwen3 model loaded in BF16 with ``overrides``, its FP8 state at ``small_m_max``, 40 prompts of 3-19
    tokens, sampling for 24 tokens at temperature 1, and a ``LocalEngine`` factory over them (``cuda_graphs``)."""
    from megatron_jetrl.rollout.base import SamplingParams
    from megatron_jetrl.rollout.local import LocalEngine
    from tests.hf_models import make_hf_model
    from tests.workers import build_loaded

    make_hf_model("qwen3", str(tmp_path))
    _, model, state = build_loaded(str(tmp_path), overrides, backend="auto")
    model = model.bfloat16()
    state.bump()
    state.small_m_max = small_m_max
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (40,), generator=g)]
    params = SamplingParams(max_new_tokens=24, temperature=1.0)

    def engine(cuda_graphs: bool = True) -> LocalEngine:
        return LocalEngine(model, state, pad_id=0, vocab_size=384, seed=3, bucket=16, cuda_graphs=cuda_graphs)

    return model, state, prompts, params, engine


def test_decoder_tunes_and_replays_deepgemm(tmp_path, megatron_single, kernel_table, monkeypatch):
    """The static decoder above ``small_m_max`` rows times cuBLAS against DeepGEMM for each FP8 weight shape
    before its first capture and records both; with DeepGEMM forced on every shape its graph replays draw the
    tokens and logprobs of the same decoder run eagerly (which calls DeepGEMM: counted)."""
    dg = deepgemm_or_skip()
    # small_m_max 0: every decode GEMM on the cuBLAS path, where the table applies
    model, state, prompts, params, engine = _tiny_tuned_decoder(tmp_path, ["precision.mode=jet"], 0)
    eng = engine()
    eng.generate(prompts, params)
    tuning = eng._decoder.gemm_tuning
    shapes = {tuple(m.fp8_weight()[0].shape) for m in model.modules() if getattr(m, "fp8_cache", None) is not None}
    # the tiny model's four linears have two weight shapes (QKV and fc1: 1024 x 256; o and fc2: 256 x 512)
    assert {tuple(int(v) for v in k.split("x")[1:]) for k in tuning} == shapes and len(shapes) == 2
    for k, v in tuning.items():
        assert v["cublas_us"] > 0 and v["deepgemm_us"] > 0 and kernel_table.kernel_for(*map(int, k.split("x"))) == v["kernel"]
    rows = eng._decoder.B
    state.decode_gemm = "cublas"  # the forced table below stays as set
    for n, k in shapes:
        kernel_table.set_kernel(rows, n, k, "deepgemm")
    calls = []
    real = dg.gemm
    monkeypatch.setattr(dg, "gemm", lambda *a: calls.append(1) or real(*a))
    engines = {gr: engine(gr) for gr in (False, True)}
    outs = {gr: engines[gr].generate(prompts, params) for gr in engines}
    assert engines[True]._decoder.B == rows and engines[True]._decoder.gemm_tuning == {} and calls
    for a, b in zip(outs[True], outs[False]):
        assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs


@pytest.mark.parametrize("mode", ["jet", "jet+fp8kv"])
def test_decoder_tunes_the_small_m_gemm_above_small_m_max(mode, tmp_path, megatron_single, kernel_table, monkeypatch):
    """Above ``small_m_max`` rows the static decoder times the small-M Triton GEMM beside cuBLAS's for each FP8
    weight shape, records both and keeps the faster (another kernel than cuBLAS only when 3% faster). A shape the
    table gives the small-M GEMM runs it (the norm kernel then writes its row-major scales): the graph replays draw
    the tokens and logprobs of the same decoder run eagerly (which calls the small-M GEMM: counted), and of the
    decoder whose ``small_m_max`` covers the batch (the same kernel by the row rule), bit for bit."""
    from megatron_jetrl.bench.timing import mode_overrides
    from megatron_jetrl.kernels import triton_gemm

    model, state, prompts, params, engine = _tiny_tuned_decoder(tmp_path, mode_overrides(mode), 16)
    eng = engine()
    tuned_out = eng.generate(prompts, params)
    rows, tuning = eng._decoder.B, eng._decoder.gemm_tuning
    shapes = {tuple(m.fp8_weight()[0].shape) for m in model.modules() if getattr(m, "fp8_cache", None) is not None}
    assert rows > state.small_m_max and len(shapes) == 2
    assert {tuple(int(v) for v in k.split("x")[1:]) for k in tuning} == shapes
    # a second decoder of that row count, eager, is not timed again: the first one's record and kernels, its draws
    again = engine(False)
    for a, b in zip(again.generate(prompts, params), tuned_out):
        assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs
    assert all(again._decoder.gemm_tuning[k] is v for k, v in tuning.items())
    for k, v in tuning.items():
        times = {n[:-3]: t for n, t in v.items() if n.endswith("_us")}
        assert times["cublas"] > 0 and times["small_m"] > 0
        best = min(times, key=times.get)
        assert v["kernel"] == (best if times[best] < 0.97 * times["cublas"] else "cublas")
        assert kernel_table.kernel_for(*map(int, k.split("x"))) == v["kernel"]
    state.decode_gemm = "cublas"  # the forced table below stays as set
    for n, k in shapes:
        kernel_table.set_kernel(rows, n, k, "small_m")
    calls = []
    real = triton_gemm.small_m_linear
    rows_of = lambda x: x.numel() // x.shape[-1]  # noqa: E731
    monkeypatch.setattr(triton_gemm, "small_m_linear", lambda *a, **kw: calls.append(rows_of(a[0])) or real(*a, **kw))
    engines = {gr: engine(gr) for gr in (False, True)}
    outs = {gr: engines[gr].generate(prompts, params) for gr in engines}
    assert engines[True]._decoder.B == rows and engines[True]._decoder.gemm_tuning == {} and rows in calls
    for n, k in shapes:  # the same kernel by the row rule
        kernel_table.set_kernel(rows, n, k, "cublas")
    state.small_m_max = rows
    by_rule = engine().generate(prompts, params)
    for a, b, c in zip(outs[True], outs[False], by_rule):
        assert a.output_ids == b.output_ids == c.output_ids
        assert a.output_logprobs == b.output_logprobs == c.output_logprobs


@pytest.mark.gpu
def test_bf16_fallback_linears_decode_on_gpu(tmp_path, megatron_single):
    """jet with q/k/v left in BF16 (a SmolLM-shaped llama: 576/192/192 rows) and o_proj on a partial last K
    block: the graph-captured static decoder draws what its eager run does, and its greedy tokens are
    megatron-core's eager decode's (prompts of one length)."""
    from megatron_jetrl.rollout.base import SamplingParams
    from megatron_jetrl.rollout.local import LocalEngine
    from tests.hf_models import make_hf_model
    from tests.workers import build_loaded

    make_hf_model("llama", str(tmp_path), seed=4, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                  head_dim=64, intermediate_size=1536)
    _, model, state = build_loaded(str(tmp_path), ["precision.mode=jet"], backend="auto")
    model = model.bfloat16()
    state.bump()
    assert len(state.bf16_linears) == 2 and state.num_fp8_layers == 6
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (12,), generator=g)]
    sampled = SamplingParams(max_new_tokens=30, temperature=1.0)
    runs = [LocalEngine(model, state, pad_id=0, vocab_size=384, seed=3, bucket=16, cuda_graphs=gr).generate(prompts, sampled)
            for gr in (False, True)]
    assert [x.output_ids for x in runs[0]] == [x.output_ids for x in runs[1]]
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    # prompts of one length: megatron's decode numbers RoPE positions by column, the static decoder by each row's
    # own first token; the two agree without left padding
    prompts = [p[-3:] for p in prompts]
    outs = [LocalEngine(model, state, pad_id=0, vocab_size=384, decode=d).generate(prompts, greedy)
            for d in ("static", "megatron")]
    same = sum(a.output_ids == b.output_ids for a, b in zip(*outs))
    assert same >= len(prompts) - 1, same  # FP8 rounding may flip one near-tie


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_kernels_address_caches_past_2_31_elements(fp8):
    """A layer's KV cache of 256 rows x 8 groups x 8320 positions x 128 (a batch-256, 8K-token rollout of an 8B
    model) holds more than 2^31 elements: the RoPE + cache-write kernel and the decode attention compute 64-bit
    offsets, so the last row is written where torch indexes it and attended over correctly (32-bit offsets wrapped
    into an illegal memory access). V is stored [L, d], as the decoder keeps it on the H100."""
    from megatron_jetrl.kernels.decode_attn import decode_attention
    from megatron_jetrl.kernels.rope import rope_and_cache, rope_tables
    from megatron_jetrl.precision.quant import dequantize_kv, quantize_kv
    from megatron_jetrl.precision.recipe import FP8Recipe

    b, H, G, L, D, pos = 256, 32, 8, 8320, 128, 8000
    assert b * G * L * D > 2 ** 31
    recipe = FP8Recipe(kv_cache="fp8")
    dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    kc = torch.zeros(b, G, L, D, dtype=dt, device="cuda")
    vc = torch.zeros_like(kc)
    ks = vs = None
    if fp8:
        ks, vs = torch.ones(b, G, L, device="cuda"), torch.ones(b, G, L, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    last = slice(b - 2, b)
    kr = torch.randn(2, G, pos, D, device="cuda", generator=g)
    vr = torch.randn(2, G, pos, D, device="cuda", generator=g)
    if fp8:
        (kq, ksr), (vq, vsr) = quantize_kv(kr, recipe), quantize_kv(vr, recipe)
        kc[last, :, :pos], vc[last, :, :pos], ks[last, :, :pos], vs[last, :, :pos] = kq, vq, ksr, vsr
    else:
        kc[last, :, :pos], vc[last, :, :pos] = kr.bfloat16(), vr.bfloat16()
    q = torch.randn(1, b, H, D, device="cuda", generator=g).bfloat16()
    k1 = torch.randn(1, b, G, D, device="cuda", generator=g).bfloat16()
    v1 = torch.randn(1, b, G, D, device="cuda", generator=g).bfloat16()
    freqs = torch.zeros(1, 1, 1, D, device="cuda")  # position's rotation 0: RoPE is the identity
    cos, sin = rope_tables(freqs, torch.bfloat16)
    idx = torch.tensor([pos], device="cuda")
    rope_and_cache(q, k1, v1, cos, sin, kc, vc, idx, ks, vs, recipe if fp8 else None)
    if fp8:
        kq1, ks1 = quantize_kv(k1[0, -1], recipe)
        vq1, vs1 = quantize_kv(v1[0, -1], recipe)
        assert same_bytes(kc[-1, :, pos], kq1) and torch.equal(ks[-1, :, pos], ks1)
        assert same_bytes(vc[-1, :, pos], vq1) and torch.equal(vs[-1, :, pos], vs1)
    else:
        assert torch.equal(kc[-1, :, pos], k1[0, -1]) and torch.equal(vc[-1, :, pos], v1[0, -1])
    ok = torch.ones(b, L, dtype=torch.bool, device="cuda")
    plan = (128, 2, 4) if fp8 else (64, 2, 4)  # the decoder's: the key-major kernel over the FP8 cache
    out = decode_attention(q[0], kc, vc, ok, idx, D ** -0.5, 2, *plan, k_scale=ks, v_scale=vs)
    kl = kc[-1, :, : pos + 1] if not fp8 else dequantize_kv(kc[-1, :, : pos + 1], ks[-1, :, : pos + 1], torch.float32)
    vl = vc[-1, :, : pos + 1] if not fp8 else dequantize_kv(vc[-1, :, : pos + 1], vs[-1, :, : pos + 1], torch.float32)
    s = torch.matmul(q[0, -1].float().view(G, H // G, D), kl.float().transpose(-1, -2)) * D ** -0.5
    ref = torch.matmul(s.softmax(-1), vl.float()).view(H, D)
    assert (out[-1].float() - ref).abs().max() < 2e-2


@pytest.mark.parametrize("mode", ["jet", "jet+fp8kv"])
def test_rows_past_the_gpus_free_memory_decode_in_waves(mode, tmp_path, megatron_single, monkeypatch):
    """With the GPU's free memory (``decode.free_bytes``) holding the KV cache of 20 rows of the rollout's length beside
    the decoder's work (``decode.work_bytes``), 44 rows decode in 3 waves of 16 on one graph-captured decoder, drawing
    each row's tokens of the batch decoded at once (row-seeded; 9 rows in 10 at least: the GEMMs at 16 rows round
    otherwise than at 48); with room for none a one-line refusal naming the response length."""
    from megatron_jetrl.bench.timing import mode_overrides
    from megatron_jetrl.errors import ConfigError
    from megatron_jetrl.rollout import decode
    from megatron_jetrl.rollout.base import SamplingParams
    from megatron_jetrl.rollout.local import LocalEngine
    from tests.hf_models import make_hf_model
    from tests.workers import build_loaded

    make_hf_model("qwen3", str(tmp_path))
    _, model, state = build_loaded(str(tmp_path), mode_overrides(mode), backend="auto")
    model = model.bfloat16()
    state.bump()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 384, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (44,), generator=g)]
    seeds = list(range(44))
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    whole = LocalEngine(model, state, pad_id=0, vocab_size=384, bucket=16)
    ref = whole.generate(prompts, params, seeds)
    assert whole.metrics == {"rollout_waves": 1}
    length = max(map(len, prompts)) + params.max_new_tokens
    per_row = decode.cache_bytes(model, 1, length, mode.endswith("+fp8kv"))
    work = decode.work_bytes(model)  # kept free beside the cache
    assert work > decode.PREFILL_SCORE_BYTES
    monkeypatch.setattr(decode, "free_bytes", lambda device: work + 20 * per_row + per_row // 2)
    engine = LocalEngine(model, state, pad_id=0, vocab_size=384, bucket=16)
    out = engine.generate(prompts, params, seeds)
    assert engine.metrics == {"rollout_waves": 3} and engine.decoder.B == 16 and engine.last_stats["cuda_graphs"]
    # 16 rows run other GEMM tiles and splits than 48 (other roundings): a draw near a boundary may go another way
    same = sum(a.output_ids == b.output_ids for a, b in zip(out, ref))
    assert same >= 0.9 * len(ref), same
    monkeypatch.setattr(decode, "free_bytes", lambda device: work + per_row // 2)
    fresh = LocalEngine(model, state, pad_id=0, vocab_size=384, bucket=16)
    with pytest.raises(ConfigError, match=r"^config error: rollout decode: a KV cache of 1 row x \d+ positions needs "
                                          r".*; shorten rollout.max_new_tokens"):
        fresh.generate(prompts, params, seeds)
