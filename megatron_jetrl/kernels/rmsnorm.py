"""RMSNorm as one Triton kernel per call on CUDA, used by training and rollout alike.

torch's ``rms_norm`` (what megatron-core's ``WrappedTorchNorm`` builds) ran as about seven kernels
per call inside our CUDA-graph-captured decode step on the H200 (pow, mean, add, rsqrt, products,
casts: 65 norms per step of a 32-layer model were ~450 launches, ~15% of the step). ``JetRMSNorm``
is a ``torch.nn.RMSNorm`` (same parameter, same state dict, same math as torch's fused CUDA
``rms_norm``: ``(x32 * rsqrt(mean(x32^2) + eps) * w32).to(dtype)``, one rounding) whose CUDA forward
is one kernel with one program per row (a pass over the row in fp32; the sum of squares reduced in
the kernel's own fixed order). A row's result depends only on that row, not on how many rows
the call has, so the trainer's forward (thousands of rows) and the rollout's decode step (one row
per sequence) produce the same bytes for the same hidden state: the norms add no train-rollout
mismatch. The backward is one Triton pass too (fp32, from the saved input and per-row ``rstd``;
the weight's gradient summed from per-program partials).

CPU (tests, the embedded run) keeps torch's ``rms_norm``; the CPU tests run these kernels under Triton's
interpreter.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from megatron_jetrl.kernels.triton_quant import act_outputs, quantize_store_groups, rows_2d
from megatron_jetrl.env import triton_interpreted


def rmsnorm_forward(x2: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2 [M, N]`` (unit stride along N) -> (y [M, N] in x's dtype, rstd [M] fp32)."""
    _, y, _, rstd = _launch(x2, None, weight, eps, None)
    return y, rstd


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = rows_2d(x)
        y, rstd = rmsnorm_forward(x2, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dy2 = dy.reshape(-1, x2.shape[-1])
        if x2.is_cuda or triton_interpreted():
            dx, dw = rmsnorm_backward(x2, dy2, weight, rstd)
            return dx.view(dy.shape), dw, None
        dy2 = dy2.float()
        n = x2.float() * rstd[:, None]
        g = dy2 * weight.float()
        dx = rstd[:, None] * (g - n * (g * n).mean(-1, keepdim=True))
        dw = (dy2 * n).sum(0)
        return dx.to(x2.dtype).view(dy.shape), dw.to(weight.dtype), None


@triton.jit
def _rmsnorm_bwd_kernel(x_ptr, dy_ptr, w_ptr, rstd_ptr, dx_ptr, dwp_ptr, M, N, stride_x, stride_dy, stride_dx,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS rows: dx = rstd * (g - n * mean(g * n)) with n = x * rstd, g = dy * w (fp32), and this
    program's partial sum of dy * n for dw."""
    pid = tl.program_id(0).to(tl.int64)  # 64-bit row offsets (a scalar per row: free)
    cols = tl.arange(0, BLOCK)
    cm = cols < N
    w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        mask = cm & ((tl.zeros((BLOCK,), tl.int32) + row) < M)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(rstd_ptr + tl.minimum(row, M - 1))  # rows past M are masked out below
        n = x * r
        g = dy * w
        c = tl.sum(g * n, axis=0) / N
        tl.store(dx_ptr + row * stride_dx + cols, (r * (g - n * c)).to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * n
    tl.store(dwp_ptr + pid * N + cols, dw, mask=cm)


def rmsnorm_backward(x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's backward in one pass over (x, dy) (plus a sum of per-program dw partials): the
    same fp32 math as the torch statement in ``RMSNormFunction.backward``, which ran as ~10 eager
    fp32 kernels over [tokens x hidden] per norm."""
    M, N = x2.shape
    dy2 = dy2 if dy2.stride(-1) == 1 else dy2.contiguous()
    dx = torch.empty_like(x2)
    rows = max(1, triton.cdiv(M, 1024))
    nprog = triton.cdiv(M, rows) if M else 0
    dwp = torch.empty((nprog, N), dtype=torch.float32, device=x2.device)
    if M:
        block = triton.next_power_of_2(N)
        _rmsnorm_bwd_kernel[(nprog,)](x2, dy2, weight, rstd, dx, dwp, M, N, x2.stride(0), dy2.stride(0), dx.stride(0),
                                      ROWS=rows, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return dx, dwp.sum(0).to(weight.dtype)


@triton.jit
def _rmsnorm_kernel(h_ptr, d_ptr, w_ptr, hout_ptr, y_ptr, q_ptr, s_ptr, rstd_ptr, N, stride_h, stride_d,
                    stride_ho, stride_y, stride_q, stride_s, stride_sg, eps, inv_max, fmax, amax_eps, stride_dsplit,
                    HAS_DELTA: tl.constexpr, QUANT: tl.constexpr, UE8M0: tl.constexpr,
                    G: tl.constexpr, NG: tl.constexpr, SPLIT: tl.constexpr):
    """One row, held as an [NG, G] tile (element ``i * G + j``): optional residual add, RMSNorm
    (fp32, one rounding), optional 1x128 quantization (one scale per tile row: the quantizer's
    groups, no reshape of the row). Every variant reduces the sum of squares in the same order, so
    the norm's bytes do not depend on the add or the quantization being fused."""
    row = tl.program_id(0).to(tl.int64)  # 64-bit row offsets (a scalar per row: free)
    offs = tl.arange(0, NG)[:, None] * G + tl.arange(0, G)[None, :]
    mask = offs < N
    x = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0)
    if HAS_DELTA:  # the residual add, rounded as torch's ``h + out`` is
        d = tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0)
        if SPLIT > 1:  # delta = a split-K GEMM's fp32 partials: summed in split order and rounded to the
            # activation dtype, as triton_gemm's sum kernel writes the linear's output
            for sp in tl.static_range(1, SPLIT):
                d += tl.load(d_ptr + sp * stride_dsplit + row * stride_d + offs, mask=mask, other=0.0)
            d = d.to(hout_ptr.dtype.element_ty)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(hout_ptr.dtype.element_ty)
        tl.store(hout_ptr + row * stride_ho + offs, x, mask=mask)
    x = x.to(tl.float32)
    ms = tl.sum(tl.sum(x * x, axis=1), axis=0) / N
    rstd = tl.math.div_rn(tl.full(ms.shape, 1.0, tl.float32), tl.sqrt_rn(ms + eps))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = ((x * rstd) * w).to(y_ptr.dtype.element_ty)  # torch's fused CUDA rms_norm: fp32, one rounding
    tl.store(y_ptr + row * stride_y + offs, y, mask=mask)
    tl.store(rstd_ptr + row, rstd)
    if QUANT:  # the 1x128 activation quantizer's own group rule (triton_quant.py) on the stored values
        quantize_store_groups(y.to(tl.float32), tl.arange(0, NG), tl.arange(0, G), mask, 0,
                               q_ptr + row * stride_q, s_ptr + row * stride_s, N // G, G, stride_sg, 0, inv_max,
                               fmax, amax_eps, UE8M0)


def _launch(h2, d2, weight, eps, recipe, splits: int = 1, scale_col_major: bool = False):
    M, N = h2.shape
    hout = torch.empty_like(h2) if d2 is not None else h2
    y = torch.empty_like(h2)
    rstd = torch.empty(M, dtype=torch.float32, device=h2.device)
    G = recipe.group_size if recipe is not None else 128
    if recipe is not None and N % G:
        raise ValueError(f"add_rmsnorm_quant: hidden size {N} is not a multiple of the group {G}")
    if recipe is not None:
        q, s, _ = act_outputs(M, N, recipe, h2.device, scale_col_major)
    else:
        q = s = y
    if M:
        ng = triton.next_power_of_2(triton.cdiv(N, G))
        block = ng * G
        fmax = recipe.fp8_max if recipe is not None else 448.0
        _rmsnorm_kernel[(M,)](
            h2, d2 if d2 is not None else h2, weight, hout, y, q, s, rstd, N, h2.stride(0),
            d2.stride(-2) if d2 is not None else 0, hout.stride(0), y.stride(0), q.stride(0), s.stride(0),
            s.stride(1) if recipe is not None else 0, eps,
            1.0 / fmax, fmax, recipe.amax_eps if recipe is not None else 1e-12,
            d2.stride(0) if splits > 1 else 0, HAS_DELTA=d2 is not None, SPLIT=splits,
            QUANT=recipe is not None, UE8M0=recipe is not None and recipe.scale_fmt == "ue8m0", G=G, NG=ng,
            num_warps=min(16, max(1, block // 256)), enable_fp_fusion=False,)  # no FMA: torch's roundings
    return hout, y, ((q, s) if recipe is not None else None), rstd


def add_rmsnorm_quant(h: torch.Tensor, delta, weight: torch.Tensor, eps: float, recipe=None, delta_splits: int = 1,
                      scale_col_major: bool = False):
    """Inference (no autograd), CUDA: ``h2 = h + delta`` (when ``delta`` is given) and
    ``y = JetRMSNorm(h2)``, and with a ``recipe`` also ``quantize_act(y)`` (1x128 groups; row-major
    scales, or column-major, strides (1, rows), the layout cuBLAS's ``scaled_mm`` reads, with
    ``scale_col_major``), in one kernel. Returns ``(h2, y, (q, scale_inv) or None)``: the same bytes as the
    separate add, norm kernel and activation quantizer (tests). Needs the hidden size a multiple
    of the recipe's group when quantizing. ``delta_splits > 1``: ``delta`` is a split-K GEMM's fp32
    partials ``[splits, tokens, N]`` (``triton_gemm.small_m_linear(..., return_partials=True)``),
    summed here exactly as its sum kernel would (same bytes, one launch less)."""
    shape, N = h.shape, h.shape[-1]
    h2 = rows_2d(h)
    if delta is None:
        d2 = None
    elif delta_splits > 1:
        d2 = delta.reshape(delta_splits, -1, N).contiguous()
        if d2.dtype != torch.float32 or d2.shape[1] != h2.shape[0]:
            raise ValueError(f"add_rmsnorm_quant: split-K partials {tuple(delta.shape)} {delta.dtype} do not "
                             f"match h {tuple(h.shape)}")
    else:
        d2 = delta.reshape(-1, N)
        if d2.stride(-1) != 1:
            d2 = d2.contiguous()
    hout, y, xq, _ = _launch(h2, d2, weight, eps, recipe, delta_splits, scale_col_major)
    return hout.view(shape), y.view(shape), xq
