"""CUDA only: cuBLAS's block-FP8 GEMM, the small-M Triton GEMM, the cuBLASLt accumulation, DeepGEMM."""
import pytest
import torch
from megatron_jetrl.precision.gemm import block_gemm
from megatron_jetrl.precision.linear import FP8LinearFunction
from megatron_jetrl.precision.quant import quantize_act, quantize_transposed, quantize_weight
from megatron_jetrl.precision.recipe import FP8Recipe

from tests.common import deepgemm_or_skip, same_bytes, gpu_input

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("M,N,K", [(256, 512, 384), (1024, 4096, 4096), (77, 300, 200)])
def test_scaled_mm_matches_emulated_fwd_dgrad_wgrad(M, N, K):
    recipe = FP8Recipe()
    x, w, dy = gpu_input((M, K)), gpu_input((N, K), seed=1) * 0.02, gpu_input((M, N), seed=2)
    xq, xs = quantize_act(x, recipe)
    wq, ws = quantize_weight(w, recipe)
    dyq, dys = quantize_act(dy, recipe)
    dytq, dyts = quantize_transposed(dy, recipe, False)
    xtq, xts = quantize_transposed(xq, recipe, True, x_scale=xs)
    for a, a_s, b, b_s in ((xq, xs, wq, ws), (dyq, dys, wq.t(), ws.t()), (dytq, dyts, xtq, xts)):
        ref = block_gemm(a, a_s, b, b_s, "emulated", torch.float32)
        out = block_gemm(a, a_s, b, b_s, "scaled_mm", torch.float32)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-3


def test_fp8_linear_scaled_mm_vs_emulated():
    recipe = FP8Recipe()
    x = gpu_input((512, 1024)).requires_grad_()
    w = (gpu_input((768, 1024), seed=3) * 0.02).requires_grad_()
    qw, sw = quantize_weight(w.detach(), recipe)
    grads = {}
    for backend in ("scaled_mm", "emulated"):
        x.grad = w.grad = None
        y = FP8LinearFunction.apply(x, w, qw, sw, None, None, recipe, backend)
        y.float().square().sum().backward()
        grads[backend] = (y.detach().float(), x.grad.float(), w.grad.float())
    for a, b in zip(grads["scaled_mm"], grads["emulated"]):
        assert ((a - b).norm() / b.norm()).item() < 1e-2


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (16, 14336, 4096), (64, 4096, 14336), (256, 1024, 300),
                                   (7, 1000, 1300)])
def test_small_m_triton_gemm_bytes_and_result(M, N, K, scale_fmt):
    """The fused small-M kernel quantizes x to the torch rule's bytes and computes the same GEMM, to
    bf16 rounding: Hopper's FP8 tensor-core accumulator keeps fewer bits than fp32 inside each
    128-wide K step (the kernel promotes to fp32 per step, as cuBLAS does), so the bound is the one
    scaled_mm meets (measured 1.2e-4), not fp32's."""
    from megatron_jetrl.kernels.triton_gemm import small_m_linear

    recipe = FP8Recipe(scale_fmt=scale_fmt)
    x = gpu_input((M, K))
    qw, sw = quantize_weight(gpu_input((N, K), seed=1) * 0.02, recipe)
    y, q, s = small_m_linear(x, qw, sw, recipe, torch.float32, return_quantized=True)
    q_r, s_r = quantize_act(x, recipe, use_triton=False)
    assert same_bytes(q, q_r) and torch.equal(s, s_r)
    ref = block_gemm(q_r, s_r, qw, sw, "emulated", torch.float32)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-3
    y_bf16 = small_m_linear(x.bfloat16(), qw, sw, recipe)  # the rollout's call: bf16 in, bf16 out
    assert ((y_bf16.float() - ref).norm() / ref.norm()).item() < 4e-3


@pytest.mark.parametrize("swap,tma", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (16, 14336, 4096), (64, 4096, 14336), (256, 1024, 512),
                                   (200, 1000, 1312), (7, 1000, 1300)])
def test_small_m_gemm_layouts_agree(M, N, K, swap, tma):
    """The swapped-operand layout and the TMA loads compute the plain kernel's GEMM from the same bytes:
    equal to the dequantized reference within the FP8 tensor-core accumulator's bound (the same bound as
    test_small_m_triton_gemm_bytes_and_result), and to the plain kernel within twice that."""
    from megatron_jetrl.kernels.triton_gemm import small_m_linear
    from megatron_jetrl.kernels.triton_quant import quantize_act_triton

    recipe = FP8Recipe()
    x = gpu_input((M, K))
    qw, sw = quantize_weight(gpu_input((N, K), seed=1) * 0.02, recipe)
    xq = quantize_act_triton(x, recipe)
    ref = block_gemm(xq[0], xq[1].t().contiguous().t(), qw, sw, "emulated", torch.float32)
    plain = small_m_linear(x, qw, sw, recipe, torch.float32, xq=xq, swap=False, tma=False)
    for split in (None, 1, 3):
        y = small_m_linear(x, qw, sw, recipe, torch.float32, xq=xq, swap=swap, tma=tma, split_k=split)
        assert ((y - ref).norm() / ref.norm()).item() < 1e-3, split
        assert ((y - plain).norm() / ref.norm()).item() < 2e-3, split
    y_bf16 = small_m_linear(x.bfloat16(), qw, sw, recipe, swap=swap, tma=tma)  # x quantized inside
    assert ((y_bf16.float() - ref).norm() / ref.norm()).item() < 4e-3


@pytest.mark.parametrize("M", [16, 64])
def test_small_m_gemm_with_fused_swiglu_equals_swiglu_then_gemm(M):
    """fc2 at decode sizes: the small-M GEMM fed by the fused SwiGLU quantizer gives the bytes of
    torch's SwiGLU followed by the same GEMM (same activation bytes, same kernel and plan)."""
    from megatron_jetrl.precision.quant import swiglu
    from megatron_jetrl.kernels.triton_gemm import small_m_linear

    recipe = FP8Recipe()
    gu = gpu_input((M, 2 * 14336))
    qw, sw = quantize_weight(gpu_input((4096, 14336), seed=1), recipe)
    fused = small_m_linear(gu, qw, sw, recipe, swiglu=True)
    ref = small_m_linear(swiglu(gu), qw, sw, recipe, prequant=True)
    assert same_bytes(fused, ref)


@pytest.mark.parametrize("M,N,K", [(64, 4096, 4096), (16, 4096, 14336), (64, 6144, 4096), (40, 1000, 3000)])
def test_small_m_fused_split_sum_equals_two_kernels(M, N, K):
    """Split-K partials summed by each tile's last program (a per-tile counter, acq_rel atomics) give
    the bytes of the separate sum kernel, over 50 back-to-back calls and 50 CUDA-graph replays (a
    missed partial or a stale read would show), and leave the counters at zero."""
    from megatron_jetrl.kernels.triton_gemm import _LOCKS, plan, small_m_linear

    recipe = FP8Recipe()
    x = gpu_input((M, K))
    qw, sw = quantize_weight(gpu_input((N, K), seed=1), recipe)
    assert plan(M, N, K, 128, x.device)[2] > 1  # the default plan splits K here
    ref = small_m_linear(x, qw, sw, recipe, fused_sum=False)
    outs = [small_m_linear(x, qw, sw, recipe, fused_sum=True) for _ in range(50)]
    assert all(same_bytes(o, ref) for o in outs)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        small_m_linear(x, qw, sw, recipe, fused_sum=True)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        y = small_m_linear(x, qw, sw, recipe, fused_sum=True)
    for _ in range(50):
        g.replay()
        assert same_bytes(y, ref)
    torch.cuda.synchronize()
    assert all(int(b.abs().sum()) == 0 for b in _LOCKS.values())


@pytest.mark.parametrize("T,N,K", [(512, 768, 1024), (4096, 4096, 4096), (2048, 6144, 4096), (4096, 1024, 14336)])
def test_cublaslt_wgrad_accumulates_into_fp32(T, N, K):
    """kernels/cublaslt.py: the FP8 wgrad GEMM with beta = 1 into an fp32 buffer adds the same product as
    the emulated GEMM and as torch's scaled_mm (same operands, same scales), and accumulates on repeat."""
    from megatron_jetrl.kernels import cublaslt
    from megatron_jetrl.precision.gemm import accumulate_supported, block_gemm_accumulate

    assert cublaslt.available() == (True, "")
    recipe = FP8Recipe()
    x, dy = gpu_input((T, K)), gpu_input((T, N), seed=2)
    xq, xs = quantize_act(x, recipe)
    dytq, dyts = quantize_transposed(dy, recipe, False)
    xtq, xts = quantize_transposed(xq, recipe, True, x_scale=xs)
    ref = block_gemm(dytq, dyts, xtq, xts, "emulated", torch.float32)
    torch_mm = block_gemm(dytq, dyts, xtq, xts, "scaled_mm", torch.float32)
    base = torch.randn(N, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    out = base.clone()
    assert accumulate_supported(dytq, xtq, out, "scaled_mm")
    block_gemm_accumulate(dytq, dyts, xtq, xts, out, "scaled_mm")
    got = out - base
    assert ((got - ref).norm() / ref.norm()).item() < 1e-3
    assert ((got - torch_mm).norm() / torch_mm.norm()).item() < 1e-5
    block_gemm_accumulate(dytq, dyts, xtq, xts, out, "scaled_mm")
    assert (((out - base) - 2 * ref).norm() / (2 * ref).norm()).item() < 1e-3
    assert not accumulate_supported(dytq[:, :300], xtq[:, :300], out, "scaled_mm")  # ragged tokens: unfused path


@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (7, 256, 512), (77, 1024, 256), (256, 4096, 14336),
                                   (300, 14336, 4096)])
def test_deepgemm_matches_dequantized_reference(M, N, K, kernel_table):
    """DeepGEMM's kernel on the FP8 linear's operands gives the dequantized fp32 product to BF16 rounding and
    agrees with cuBLAS's as closely; through ``block_gemm`` (the per-shape table) both the forward form and the
    dgrad form (``b`` a transposed view, made K-major first) run it; a CUDA-graph replay equals the eager call."""
    dg = deepgemm_or_skip()
    recipe = FP8Recipe()
    xq, xs = quantize_act(gpu_input((M, K)), recipe, scale_col_major=True)
    qw, sw = quantize_weight(gpu_input((N, K), seed=1) * 0.02, recipe)
    ref = block_gemm(xq, xs, qw, sw, "emulated", torch.float32)
    out = dg.gemm(xq, xs, qw, sw)
    cub = block_gemm(xq, xs, qw, sw, "scaled_mm")
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    assert rel(out, ref) < 4e-3 and rel(out, cub) < 6e-3
    kernel_table.set_kernel(M, N, K, "deepgemm")
    assert torch.equal(block_gemm(xq, xs, qw, sw, "scaled_mm"), out)
    # dgrad form: b = W^T as a view of a [K, N] weight's FP8 blocks
    wt_q, wt_s = quantize_weight(gpu_input((K, N), seed=2) * 0.02, recipe)
    kernel_table.set_kernel(M, N, K, "cublas")
    d_cub = block_gemm(xq, xs, wt_q.t(), wt_s.t(), "scaled_mm")
    kernel_table.set_kernel(M, N, K, "deepgemm")
    d_dg = block_gemm(xq, xs, wt_q.t(), wt_s.t(), "scaled_mm")
    assert rel(d_dg, d_cub) < 6e-3
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g):
        y = block_gemm(xq, xs, qw, sw, "scaled_mm")
    torch.cuda.current_stream().wait_stream(s)
    x2q, x2s = quantize_act(gpu_input((M, K), seed=3), recipe, scale_col_major=True)
    xq.copy_(x2q)
    xs.copy_(x2s)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, dg.gemm(xq, xs, qw, sw))
