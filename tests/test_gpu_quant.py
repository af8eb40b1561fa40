"""CUDA only: the Triton quantizers and SwiGLU kernels, bytes and scales equal to the torch statements."""
import pytest
import torch
from megatron_jetrl.precision.quant import quantize_act, quantize_transposed, quantize_weight
from megatron_jetrl.precision.recipe import FP8Recipe

from tests.common import same_bytes, gpu_input

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("shape", [(7, 300), (4096, 4096), (3000, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_act_quant_bit_identical(shape, scale_fmt, dtype):
    from megatron_jetrl.kernels.triton_quant import quantize_act_triton

    recipe = FP8Recipe(scale_fmt=scale_fmt)
    x = gpu_input(shape, dtype)
    q_t, s_t = quantize_act(x, recipe, use_triton=True)
    q_r, s_r = quantize_act(x, recipe, use_triton=False)
    assert same_bytes(q_t, q_r) and torch.equal(s_t, s_r)
    q_c, s_c = quantize_act(x, recipe, use_triton=True, scale_col_major=True)
    assert s_c.stride() == (1, shape[0]) and torch.equal(s_c, s_r) and same_bytes(q_c, q_r)
    for plan in ((4, 1, 4), (16, 4, 4), (32, 8, 8), (8, 2, 4, 1)):  # every launch plan: the same bytes
        q_p, s_p = quantize_act_triton(x, recipe, scale_col_major=True, plan=plan)
        assert torch.equal(s_p, s_r) and same_bytes(q_p, q_r), plan


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("tile", [False, True])
@pytest.mark.parametrize("shape", [(300, 200), (1024, 2048)])
def test_triton_transposed_quant_bit_identical(shape, tile, scale_fmt):
    """The transposed quantizer (wgrad operands), also with the token dimension padded to 512 in its own
    buffers (``pad_to``: zero bytes, scale 1)."""
    recipe = FP8Recipe(scale_fmt=scale_fmt)
    x = gpu_input(shape)
    xq, xs = quantize_act(x, recipe)  # from saved FP8 activations
    for pad in (0, 512):
        q_t, s_t = quantize_transposed(x, recipe, tile, use_triton=True, pad_to=pad)
        q_r, s_r = quantize_transposed(x, recipe, tile, use_triton=False, pad_to=pad)
        assert same_bytes(q_t, q_r) and torch.equal(s_t, s_r) and q_t.shape[1] == -(-shape[0] // (pad or 1)) * (pad or 1)
        q_t, s_t = quantize_transposed(xq, recipe, tile, x_scale=xs, use_triton=True, pad_to=pad)
        q_r, s_r = quantize_transposed(xq, recipe, tile, x_scale=xs, use_triton=False, pad_to=pad)
        assert same_bytes(q_t, q_r) and torch.equal(s_t, s_r)


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("shape", [(300, 200), (4096, 14336), (128, 128)])
def test_triton_weight_quant_bit_identical(shape, scale_fmt):
    recipe = FP8Recipe(scale_fmt=scale_fmt)
    w = gpu_input(shape) * 0.02
    q_t, s_t = quantize_weight(w, recipe, use_triton=True)
    q_r, s_r = quantize_weight(w, recipe, use_triton=False)
    assert same_bytes(q_t, q_r) and torch.equal(s_t, s_r)


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,F", [(4096, 14336), (33, 300)])
def test_fused_swiglu_quant_bit_identical(M, F, dtype, scale_fmt):
    """The fused SwiGLU + 1x128 quantizer writes the bytes and scales of torch's SwiGLU (silu then
    mul, each rounded to the input dtype) followed by the torch statement of the quantizer."""
    from megatron_jetrl.precision.quant import quantize_swiglu, swiglu

    recipe = FP8Recipe(scale_fmt=scale_fmt)
    y = gpu_input((M, 2 * F), dtype) * 2
    q, s = quantize_swiglu(y, recipe)
    q_r, s_r = quantize_act(swiglu(y), recipe, use_triton=False)
    assert same_bytes(q, q_r) and torch.equal(s, s_r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,F", [(4096, 14336), (33, 300)])
def test_one_kernel_swiglu_equals_eager(M, F, dtype):
    """The BF16 MLP's SwiGLU (``quant.swiglu_fused``: one Triton pass forward, the fused backward) writes the
    bytes of torch's eager ``silu(gate) * up`` and its gradient is ``swiglu_backward``'s."""
    from megatron_jetrl.precision.quant import swiglu, swiglu_backward, swiglu_fused

    y = (gpu_input((M, 2 * F), dtype) * 2).requires_grad_()
    a = swiglu_fused(y)
    assert a.dtype == dtype and torch.equal(a, swiglu(y.detach()))
    da = gpu_input((M, F), dtype, seed=1)
    a.backward(da)
    assert torch.equal(y.grad, swiglu_backward(y.detach(), da))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,F", [(4096, 14336), (33, 300)])
def test_swiglu_backward_kernel_equals_torch(M, F, dtype):
    """The fused SwiGLU backward (one Triton pass) vs its torch fp32 statement: same fp32 operations
    in the same order (libdevice expf, IEEE division, no FMA), so equal bytes but for exp's last bit
    at rare elements: at most one unit of the output dtype's last place anywhere."""
    from megatron_jetrl.precision.quant import swiglu_backward

    y = gpu_input((M, 2 * F), dtype) * 2
    da = gpu_input((M, F), dtype, seed=1)
    out = swiglu_backward(y, da)
    ref = swiglu_backward(y, da, use_triton=False)
    same = (out == ref).float().mean().item()
    print(f"swiglu backward {M}x{F} {dtype}: {100 * same:.4f}% of elements bit-equal")
    assert same > 0.999
    ulp = torch.finfo(dtype).eps * ref.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((out.float() - ref.float()).abs() <= ulp).all()


@pytest.mark.parametrize("shape", [(14336, 4096), (300, 77), (4096, 128)])
def test_fp8_transpose_kernel_bytes(shape):
    """dgrad's K-major weight copy: the Triton transpose's bytes equal torch's strided copy."""
    from megatron_jetrl.kernels.triton_quant import transpose_bytes_triton

    q, _ = quantize_weight(gpu_input(shape), FP8Recipe())
    t = transpose_bytes_triton(q)
    assert t.is_contiguous() and same_bytes(t, q.t().contiguous())


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,N", [(4096, 6144), (4096, 28672), (300, 200), (77, 4096)])
def test_dual_gradient_quantizer_bit_identical(M, N, dtype, scale_fmt):
    """The backward's one-pass gradient quantizer: the torch statements' bytes and scales for both operands
    (1x128 along N with column-major scales for dgrad, 1x128 along the tokens transposed for wgrad)."""
    from megatron_jetrl.precision.quant import quantize_dual

    recipe = FP8Recipe(scale_fmt=scale_fmt)
    d = gpu_input((M, N), dtype, seed=2)
    q, s, qt, st = quantize_dual(d, recipe, scale_col_major=True)
    qr, sr = quantize_act(d, recipe, use_triton=False)
    qtr, str_ = quantize_transposed(d, recipe, False, use_triton=False)
    assert same_bytes(q, qr) and torch.equal(s, sr) and s.stride() == (1, M)
    assert same_bytes(qt, qtr) and torch.equal(st, str_)
    qtp, stp = quantize_dual(d, recipe, scale_col_major=True, pad_to=512)[2:]  # wgrad operand padded to 512 tokens
    qtrp, strp = quantize_transposed(d, recipe, False, use_triton=False, pad_to=512)
    assert same_bytes(qtp, qtrp) and torch.equal(stp, strp) and qtp.shape[1] % 512 == 0
