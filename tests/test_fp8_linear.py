"""The FP8 linear on CPU (emulated GEMM): gradients against fp32 autograd, the fused QKV's row orders,
the fused SwiGLU, call hints, the dgrad weight cache, wgrad padding, the batch-major LM head."""
import os
import pytest
import torch
from megatron_jetrl.precision.gemm import BackendUnavailable, block_gemm, resolve_backend
from megatron_jetrl.precision.layout import qkv_permutation
from megatron_jetrl.precision.linear import FP8LinearFunction
from megatron_jetrl.precision.quant import (dequantize_act, dequantize_blocks, quantize_act,
                                            quantize_weight)
from megatron_jetrl.precision.recipe import FP8Recipe
from tests.common import REPO, graph_names, rel_err

def test_backend_resolution_errors():
    assert resolve_backend("auto", torch.device("cpu")) == "emulated"
    with pytest.raises(BackendUnavailable, match="precision.backend=scaled_mm is unavailable"):
        resolve_backend("scaled_mm", torch.device("cpu"))
    with pytest.raises(BackendUnavailable, match="not an FP8 GEMM backend"):
        resolve_backend("cutlass", torch.device("cpu"))


@pytest.mark.parametrize("wgrad", ["fp8", "bf16"])
def test_fp8_linear_forward_backward_vs_fp32(wgrad):
    """Stated bounds: forward, dgrad, wgrad within 5% relative Frobenius error of fp32 autograd
    (E4M3 rounds each operand by <= 2^-4 relative; errors average over the contraction)."""
    recipe = FP8Recipe(wgrad=wgrad)
    torch.manual_seed(0)
    x = torch.randn(96, 384, requires_grad=True)
    w = (torch.randn(256, 384) * 0.05).requires_grad_()
    qw, sw = quantize_weight(w.detach(), recipe)
    y = FP8LinearFunction.apply(x, w, qw, sw, None, None, recipe, "emulated")
    dy = torch.randn_like(y)
    y.backward(dy)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_ref = x_ref @ w_ref.t()
    y_ref.backward(dy)
    assert rel_err(y, y_ref) < 0.05
    assert rel_err(x.grad, x_ref.grad) < 0.05
    assert rel_err(w.grad, w_ref.grad) < 0.05
    # FP8 is really in the path: not bit-equal to fp32
    assert rel_err(y, y_ref) > 1e-4
    # forward = the dequantized GEMM of exactly the quantized operands
    xq, xs = quantize_act(x.detach(), recipe)
    exact = dequantize_act(xq, xs) @ dequantize_blocks(qw, sw, 128, 128).t()
    assert torch.equal(y.detach(), exact)


def test_fp8_linear_with_qkv_permutation():
    """The cache holds rows in SGLang's [q; k; v] order; outputs and weight gradients come back
    in Megatron's per-group order."""
    recipe = FP8Recipe()
    heads_per_group, head_dim, groups = 2, 64, 2
    rows = groups * (heads_per_group + 2) * head_dim
    perm, sub = qkv_permutation(rows, heads_per_group, head_dim)
    assert sub == [256, 128, 128]
    torch.manual_seed(1)
    x = torch.randn(40, 256, requires_grad=True)
    w = (torch.randn(rows, 256) * 0.05).requires_grad_()
    w_export = w.detach()[perm]
    qs, ss = zip(*(quantize_weight(p, recipe) for p in w_export.split(sub, 0)))
    qw, sw = torch.cat(qs), torch.cat(ss)
    y = FP8LinearFunction.apply(x, w, qw, sw, torch.argsort(perm), perm, recipe, "emulated")
    dy = torch.randn_like(y)
    y.backward(dy)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (x_ref @ w_ref.t()).backward(dy)
    assert rel_err(y, x_ref @ w_ref.t()) < 0.05
    assert rel_err(x.grad, x_ref.grad) < 0.05 and rel_err(w.grad, w_ref.grad) < 0.05


def test_block_gemm_emulated_matches_definition():
    recipe = FP8Recipe()
    a = torch.randn(33, 200)
    b = torch.randn(130, 200)
    aq, as_ = quantize_act(a, recipe)
    bq, bs = quantize_weight(b, recipe)
    out = block_gemm(aq, as_, bq, bs, "emulated", torch.float32)
    ref = dequantize_act(aq, as_).double() @ dequantize_blocks(bq, bs, 128, 128).double().t()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_fused_swiglu_fp8_linear_forward_and_gradients():
    """fc2 with the SwiGLU fused into its activation quantizer: the same output bytes as SwiGLU
    followed by the FP8 linear, and the same gradients for fc1's output and fc2's weight (the
    fused backward differentiates SwiGLU in fp32 itself; autograd goes through silu and mul)."""
    from megatron_jetrl.precision.linear import FP8SwigluLinearFunction
    from megatron_jetrl.precision.quant import quantize_swiglu, swiglu

    r = FP8Recipe(mode="jet")
    g = torch.Generator().manual_seed(4)
    y = (torch.randn(3, 5, 2 * 384, generator=g) * 2).requires_grad_()
    w = (torch.randn(256, 384, generator=g) * 0.05).requires_grad_()
    qw, ws = quantize_weight(w.detach(), r)
    q, s = quantize_swiglu(y.detach(), r)
    q_ref, s_ref = quantize_act(swiglu(y.detach()), r)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    dout = torch.randn(3, 5, 256, generator=g)
    out = FP8SwigluLinearFunction.apply(y, w, qw, ws, None, None, r, "emulated")
    out.backward(dout)
    dy_fused, dw_fused = y.grad.clone(), w.grad.clone()
    y.grad = w.grad = None
    ref = FP8LinearFunction.apply(swiglu(y), w, qw, ws, None, None, r, "emulated")
    ref.backward(dout)
    assert torch.equal(out, ref)
    assert rel_err(dy_fused, y.grad) < 1e-5 and torch.allclose(dw_fused, w.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fuse", [True, False])
def test_jet_mlp_fuses_swiglu_only_when_fc2_runs_fp8(fuse, megatron_single):
    """The dense MLP is models.spec.JetMLP; with precision.fuse_swiglu on and fc2 in FP8 the
    SwiGLU runs inside fc2's quantizer (FP8SwigluLinearFunction in the graph), otherwise it is
    megatron-core's MLP forward; both give the same output and gradients."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.builder import build_model
    from megatron_jetrl.models.spec import JetMLP

    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), ["precision.mode=jet"])
    torch.manual_seed(0)
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), torch.float32,
                               backend="emulated")
    mlp = model.decoder.layers[0].mlp
    assert isinstance(mlp, JetMLP)
    x = torch.randn(7, 2, cfg.model.hidden_size)
    outs = {}
    for f in (True, False):
        state.fuse_swiglu = f
        model.zero_grad()
        out, _ = mlp(x)
        names = set()
        node = out.grad_fn
        while node is not None and len(names) < 50:  # the ops just above fc2's output
            names.add(type(node).__name__)
            node = node.next_functions[0][0] if node.next_functions else None
        out.square().sum().backward()
        outs[f] = (out.detach(), mlp.linear_fc1.weight.grad.clone(), names)
    assert any("FP8SwigluLinearFunction" in n for n in outs[True][2])
    assert not any("FP8SwigluLinearFunction" in n for n in outs[False][2])
    assert torch.equal(outs[True][0], outs[False][0])
    assert rel_err(outs[True][1], outs[False][1]) < 1e-5
    state.fuse_swiglu = fuse  # the setting only changes the path, not the numbers (checked above)
    state.forward_fp8 = False  # bf16 forward: fc2 never sees [gate | up]
    out, _ = mlp(x)
    assert out.shape == outs[True][0].shape and not mlp.linear_fc2.hints.swiglu_input


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_mlp_runs_the_one_kernel_swiglu(dtype, megatron_single):
    """BF16 fc2 (FP8 off: the bf16 / fp8_rollout training path) with precision.fuse_swiglu on: the SwiGLU is
    ``quant.swiglu_fused`` (one kernel each way on CUDA) instead of megatron-core's eager silu/mul/cat; the
    output is bit-equal to megatron-core's MLP (fuse_swiglu off) and the gradients agree (the fused backward
    computes in fp32 where eager BF16 autograd rounds between its ops)."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.builder import build_model

    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), ["precision.mode=bf16"])
    torch.manual_seed(0)
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), dtype,
                               backend="emulated")
    mlp = model.decoder.layers[0].mlp
    assert not mlp.linear_fc2.fp8_active()
    x = torch.randn(9, 2, cfg.model.hidden_size, dtype=dtype)
    res = {}
    for fuse in (True, False):
        state.fuse_swiglu = fuse
        model.zero_grad()
        xi = x.clone().requires_grad_()
        out, _ = mlp(xi)
        names = graph_names(out)
        out.float().square().sum().backward()
        res[fuse] = (out.detach(), xi.grad, mlp.linear_fc1.weight.grad.clone(), names)
    assert "_SwigluFunctionBackward" in res[True][3] and "_SwigluFunctionBackward" not in res[False][3]
    assert torch.equal(res[True][0], res[False][0])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(res[True][1].float(), res[False][1].float()) < tol
    assert rel_err(res[True][2].float(), res[False][2].float()) < tol


def test_gated_mlp_gradients_one_pass_quantizer_equal_one_quantizer_per_operand(megatron_single, monkeypatch):
    """Training through JetMLP: fc2's backward runs the SwiGLU backward once, then fc1's output gradient is
    quantized both ways in one pass (``quant.quantize_dual``, the default). Gradients (fc1, fc2, the MLP input)
    are bit-equal to one quantizer per operand (``FP8ModelState.fused_dy_quant=False``), also with a bias added
    between fc1 and fc2."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.builder import build_model
    from megatron_jetrl.precision import linear as lin
    from megatron_jetrl.precision import quant

    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), ["precision.mode=jet"])
    torch.manual_seed(0)
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), torch.float32,
                               backend="emulated")
    mlp = model.decoder.layers[0].mlp
    x0 = torch.randn(7, 2, cfg.model.hidden_size)
    calls = {"dual": 0, "bwd": 0}
    real_dual, real_bwd = lin.quantize_dual, quant.swiglu_backward

    def dual(*a, **k):
        calls["dual"] += 1
        return real_dual(*a, **k)

    def bwd(*a, **k):
        calls["bwd"] += 1
        return real_bwd(*a, **k)

    monkeypatch.setattr(lin, "quantize_dual", dual)
    monkeypatch.setattr(quant, "swiglu_backward", bwd)

    def grads():
        model.zero_grad()
        x = x0.clone().requires_grad_()
        out, _ = mlp(x)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return [x.grad.clone(), mlp.linear_fc1.weight.grad.clone(), mlp.linear_fc2.weight.grad.clone()]

    fused = grads()
    assert calls == {"dual": 2, "bwd": 1}  # fc2's and fc1's output gradients, one SwiGLU backward
    state.fused_dy_quant = False
    unfused = grads()
    assert calls == {"dual": 2, "bwd": 2}
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b) and a.abs().sum() > 0
    state.fused_dy_quant = True
    # y = fc1(x) + bias between the linears: the same gradients either way
    real_fc1 = mlp.linear_fc1.forward
    monkeypatch.setattr(mlp.linear_fc1, "forward", lambda h: (real_fc1(h)[0], torch.zeros(())))
    with_bias = grads()
    state.fused_dy_quant = False
    for a, b in zip(with_bias, grads()):
        assert torch.equal(a, b)


def test_dgrad_weight_made_once_per_step_and_dropped(megatron_single):
    """precision.cache_dgrad_weights: dgrad's K-major FP8 weight and its K-major block scales are made on a
    linear's first backward of the step and reused by the later micro-batches (the same tensors), the gradients
    equal the per-micro-batch transpose path's, and ``drop_dgrad_weights`` frees the copies; a new version of
    the weights (refresh) makes new ones. The scale copy is laid out as cuBLAS's 128x128 scale operand wants
    it (``layout.col_major`` of its transpose is a view: no copy per call)."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.builder import build_model
    from megatron_jetrl.kernels.layout import col_major
    from megatron_jetrl.precision.linear import FP8LinearMixin, drop_dgrad_weights, refresh_fp8_weights

    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), ["precision.mode=jet"])
    torch.manual_seed(0)
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), torch.float32,
                               backend="emulated")
    lin = [m for m in model.modules() if isinstance(m, FP8LinearMixin)]
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.model.vocab_size, (1, 16), generator=g) for _ in range(2)]
    pos = torch.arange(16).expand(1, 16)
    grads = {}
    for on in (True, False):
        state.cache_dgrad_weights = on
        model.zero_grad()
        seen = []
        for tokens in batches:
            model(tokens, pos, None, labels=tokens).float().mean().backward()
            seen.append([(m.fp8_cache._t, m.fp8_cache._t_scale) for m in lin])
        if on:
            assert all(t is not None and ts is not None for t, ts in seen[0])
            assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(*seen))
            q, s = lin[0].fp8_weight()
            assert torch.equal(seen[0][0][0].view(torch.uint8), q.view(torch.uint8).t())
            ts = seen[0][0][1]
            assert torch.equal(ts, s.t()) and ts.is_contiguous() and col_major(ts.t()).data_ptr() == ts.data_ptr()
        else:
            assert all(t is None and ts is None for t, ts in seen[0] + seen[1])
        grads[on] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        drop_dgrad_weights(model)
        assert all(m.fp8_cache._t is None and m.fp8_cache._t_scale is None for m in lin)
    assert len(grads[True]) == len(grads[False]) and all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    state.cache_dgrad_weights = True
    model(batches[0], pos, None, labels=batches[0]).float().mean().backward()
    first = lin[0].fp8_cache._t
    with torch.no_grad():
        lin[0].weight.mul_(2.0)
    refresh_fp8_weights(model, state)
    model(batches[0], pos, None, labels=batches[0]).float().mean().backward()
    assert lin[0].fp8_cache._t is not first
    q, s = lin[0].fp8_weight()
    assert torch.equal(lin[0].fp8_cache._t.view(torch.uint8), q.view(torch.uint8).t())
    assert torch.equal(lin[0].fp8_cache._t_scale, s.t())


def test_fp8_linear_takes_prequantized_input_with_column_major_scales(megatron_single):
    """An inference forward above ``small_m_max`` rows handed x's FP8 bytes with cuBLAS-layout (column-major)
    scales (``prequantized_input``, what the decoder's norm kernel writes for the cuBLAS-path linears)
    runs the GEMM alone: no quantizer call, the output bit-equal to the linear quantizing x itself, for the
    fused QKV in both its output orders (megatron's, through the training-order blocks, and the rollout's) and
    fc1; a mismatched or absent pre-quantized input is ignored, and a training forward never uses it."""
    from unittest import mock

    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.builder import build_model
    from megatron_jetrl.precision import linear as linear_mod

    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), ["precision.mode=jet"])
    torch.manual_seed(0)
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), torch.float32,
                               backend="emulated")
    state.small_m_max = 0
    layer = model.decoder.layers[0]
    g = torch.Generator().manual_seed(3)
    for lin, rollout_layout in ((layer.self_attention.linear_qkv, False), (layer.self_attention.linear_qkv, True),
                                (layer.mlp.linear_fc1, False)):
        K = lin.weight.shape[1]
        x = torch.randn(7, 3, K, generator=g) * 2
        with torch.no_grad(), state.rollout_precision(), lin.hinted(rollout_layout_output=rollout_layout):
            ref, _ = lin(x)
            pre = quantize_act(x.reshape(-1, K), state.recipe, scale_col_major=True, use_triton=False)
            assert pre[1].t().is_contiguous()  # column-major (tiny: one 128-group per row)
            with lin.hinted(prequantized_input=pre), \
                    mock.patch.object(linear_mod, "quantize_act", side_effect=AssertionError("quantized again")):
                out, _ = lin(x)
            assert torch.equal(out, ref), (lin, rollout_layout)
            with lin.hinted(prequantized_input=(pre[0][:20], pre[1][:20])):  # another row count: not x's, ignored
                assert torch.equal(lin(x)[0], ref)
        assert lin.hints == linear_mod.CallHints()  # restored on exit
    lin = layer.mlp.linear_fc1
    x = torch.randn(7, 3, lin.weight.shape[1], generator=g, requires_grad=True)
    pre = quantize_act(x.detach().reshape(21, -1), state.recipe, scale_col_major=True, use_triton=False)
    with lin.hinted(prequantized_input=pre), \
            mock.patch.object(linear_mod, "quantize_act", wraps=linear_mod.quantize_act) as q:
        lin(x)[0].sum().backward()  # a training forward quantizes x itself (and saves it for the backward)
    assert q.call_count >= 1 and x.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_writes_batch_major_logits(dtype, megatron_single):
    """The LM head runs on the batch-major hidden states (``models.builder._batch_major_output``): GPTModel's
    ``[s, b, V] -> [b, s, V]`` ``.contiguous()`` is then a view of the LM head's own output (no copy of the
    [tokens x vocab] logits), and the logits and every gradient equal megatron's path."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.builder import build_model

    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), ["precision.mode=bf16"])
    torch.manual_seed(0)
    model, _ = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), dtype, backend="emulated")
    assert "forward" in model.output_layer.__dict__
    b, s = 3, 7
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(s).expand(b, s)
    seen, norm_grads = [], []
    hook = model.output_layer.register_forward_hook(lambda m, i, o: seen.append(o[0]))

    def grad_of_norm_output(module, inputs, out):
        out.register_hook(norm_grads.append)

    # the gradient handed back to the decoder keeps megatron's sequence-major layout (contiguous [s, b, h])
    nhook = model.decoder.final_layernorm.register_forward_hook(grad_of_norm_output)
    res = {}
    for batch_major in (True, False):
        if not batch_major:
            fwd = model.output_layer.__dict__.pop("forward")
        model.zero_grad()
        seen.clear()
        logits = model(tokens, pos, None)
        shares = logits.untyped_storage().data_ptr() == seen[0].untyped_storage().data_ptr()
        (logits.float().square().sum()).backward()
        res[batch_major] = (logits.detach(), shares, {n: p.grad.clone() for n, p in model.named_parameters()})
        assert norm_grads.pop().is_contiguous()
    model.output_layer.forward = fwd
    assert res[True][1] and not res[False][1]  # a view of the LM head's output vs megatron's copy of it
    assert logits.shape == (b, s, cfg.model.vocab_size) and res[True][0].is_contiguous()
    assert torch.equal(res[True][0], res[False][0])
    for n, g in res[True][2].items():
        assert torch.allclose(g.float(), res[False][2][n].float(), rtol=1e-5, atol=1e-6), n
    # with labels, megatron computes its loss on the [s, b, V] logits (views them [s * b, V]): megatron's path
    seen.clear()
    labels = torch.randint(0, cfg.model.vocab_size, (b, s), generator=torch.Generator().manual_seed(2))
    loss = model(tokens, pos, None, labels=labels)
    assert loss.shape == (b, s) and seen[0].is_contiguous()
    hook.remove()
    nhook.remove()


@pytest.mark.parametrize("path", ["dual", "separate"])
def test_wgrad_operands_padded_to_512_tokens_give_the_same_gradients(path, megatron_single, monkeypatch):
    """``gemm.wgrad_token_pad`` (on the H200's scaled_mm backend: a micro-batch's token count not a multiple of
    512): the wgrad quantizers write dy^T and x^T into buffers padded to 512 tokens (zero bytes, scale 1), so
    the wgrad GEMM takes them as they are and accumulates into megatron's ``main_grad``. Forced here on the
    emulated backend for 2 x 13 tokens, through megatron's DDP: every ``main_grad`` and the input gradient equal
    the unpadded run's, the accumulation saw 512-token operands, for the one-pass gradient quantizer
    (``dual``) and one quantizer per operand (``FP8ModelState.fused_dy_quant=False``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.builder import build_model
    from megatron_jetrl.models.grad_accum import enable
    from megatron_jetrl.precision import gemm

    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), ["precision.mode=jet"])
    torch.manual_seed(0)
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), torch.float32,
                               backend="emulated")
    state.fused_dy_quant = path == "dual"
    ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False))
    enable(model, True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 13), generator=g)
    pos = torch.arange(13).expand(2, 13)
    real_pad, real_acc = gemm.wgrad_token_pad, gemm.block_gemm_accumulate
    seen = []

    def acc(a, a_s, b, b_s, out, *rest, **k):
        seen.append((a.shape[1], b.shape[1], a_s.shape[1], b_s.shape[1]))
        return real_acc(a, a_s, b, b_s, out, *rest, **k)

    monkeypatch.setattr(gemm, "block_gemm_accumulate", acc)
    res = {}
    for pad in (0, 512):
        monkeypatch.setattr(gemm, "wgrad_token_pad", lambda t, backend, group=128, _p=pad: _p if t % 512 else 0)
        ddp.zero_grad_buffer()
        seen.clear()
        emb_out = []  # the embedding's output: its gradient is what the FP8 dgrads hand back through the layers
        hook = model.embedding.word_embeddings.register_forward_hook(lambda m, i, o: emb_out.append(o) or o.retain_grad())
        ddp(tokens, pos, None, labels=tokens).float().mean().backward()
        hook.remove()
        # dy^T and x^T: 512 tokens in 4 scale groups padded, else the 26 tokens in 1 (partial) group
        assert seen and all(s == ((512, 512, 4, 4) if pad else (26, 26, 1, 1)) for s in seen), seen
        res[pad] = ({n: p.main_grad.clone() for n, p in model.named_parameters()}, emb_out[0].grad.clone())
    monkeypatch.setattr(gemm, "wgrad_token_pad", real_pad)
    (g0, x0), (g1, x1) = res[0], res[512]
    assert torch.equal(x1, x0) and x0.abs().sum() > 0
    for n, ref in g0.items():
        assert ref.abs().sum() > 0, n
        torch.testing.assert_close(g1[n], ref, rtol=1e-6, atol=1e-7, msg=n)


def test_call_hints_hold_for_the_enclosed_calls_only(megatron_single):
    """``FP8LinearMixin.hinted`` sets a linear's ``CallHints`` for the enclosed calls only: nested hints stack,
    an exception inside restores the outer ones, another linear keeps its defaults, and a field that
    ``CallHints`` does not have is refused."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.builder import build_model
    from megatron_jetrl.precision.linear import CallHints

    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), ["precision.mode=jet"])
    model, _ = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), torch.float32,
                           backend="emulated")
    qkv, fc1 = model.decoder.layers[0].self_attention.linear_qkv, model.decoder.layers[0].mlp.linear_fc1
    pre = (torch.zeros(1, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1))
    with qkv.hinted(rollout_layout_output=True):
        assert qkv.hints == CallHints(rollout_layout_output=True) and fc1.hints == CallHints()
        with pytest.raises(RuntimeError, match="inside"):
            with qkv.hinted(prequantized_input=pre):
                assert qkv.hints.rollout_layout_output and qkv.hints.prequantized_input is pre
                raise RuntimeError("inside")
        assert qkv.hints == CallHints(rollout_layout_output=True)
    assert qkv.hints == CallHints() and qkv.hints is type(qkv).hints
    with pytest.raises(TypeError):
        with qkv.hinted(no_such_hint=True):
            pass
