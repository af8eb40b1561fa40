"""Block quantizers: activations and gradients in 1x128 groups, weights in 128x128 blocks.

The rule (docs/architecture.md, the numerics contract; SGLang's CUDA ``per_token_group_quant_8bit``):

    amax      = max(eps, max |x|) over the block               (float32)
    fp32:     scale_inv = amax * fp32(1/448);  q = e4m3(clamp(x * fp32(448 / amax), -448, 448))
    ue8m0:    e = ceil(log2(amax * fp32(1/448))); scale_inv = 2^e;  q = e4m3(clamp(x * 2^-e, ...))

with round-to-nearest-even into E4M3. Sizes that are not multiples of the block are handled as
SGLang does: the scale grid is ceil-divided and the last block is partial (padding never
contributes to amax). Every function returns ``(q float8_e4m3fn, scale_inv float32)``.

On CUDA, :func:`quantize_act` uses the fused Triton kernel of ``kernels/triton_quant.py`` (bit-identical,
tested on the H200); the torch statement here is the reference and the CPU path.
"""
from __future__ import annotations

import torch

from megatron_jetrl.kernels.layout import transposed_outputs
from megatron_jetrl.precision.recipe import KV_SCALE_FMT, FP8Recipe

_INV_MAX = {}  # fp32(1/448), fp32(448) per fp8_max, as 0-d float32 tensors per device


def _consts(recipe: FP8Recipe, device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (recipe.fp8_max, str(device))
    if key not in _INV_MAX:
        _INV_MAX[key] = (torch.tensor(1.0 / recipe.fp8_max, dtype=torch.float32, device=device),
                         torch.tensor(recipe.fp8_max, dtype=torch.float32, device=device))
    return _INV_MAX[key]


def scales_from_amax(amax: torch.Tensor, recipe: FP8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 amax per block -> (scale_inv, multiplier applied to x before the cast)."""
    inv_max, fmax = _consts(recipe, amax.device)
    amax = amax.float().clamp_min(recipe.amax_eps)
    if recipe.scale_fmt == "fp32":
        return amax * inv_max, fmax / amax
    # ue8m0: exact ceil(log2(y)) from the float's exponent (frexp: y = m * 2^e, m in [0.5, 1)),
    # so no transcendental rounding can move a power-of-two boundary.
    mant, exp = torch.frexp(amax * inv_max)
    e = torch.where(mant == 0.5, exp - 1, exp).float()
    return torch.exp2(e), torch.exp2(-e)


def expand_blocks(grid: torch.Tensor, block_rows: int, block_cols: int, rows: int, cols: int) -> torch.Tensor:
    """A per-block grid [ceil(rows/br), ceil(cols/bc)] repeated to one value per element [rows, cols]."""
    return grid.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]


def quantize_blocks(x: torch.Tensor, block_rows: int, block_cols: int, recipe: FP8Recipe
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor in ``block_rows x block_cols`` blocks; scale grid is ceil-divided."""
    if x.dim() != 2:
        raise ValueError(f"quantize_blocks expects a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    rb, cb = -(-rows // block_rows), -(-cols // block_cols)
    x32 = x.float()
    pad = torch.nn.functional.pad(x32.abs(), (0, cb * block_cols - cols, 0, rb * block_rows - rows))
    amax = pad.view(rb, block_rows, cb, block_cols).amax(dim=(1, 3))
    scale_inv, mult = scales_from_amax(amax, recipe)
    q = (x32 * expand_blocks(mult, block_rows, block_cols, rows, cols)).clamp_(-recipe.fp8_max, recipe.fp8_max).to(recipe.dtype)
    return q, scale_inv


def quantize_act(x: torch.Tensor, recipe: FP8Recipe, use_triton: bool | None = None,
                 scale_col_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """1xG groups along the last dim: ``[..., K] -> q [..., K], scale_inv [..., ceil(K/G)]``.

    Used for activations (groups along K) and for gradients (pass the tensor whose last dim is the
    contraction dim of the GEMM that consumes it). ``scale_col_major`` (2-D input) returns the
    scales with strides (1, M), the layout ``scaled_mm`` takes without a copy."""
    if use_triton is None:
        use_triton = x.is_cuda
    if use_triton:
        from megatron_jetrl.kernels.triton_quant import quantize_act_triton

        return quantize_act_triton(x, recipe, scale_col_major)
    lead = x.shape[:-1]
    q, s = quantize_blocks(x.reshape(-1, x.shape[-1]), 1, recipe.group_size, recipe)
    if scale_col_major:
        return q, s.t().contiguous().t()
    return q.view(*lead, x.shape[-1]), s.view(*lead, s.shape[-1])


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``y = [gate | up]`` along the last dim, in ``y``'s dtype: the eager ops
    of Megatron's unfused gated MLP (and SGLang's ``silu_and_mul`` output before its quantization)."""
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


class _SwigluFunction(torch.autograd.Function):
    """``swiglu(y)`` with the fused backward: forward one Triton pass on CUDA (the eager ops' bytes), backward
    :func:`swiglu_backward` (one pass, fp32 math). Saves only ``y``."""

    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        if y.is_cuda and y.dtype in (torch.bfloat16, torch.float32):
            from megatron_jetrl.kernels.triton_quant import swiglu_triton

            return swiglu_triton(y)
        return swiglu(y)

    @staticmethod
    def backward(ctx, da):
        (y,) = ctx.saved_tensors
        return swiglu_backward(y, da)


def swiglu_fused(y: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation for BF16 linears (``models.spec.JetMLP``): ``swiglu(y)``'s values with one
    kernel each way, where megatron-core's unfused MLP runs ~6 eager kernels (silu, mul, their backwards, a
    cat) over strided halves. The FP8 fc2 fuses the SwiGLU into its quantizer instead."""
    return _SwigluFunction.apply(y)


def swiglu_backward(y: torch.Tensor, da: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """Gradient of ``swiglu(y)`` w.r.t. ``y = [gate | up]`` given ``da`` (the gradient of the
    activation), computed in fp32 and returned in ``y``'s dtype. On CUDA one Triton pass
    (``triton_quant.swiglu_backward_triton``, same fp32 operations in the same order)."""
    if use_triton is None:
        use_triton = y.is_cuda
    if use_triton:
        from megatron_jetrl.kernels.triton_quant import swiglu_backward_triton

        return swiglu_backward_triton(y, da)
    gate, up = y.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    da = da.float()
    dgate = da * up * sig * (1 + gate * (1 - sig))
    dup = da * gate * sig
    return torch.cat([dgate, dup], -1).to(y.dtype)


def quantize_dual(d: torch.Tensor, recipe: FP8Recipe, scale_col_major: bool = False, use_triton: bool | None = None,
                  pad_to: int = 0):
    """A gradient ``d`` [M, N] quantized both ways the FP8 backward needs: ``quantize_act(d)`` (dgrad) and
    ``quantize_transposed(d, tile_scale=False, pad_to=pad_to)`` (wgrad), returned as ``(q, scale_inv, q_t,
    scale_inv_t)``; on CUDA one Triton pass that reads ``d`` once (same bytes and scales)."""
    if use_triton is None:
        use_triton = d.is_cuda
    if use_triton:
        from megatron_jetrl.kernels.triton_quant import quantize_dual_triton

        return quantize_dual_triton(d, recipe, scale_col_major, pad_to=pad_to)
    return (*quantize_act(d, recipe, use_triton=False, scale_col_major=scale_col_major),
            *quantize_transposed(d, recipe, False, use_triton=False, pad_to=pad_to))


def quantize_swiglu(y: torch.Tensor, recipe: FP8Recipe, use_triton: bool | None = None,
                    scale_col_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_act(swiglu(y))``; on CUDA one fused Triton pass (the BF16 activation is never
    written), same bytes and scales."""
    if use_triton is None:
        use_triton = y.is_cuda
    if use_triton:
        from megatron_jetrl.kernels.triton_quant import swiglu_quant_triton

        return swiglu_quant_triton(y, recipe, scale_col_major)
    return quantize_act(swiglu(y), recipe, use_triton=False, scale_col_major=scale_col_major)


def quantize_weight(w: torch.Tensor, recipe: FP8Recipe, use_triton: bool | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks: ``[N, K] -> q [N, K], scale_inv [ceil(N/128), ceil(K/128)]`` (Triton on
    CUDA, bit-identical to the torch statement)."""
    if use_triton is None:
        use_triton = w.is_cuda
    if use_triton:
        from megatron_jetrl.kernels.triton_quant import quantize_weight_triton

        return quantize_weight_triton(w, recipe)
    return quantize_blocks(w, *recipe.weight_block, recipe)


def quantize_transposed(x: torch.Tensor, recipe: FP8Recipe, tile_scale: bool,
                        x_scale: torch.Tensor | None = None, use_triton: bool | None = None, pad_to: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x^T`` quantized in groups of G along x's rows, for the wgrad GEMM: 1xG groups
    (``tile_scale=False``, scales [C, R/G]) or GxG blocks (scales [C/G, R/G]). With ``x_scale``,
    ``x`` is FP8 in 1xG groups along its columns and is dequantized first (the saved activation).
    ``pad_to`` (a multiple of G; 0 = none): R padded to a multiple of it with zero bytes of scale 1, the
    contraction length cuBLAS's block-scaled GEMMs take as is (on CUDA written in place by the kernel)."""
    if use_triton is None:
        use_triton = x.is_cuda
    if use_triton:
        from megatron_jetrl.kernels.triton_quant import quantize_transposed_triton

        return quantize_transposed_triton(x, recipe, tile_scale, x_scale, pad_to=pad_to)
    if x_scale is not None:
        x = dequantize_blocks(x, x_scale, 1, recipe.group_size)
    g = recipe.group_size
    q, s = quantize_blocks(x.t(), g if tile_scale else 1, g, recipe)
    if not pad_to or (q.shape[1] % pad_to == 0 and pad_to % g == 0):  # nothing to pad
        return q, s
    qp, sp = transposed_outputs(q.shape[0], q.shape[1], s.shape[0], recipe, q.device, pad_to)
    qp[:, : q.shape[1]] = q
    sp[:, : s.shape[1]] = s
    return qp, sp


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block_rows: int, block_cols: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks` (exact in float32: e4m3 x fp32 scale)."""
    return (q.float() * expand_blocks(scale_inv, block_rows, block_cols, *q.shape)).to(dtype)


def dequantize_act(q: torch.Tensor, scale_inv: torch.Tensor, group: int = 128,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    lead = q.shape[:-1]
    out = dequantize_blocks(q.reshape(-1, q.shape[-1]), scale_inv.reshape(-1, scale_inv.shape[-1]),
                            1, group, dtype)
    return out.view(*lead, q.shape[-1])


# ---- the FP8 KV cache (``FP8Recipe.kv_cache``) ---------------------------------------------------

def kv_rule(recipe: FP8Recipe) -> FP8Recipe:
    """The recipe the KV quantizer applies: ``recipe`` with power-of-two scales (``KV_SCALE_FMT``)."""
    if recipe.scale_fmt == KV_SCALE_FMT:
        return recipe
    import dataclasses

    return dataclasses.replace(recipe, scale_fmt=KV_SCALE_FMT)


def quantize_kv(x: torch.Tensor, recipe: FP8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (after RoPE) or values ``[..., head_dim]`` -> ``(q [..., head_dim] e4m3, scale_inv [...] fp32)``: one
    group per token and KV head (the whole last dimension), the ue8m0 rule: ``scale_inv = 2^ceil(log2(amax/448))``,
    ``q = e4m3(x * 2^-e)``; ``x`` is read as float32 (exact from BF16)."""
    q, s = quantize_blocks(x.reshape(-1, x.shape[-1]), 1, x.shape[-1], kv_rule(recipe))
    return q.view(x.shape), s.view(x.shape[:-1])


def dequantize_kv(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [..., d] * scale_inv [...]`` in ``dtype``: exact in float32 and in BF16 (an E4M3 value times a power of
    two; no rounding happens)."""
    return (q.float() * scale_inv[..., None]).to(dtype)


def kv_qdq(x: torch.Tensor, recipe: FP8Recipe, use_triton: bool | None = None, with_bytes: bool = False):
    """``dequantize_kv(*quantize_kv(x))`` in ``x``'s dtype: the keys or values both sides of the unified FP8 KV
    cache attend over. On CUDA one Triton pass (``kernels/triton_quant.kv_qdq_triton``, the same values).
    ``with_bytes``: ``(q, scale_inv, values)``, :func:`quantize_kv`'s bytes and scales with the values (one pass)."""
    if use_triton is None:
        use_triton = x.is_cuda
    if use_triton:
        from megatron_jetrl.kernels.triton_quant import kv_qdq_triton

        return kv_qdq_triton(x, kv_rule(recipe), with_bytes)
    q, s = quantize_kv(x, recipe)
    y = dequantize_kv(q, s, x.dtype)
    return (q, s, y) if with_bytes else y


class _KVFakeQuant(torch.autograd.Function):
    """Forward :func:`kv_qdq`; backward the identity (a straight-through estimator: the gradient of the rounding
    is taken as 1, as for every FP8 cast in the recipe's backward). The bytes and scales (``with_bytes``) carry no
    gradient."""

    @staticmethod
    def forward(ctx, x, recipe, with_bytes):
        if not with_bytes:
            return kv_qdq(x, recipe)
        q, s, y = kv_qdq(x, recipe, with_bytes=True)
        ctx.mark_non_differentiable(q, s)
        return y, q, s

    @staticmethod
    def backward(ctx, dy, *_):
        return dy, None, None


def kv_fake_quant(x: torch.Tensor, recipe: FP8Recipe, with_bytes: bool = False):
    """The training forward's keys/values with the FP8 KV cache: :func:`kv_qdq`, straight-through in backward.
    ``with_bytes``: ``(values, q, scale_inv)``, the cache's bytes and scales of ``x`` too (exact mode's attention
    kernel reads them; the values are their dequantization, for the backward)."""
    return _KVFakeQuant.apply(x, recipe, with_bytes)
