"""One kernel per layer for the static decoder's RoPE and KV-cache write (CUDA; Triton).

megatron-core's unfused RoPE (``rope_utils._apply_rotary_pos_emb_bshd``) launches about a dozen
small kernels per call (cos, sin, casts, the rotate-half chunk/neg/cat, two products, a sum, the
final cat), and the decoder calls it for q and for k in every layer: about 770 kernels per decode
step of a 32-layer model, each a few microseconds even inside a CUDA graph, followed by two
``index_copy_`` into the KV cache. :func:`rope_and_cache` does all of it in one launch and gives
the same bytes: the cos/sin rows are computed once per forward by torch exactly as megatron does
(``(cos(freqs) * mscale).to(dtype)``), and every product and the sum are rounded to the tensor's
dtype in the same order as megatron's eager ops (``t * cos``, ``rotate_half(t) * sin``, their sum),
which is what torch's CUDA elementwise kernels compute (float math, one rounding per op).

:func:`rope_torch` is the same statement in torch ops with the shared cos/sin (the CPU path, and
the reference of the tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl



def rope_tables(freqs: torch.Tensor, dtype: torch.dtype, mscale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's ``cos_``/``sin_`` for RoPE rows ``freqs [S, 1, 1, rot]`` -> two ``[S, rot]`` tensors."""
    f = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    return (torch.cos(f) * mscale).to(dtype).contiguous(), (torch.sin(f) * mscale).to(dtype).contiguous()


def rope_torch(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron's non-interleaved RoPE of ``t [S, b, h, d]`` with precomputed ``cos``/``sin`` ``[S, rot]``."""
    rot = cos.shape[-1]
    c, s = cos[:, None, None, :], sin[:, None, None, :]
    x, x_pass = t[..., :rot], t[..., rot:]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    out = (x * c) + (torch.cat((-x2, x1), dim=-1) * s)
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


@triton.jit
def _rope_row(ptr, cos_ptr, sin_ptr, s, d, ROT: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr):
    """Load one head row (``D`` wide) and apply RoPE to its first ``ROT`` elements, rounding each op
    to the row's dtype as megatron's eager ops do; returns the row in that dtype."""
    in_rot = d < ROT
    t = tl.load(ptr + d, mask=d < D, other=0.0)
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    tr = tl.load(ptr + partner, mask=in_rot, other=0.0)
    rot = tl.where(d < HALF, -tr, tr)
    c = tl.load(cos_ptr + s * ROT + d, mask=in_rot, other=0.0)
    sn = tl.load(sin_ptr + s * ROT + d, mask=in_rot, other=0.0)
    a = (t.to(tl.float32) * c.to(tl.float32)).to(t.dtype)
    b = (rot.to(tl.float32) * sn.to(tl.float32)).to(t.dtype)
    y = (a.to(tl.float32) + b.to(tl.float32)).to(t.dtype)
    return tl.where(in_rot, y, t)


@triton.jit
def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, idx_ptr, B, H,
                    sq_s, sq_b, sq_h, sk_s, sk_b, sk_h, sv_s, sv_b, sv_h, sc_b, sc_g, sc_l,
                    ROT: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0)
    bi = tl.program_id(1)
    h = tl.program_id(2)  # q heads first, then the key/value groups
    d = tl.arange(0, BLOCK_D)
    if h < H:
        row = q_ptr + s * sq_s + bi * sq_b + h * sq_h
        tl.store(row + d, _rope_row(row, cos_ptr, sin_ptr, s, d, ROT, HALF, D), mask=d < D)
    else:
        g = h - H
        pos = tl.load(idx_ptr + s)
        dst = bi * sc_b + g * sc_g + pos * sc_l + d
        krow = k_ptr + s * sk_s + bi * sk_b + g * sk_h
        tl.store(kc_ptr + dst, _rope_row(krow, cos_ptr, sin_ptr, s, d, ROT, HALF, D), mask=d < D)
        vrow = tl.load(v_ptr + s * sv_s + bi * sv_b + g * sv_h + d, mask=d < D)
        tl.store(vc_ptr + dst, vrow, mask=d < D)


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, idx: torch.Tensor) -> None:
    """RoPE on ``q [S, b, H, d]`` in place; RoPE'd ``k`` and ``v`` (``[S, b, G, d]``) written into the
    caches ``[b, G, L, d]`` at positions ``idx [S]``. Any strides with a unit last dimension (the
    views megatron's ``get_query_key_value_tensors`` returns); cache views must share strides."""
    S, b, H, D = q.shape
    G, rot = k.shape[2], cos.shape[-1]
    if rot % 2 or rot > D or k_cache.stride() != v_cache.stride() or min(x.stride(-1) for x in (q, k, v, k_cache)) != 1:
        raise ValueError(f"rope_and_cache: unsupported layout (rot {rot}, head dim {D}, strides "
                         f"{[tuple(x.stride()) for x in (q, k, v, k_cache, v_cache)]})")
    if S == 0 or b == 0:
        return
    grid = (S, b, H + G)
    _rope_kv_kernel[grid](q, k, v, cos, sin, k_cache, v_cache, idx, b, H,
                          q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                          v.stride(0), v.stride(1), v.stride(2), k_cache.stride(0), k_cache.stride(1),
                          k_cache.stride(2), ROT=rot, HALF=rot // 2, D=D, BLOCK_D=triton.next_power_of_2(D),
                          num_warps=1, enable_fp_fusion=False,)  # no FMA: one rounding per op, as torch
