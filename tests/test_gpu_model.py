"""CUDA only: the models and the trainer on the GPU: logits parity, training kernels, gradients, padding."""
import pytest
import torch
from megatron_jetrl.precision.quant import quantize_weight
from megatron_jetrl.precision.recipe import FP8Recipe

from tests.common import REPO, same_bytes, gpu_input

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_logits_parity_bf16_on_gpu(model_type, tmp_path, megatron_single):
    import json

    from tests.hf_models import make_hf_model
    from tests.workers import build_loaded

    hf = make_hf_model(model_type, str(tmp_path)).cuda().bfloat16()
    cfg, model, _ = build_loaded(str(tmp_path), ["precision.mode=bf16", "precision.params_dtype=bf16"])
    model = model.bfloat16()
    tokens = torch.randint(0, 384, (2, 64), device="cuda")
    pos = torch.arange(64, device="cuda").expand_as(tokens)
    with torch.no_grad():
        ours = model.eval()(tokens, pos, None).float()
        ref = hf(tokens).logits.float()
    diff = (ours - ref).abs().max().item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(json.dumps({"model_type": model_type, "bf16_max_abs_logit_diff": diff,
                      "logit_scale": ref.abs().max().item(), "argmax_agreement": agree}))
    # Dense: bf16 rounding only. MoE: near-tied router scores can pick another expert in bf16
    # (seen on the H200: max diff 0.14 of a 1.4 logit scale at 98% argmax agreement).
    bound = 0.2 if model_type == "qwen3_moe" else 0.05
    assert diff < bound * ref.abs().max().item() and agree > 0.95


def test_jet_model_forward_backward_on_scaled_mm(tmp_path, megatron_single):
    """The FP8 model path on CUDA (qkv permutation, cache, scaled_mm) against the bf16 model."""
    from tests.hf_models import make_hf_model
    from tests.workers import build_loaded

    make_hf_model("qwen3", str(tmp_path))
    tokens = torch.randint(0, 384, (2, 64), device="cuda")
    pos = torch.arange(64, device="cuda").expand_as(tokens)
    outs = {}
    for mode in ("bf16", "jet"):
        _, model, state = build_loaded(str(tmp_path), [f"precision.mode={mode}"], backend="auto")
        model = model.bfloat16()
        state.bump()
        assert state.backend == "scaled_mm"
        out = model(tokens, pos, None).float()
        out.square().mean().backward()
        grads = model.decoder.layers[0].self_attention.linear_qkv.weight.grad
        outs[mode] = (out.detach(), grads.float())
    (y_b, g_b), (y_j, g_j) = outs["bf16"], outs["jet"]
    assert 1e-4 < ((y_j - y_b).norm() / y_b.norm()).item() < 0.1
    assert ((g_j - g_b).norm() / g_b.norm()).item() < 0.2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("S,b,H,G,D,rot", [(4096, 1, 32, 8, 128, 128), (37, 3, 4, 2, 64, 32), (5, 2, 6, 6, 80, 80)])
def test_training_rope_equals_megatron_eager_rope(S, b, H, G, D, rot, dtype):
    """The training RoPE (``kernels/rope_train.py``) gives the bytes of megatron-core's unfused RoPE forward and
    of its eager autograd backward, on the strided q/k views of the fused QKV split; the model builder
    routes megatron's ``apply_rotary_pos_emb`` to it (``apply_rope_fusion``)."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_jetrl.config import ModelConfig, ParallelConfig
    from megatron_jetrl.kernels import rope_train as rope
    from megatron_jetrl.models.builder import transformer_config

    g = torch.Generator(device="cuda").manual_seed(0)
    hpg = H // G
    qkv = torch.randn(S, b, G, (hpg + 2) * D, device="cuda", generator=g).to(dtype)
    q, k, _ = torch.split(qkv, [hpg * D, D, D], dim=3)
    q = q.reshape(S, b, H, D)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, device="cuda").float() / rot))
    freqs = torch.outer(torch.arange(S, device="cuda").float() + 3, inv)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :]
    for t in (q, k):
        dy = torch.randn(t.shape, device="cuda", generator=g).to(dtype)
        x_ref = t.detach().clone().requires_grad_()
        y_ref = rope_utils._apply_rotary_pos_emb_bshd(x_ref, freqs)
        y_ref.backward(dy)
        x = t.detach().requires_grad_()
        y = rope.fused_rope(x, freqs)
        y.backward(dy)
        assert same_bytes(y, y_ref.contiguous()) and same_bytes(x.grad, x_ref.grad.contiguous())
    cfg = transformer_config(ModelConfig(), ParallelConfig(), dtype)
    assert cfg.apply_rope_fusion and rope_utils.fused_apply_rotary_pos_emb is rope.fused_rope
    out = rope_utils.apply_rotary_pos_emb(k, freqs, cfg)
    assert same_bytes(out, rope_utils._apply_rotary_pos_emb_bshd(k, freqs).contiguous())


@pytest.mark.parametrize("N", [4096, 128, 5120])
def test_triton_rmsnorm_matches_torch_and_is_batch_invariant(N):
    """``models.norm.JetRMSNorm`` on CUDA (one Triton kernel) vs torch's fused ``rms_norm`` in bf16: at
    most one bf16 ulp apart on under 1% of elements (the fp32 sum of squares is reduced in another
    order, rsqrt is exact here; a first version that rounded x*rstd to bf16 before the weight, as
    torch's composite does, differed on 25% of elements: torch's CUDA kernel rounds once); every row's bytes are the same
    whether the call has 1, 64 or 8192 rows (decode step vs trainer
    forward); the backward (one Triton pass, dw from per-program partials) matches torch's autograd
    to bf16 rounding."""
    from megatron_jetrl.models.norm import JetRMSNorm

    norm = JetRMSNorm(N, eps=1e-5, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(N, device="cuda"))
    x = gpu_input((8192, N)).view(8192, 1, N)
    y = norm(x)
    ref = torch.rms_norm(x, (N,), norm.weight, 1e-5)
    ulp = (y.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-30)
    assert (y != ref).float().mean() < 0.01 and float(ulp.max()) <= 2 ** -7
    for rows in (1, 64):
        assert torch.equal(norm(x[:rows].clone()), y[:rows])
    xa, xb = x[:3001].clone().requires_grad_(), x[:3001].clone().requires_grad_()  # 3 rows per program, a partial last one
    dy = torch.randn_like(xa)
    norm(xa).backward(dy)
    wa = norm.weight.grad.clone()
    norm.weight.grad = None
    torch.rms_norm(xb, (N,), norm.weight, 1e-5).backward(dy)
    assert torch.allclose(xa.grad.float(), xb.grad.float(), rtol=2e-2, atol=1e-2)
    assert torch.allclose(wa.float(), norm.weight.grad.float(), rtol=2e-2, atol=0.5)


@pytest.mark.parametrize("T,V", [(4096, 128256), (37, 1000)])
def test_fused_logp_entropy_equals_megatron_path_on_gpu(T, V, megatron_single):
    """The fused logprob/entropy kernels (the CUDA default) vs megatron-core's vocab-parallel cross
    entropy + eager entropy on bf16 logits: values to fp32 summation-order rounding, the logits'
    gradient (entropy bonus on) to bf16 rounding."""
    from megatron_jetrl.trainer.actor import vocab_parallel_logp_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(1, T, V, device="cuda", generator=g) * 3).to(torch.bfloat16)
    labels = torch.randint(0, V, (1, T), device="cuda", generator=g)
    w = torch.randn(1, T, device="cuda", generator=g)
    res = {}
    for fused in ("1", "0"):
        x = logits.clone().requires_grad_(True)
        lp, ent = vocab_parallel_logp_entropy(x, labels, 0.8, True, fused=fused == "1")
        ((lp * w).sum() - 0.1 * ent.sum()).backward()
        res[fused] = (lp.detach(), ent.detach(), x.grad)
    (lp, ent, gr), (lp_r, ent_r, gr_r) = res["1"], res["0"]
    torch.testing.assert_close(lp, lp_r, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent, ent_r, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(gr.float(), gr_r.float(), rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("seq", [256, 300])
def test_jet_wgrad_accumulation_into_main_grad_on_gpu(seq, megatron_single):
    """The fused wgrad accumulation in the model under megatron's DDP on the H200 (cuBLASLt for the FP8
    linears, torch.addmm with an fp32 output for megatron's BF16 LM head; bf16 parameters):
    the same protocol checks as the CPU test, and main_grads within BF16 rounding of the unfused path's
    (which rounds each micro-batch's wgrad to BF16 before the hook adds it). At 2 x 300 tokens the wgrad
    operands are padded to 1024 tokens in the quantizers' buffers (``gemm.wgrad_token_pad``), so every FP8
    linear still accumulates (before, cuBLASLt refused 600 tokens and the unfused path ran)."""
    import os

    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.builder import build_model
    from megatron_jetrl.models import grad_accum
    from tests.common import ddp_main_grads_fused_vs_unfused

    assert grad_accum.available("cuda") == (True, "")  # torch.addmm(bf16, bf16 -> fp32 out) for megatron's LM head
    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), ["precision.mode=jet"])
    torch.manual_seed(0)
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), torch.bfloat16,
                               backend="auto")
    assert state.backend == "scaled_mm"
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.model.vocab_size, (2, seq), generator=g).cuda() for _ in range(2)]
    grads, fused = ddp_main_grads_fused_vs_unfused(model, state, batches, torch.arange(seq, device="cuda").expand(2, seq))
    assert fused
    for step in range(2):
        for n, ref in grads[False, step].items():
            got = grads[True, step][n]
            assert ((got - ref).norm() / ref.norm()).item() < 1e-2, n


def test_fused_dy_quant_and_in_place_refresh_in_the_model_on_gpu(megatron_single):
    """The tiny model in BF16 on the H200 with head_dim 128 (the fused QKV trains in Megatron block order):
    gradients with the one-pass gradient quantizers equal those of one quantizer per operand
    (``FP8ModelState.fused_dy_quant=False``) bit for bit; the per-step refresh writes every FP8 cache in
    place (same storage) with the bytes and scales of the torch quantizer, the QKV's training-order copy
    too."""
    import os

    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.builder import build_model
    from megatron_jetrl.precision.linear import FP8LinearMixin, refresh_fp8_weights

    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), [
        "precision.mode=jet", "model.head_dim=128", "model.num_attention_heads=4", "model.num_key_value_heads=2"])
    torch.manual_seed(0)
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), torch.bfloat16,
                               backend="auto")
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 256), device="cuda")
    pos = torch.arange(256, device="cuda").expand(2, 256)
    grads = {}
    for fused in (True, False):
        state.fused_dy_quant = fused
        model.zero_grad()
        model(tokens, pos, None).float().square().mean().backward()
        grads[fused] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    state.fused_dy_quant = True
    assert len(grads[True]) > 10
    assert grads[False].keys() == grads[True].keys()
    for n, g in grads[True].items():
        assert torch.equal(g, grads[False][n]), n
    fp8 = [m for m in model.modules() if isinstance(m, FP8LinearMixin)]
    assert any(m.fp8_cache._train is not None for m in fp8)
    ptrs = [(m.fp8_cache.qweight.data_ptr(), m.fp8_cache.scale_inv.data_ptr()) for m in fp8]
    with torch.no_grad():
        for m in fp8:
            m.weight.add_(torch.randn_like(m.weight) * 0.05)
    refresh_fp8_weights(model, state)
    for m, ptr in zip(fp8, ptrs):
        c = m.fp8_cache
        assert (c.qweight.data_ptr(), c.scale_inv.data_ptr()) == ptr
        w = m.weight.detach()
        w = w if c.perm is None else w.index_select(0, c.perm)
        for (q, s), part in zip(c.parts(), w.split(c.sub_rows, 0)):
            qr, sr = quantize_weight(part, state.recipe, use_triton=False)
            assert same_bytes(q, qr) and torch.equal(s, sr)
        if c._train is not None:
            qr, sr = quantize_weight(m.weight.detach(), state.recipe, use_triton=False)
            assert same_bytes(c._train[0], qr) and torch.equal(c._train[1], sr)
            assert same_bytes(c.train_order(m.weight, state)[0], qr)  # current: no second reorder


def test_dgrad_weight_cache_on_gpu(megatron_single):
    """precision.cache_dgrad_weights on the H200 (scaled_mm, bf16 parameters, the fused QKV in training order):
    the step's one K-major copy per weight gives the gradients of the per-micro-batch transposes bit for bit."""
    import os

    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.builder import build_model
    from megatron_jetrl.precision.linear import FP8LinearMixin, drop_dgrad_weights

    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), ["precision.mode=jet"])
    torch.manual_seed(0)
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), torch.bfloat16,
                               backend="auto")
    assert state.backend == "scaled_mm"
    lin = [m for m in model.modules() if isinstance(m, FP8LinearMixin)]
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.model.vocab_size, (2, 256), generator=g).cuda() for _ in range(2)]
    pos = torch.arange(256, device="cuda").expand(2, 256)
    grads = {}
    for on in (True, False):
        state.cache_dgrad_weights = on
        model.zero_grad()
        for tokens in batches:
            model(tokens, pos, None, labels=tokens).float().mean().backward()
        assert all((m.fp8_cache._t is not None) is on and (m.fp8_cache._t_scale is not None) is on for m in lin)
        grads[on] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        drop_dgrad_weights(model)
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


def test_jet_trainer_pads_micro_batches_on_gpu(tmp_path, megatron_single):
    """``algo.pad_tokens_to`` auto on the H200 (jet, scaled_mm, bf16 parameters): 2 sequences of 13 positions per
    micro-batch are padded to 16 (32 tokens, the GEMMs' row alignment); the logprobs, policy loss and weight
    gradients match the unpadded run's (``pad_tokens_to=0``) to bf16/FP8 rounding (cuBLAS may pick other kernels
    for 26 and 32 rows; the pad tokens share the wgrad's last 128-token activation block)."""
    from megatron_jetrl.train import close
    from megatron_jetrl.trainer.actor import build_batch
    from tests.test_rl import _tiny_run

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 60, (n,), generator=g).tolist() for n in (3, 5, 4, 6)]
    responses = [torch.randint(1, 60, (n,), generator=g).tolist() for n in (11, 9, 10, 8)]
    res = {}
    for pad in (-1, 0):
        run = _tiny_run(tmp_path / str(pad), "steps=1", "algo.sft_warmup_steps=0", "precision.mode=jet",
                        "precision.params_dtype=bf16", "algo.micro_batch_size=2", f"algo.pad_tokens_to={pad}")
        try:
            actor = run.actor
            assert next(actor.module.parameters()).is_cuda and actor.fp8_state.backend == "scaled_mm"
            batch = build_batch(prompts, responses, [[-1.0] * len(r) for r in responses],
                                torch.tensor([1.0, -1.0, 0.5, -0.5]), 0, "cuda")
            assert actor.seq_len(batch) == (16 if pad else 13)
            logp = actor.compute_logprobs(batch)
            batch.old_logp = logp - 0.1 * batch.mask
            m = actor.train_step(batch)
            assert m["train_seq_len"] == actor.seq_len(batch)
            res[pad] = (logp, m, {n: p.main_grad.clone() for n, p in actor.module.named_parameters()})
        finally:
            close(run)
    (lp1, m1, g1), (lp0, m0, g0) = res[-1], res[0]
    assert lp1.shape == lp0.shape == (4, 13) and (lp1 - lp0).abs().max().item() < 3e-2
    assert abs(m1["pg_loss"] - m0["pg_loss"]) < 1e-2 * max(1.0, abs(m0["pg_loss"]))
    for n, ref in g0.items():
        assert ref.norm() > 0 and ((g1[n] - ref).norm() / ref.norm()).item() < 5e-2, n


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama3", "yarn"])
def test_rope_scaling_on_gpu_matches_transformers_and_the_decoder(kind, tmp_path, megatron_single):
    """Llama-3.1's and YaRN's scaled RoPE through the fused Triton RoPE of the training forward: fp32 logits
    within 1e-4 of transformers' over 200 tokens; the static decoder (CUDA graphs, its one-kernel RoPE + KV
    write) greedily decodes what megatron-core's eager decode does."""
    from megatron_jetrl.rollout.base import SamplingParams
    from megatron_jetrl.rollout.local import LocalEngine
    from tests.hf_models import make_hf_model
    from tests.test_models import SCALED
    from tests.workers import build_loaded

    mt, rope = SCALED[kind]
    hf = make_hf_model(mt, str(tmp_path), seed=7, rope_parameters=dict(rope)).cuda()
    _, model, state = build_loaded(str(tmp_path), ["precision.mode=bf16"], backend="auto")
    tokens = torch.randint(0, 384, (1, 200), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        ours = model.eval()(tokens, torch.arange(200, device="cuda")[None], None)
        assert (ours - hf(tokens).logits).abs().max().item() <= 1e-4
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 384, (int(n),), generator=g).tolist() for n in (5, 17, 40)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    outs = [LocalEngine(model, state, pad_id=0, vocab_size=384, decode=d).generate(prompts, params)
            for d in ("static", "megatron")]
    assert [x.output_ids for x in outs[0]] == [x.output_ids for x in outs[1]]
