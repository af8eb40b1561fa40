"""Exact-mode attention: one kernel for the training forward and for the decoder, the same bits for a
query whichever of the two computes it (``precision.exact`` on CUDA; Triton).

A decode step (one query over a KV cache) and the training forward (every query of a sequence at once)
round differently in SDPA, and the activation quantizer after the attention turns those last bits into
whole E4M3 steps. This kernel reduces over keys in a fixed order that depends on nothing but the query's
own position, so the rollout's decoder and the trainer's forward give a query the same output bytes:

- one program owns a tile of ``R`` query rows: ``R // hpg`` consecutive positions x the ``hpg`` query heads of one
  key/value group, so a program reads its group's K/V tiles once for all of them (grouped-query attention); the
  decoder's tile holds one position (``R = max(16, next_pow2(hpg))``), the trainer's 32 rows (:data:`TRAIN_PLAN`);
- keys are indexed by position: the trainer's sequences start at column 0, and the exact decoder's cache writes
  each row's tokens from its own position 0 (no left pads in it: ``rollout/decode.py``); keys are visited in
  blocks of ``BLOCK_N`` from position 0, so every query sees the same blocks with the same contents in both, and
  a block's tiles start on a ``BLOCK_N`` edge (aligned, wide loads); within a block the causal mask (key <= query
  position) is applied to the fp32 scores;
- per block, in this order: ``s = (q . k) * scale * log2(e)`` (tensor cores, fp32 accumulation), masked keys
  -> -inf, ``m' = max(m, max(s))``, ``alpha = 2^(m - m')``, ``p = 2^(s - m')``, ``l = l * alpha + p_fp16 . 1``
  (the block's weight sum on the tensor cores too, in their k order, not a reduction whose order is the tile
  layout's), ``acc = acc * alpha + p_bf16 . v``; at the end ``acc / l``. A block past a row's own last key (the
  tile's other rows need it) is all masked: alpha = 1, p = 0, and acc, l, m come out of it bit for bit unchanged,
  so the number of blocks a program walks does not change a row. The blocks inside the keys' length load
  unmasked (whole 16-byte vectors along a key-major V's rows: the length is not specialized on, so a mask against
  it would load a byte at a time), the one past it masked;
- rows of a tile never mix (each output row of an MMA is the dot products of its own query row). Lengths are not
  specialized on (``do_not_specialize``: a one-query step is not a separate binary). That the decoder's 16-row and
  the trainer's 32-row tiles give a row the same bits is a property of the tensor-core instruction both compile to,
  measured on the H200 (tools/exact_bench.py, tests/test_gpu_exact.py); 64 rows compile to another one (wgmma) and
  change the bits;
- an FP8 KV cache (``precision.kv_cache=fp8``) is read as its E4M3 bytes and power-of-two scales: the bytes
  converted to fp16 (exact; one instruction per pair) for fp16 tensor cores with q converted once (exact above
  2^-14), a key's scale (times ``scale * log2(e)``) multiplying its fp32 score and a value's scale (times ``P_F16``,
  divided out at the end: fp16's normal range) its softmax weight before the weight's rounding, as the key-major
  decode kernel does; powers of two, so the scales round nothing. With fp32 inputs (the CPU tests) the result is
  the kernel's over the dequantized values bit for bit. V's bytes are key-major (``[d, L]`` memory), so the
  P.V product's operand tiles are contiguous along the keys it sums over (one E4M3 -> fp16 conversion per pair,
  no byte-wise gathers). The trainer hands the kernel the same bytes and scales in the same layout (the recipe's
  KV rule applied to its K/V, ``models/spec.py``), so both run the FP8 variant of the kernel.

A decode step over the FP8 cache runs the same block steps on transposed tiles (:func:`_exact_decode_keys_kernel`):
S^T = K q^T and O^T += V^T P^T with the group's query heads as the MMAs' narrow side (8 columns for 4 heads, where the
head-major tile pads them to 16 rows) and the weight sums as 1 . P^T. An MMA's output element is its row's and
column's products summed in k order whichever operand holds which, so the bytes are the head-major kernel's, the
trainer's (tests/test_gpu_exact.py on the H100; the interpreter's dot has the same property, tests/common.py); its
loop takes two key blocks an iteration and issues 15.3 warp-instructions per key against the head-major tile's 29.4
(Triton 3.6, sm_90a: ``tools/kernel_sass.py exact-attn``), and over the rollout's cache it takes 110 us per layer
where the default mode's decode kernel takes 106 (H100, 64 rows x 2,176 keys; docs/decode_attention.md, "Exact
mode's attention"). From its epilogue it writes the output projection's FP8 input, as the default kernel does.

No key splits (they would reorder the softmax's sum): at batch 64 an 8B model's decode step already has
512 (row, group) programs. The training backward recomputes through SDPA (:class:`ExactAttention`): only the
forward values must match the rollout's. Runs under ``TRITON_INTERPRET=1`` on CPU (the tests).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from megatron_jetrl.kernels.decode_attn import P_F16, group_query, load_whole, output_quant, store_quantized
from megatron_jetrl.precision.recipe import FP8Recipe

BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
# The key-major decode kernel's plan (warps, stages, key blocks an iteration). Under 4 warps: from 4 on a compiler may
# give its 64-key and 128-feature tiles to warpgroup MMAs (HGMMA; Triton 3.9 does, `tools/kernel_sass.py exact-attn
# --plans fp8keys:64:4:3:8`), another instruction than the trainer's warp-level HMMA, and other bits. Two blocks an
# iteration, each block's steps unchanged (the same bytes): a program is bound by its loop's latency, and the second
# block's loads and scores overlap the first one's softmax. H100, 64 rows x 2,176 keys over a decoder-shaped cache
# (`tools/exact_bench.py --parts long,cache`): 110.3 us per layer against 122.3 with one block an iteration (2 warps,
# 3 stages; 2 or 4 stages ran alike), 120.7 with 2 blocks and 3 stages, 123.0 with 4 warps; the default decode kernel
# 106.1.
DECODE_KEYS_PLAN = (2, 2, 2)


def keys_plan_of(keys_plan: tuple[int, ...] | None = None) -> tuple[int, int, int]:
    """(warps, stages, key blocks an iteration) of a key-major decode plan given as (warps, stages[, blocks]); None:
    :data:`DECODE_KEYS_PLAN`. One block an iteration where the plan names none."""
    warps, stages, per_iter = (*(keys_plan or DECODE_KEYS_PLAN), 1)[:3]
    if per_iter not in (1, 2):
        raise ValueError(f"exact_attention: keys_plan {keys_plan}: 1 or 2 key blocks an iteration")
    return warps, stages, per_iter


@triton.jit
def _head_block(q, qpos, k_row, v_row, ks_row, vs_row, j, L, m_i, l_i, acc, sk_l, sv_l, sv_d, qk_scale,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                KV_FP8: tl.constexpr, F16: tl.constexpr, IEEE: tl.constexpr, WIDE: tl.constexpr):
    """Key block ``j`` of the head-major kernel (``MASKED``: its keys from L on read as 0 and weigh 0) -> the online
    softmax's updated (max, sum, O)."""
    keys = j * BLOCK_N + tl.arange(0, BLOCK_N)
    dd = tl.arange(0, BLOCK_D)
    kk = keys.to(tl.int64) if WIDE else keys  # 32-bit offsets within a (row, group) where they fit
    k_ptrs = k_row + kk[:, None] * sk_l + dd[None, :]
    v_ptrs = v_row + kk[:, None] * sv_l + dd[None, :] * sv_d
    if MASKED:
        km = keys < L
        kt = tl.load(k_ptrs, mask=km[:, None] & (dd < D)[None, :], other=0.0)
        vt = tl.load(v_ptrs, mask=km[:, None] & (dd < D)[None, :], other=0.0)
        ok = (keys[None, :] <= qpos[:, None]) & km[None, :]
    else:
        kt = load_whole(k_ptrs, (dd < D)[None, :], D, BLOCK_D)
        vt = load_whole(v_ptrs, (dd < D)[None, :], D, BLOCK_D)
        ok = keys[None, :] <= qpos[:, None]
    if KV_FP8:  # E4M3 -> fp16 (fp32 on the CPU): exact; the power-of-two scales act on the scores and weights
        kt = kt.to(q.dtype)
        vt = vt.to(q.dtype)
        if MASKED:
            kscale = tl.load(ks_row + kk, mask=km, other=1.0) * qk_scale
            vscale = tl.load(vs_row + kk, mask=km, other=0.0)
        else:
            kscale = tl.load(ks_row + kk) * qk_scale
            vscale = tl.load(vs_row + kk)
    if IEEE:
        sc = tl.dot(q, tl.trans(kt), input_precision="ieee", out_dtype=tl.float32)
    else:
        sc = tl.dot(q, tl.trans(kt), out_dtype=tl.float32)
    if KV_FP8:
        sc = sc * kscale[None, :]
    else:
        sc = sc * qk_scale
    sc = tl.where(ok, sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new[:, None])
    # the block's weight sums on the tensor cores (P . 1), not a reduction whose order is the tile layout's: the
    # key-major decode kernel computes the same sums as 1 . P^T
    ones = tl.full([BLOCK_N, 16], 1.0, tl.float32 if IEEE else tl.float16)
    if IEEE:
        sums = tl.dot(p, ones, input_precision="ieee", out_dtype=tl.float32)
    else:
        sums = tl.dot(p.to(tl.float16), ones, out_dtype=tl.float32)
    l_i = l_i * alpha + tl.max(sums, 1)  # 16 equal columns
    if KV_FP8:  # the value's scale (times P_F16 on fp16, inside its normal range) on its weight
        p = p * (vscale * (P_F16 if F16 else 1.0))[None, :]
    if IEEE:
        pv = tl.dot(p.to(vt.dtype), vt, input_precision="ieee", out_dtype=tl.float32)
    else:
        pv = tl.dot(p.to(vt.dtype), vt, out_dtype=tl.float32)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit(do_not_specialize=["S", "L"])
def _exact_attn_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, q0_ptr, S, L, qk_scale,
                       sq_s, sq_b, sq_h, sk_b, sk_g, sk_l, sv_b, sv_g, sv_l, sv_d, ss_b, ss_g, so_s, so_b, so_h,
                       HPG: tl.constexpr, R: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, F16: tl.constexpr, IEEE: tl.constexpr,
                       WIDE: tl.constexpr):
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    g = tl.program_id(2).to(tl.int64)
    P: tl.constexpr = R // HPG  # positions per tile
    r = tl.arange(0, R)
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    qi = t * P + r // HPG  # query index in this call
    head = g * HPG + r % HPG
    rm = (r < P * HPG) & (qi < S)
    q0 = tl.load(q0_ptr + b)  # the row's first query's position (the decoder's step position; 0 in training)
    qpos = q0 + qi  # negative: a left pad of the decoder's prefill (no key; output 0)
    q = tl.load(q_ptr + qi.to(tl.int64)[:, None] * sq_s + b * sq_b + head[:, None] * sq_h + dd[None, :],
                mask=rm[:, None] & dm[None, :], other=0.0)
    if F16:  # the FP8 cache on fp16 tensor cores (E4M3 -> fp16: one instruction per pair); q exact in fp16 above 2^-14
        q = q.to(tl.float16)
    last = q0 + tl.minimum(t * P + P, S) - 1  # the tile's last query position
    nblocks = tl.cdiv(tl.maximum(last + 1, 0), BLOCK_N).to(tl.int32)
    m_i = tl.full([R], -1.0e30, tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, BLOCK_D], tl.float32)
    k_row = k_ptr + b * sk_b + g * sk_g
    v_row = v_ptr + b * sv_b + g * sv_g
    s_row = b * ss_b + g * ss_g
    # the blocks inside the L keys unmasked (whole-vector loads along a key-major V's rows), then the one that
    # passes L, if any, masked: the same values either way
    full = tl.minimum(nblocks, L // BLOCK_N)
    for j in range(0, full):
        m_i, l_i, acc = _head_block(q, qpos, k_row, v_row, ks_ptr + s_row, vs_ptr + s_row, j, L, m_i, l_i, acc, sk_l,
                                    sv_l, sv_d, qk_scale, D, BLOCK_D, BLOCK_N, False, KV_FP8, F16, IEEE, WIDE)
    for j in range(full, nblocks):
        m_i, l_i, acc = _head_block(q, qpos, k_row, v_row, ks_ptr + s_row, vs_ptr + s_row, j, L, m_i, l_i, acc, sk_l,
                                    sv_l, sv_d, qk_scale, D, BLOCK_D, BLOCK_N, True, KV_FP8, F16, IEEE, WIDE)
    if F16:
        acc = acc * (1.0 / P_F16)
    out = acc / tl.maximum(l_i, 1.0e-30)[:, None]  # l >= 1 for a row with a key; a pad query (no key) gets 0
    tl.store(o_ptr + qi.to(tl.int64)[:, None] * so_s + b * so_b + head[:, None] * so_h + dd[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rm[:, None] & dm[None, :])


@triton.jit
def _keys_block(qt, qpos, k_row, v_row, ks_row, vs_row, j, L, m_i, l_i, acc, sk_l, sv_d, qk_scale,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                F16: tl.constexpr, IEEE: tl.constexpr, WIDE: tl.constexpr):
    """Key block ``j`` of the key-major decode kernel: :func:`_head_block`'s steps on transposed tiles (S^T, P^T,
    O^T) -> the updated (max, sum, O^T)."""
    keys = j * BLOCK_N + tl.arange(0, BLOCK_N)
    dd = tl.arange(0, BLOCK_D)
    kk = keys.to(tl.int64) if WIDE else keys
    k_ptrs = k_row + kk[:, None] * sk_l + dd[None, :]
    v_ptrs = v_row + dd[:, None] * sv_d + kk[None, :]  # V^T's tile: key-major memory, contiguous along the keys
    if MASKED:
        km = keys < L
        kt = tl.load(k_ptrs, mask=km[:, None] & (dd < D)[None, :], other=0.0)
        vt = tl.load(v_ptrs, mask=(dd < D)[:, None] & km[None, :], other=0.0)
        kscale = tl.load(ks_row + kk, mask=km, other=1.0) * qk_scale
        vscale = tl.load(vs_row + kk, mask=km, other=0.0)
        ok = (keys <= qpos) & km
    else:
        kt = load_whole(k_ptrs, (dd < D)[None, :], D, BLOCK_D)
        vt = load_whole(v_ptrs, (dd < D)[:, None], D, BLOCK_D)
        kscale = tl.load(ks_row + kk) * qk_scale
        vscale = tl.load(vs_row + kk)
        ok = keys <= qpos
    kt = kt.to(qt.dtype)  # E4M3 -> fp16 (fp32 on the CPU): exact
    vt = vt.to(qt.dtype)
    if IEEE:
        st = tl.dot(kt, qt, input_precision="ieee", out_dtype=tl.float32)
    else:
        st = tl.dot(kt, qt, out_dtype=tl.float32)
    st = st * kscale[:, None]
    st = tl.where(ok[:, None], st, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(st, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(st - m_new[None, :])
    ones = tl.full([16, BLOCK_N], 1.0, tl.float32 if IEEE else tl.float16)
    if IEEE:
        sums = tl.dot(ones, p, input_precision="ieee", out_dtype=tl.float32)
    else:
        sums = tl.dot(ones, p.to(tl.float16), out_dtype=tl.float32)
    l_i = l_i * alpha + tl.max(sums, 0)  # 16 equal rows
    p = p * (vscale * (P_F16 if F16 else 1.0))[:, None]
    if IEEE:
        pv = tl.dot(vt, p.to(vt.dtype), input_precision="ieee", out_dtype=tl.float32)
    else:
        pv = tl.dot(vt, p.to(vt.dtype), out_dtype=tl.float32)
    return m_new, l_i, acc * alpha[None, :] + pv


@triton.jit(do_not_specialize=["L"])
def _exact_decode_keys_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, q0_ptr, L, qk_scale, sq_b, sq_h,
                              sk_b, sk_g, sk_l, sv_b, sv_g, sv_d, ss_b, ss_g, so_b, so_h,
                              xq_ptr, xs_ptr, sxq_b, sxs_b, sxs_h, inv_max, fmax, eps,
                              HPG: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_N: tl.constexpr, F16: tl.constexpr, IEEE: tl.constexpr, WIDE: tl.constexpr,
                              QUANT: tl.constexpr, UE8M0: tl.constexpr, PAIRS: tl.constexpr):
    """A decode step over the FP8 cache, key-major: one program per (row, KV group), its query heads the MMAs'
    narrow side (``BLOCK_H`` = 8 for 4 heads, where the head-major tile pads them to 16 rows), S^T = K q^T and
    O^T += V^T P^T with K's and V^T's tiles (V key-major: ``[d, L]`` memory) the first operands. Each step of
    :func:`_exact_attn_kernel`'s block loop, on transposed tiles: the same 64-key blocks from position 0, the same
    products in the same k order (an MMA's output element is its row's and column's k-ordered products, whichever
    operand holds which), the same elementwise operations in the same order, the block's weight sums as 1 . P^T
    where the head-major kernel takes P . 1; so a query's output is its bytes in the trainer's call. ``QUANT``: also
    the output projection's FP8 input from the stored output, the bytes and scales of the trainer's activation
    quantizer (``decode_attn.store_quantized``). ``PAIRS``: two key blocks an iteration (then an odd one, then the
    masked one), each block's steps as they are, so the same bytes."""
    b, g, heads, hm, dd, dm, q = group_query(q_ptr, sq_b, sq_h, HPG, D, BLOCK_H, BLOCK_D)
    if F16:
        q = q.to(tl.float16)
    qt = tl.trans(q)  # [BLOCK_D, BLOCK_H]
    qpos = tl.load(q0_ptr + b)  # the step's position: keys 0..qpos
    nblocks = tl.cdiv(tl.maximum(qpos + 1, 0), BLOCK_N).to(tl.int32)
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_D, BLOCK_H], tl.float32)  # O^T
    k_row = k_ptr + b * sk_b + g * sk_g
    v_row = v_ptr + b * sv_b + g * sv_g
    s_row = b * ss_b + g * ss_g
    full = tl.minimum(nblocks, L // BLOCK_N)  # as the head-major kernel: whole blocks unmasked, then the last
    first = 0
    if PAIRS:  # two blocks an iteration, each block's steps as they are
        for jj in range(0, full // 2):
            for t in tl.static_range(2):
                m_i, l_i, acc = _keys_block(qt, qpos, k_row, v_row, ks_ptr + s_row, vs_ptr + s_row, 2 * jj + t, L,
                                            m_i, l_i, acc, sk_l, sv_d, qk_scale, D, BLOCK_D, BLOCK_N, False, F16, IEEE,
                                            WIDE)
        first = full // 2 * 2
    for j in range(first, full):
        m_i, l_i, acc = _keys_block(qt, qpos, k_row, v_row, ks_ptr + s_row, vs_ptr + s_row, j, L, m_i, l_i, acc,
                                    sk_l, sv_d, qk_scale, D, BLOCK_D, BLOCK_N, False, F16, IEEE, WIDE)
    for j in range(full, nblocks):
        m_i, l_i, acc = _keys_block(qt, qpos, k_row, v_row, ks_ptr + s_row, vs_ptr + s_row, j, L, m_i, l_i, acc,
                                    sk_l, sv_d, qk_scale, D, BLOCK_D, BLOCK_N, True, F16, IEEE, WIDE)
    if F16:
        acc = acc * (1.0 / P_F16)
    out = (acc / tl.maximum(l_i, 1.0e-30)[None, :]).to(o_ptr.dtype.element_ty)  # O^T [BLOCK_D, BLOCK_H]
    mask = dm[:, None] & hm[None, :]
    tl.store(o_ptr + b * so_b + heads[None, :] * so_h + dd[:, None], out, mask=mask)
    if QUANT:
        store_quantized(out, b, heads, hm, dd, mask, xq_ptr, xs_ptr, sxq_b, sxs_b, sxs_h, inv_max, fmax, eps, D, UE8M0,
                        TRANSPOSED=True)


def tile_rows(heads_per_group: int) -> int:
    """Query rows per decode program: the group's heads at one position (at least the MMA's 16 rows)."""
    return max(16, triton.next_power_of_2(heads_per_group))


# The training forward's plan (BLOCK_N, warps, stages, query rows per program): more positions per program than
# the decoder's one (K/V tiles read once for all of them; 240 us vs 309 us with 16 rows at 4 x 1,024 tokens of the
# 8B model on the H200). The rows come out alike up to 32 rows per program (measured bit-equal on the H200:
# tools/exact_bench.py, tests/test_gpu_exact.py); 64 rows changes the tensor-core instruction and the bits.
TRAIN_PLAN = (BLOCK_N, NUM_WARPS, NUM_STAGES, 32)


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q0: torch.Tensor,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, plan: tuple[int, int, int, int] | None = None,
                    keys_plan: tuple[int, ...] | None = None, quant: FP8Recipe | None = None,
                    scale_col_major: bool = False):
    """Causal attention of ``q [S, b, heads, d]`` (query ``i`` of row ``r`` at position ``q0[r] + i``) over keys
    ``k``/``v`` given as ``[b, groups, L, d]`` views indexed by position (key ``j`` of a row in column ``j``: the
    trainer's sequences, and the exact decoder's cache, which writes each row's tokens from its own position 0),
    query ``i`` of row ``r`` reading keys ``0 .. q0[r] + i`` (a negative position: none, output 0); returns
    ``[S, b, heads * d]`` (or writes ``out``, that shape). ``q0`` [b] is an int64 device tensor (read by the kernel:
    one CUDA graph for every step). FP8 K/V (float8_e4m3fn) with ``k_scale``/``v_scale`` ``[b, groups, L]`` (unit last
    stride) are read as bytes and scales. q and k with a unit last stride; v with a unit stride in either of its
    last two dimensions (the FP8 cache keeps V key-major, ``[d, L]`` memory: the P.V product's operand tiles are then
    contiguous along the keys it sums over). A decode step (one query) over such an FP8 cache runs the key-major
    kernel (:func:`_exact_decode_keys_kernel`, ``keys_plan`` (warps, stages[, key blocks an iteration: 1 or 2])
    instead of :data:`DECODE_KEYS_PLAN`),
    every other call the head-major one; ``plan``: (BLOCK_N, warps, stages, query rows per program) instead of the
    decoder's (the trainer's :data:`TRAIN_PLAN`; ``tools/exact_bench.py``), a one-query call's included. ``quant``
    (a recipe): returns ``(out, xq)``, ``xq`` the output's activation quantization for the FP8 output projection as
    :func:`decode_attn.decode_attention` gives it (``scale_col_major`` likewise), written by the key-major kernel;
    None from every other call (the projection's own quantizer computes the same bytes)."""
    S, b, H, D = q.shape
    G, L = k.shape[1], k.shape[2]
    fp8 = k.dtype == torch.float8_e4m3fn
    if (H % G or k.shape != v.shape or k.shape[0] != b or k.shape[3] != D or q.stride(-1) != 1
            or k.stride(-1) != 1 or 1 not in v.stride()[-2:] or q0.shape != (b,)):
        raise ValueError(f"exact_attention: unsupported shapes/strides q {tuple(q.shape)} {tuple(q.stride())}, "
                         f"k {tuple(k.shape)} {tuple(k.stride())}, v {tuple(v.stride())}, q0 {tuple(q0.shape)}")
    if fp8 and (k_scale is None or v_scale is None or k_scale.shape != (b, G, L) or k_scale.stride(-1) != 1
                or v_scale.stride() != k_scale.stride()):
        raise ValueError("exact_attention: FP8 K/V need k_scale/v_scale [b, groups, L] with equal strides, unit last")
    if out is None:
        out = torch.empty((S, b, H * D), dtype=q.dtype, device=q.device)
    if S == 0 or b == 0:
        return out if quant is None else (out, None)
    o = out.view(S, b, H, D)
    if not fp8:
        k_scale = v_scale = k  # unused (KV_FP8 off)
    hpg = H // G
    # a key's offset within its (row, group) in 32 bits unless it can pass 2^31 (e.g. a trainer's [s, b, g, d] K of
    # 64 sequences x 32K tokens); the values are the same either way
    wide = L * max(k.stride(2), k.stride(3), v.stride(2), v.stride(3)) >= 2 ** 31
    if S == 1 and fp8 and v.stride(2) == 1 and plan is None:  # a decode step over the FP8 cache: key-major
        warps, stages, per_iter = keys_plan_of(keys_plan)
        xq, qargs = output_quant(quant, b, H, D, scale_col_major, o[0])
        _exact_decode_keys_kernel[(b, G)](
            q, k, v, k_scale, v_scale, o, q0, L, float(scale) * math.log2(math.e), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(3), k_scale.stride(0),
            k_scale.stride(1), o.stride(1), o.stride(2), *qargs, HPG=hpg, BLOCK_H=max(8, triton.next_power_of_2(hpg)),
            D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_N=BLOCK_N, F16=q.dtype != torch.float32,
            IEEE=q.dtype == torch.float32, WIDE=wide, QUANT=xq is not None,
            UE8M0=xq is not None and quant.scale_fmt == "ue8m0", PAIRS=per_iter == 2, num_warps=warps,
            num_stages=stages)
        return out if quant is None else (out, xq)
    block_n, warps, stages, R = plan or (BLOCK_N, NUM_WARPS, NUM_STAGES, 0)
    R = max(R, tile_rows(hpg))
    grid = (triton.cdiv(S, R // hpg), b, G)
    _exact_attn_kernel[grid](
        q, k, v, k_scale, v_scale, o, q0, S, L, float(scale) * math.log2(math.e),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), *v.stride(),
        k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0, o.stride(0), o.stride(1), o.stride(2),
        HPG=hpg, R=R, D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_N=block_n, KV_FP8=fp8,
        F16=fp8 and q.dtype != torch.float32, IEEE=q.dtype == torch.float32, WIDE=wide, num_warps=warps,
        num_stages=stages)
    return out if quant is None else (out, None)


def key_major(x: torch.Tensor) -> torch.Tensor:
    """``x [..., L, d]`` as a view of ``[..., d, La]`` memory, ``La`` = L rounded up to ``BLOCK_N`` (the FP8 cache's V
    layout, its rows aligned as the decoder's: the kernels' whole-block loads along them are whole 16-byte vectors;
    one copy; the padding is never read: a block past L loads masked)."""
    *lead, L, d = x.shape
    t = x.new_empty(*lead, d, -(-L // BLOCK_N) * BLOCK_N)
    t[..., :L] = x.transpose(-1, -2)
    return t[..., :L].transpose(-1, -2)


class ExactAttention(torch.autograd.Function):
    """The training forward's attention in exact mode: ``q [s, b, heads, d]``, ``k``/``v`` ``[s, b, groups, d]``
    (after RoPE) -> ``[s, b, heads * d]`` from :func:`exact_attention` (keys from position 0, causal). With the
    FP8 KV cache, ``kv8 = (k_bytes, k_scale, v_bytes, v_scale)`` (``[b, groups, s, d]`` E4M3 and ``[b, groups, s]``,
    the bytes the decoder's cache write stores) is what the forward reads, through the same kernel binary as the
    decoder's, and ``k``/``v`` are their dequantized values (the caller's straight-through rounding). The backward
    recomputes the attention of ``q, k, v`` with SDPA and differentiates that: only the forward's bits must match
    the rollout."""

    @staticmethod
    def forward(ctx, q, k, v, scale, kv8=None):
        s, b = q.shape[:2]
        zero = torch.zeros(b, dtype=torch.int64, device=q.device)
        if kv8 is not None:  # V's bytes key-major, as exact mode's FP8 cache holds them
            kb, ks, vb, vs = kv8[0], kv8[1], key_major(kv8[2]), kv8[3]
        else:
            kb, ks, vb, vs = k.permute(1, 2, 0, 3), None, v.permute(1, 2, 0, 3), None
        out = exact_attention(q, kb, vb, scale, zero, ks, vs, plan=TRAIN_PLAN)
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_(True) for t in (q, k, v))
            s, b, heads, d = q.shape
            o = F.scaled_dot_product_attention(qd.permute(1, 2, 0, 3), kd.permute(1, 2, 0, 3), vd.permute(1, 2, 0, 3),
                                               is_causal=True, scale=ctx.scale, enable_gqa=k.shape[2] != heads)
            o = o.permute(2, 0, 1, 3).reshape(s, b, heads * d)
            dq, dk, dv = torch.autograd.grad(o, (qd, kd, vd), dout)
        return dq, dk, dv, None, None
