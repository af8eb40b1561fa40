"""Fused Triton kernel for the 1x128 activation/gradient quantizer (CUDA only).

One program quantizes a [BLOCK_M, G] tile: amax, scale and the E4M3 cast in one pass over the
input. Bit-identical to ``quant.quantize_act``'s torch statement (tested on the H200,
``tests/test_gpu_*.py``): the division is IEEE round-to-nearest (``div_rn``, not the approximate
``/``), ue8m0's ceil(log2) is read from the float's exponent bits, and the cast is the hardware
round-to-nearest-even with saturation at 448.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from megatron_jetrl.kernels.layout import act_outputs, rows_2d, transposed_outputs, wide_offsets
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.env import triton_interpreted


@triton.jit
def scale_and_multiplier(amax, inv_max, fmax, UE8M0: tl.constexpr):
    """The recipe's rule per group: (scale_inv, multiplier applied before the E4M3 cast)."""
    if UE8M0:
        y = amax * inv_max
        bits = y.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale_inv = ((e + 127) << 23).to(tl.float32, bitcast=True)
        mult = ((127 - e) << 23).to(tl.float32, bitcast=True)
    else:
        scale_inv = amax * inv_max
        mult = tl.math.div_rn(tl.full(amax.shape, fmax, tl.float32), amax)
    return scale_inv, mult


@triton.jit
def quantize_store_groups(x, rows, cols, mask, g, q_ptr, s_ptr, M, stride_qm, stride_sm, stride_sg, inv_max, fmax,
                           eps, UE8M0: tl.constexpr):
    """Quantize the fp32 tile ``x`` [rows, one G-wide group g] with one scale per row; store the
    E4M3 bytes and the scale_inv."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), eps)
    scale_inv, mult = scale_and_multiplier(amax, inv_max, fmax, UE8M0)
    q = tl.clamp(x * mult[:, None], -fmax, fmax).to(tl.float8e4nv)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows * stride_sm + g * stride_sg, scale_inv, mask=rows < M)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sg,
                      inv_max, fmax, eps, G: tl.constexpr, BLOCK_M: tl.constexpr,
                      UE8M0: tl.constexpr, NG: tl.constexpr = 1, STREAM: tl.constexpr = False,
                      WIDE: tl.constexpr = False):
    # One program: BLOCK_M rows x NG consecutive G-wide groups (one scale per row and group); STREAM
    # (NG > 1 only) loads x with the evict-first cache hint. WIDE: 64-bit element offsets (wide_offsets)
    pid_m = tl.program_id(0)
    g0 = tl.program_id(1) * NG
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if WIDE:
        rows = rows.to(tl.int64)
    if NG == 1:
        cols = g0 * G + tl.arange(0, G)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        quantize_store_groups(x, rows, cols, mask, g0, q_ptr, s_ptr, M, stride_qm, stride_sm, stride_sg, inv_max,
                               fmax, eps, UE8M0)
    else:
        cols = g0 * G + tl.arange(0, NG * G)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        if STREAM:  # read once: do not keep x in L2
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
        else:
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x3 = tl.reshape(x, (BLOCK_M, NG, G))
        amax = tl.maximum(tl.max(tl.abs(x3), axis=2), eps)  # [BLOCK_M, NG], the same max per group
        scale_inv, mult = scale_and_multiplier(amax, inv_max, fmax, UE8M0)
        q = tl.reshape(tl.clamp(x3 * mult[:, :, None], -fmax, fmax), (BLOCK_M, NG * G)).to(tl.float8e4nv)
        tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask)
        gs = g0 + tl.arange(0, NG)
        tl.store(s_ptr + rows[:, None] * stride_sm + gs[None, :] * stride_sg, scale_inv,
                 mask=(rows[:, None] < M) & (gs[None, :] * G < K))


def act_quant_plan(M: int, K: int) -> tuple[int, int, int, int]:
    """(rows per program, G-wide groups per program, warps, evict-first loads) of the 1xG quantizer,
    from the H200 sweep ``tools/tune_act_quant.py`` (docs/benchmarks.md); ``quantize_act_triton(plan=...)``
    takes another (checked by :func:`check_act_quant_plan`)."""
    # 8 rows x 8 groups (1024 columns), 8 warps: within 1% of the best plan at every training shape
    # swept (M 4096-16384, K 4096-28672; 4.0-4.2 TB/s) and 3-6% faster than one group per program. Below
    # 1024 rows (decode, short prefill) more, smaller programs: 4 rows x 1 group, 4 warps.
    return (8, 8, 8, 0) if M >= 1024 else (4, 1, 4, 0)


def check_act_quant_plan(plan: tuple[int, ...]) -> tuple[int, int, int, int]:
    """A launch plan (rows, groups, warps[, stream]) of the 1xG quantizer, refused with one line unless rows and
    groups are powers of two and warps one of 1/2/4/8/16 (a bad plan would fail later as a Triton compile error)."""
    v = list(plan)
    pow2 = lambda n: isinstance(n, int) and n > 0 and n & (n - 1) == 0  # noqa: E731
    if len(v) not in (3, 4) or not (pow2(v[0]) and pow2(v[1]) and v[2] in (1, 2, 4, 8, 16)):
        raise ValueError(f"activation quantizer plan {tuple(plan)!r}: expected (rows, groups, warps[, stream]) with "
                         f"rows and groups powers of two and warps in 1/2/4/8/16, e.g. (8, 8, 8)")
    return v[0], v[1], v[2], (v[3] if len(v) > 3 else 0)


def quantize_act_triton(x: torch.Tensor, recipe: FP8Recipe, scale_col_major: bool = False,
                        plan: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., K] -> (q [..., K], scale_inv [..., ceil(K/G)])``; ``scale_col_major`` lays the
    scales out as [M, groups] with strides (1, M), the form ``scaled_mm`` wants. ``plan`` = (rows,
    groups, warps[, stream]) per program instead of ``act_quant_plan``'s (same bytes for every plan)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = rows_2d(x)
    M, G = x2.shape[0], recipe.group_size
    q, s, ng = act_outputs(M, K, recipe, x.device, scale_col_major)
    if M:
        block_m, groups, warps, *stream = check_act_quant_plan(plan) if plan else act_quant_plan(M, K)
        grid = (triton.cdiv(M, block_m), triton.cdiv(ng, groups))
        _act_quant_kernel[grid](x2, q, s, M, K, x2.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                1.0 / recipe.fp8_max, recipe.fp8_max, recipe.amax_eps, G=G,
                                BLOCK_M=block_m, UE8M0=recipe.scale_fmt == "ue8m0", NG=groups,
                                STREAM=bool(stream and stream[0]) and groups > 1, WIDE=wide_offsets(x2, q),
                                num_warps=warps)
    if scale_col_major:
        return q.view(*lead, K), s
    return q.view(*lead, K), s.view(*lead, ng)


@triton.jit
def _quant_t_kernel(x_ptr, xs_ptr, q_ptr, s_ptr, R, C, stride_xr, stride_xsr, stride_qc, stride_sc,
                    inv_max, fmax, eps, G: tl.constexpr, DEQUANT: tl.constexpr,
                    TILE_SCALE: tl.constexpr, UE8M0: tl.constexpr, TRANSPOSE: tl.constexpr, WIDE: tl.constexpr):
    # Tile [G rows (r), G cols (c)] of x [R, C]. TRANSPOSE: writes y = x^T [C, R] quantized with
    # groups of G along r: one scale per output row (1xG, TILE_SCALE=False) or per tile (GxG).
    # Not TRANSPOSE (weights): x itself in GxG blocks, scale [R/G, C/G].
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * G + tl.arange(0, G)
    cols = pid_c * G + tl.arange(0, G)
    if WIDE:  # 64-bit element offsets (wide_offsets)
        rows = rows.to(tl.int64)
        cols = cols.to(tl.int64)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if DEQUANT:  # x is fp8 with one scale per (row, G-column group): exact same product as torch
        xs = tl.load(xs_ptr + rows * stride_xsr + pid_c, mask=rows < R, other=0.0)
        x = x * xs[:, None]
    if TILE_SCALE:
        amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), eps)
        amax = tl.full((G,), 0.0, tl.float32) + amax
    else:
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), eps)  # per column c
    scale_inv, mult = scale_and_multiplier(amax, inv_max, fmax, UE8M0)
    q = tl.clamp(x * mult[None, :], -fmax, fmax).to(tl.float8e4nv)
    if TRANSPOSE:
        tl.store(q_ptr + cols[None, :] * stride_qc + rows[:, None], q, mask=mask)
    else:
        tl.store(q_ptr + rows[:, None] * stride_qc + cols[None, :], q, mask=mask)
    if TILE_SCALE:
        if TRANSPOSE:
            s_off = pid_c * stride_sc + pid_r
        else:
            s_off = pid_r * stride_sc + pid_c
        tl.store(s_ptr + s_off + tl.arange(0, G) * 0, scale_inv, mask=tl.arange(0, G) == 0)
    else:
        tl.store(s_ptr + cols * stride_sc + pid_r, scale_inv, mask=cols < C)


def quantize_transposed_triton(x: torch.Tensor, recipe: FP8Recipe, tile_scale: bool,
                               x_scale: torch.Tensor | None = None, pad_to: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] (or fp8 x with ``x_scale`` [R, ceil(C/G)]) -> x^T [C, R] quantized in groups of G
    along R: scales [C, ceil(R/G)] (1xG) or [ceil(C/G), ceil(R/G)] (GxG, ``tile_scale``). ``pad_to``: R
    padded to a multiple of it in the outputs' own buffers (:func:`quant.transposed_outputs`)."""
    x = x.contiguous()
    R, C = x.shape
    G = recipe.group_size
    rb, cb = triton.cdiv(R, G), triton.cdiv(C, G)
    q, s = transposed_outputs(C, R, cb if tile_scale else C, recipe, x.device, pad_to)
    if R and C:
        xs = x_scale.contiguous() if x_scale is not None else s
        _quant_t_kernel[(rb, cb)](x, xs, q, s, R, C, x.stride(0), xs.stride(0), q.stride(0), s.stride(0),
                                  1.0 / recipe.fp8_max, recipe.fp8_max, recipe.amax_eps, G=G,
                                  DEQUANT=x_scale is not None, TILE_SCALE=tile_scale,
                                  UE8M0=recipe.scale_fmt == "ue8m0", TRANSPOSE=True, WIDE=wide_offsets(x, q),
                                  num_warps=8)
    return q, s


def quantize_weight_triton(w: torch.Tensor, recipe: FP8Recipe, out: tuple[torch.Tensor, torch.Tensor] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (q [N, K], scale_inv [ceil(N/G), ceil(K/G)]) in GxG blocks, one program per block;
    ``out``: write into these (row-contiguous, e.g. the weight cache's own slices) instead of new tensors."""
    w = w.contiguous()
    R, C = w.shape
    G = recipe.group_size
    rb, cb = triton.cdiv(R, G), triton.cdiv(C, G)
    if out is not None:
        q, s = out
        if (q.shape != (R, C) or s.shape != (rb, cb) or q.dtype != recipe.dtype or s.dtype != torch.float32
                or q.stride(1) != 1 or s.stride(1) != 1 or q.device != w.device or s.device != w.device):
            raise ValueError(f"quantize_weight_triton: out must be fp8 [{R}, {C}] and fp32 [{rb}, {cb}] row-contiguous "
                             f"on {w.device}, got {tuple(q.shape)} {q.dtype} / {tuple(s.shape)} {s.dtype}")
    else:
        q = torch.empty((R, C), dtype=recipe.dtype, device=w.device)
        s = torch.empty((rb, cb), dtype=torch.float32, device=w.device)
    if R and C:
        _quant_t_kernel[(rb, cb)](w, s, q, s, R, C, w.stride(0), s.stride(0), q.stride(0), s.stride(0),
                                  1.0 / recipe.fp8_max, recipe.fp8_max, recipe.amax_eps, G=G, DEQUANT=False,
                                  TILE_SCALE=True, UE8M0=recipe.scale_fmt == "ue8m0", TRANSPOSE=False,
                                  WIDE=wide_offsets(w, q), num_warps=8)
    return q, s


@triton.jit
def _swiglu_tile(y_ptr, rows, cols, mask, stride_ym, F, ROUND_BF16: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    """fp32 ``silu(gate) * up`` of a [rows, cols] tile of y = [gate | up], silu rounded to BF16 first when
    ROUND_BF16 (as the eager ops round it; the caller rounds the product)."""
    base = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + F, mask=mask, other=0.0).to(tl.float32)
    # torch's CUDA silu: x / (1 + expf(-x)) in fp32 with IEEE division, then the tensor's dtype
    # (libdevice's expf is CUDA's; tl.exp is the fast approximation; the CPU interpreter has only it)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + e)
    if ROUND_BF16:
        silu = silu.to(tl.bfloat16).to(tl.float32)
    return silu * up


@triton.jit
def _swiglu_quant_kernel(y_ptr, q_ptr, s_ptr, M, F, stride_ym, stride_qm, stride_sm, stride_sg,
                         inv_max, fmax, eps, G: tl.constexpr, BLOCK_M: tl.constexpr, UE8M0: tl.constexpr,
                         ROUND_BF16: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, WIDE: tl.constexpr):
    """a = silu(gate) * up for y = [gate | up] (Megatron's fused fc1 output), rounded as the eager
    torch ops round it (silu to the input dtype, then the product), quantized in 1xG groups."""
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if WIDE:  # 64-bit element offsets (wide_offsets)
        rows = rows.to(tl.int64)
    cols = g * G + tl.arange(0, G)
    mask = (rows[:, None] < M) & (cols[None, :] < F)
    a = _swiglu_tile(y_ptr, rows, cols, mask, stride_ym, F, ROUND_BF16, LIBDEVICE_EXP)
    if ROUND_BF16:
        a = a.to(tl.bfloat16).to(tl.float32)
    quantize_store_groups(a, rows, cols, mask, g, q_ptr, s_ptr, M, stride_qm, stride_sm, stride_sg, inv_max, fmax,
                           eps, UE8M0)


def swiglu_quant_triton(y: torch.Tensor, recipe: FP8Recipe, scale_col_major: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``y [..., 2F]`` (bf16 or fp32) -> the 1xG quantization of ``silu(y[..., :F]) * y[..., F:]``:
    (q [..., F], scale_inv) in one pass (the activation is never written in BF16). Same bytes as
    ``quant.quantize_act(quant.swiglu(y))`` (tested on the H200)."""
    if y.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"swiglu_quant_triton: bf16 or fp32 input expected, got {y.dtype}")
    lead, F2 = y.shape[:-1], y.shape[-1]
    y2 = rows_2d(y)
    M, F, G = y2.shape[0], F2 // 2, recipe.group_size
    q, s, ng = act_outputs(M, F, recipe, y.device, scale_col_major)
    if M:
        block_m = 16 if M >= 4096 else 4
        _swiglu_quant_kernel[(triton.cdiv(M, block_m), ng)](
            y2, q, s, M, F, y2.stride(0), q.stride(0), s.stride(0), s.stride(1), 1.0 / recipe.fp8_max,
            recipe.fp8_max, recipe.amax_eps, G=G, BLOCK_M=block_m, UE8M0=recipe.scale_fmt == "ue8m0",
            ROUND_BF16=y.dtype == torch.bfloat16, LIBDEVICE_EXP=not triton_interpreted(),
            WIDE=wide_offsets(y2, q), num_warps=4)
    if scale_col_major:
        return q.view(*lead, F), s
    return q.view(*lead, F), s.view(*lead, ng)


@triton.jit
def _swiglu_kernel(y_ptr, a_ptr, M, F, stride_ym, stride_am, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
                   ROUND_BF16: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, WIDE: tl.constexpr):
    """a = silu(gate) * up for y = [gate | up], written in ``a``'s dtype and rounded as the eager torch
    ops round it (``_swiglu_quant_kernel``'s arithmetic without the quantization)."""
    pid_m = tl.program_id(0)
    pid_f = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if WIDE:  # 64-bit element offsets (wide_offsets)
        rows = rows.to(tl.int64)
    cols = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows[:, None] < M) & (cols[None, :] < F)
    a = _swiglu_tile(y_ptr, rows, cols, mask, stride_ym, F, ROUND_BF16, LIBDEVICE_EXP)
    tl.store(a_ptr + rows[:, None] * stride_am + cols[None, :], a.to(a_ptr.dtype.element_ty), mask=mask)


def swiglu_triton(y: torch.Tensor) -> torch.Tensor:
    """``y [..., 2F]`` (bf16 or fp32) -> ``silu(y[..., :F]) * y[..., F:]`` [..., F] in ``y``'s dtype, one
    pass (torch's eager form is a silu and a mul over strided halves, two launches and a BF16
    intermediate); the bytes of ``quant.swiglu`` (tested on the H200)."""
    if y.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"swiglu_triton: bf16 or fp32 input expected, got {y.dtype}")
    lead, F2 = y.shape[:-1], y.shape[-1]
    y2 = rows_2d(y)
    M, F = y2.shape[0], F2 // 2
    a = torch.empty((M, F), dtype=y.dtype, device=y.device)
    if M and F:
        block_m, block_f = 4, 512
        _swiglu_kernel[(triton.cdiv(M, block_m), triton.cdiv(F, block_f))](
            y2, a, M, F, y2.stride(0), a.stride(0), BLOCK_M=block_m, BLOCK_F=block_f,
            ROUND_BF16=y.dtype == torch.bfloat16, LIBDEVICE_EXP=not triton_interpreted(), WIDE=wide_offsets(y2, a),
            num_warps=4, enable_fp_fusion=False)
    return a.view(*lead, F)


@triton.jit
def _swiglu_bwd_kernel(y_ptr, da_ptr, dy_ptr, M, F, stride_ym, stride_dam, stride_dym,
                       BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                       WIDE: tl.constexpr):
    """d/dy of ``silu(gate) * up`` for ``y = [gate | up]`` given ``da``: fp32 math, in the order of
    ``quant.swiglu_backward``'s torch statement, written in ``dy``'s dtype."""
    pid_m = tl.program_id(0)
    pid_f = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if WIDE:  # 64-bit element offsets (wide_offsets)
        rows = rows.to(tl.int64)
    cols = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows[:, None] < M) & (cols[None, :] < F)
    base = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + F, mask=mask, other=0.0).to(tl.float32)
    da = tl.load(da_ptr + rows[:, None] * stride_dam + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:  # torch's CUDA sigmoid: 1 / (1 + expf(-x)), IEEE division
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    sig = tl.math.div_rn(tl.full(gate.shape, 1.0, tl.float32), 1.0 + e)
    dgate = da * up * sig * (1.0 + gate * (1.0 - sig))
    dup = da * gate * sig
    out = dy_ptr + rows[:, None] * stride_dym + cols[None, :]
    tl.store(out, dgate.to(dy_ptr.dtype.element_ty), mask=mask)
    tl.store(out + F, dup.to(dy_ptr.dtype.element_ty), mask=mask)


def swiglu_backward_triton(y: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """``y [..., 2F]``, ``da [..., F]`` -> ``dy [..., 2F]`` in ``y``'s dtype: the gradient of
    ``silu(gate) * up`` in one pass (read y and da once, write dy once) instead of ~12 eager fp32 ops,
    a cat and their temporaries. Same fp32 arithmetic as ``quant.swiglu_backward`` (no FMA)."""
    lead, F2 = y.shape[:-1], y.shape[-1]
    y2, da2 = rows_2d(y), rows_2d(da)
    M, F = y2.shape[0], F2 // 2
    dy = torch.empty((M, F2), dtype=y.dtype, device=y.device)
    if M and F:
        block_m, block_f = 4, 512
        _swiglu_bwd_kernel[(triton.cdiv(M, block_m), triton.cdiv(F, block_f))](
            y2, da2, dy, M, F, y2.stride(0), da2.stride(0), dy.stride(0), BLOCK_M=block_m, BLOCK_F=block_f,
            LIBDEVICE_EXP=not triton_interpreted(), WIDE=wide_offsets(y2, da2, dy), num_warps=4,
            enable_fp_fusion=False)
    return dy.view(*lead, F2)


@triton.jit
def _dual_quant_kernel(x_ptr, qr_ptr, sr_ptr, qt_ptr, st_ptr, M, N, stride_xm, stride_qrm,
                       stride_srm, stride_srg, stride_qtn, stride_stn, inv_max, fmax, eps, G: tl.constexpr,
                       RB: tl.constexpr, UE8M0: tl.constexpr, WIDE: tl.constexpr):
    """One [G tokens, G columns] tile of a gradient ``d`` [M, N], quantized both ways the backward needs:
    1xG groups along N (dgrad; ``qr`` [M, N], ``sr``) and 1xG groups along the tokens, stored transposed
    (wgrad; ``qt`` [N, M], ``st`` [N, ceil(M/G)]): ``d`` comes from memory once instead of twice. RB < G: the tile is walked in
    RB-row chunks twice (row groups and column amax, then the column quantization from values re-read
    while they sit in L2), holding an RB x G chunk in registers instead of the whole tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols = pid_n * G + tl.arange(0, G)
    base = pid_m * G
    if WIDE:  # 64-bit element offsets (wide_offsets)
        cols = cols.to(tl.int64)
        base = base.to(tl.int64)
    if RB == G:
        rows = base + tl.arange(0, G)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        d = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        quantize_store_groups(d, rows, cols, mask, pid_n, qr_ptr, sr_ptr, M, stride_qrm, stride_srm, stride_srg,
                               inv_max, fmax, eps, UE8M0)
        amax = tl.maximum(tl.max(tl.abs(d), axis=0), eps)  # per column, over this tile's G tokens
        scale_inv, mult = scale_and_multiplier(amax, inv_max, fmax, UE8M0)
        q = tl.clamp(d * mult[None, :], -fmax, fmax).to(tl.float8e4nv)
        tl.store(qt_ptr + cols[None, :] * stride_qtn + rows[:, None], q, mask=mask)
    else:
        camax = tl.zeros((G,), tl.float32)
        for i in tl.static_range(G // RB):
            rows = base + i * RB + tl.arange(0, RB)
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            d = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            quantize_store_groups(d, rows, cols, mask, pid_n, qr_ptr, sr_ptr, M, stride_qrm, stride_srm,
                                   stride_srg, inv_max, fmax, eps, UE8M0)
            camax = tl.maximum(camax, tl.max(tl.abs(d), axis=0))
        scale_inv, mult = scale_and_multiplier(tl.maximum(camax, eps), inv_max, fmax, UE8M0)
        for i in tl.static_range(G // RB):
            rows = base + i * RB + tl.arange(0, RB)
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            d = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(d * mult[None, :], -fmax, fmax).to(tl.float8e4nv)
            tl.store(qt_ptr + cols[None, :] * stride_qtn + rows[:, None], q, mask=mask)
    tl.store(st_ptr + cols * stride_stn + pid_m, scale_inv, mask=cols < N)


def dual_quant_plan() -> tuple[int, int]:
    """(rows per register chunk, warps) of the dual gradient quantizer; ``quantize_dual_triton(plan=...)`` takes
    another (``tools/tune_dual_quant.py`` sweeps them): rows a power of two <= 128, warps in 1/2/4/8/16."""
    # H200 sweep (tools/tune_dual_quant.py, docs/benchmarks.md): the whole 128x128 tile in registers, 4 warps
    # (1.25-1.28x the two separate quantizers at 4096 x 4096 / 6144)
    return 128, 4


def quantize_dual_triton(d: torch.Tensor, recipe: FP8Recipe, scale_col_major: bool = False, plan=None,
                         pad_to: int = 0):
    """A gradient ``d`` [M, N] -> (q [M, N], scale_inv [M, ceil(N/G)], qt [N, M], scale_inv_t [N, ceil(M/G)]):
    ``quantize_act_triton(d)`` and ``quantize_transposed_triton(d, tile_scale=False, pad_to=pad_to)`` (the same
    bytes and scales) in one pass over ``d``."""
    d = d if d.stride(-1) == 1 else d.contiguous()
    M, N = d.shape
    G = recipe.group_size
    qr, sr, _ = act_outputs(M, N, recipe, d.device, scale_col_major)
    qt, st = transposed_outputs(N, M, N, recipe, d.device, pad_to)
    if M and N:
        rb, warps = plan or dual_quant_plan()
        if not (rb > 0 and rb & (rb - 1) == 0 and rb <= 128 and warps in (1, 2, 4, 8, 16)):
            raise ValueError(f"dual quantizer plan {(rb, warps)!r}: expected (rows, warps) with rows a power of two "
                             f"<= 128 and warps in 1/2/4/8/16, e.g. (128, 4)")
        _dual_quant_kernel[(triton.cdiv(M, G), triton.cdiv(N, G))](
            d, qr, sr, qt, st, M, N, d.stride(0), qr.stride(0), sr.stride(0), sr.stride(1),
            qt.stride(0), st.stride(0), 1.0 / recipe.fp8_max, recipe.fp8_max, recipe.amax_eps, G=G, RB=min(rb, G),
            UE8M0=recipe.scale_fmt == "ue8m0", WIDE=wide_offsets(d, qr, qt), num_warps=warps, enable_fp_fusion=False)
    return qr, sr, qt, st


@triton.jit
def _transpose_kernel(x_ptr, y_ptr, R, C, stride_xr, stride_yc, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK + tl.arange(0, BLOCK)
    cols = pid_c * BLOCK + tl.arange(0, BLOCK)
    if WIDE:  # 64-bit element offsets (wide_offsets)
        rows = rows.to(tl.int64)
        cols = cols.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :], mask=(rows[:, None] < R) & (cols[None, :] < C))
    xt = tl.trans(x)  # [cols, rows]: both the load and the store are row-contiguous
    tl.store(y_ptr + cols[:, None] * stride_yc + rows[None, :], xt, mask=(cols[:, None] < C) & (rows[None, :] < R))


def transpose_bytes_triton(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x.t()`` for a 2-D tensor of 1-byte elements (the FP8 weight for
    dgrad: cuBLAS's FP8 GEMM reads both operands K-major). torch's strided copy of an fp8 tensor
    ran at ~0.35 TB/s on the H200 (0.32 ms per 8B FFN weight, per micro-batch); this is a tiled
    transpose through shared memory."""
    if x.dim() != 2 or x.element_size() != 1:
        raise ValueError(f"transpose_bytes_triton: 2-D 1-byte tensor expected, got {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    R, C = x.shape
    xb = x.view(torch.uint8)
    y = torch.empty((C, R), dtype=torch.uint8, device=x.device)
    if R and C:
        block = 64
        _transpose_kernel[(triton.cdiv(R, block), triton.cdiv(C, block))](xb, y, R, C, xb.stride(0), y.stride(0),
                                                                          BLOCK=block, WIDE=wide_offsets(xb),
                                                                          num_warps=4)
    return y.view(x.dtype)


@triton.jit
def _kv_qdq_kernel(x_ptr, y_ptr, q_ptr, s_ptr, M, stride_xm, stride_ym, inv_max, fmax, eps, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BYTES: tl.constexpr, WIDE: tl.constexpr):
    # BLOCK_M rows (a token's KV head each) of D values: amax, the ue8m0 scale, the E4M3 cast and back, in one pass
    # (BYTES: the E4M3 bytes [M, D] and scales [M] stored too; WIDE: 64-bit element offsets, wide_offsets)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if WIDE:
        rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < M) & (cols[None, :] < D)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), eps)
    scale_inv, mult = scale_and_multiplier(amax, inv_max, fmax, True)
    q = tl.clamp(x * mult[:, None], -fmax, fmax).to(tl.float8e4nv)
    if BYTES:  # stored as their bit pattern, before the values: storing the E4M3 tensor after converting it to
        # fp32 (the order of the statements below) wrote wrong values for two of every four columns on the H100
        # (Triton 3.6, CUDA 13), while the bytes and scales were right
        tl.store(q_ptr + rows[:, None] * D + cols[None, :], q.to(tl.uint8, bitcast=True), mask=mask)
        tl.store(s_ptr + rows, scale_inv, mask=rows < M)
    y = q.to(tl.float32) * scale_inv[:, None]  # exact: an E4M3 value times a power of two
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def kv_qdq_triton(x: torch.Tensor, recipe: FP8Recipe, with_bytes: bool = False):
    """``quant.kv_qdq`` on CUDA: ``x [..., d]`` (any strides with a unit last one) -> a new contiguous tensor of
    ``x``'s shape and dtype; ``recipe`` is the KV rule (``quant.kv_rule``: ue8m0 scales). ``with_bytes``: returns
    ``(q [..., d] e4m3, scale_inv [...] fp32, values)`` from the same pass (``quant.quantize_kv``'s bytes and
    scales)."""
    if recipe.scale_fmt != "ue8m0":
        raise ValueError("kv_qdq_triton: the FP8 KV cache's scales are powers of two (pass quant.kv_rule(recipe))")
    D = x.shape[-1]
    x2 = rows_2d(x)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    M = x2.shape[0]
    q = s = y  # unused (BYTES off)
    if with_bytes:
        q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        block_m = 8
        qb = q.view(torch.uint8) if with_bytes else q  # the kernel stores the bytes' bit pattern
        _kv_qdq_kernel[(triton.cdiv(M, block_m),)](x2, y, qb, s, M, x2.stride(0), y.stride(0), 1.0 / recipe.fp8_max,
                                                   recipe.fp8_max, recipe.amax_eps, D=D,
                                                   BLOCK_D=triton.next_power_of_2(D), BLOCK_M=block_m,
                                                   BYTES=with_bytes, WIDE=wide_offsets(x2, y), num_warps=4)
    if with_bytes:
        return q.view(x.shape), s.view(x.shape[:-1]), y.view(x.shape)
    return y.view(x.shape)
