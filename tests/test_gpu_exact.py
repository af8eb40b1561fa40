"""CUDA only: exact on-policy mode (``precision.exact``) on the batch-invariant kernels. The decoder's step and the
trainer's forward give a token the same logprob bits; the kernels under them give a row the same bits at any row
count / query position."""
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_exact_fp8_gemm_rows_do_not_depend_on_the_row_count(N, K):
    """The exact block-FP8 GEMM at the 8B model's weight shapes (fc2's K = 14336, where cuBLAS's rows change at
    M <= 16): rows 0-63 are the same bytes at M = 1, 16, 64 (the decoder: one program per K segment, summed in
    order), 256 and 4,608 (the trainer: the segments summed in the program) as at M = 8,192, and close to the
    dequantized product."""
    from megatron_jetrl.kernels.exact_gemm import exact_block_gemm
    from megatron_jetrl.precision.quant import dequantize_act, quantize_act, quantize_weight
    from megatron_jetrl.precision.recipe import FP8Recipe

    r = FP8Recipe()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, K, device="cuda", generator=g).bfloat16()
    wq, ws = quantize_weight(torch.randn(N, K, device="cuda", generator=g).bfloat16() / 64, r)
    xq, xs = quantize_act(x, r)
    full = exact_block_gemm(xq, xs, wq, ws, torch.bfloat16)
    for m in (1, 16, 64, 256, 4608):
        n = min(m, 64)
        assert torch.equal(exact_block_gemm(xq[:m], xs[:m], wq, ws, torch.bfloat16)[:n], full[:n]), m
    xq_c, xs_c = quantize_act(x[:4608], r, scale_col_major=True)  # the training forward's scale layout
    assert torch.equal(exact_block_gemm(xq_c, xs_c, wq, ws, torch.bfloat16), full[:4608])
    from megatron_jetrl.precision.quant import dequantize_blocks

    ref = dequantize_act(xq[:64], xs[:64], 128) @ dequantize_blocks(wq, ws, 128, 128).t()
    assert (full[:64].float() - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_exact_bf16_gemm_rows_do_not_depend_on_the_row_count():
    """The exact BF16 GEMM at the LM head's shape (128,256 x 4,096) and a square BF16 linear: rows 0-63 at M = 1,
    64 and 4,608 are the bytes of M = 8,192; close to cuBLAS."""
    from megatron_jetrl.kernels.exact_gemm import exact_mm

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(8192, 4096, device="cuda", generator=g).bfloat16()
    for n in (128256, 4096):
        w = (torch.randn(n, 4096, device="cuda", generator=g) / 64).bfloat16()
        full = exact_mm(x, w)
        for m in (1, 64, 4608):
            assert torch.equal(exact_mm(x[:m], w)[:64], full[:min(m, 64)]), (n, m)
        ref = (x[:64] @ w.t()).float()
        assert (full[:64].float() - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_exact_label_logp_rows_do_not_depend_on_the_row_count():
    """Exact mode's logprob at Llama-3's vocabulary (128,256): the sampler's ``label_logp`` over 1, 64 and 256 rows
    gives the bits of the trainer's fused logprob over 4,608 rows (a [s, b, V] view of [b, s, V] memory) for the
    same rows; the eager ``log_softmax`` statement is close (1e-4)."""
    from megatron_jetrl.kernels.fused_logp import fused_logp_entropy, label_logp

    g = torch.Generator(device="cuda").manual_seed(2)
    logits = (torch.randn(4, 1152, 128256, device="cuda", generator=g) * 3).bfloat16().transpose(0, 1)
    labels = torch.randint(0, 128256, (1152, 4), device="cuda", generator=g)
    train = fused_logp_entropy(logits, labels, 0.8)[0]
    rows, lab = logits.reshape(-1, 128256), labels.reshape(-1)
    for m in (1, 64, 256):
        for start in (0, 1000, 4608 - m):
            assert torch.equal(label_logp(rows[start:start + m], lab[start:start + m], 0.8),
                               train.reshape(-1)[start:start + m]), (m, start)
    ref = torch.log_softmax(rows[:256].float() / 0.8, -1).gather(-1, lab[:256, None]).squeeze(-1)
    assert (train.reshape(-1)[:256] - ref).abs().max() < 1e-4


@pytest.mark.parametrize("fp8", [False, True])
def test_exact_attention_decode_step_equals_the_training_forward(fp8):
    """``kernels/exact_attn.py`` at 8B attention shapes (32 heads, 8 groups, head dim 128): a query decoded over the
    exact decoder's cache (indexed by position: keys 0..p in columns 0..p, stale values past them; one query per
    program) is the bytes of the same query in the trainer's call over the whole sequence (its plan: more positions
    per program), at positions around the 64-key block edges, and in a left-padded prefill whose tiles are not the
    trainer's (the pads' queries get 0); the trainer's call is close to SDPA. FP8 K/V: both read the cache's bytes
    (V key-major, as the caches hold it) and scales, and the result is the dequantized values' to BF16 rounding."""
    from megatron_jetrl.kernels.exact_attn import TRAIN_PLAN, exact_attention, key_major
    from megatron_jetrl.precision.quant import dequantize_kv, quantize_kv
    from megatron_jetrl.precision.recipe import FP8Recipe

    b, S, H, G, D, L = 4, 300, 32, 8, 128, 512
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(S, b, H, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(b, G, S, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(b, G, S, D, device="cuda", generator=g).bfloat16()
    zero = torch.zeros(b, dtype=torch.long, device="cuda")
    rec = FP8Recipe(kv_cache="fp8")
    ks = vs = None
    if fp8:
        (k, ks), (v, vs) = quantize_kv(k, rec), quantize_kv(v, rec)
        v = key_major(v)
    train = exact_attention(q, k, v, D ** -0.5, zero, ks, vs, plan=TRAIN_PLAN)
    kd, vd = (dequantize_kv(k, ks, torch.bfloat16), dequantize_kv(v, vs, torch.bfloat16)) if fp8 else (k, v)
    ref = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), kd, vd, is_causal=True, scale=D ** -0.5,
                                         enable_gqa=True).permute(2, 0, 1, 3)
    assert (train.view(S, b, H, D).float() - ref.float()).abs().max() < 2e-2
    if fp8:
        deq = exact_attention(q, kd, vd, D ** -0.5, zero, plan=TRAIN_PLAN)
        assert (deq.float() - train.float()).abs().max() <= 2 ** -7 * train.float().abs().max()
    kc = torch.randn(b, G, L, D, device="cuda", generator=g).bfloat16()  # stale values past the rows' keys
    vc = torch.randn(b, G, L, D, device="cuda", generator=g).bfloat16()
    kcs = vcs = None
    if fp8:
        (kc, kcs), (vc, vcs) = quantize_kv(kc, rec), quantize_kv(vc, rec)
        vc = key_major(vc)
    kc[:, :, :S], vc[:, :, :S] = k, v
    if fp8:
        kcs[:, :, :S], vcs[:, :, :S] = ks, vs
    for i in (0, 1, 62, 63, 64, 65, 127, 128, 200, S - 1):
        out = exact_attention(q[i:i + 1], kc, vc, D ** -0.5, torch.full_like(zero, i), kcs, vcs)
        assert torch.equal(out[0], train[i]), (fp8, i)
    # a left-padded prefill (row r's prompt from column pads[r]: queries at positions column - pads[r])
    pads = torch.tensor([0, 3, 64, 130], device="cuda")
    P = 200
    qp = torch.randn(P, b, H, D, device="cuda", generator=g).bfloat16()
    for r in range(b):
        qp[int(pads[r]):, r] = q[:P - int(pads[r]), r]
    out = exact_attention(qp, kc, vc, D ** -0.5, -pads, kcs, vcs)
    for r in range(b):
        p = int(pads[r])
        assert torch.equal(out[p:, r], train[:P - p, r]) and not out[:p, r].any(), (fp8, r)


@pytest.mark.parametrize("mode", ["jet", "bf16", "jet+fp8kv"])
def test_exact_mode_rollout_logprobs_equal_the_trainers_on_gpu(mode, tmp_path, megatron_single):
    """``precision.exact=true`` on the GPU (BF16 model, CUDA graphs, the batch-invariant kernels): for batches of 1,
    64 and 256 prompts of 3-19 tokens and 80 new tokens (past the 64-key block edge), every sampled token's logprob
    equals the trainer's forward's (micro-batches of 24) bit for bit, and again after a weight update that
    re-quantizes the FP8 caches; the default mode differs at batch 64."""
    from megatron_jetrl.bench.timing import mode_overrides
    from megatron_jetrl.rollout.base import SamplingParams
    from megatron_jetrl.rollout.local import LocalEngine
    from tests.hf_models import make_hf_model
    from tests.workers import build_loaded, gaps_before_and_after_update

    make_hf_model("qwen3", str(tmp_path), seed=9)
    params = SamplingParams(max_new_tokens=80, temperature=1.0)
    worst = {}
    for exact in (True, False):
        _, model, state = build_loaded(str(tmp_path), [*mode_overrides(mode), f"precision.exact={str(exact).lower()}"],
                                       backend="auto")
        model = model.bfloat16()
        state.bump()
        engine = LocalEngine(model, state, pad_id=0, vocab_size=384, seed=5)
        diffs = gaps_before_and_after_update(engine, model, state, params, (1, 64, 256) if exact else (64,),
                                             torch.Generator().manual_seed(0), exact)
        if exact:
            assert engine._decoder.exact and engine._decoder.use_graphs
            assert diffs == [0.0] * len(diffs), (mode, diffs)
        worst[exact] = max(diffs)
    assert worst[False] > 0, worst
