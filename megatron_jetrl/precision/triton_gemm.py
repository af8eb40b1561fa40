"""Block-FP8 GEMM for small M (decode), with the activation quantization fused in (CUDA; Triton).

``y[M, N] = dequant(quant_1x128(x))[M, K] @ dequant(W)[N, K]^T`` for W in 128x128 blocks: one
program owns a [BLOCK_M, BLOCK_N] tile of y and walks K in 128-wide groups; for each group it
quantizes its rows of x exactly as ``quant.quantize_act`` does (same amax, epsilon, scale rule and
saturating E4M3 cast as the Triton quantizer, so the same bytes and scales), multiplies with the
FP8 weight tile on the tensor cores, and accumulates ``dot * x_scale[row] * w_scale[block]`` in
fp32. At decode sizes the weight read dominates; x (a few rows) is re-quantized per N tile, which
costs compute on a tiny tile instead of a kernel launch and a round trip through memory.

Used by the FP8 linear for inference forwards (rollout) with M <= ``precision.small_m_max``
(0 = off until measured on the target GPU: ``jetrl bench linear --decode`` prints the crossover);
cuBLAS ``scaled_mm`` above it. Runs under ``TRITON_INTERPRET=1`` on CPU (the tests do).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.precision.triton_quant import _scale_and_multiplier


@triton.jit
def _small_m_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, q_ptr, s_ptr, M, N, K,
                    stride_xm, stride_wn, stride_wsn, stride_ym, stride_qm, stride_sm,
                    inv_max, fmax, eps, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    UE8M0: tl.constexpr, STORE_Q: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, G)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, G)):
        k = kb * G + kk
        xm = (rows[:, None] < M) & (k[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=xm, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), eps)
        x_scale, mult = _scale_and_multiplier(amax, inv_max, fmax, UE8M0)
        xq = tl.clamp(x * mult[:, None], -fmax, fmax).to(tl.float8e4nv)
        if STORE_Q:  # for tests: the quantized activations, to compare with quant.quantize_act
            tl.store(q_ptr + rows[:, None] * stride_qm + k[None, :], xq, mask=xm)
            if pid_n == 0:
                tl.store(s_ptr + rows * stride_sm + kb, x_scale, mask=rows < M)
        wm = (cols[:, None] < N) & (k[None, :] < K)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + k[None, :], mask=wm, other=0.0)
        w_scale = tl.load(ws_ptr + (cols // G) * stride_wsn + kb, mask=cols < N, other=0.0)
        part = tl.dot(xq, tl.trans(w), out_dtype=tl.float32)
        acc += part * x_scale[:, None] * w_scale[None, :]
    ym = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=ym)


def small_m_linear(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, recipe: FP8Recipe,
                   out_dtype: torch.dtype | None = None, return_quantized: bool = False, block_n: int = 64):
    """``x [..., K]`` (bf16/fp32) times the cached FP8 weight ``[N, K]`` with ``w_scale``
    ``[ceil(N/128), ceil(K/128)]``; returns y ``[..., N]`` (and, with ``return_quantized``, the
    activation bytes and scales the kernel used, for tests)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N, G = x2.shape[0], qweight.shape[0], recipe.group_size
    if qweight.shape[1] != K or w_scale.shape != (triton.cdiv(N, G), triton.cdiv(K, G)):
        raise ValueError(f"small_m_linear: weight {tuple(qweight.shape)} / scale {tuple(w_scale.shape)} do not match K={K}")
    if G % block_n:
        raise ValueError(f"small_m_linear: block_n={block_n} must divide the group size {G}")
    y = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    q = torch.empty((M, K), dtype=recipe.dtype, device=x.device) if return_quantized else y
    s = torch.empty((M, triton.cdiv(K, G)), dtype=torch.float32, device=x.device) if return_quantized else y
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
    if M:
        _small_m_kernel[grid](x2, qweight, w_scale, y, q, s, M, N, K, x2.stride(0), qweight.stride(0),
                              w_scale.stride(0), y.stride(0), q.stride(0) if return_quantized else 0,
                              s.stride(0) if return_quantized else 0, 1.0 / recipe.fp8_max, recipe.fp8_max,
                              recipe.amax_eps, G=G, BLOCK_M=block_m, BLOCK_N=block_n,
                              UE8M0=recipe.scale_fmt == "ue8m0", STORE_Q=return_quantized, num_warps=4)
    y = y.view(*lead, N)
    return (y, q, s) if return_quantized else y
