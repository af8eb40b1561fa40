"""One kernel per layer for the static decoder's RoPE and KV-cache write (CUDA; Triton).

megatron-core's unfused RoPE (``rope_utils._apply_rotary_pos_emb_bshd``) launches about a dozen
small kernels per call (cos, sin, casts, the rotate-half chunk/neg/cat, two products, a sum, the
final cat), and the decoder calls it for q and for k in every layer: about 770 kernels per decode
step of a 32-layer model, each a few microseconds even inside a CUDA graph, followed by two
``index_copy_`` into the KV cache. :func:`rope_and_cache` does all of it in one launch and gives
the same bytes (with an FP8 KV cache, the E4M3 bytes and scales of ``quant.quantize_kv``): the cos/sin rows
are computed once per forward by torch exactly as megatron does (``(cos(freqs) * mscale).to(dtype)``), and
every product and the sum are rounded to the tensor's dtype in the same order as megatron's eager ops
(``t * cos``, ``rotate_half(t) * sin``, their sum), which is what torch's CUDA elementwise kernels compute
(float math, one rounding per op). Fed the fused QKV GEMM's split-K fp32 partials instead of its output, the
kernel sums them first, in split order, rounded to the model's dtype: the bytes of the GEMM's own sum kernel,
one launch fewer per layer.

:func:`rope_torch` is the same statement in torch ops with the shared cos/sin (the CPU path, and
the reference of the tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_jetrl.kernels.triton_quant import scale_and_multiplier
from megatron_jetrl.precision.recipe import FP8Recipe


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype, mscale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's ``cos_``/``sin_`` for RoPE rows ``freqs [S, 1, 1, rot]`` (or one row per token and sequence,
    ``[S, b, 1, rot]``) -> two ``[S, rot]`` (``[S * b, rot]``) tensors."""
    f = freqs.reshape(-1, freqs.shape[-1])
    return (torch.cos(f) * mscale).to(dtype).contiguous(), (torch.sin(f) * mscale).to(dtype).contiguous()


def rope_torch(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron's non-interleaved RoPE of ``t [S, b, h, d]`` with precomputed ``cos``/``sin`` ``[S, rot]`` (one
    position per token) or ``[S * b, rot]`` (one per token and sequence)."""
    rot = cos.shape[-1]
    c, s = cos.view(t.shape[0], -1, 1, rot), sin.view(t.shape[0], -1, 1, rot)
    x, x_pass = t[..., :rot], t[..., rot:]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    out = (x * c) + (torch.cat((-x2, x1), dim=-1) * s)
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


@triton.jit
def _load_row(ptr, d, mask, SPLIT: tl.constexpr, sp, DT: tl.constexpr):
    """Elements ``d`` of a row: as stored, or (``SPLIT`` > 1) the sum of a split-K GEMM's fp32 partials ``sp``
    apart, in split order, rounded to ``DT``: the bytes ``triton_gemm.sum_partials`` writes."""
    if SPLIT == 1:
        return tl.load(ptr + d, mask=mask, other=0.0)
    acc = tl.load(ptr + d, mask=mask, other=0.0)
    for i in tl.static_range(1, SPLIT):
        acc += tl.load(ptr + i * sp + d, mask=mask, other=0.0)
    return acc.to(DT)


@triton.jit
def _rope_row(ptr, cos_ptr, sin_ptr, s, d, ROT: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr,
              SPLIT: tl.constexpr, sp, DT: tl.constexpr):
    """Load one head row (``D`` wide; ``_load_row``) and apply RoPE to its first ``ROT`` elements with the cos/sin
    table row ``s``, rounding each op to the row's dtype as megatron's eager ops do; returns the row in that
    dtype."""
    in_rot = d < ROT
    t = _load_row(ptr, d, d < D, SPLIT, sp, DT)
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    tr = _load_row(ptr, partner, in_rot, SPLIT, sp, DT)
    rot = tl.where(d < HALF, -tr, tr)
    c = tl.load(cos_ptr + s * ROT + d, mask=in_rot, other=0.0)
    sn = tl.load(sin_ptr + s * ROT + d, mask=in_rot, other=0.0)
    a = (t.to(tl.float32) * c.to(tl.float32)).to(t.dtype)
    b = (rot.to(tl.float32) * sn.to(tl.float32)).to(t.dtype)
    y = (a.to(tl.float32) + b.to(tl.float32)).to(t.dtype)
    return tl.where(in_rot, y, t)


@triton.jit
def _store_kv(dst_ptr, scale_ptr, row, d, D: tl.constexpr, inv_max, fmax, eps, KV_FP8: tl.constexpr, sd, n):
    """Store one K or V head row into the cache (its elements ``sd`` apart: 1, or the cache length for a key-major
    V; ``n``: D, or 0 to write nothing): as it is, or (``KV_FP8``) as E4M3 bytes with its power-of-two scale (the
    recipe's KV rule, ``quant.quantize_kv``: amax over the row, ue8m0, the cast to nearest even)."""
    if KV_FP8:
        x = row.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(tl.where(d < D, x, 0.0)), axis=0), eps)
        scale_inv, mult = scale_and_multiplier(amax, inv_max, fmax, True)
        tl.store(dst_ptr + d * sd, tl.clamp(x * mult, -fmax, fmax).to(tl.float8e4nv), mask=d < n)
        tl.store(scale_ptr, scale_inv, mask=n > 0)
    else:
        tl.store(dst_ptr + d * sd, row, mask=d < n)


@triton.jit
def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, idx_ptr, shift_ptr, CB, H,
                    sq_s, sq_b, sq_h, sk_s, sk_b, sk_h, sv_s, sv_b, sv_h, sc_b, sc_g, sc_l, svc_b, svc_g, svc_l,
                    svc_d, ss_b, ss_g, qo_ptr, sqo_s, sqo_b, sqo_h, sp,
                    inv_max, fmax, eps, ROT: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr,
                    BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr, SHIFT: tl.constexpr, SPLIT: tl.constexpr):
    s = tl.program_id(0)
    bi = tl.program_id(1).to(tl.int64)  # 64-bit offsets: a 256 x 8K-token cache of one layer passes 2^31 elements
    h = tl.program_id(2)  # q heads first, then the key/value groups
    d = tl.arange(0, BLOCK_D)
    cs = s * CB + tl.minimum(bi, CB - 1)  # the cos/sin row: one per token (CB = 1) or per token and sequence
    DT: tl.constexpr = qo_ptr.dtype.element_ty  # q's, k's and v's dtype (the partials' sums are rounded to it)
    if h < H:
        row = q_ptr + s * sq_s + bi * sq_b + h * sq_h
        y = _rope_row(row, cos_ptr, sin_ptr, cs, d, ROT, HALF, D, SPLIT, sp, DT)
        tl.store(qo_ptr + s * sqo_s + bi * sqo_b + h * sqo_h + d, y, mask=d < D)
    else:
        g = h - H
        pos = tl.load(idx_ptr + s)
        if SHIFT:  # the row's own position: a cache indexed by position (a left pad's column < 0 is not written)
            pos -= tl.load(shift_ptr + bi)
        n = tl.where(pos >= 0, D, 0)
        dst = bi * sc_b + g * sc_g + pos * sc_l
        sdst = bi * ss_b + g * ss_g + pos  # the scales' [b, G, L] (KV_FP8)
        krow = k_ptr + s * sk_s + bi * sk_b + g * sk_h
        _store_kv(kc_ptr + dst, ks_ptr + sdst, _rope_row(krow, cos_ptr, sin_ptr, cs, d, ROT, HALF, D, SPLIT, sp, DT),
                  d, D, inv_max, fmax, eps, KV_FP8, 1, n)
        vrow = _load_row(v_ptr + s * sv_s + bi * sv_b + g * sv_h, d, d < D, SPLIT, sp, DT)
        _store_kv(vc_ptr + bi * svc_b + g * svc_g + pos * svc_l, vs_ptr + sdst, vrow, d, D, inv_max, fmax, eps, KV_FP8,
                  svc_d, n)


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, idx: torch.Tensor,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                   recipe: FP8Recipe | None = None, shift: torch.Tensor | None = None,
                   partials: tuple[int, int] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """RoPE on ``q [S, b, H, d]`` in place (returns q); RoPE'd ``k`` and ``v`` (``[S, b, G, d]``) written into the caches
    ``[b, G, L, d]`` at cache columns ``idx [S]``. ``partials`` ``(splits, stride)``: q, k and v are views of the
    first of a split-K GEMM's fp32 partials (the fused QKV's, ``stride`` elements apart), summed here in split order
    and rounded to ``dtype`` (the bytes ``triton_gemm.sum_partials`` writes; one kernel instead of two); the RoPE'd q
    is then returned in a new ``[S, b, H, d]`` tensor of ``dtype``. ``cos``/``sin`` ``[S, rot]`` (one RoPE position
    per token) or ``[S * b, rot]`` (one per token and sequence: left-padded rows rotated from their own first token).
    Any strides with a unit last dimension (the views megatron's ``get_query_key_value_tensors`` returns); the K cache
    with a unit last stride, the V cache with one or key-major (a ``[b, G, L, d]`` view of ``[b, G, d, L]`` memory,
    the decoder's FP8 cache for the key-major decode attention). An FP8 cache (``k_cache``/``v_cache`` float8_e4m3fn,
    ``k_scale``/``v_scale`` ``[b, G, L]`` fp32 with a unit last stride and equal strides, ``recipe``) gets
    ``quant.quantize_kv``'s bytes and scales of the RoPE'd k and of v. ``shift`` (int64 ``[b]``): row ``r``'s token at
    column ``idx[s]`` goes to cache column ``idx[s] - shift[r]`` (the row's own position: exact mode's cache, indexed
    by position; a negative column, a left pad, is not written)."""
    S, b, H, D = q.shape
    G, rot = k.shape[2], cos.shape[-1]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if (cos.shape[0] not in (S, S * b) or rot % 2 or rot > D or k_cache.shape != v_cache.shape
            or min(x.stride(-1) for x in (q, k, v, k_cache)) != 1 or 1 not in v_cache.stride()[-2:]):
        raise ValueError(f"rope_and_cache: unsupported layout (rot {rot}, head dim {D}, strides "
                         f"{[tuple(x.stride()) for x in (q, k, v, k_cache, v_cache)]})")
    if fp8 and (k_scale is None or v_scale is None or recipe is None or k_scale.stride() != v_scale.stride()
                or k_scale.stride(-1) != 1 or k_scale.shape != k_cache.shape[:-1]):
        raise ValueError("rope_and_cache: an FP8 KV cache needs k_scale/v_scale [b, G, L] (equal strides, unit last) "
                         "and the recipe")
    if shift is not None and shift.shape != (b,):
        raise ValueError(f"rope_and_cache: shift {tuple(shift.shape)} for {b} rows")
    splits, sp = partials or (1, 0)
    if splits > 1 and (dtype is None or q.dtype != torch.float32
                       or len({x.untyped_storage().data_ptr() for x in (q, k, v)}) != 1):
        raise ValueError("rope_and_cache: split-K partials are fp32 views of one GEMM output and need the dtype "
                         "to round their sums to")
    q_out = q if splits == 1 else torch.empty(q.shape, dtype=dtype, device=q.device)
    if S == 0 or b == 0:
        return q_out
    if not fp8:
        k_scale = v_scale = k_cache  # unused (KV_FP8 off), as the quantizer's constants below
        recipe = recipe or FP8Recipe()
    grid = (S, b, H + G)
    _rope_kv_kernel[grid](q, k, v, cos, sin, k_cache, v_cache, k_scale, v_scale, idx,
                          idx if shift is None else shift, cos.shape[0] // S, H,
                          q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                          v.stride(0), v.stride(1), v.stride(2), k_cache.stride(0), k_cache.stride(1),
                          k_cache.stride(2), *v_cache.stride(), k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0,
                          q_out, q_out.stride(0), q_out.stride(1), q_out.stride(2), sp,
                          1.0 / recipe.fp8_max, recipe.fp8_max, recipe.amax_eps, ROT=rot, HALF=rot // 2, D=D,
                          BLOCK_D=triton.next_power_of_2(D), KV_FP8=fp8, SHIFT=shift is not None, SPLIT=splits,
                          num_warps=1, enable_fp_fusion=False,)  # no FMA: one rounding per op, as torch
    return q_out
