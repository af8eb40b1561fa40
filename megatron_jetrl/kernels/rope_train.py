"""Training RoPE in one Triton kernel per tensor, forward and backward (CUDA; both precision modes).

Without TransformerEngine, megatron-core applies RoPE with its unfused eager statement
(``rope_utils._apply_rotary_pos_emb_bshd``): per call about a dozen kernels over q or k (cos, sin,
casts, the rotate-half chunk/neg/cat, two products, a sum, a cat) and as many again in the backward.
On the H200 that was ~70 ms of an 8-layer training step (docs/benchmarks.md), in every mode.

megatron routes ``apply_rotary_pos_emb`` to ``rope_utils.fused_apply_rotary_pos_emb(t, freqs,
interleaved=...)`` when ``config.apply_rope_fusion`` is set; that slot is TransformerEngine's and stays
``None`` without it. :func:`install` fills the empty slot with :func:`fused_rope`, and the model builder
then sets ``apply_rope_fusion`` (CUDA, non-interleaved RoPE). Where TransformerEngine is installed its function
is left in place and megatron's eager RoPE is kept, since ours is the one that gives the decoder's bytes.

Numerics: the forward gives the bytes of megatron's eager statement (the same cos/sin tables,
``kernels.rope.rope_tables``; every product and the sum rounded to the tensor's dtype in
eager order, no FMA), so the training forward, the logprob recompute and the static decoder
(``kernels.rope``) keep computing the same RoPE. The backward is the eager autograd's:
``dx = dy * cos + R^T(dy * sin)`` with ``R^T(g) = [g2, -g1]``, the same roundings in the same order.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from megatron_jetrl.kernels.rope import rope_tables


@triton.jit
def _rope_kernel(x_ptr, y_ptr, cos_ptr, sin_ptr, H, sx_s, sx_b, sx_h, sy_s, sy_b, sy_h,
                 ROT: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr):
    # One program: BLOCK_H heads of one (position, sequence); rows of D, RoPE on the first ROT.
    s = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    in_rot = d < ROT
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    mask = (h[:, None] < H) & (d[None, :] < D)
    rmask = mask & in_rot[None, :]
    src = x_ptr + s * sx_s + b * sx_b + h[:, None] * sx_h
    t = tl.load(src + d[None, :], mask=mask, other=0.0)
    tp = tl.load(src + partner[None, :], mask=rmask, other=0.0)
    c = tl.load(cos_ptr + s * ROT + d, mask=in_rot, other=0.0).to(tl.float32)
    a = (t.to(tl.float32) * c[None, :]).to(t.dtype)
    if BACKWARD:  # dy * cos + [ (dy*sin)[HALF:], -(dy*sin)[:HALF] ]
        sp = tl.load(sin_ptr + s * ROT + partner, mask=in_rot, other=0.0).to(tl.float32)
        g = (tp.to(tl.float32) * sp[None, :]).to(t.dtype)
        r = tl.where((d < HALF)[None, :], g, -g)
    else:  # t * cos + [-t2, t1] * sin
        sn = tl.load(sin_ptr + s * ROT + d, mask=in_rot, other=0.0).to(tl.float32)
        rot = tl.where((d < HALF)[None, :], -tp, tp)
        r = (rot.to(tl.float32) * sn[None, :]).to(t.dtype)
    y = (a.to(tl.float32) + r.to(tl.float32)).to(t.dtype)
    y = tl.where(in_rot[None, :], y, t)
    tl.store(y_ptr + s * sy_s + b * sy_b + h[:, None] * sy_h + d[None, :], y, mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    S, B, H, D = x.shape
    rot = cos.shape[-1]
    y = torch.empty((S, B, H, D), dtype=x.dtype, device=x.device)
    if y.numel():
        block_d = triton.next_power_of_2(D)
        block_h = max(1, min(triton.next_power_of_2(H), 4096 // block_d))
        grid = (S, B, triton.cdiv(H, block_h))
        _rope_kernel[grid](x, y, cos, sin, H, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1),
                           y.stride(2), ROT=rot, HALF=rot // 2, D=D, BLOCK_H=block_h, BLOCK_D=block_d,
                           BACKWARD=backward, num_warps=4,
                           enable_fp_fusion=False)  # no FMA: one rounding per op, as torch's eager ops
    return y


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(t, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _launch(dy, cos, sin, backward=True), None, None


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """megatron's ``fused_apply_rotary_pos_emb(t [s, b, h, d], freqs [s, 1, 1, rot])``: the eager
    statement's bytes in one kernel (backward: one kernel). Interleaved RoPE, per-sequence freqs and
    layouts it does not cover fall back to megatron's eager function."""
    from megatron.core.models.common.embeddings import rope_utils

    rot = freqs.shape[-1]
    if (interleaved or t.dim() != 4 or freqs.dim() != 4 or freqs.shape[0] != t.shape[0]
            or freqs.shape[1] != 1 or freqs.shape[2] != 1 or rot % 2 or rot > t.shape[-1]
            or not t.is_cuda):
        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    return rope_kernel_apply(t, freqs)


_TABLES: dict = {}
"""(id(freqs), freqs._version, dtype) -> (freqs, cos, sin) for the last few ``freqs`` tensors (kept alive here,
so an id is not reused while cached)."""


def _tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_tables(freqs, dtype)``, computed once per ``freqs`` tensor: megatron's ``RotaryEmbedding.forward``
    is an ``lru_cache``, so every layer's q and k of every micro-batch get the same ``freqs`` object, and the
    cos/sin tables (a handful of kernels each) were recomputed 2 x layers times per forward."""
    try:
        key = (id(freqs), freqs._version, dtype)
    except RuntimeError:  # an inference-mode tensor has no version counter: no caching
        return rope_tables(freqs, dtype)
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is freqs:
        return hit[1], hit[2]
    cos, sin = rope_tables(freqs, dtype)
    if len(_TABLES) >= 8:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = (freqs, cos, sin)
    return cos, sin


def rope_kernel_apply(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """:func:`fused_rope` without the CUDA check (the CPU tests run the kernel under Triton's interpreter)."""
    cos, sin = _tables(freqs, t.dtype)
    return _RoPE.apply(t, cos, sin)


def install() -> bool:
    """Fill megatron's empty fused-RoPE slot with :func:`fused_rope` (CUDA, TransformerEngine absent,
    ). Returns whether the model builder may set ``apply_rope_fusion``."""
    if not torch.cuda.is_available():
        return False
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rope
    return rope_utils.fused_apply_rotary_pos_emb is fused_rope
