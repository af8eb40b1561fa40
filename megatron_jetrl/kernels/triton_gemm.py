"""Block-FP8 GEMM for small M (decode), with the activation quantization fused in (CUDA; Triton).

``y[M, N] = dequant(quant_1x128(x))[M, K] @ dequant(W)[N, K]^T`` for W in 128x128 blocks: one
program owns a [BLOCK_M, BLOCK_N] tile of y and walks K in 128-wide groups; for each group it
quantizes its rows of x exactly as ``quant.quantize_act`` does (same amax, epsilon, scale rule and
saturating E4M3 cast as the Triton quantizer, so the same bytes and scales), multiplies with the
FP8 weight tile on the tensor cores, and accumulates ``dot * x_scale[row] * w_scale[block]`` in
fp32 (the per-128 promotion out of the tensor core's reduced-precision FP8 accumulator). At decode
sizes the weight read dominates: its FP8 tiles come through TMA tensor descriptors, and up to 16 rows
each tile is computed as y^T = W x^T so the weight rows fill the tensor core's wide side. x is
quantized once beforehand from 9 rows up (``prequant``, or given by the op that produced it: ``xq``);
below that, each program re-quantizes its few rows per N tile, which costs compute on a tiny tile
instead of a kernel launch. K is split across programs
when the N tiles alone cannot fill the GPU; the fp32 partials are summed in a fixed split order
(deterministic: same tokens on every run, unlike atomic adds) by the last program of each tile to
finish (a per-tile counter, ``fused_sum``), or by a second kernel (the default: faster on the H200).

Used by the FP8 linear for inference forwards (rollout) with M <= ``precision.small_m_max``
(64 by default, the crossover measured on the H200: ``jetrl bench linear --decode`` prints it), and above it
for the weight shapes the static decoder's tuning found it faster on (``gemm.tune_kernels``); cuBLAS
``scaled_mm`` otherwise. Runs under ``TRITON_INTERPRET=1`` on CPU (the tests do).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.kernels.triton_quant import scale_and_multiplier


@triton.jit
def _small_m_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, q_ptr, s_ptr, M, N, K, groups_per_split,
                    stride_xm, stride_wn, stride_wsn, stride_ys, stride_ym, stride_qm, stride_sm,
                    inv_max, fmax, eps, out_ptr, lock_ptr, G: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, UE8M0: tl.constexpr, STORE_Q: tl.constexpr, NUM_STAGES: tl.constexpr,
                    PREQ: tl.constexpr, SPLIT: tl.constexpr, FUSED_SUM: tl.constexpr, SWAP: tl.constexpr,
                    TMA: tl.constexpr):
    pid_m = tl.program_id(0)  # fastest: the row tiles of one weight tile run together (its bytes hit L2)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, G)
    if SWAP:  # y^T tile = W tile @ x^T: the weight rows fill the MMA's 64/128-row side, the tokens its narrow side
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb0 = pid_k * groups_per_split
    kb1 = tl.minimum(kb0 + groups_per_split, tl.cdiv(K, G))
    for kb in tl.range(kb0, kb1, num_stages=NUM_STAGES):
        k = kb * G + kk
        xm = (rows[:, None] < M) & (k[None, :] < K)
        if PREQ:  # x quantized once beforehand (q_ptr/s_ptr are inputs): FP8 tiles, no re-quantization per N tile
            if TMA:  # q_ptr is a tensor descriptor: one bulk copy per tile, out-of-range rows/columns read as 0
                xq = q_ptr.load([pid_m * BLOCK_M, kb * G])
            else:
                xq = tl.load(q_ptr + rows[:, None] * stride_qm + k[None, :], mask=xm, other=0.0)
            x_scale = tl.load(s_ptr + rows * stride_sm + kb, mask=rows < M, other=0.0)
        else:
            x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=xm, other=0.0).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), eps)
            x_scale, mult = scale_and_multiplier(amax, inv_max, fmax, UE8M0)
            xq = tl.clamp(x * mult[:, None], -fmax, fmax).to(tl.float8e4nv)
        if STORE_Q:  # for tests: the quantized activations, to compare with quant.quantize_act
            if pid_n == 0:
                tl.store(q_ptr + rows[:, None] * stride_qm + k[None, :], xq, mask=xm)
                tl.store(s_ptr + rows * stride_sm + kb, x_scale, mask=rows < M)
        if TMA:  # w_ptr is a tensor descriptor
            w = w_ptr.load([pid_n * BLOCK_N, kb * G])
        else:
            wm = (cols[:, None] < N) & (k[None, :] < K)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + k[None, :], mask=wm, other=0.0)
        w_scale = tl.load(ws_ptr + (cols // G) * stride_wsn + kb, mask=cols < N, other=0.0)
        if SWAP:  # same products and the same fp32 scaling order as below, transposed
            part = tl.dot(w, tl.trans(xq), out_dtype=tl.float32)
            acc += part * x_scale[None, :] * w_scale[:, None]
        else:
            part = tl.dot(xq, tl.trans(w), out_dtype=tl.float32)
            acc += part * x_scale[:, None] * w_scale[None, :]
    if SWAP:
        out = tl.trans(acc)
    else:
        out = acc
    ym = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(y_ptr + pid_k * stride_ys + rows[:, None] * stride_ym + cols[None, :],
             out.to(y_ptr.dtype.element_ty), mask=ym)
    if FUSED_SUM:  # split-K: the last of the tile's programs to finish sums the partials (fixed order)
        tl.debug_barrier()  # every thread's partial is stored before the counter moves (release below)
        tile = pid_n * tl.num_programs(0) + pid_m
        done = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            offs = rows[:, None] * stride_ym + cols[None, :]
            total = tl.load(y_ptr + offs, mask=ym, other=0.0, cache_modifier=".cg")
            for sp in tl.static_range(1, SPLIT):
                total += tl.load(y_ptr + sp * stride_ys + offs, mask=ym, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ym)
            tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next call (and graph replay)


@triton.jit
def _split_sum_kernel(p_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """y = sum over the split-K partials in a fixed order (deterministic, unlike atomics)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# Launch plan (measured on the H200 with the weights cycled past L2, docs/benchmarks.md;
# ``small_m_linear``'s ``swap``/``tma`` arguments override it per call). The swapped layout computes
# y^T = W x^T per tile, so the weight rows, not the few tokens, fill the tensor core's wide side: 1-4%
# faster at M=16, slower from M=64 (2x at M=256), so it is used up to SWAP_MAX_M rows. TMA streams the
# FP8 tiles (weight, pre-quantized x) with the bulk tensor copy engine instead of per-thread loads: 2-13%
# faster at M=64 and 256, never slower.
SWAP_MAX_M = 16
USE_TMA = True


def _tma_ok(q: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Tensor descriptors need 16-byte aligned bases and row strides and contiguous rows."""
    return all(t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and t.stride(0) % 16 == 0 for t in (q, qweight))


_LOCKS: dict = {}


def _locks(device: torch.device, n: int):
    """Zeroed int32 tile counters for the fused split-K sum (each kernel leaves them at zero), one
    buffer per device, grown outside CUDA-graph capture only (None while capturing a graph that
    would need a larger one: the call then sums in a second kernel)."""
    buf = _LOCKS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _LOCKS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132, an H100/H200, where there is none: the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def plan(M: int, N: int, K: int, G: int, device: torch.device, block_n: int | None = None,
         split_k: int | None = None, waves: float | None = None, block_m: int | None = None,
         swap: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, split_k, groups per split) for one call. At decode sizes an N-tile grid
    alone leaves most SMs idle (N=4096 in 128-wide tiles is 32 programs on 132 SMs), so K is split
    until about ``waves`` programs per SM run (``waves`` None: 2 up to 16 rows, 1 above); the fp32
    partials cost M*N*4 bytes per split, small next to the weight while M is small. The defaults are
    the best plans ``tools/tune_small_m.py`` measured on the H200 (docs/benchmarks.md): 128-wide N
    tiles; at M=64 split 4 for N=4096 and none for N >= 14336, at M=16 split 8 / 2 / 1 for
    N = 4096 / 14336 / 28672."""
    block_m = block_m or (16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 or not swap else 128)
    block_n = block_n or 128
    groups = triton.cdiv(K, G)
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    if split_k is None:
        waves = waves or (2.0 if M <= 16 else 1.0)
        split_k = max(1, min(int(waves * num_sms(device)) // tiles, groups // 4))
        if M > 64:  # partials would be a real share of the traffic
            split_k = min(split_k, 2)
    split_k = max(1, min(split_k, groups))
    per = triton.cdiv(groups, split_k)
    return block_m, block_n, triton.cdiv(groups, per), per


def small_m_linear(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, recipe: FP8Recipe,
                   out_dtype: torch.dtype | None = None, return_quantized: bool = False,
                   block_n: int | None = None, split_k: int | None = None, num_stages: int = 4,
                   block_m: int | None = None, prequant: bool | None = None, num_warps: int = 4,
                   swiglu: bool = False, xq: tuple[torch.Tensor, torch.Tensor] | None = None,
                   fused_sum: bool = False, return_partials: bool = False, swap: bool | None = None,
                   tma: bool | None = None):
    """``x [..., K]`` (bf16/fp32) times the cached FP8 weight ``[N, K]`` with ``w_scale``
    ``[ceil(N/128), ceil(K/128)]``; returns y ``[..., N]`` (and, with ``return_quantized``, the
    activation bytes and scales the kernel used, for tests). ``block_n``/``split_k``/``block_m``/
    ``num_stages``/``num_warps`` override the launch plan (``tools/tune_small_m.py`` sweeps them).
    ``prequant``: quantize x once with the Triton activation quantizer and stream FP8 tiles instead
    of re-quantizing x per N tile (None: from 9 rows up, where the H200 sweep found it 1.2-1.8x
    faster at M=64; one kernel launch more). ``swiglu``: x is the MLP's ``[gate | up]`` [..., 2K] and
    the activation is SwiGLU(x), quantized by the fused SwiGLU quantizer (same bytes as SwiGLU then
    the quantizer; always pre-quantized). ``xq``: x's activation bytes and row-major scales
    (``quantize_act``'s) computed by the op that produced x (the decoder's fused add + RMSNorm +
    quantizer, ``kernels/rmsnorm.py``); used as given. ``fused_sum``: with split-K, the last program of
    each output tile sums the fp32 partials in split order (a per-tile counter), instead of a second
    kernel; the same order, so the same bytes either way. Off by default: on the H200 it saved the
    second kernel's launches but the GEMM's own time grew more (8B decode step at batch 64: 2.93 ms
    of small-M kernel time vs 2.50 + 0.18 ms for GEMM + sum kernel, docs/benchmarks.md).
    ``return_partials``: returns ``(out, split)``; with split-K, ``out`` is the unsummed fp32 partials
    ``[split, M, N]`` for a consumer that sums them itself in split order (the decoder's residual add +
    RMSNorm kernel: same bytes as the sum kernel, one launch less), else y and 1. ``swap``: compute each
    tile as y^T = W x^T (None: up to ``SWAP_MAX_M`` rows); ``tma``: load the FP8 weight and pre-quantized x
    tiles through tensor descriptors (None: ``USE_TMA``, where the layouts allow it; otherwise plain loads)."""
    lead, K = x.shape[:-1], x.shape[-1] // 2 if swiglu else x.shape[-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N, G = x2.shape[0], qweight.shape[0], recipe.group_size
    if qweight.shape[1] != K or w_scale.shape != (triton.cdiv(N, G), triton.cdiv(K, G)):
        raise ValueError(f"small_m_linear: weight {tuple(qweight.shape)} / scale {tuple(w_scale.shape)} do not match K={K}")
    y = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if prequant is None:
        prequant = M > 8
    if xq is not None:
        q, s = xq
        prequant = True
        if q.shape != (M, K) or s.shape != (M, triton.cdiv(K, G)) or q.stride(-1) != 1 or s.stride(-1) != 1:
            raise ValueError(f"small_m_linear: pre-quantized input {tuple(q.shape)} / {tuple(s.shape)} "
                             f"(scale strides {tuple(s.stride())}) does not match x [{M}, {K}] with row-major scales")
    elif swiglu:
        from megatron_jetrl.kernels.triton_quant import swiglu_quant_triton

        prequant = True
        q, s = swiglu_quant_triton(x2, recipe)
    elif prequant:
        from megatron_jetrl.kernels.triton_quant import quantize_act_triton

        q, s = quantize_act_triton(x2, recipe)
    else:
        q = torch.empty((M, K), dtype=recipe.dtype, device=x.device) if return_quantized else y
        s = torch.empty((M, triton.cdiv(K, G)), dtype=torch.float32, device=x.device) if return_quantized else y
    if M:
        swap = M <= SWAP_MAX_M if swap is None else swap
        block_m, block_n, split, per = plan(M, N, K, G, x.device, block_n, split_k, block_m=block_m, swap=swap)
        part = y if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), split)
        locks = _locks(x.device, grid[0] * grid[1]) if split > 1 and fused_sum else None
        tma = (USE_TMA if tma is None else tma) and prequant and _tma_ok(q, qweight)
        wt, qt = ((TensorDescriptor.from_tensor(qweight, [block_n, G]), TensorDescriptor.from_tensor(q, [block_m, G]))
                  if tma else (qweight, q))
        _small_m_kernel[grid](x2, wt, w_scale, part, qt, s, M, N, K, per, x2.stride(0), qweight.stride(0),
                              w_scale.stride(0), part.stride(0) if split > 1 else 0, N,
                              q.stride(0) if return_quantized or prequant else 0,
                              s.stride(0) if return_quantized or prequant else 0, 1.0 / recipe.fp8_max, recipe.fp8_max,
                              recipe.amax_eps, y, locks if locks is not None else y, G=G, BLOCK_M=block_m,
                              BLOCK_N=block_n, UE8M0=recipe.scale_fmt == "ue8m0",
                              STORE_Q=return_quantized and not prequant, NUM_STAGES=num_stages, PREQ=prequant,
                              SPLIT=split, FUSED_SUM=locks is not None, SWAP=swap, TMA=tma, num_warps=num_warps)
        if split > 1 and locks is None:
            if return_partials:
                return part, split
            sum_partials(part, y)
    y = y.view(*lead, N)
    if return_partials:
        return y, 1
    return (y, q, s) if return_quantized else y


def sum_partials(part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out [M, N] = sum_s part[s]`` in split order (fp32), written in ``out``'s dtype."""
    split, MN = part.shape[0], part[0].numel()
    block = 1024
    _split_sum_kernel[(triton.cdiv(MN, block),)](part, out, MN, SPLIT=split, BLOCK=block)
    return out
