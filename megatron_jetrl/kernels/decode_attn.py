"""Decode attention over the static decoder's KV cache, to the exact length (CUDA; Triton).

The static decoder's SDPA attention reads the KV cache up to the next length-bucket edge (one CUDA
graph per bucket, 64 keys by default) with an additive mask: on average half a bucket of keys more
than the step needs, and one graph per bucket. This kernel reads the number of keys from the step's
position tensor on the device, so one captured graph serves every length and a step reads keys
``0..pos`` only; validity (left-pad keys of shorter prompts) comes from the decoder's ``key_ok`` row,
one byte per key next to the 2 x head_dim x 2 bytes of K and V, instead of an additive mask per step (the key-major
kernel, given each row's first valid key, compares positions instead: no byte loads in its loop).

One program per (row, key/value group, key split): the group's query heads (grouped-query attention:
query head h reads group h // (heads / groups), megatron's and SDPA's grouping) form one
``[BLOCK_H, d]`` tile against ``[BLOCK_N, d]`` key tiles on the tensor cores, with the usual online
softmax in fp32 (scores and the running max/sum in fp32, P rounded to the cache dtype for the PV
product, as flash kernels do). With one split the program writes the output; with several each
writes its unnormalized fp32 partial and its (max, sum), and a second kernel merges the splits in
split order (deterministic). Splits divide ``0..pos`` at run time, so they stay balanced at every
length; the decoder asks for splits only when rows x groups leave SMs idle (small batches, long
contexts).

Opt-in (``rollout.decode_attention=triton``; measurements in docs/benchmarks.md, "Decode attention";
``tools/attn_decode_bench.py``, part ``decattn`` of ``tools/device_check.sh``). With SDPA's 64-key buckets the
8B rollout takes about the same time with either (batch 256: 14.84 / 12.41 s with SDPA vs 14.70 / 12.38 s with
this kernel, bf16 / jet), while this kernel's rounding, independent of the attention the trainer runs, raises
the RL step's train-rollout mismatch by about a quarter; so SDPA stays the default.
With the FP8 KV cache (``precision.kv_cache=fp8``: E4M3 K/V, one power-of-two scale per token and KV head) the decoder
runs the key-major kernel for every decode step (SDPA reads no FP8). The head-major form above, fed FP8 tiles, had to
gather V's bytes one key at a time for the P.V operand (V's reduction axis, the keys, is strided in a ``[L, d]``
cache) and padded the 4 query heads of an 8B group to the MMA's 16 rows; compiled for sm_90a (``python
tools/kernel_sass.py decode-attn``) its loop issued 39.5 warp-instructions per key at 255 registers (2 programs per
SM). The key-major kernel computes S^T = K q^T and O^T += V^T P^T: K's and V^T's tiles are the MMAs' first operands,
the query heads are the narrow side (8); a split's keys run in whole tiles, its last keys masked (below). Over a V
stored key-major (``[d, L]`` memory: V^T's tiles contiguous along the keys, one E4M3 -> fp16 conversion per pair) its
loop issues 15.5 warp-instructions per key at 127 registers (4 programs per SM), per KV byte what the BF16 kernel
issues (0.059 vs 0.062); over a V ``[L, d]`` 27.4 at 239 registers (2 programs per SM; its one loop's masked loads:
24.7 at 203 with unmasked whole tiles), and on the H100 as fast: there the kernel waits on memory (64 rows x 2,048
keys, 32 layers: write + attention 3.43 vs 3.57 ms), and V ``[L, d]``, whose cache write is one contiguous row per
step and KV head, made the whole rollout 3.5% faster than a key-major V's write (one byte per feature row). On the
H200, with 1.45x the H100's bandwidth for the same SMs, the key-major V's fewer instructions win: its rollout ran 2%
faster at 4K and 5% at 8K new tokens. The decoder picks by the GPU's bandwidth per SM (``rollout.fp8_kv_v_layout``;
docs/decode_attention.md); exact mode's kernel (``kernels/exact_attn.py``) reads V key-major. Numerics: K
and V tiles converted to fp16 (exact) for fp16 tensor cores (q converted once), the key's scale multiplying its fp32
score and the value's scale (times 2^8, kept in fp16's normal range and divided out at the end) multiplying the
softmax weight; powers of two, so the scales change no rounding. With an fp32 q (CPU, tests) the tiles convert to fp32
and the result equals the same kernel over the dequantized cache bit for bit.
With one key split the key-major kernel can also write the output projection's FP8 input (``quant``): the E4M3
bytes and 1 x head_dim scales the activation quantizer would compute from the BF16 output, one launch fewer per
layer.
Runs under ``TRITON_INTERPRET=1`` on CPU (the tests compare it with SDPA there).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from megatron_jetrl.kernels.triton_quant import scale_and_multiplier
from megatron_jetrl.precision.recipe import FP8Recipe

LOG2E = math.log2(math.e)
TAIL_N = 32  # a key-major V's masked tiles at a split's end (narrow: few registers beside the pipelined loop)

P_F16: tl.constexpr = tl.constexpr(256.0)


@triton.jit
def group_query(q_ptr, sq_b, sq_h, HPG: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """A decode program's row b and KV group g (program ids 0 and 1), the group's query heads (masked to HPG: hm),
    the features (masked to D: dm) and their query rows q [BLOCK_H, BLOCK_D]."""
    b = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a 256 x 8K-token cache of one layer passes 2^31 elements
    g = tl.program_id(1).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    dd = tl.arange(0, BLOCK_D)
    hm = hh < HPG
    dm = dd < D
    heads = g * HPG + hh
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + dd[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    return b, g, heads, hm, dd, dm, q


@triton.jit
def _program(q_ptr, pos_ptr, sq_b, sq_h, HPG: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """A decode program's (row b, KV group g, key split s), its query heads and their rows q [BLOCK_H, BLOCK_D]
    (masks hm, dm), and its keys [lo, hi): the split's share of ``0..pos`` in whole tiles."""
    b, g, heads, hm, dd, dm, q = group_query(q_ptr, sq_b, sq_h, HPG, D, BLOCK_H, BLOCK_D)
    s = tl.program_id(2)
    n = tl.load(pos_ptr).to(tl.int32) + 1  # keys 0..pos: the step's own key is written before this runs
    chunk = tl.cdiv(tl.cdiv(n, SPLIT), BLOCK_N) * BLOCK_N
    lo = s * chunk
    return b, g, s, heads, hm, dd, dm, q, lo, tl.minimum(lo + chunk, n)


@triton.jit
def _decode_attn_kernel(q_ptr, k_ptr, v_ptr, ok_ptr, pos_ptr, o_ptr, part_ptr, ml_ptr, scale,
                        sq_b, sq_h, sk_b, sk_g, sk_l, sv_b, sv_g, sv_l, sok_b, so_b, so_h,
                        HPG: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, IEEE: tl.constexpr):
    """Head-major: S = q K^T [BLOCK_H, BLOCK_N], O += P V with V's tile [BLOCK_N, d] as the second operand (the
    cache's [L, d] layout)."""
    b, g, s, heads, hm, dd, dm, q, lo, hi = _program(q_ptr, pos_ptr, sq_b, sq_h, HPG, D, BLOCK_H, BLOCK_D, BLOCK_N,
                                                     SPLIT)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    kn = tl.arange(0, BLOCK_N)
    k_row = k_ptr + b * sk_b + g * sk_g
    v_row = v_ptr + b * sv_b + g * sv_g
    for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        keys = start + kn
        km = keys < hi
        ok = (tl.load(ok_ptr + b * sok_b + keys, mask=km, other=0) != 0) & km
        kt = tl.load(k_row + keys[:, None] * sk_l + dd[None, :], mask=km[:, None] & dm[None, :], other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(kt), input_precision="ieee", out_dtype=tl.float32)
        else:
            sc = tl.dot(q, tl.trans(kt), out_dtype=tl.float32)
        sc = tl.where(ok[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: exp() of -inf -> 0, not NaN
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(sc - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_row + keys[:, None] * sv_l + dd[None, :], mask=km[:, None] & dm[None, :], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(vt.dtype), vt, input_precision="ieee", out_dtype=tl.float32)
        else:
            pv = tl.dot(p.to(vt.dtype), vt, out_dtype=tl.float32)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    _store_out(acc, l_i, m_i, o_ptr, part_ptr, ml_ptr, b, heads, hm, dd, dm, so_b, so_h,
               tl.num_programs(1) * HPG, s, BLOCK_D, SPLIT, o_ptr, o_ptr, 0, 0, 0, 1.0, 1.0, 0.0, D, False, False)


@triton.jit
def load_whole(ptrs, d_mask, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """A tile of keys that all lie inside the cache: no mask where the features fill ``BLOCK_D`` (whole-vector
    loads), else masked to the ``D`` features (``d_mask``, broadcast over the tile)."""
    if D == BLOCK_D:
        t = tl.load(ptrs)
    else:
        t = tl.load(ptrs, mask=d_mask, other=0.0)
    return t


@triton.jit
def _decode_attn_keys_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, ok_ptr, first_ptr, pos_ptr, o_ptr, part_ptr, ml_ptr,
                             qk_scale, sq_b, sq_h, sk_b, sk_g, sk_l, sv_b, sv_g, sv_l, sv_d, ss_b, ss_g, sok_b,
                             so_b, so_h, xq_ptr, xs_ptr, sxq_b, sxs_b, sxs_h, inv_max, fmax, eps,
                             HPG: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                             NUM_STAGES: tl.constexpr, TAIL_N: tl.constexpr, V_KEYS: tl.constexpr,
                             LOAD16: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr, F16: tl.constexpr,
                             QUANT: tl.constexpr, UE8M0: tl.constexpr, FIRST: tl.constexpr):
    """Key-major: S^T = K q^T [BLOCK_N, BLOCK_H], O^T += V^T P^T with V^T's tile [d, BLOCK_N] as the first operand
    (key-contiguous in a [d, L] layout: wide loads, one conversion per pair of keys; d-contiguous in a [L, d] one,
    which this kernel reads as fast where it waits on memory, the H100). The query heads
    of a group are the MMA's narrow dimension (BLOCK_H = 8 for 4 heads, where the head-major form pads them to 16),
    a split's keys run in whole ``BLOCK_N``-key tiles, the masked ones scored to ``hi`` and loaded to ``hl``: ``hi``
    rounded up to 16 keys where the cache's rows hold a multiple of 16 (``LOAD16``), so that a key-major V's masked
    tiles load whole 16-byte vectors; the up to 15 keys past ``hi`` they read weigh 0, and their V must be finite (the
    decoder's cache past the step's position holds zeros, ``StaticDecoder.prefill``). With V key-major (``V_KEYS``)
    the loop over the whole tiles is unmasked and the split's last keys follow in unpipelined ``TAIL_N``-key tiles;
    with V ``[L, d]`` one pipelined loop covers the split, its last tile masked. Measured on the rollout's graph
    (H100, 8B, 64 rows; docs/decode_attention.md): each unpipelined tail tile costs a memory latency (2.7 us
    per layer over V ``[L, d]``, a sawtooth of period ``BLOCK_N`` keys in the step's time), which the one loop
    removes (3.7% of the step at 660-916 keys, 1.6% at 4,116-4,372) where over a key-major V its masked loads slowed
    the whole loop (up to 5% at 4K keys); a key-major V's tail tiles loaded byte by byte until their mask was
    16-key-granular (2.7-5.3% of the step). ``FIRST``: a row's valid keys are ``first[b]..pos`` (its left pads
    before them), compared in registers instead of loaded from ``key_ok``: a byte per key, which Triton 3.6 loads
    synchronously in every tile (``cp.async`` moves 4 bytes or more)."""
    b, g, s, heads, hm, dd, dm, q, lo, hi = _program(q_ptr, pos_ptr, sq_b, sq_h, HPG, D, BLOCK_H, BLOCK_D, BLOCK_N,
                                                     SPLIT)
    if F16:  # the FP8 cache on fp16 tensor cores: E4M3 -> fp16 is one instruction per pair; through bf16 the
        # head-major kernel ran 7-20% slower on the H200 (docs/decode_attention.md). q is exact in fp16
        # above 2^-14
        q = q.to(tl.float16)
    qt = tl.trans(q)  # [BLOCK_D, BLOCK_H]
    hl = tl.multiple_of((hi + 15) // 16 * 16, 16) if LOAD16 else hi  # the last tile's loads end here
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_D, BLOCK_H], tl.float32)  # O^T
    k_row = k_ptr + b * sk_b + g * sk_g
    v_row = v_ptr + b * sv_b + g * sv_g
    ok_row = ok_ptr + b * sok_b
    s_row = b * ss_b + g * ss_g  # the FP8 cache's per-key scales [b, G, L] (KV_FP8)
    first = 0
    if FIRST:
        first = tl.load(first_ptr + b).to(tl.int32)
    if V_KEYS:  # whole tiles unmasked, then [full, hi) in narrow masked tiles
        full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        for start in tl.range(lo, full, BLOCK_N, num_stages=NUM_STAGES):
            m_i, l_i, acc = _keys_tile(qt, k_row, v_row, ks_ptr + s_row, vs_ptr + s_row, ok_row, start, hi, hl, m_i,
                                       l_i, acc, sk_l, sv_l, sv_d, qk_scale, D, BLOCK_D, BLOCK_N, False, IEEE, KV_FP8,
                                       F16, FIRST, first)
        for start in tl.range(full, hi, TAIL_N, num_stages=1):
            m_i, l_i, acc = _keys_tile(qt, k_row, v_row, ks_ptr + s_row, vs_ptr + s_row, ok_row, start, hi, hl, m_i,
                                       l_i, acc, sk_l, sv_l, sv_d, qk_scale, D, BLOCK_D, TAIL_N, True, IEEE, KV_FP8,
                                       F16, FIRST, first)
    else:  # one pipelined loop, its last tile masked
        for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
            m_i, l_i, acc = _keys_tile(qt, k_row, v_row, ks_ptr + s_row, vs_ptr + s_row, ok_row, start, hi, hl, m_i,
                                       l_i, acc, sk_l, sv_l, sv_d, qk_scale, D, BLOCK_D, BLOCK_N, True, IEEE, KV_FP8,
                                       F16, FIRST, first)
    if F16:
        acc = acc * (1.0 / P_F16)
    _store_out(tl.trans(acc), l_i, m_i, o_ptr, part_ptr, ml_ptr, b, heads, hm, dd, dm, so_b, so_h,
               tl.num_programs(1) * HPG, s, BLOCK_D, SPLIT, xq_ptr, xs_ptr, sxq_b, sxs_b, sxs_h, inv_max, fmax, eps,
               D, QUANT, UE8M0)


@triton.jit
def _keys_tile(qt, k_row, v_row, ks_row, vs_row, ok_row, start, hi, hl, m_i, l_i, acc, sk_l, sv_l, sv_d, qk_scale,
               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               IEEE: tl.constexpr, KV_FP8: tl.constexpr, F16: tl.constexpr, FIRST: tl.constexpr, first):
    """One key tile of the key-major kernel: keys ``start..start+BLOCK_N`` (``MASKED``: those below ``hi`` weighed,
    their K and V bytes loaded below ``hl >= hi``, the rest read as 0; valid: ``key_ok``'s, or with ``FIRST`` those
    from ``first``) -> the online softmax's updated (max, sum, O^T).
    Scores in base 2 (``qk_scale`` holds log2(e)); an FP8 key's power-of-two scale multiplies its fp32 score and a
    value's scale (times P_F16 on fp16) its softmax weight, exactly."""
    keys = start + tl.arange(0, BLOCK_N)
    dd = tl.arange(0, BLOCK_D)
    k_ptrs = k_row + keys[:, None] * sk_l + dd[None, :]
    v_ptrs = v_row + dd[:, None] * sv_d + keys[None, :] * sv_l
    if MASKED:
        km = keys < hi
        kl = keys < hl
        if FIRST:
            ok = (keys >= first) & km
        else:
            ok = (tl.load(ok_row + keys, mask=km, other=0) != 0) & km
        kt = tl.load(k_ptrs, mask=kl[:, None] & (dd < D)[None, :], other=0.0)
        vt = tl.load(v_ptrs, mask=(dd < D)[:, None] & kl[None, :], other=0.0)
        if KV_FP8:
            kscale = tl.load(ks_row + keys, mask=km, other=1.0) * qk_scale
            vscale = tl.load(vs_row + keys, mask=km, other=0.0)
    else:
        if FIRST:
            ok = keys >= first
        else:
            ok = tl.load(ok_row + keys) != 0
        kt = load_whole(k_ptrs, (dd < D)[None, :], D, BLOCK_D)
        vt = load_whole(v_ptrs, (dd < D)[:, None], D, BLOCK_D)
        if KV_FP8:
            kscale = tl.load(ks_row + keys) * qk_scale
            vscale = tl.load(vs_row + keys)
    kt = kt.to(qt.dtype)  # E4M3 -> fp16/fp32: exact
    if IEEE:
        st = tl.dot(kt, qt, input_precision="ieee", out_dtype=tl.float32)
    else:
        st = tl.dot(kt, qt, out_dtype=tl.float32)
    if KV_FP8:
        st = st * kscale[:, None]
    else:
        st = st * qk_scale
    st = tl.where(ok[:, None], st, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(st, 0))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: exp2() of -inf -> 0, not NaN
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(st - m_ref[None, :])
    l_i = l_i * alpha + tl.sum(p, 0)
    if KV_FP8:
        p = p * (vscale * (P_F16 if F16 else 1.0))[:, None]
    vt = vt.to(qt.dtype)
    if IEEE:
        pv = tl.dot(vt, p.to(vt.dtype), input_precision="ieee", out_dtype=tl.float32)
    else:
        pv = tl.dot(vt, p.to(vt.dtype), out_dtype=tl.float32)
    return m_new, l_i, acc * alpha[None, :] + pv


@triton.jit
def store_quantized(out, b, heads, hm, dd, mask, xq_ptr, xs_ptr, sxq_b, sxs_b, sxs_h, inv_max, fmax, eps,
                    D: tl.constexpr, UE8M0: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """The output projection's FP8 input from a decode program's output rows ``out [heads, d]`` (``TRANSPOSED``:
    ``out^T [d, heads]``, ``mask`` likewise) as stored (rounded to the output's dtype): one 1 x D group per head (D =
    the recipe's group), the E4M3 bytes and scale_inv the activation quantizer computes from them
    (``triton_quant._act_quant_kernel``), at row ``b`` of ``xq [b, heads * D]`` and ``xs`` (strides ``sxs_b``,
    ``sxs_h``: row- or column-major)."""
    x = out.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0 if TRANSPOSED else 1), eps)
    scale_inv, mult = scale_and_multiplier(amax, inv_max, fmax, UE8M0)
    if TRANSPOSED:
        q8 = tl.clamp(x * mult[None, :], -fmax, fmax).to(tl.float8e4nv)
        tl.store(xq_ptr + b * sxq_b + heads[None, :] * D + dd[:, None], q8, mask=mask)
    else:
        q8 = tl.clamp(x * mult[:, None], -fmax, fmax).to(tl.float8e4nv)
        tl.store(xq_ptr + b * sxq_b + heads[:, None] * D + dd[None, :], q8, mask=mask)
    tl.store(xs_ptr + b * sxs_b + heads * sxs_h, scale_inv, mask=hm)


@triton.jit
def _store_out(acc, l_i, m_i, o_ptr, part_ptr, ml_ptr, b, heads, hm, dd, dm, so_b, so_h, H, s,
               BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, xq_ptr, xs_ptr, sxq_b, sxs_b, sxs_h, inv_max, fmax, eps,
               D: tl.constexpr, QUANT: tl.constexpr, UE8M0: tl.constexpr):
    """A program's result ``acc [heads, d]``: with one split the output ``acc / l``, with several its unnormalized
    fp32 partial [B, H, SPLIT, BLOCK_D] and (max, sum) [B, H, SPLIT, 2] for :func:`_merge_kernel`. ``QUANT`` (one
    split): also the output's 1 x D quantization for the output projection, one scale per head (D = the recipe's
    group), from the output as stored (rounded to its dtype): the bytes and scales the activation quantizer
    computes from it (``triton_quant._act_quant_kernel``)."""
    mask = hm[:, None] & dm[None, :]
    if SPLIT == 1:
        out = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + b * so_b + heads[:, None] * so_h + dd[None, :], out, mask=mask)
        if QUANT:
            store_quantized(out, b, heads, hm, dd, mask, xq_ptr, xs_ptr, sxq_b, sxs_b, sxs_h, inv_max, fmax, eps, D,
                            UE8M0)
    else:
        row = (b * H + heads) * SPLIT + s
        tl.store(part_ptr + row[:, None] * BLOCK_D + dd[None, :], acc, mask=mask)
        tl.store(ml_ptr + row * 2, m_i, mask=hm)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=hm)


@triton.jit
def _merge_kernel(part_ptr, ml_ptr, o_ptr, so_b, so_h, H, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  SPLIT: tl.constexpr, BLOCK_S: tl.constexpr, BASE2: tl.constexpr):
    """out[b, h] = sum_s part_s * exp(m_s - M) / sum_s l_s * exp(m_s - M), M = max_s m_s (split order; ``BASE2``:
    the maxima are of base-2 scores, exp2)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    ss = tl.arange(0, BLOCK_S)
    dd = tl.arange(0, BLOCK_D)
    sm = ss < SPLIT
    row = (b * H + h) * SPLIT + ss
    m_s = tl.load(ml_ptr + row * 2, mask=sm, other=float("-inf"))
    l_s = tl.load(ml_ptr + row * 2 + 1, mask=sm, other=0.0)
    m = tl.max(m_s, 0)  # finite: the split holding key ``pos`` (always valid) has a finite max
    w = tl.exp2(m_s - m) if BASE2 else tl.exp(m_s - m)
    acc = tl.load(part_ptr + row[:, None] * BLOCK_D + dd[None, :], mask=sm[:, None] & (dd[None, :] < D), other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(o_ptr + b * so_b + h * so_h + dd, out.to(o_ptr.dtype.element_ty), mask=dd < D)


def default_splits(rows: int, groups: int, max_len: int, device: torch.device, block_n: int = 64) -> int:
    """Key splits per (row, group): enough programs for about two per SM, each split at least four
    key tiles long at ``max_len``; 1 (no merge kernel) when rows x groups already fill the GPU
    (batch 64 of an 8B model: 512 programs on 132 SMs)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    want = -(-2 * sms // max(1, rows * groups))
    return max(1, min(want, max_len // (4 * block_n), 32))


def output_quant(quant: FP8Recipe | None, b: int, H: int, D: int, col_major: bool, out: torch.Tensor):
    """(xq, the kernel arguments of :func:`store_quantized`) for a decode kernel that writes the output projection's
    FP8 input from its epilogue: ``xq = (bytes [b, H*D] E4M3, scale_inv [b, H] fp32)``, the scales row-major or, with
    ``col_major``, column-major as cuBLAS's scaled_mm reads them; (None, placeholders) where ``quant`` is None or its
    group is not the head dim (one scale per head)."""
    if quant is None or D != quant.group_size:
        return None, (out, out, out.stride(0), out.stride(0), out.stride(1), 1.0, 1.0, 0.0)  # unused without QUANT
    xs = (torch.empty((H, b), dtype=torch.float32, device=out.device).t() if col_major
          else torch.empty((b, H), dtype=torch.float32, device=out.device))
    xb = torch.empty((b, H * D), dtype=torch.float8_e4m3fn, device=out.device)
    return (xb, xs), (xb, xs, xb.stride(0), xs.stride(0), xs.stride(1), 1.0 / quant.fp8_max, quant.fp8_max,
                      quant.amax_eps)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_ok: torch.Tensor,
                     pos: torch.Tensor, scale: float, splits: int = 1, block_n: int = 64,
                     num_stages: int = 2, num_warps: int = 4, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, quant: FP8Recipe | None = None,
                     scale_col_major: bool = False, first_key: torch.Tensor | None = None):
    """One query token per row: ``q [b, heads, d]`` (any strides with a unit last one) against
    ``k_cache``/``v_cache [b, groups, L, d]`` (views of the decoder's cache; K with a unit last stride, V with a unit
    last stride or key-major, a transposed view of ``[b, groups, d, L]`` memory) over keys ``0..pos[0]`` where
    ``key_ok [b, L]`` is true; returns ``[b, heads, d]`` in q's dtype. ``pos`` is a one-element device tensor (read
    by the kernel: no host sync, one CUDA graph for every length). An FP8 cache (float8_e4m3fn K/V with
    ``k_scale``/``v_scale [b, groups, L]`` fp32 power-of-two scales, unit last stride, ``FP8Recipe.kv_cache``) is
    read as its bytes; the attention is over their dequantized values. An FP8 cache or a key-major V runs the
    key-major kernel, a BF16 cache with V [L, d] the head-major one. ``quant`` (a recipe): returns ``(out, xq)``,
    ``xq`` the output's activation quantization for the FP8 output projection, ``(q [b, heads*d] E4M3, scale_inv [b,
    heads] fp32)``, the bytes and scales ``quant.quantize_act`` computes from ``out`` (1 x d groups; scales row-major,
    or column-major as cuBLAS's scaled_mm reads them with ``scale_col_major``), written by the same kernel; None where
    the kernel cannot (several key splits, the head-major kernel, d other than the recipe's group). ``first_key [b]``
    (integer): each row's first valid key, where ``key_ok`` holds left pads only (a row's keys before it invalid, every
    key from it to ``pos`` valid: the decoder's rows); the key-major kernel then compares positions instead of reading
    ``key_ok``."""
    b, H, D = q.shape
    G, L = k_cache.shape[1], k_cache.shape[2]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    v_keys = v_cache.stride(2) == 1 and L > 1  # V key-major ([d, L] memory)
    key_major = fp8 or v_keys
    if (H % G or k_cache.shape != v_cache.shape or k_cache.shape[0] != b or k_cache.shape[3] != D
            or key_ok.shape != (b, L) or q.stride(-1) != 1 or k_cache.stride(-1) != 1
            or 1 not in (v_cache.stride(-1), v_cache.stride(-2))):
        raise ValueError(f"decode_attention: unsupported shapes/strides q {tuple(q.shape)} {tuple(q.stride())}, "
                         f"k/v {tuple(k_cache.shape)} {tuple(k_cache.stride())} {tuple(v_cache.stride())}, "
                         f"key_ok {tuple(key_ok.shape)}")
    if fp8 and (k_scale is None or v_scale is None or k_scale.shape != (b, G, L) or k_scale.stride() != v_scale.stride()
                or k_scale.stride(-1) != 1):
        raise ValueError("decode_attention: an FP8 KV cache needs k_scale/v_scale [b, groups, L] with equal strides "
                         "and a unit last one")
    if first_key is not None and (first_key.shape != (b,) or first_key.dtype.is_floating_point):
        raise ValueError(f"decode_attention: first_key must be [b] integers, got {tuple(first_key.shape)} "
                         f"{first_key.dtype}")
    out = torch.empty((b, H, D), dtype=q.dtype, device=q.device)
    if b == 0:
        return out if quant is None else (out, None)
    hpg = H // G
    block_d = max(16, triton.next_power_of_2(D))
    ok = key_ok.view(torch.uint8) if key_ok.dtype == torch.bool else key_ok
    splits = max(1, int(splits))
    if splits > 1:
        part = torch.empty((b, H, splits, block_d), dtype=torch.float32, device=q.device)
        ml = torch.empty((b, H, splits, 2), dtype=torch.float32, device=q.device)
    else:
        part = ml = out
    common = dict(D=D, BLOCK_D=block_d, BLOCK_N=block_n, SPLIT=splits, NUM_STAGES=num_stages,
                  IEEE=q.dtype == torch.float32, num_warps=num_warps)
    xq, qargs = output_quant(quant if key_major and splits == 1 else None, b, H, D, scale_col_major, out)
    if key_major:  # the query heads as the MMA's narrow side: 8 for up to 8 heads per group (tensor cores pad less)
        ks, vs = (k_scale, v_scale) if fp8 else (q, q)  # unused without KV_FP8
        _decode_attn_keys_kernel[(b, G, splits)](
            q, k_cache, v_cache, ks, vs, ok, ok if first_key is None else first_key, pos, out, part, ml,
            float(scale) * LOG2E,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
            ks.stride(0) if fp8 else 0, ks.stride(1) if fp8 else 0, ok.stride(0), out.stride(0), out.stride(1),
            *qargs, HPG=hpg, BLOCK_H=max(8, triton.next_power_of_2(hpg)), TAIL_N=min(TAIL_N, block_n),
            V_KEYS=v_keys, LOAD16=L % 16 == 0, KV_FP8=fp8,
            F16=fp8 and q.dtype != torch.float32, QUANT=xq is not None,
            UE8M0=xq is not None and quant.scale_fmt == "ue8m0", FIRST=first_key is not None, **common)
    else:
        _decode_attn_kernel[(b, G, splits)](
            q, k_cache, v_cache, ok, pos, out, part, ml, float(scale),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), ok.stride(0), out.stride(0), out.stride(1),
            HPG=hpg, BLOCK_H=max(16, triton.next_power_of_2(hpg)), **common)
    if splits > 1:
        _merge_kernel[(b, H)](part, ml, out, out.stride(0), out.stride(1), H, D=D, BLOCK_D=block_d, SPLIT=splits,
                              BLOCK_S=triton.next_power_of_2(splits), BASE2=key_major, num_warps=4)
    return out if quant is None else (out, xq)
