"""Exact-mode GEMMs: a row's output bits do not depend on how many rows the call has (``precision.exact`` on
CUDA; Triton).

cuBLAS and the small-M decode GEMM pick tiles and split-K by the row count M, so the decoder's 64-row GEMM and
the trainer's 4,608-row GEMM sum a row's products in different orders (measured on the H200: fc2's K = 14336 at
M <= 16, BF16 at M <= 16, the small-M kernel at every M; ``H200_FP8_FACTS.md``). Here the order is a function
of the weight's shape alone:

- K is cut into ``S = segments(N, K)`` contiguous segments of whole ``G``-wide groups (the FP8 block, 128;
  64 for BF16); inside a segment the groups are accumulated in order in fp32 (FP8: ``acc = fma(dot(xq, wq),
  x_scale * w_scale, acc)`` per group, the block-scaled promotion: one rounding of the scale product, one of the
  fused multiply-add; BF16: one chain of tensor-core MMAs over the segment's groups into one fp32 accumulator),
  then the segments' sums are added in segment order:
  ``((seg_0 + seg_1) + seg_2) + ...``, and the total is rounded once to the output dtype;
- the tile plan (the rows and columns a program owns, its warps and stages) does not enter the order: a row's
  products within a group (BF16: a segment) are a chain of the same tensor-core instructions in every plan.
  That part is a property of the hardware, measured, not constructed: on the H200 every plan of
  ``tools/exact_bench.py`` gave the same bytes, and ``tests/test_gpu_exact.py`` compares the decoder's and the
  trainer's row counts (which run different plans for BF16). M is not specialized on (a 1-row call is the same
  binary);
- few row tiles (decode) leave SMs idle: each segment then runs in its own program and writes its fp32 sum,
  and ``triton_gemm.sum_partials`` adds them in segment order; many row tiles (training) run the segments one
  after another in the program (each a decode program's loop) and add each sum to the total as it ends. Both are
  the same additions in the same order: the same bits (tested). The inner loop over a segment's groups is the
  software-pipelined one (TMA loads stages ahead; BF16: asynchronous MMAs), with nothing but the promotion in it.

``S`` is chosen for the decode grid (about one program per SM for a tile row: ``num_sms // (N / 128)``,
at most a segment per 4 groups), from N, K and the GPU only. Runs under ``TRITON_INTERPRET=1`` (the tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from megatron_jetrl.kernels.triton_gemm import num_sms, sum_partials

SEGMENT_TILE_N = 128  # the N tile the segment count is sized for (numerics: fixed, whatever the plan)
BF16_GROUP = 64
USE_TMA = True
# Tile plans (BLOCK_M, BLOCK_N, warps, stages) by grid size (tools/exact_bench.py, docs/benchmarks.md; every plan
# gives the same bits): the small ones at the decoder's 64 rows (H200), the large ones at a training micro-batch's
# 4,608 rows (H100, 2026-12-05: FP8 128 x 128 tiles 7% faster than 64 x 128 over the four 8B weights; the LM head's
# 128 x 256 tiles 7.29 ms against 9.97 ms with 128 x 128, cuBLAS 7.08 ms).
FP8_PLAN_SMALL = (64, 128, 4, 4)
FP8_PLAN_LARGE = (128, 128, 8, 3)
BF16_PLAN_SMALL = (64, 128, 4, 4)
BF16_PLAN_LARGE = (128, 256, 8, 3)
PLANS = {"fp8": (FP8_PLAN_SMALL, FP8_PLAN_LARGE), "bf16": (BF16_PLAN_SMALL, BF16_PLAN_LARGE)}


@triton.jit(do_not_specialize=["M"])
def _exact_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, y_ptr, M, N, K, per_seg,
                       stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_ys, stride_ym,
                       G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUM_SEGS: tl.constexpr,
                       FP8: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)  # SUM_SEGS off: this program's segment (one program per segment)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, G)
    groups = tl.cdiv(K, G)
    if SUM_SEGS:  # every segment, one after another in this program
        s0, s1 = 0, tl.cdiv(groups, per_seg)
    else:  # this program's segment (the decoder's grid: one program per segment)
        s0, s1 = pid_s, pid_s + 1
    total = tl.full((BLOCK_M, BLOCK_N), -0.0, dtype=tl.float32)  # -0 + x = x for every x: the first add is exact
    for seg in range(s0, s1):  # the segments in order; the inner loop is the pipelined one
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # this segment's sum
        for kb in range(seg * per_seg, tl.minimum(seg * per_seg + per_seg, groups)):
            k = kb * G + kk
            if TMA:  # tensor descriptors: bulk copies, out-of-range rows/columns read as 0 (the same values)
                a = a_ptr.load([pid_m * BLOCK_M, kb * G])
                b = b_ptr.load([pid_n * BLOCK_N, kb * G])
            else:
                a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :],
                            mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
                b = tl.load(b_ptr + cols[:, None] * stride_bn + k[None, :],
                            mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0)
            if FP8:  # the block-scaled promotion per group in fp32: acc = fma(dot, x_scale * w_scale, acc)
                part = tl.dot(a, tl.trans(b), out_dtype=tl.float32)
                a_s = tl.load(as_ptr + rows * stride_asm + kb * stride_ask, mask=rows < M, other=0.0)
                if G % BLOCK_N == 0:  # the tile's columns lie in one weight block: one scale
                    b_s = tl.load(bs_ptr + (pid_n * BLOCK_N // G) * stride_bsn + kb)
                    acc = tl.fma(part, (a_s * b_s)[:, None], acc)
                else:
                    b_s = tl.load(bs_ptr + (cols // G) * stride_bsn + kb, mask=cols < N, other=0.0)
                    acc = tl.fma(part, a_s[:, None] * b_s[None, :], acc)
            elif IEEE:  # fp32 operands (CPU tests)
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee", out_dtype=tl.float32)
            else:  # BF16: the segment's groups accumulate in the tensor cores' fp32 accumulator, one chain of MMAs
                acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.float32)
        total += acc
    ym = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(y_ptr + pid_s * stride_ys + rows[:, None] * stride_ym + cols[None, :], total.to(y_ptr.dtype.element_ty),
             mask=ym)


def segments(N: int, K: int, G: int, device: torch.device) -> int:
    """The K segments of every exact GEMM with an ``[N, K]`` weight on ``device`` (see the module docstring)."""
    groups = triton.cdiv(K, G)
    return max(1, min(num_sms(device) // triton.cdiv(N, SEGMENT_TILE_N), groups // 4))


def _tma_ok(*ts: torch.Tensor) -> bool:
    """Tensor descriptors need CUDA, 16-byte aligned bases and row strides, contiguous rows."""
    return all(t.is_cuda and t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in ts)


def _launch(a, a_s, b, b_s, out_dtype, G: int, fp8: bool, split: bool | None,
            config: tuple[int, int, int, int] | None = None, return_partials: bool = False):
    M, K = a.shape
    N = b.shape[0]
    if config is None:
        small, large = PLANS["fp8" if fp8 else "bf16"]
        config = large if triton.cdiv(M, small[0]) * triton.cdiv(N, small[1]) >= 8 * num_sms(a.device) else small
    block_m, block_n, warps, stages = config
    y = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0:
        return (y, 1) if return_partials else y
    S = segments(N, K, G, a.device)
    per = triton.cdiv(triton.cdiv(K, G), S)
    S = triton.cdiv(triton.cdiv(K, G), per)  # segments that hold a group
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    if split is None:  # decode sizes: one program per segment, summed in order
        split = tiles < num_sms(a.device)
    split = split and S > 1
    part = torch.empty((S, M, N), dtype=torch.float32, device=a.device) if split else y
    if a_s is None:
        a_s = b_s = a  # unused (BF16)
    tma = USE_TMA and _tma_ok(a, b)
    at, bt = ((TensorDescriptor.from_tensor(a, [block_m, G]), TensorDescriptor.from_tensor(b, [block_n, G]))
              if tma else (a, b))
    _exact_gemm_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n), S if split else 1)](
        at, a_s, bt, b_s, part, M, N, K, per, a.stride(0), a_s.stride(0) if fp8 else 0, a_s.stride(1) if fp8 else 0,
        b.stride(0), b_s.stride(0) if fp8 else 0, part.stride(0) if split else 0, N,
        G=G, BLOCK_M=block_m, BLOCK_N=block_n, SUM_SEGS=not split and S > 1, FP8=fp8, IEEE=a.dtype == torch.float32,
        TMA=tma, num_warps=warps, num_stages=stages)
    if split:
        if return_partials:
            return part, S
        sum_partials(part, y)
    return (y, 1) if return_partials else y


def exact_block_gemm(xq: torch.Tensor, xs: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
                     out_dtype: torch.dtype, group: int = 128, split: bool | None = None,
                     config: tuple[int, int, int, int] | None = None, return_partials: bool = False):
    """``(xq * xs) @ (qweight * w_scale)^T``: ``xq [M, K]`` fp8 in 1 x ``group`` groups (``xs [M, K/group]``, any
    strides), ``qweight [N, K]`` fp8 in ``group`` x ``group`` blocks (``w_scale [N/group, K/group]``) -> ``[M, N]``
    in ``out_dtype``, the same bits for a row at any M. ``split``: one program per K segment (True) or the
    segments summed in the program (False); None: by the grid's size (the same bits either way). ``config``:
    (BLOCK_M, BLOCK_N, warps, stages) instead of the module's (``tools/exact_bench.py`` compares them).
    ``return_partials``: returns ``(out, segments)``, ``out`` the unsummed fp32 segment sums ``[S, M, N]`` when the
    segments ran in their own programs (``segments`` > 1: for a consumer that adds them in segment order, the
    decoder's add + RMSNorm kernel), else ``(y, 1)``."""
    if qweight.stride(1) != 1:
        qweight = qweight.contiguous()
    if xq.stride(1) != 1:
        xq = xq.contiguous()
    if w_scale.stride(1) != 1:
        w_scale = w_scale.contiguous()
    return _launch(xq, xs, qweight, w_scale, out_dtype, group, True, split, config, return_partials)


def exact_mm(x: torch.Tensor, weight: torch.Tensor, split: bool | None = None,
             config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T`` in ``x``'s dtype (BF16 linears and the LM head in exact mode), fp32
    accumulation, the same bits for a row at any M (``split``: as :func:`exact_block_gemm`'s)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    return _launch(x, None, weight, None, x.dtype, BF16_GROUP, False, split, config)


class ExactLinearFunction(torch.autograd.Function):
    """``y = x @ W^T`` with :func:`exact_mm`'s forward (exact mode's BF16 linears and LM head); the backward is
    the plain one (only the forward's bits must match the rollout's). ``fuse_accum``: the weight gradient is added
    into megatron's fp32 ``main_grad`` by the GEMM (``torch.addmm`` with an fp32 output), under megatron's
    gradient-accumulation-fusion protocol (``grad_added_to_main_grad``; a placeholder for autograd), as
    ``models/grad_accum.py`` does for megatron's own linears."""

    @staticmethod
    def forward(ctx, x, weight, fuse_accum=False):
        ctx.save_for_backward(x, weight)
        ctx.fuse_accum = fuse_accum
        lead = x.shape[:-1]
        return exact_mm(x.reshape(-1, x.shape[-1]), weight).view(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dx = (dy2 @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None, None
        mg = getattr(weight, "main_grad", None)
        if (ctx.fuse_accum and mg is not None and mg.dtype == torch.float32 and mg.shape == weight.shape
                and hasattr(weight, "grad_added_to_main_grad")):
            if x2.dtype == torch.float32:
                mg.addmm_(dy2.t(), x2)
            else:
                torch.addmm(mg, dy2.t(), x2, out_dtype=torch.float32, out=mg)
            weight.grad_added_to_main_grad = True
            dw = (torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty)(
                weight.shape, dtype=weight.dtype, device=weight.device)
            return dx, dw, None
        return dx, (dy2.t() @ x2).to(weight.dtype), None
