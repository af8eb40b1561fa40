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


def test_quantizers_past_2_31_elements():
    """Past 2^31 elements a 32-bit element offset wraps (fc1's [tokens, 2 x 28672] output of a 70B micro-batch from
    37,450 tokens on): over a [37,504 x 57,344] BF16 tensor (2^31 + 3.1M elements) the quantizers, the SwiGLU
    kernels, the byte transpose, the KV quantizer and the RMSNorm kernels write in the last rows (and the last
    token groups of the transposed outputs) what the same kernels write for those rows alone."""
    from megatron_jetrl.kernels import triton_quant as tq
    from megatron_jetrl.kernels.layout import wide_offsets
    from megatron_jetrl.kernels.rmsnorm import add_rmsnorm_quant, rmsnorm_backward
    from megatron_jetrl.precision.quant import kv_rule

    r = FP8Recipe()
    M, N, T = 37504, 57344, 256  # T: the tail compared (two 128-token groups)
    g = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn((M, N), device="cuda", dtype=torch.bfloat16, generator=g)
    assert wide_offsets(y) and not wide_offsets(y[-T:])
    tail = y[-T:].contiguous()

    def eq(a, b):
        return a.shape == b.shape and (same_bytes(a, b) if a.element_size() == 1 else torch.equal(a, b))

    q, s = tq.quantize_act_triton(y, r)
    qt_, st_ = tq.quantize_act_triton(tail, r)
    assert eq(q[-T:], qt_) and eq(s[-T:], st_)
    t = tq.transpose_bytes_triton(q)
    assert eq(t[:, -T:], q[-T:].t().contiguous())
    del t
    q, s, qt, st = tq.quantize_dual_triton(y, r, scale_col_major=True)
    rq, rs, rqt, rst = tq.quantize_dual_triton(tail, r, scale_col_major=True)
    assert eq(q[-T:], rq) and eq(s[-T:], rs) and eq(qt[:, -T:], rqt) and eq(st[:, -2:], rst)
    del q, s, qt, st
    qt, st = tq.quantize_transposed_triton(y, r, tile_scale=False)
    assert eq(qt[:, -T:], rqt) and eq(st[:, -2:], rst)
    del qt, st
    q, s = tq.swiglu_quant_triton(y, r)
    rq, rs = tq.swiglu_quant_triton(tail, r)
    assert eq(q[-T:], rq) and eq(s[-T:], rs)
    del q, s
    a = tq.swiglu_triton(y)
    assert eq(a[-T:], tq.swiglu_triton(tail))
    dy = tq.swiglu_backward_triton(y, a)
    assert eq(dy[-T:], tq.swiglu_backward_triton(tail, a[-T:].contiguous()))
    del a, dy
    kq, ks, kv = tq.kv_qdq_triton(y.view(-1, 8, 128), kv_rule(r), with_bytes=True)
    rkq, rks, rkv = tq.kv_qdq_triton(tail.view(-1, 8, 128), kv_rule(r), with_bytes=True)
    n = rkq.shape[0]
    assert eq(kq[-n:], rkq) and eq(ks[-n:], rks) and eq(kv[-n:], rkv)
    del kq, ks, kv
    h = y.view(-1, 8192)  # RMSNorm over 8192-wide rows: 262,528 of them
    w = torch.rand(8192, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    rows = tail.numel() // 8192
    _, hn, (q, s) = add_rmsnorm_quant(h, None, w, 1e-5, r)
    _, rhn, (rq, rs) = add_rmsnorm_quant(h[-rows:].contiguous(), None, w, 1e-5, r)
    assert eq(hn[-rows:], rhn) and eq(q[-rows:], rq) and eq(s[-rows:], rs)
    del q, s
    rstd = torch.rand(h.shape[0], device="cuda", generator=g) + 0.5
    dx, _ = rmsnorm_backward(h, hn, w, rstd)
    rdx, _ = rmsnorm_backward(h[-rows:].contiguous(), rhn, w, rstd[-rows:].contiguous())
    assert eq(dx[-rows:], rdx)
