"""Precision core on CPU: quantizers vs an independent float64 statement of the rule, the FP8
linear's gradients vs fp32 autograd, the weight cache, and the Megatron integration."""
import os

import numpy as np
import pytest
import torch

from megatron_jetrl.precision.gemm import BackendUnavailable, block_gemm, resolve_backend
from megatron_jetrl.models.hf_mapping import qkv_permutation
from megatron_jetrl.precision.linear import FP8LinearFunction
from megatron_jetrl.precision.quant import (dequantize_act, dequantize_blocks, quantize_act,
                                            quantize_blocks, quantize_weight)
from megatron_jetrl.precision.recipe import FP8Recipe

F32 = np.float32
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def e4m3_rne(v: np.ndarray) -> np.ndarray:
    """Round float64 values (|v| <= 448) to E4M3 (bias 7, 3 mantissa bits, subnormal step 2^-9),
    ties to even; written from the format's definition, not from torch's cast."""
    a = np.abs(v)
    _, e = np.frexp(a)  # a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    exp = np.maximum(e - 1, -6)
    quantum = np.exp2(exp - 3.0)
    return np.sign(v) * np.rint(a / quantum) * quantum


def reference_blocks(x: np.ndarray, br: int, bc: int, scale_fmt: str):
    """The numerics contract in float64 with float32 rounding where the rule says fp32."""
    rows, cols = x.shape
    x = x.astype(F32).astype(np.float64)
    rb, cb = -(-rows // br), -(-cols // bc)
    q = np.zeros_like(x)
    s = np.zeros((rb, cb))
    inv448 = float(F32(1.0 / 448.0))
    for i in range(rb):
        for j in range(cb):
            blk = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            amax = max(float(F32(1e-10)), float(np.abs(blk).max()))
            if scale_fmt == "fp32":
                scale_inv = float(F32(amax * inv448))
                mult = float(F32(448.0 / amax))
            else:
                y = float(F32(amax * inv448))
                m, e = np.frexp(y)
                e = e - 1 if m == 0.5 else e
                scale_inv, mult = 2.0 ** e, 2.0 ** -e
            scaled = np.clip((blk * mult).astype(F32).astype(np.float64), -448, 448)
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = e4m3_rne(scaled)
            s[i, j] = scale_inv
    return q, s


def _data(shape, seed, outliers=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g))
    if outliers:
        x[0, 0] = 900.0
        x[-1, -1] = -1e-7
    return x


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("shape,block", [((7, 300), (1, 128)), ((64, 256), (1, 128)),
                                         ((300, 200), (128, 128)), ((256, 384), (128, 128))])
def test_quantizer_matches_float64_reference(shape, block, scale_fmt):
    recipe = FP8Recipe(scale_fmt=scale_fmt)
    x = _data(shape, seed=shape[0])
    q, s = quantize_blocks(x, *block, recipe)
    ref_q, ref_s = reference_blocks(x.numpy(), *block, scale_fmt)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))  # ceil-div like SGLang
    np.testing.assert_array_equal(s.double().numpy(), ref_s)
    np.testing.assert_array_equal(q.double().numpy(), ref_q)
    if scale_fmt == "ue8m0":  # powers of two
        m, _ = np.frexp(s.numpy())
        assert np.all(m == 0.5)


def test_bf16_input_and_wrappers_agree():
    recipe = FP8Recipe()
    x = _data((15, 256), seed=3).view(5, 3, 256).bfloat16()
    q, s = quantize_act(x, recipe)
    assert q.shape == x.shape and s.shape == (5, 3, 2)
    q2, s2 = quantize_blocks(x.reshape(15, 256), 1, 128, recipe)
    assert torch.equal(q.view(15, 256).view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s.view(15, 2), s2)
    w = _data((256, 256), seed=4)
    qw, sw = quantize_weight(w, recipe)
    assert sw.shape == (2, 2)


def test_saturation_zero_blocks_and_error_bound():
    recipe = FP8Recipe()
    x = _data((4, 256), seed=5)
    x[1, :128] = 0.0
    q, s = quantize_act(x, recipe)
    # every non-zero group's largest magnitude lands on +-448, exactly the format's max
    amax_q = q.float().abs().view(4, 2, 128).amax(-1)
    assert torch.all((amax_q == 448.0) | (s.view(4, 2) < 1e-12))
    # an all-zero group: tiny finite scale, zero bytes
    assert s[1, 0].item() == pytest.approx(1e-10 / 448, rel=1e-6) and torch.all(q[1, :128].float() == 0)
    # dequantized error <= half an E4M3 ulp (2^-4 relative) or the subnormal step
    deq = dequantize_act(q, s)
    bound = torch.maximum(x.abs() * 2.0 ** -4, s.repeat_interleave(128, 1) * 2.0 ** -9)
    assert torch.all((deq - x).abs() <= bound + 1e-30)


def test_tp_shards_quantize_like_the_whole_tensor():
    recipe = FP8Recipe()
    w = _data((512, 768), seed=6)
    q, s = quantize_weight(w, recipe)
    for dim in (0, 1):  # column-parallel rows / row-parallel columns, 128-aligned shards
        for r, part in enumerate(w.chunk(2, dim)):
            qp, sp = quantize_weight(part, recipe)
            assert torch.equal(qp.view(torch.uint8), q.chunk(2, dim)[r].view(torch.uint8))
            assert torch.equal(sp, s.chunk(2, dim)[r])


def test_backend_resolution_errors():
    assert resolve_backend("auto", torch.device("cpu")) == "emulated"
    with pytest.raises(BackendUnavailable, match="precision.backend=scaled_mm is unavailable"):
        resolve_backend("scaled_mm", torch.device("cpu"))
    with pytest.raises(BackendUnavailable, match="not an FP8 GEMM backend"):
        resolve_backend("cutlass", torch.device("cpu"))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


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
    assert _rel(y, y_ref) < 0.05
    assert _rel(x.grad, x_ref.grad) < 0.05
    assert _rel(w.grad, w_ref.grad) < 0.05
    # FP8 is really in the path: not bit-equal to fp32
    assert _rel(y, y_ref) > 1e-4
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
    assert _rel(y, x_ref @ w_ref.t()) < 0.05
    assert _rel(x.grad, x_ref.grad) < 0.05 and _rel(w.grad, w_ref.grad) < 0.05


def test_block_gemm_emulated_matches_definition():
    recipe = FP8Recipe()
    a = torch.randn(33, 200)
    b = torch.randn(130, 200)
    aq, as_ = quantize_act(a, recipe)
    bq, bs = quantize_weight(b, recipe)
    out = block_gemm(aq, as_, bq, bs, "emulated", torch.float32)
    ref = dequantize_act(aq, as_).double() @ dequantize_blocks(bq, bs, 128, 128).double().t()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_small_m_triton_gemm_under_the_interpreter():
    """The fused small-M kernel (CUDA in production) run by Triton's CPU interpreter: the activation
    bytes and scales it uses are the precision core's Triton quantizer's, and its output is the
    dequantized GEMM of those bytes. (The interpreter's own float->E4M3 cast mis-rounds at binade
    edges, so the comparison is kernel-to-kernel here; tests/test_gpu.py compares against the torch
    quantizer on the GPU.)"""
    import subprocess
    import sys

    code = r'''
import torch
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.precision.quant import quantize_weight
from megatron_jetrl.kernels.triton_quant import quantize_act_triton
from megatron_jetrl.precision.gemm import block_gemm
from megatron_jetrl.kernels.triton_gemm import small_m_linear
for fmt in ("fp32", "ue8m0"):
    r = FP8Recipe(mode="jet", scale_fmt=fmt)
    g = torch.Generator().manual_seed(0)
    # None: the launch plan; then split-K (3 splits over 8 groups, the last one short) and other tiles
    # and x quantized once beforehand (prequant) with other row tiles
    for M, N, K, bn, split, pre, bm in ((1, 256, 384, None, None, False, None), (5, 384, 320, None, None, False, None),
                                        (33, 128, 256, None, None, False, None), (2, 200, 1000, 32, 3, False, None),
                                        (17, 384, 1024, 128, 8, False, None), (40, 256, 640, 64, 2, True, 32),
                                        (3, 130, 300, None, None, True, None), (70, 200, 400, 128, 2, True, None)):
        x = torch.randn(M, K, generator=g) * 3
        w = torch.randn(N, K, generator=g)
        qw, ws = quantize_weight(w, r)
        y, q, s = small_m_linear(x, qw, ws, r, torch.float32, return_quantized=True, block_n=bn, split_k=split,
                                 prequant=pre, block_m=bm, fused_sum=True)
        qr, sr = quantize_act_triton(x, r)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr), (fmt, M, N, K)
        ref = block_gemm(qr, sr, qw, ws, "emulated", out_dtype=torch.float32)
        err = float((y - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, (fmt, M, N, K, err)
        # split-K summed by the tile's last program == by the second kernel (same order, same bytes)
        y2 = small_m_linear(x, qw, ws, r, torch.float32, block_n=bn, split_k=split, prequant=pre, block_m=bm,
                            fused_sum=False)
        assert torch.equal(y, y2), (fmt, M, N, K)
        # deferred sum: the partials as returned, summed in split order == the summed output
        from megatron_jetrl.kernels.triton_gemm import sum_partials
        part, n = small_m_linear(x, qw, ws, r, torch.float32, block_n=bn, split_k=split, prequant=pre, block_m=bm,
                                 return_partials=True)
        y3 = part if n == 1 else sum_partials(part, torch.empty(M, N))
        assert torch.equal(y3, y2) and (n > 1) == (part.dim() == 3), (fmt, M, N, K, n)
        # bulk-copy (TMA descriptor) loads: the same tiles, so the same bytes as per-thread loads in either
        # layout; the swapped-operand layout (y^T = W x^T per tile): the same products summed in another
        # order inside each 128-wide dot (the interpreter's dot is numpy's matmul into fp32: bit-equal in
        # earlier CI runs, two elements one fp32 step apart in the 2026-12-03 run), so equal to fp32 rounding
        if fmt == "fp32":
            lay = {(sw, tma): small_m_linear(x, qw, ws, r, torch.float32, block_n=bn, split_k=split, prequant=pre,
                                             block_m=bm, swap=sw, tma=tma) for sw in (False, True) for tma in (False, True)}
            for sw in (False, True):
                assert torch.equal(lay[(sw, True)], lay[(sw, False)]), (fmt, M, N, K, sw)
            assert torch.equal(lay[(M <= 16, False)], y2), (fmt, M, N, K)  # the default layout is the plan's
            rel = float((lay[(True, False)] - lay[(False, False)]).abs().max() / ref.abs().max())
            assert rel < 1e-6, (fmt, M, N, K, rel)
    from megatron_jetrl.kernels.triton_gemm import _LOCKS
    assert _LOCKS and all(int(b.abs().sum()) == 0 for b in _LOCKS.values())  # counters left at zero
    # fc2 of a gated MLP: x = [gate | up], the activation SwiGLU(x) quantized by the fused quantizer
    from megatron_jetrl.kernels.triton_quant import swiglu_quant_triton
    for M, N, K in ((16, 256, 384), (40, 130, 300)):
        gu = torch.randn(M, 2 * K, generator=g) * 2
        qw, ws = quantize_weight(torch.randn(N, K, generator=g), r)
        y, q, s = small_m_linear(gu, qw, ws, r, torch.float32, return_quantized=True, swiglu=True)
        qr, sr = swiglu_quant_triton(gu, r)
        assert y.shape == (M, N) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
        ref = block_gemm(qr, sr, qw, ws, "emulated", out_dtype=torch.float32)
        assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5, (fmt, M, N, K)
    # the quantizer's launch plans (rows x groups per program, warps): the same bytes and scales for every
    # plan, K not a multiple of the groups a program covers, rows not a multiple of its row tile
    for M, K in ((37, 1000), (5, 640)):
        x = torch.randn(M, K, generator=g) * 5
        for col_major in (False, True):
            q0, s0 = quantize_act_triton(x, r, col_major, plan=(4, 1, 4))
            for plan in ((16, 4, 4), (8, 2, 8, 1), (32, 8, 4)):
                q1, s1 = quantize_act_triton(x, r, col_major, plan=plan)
                assert torch.equal(q1.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s1, s0), (M, K, plan)
                assert s1.stride() == s0.stride()
print("ok")
'''
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def _sglang_fp8_utils_reference():
    """SGLang's own block quantizer (``per_block_cast_to_fp8`` + ``ceil_to_ue8m0`` in
    srt/layers/quantization/fp8_utils.py, copied there from DeepGEMM): that module does not import
    on a CPU machine (its CUDA kernel deps), so the two functions' source is read from SGLang's file
    and executed as written."""
    import ast
    import importlib.metadata

    try:
        path = str(importlib.metadata.distribution("sglang").locate_file("sglang/srt/layers/quantization/fp8_utils.py"))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sglang is not installed")
    text = open(path).read()
    fns = {n.name: ast.get_source_segment(text, n) for n in ast.parse(text).body
           if isinstance(n, ast.FunctionDef) and n.name in ("per_block_cast_to_fp8", "ceil_to_ue8m0")}
    ns = {"torch": torch, "Tuple": tuple, "ceil_align": lambda x, a: -(-x // a) * a}
    exec(fns["ceil_to_ue8m0"], ns)
    exec(fns["per_block_cast_to_fp8"], ns)
    return ns["per_block_cast_to_fp8"]


def _one_ulp_apart(ours, theirs):
    """``amax * fp32(1/448)`` vs ``amax / 448``: equal, or adjacent float32 values."""
    gap = (ours.view(torch.int32).long() - theirs.float().view(torch.int32).long()).abs()
    assert gap.max() <= 1 and (gap == 0).any()


def _blocks_differing(q, qr, rows_blk, cols_blk):
    d = (q.view(torch.uint8) != qr.view(torch.uint8)).float()
    d = torch.nn.functional.pad(d, (0, cols_blk * 128 - d.shape[1], 0, rows_blk * 128 - d.shape[0]))
    return d.view(rows_blk, 128, cols_blk, 128).sum((1, 3))


def test_quantized_weights_vs_sglang_and_modelopt_references():
    """Our 128x128 weight quantizer against SGLang's reference quantizers and nvidia-modelopt's
    block quantizer on a [1000, 1300] weight (not 128-aligned) with a zero block and a block of
    magnitude 1e-6. Differences, all explained:
    - ordinary blocks: FP8 bytes identical to all of them, ue8m0 scales identical; fp32 scales
      equal or one float32 ulp apart: the contract (shared/DESIGN.md) is SGLang's CUDA activation
      kernel's ``amax * fp32(1/448)``, so the rollout's activation scales equal the trainer's;
      these Python references divide (``amax / 448``). Weight scales travel with the weights, so
      the rollout never recomputes them;
    - the zero block: modelopt divides by amax/448 = 0 (NaN bytes); SGLang and we clamp amax;
    - the 1e-6 block: SGLang clamps amax at 1e-4 (so those weights round to ~0 in FP8), we at
      1e-10 (the block keeps its resolution); modelopt has no clamp and agrees with us;
    - modelopt on a bf16 tensor computes amax/448 and the division in bf16 (we always in fp32)."""
    from sglang.benchmark.deepseek_utils import per_block_cast_to_fp8 as sglang_fp32  # pure torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 1300, generator=g) * torch.exp(torch.randn(1000, 1, generator=g))
    w[:128, :128] = 0
    w[128:256, :128] *= 1e-6
    ordinary = torch.ones(8, 11, dtype=torch.bool)
    ordinary[0, 0] = ordinary[1, 0] = False

    q, s = quantize_weight(w, FP8Recipe(scale_fmt="fp32"), use_triton=False)
    qs, ss = sglang_fp32(w)
    d = _blocks_differing(q, qs, 8, 11)
    assert d[ordinary].sum() == 0 and d[0, 0] == 0
    _one_ulp_apart(s[ordinary], ss[ordinary])
    assert d[1, 0] > 16000  # the 1e-6 block: SGLang's 1e-4 clamp flushes it

    qu, su = quantize_weight(w, FP8Recipe(scale_fmt="ue8m0"), use_triton=False)
    qsu, ssu = _sglang_fp8_utils_reference()(w)
    d = _blocks_differing(qu, qsu, 8, 11)
    assert torch.equal(su[ordinary], ssu[ordinary]) and d[ordinary].sum() == 0 and d[1, 0] > 16000

    try:
        from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor
    except ImportError as e:
        pytest.skip(f"nvidia-modelopt does not import here ({e}); tools/setup_env.sh installs it")
    mq, ms = FP8QTensor.quantize(w, block_sizes={-1: 128, -2: 128})
    d = _blocks_differing(q, mq._quantized_data, 8, 11)
    assert d[ordinary].sum() == 0 and d[1, 0] == 0
    _one_ulp_apart(s[ordinary], ms[ordinary])
    assert torch.isnan(mq._quantized_data[:128, :128].float()).all()  # 0 / 0
    mqb, msb = FP8QTensor.quantize(w.bfloat16(), block_sizes={-1: 128, -2: 128})
    assert msb.dtype == torch.bfloat16 and not torch.equal(msb.float()[ordinary], s[ordinary])


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
    assert _rel(dy_fused, y.grad) < 1e-5 and torch.allclose(dw_fused, w.grad, rtol=1e-6, atol=1e-6)


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
    assert _rel(outs[True][1], outs[False][1]) < 1e-5
    state.fuse_swiglu = fuse  # the setting only changes the path, not the numbers (checked above)
    state.forward_fp8 = False  # bf16 forward: fc2 never sees [gate | up]
    out, _ = mlp(x)
    assert out.shape == outs[True][0].shape and not mlp.linear_fc2.hints.swiglu_input


def _graph_names(out, limit=50):
    names, node = set(), out.grad_fn
    while node is not None and len(names) < limit:
        names.add(type(node).__name__)
        node = node.next_functions[0][0] if node.next_functions else None
    return names


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
        names = _graph_names(out)
        out.float().square().sum().backward()
        res[fuse] = (out.detach(), xi.grad, mlp.linear_fc1.weight.grad.clone(), names)
    assert "_SwigluFunctionBackward" in res[True][3] and "_SwigluFunctionBackward" not in res[False][3]
    assert torch.equal(res[True][0], res[False][0])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _rel(res[True][1].float(), res[False][1].float()) < tol
    assert _rel(res[True][2].float(), res[False][2].float()) < tol


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


def test_fused_swiglu_quant_kernel_under_the_interpreter():
    """The fused SwiGLU + 1x128 quantization Triton kernel (CUDA in production) under Triton's CPU
    interpreter on fp32 input: the bytes and scales of the unfused SwiGLU + Triton quantizer. (The
    interpreter rounds fp32 -> bf16 differently from the GPU, so bf16 input is checked on the H200,
    tests/test_gpu.py; its exp is numpy's, one ulp off torch's at times, so the reference SwiGLU
    here uses numpy's exp too.)"""
    import subprocess
    import sys

    code = r'''
import numpy as np
import torch
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.kernels.triton_quant import quantize_act_triton, swiglu_quant_triton, swiglu_triton
def swiglu(y):
    g, u = y.chunk(2, -1)
    g = g.numpy()
    return torch.from_numpy(g / (np.float32(1) + np.exp(-g))) * u
for M, F in ((37, 300), (4, 256), (1, 1000)):  # the BF16 path's one-kernel SwiGLU (fp32 here: exact)
    y = torch.randn(M, 2 * F, generator=torch.Generator().manual_seed(M)) * 3
    assert torch.equal(swiglu_triton(y), swiglu(y)), (M, F)
    assert torch.equal(swiglu_triton(y.view(1, M, 2 * F)), swiglu(y).view(1, M, F))
for fmt in ("fp32", "ue8m0"):
    r = FP8Recipe(mode="jet", scale_fmt=fmt)
    for M, F in ((37, 300), (4, 256)):
        y = torch.randn(M, 2 * F, generator=torch.Generator().manual_seed(M)) * 3
        y[0, :F] = 0.0  # a zero gate row: zero group, eps scale
        for col_major in (False, True):
            q, s = swiglu_quant_triton(y, r, col_major)
            qr, sr = quantize_act_triton(swiglu(y), r, col_major)
            assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr), (fmt, M, F)
            assert s.stride() == sr.stride()
print("ok")
'''
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_swiglu_backward_and_transpose_kernels_under_the_interpreter():
    """The fused SwiGLU backward and the FP8 byte transpose (CUDA in production) under Triton's CPU
    interpreter: the transpose's bytes equal ``x.t().contiguous()`` (partial tiles included); wgrad's
    transposed 1x128 quantizer writes what the 1x128 quantizer writes for ``x^T`` (kernel to kernel); the
    backward equals the torch statement in fp32 to fp32 rounding (the interpreter's exp is numpy's;
    bf16 output is checked on the H200, tests/test_gpu.py)."""
    import subprocess
    import sys

    code = r'''
import torch
from megatron_jetrl.precision.quant import swiglu_backward
from megatron_jetrl.kernels.triton_quant import swiglu_backward_triton, transpose_bytes_triton
g = torch.Generator().manual_seed(0)
for R, C in ((300, 77), (128, 256), (1, 5)):
    x = (torch.randn(R, C, generator=g) * 100).to(torch.float8_e4m3fn)
    t = transpose_bytes_triton(x)
    assert t.shape == (C, R) and t.is_contiguous() and torch.equal(t.view(torch.uint8), x.t().contiguous().view(torch.uint8))
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.kernels.triton_quant import quantize_act_triton, quantize_transposed_triton
r = FP8Recipe(mode="jet")
for R, C in ((300, 200), (128, 128)):  # wgrad's dy^T quantizer (transposed store) == the 1x128 quantizer on x^T
    x = torch.randn(R, C, generator=g) * 3
    q, s = quantize_transposed_triton(x, r, tile_scale=False)
    qr, sr = quantize_act_triton(x.t().contiguous(), r)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr), (R, C)
for M, F in ((37, 600), (4, 256)):
    y = torch.randn(M, 2 * F, generator=g) * 3
    da = torch.randn(M, F, generator=g)
    dy = swiglu_backward_triton(y, da)
    ref = swiglu_backward(y, da, use_triton=False)
    assert dy.shape == ref.shape and dy.dtype == ref.dtype
    torch.testing.assert_close(dy, ref, rtol=1e-5, atol=1e-6)
    assert not torch.equal(dy[:, :F], torch.zeros_like(dy[:, :F]))
print("ok")
'''
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_dual_gradient_quantizer_under_the_interpreter():
    """The backward's one-pass gradient quantizer under Triton's CPU interpreter, kernel to kernel: the
    same bytes and scales as the 1x128 quantizer (dgrad operand, both scale layouts) and the transposed
    1x128 quantizer (wgrad operand), ragged shapes included (fp32: the interpreter's bf16 rounding is not the
    GPU's; bf16 bytes are checked on the H200, tests/test_gpu.py); a malformed plan is refused; the wgrad operands padded to
    512 tokens in the kernels'
    buffers (``pad_to``) hold the same bytes and scales in front and zero bytes of scale 1 behind, and so do
    the torch path's."""
    import subprocess
    import sys

    code = r'''
import torch
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.kernels.triton_quant import quantize_act_triton, quantize_dual_triton, quantize_transposed_triton
g = torch.Generator().manual_seed(0)
same = lambda a, b: a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
for fmt in ("fp32", "ue8m0"):
    r = FP8Recipe(mode="jet", scale_fmt=fmt)
    for M, N in ((300, 200), (128, 256), (1, 5)):
        d = torch.randn(M, N, generator=g) * 3
        d[:, :7] *= 50  # groups of very different range
        for cm, plan in ((False, (128, 8)), (True, (32, 4)), (True, (128, 8))):  # one tile / RB-row chunks
            q, s, qt, st = quantize_dual_triton(d, r, cm, plan=plan)
            qr, sr = quantize_act_triton(d, r, cm)
            qtr, str_ = quantize_transposed_triton(d, r, tile_scale=False)
            assert same(q, qr) and torch.equal(s, sr) and s.stride() == sr.stride(), (M, N, cm)
            assert same(qt, qtr) and torch.equal(st, str_), (M, N, cm)
# the wgrad operands padded to 512 tokens in the kernels' own buffers (gemm.wgrad_token_pad): the same bytes and
# scales in front, zero bytes with scale 1 behind; the torch path pads alike
from megatron_jetrl.precision.quant import quantize_transposed
r = FP8Recipe(mode="jet")
pad_ok = lambda qp, sp, q, s_: (qp.shape[1] % 512 == 0 and same(qp[:, : q.shape[1]].contiguous(), q)
                                and not qp.view(torch.uint8)[:, q.shape[1]:].any() and torch.equal(sp[:, : s_.shape[1]], s_)
                                and bool((sp[:, s_.shape[1]:] == 1).all()) and sp.shape[1] == qp.shape[1] // 128)
for M, N in ((300, 200), (600, 256), (512, 128)):
    d = torch.randn(M, N, generator=g) * 3
    qt, st = quantize_dual_triton(d, r, True)[2:]
    qtp, stp = quantize_dual_triton(d, r, True, pad_to=512)[2:]
    assert pad_ok(qtp, stp, qt, st) and (qtp.shape[1] == M) is (M % 512 == 0), (M, N)
    for tile in (False, True):
        for xs_ in (None, quantize_act_triton(d, r)):
            src = d if xs_ is None else xs_[0]
            q, s_ = quantize_transposed_triton(src, r, tile, None if xs_ is None else xs_[1])
            qp, sp = quantize_transposed_triton(src, r, tile, None if xs_ is None else xs_[1], pad_to=512)
            assert pad_ok(qp, sp, q, s_), (M, N, tile)
            # the torch path (its FP8 casts round like the GPU's, not like the interpreter's: compared on the H200)
            qc, sc = quantize_transposed(src, r, tile, None if xs_ is None else xs_[1], use_triton=False)
            qcp, scp = quantize_transposed(src, r, tile, None if xs_ is None else xs_[1], use_triton=False, pad_to=512)
            assert pad_ok(qcp, scp, qc, sc) and qcp.shape == qp.shape and scp.shape == sp.shape, (M, N, tile)
try:
    quantize_transposed_triton(d, r, False, pad_to=200)
    raise SystemExit("pad_to not a multiple of the group accepted")
except ValueError as e:
    assert "multiple of the group size" in str(e)
for bad in ((100, 4), (128, 3)):
    try:
        quantize_dual_triton(d, r, True, plan=bad)
        raise SystemExit("bad plan accepted")
    except ValueError as e:
        assert "dual quantizer plan" in str(e)
print("ok")
'''
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_rope_and_cache_kernel_under_the_interpreter():
    """The static decoder's RoPE + KV-cache kernel (CUDA in production) under Triton's CPU
    interpreter, fp32 (the interpreter's bf16 rounding is not the GPU's; tests/test_gpu.py checks
    bf16 bytes on the H200): q in place and the cache columns equal megatron-core's unfused RoPE
    (``_apply_rotary_pos_emb_bshd``) plus ``index_copy_``, and :func:`rope_torch` (the CPU path)
    equals megatron's too; partial rotary, GQA, prefill (S > 1) and the strided views of the fused
    QKV split; cache columns outside the positions untouched."""
    import subprocess
    import sys

    code = r'''
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron_jetrl.kernels.rope import rope_and_cache, rope_tables, rope_torch
g = torch.Generator().manual_seed(0)
for S, b, H, G, D, rot in ((1, 3, 4, 2, 16, 16), (5, 2, 4, 4, 24, 8)):
    hpg = H // G
    qkv = torch.randn(S, b, G, (hpg + 2) * D, generator=g)
    q, k, v = torch.split(qkv, [hpg * D, D, D], dim=3)
    q = q.reshape(S, b, H, D)
    L, pos = 12, 3
    idx = pos + torch.arange(S)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(L).float(), inv)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :].index_select(0, idx)
    kc_ref, vc_ref = torch.randn(b, G, L, D, generator=g), torch.randn(b, G, L, D, generator=g)
    kc, vc = kc_ref.clone(), vc_ref.clone()
    q_ref, k_ref = _apply_rotary_pos_emb_bshd(q, freqs), _apply_rotary_pos_emb_bshd(k, freqs)
    kc_ref.index_copy_(2, idx, k_ref.permute(1, 2, 0, 3))
    vc_ref.index_copy_(2, idx, v.permute(1, 2, 0, 3))
    cos, sin = rope_tables(freqs, torch.float32)
    assert torch.equal(rope_torch(q, cos, sin), q_ref) and torch.equal(rope_torch(k, cos, sin), k_ref)
    q_in = q.clone()
    rope_and_cache(q_in, k, v, cos, sin, kc, vc, idx)
    assert torch.equal(q_in, q_ref), (S, (q_in - q_ref).abs().max())
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), (S, b, H, G, D, rot)
print("ok")
'''
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_training_rope_kernel_under_the_interpreter():
    """The training RoPE (``kernels/rope_train.py``, CUDA in production) under Triton's CPU interpreter, fp32:
    its forward and its autograd backward equal megatron-core's unfused RoPE and that statement's eager
    autograd gradient (same ops, same order), for the strided q/k views of the fused QKV split,
    partial rotary and more heads than one program holds; ``fused_rope`` on CPU tensors is megatron's
    eager function."""
    import subprocess
    import sys

    code = r'''
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron_jetrl.kernels import rope_train as rope
g = torch.Generator().manual_seed(0)
for S, b, H, G, D, rot in ((3, 2, 4, 2, 16, 16), (2, 1, 40, 8, 128, 64)):
    hpg = H // G
    qkv = torch.randn(S, b, G, (hpg + 2) * D, generator=g)
    q, k, _ = torch.split(qkv, [hpg * D, D, D], dim=3)
    q = q.reshape(S, b, H, D)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(S).float() + 5, inv)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :]
    for t in (q, k):
        dy = torch.randn(t.shape, generator=g)
        x_ref = t.detach().clone().requires_grad_()
        y_ref = _apply_rotary_pos_emb_bshd(x_ref, freqs)
        y_ref.backward(dy)
        x = t.detach().requires_grad_()
        y = rope.rope_kernel_apply(x, freqs)
        y.backward(dy)
        assert torch.equal(y, y_ref), (S, H, D, rot, (y - y_ref).abs().max())
        assert torch.equal(x.grad, x_ref.grad), (S, H, D, rot, (x.grad - x_ref.grad).abs().max())
    assert torch.equal(rope.fused_rope(q, freqs), _apply_rotary_pos_emb_bshd(q, freqs))  # CPU: eager
# the cos/sin tables: once per freqs tensor (megatron hands every layer the same one), again after it changes
calls, real = [], rope.rope_tables
rope.rope_tables = lambda *a: calls.append(1) or real(*a)
freqs2 = freqs.clone()
ref = rope.rope_kernel_apply(q, freqs2)
assert torch.equal(rope.rope_kernel_apply(q, freqs2), ref) and len(calls) == 1
assert rope._tables(freqs2, torch.float64)[0].dtype == torch.float64 and len(calls) == 2  # per dtype
freqs2.mul_(0.5)  # changed in place: new tables
assert torch.equal(rope.rope_kernel_apply(q, freqs2), _apply_rotary_pos_emb_bshd(q, freqs2)) and len(calls) == 3
print("ok")
'''
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_triton_rmsnorm_under_the_interpreter():
    """The one-kernel RMSNorm (CUDA in production, ``kernels/rmsnorm.py``) under Triton's CPU
    interpreter, fp32: forward equals torch's ``rms_norm`` to fp32 rounding, each row's bytes do not
    depend on how many rows the call has (the trainer's forward and a decode step give the same
    bytes), and the autograd backward matches torch's to fp32 rounding."""
    import subprocess
    import sys

    code = r'''
import torch
from megatron_jetrl.kernels.rmsnorm import RMSNormFunction, rmsnorm_backward, rmsnorm_forward
g = torch.Generator().manual_seed(0)
# the backward kernel alone where a program takes 3 rows (M > 1024), against torch's autograd
x = torch.randn(2050, 96, generator=g) * 3
w, dy = torch.randn(96, generator=g), torch.randn(2050, 96, generator=g)
dx, dw = rmsnorm_backward(x, dy, w, torch.rsqrt(x.pow(2).mean(-1) + 1e-6))
xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
torch.rms_norm(xb, (96,), wb, 1e-6).backward(dy)
assert torch.allclose(dx, xb.grad, rtol=1e-4, atol=1e-5) and torch.allclose(dw, wb.grad, rtol=1e-4, atol=1e-4)
for M, N in ((37, 96), (5, 4096), (3, 300)):
    x = torch.randn(M, N, generator=g) * 3
    w = torch.randn(N, generator=g)
    y, rstd = rmsnorm_forward(x, w, 1e-6)
    ref = torch.rms_norm(x, (N,), w, 1e-6)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5), (M, N, (y - ref).abs().max())
    assert torch.allclose(rstd, torch.rsqrt(x.pow(2).mean(-1) + 1e-6), rtol=1e-6)
    for r in (0, M - 1):  # batch invariance: the row alone gives the same bytes
        assert torch.equal(rmsnorm_forward(x[r:r + 1].clone(), w, 1e-6)[0][0], y[r])
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn(M, N, generator=g)
    RMSNormFunction.apply(xa, wa, 1e-6).backward(dy)
    torch.rms_norm(xb, (N,), wb, 1e-6).backward(dy)
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-4, atol=1e-5), (xa.grad - xb.grad).abs().max()
    assert torch.allclose(wa.grad, wb.grad, rtol=1e-4, atol=1e-4), (wa.grad - wb.grad).abs().max()
print("ok")
'''
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_fused_add_rmsnorm_quant_under_the_interpreter():
    """The decoder's fused residual add + RMSNorm + 1x128 quantizer (CUDA in production) under
    Triton's CPU interpreter, fp32: the sum is torch's ``h + d``, the norm output is the RMSNorm
    kernel's (same bytes as without the add and the quantizer), the FP8 bytes and scales are the
    activation quantizer's on that output (kernel-to-kernel: the interpreter's own E4M3 cast is
    used by both), fp32 and ue8m0 scales, row- and column-major; a split-K GEMM's partials as the delta
    give the bytes of their sum kernel's output as the delta."""
    import subprocess
    import sys

    code = r'''
import torch
from megatron_jetrl.kernels.rmsnorm import add_rmsnorm_quant, rmsnorm_forward
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.kernels.triton_quant import quantize_act_triton
g = torch.Generator().manual_seed(0)
for fmt in ("fp32", "ue8m0"):
    r = FP8Recipe(mode="jet", scale_fmt=fmt)
    for M, N in ((5, 384), (1, 256)):
        h = torch.randn(M, N, generator=g) * 2
        d = torch.randn(M, N, generator=g)
        w = torch.randn(N, generator=g)
        h2, y, (q, s) = add_rmsnorm_quant(h, d, w, 1e-5, r)
        assert torch.equal(h2, h + d)
        y_ref, _ = rmsnorm_forward(h + d, w, 1e-5)
        assert torch.equal(y, y_ref)
        qr, sr = quantize_act_triton(y_ref, r)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr), (fmt, M, N)
        # column-major scales (cuBLAS's layout, as quantize_act(..., scale_col_major=True) writes them)
        _, _, (qc, sc) = add_rmsnorm_quant(h, d, w, 1e-5, r, scale_col_major=True)
        qrc, src = quantize_act_triton(y_ref, r, True)
        assert sc.stride() == src.stride() == (1, M) and torch.equal(sc, sr) and torch.equal(sc, src)
        assert torch.equal(qc.view(torch.uint8), q.view(torch.uint8))
        h3, y3, none = add_rmsnorm_quant(h, None, w, 1e-5)
        assert none is None and h3.data_ptr() == h.data_ptr() and torch.equal(y3, rmsnorm_forward(h, w, 1e-5)[0])
        # delta as split-K partials (deferred sum): the bytes of the sum kernel's output as delta
        from megatron_jetrl.kernels.triton_gemm import sum_partials
        parts = torch.randn(3, M, N, generator=g)
        dsum = sum_partials(parts, torch.empty(M, N))
        assert torch.equal(dsum, parts[0] + parts[1] + parts[2])
        h4, y4, (q4, s4) = add_rmsnorm_quant(h, parts, w, 1e-5, r, delta_splits=3)
        h5, y5, (q5, s5) = add_rmsnorm_quant(h, dsum, w, 1e-5, r)
        assert torch.equal(h4, h5) and torch.equal(y4, y5) and torch.equal(q4.view(torch.uint8), q5.view(torch.uint8))
        assert torch.equal(s4, s5)
print("ok")
'''
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_act_quant_plan_is_checked():
    """The quantizer's default launch plan by shape; a plan passed in (the tuning tool's) is checked and a
    malformed one refused with one line naming the plan (not a Triton compile error later)."""
    from megatron_jetrl.kernels.triton_quant import act_quant_plan, check_act_quant_plan

    assert act_quant_plan(16384, 4096) == (8, 8, 8, 0) and act_quant_plan(64, 4096) == (4, 1, 4, 0)
    assert check_act_quant_plan((16, 4, 8)) == (16, 4, 8, 0)
    for bad in ((8, 3, 8), (8, 8), (8, 8, 3)):
        with pytest.raises(ValueError, match="activation quantizer plan"):
            check_act_quant_plan(bad)


def _megatron_linears(model):
    from megatron.core.tensor_parallel import layers

    return [m for m in model.modules() if isinstance(m, (layers.ColumnParallelLinear, layers.RowParallelLinear))]


def ddp_main_grads_fused_vs_unfused(model, state, batches, pos, steps: int = 2) -> tuple[dict, list]:
    """Wrap ``model`` in megatron's DDP (fp32 grad buffers, as the actor does) and run ``steps`` steps of
    backward over ``batches`` (``zero_grad_buffer`` between steps) with precision.fuse_wgrad_accumulation
    off, then on (the FP8 wgrad accumulation and megatron's own fusion for its BF16 linears, here the LM
    head, through ``models/grad_accum.py``). Checks the fusion protocol on the way (flags set exactly when
    fused, one FP8 accumulate call per fused weight and micro-batch, every placeholder gradient dropped by
    megatron's hook) and returns
    ``{(fuse, step): {name: main_grad}}`` and the weights the fused path covers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_jetrl.precision import gemm
    from megatron_jetrl.precision.linear import FP8LinearMixin

    ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False))
    fused_weights = [m.weight for m in model.modules() if isinstance(m, FP8LinearMixin) and m.fp8_cache.inv_perm is None]
    calls, real = [], gemm.block_gemm_accumulate

    def counting(*a, **k):
        calls.append(a[4].data_ptr())
        return real(*a, **k)

    from megatron_jetrl.models.grad_accum import enable

    grads = {}
    for fuse in (False, True):
        state.fuse_wgrad_accumulation = fuse
        assert enable(model, fuse) == (sum(1 for _ in _megatron_linears(model)) if fuse else 0)
        gemm.block_gemm_accumulate = counting
        try:
            for step in range(steps):
                ddp.zero_grad_buffer()
                calls.clear()
                for tokens in batches:
                    ddp(tokens, pos, None, labels=tokens).float().mean().backward()
                flags = [w.grad_added_to_main_grad for w in fused_weights]
                flags.append(model.output_layer.weight.grad_added_to_main_grad)  # megatron's BF16 LM head
                flags.append(model.embedding.word_embeddings.weight.grad_added_to_main_grad)  # the input embedding
                assert all(flags) if fuse else not any(flags)
                assert len(calls) == (len(batches) * len(fused_weights) if fuse else 0)
                assert all(p.grad is None for p in model.parameters())  # placeholders dropped by the hook
                grads[fuse, step] = {n: p.main_grad.clone() for n, p in model.named_parameters()}
        finally:
            gemm.block_gemm_accumulate = real
    return grads, fused_weights


def test_fp8_wgrad_accumulates_into_megatron_main_grad(megatron_single):
    """precision.fuse_wgrad_accumulation under megatron's real DDP (gloo, CPU): the FP8 wgrad adds its fp32
    product straight into each weight's ``main_grad`` and marks ``grad_added_to_main_grad``, so megatron's
    backward hook drops the placeholder gradient instead of adding it a second time. Over two micro-batches
    and two steps every ``main_grad`` equals the unfused path's (fp32 parameters: the unfused wgrad is fp32
    too, so the same numbers up to the order of fp32 additions); the fused path ran for the FP8 linears whose
    rows need no permutation and for megatron's BF16 LM head (``models/grad_accum.py``)."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.builder import build_model

    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), ["precision.mode=jet"])
    torch.manual_seed(0)
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), torch.float32,
                               backend="emulated")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.model.vocab_size, (2, 16), generator=g) for _ in range(2)]
    grads, fused = ddp_main_grads_fused_vs_unfused(model, state, batches, torch.arange(16).expand(2, 16))
    assert fused
    for step in range(2):
        for n, ref in grads[False, step].items():
            got = grads[True, step][n]
            assert ref.abs().sum() > 0, n
            assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6), (n, (got - ref).abs().max())


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_gradient_goes_into_main_grad_unless_tied(tied, megatron_single):
    """The untied input embedding's backward adds its rows into ``main_grad`` (``grad_accum._EmbeddingIntoMainGrad``;
    the same main_grads as the dense gradient: checked with the linears in the test above); a weight tied to the
    LM head keeps megatron-core's forward, and switching the fusion off restores it."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.builder import build_model
    from megatron_jetrl.models.grad_accum import enable

    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"),
                      ["precision.mode=bf16", f"model.tie_word_embeddings={str(tied).lower()}"])
    model, _ = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), torch.float32,
                           backend="emulated")
    emb = model.embedding.word_embeddings
    enable(model, True)
    assert ("forward" in emb.__dict__) == (not tied)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 8))
    out = emb(tokens)
    assert torch.equal(out, torch.nn.functional.embedding(tokens, emb.weight))
    assert ("_EmbeddingIntoMainGradBackward" in _graph_names(out)) == (not tied)
    out.sum().backward()  # outside DDP (no main_grad): the dense gradient, as megatron's path gives it
    ref = torch.zeros_like(emb.weight).index_add_(0, tokens.reshape(-1), torch.ones(16, emb.weight.shape[1]))
    assert torch.equal(emb.weight.grad, ref)
    enable(model, False)
    assert "forward" not in emb.__dict__


def test_grad_accum_fusion_probe_follows_device_and_dtype(megatron_single):
    """models/grad_accum.py switches megatron's fusion on only where its torch call runs for the model's
    parameters: fp32 on CPU (``addmm_``) yes, BF16 on CPU (``addmm`` with an fp32 ``out_dtype`` is CUDA-only) no,
    leaving every layer on megatron's plain path."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.models import grad_accum
    from megatron_jetrl.models.builder import build_model

    assert grad_accum.available("cpu", torch.float32) == (True, "")
    ok, why = grad_accum.available("cpu", torch.bfloat16)
    assert not ok and why
    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), ["precision.mode=bf16"])
    for dtype, expect_on in ((torch.bfloat16, False), (torch.float32, True)):
        model, _ = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), dtype, backend="emulated")
        n = grad_accum.enable(model)
        flags = {m.gradient_accumulation_fusion for m in _megatron_linears(model)}
        assert (n > 0) == expect_on and flags == {expect_on}, (dtype, n, flags)


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


def test_gemm_kernel_table_and_deepgemm_availability(tmp_path, monkeypatch):
    """The per-shape kernel table (cuBLAS unless a shape is set to DeepGEMM), its validation, and DeepGEMM's
    availability answers: unset directory, a directory without the build, not CUDA; tuning on CPU changes
    nothing."""
    from megatron_jetrl.kernels import deepgemm
    from megatron_jetrl.precision import gemm

    saved = dict(gemm._KERNELS)
    try:
        assert gemm.kernel_for(256, 4096, 4096) == "cublas"
        gemm.set_kernel(256, 4096, 4096, "deepgemm")
        assert gemm.kernel_for(256, 4096, 4096) == "deepgemm" and gemm.kernel_for(255, 4096, 4096) == "cublas"
        gemm.set_kernel(256, 4096, 4096, "cublas")
        assert (256, 4096, 4096) not in gemm._KERNELS
        with pytest.raises(ValueError, match="cublas or deepgemm"):
            gemm.set_kernel(1, 2, 3, "cutlass")
        # a table entry never reaches the emulated backend: the same result as without it
        recipe = FP8Recipe()
        xq, xs = quantize_act(torch.randn(8, 256), recipe)
        qw, sw = quantize_weight(torch.randn(128, 256), recipe)
        ref = block_gemm(xq, xs, qw, sw, "emulated")
        gemm.set_kernel(8, 128, 256, "deepgemm")
        assert torch.equal(block_gemm(xq, xs, qw, sw, "emulated"), ref)
        assert gemm.tune_kernels(256, {(128, 256): [(qw, sw)]}) == {}  # CPU: nothing timed, nothing set
    finally:
        gemm._KERNELS.clear()
        gemm._KERNELS.update(saved)
    monkeypatch.delenv(deepgemm.ENV_DIR, raising=False)
    ok, why = deepgemm.available(torch.device("cpu"))
    assert not ok and "JETRL_DEEPGEMM_DIR is unset" in why and "build_deepgemm_sm90.py" in why
    monkeypatch.setenv(deepgemm.ENV_DIR, str(tmp_path))
    assert deepgemm.available(torch.device("cpu")) == (False, "device is not CUDA")
    with pytest.raises(deepgemm.DeepGemmUnavailable, match="holds no libjetrl_deepgemm_sm90.so"):
        deepgemm._lib(str(tmp_path))
    a = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    assert deepgemm.takes(a, torch.zeros(1024, 512, dtype=torch.float8_e4m3fn), torch.bfloat16)
    assert not deepgemm.takes(a, torch.zeros(1000, 512, dtype=torch.float8_e4m3fn), torch.bfloat16)  # N % 64
    assert not deepgemm.takes(a, torch.zeros(1024, 512, dtype=torch.float8_e4m3fn), torch.float32)
    assert not deepgemm.takes(a[:, :384], torch.zeros(1024, 384, dtype=torch.float8_e4m3fn), torch.bfloat16)


def test_deepgemm_build_plans_every_gemm_of_a_preset():
    """The build script's ahead-of-time shape list: every decode row count for each linear, and at every
    training micro-batch the forward, dgrad and wgrad forms; bad input names the flag."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "build_deepgemm_sm90.py"
    spec = importlib.util.spec_from_file_location("build_deepgemm_sm90", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    shapes = set(mod.preset_shapes(["llama3.1-8b"], decode_m=[64, 256], tokens=[8192]))
    for n, k in mod.PRESET_LINEARS["llama3.1-8b"]:
        assert {(64, n, k), (256, n, k), (8192, n, k), (8192, k, n), (n, k, 8192)} <= shapes
    assert len(shapes) == len(set(shapes))
    with pytest.raises(SystemExit, match="unknown 'llama9'"):
        mod.preset_shapes(["llama9"])
    with pytest.raises(SystemExit, match="--precompile: 'x' is not M:N:K"):
        mod.main(["--skip-library", "--out", "/nonexistent", "--precompile", "x", "--nvcc", "sh"])
    with pytest.raises(SystemExit, match="--skip-library: no /nonexistent/libjetrl_deepgemm_sm90.so"):
        mod.main(["--skip-library", "--out", "/nonexistent", "--precompile", "1:128:128", "--nvcc", "sh"])
    with pytest.raises(SystemExit, match="--flashinfer: required"):
        mod.main(["--out", "/nonexistent", "--nvcc", "sh"])
    with pytest.raises(SystemExit, match="--nvcc: no-such-nvcc not found"):
        mod.main(["--out", "/nonexistent", "--nvcc", "no-such-nvcc"])
