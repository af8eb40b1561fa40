"""The Triton kernels under Triton's CPU interpreter (subprocesses with TRITON_INTERPRET=1), kernel
against its torch statement: small-M GEMM, fused SwiGLU quantizer, SwiGLU backward, transposes, the dual
gradient quantizer, RoPE (decode and training), RMSNorm, the fused add + RMSNorm + quantizer."""
from tests.common import run_interpreted

def test_small_m_triton_gemm_under_the_interpreter():
    """The fused small-M kernel (CUDA in production) run by Triton's CPU interpreter: the activation
    bytes and scales it uses are the precision core's Triton quantizer's, and its output is the
    dequantized GEMM of those bytes. (The interpreter's own float->E4M3 cast mis-rounds at binade
    edges, so the comparison is kernel-to-kernel here; tests/test_gpu_*.py compares against the torch
    quantizer on the GPU.)"""
    code = r'''
import torch
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.precision.quant import quantize_weight
from megatron_jetrl.kernels.triton_quant import quantize_act_triton
from megatron_jetrl.precision.gemm import block_gemm
from megatron_jetrl.kernels.triton_gemm import small_m_linear
for fmt in ("fp32", "ue8m0"):
    r = FP8Recipe(mode="jet", scale_fmt=fmt)
    g = torch.Generator().manual_seed(0)
    # None: the launch plan; then split-K (3 splits over 8 groups, the last one short) and other tiles
    # and x quantized once beforehand (prequant) with other row tiles
    for M, N, K, bn, split, pre, bm in ((1, 256, 384, None, None, False, None), (5, 384, 320, None, None, False, None),
                                        (33, 128, 256, None, None, False, None), (2, 200, 1000, 32, 3, False, None),
                                        (17, 384, 1024, 128, 8, False, None), (40, 256, 640, 64, 2, True, 32),
                                        (3, 130, 300, None, None, True, None), (70, 200, 400, 128, 2, True, None)):
        x = torch.randn(M, K, generator=g) * 3
        w = torch.randn(N, K, generator=g)
        qw, ws = quantize_weight(w, r)
        y, q, s = small_m_linear(x, qw, ws, r, torch.float32, return_quantized=True, block_n=bn, split_k=split,
                                 prequant=pre, block_m=bm, fused_sum=True)
        qr, sr = quantize_act_triton(x, r)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr), (fmt, M, N, K)
        ref = block_gemm(qr, sr, qw, ws, "emulated", out_dtype=torch.float32)
        err = float((y - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, (fmt, M, N, K, err)
        # split-K summed by the tile's last program == by the second kernel (same order, same bytes)
        y2 = small_m_linear(x, qw, ws, r, torch.float32, block_n=bn, split_k=split, prequant=pre, block_m=bm,
                            fused_sum=False)
        assert torch.equal(y, y2), (fmt, M, N, K)
        # deferred sum: the partials as returned, summed in split order == the summed output
        from megatron_jetrl.kernels.triton_gemm import sum_partials
        part, n = small_m_linear(x, qw, ws, r, torch.float32, block_n=bn, split_k=split, prequant=pre, block_m=bm,
                                 return_partials=True)
        y3 = part if n == 1 else sum_partials(part, torch.empty(M, N))
        assert torch.equal(y3, y2) and (n > 1) == (part.dim() == 3), (fmt, M, N, K, n)
        # bulk-copy (TMA descriptor) loads: the same tiles, so the same bytes as per-thread loads in either
        # layout; the swapped-operand layout (y^T = W x^T per tile): the same products summed in another
        # order inside each 128-wide dot (the interpreter's dot is numpy's matmul into fp32: bit-equal in
        # earlier CI runs, two elements one fp32 step apart in the 2026-12-03 run), so equal to fp32 rounding
        if fmt == "fp32":
            lay = {(sw, tma): small_m_linear(x, qw, ws, r, torch.float32, block_n=bn, split_k=split, prequant=pre,
                                             block_m=bm, swap=sw, tma=tma) for sw in (False, True) for tma in (False, True)}
            for sw in (False, True):
                assert torch.equal(lay[(sw, True)], lay[(sw, False)]), (fmt, M, N, K, sw)
            assert torch.equal(lay[(M <= 16, False)], y2), (fmt, M, N, K)  # the default layout is the plan's
            rel = float((lay[(True, False)] - lay[(False, False)]).abs().max() / ref.abs().max())
            assert rel < 1e-6, (fmt, M, N, K, rel)
    from megatron_jetrl.kernels.triton_gemm import _LOCKS
    assert _LOCKS and all(int(b.abs().sum()) == 0 for b in _LOCKS.values())  # counters left at zero
    # fc2 of a gated MLP: x = [gate | up], the activation SwiGLU(x) quantized by the fused quantizer
    from megatron_jetrl.kernels.triton_quant import swiglu_quant_triton
    for M, N, K in ((16, 256, 384), (40, 130, 300)):
        gu = torch.randn(M, 2 * K, generator=g) * 2
        qw, ws = quantize_weight(torch.randn(N, K, generator=g), r)
        y, q, s = small_m_linear(gu, qw, ws, r, torch.float32, return_quantized=True, swiglu=True)
        qr, sr = swiglu_quant_triton(gu, r)
        assert y.shape == (M, N) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
        ref = block_gemm(qr, sr, qw, ws, "emulated", out_dtype=torch.float32)
        assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5, (fmt, M, N, K)
    # the quantizer's launch plans (rows x groups per program, warps): the same bytes and scales for every
    # plan, K not a multiple of the groups a program covers, rows not a multiple of its row tile
    for M, K in ((37, 1000), (5, 640)):
        x = torch.randn(M, K, generator=g) * 5
        for col_major in (False, True):
            q0, s0 = quantize_act_triton(x, r, col_major, plan=(4, 1, 4))
            for plan in ((16, 4, 4), (8, 2, 8, 1), (32, 8, 4)):
                q1, s1 = quantize_act_triton(x, r, col_major, plan=plan)
                assert torch.equal(q1.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s1, s0), (M, K, plan)
                assert s1.stride() == s0.stride()
print("ok")
'''
    run_interpreted(code)


def test_fused_swiglu_quant_kernel_under_the_interpreter():
    """The fused SwiGLU + 1x128 quantization Triton kernel (CUDA in production) under Triton's CPU
    interpreter on fp32 input: the bytes and scales of the unfused SwiGLU + Triton quantizer. (The
    interpreter rounds fp32 -> bf16 differently from the GPU, so bf16 input is checked on the H200,
    tests/test_gpu_*.py; its exp is numpy's, one ulp off torch's at times, so the reference SwiGLU
    here uses numpy's exp too.)"""
    code = r'''
import numpy as np
import torch
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.kernels.triton_quant import quantize_act_triton, swiglu_quant_triton, swiglu_triton
def swiglu(y):
    g, u = y.chunk(2, -1)
    g = g.numpy()
    return torch.from_numpy(g / (np.float32(1) + np.exp(-g))) * u
for M, F in ((37, 300), (4, 256), (1, 1000)):  # the BF16 path's one-kernel SwiGLU (fp32 here: exact)
    y = torch.randn(M, 2 * F, generator=torch.Generator().manual_seed(M)) * 3
    assert torch.equal(swiglu_triton(y), swiglu(y)), (M, F)
    assert torch.equal(swiglu_triton(y.view(1, M, 2 * F)), swiglu(y).view(1, M, F))
for fmt in ("fp32", "ue8m0"):
    r = FP8Recipe(mode="jet", scale_fmt=fmt)
    for M, F in ((37, 300), (4, 256)):
        y = torch.randn(M, 2 * F, generator=torch.Generator().manual_seed(M)) * 3
        y[0, :F] = 0.0  # a zero gate row: zero group, eps scale
        for col_major in (False, True):
            q, s = swiglu_quant_triton(y, r, col_major)
            qr, sr = quantize_act_triton(swiglu(y), r, col_major)
            assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr), (fmt, M, F)
            assert s.stride() == sr.stride()
print("ok")
'''
    run_interpreted(code)


def test_swiglu_backward_and_transpose_kernels_under_the_interpreter():
    """The fused SwiGLU backward and the FP8 byte transpose (CUDA in production) under Triton's CPU
    interpreter: the transpose's bytes equal ``x.t().contiguous()`` (partial tiles included); wgrad's
    transposed 1x128 quantizer writes what the 1x128 quantizer writes for ``x^T`` (kernel to kernel); the
    backward equals the torch statement in fp32 to fp32 rounding (the interpreter's exp is numpy's;
    bf16 output is checked on the H200, tests/test_gpu_*.py)."""
    code = r'''
import torch
from megatron_jetrl.precision.quant import swiglu_backward
from megatron_jetrl.kernels.triton_quant import swiglu_backward_triton, transpose_bytes_triton
g = torch.Generator().manual_seed(0)
for R, C in ((300, 77), (128, 256), (1, 5)):
    x = (torch.randn(R, C, generator=g) * 100).to(torch.float8_e4m3fn)
    t = transpose_bytes_triton(x)
    assert t.shape == (C, R) and t.is_contiguous() and torch.equal(t.view(torch.uint8), x.t().contiguous().view(torch.uint8))
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.kernels.triton_quant import quantize_act_triton, quantize_transposed_triton
r = FP8Recipe(mode="jet")
for R, C in ((300, 200), (128, 128)):  # wgrad's dy^T quantizer (transposed store) == the 1x128 quantizer on x^T
    x = torch.randn(R, C, generator=g) * 3
    q, s = quantize_transposed_triton(x, r, tile_scale=False)
    qr, sr = quantize_act_triton(x.t().contiguous(), r)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr), (R, C)
for M, F in ((37, 600), (4, 256)):
    y = torch.randn(M, 2 * F, generator=g) * 3
    da = torch.randn(M, F, generator=g)
    dy = swiglu_backward_triton(y, da)
    ref = swiglu_backward(y, da, use_triton=False)
    assert dy.shape == ref.shape and dy.dtype == ref.dtype
    torch.testing.assert_close(dy, ref, rtol=1e-5, atol=1e-6)
    assert not torch.equal(dy[:, :F], torch.zeros_like(dy[:, :F]))
print("ok")
'''
    run_interpreted(code)


def test_dual_gradient_quantizer_under_the_interpreter():
    """The backward's one-pass gradient quantizer under Triton's CPU interpreter, kernel to kernel: the
    same bytes and scales as the 1x128 quantizer (dgrad operand, both scale layouts) and the transposed
    1x128 quantizer (wgrad operand), ragged shapes included (fp32: the interpreter's bf16 rounding is not the
    GPU's; bf16 bytes are checked on the H200, tests/test_gpu_*.py); a malformed plan is refused; the wgrad operands padded to
    512 tokens in the kernels'
    buffers (``pad_to``) hold the same bytes and scales in front and zero bytes of scale 1 behind, and so do
    the torch path's."""
    code = r'''
import torch
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.kernels.triton_quant import quantize_act_triton, quantize_dual_triton, quantize_transposed_triton
g = torch.Generator().manual_seed(0)
same = lambda a, b: a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
for fmt in ("fp32", "ue8m0"):
    r = FP8Recipe(mode="jet", scale_fmt=fmt)
    for M, N in ((300, 200), (128, 256), (1, 5)):
        d = torch.randn(M, N, generator=g) * 3
        d[:, :7] *= 50  # groups of very different range
        for cm, plan in ((False, (128, 8)), (True, (32, 4)), (True, (128, 8))):  # one tile / RB-row chunks
            q, s, qt, st = quantize_dual_triton(d, r, cm, plan=plan)
            qr, sr = quantize_act_triton(d, r, cm)
            qtr, str_ = quantize_transposed_triton(d, r, tile_scale=False)
            assert same(q, qr) and torch.equal(s, sr) and s.stride() == sr.stride(), (M, N, cm)
            assert same(qt, qtr) and torch.equal(st, str_), (M, N, cm)
# the wgrad operands padded to 512 tokens in the kernels' own buffers (gemm.wgrad_token_pad): the same bytes and
# scales in front, zero bytes with scale 1 behind; the torch path pads alike
from megatron_jetrl.precision.quant import quantize_transposed
r = FP8Recipe(mode="jet")
pad_ok = lambda qp, sp, q, s_: (qp.shape[1] % 512 == 0 and same(qp[:, : q.shape[1]].contiguous(), q)
                                and not qp.view(torch.uint8)[:, q.shape[1]:].any() and torch.equal(sp[:, : s_.shape[1]], s_)
                                and bool((sp[:, s_.shape[1]:] == 1).all()) and sp.shape[1] == qp.shape[1] // 128)
for M, N in ((300, 200), (600, 256), (512, 128)):
    d = torch.randn(M, N, generator=g) * 3
    qt, st = quantize_dual_triton(d, r, True)[2:]
    qtp, stp = quantize_dual_triton(d, r, True, pad_to=512)[2:]
    assert pad_ok(qtp, stp, qt, st) and (qtp.shape[1] == M) is (M % 512 == 0), (M, N)
    for tile in (False, True):
        for xs_ in (None, quantize_act_triton(d, r)):
            src = d if xs_ is None else xs_[0]
            q, s_ = quantize_transposed_triton(src, r, tile, None if xs_ is None else xs_[1])
            qp, sp = quantize_transposed_triton(src, r, tile, None if xs_ is None else xs_[1], pad_to=512)
            assert pad_ok(qp, sp, q, s_), (M, N, tile)
            # the torch path (its FP8 casts round like the GPU's, not like the interpreter's: compared on the H200)
            qc, sc = quantize_transposed(src, r, tile, None if xs_ is None else xs_[1], use_triton=False)
            qcp, scp = quantize_transposed(src, r, tile, None if xs_ is None else xs_[1], use_triton=False, pad_to=512)
            assert pad_ok(qcp, scp, qc, sc) and qcp.shape == qp.shape and scp.shape == sp.shape, (M, N, tile)
try:
    quantize_transposed_triton(d, r, False, pad_to=200)
    raise SystemExit("pad_to not a multiple of the group accepted")
except ValueError as e:
    assert "multiple of the group size" in str(e)
for bad in ((100, 4), (128, 3)):
    try:
        quantize_dual_triton(d, r, True, plan=bad)
        raise SystemExit("bad plan accepted")
    except ValueError as e:
        assert "dual quantizer plan" in str(e)
print("ok")
'''
    run_interpreted(code)


def test_quantizers_64_bit_offsets_under_the_interpreter():
    """Past 2^31 elements (``layout.wide_offsets``) the quantizers and SwiGLU kernels index in 64 bits; their
    64-bit variants, forced here on small ragged shapes under Triton's CPU interpreter, write the bytes, scales
    and values of the 32-bit ones (the H200 runs them past 2^31 for real: tests/test_gpu_quant.py). Also the
    rule itself, on meta tensors: the largest offset is the sum of (size - 1) x stride."""
    code = r'''
import torch
from megatron_jetrl.kernels import triton_quant as tq
from megatron_jetrl.kernels.layout import wide_offsets
from megatron_jetrl.precision.quant import kv_rule
from megatron_jetrl.precision.recipe import FP8Recipe
meta = lambda *shape: torch.empty(shape, device="meta")
assert wide_offsets(meta(37450, 57344)) and not wide_offsets(meta(37449, 57344))  # fc1's out, 70B: 2^31 at 37,450 rows
assert wide_offsets(meta(2, 2 ** 31)) and not wide_offsets(meta(2, 2 ** 30), meta(0, 2 ** 40))
assert wide_offsets(meta(3, 2 ** 20).as_strided((2, 8), (2 ** 31, 1)))  # by strides, not by size
g = torch.Generator().manual_seed(0)
r, r8 = FP8Recipe(mode="jet"), FP8Recipe(mode="jet", scale_fmt="ue8m0")
def every(x, y, da, f8):
    out = [*tq.quantize_act_triton(x, r), *tq.quantize_act_triton(x, r8, True, plan=(8, 2, 4, 1)),
           *tq.quantize_transposed_triton(x, r, False), *tq.quantize_transposed_triton(x, r8, True, pad_to=512),
           *tq.quantize_weight_triton(x, r), *tq.swiglu_quant_triton(y, r), tq.swiglu_triton(y),
           tq.swiglu_backward_triton(y, da), *tq.quantize_dual_triton(x, r, True, plan=(32, 4)),
           *tq.quantize_dual_triton(x, r8, False), tq.transpose_bytes_triton(f8),
           *tq.kv_qdq_triton(x[:, :128].reshape(-1, 2, 64), kv_rule(r), with_bytes=True)]
    return [t.view(torch.uint8) if t.element_size() == 1 else t for t in out]
for M, N in ((300, 200), (129, 384)):
    x = torch.randn(M, N, generator=g) * 3
    x[:, :5] *= 40
    y = torch.randn(M, 2 * N, generator=g) * 3
    da = torch.randn(M, N, generator=g)
    f8 = (x * 10).to(torch.float8_e4m3fn)
    narrow = every(x, y, da, f8)
    tq.wide_offsets = lambda *t: True
    wide = every(x, y, da, f8)
    tq.wide_offsets = wide_offsets
    assert len(narrow) == len(wide) == 26
    for i, (a, b) in enumerate(zip(narrow, wide)):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b), (M, N, i)
print("ok")
'''
    run_interpreted(code)


def test_rope_and_cache_kernel_under_the_interpreter():
    """The static decoder's RoPE + KV-cache kernel (CUDA in production) under Triton's CPU
    interpreter, fp32 (the interpreter's bf16 rounding is not the GPU's; tests/test_gpu_*.py checks
    bf16 bytes on the H200): q in place and the cache columns equal megatron-core's unfused RoPE
    (``_apply_rotary_pos_emb_bshd``) plus ``index_copy_``, and :func:`rope_torch` (the CPU path)
    equals megatron's too; partial rotary, GQA, prefill (S > 1) and the strided views of the fused
    QKV split; cache columns outside the positions untouched."""
    code = r'''
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron_jetrl.kernels.rope import rope_and_cache, rope_tables, rope_torch
g = torch.Generator().manual_seed(0)
for S, b, H, G, D, rot in ((1, 3, 4, 2, 16, 16), (5, 2, 4, 4, 24, 8)):
    hpg = H // G
    qkv = torch.randn(S, b, G, (hpg + 2) * D, generator=g)
    q, k, v = torch.split(qkv, [hpg * D, D, D], dim=3)
    q = q.reshape(S, b, H, D)
    L, pos = 12, 3
    idx = pos + torch.arange(S)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(L).float(), inv)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :].index_select(0, idx)
    kc_ref, vc_ref = torch.randn(b, G, L, D, generator=g), torch.randn(b, G, L, D, generator=g)
    kc, vc = kc_ref.clone(), vc_ref.clone()
    q_ref, k_ref = _apply_rotary_pos_emb_bshd(q, freqs), _apply_rotary_pos_emb_bshd(k, freqs)
    kc_ref.index_copy_(2, idx, k_ref.permute(1, 2, 0, 3))
    vc_ref.index_copy_(2, idx, v.permute(1, 2, 0, 3))
    cos, sin = rope_tables(freqs, torch.float32)
    assert torch.equal(rope_torch(q, cos, sin), q_ref) and torch.equal(rope_torch(k, cos, sin), k_ref)
    q_in = q.clone()
    rope_and_cache(q_in, k, v, cos, sin, kc, vc, idx)
    assert torch.equal(q_in, q_ref), (S, (q_in - q_ref).abs().max())
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), (S, b, H, G, D, rot)
print("ok")
'''
    run_interpreted(code)


def test_fp8_kv_cache_kernels_under_the_interpreter():
    """The FP8 KV cache's kernels (CUDA in production) under Triton's CPU interpreter, fp32:

    - the decoder's RoPE + cache write with one RoPE position per token and sequence (left-padded rows rotated
      from their own first token) writes ``quant.quantize_kv``'s power-of-two scales of ``rope_torch``'s keys and
      of the values, and the E4M3 bytes of the 1 x head_dim quantizer kernel with those scales (the interpreter's
      float -> E4M3 cast is its own, not round-to-nearest-even, so bytes are compared between kernels here and
      with torch's cast on the H200, tests/test_gpu_decode.py); an unquantized cache gets the RoPE'd values; q is
      rotated in place, other columns are untouched;
    - the training forward's one-pass quantize-dequantize (``kv_qdq_triton``) equals those bytes times the scales,
      for a strided [s, b, g, d] view;
    - the cache write into a key-major V cache (exact mode's FP8 cache: ``[b, G, d, L]`` memory) stores the same
      bytes; into exact mode's cache indexed by position (``shift``: each row's tokens at their own positions, left
      pads not written) the same bytes at those columns, the decoder's torch write (the CPU's) the same values;
    - the decode attention over an FP8 cache (the key-major kernel; scales folded into the scores and the softmax
      weights) equals SDPA over the dequantized K/V to 1e-5, and the same kernel over the dequantized cache bit for
      bit (multiplying by a power of two commutes with rounding), with V key-major or [L, d], one split and several;
      with a 16-bit q (the GPU's path: fp16 tensor cores, P times 2^8 in fp16) within fp16's rounding."""
    code = r'''
import torch, torch.nn.functional as F
from megatron_jetrl.kernels.decode_attn import decode_attention
from megatron_jetrl.kernels.rope import rope_and_cache, rope_tables, rope_torch
from megatron_jetrl.kernels.triton_quant import kv_qdq_triton
from megatron_jetrl.kernels.triton_quant import quantize_act_triton
from megatron_jetrl.precision.quant import dequantize_kv, kv_rule, quantize_act, quantize_kv
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.rollout.decode import StaticDecoder
recipe = FP8Recipe(kv_cache="fp8")
g = torch.Generator().manual_seed(0)
def kernel_bytes(x):  # [..., D] -> the 1 x D quantizer kernel's E4M3 bytes with ue8m0 scales (and the scales)
    D = x.shape[-1]
    q, sc = quantize_act_triton(x.reshape(-1, D), FP8Recipe(scale_fmt="ue8m0", group_size=D, weight_block=(D, D)))
    return q.view(torch.uint8).view(x.shape), sc.view(x.shape[:-1])
for S, b, H, G, D, rot in ((1, 3, 4, 2, 16, 16), (5, 2, 4, 4, 32, 8)):
    hpg = H // G
    qkv = torch.randn(S, b, G, (hpg + 2) * D, generator=g) * 3
    q, k, v = torch.split(qkv, [hpg * D, D, D], dim=3)
    q = q.reshape(S, b, H, D)
    L, pos = 12, 3
    idx = pos + torch.arange(S)
    pads = torch.tensor([0, 2, 1][:b])
    rp = (idx[:, None] - pads[None]).clamp_min(0)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(L).float(), inv)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :].index_select(0, rp.reshape(-1)).view(S, b, 1, rot)
    cos, sin = rope_tables(freqs, torch.float32)
    assert cos.shape == (S * b, rot)
    k_ref = rope_torch(k, cos, sin)
    for row in range(b):  # per-row tables: each row rotated by its own positions
        one = rope_torch(k[:, row:row + 1], *rope_tables(freqs[:, row:row + 1], torch.float32))
        assert torch.equal(k_ref[:, row:row + 1], one)
    _, ksc = quantize_kv(k_ref.permute(1, 2, 0, 3), recipe)
    _, vsc = quantize_kv(v.permute(1, 2, 0, 3), recipe)
    kq, ks2 = kernel_bytes(k_ref.permute(1, 2, 0, 3))
    vq, vs2 = kernel_bytes(v.permute(1, 2, 0, 3))
    assert torch.equal(ks2, ksc) and torch.equal(vs2, vsc)
    kc = torch.zeros(b, G, L, D, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    ks, vs = torch.full((b, G, L), 7.0), torch.full((b, G, L), 7.0)
    q_in = q.clone()
    rope_and_cache(q_in, k, v, cos, sin, kc, vc, idx, ks, vs, recipe)
    assert torch.equal(q_in, rope_torch(q, cos, sin))
    cols = torch.zeros(L, dtype=torch.bool)
    cols[idx] = True
    assert torch.equal(kc[:, :, idx].view(torch.uint8), kq) and torch.equal(ks[:, :, idx], ksc)
    assert torch.equal(vc[:, :, idx].view(torch.uint8), vq) and torch.equal(vs[:, :, idx], vsc)
    assert not kc[:, :, ~cols].float().any() and bool((ks[:, :, ~cols] == 7.0).all())
    vck = torch.zeros(b, G, D, L, dtype=torch.float8_e4m3fn).transpose(-1, -2)  # V key-major, exact mode's FP8 cache
    rope_and_cache(q.clone(), k, v, cos, sin, torch.zeros_like(kc), vck, idx, ks.clone(), vs.clone(), recipe)
    assert torch.equal(vck.view(torch.uint8), vc.view(torch.uint8))
    kc32 = torch.zeros(b, G, L, D)
    vc32 = torch.zeros_like(kc32)
    rope_and_cache(q.clone(), k, v, cos, sin, kc32, vc32, idx)
    assert torch.equal(kc32[:, :, idx], k_ref.permute(1, 2, 0, 3)) and torch.equal(vc32[:, :, idx], v.permute(1, 2, 0, 3))
    # exact mode's cache, indexed by position: row r's token at column idx - shift[r]; a negative one (a pad) is not
    # written; the same as the decoder's torch write (the CPU's), FP8 bytes and scales as the quantizer kernel's
    sh = torch.tensor([0, 4, 3][:b] if S > 1 else [0, 3, 2][:b])  # a prefill's pads; a decode step's positions >= 0
    kcs, vcs = torch.zeros(b, G, L, D), torch.zeros(b, G, D, L).transpose(-1, -2)
    rope_and_cache(q.clone(), k, v, cos, sin, kcs, vcs, idx, shift=sh)
    kct, vct = torch.zeros_like(kcs), torch.zeros_like(vcs)
    StaticDecoder._write_kv(None, kct, vct, None, None, k_ref, v, idx, sh)
    assert torch.equal(kcs, kct) and torch.equal(vcs, vct)
    k8, v8 = torch.zeros_like(kc), torch.zeros(b, G, D, L, dtype=torch.float8_e4m3fn).transpose(-1, -2)
    ks8, vs8 = torch.zeros(b, G, L), torch.zeros(b, G, L)
    rope_and_cache(q.clone(), k, v, cos, sin, k8, v8, idx, ks8, vs8, recipe, shift=sh)
    for r in range(b):
        c = idx - sh[r]
        w = c >= 0
        assert torch.equal(kcs[r][:, c[w]], k_ref[w, r].permute(1, 0, 2))
        assert torch.equal(vcs[r][:, c[w]], v[w, r].permute(1, 0, 2))
        assert torch.equal(k8[r][:, c[w]].view(torch.uint8), kq[r][:, w]) and torch.equal(ks8[r][:, c[w]], ksc[r][:, w])
        assert torch.equal(v8[r][:, c[w]].view(torch.uint8), vq[r][:, w]) and torch.equal(vs8[r][:, c[w]], vsc[r][:, w])
        rest = torch.ones(L, dtype=torch.bool)
        rest[c[w]] = False
        assert not (kcs[r][:, rest].any() or vcs[r][:, rest].any() or k8[r][:, rest].float().any() or ks8[r][:, rest].any())
    assert S == 1 or (idx[None, :] - sh[:, None] < 0).any()  # a pad column was skipped
    # a split-K QKV GEMM's fp32 partials summed by the same kernel (split order, rounded to the dtype): the bytes of
    # the sum kernel's output through the kernel, in q (a new tensor), the caches and the scales
    for splits, dt in ((2, torch.float16), (3, torch.float32)):
        part = torch.randn(splits, S, b, (H + 2 * G) * D, generator=g)  # the rollout layout [q | k | v]
        summed = part[0].clone()
        for i in range(1, splits):
            summed += part[i]
        summed = summed.to(dt)
        views = [[x.unflatten(-1, (-1, D)) for x in torch.split(t, [H * D, G * D, G * D], dim=-1)]
                 for t in (part[0], summed)]
        res = []
        for (pq, pk, pv), pp in zip(views, ((splits, part.stride(0)), None)):
            caches = (torch.zeros_like(kc), torch.zeros(b, G, D, L, dtype=torch.float8_e4m3fn).transpose(-1, -2),
                      torch.zeros(b, G, L), torch.zeros(b, G, L))
            qr = rope_and_cache(pq, pk, pv, cos.to(dt), sin.to(dt), *caches[:2], idx, *caches[2:], recipe,
                                partials=pp, dtype=dt)
            res.append((qr, *caches))
        assert res[0][0].dtype == dt and not res[0][0].data_ptr() == part.data_ptr()
        assert torch.equal(res[0][0], res[1][0]) and bool(res[0][3].any())
        assert all(torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                               y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y)
                   for x, y in zip(res[0][1:], res[1][1:]))
    kv = qkv[..., hpg * D:hpg * D + D]  # a strided view, as the fused QKV split returns
    kb, kbs = kernel_bytes(kv)
    assert torch.equal(kv_qdq_triton(kv, kv_rule(recipe)), kb.view(torch.float8_e4m3fn).float() * kbs[..., None])
    q8, s8, y8 = kv_qdq_triton(kv, kv_rule(recipe), with_bytes=True)  # the same pass, with the bytes and scales
    assert torch.equal(q8.view(torch.uint8), kb) and torch.equal(s8, kbs) and torch.equal(y8, kv_qdq_triton(kv, kv_rule(recipe)))
for b, H, G, D, L, pos, splits in ((3, 8, 4, 64, 40, 29, 1), (2, 6, 2, 80, 70, 69, 3), (2, 4, 1, 32, 20, 0, 2)):
    q = torch.randn(b, H, D, generator=g)
    kq, ks = quantize_kv(torch.randn(b, G, L, D, generator=g) * 4, recipe)
    vq, vs = quantize_kv(torch.randn(b, G, L, D, generator=g) / 8, recipe)
    ok = torch.ones(b, L, dtype=torch.bool)
    ok[0, : min(5, pos)] = False
    ok[:, pos + 1:] = torch.rand(b, L - pos - 1, generator=g) > 0.5
    valid = ok.clone()
    valid[:, pos + 1:] = False
    bias = torch.zeros(b, 1, 1, L).masked_fill_(~valid[:, None, None, :], float("-inf"))
    kd, vd = dequantize_kv(kq, ks, torch.float32), dequantize_kv(vq, vs, torch.float32)
    ref = F.scaled_dot_product_attention(q[:, :, None], kd, vd, attn_mask=bias, scale=D ** -0.5, enable_gqa=H != G)[:, :, 0]
    vqk = vq.transpose(-1, -2).contiguous().transpose(-1, -2)  # V key-major: key-contiguous tiles
    out = decode_attention(q, kq, vqk, ok, torch.tensor([pos]), D ** -0.5, splits=splits, block_n=16, k_scale=ks, v_scale=vs)
    assert (out - ref).abs().max() < 1e-5, (b, H, G, D, pos, splits, (out - ref).abs().max())
    assert torch.equal(decode_attention(q, kq, vq, ok, torch.tensor([pos]), D ** -0.5, splits=splits, block_n=16,
                                        k_scale=ks, v_scale=vs), out)  # V [L, d] (the decoder's): the same bits
    same = decode_attention(q, kd, vd.transpose(-1, -2).contiguous().transpose(-1, -2), ok, torch.tensor([pos]),
                            D ** -0.5, splits=splits, block_n=16)
    assert torch.equal(out, same)  # power-of-two scales folded into scores and weights: the dequantized cache's bits
    # each row's first valid key (the decoder's call, its left pads a prefix) instead of key_ok's bytes: the same bits
    first = torch.tensor([min(5, pos)] + [0] * (b - 1))
    for v_ in (vqk, vq):
        assert torch.equal(decode_attention(q, kq, v_, ok, torch.tensor([pos]), D ** -0.5, splits=splits, block_n=16,
                                            k_scale=ks, v_scale=vs, first_key=first), out)
    out16 = decode_attention(q.half(), kq, vqk, ok, torch.tensor([pos]), D ** -0.5, splits=splits, block_n=16,
                             k_scale=ks, v_scale=vs)  # a 16-bit q: the fp16 tensor-core path
    assert out16.dtype == torch.float16 and (out16.float() - ref).abs().max() < 3e-3, (out16.float() - ref).abs().max()
    # the output projection's activation quantization in the same kernel (one split): the bytes and scales of the
    # activation quantizer kernel the projection runs otherwise (the interpreter's E4M3 casts round a few ties
    # unlike torch's, for both kernels alike; the GPU test compares with torch), the scales also torch's rule's;
    # scales row-major or column-major
    for qq, o in ((q, out), (q.half(), out16)):
        for fmt, col in (("fp32", False), ("ue8m0", True)):
            rq = FP8Recipe(scale_fmt=fmt, group_size=D, weight_block=(D, D))
            o2, xq = decode_attention(qq, kq, vqk, ok, torch.tensor([pos]), D ** -0.5, splits=splits, block_n=16,
                                      k_scale=ks, v_scale=vs, quant=rq, scale_col_major=col)
            assert torch.equal(o2, o)
            if splits > 1:  # partials merged by a second kernel: no fused quantization
                assert xq is None
                continue
            qr, sr = quantize_act_triton(o.reshape(b, H * D), rq)
            assert xq[0].shape == (b, H * D) and torch.equal(xq[0].view(torch.uint8), qr.view(torch.uint8))
            assert torch.equal(xq[1], sr) and xq[1].stride() == ((1, b) if col else (H, 1)), xq[1].stride()
            assert torch.equal(sr, quantize_act(o.reshape(b, H * D), rq, use_triton=False)[1])
            assert xq[1].unique().numel() > 1
print("ok")
'''
    run_interpreted(code)


def test_training_rope_kernel_under_the_interpreter():
    """The training RoPE (``kernels/rope_train.py``, CUDA in production) under Triton's CPU interpreter, fp32:
    its forward and its autograd backward equal megatron-core's unfused RoPE and that statement's eager
    autograd gradient (same ops, same order), for the strided q/k views of the fused QKV split,
    partial rotary and more heads than one program holds; ``fused_rope`` on CPU tensors is megatron's
    eager function."""
    code = r'''
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron_jetrl.kernels import rope_train as rope
g = torch.Generator().manual_seed(0)
for S, b, H, G, D, rot in ((3, 2, 4, 2, 16, 16), (2, 1, 40, 8, 128, 64)):
    hpg = H // G
    qkv = torch.randn(S, b, G, (hpg + 2) * D, generator=g)
    q, k, _ = torch.split(qkv, [hpg * D, D, D], dim=3)
    q = q.reshape(S, b, H, D)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(S).float() + 5, inv)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :]
    for t in (q, k):
        dy = torch.randn(t.shape, generator=g)
        x_ref = t.detach().clone().requires_grad_()
        y_ref = _apply_rotary_pos_emb_bshd(x_ref, freqs)
        y_ref.backward(dy)
        x = t.detach().requires_grad_()
        y = rope.rope_kernel_apply(x, freqs)
        y.backward(dy)
        assert torch.equal(y, y_ref), (S, H, D, rot, (y - y_ref).abs().max())
        assert torch.equal(x.grad, x_ref.grad), (S, H, D, rot, (x.grad - x_ref.grad).abs().max())
    assert torch.equal(rope.fused_rope(q, freqs), _apply_rotary_pos_emb_bshd(q, freqs))  # CPU: eager
# the cos/sin tables: once per freqs tensor (megatron hands every layer the same one), again after it changes
calls, real = [], rope.rope_tables
rope.rope_tables = lambda *a: calls.append(1) or real(*a)
freqs2 = freqs.clone()
ref = rope.rope_kernel_apply(q, freqs2)
assert torch.equal(rope.rope_kernel_apply(q, freqs2), ref) and len(calls) == 1
assert rope._tables(freqs2, torch.float64)[0].dtype == torch.float64 and len(calls) == 2  # per dtype
freqs2.mul_(0.5)  # changed in place: new tables
assert torch.equal(rope.rope_kernel_apply(q, freqs2), _apply_rotary_pos_emb_bshd(q, freqs2)) and len(calls) == 3
print("ok")
'''
    run_interpreted(code)


def test_triton_rmsnorm_under_the_interpreter():
    """The one-kernel RMSNorm (CUDA in production, ``kernels/rmsnorm.py``) under Triton's CPU
    interpreter, fp32: forward equals torch's ``rms_norm`` to fp32 rounding, each row's bytes do not
    depend on how many rows the call has (the trainer's forward and a decode step give the same
    bytes), and the autograd backward matches torch's to fp32 rounding."""
    code = r'''
import torch
from megatron_jetrl.kernels.rmsnorm import RMSNormFunction, rmsnorm_backward, rmsnorm_forward
g = torch.Generator().manual_seed(0)
# the backward kernel alone where a program takes 3 rows (M > 1024), against torch's autograd
x = torch.randn(2050, 96, generator=g) * 3
w, dy = torch.randn(96, generator=g), torch.randn(2050, 96, generator=g)
dx, dw = rmsnorm_backward(x, dy, w, torch.rsqrt(x.pow(2).mean(-1) + 1e-6))
xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
torch.rms_norm(xb, (96,), wb, 1e-6).backward(dy)
assert torch.allclose(dx, xb.grad, rtol=1e-4, atol=1e-5) and torch.allclose(dw, wb.grad, rtol=1e-4, atol=1e-4)
for M, N in ((37, 96), (5, 4096), (3, 300)):
    x = torch.randn(M, N, generator=g) * 3
    w = torch.randn(N, generator=g)
    y, rstd = rmsnorm_forward(x, w, 1e-6)
    ref = torch.rms_norm(x, (N,), w, 1e-6)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5), (M, N, (y - ref).abs().max())
    assert torch.allclose(rstd, torch.rsqrt(x.pow(2).mean(-1) + 1e-6), rtol=1e-6)
    for r in (0, M - 1):  # batch invariance: the row alone gives the same bytes
        assert torch.equal(rmsnorm_forward(x[r:r + 1].clone(), w, 1e-6)[0][0], y[r])
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn(M, N, generator=g)
    RMSNormFunction.apply(xa, wa, 1e-6).backward(dy)
    torch.rms_norm(xb, (N,), wb, 1e-6).backward(dy)
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-4, atol=1e-5), (xa.grad - xb.grad).abs().max()
    assert torch.allclose(wa.grad, wb.grad, rtol=1e-4, atol=1e-4), (wa.grad - wb.grad).abs().max()
print("ok")
'''
    run_interpreted(code)


def test_fused_add_rmsnorm_quant_under_the_interpreter():
    """The decoder's fused residual add + RMSNorm + 1x128 quantizer (CUDA in production) under
    Triton's CPU interpreter, fp32: the sum is torch's ``h + d``, the norm output is the RMSNorm
    kernel's (same bytes as without the add and the quantizer), the FP8 bytes and scales are the
    activation quantizer's on that output (kernel-to-kernel: the interpreter's own E4M3 cast is
    used by both), fp32 and ue8m0 scales, row- and column-major; a split-K GEMM's partials as the delta
    give the bytes of their sum kernel's output as the delta."""
    code = r'''
import torch
from megatron_jetrl.kernels.rmsnorm import add_rmsnorm_quant, rmsnorm_forward
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.kernels.triton_quant import quantize_act_triton
g = torch.Generator().manual_seed(0)
for fmt in ("fp32", "ue8m0"):
    r = FP8Recipe(mode="jet", scale_fmt=fmt)
    for M, N in ((5, 384), (1, 256)):
        h = torch.randn(M, N, generator=g) * 2
        d = torch.randn(M, N, generator=g)
        w = torch.randn(N, generator=g)
        h2, y, (q, s) = add_rmsnorm_quant(h, d, w, 1e-5, r)
        assert torch.equal(h2, h + d)
        y_ref, _ = rmsnorm_forward(h + d, w, 1e-5)
        assert torch.equal(y, y_ref)
        qr, sr = quantize_act_triton(y_ref, r)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr), (fmt, M, N)
        # column-major scales (cuBLAS's layout, as quantize_act(..., scale_col_major=True) writes them)
        _, _, (qc, sc) = add_rmsnorm_quant(h, d, w, 1e-5, r, scale_col_major=True)
        qrc, src = quantize_act_triton(y_ref, r, True)
        assert sc.stride() == src.stride() == (1, M) and torch.equal(sc, sr) and torch.equal(sc, src)
        assert torch.equal(qc.view(torch.uint8), q.view(torch.uint8))
        h3, y3, none = add_rmsnorm_quant(h, None, w, 1e-5)
        assert none is None and h3.data_ptr() == h.data_ptr() and torch.equal(y3, rmsnorm_forward(h, w, 1e-5)[0])
        # delta as split-K partials (deferred sum): the bytes of the sum kernel's output as delta
        from megatron_jetrl.kernels.triton_gemm import sum_partials
        parts = torch.randn(3, M, N, generator=g)
        dsum = sum_partials(parts, torch.empty(M, N))
        assert torch.equal(dsum, parts[0] + parts[1] + parts[2])
        h4, y4, (q4, s4) = add_rmsnorm_quant(h, parts, w, 1e-5, r, delta_splits=3)
        h5, y5, (q5, s5) = add_rmsnorm_quant(h, dsum, w, 1e-5, r)
        assert torch.equal(h4, h5) and torch.equal(y4, y5) and torch.equal(q4.view(torch.uint8), q5.view(torch.uint8))
        assert torch.equal(s4, s5)
print("ok")
'''
    run_interpreted(code)


def test_exact_mode_kernels_under_the_interpreter():
    """Exact mode's kernels (``kernels/exact_attn.py``, ``kernels/exact_gemm.py``; CUDA in production) under the
    interpreter, fp32 (its BF16 is not the GPU's): the attention of a query decoded over a cache indexed by
    position (the exact decoder's: keys 0..p in columns 0..p, stale values past them) is the bytes of the same query
    in the training call over the whole sequence, at and around the 64-key block edges, and in a left-padded
    prefill (queries at negative positions, the pads, get 0) whose tiles are not the training call's, and in the
    trainer's 32-row tiles (``TRAIN_PLAN``: rows of 8 positions where the decoder's hold 1; the interpreter's dots
    element by element, as an MMA's are); the training call equals SDPA to 1e-5; an FP8 cache's bytes and scales
    (V key-major, as the caches hold it, or not) give the bytes of the dequantized values (fp32; with a 16-bit q,
    the GPU's fp16 form, their attention to fp16 rounding); a query decoded over the FP8 cache, on the key-major
    decode kernel, has the trainer's call's bytes and the head-major kernel's (fp32 and 16-bit q; also in its masked
    last block, and with 7 query heads per group), and writes the output projection's FP8 input as the activation
    quantizer would. The
    GEMMs (BF16 and block FP8, row- or column-major activation scales): a row's bytes at 1-129 rows (one program
    per K segment) are those of the 300-row call with the segments summed in the program (also in a plan whose
    column tiles span several weight blocks), and the product is the reference's to fp32 rounding. Autograd: the
    exact linear's gradients are the plain linear's (with ``fuse_accum`` the weight's lands in ``main_grad`` under
    megatron's protocol), the exact attention's forward is the kernel's (over the FP8 bytes given ``kv8``) and its
    gradients are SDPA's."""
    code = r'''
import torch, torch.nn.functional as F
from megatron_jetrl.kernels import exact_attn
from megatron_jetrl.kernels.exact_attn import TRAIN_PLAN, exact_attention, key_major
from megatron_jetrl.kernels.exact_gemm import exact_block_gemm, exact_mm, segments
from megatron_jetrl.precision.quant import (dequantize_act, dequantize_blocks, dequantize_kv, quantize_act,
                                            quantize_kv, quantize_weight)
from megatron_jetrl.precision.recipe import FP8Recipe
g = torch.Generator().manual_seed(0)
b, S, H, G, D, L = 3, 140, 8, 2, 32, 200
q, k, v = (torch.randn(S, b, h, D, generator=g) for h in (H, G, G))
kt, vt = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [b, G, S, d]
zero = torch.zeros(b, dtype=torch.long)
train = exact_attention(q, kt, vt, D ** -0.5, zero)
ref = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), kt, vt, is_causal=True,
                                     scale=D ** -0.5, enable_gqa=True).permute(2, 0, 1, 3).reshape(S, b, H * D)
assert (train - ref).abs().max() < 1e-5, (train - ref).abs().max()
assert torch.equal(exact_attention(q, kt, vt, D ** -0.5, zero, plan=TRAIN_PLAN), train)  # 32-row tiles: the decoder's bits
rec = FP8Recipe(kv_cache="fp8")
(kt8, kts), (vt8, vts) = quantize_kv(kt, rec), quantize_kv(vt, rec)


def cache(i, fp8=False):
    """The decoder's cache at position i: columns 0..i hold the sequence's keys (bytes and scales), the rest stale."""
    kc, vc = torch.randn(b, G, L, D, generator=g), torch.randn(b, G, L, D, generator=g)
    if not fp8:
        kc[:, :, :i + 1], vc[:, :, :i + 1] = kt[:, :, :i + 1], vt[:, :, :i + 1]
        return kc, vc, None, None
    (kc, ks), (vc, vs) = quantize_kv(kc, rec), quantize_kv(vc, rec)
    kc[:, :, :i + 1], vc[:, :, :i + 1] = kt8[:, :, :i + 1], vt8[:, :, :i + 1]
    ks[:, :, :i + 1], vs[:, :, :i + 1] = kts[:, :, :i + 1], vts[:, :, :i + 1]
    return kc, key_major(vc), ks, vs


for i in (0, 1, 63, 64, 65, 128, S - 1):
    kc, vc, _, _ = cache(i)
    out = exact_attention(q[i:i + 1], kc, vc, D ** -0.5, torch.full((b,), i))
    assert torch.equal(out[0], train[i]), i
# a left-padded prefill: row r's prompt from column pads[r], queries at positions column - pads[r] (pads: < 0, get 0)
pads = torch.tensor([0, 5, 60])
P = 90
qp = torch.randn(P, b, H, D, generator=g)
for r in range(b):
    qp[int(pads[r]):, r] = q[:P - int(pads[r]), r]
kc, vc, _, _ = cache(P - 1)
out = exact_attention(qp, kc, vc, D ** -0.5, -pads)
for r in range(b):
    p = int(pads[r])
    assert torch.equal(out[p:, r], train[:P - p, r]) and not out[:p, r].any(), r
kc, vc, ks, vs = cache(S - 1, fp8=True)
o8 = exact_attention(q, kc, vc, D ** -0.5, zero, ks, vs)
od = exact_attention(q, dequantize_kv(kc, ks, torch.float32), dequantize_kv(vc, vs, torch.float32), D ** -0.5, zero)
assert torch.equal(o8, od) and torch.equal(exact_attention(q, kc, vc.contiguous(), D ** -0.5, zero, ks, vs), o8)
# the GPU's form of the FP8 variant (a 16-bit q: fp16 tensor cores, the scales on scores and weights): the dequantized
# values' attention to fp16 rounding, and a query decoded over the cache has the bytes of the trainer's call over the
# sequence's own bytes (32-row tiles); a decode step over the FP8 cache runs the key-major kernel (S^T = K q^T), and
# gives the bytes of the head-major kernel's one-query tile too, fp32 and 16-bit
q16 = q.half()
assert (exact_attention(q16, kc, vc, D ** -0.5, zero, ks, vs).float() - o8).abs().max() < 1e-2
launched = []


class _Launches:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launched.append(grid)
        return self.kernel[grid]


exact_attn._exact_decode_keys_kernel = _Launches(exact_attn._exact_decode_keys_kernel)
trains = {qq.dtype: exact_attention(qq, kt8, key_major(vt8), D ** -0.5, zero, kts, vts, plan=TRAIN_PLAN)
          for qq in (q, q16)}
for qq in (q, q16):
    train8 = trains[qq.dtype]
    for i in (0, 1, 63, 64, 65, S - 1):
        kc, vc, ks, vs = cache(i, fp8=True)
        n = len(launched)
        out = exact_attention(qq[i:i + 1], kc, vc, D ** -0.5, torch.full((b,), i), ks, vs)
        assert len(launched) == n + 1 and torch.equal(out[0], train8[i]), (qq.dtype, i)
        head = exact_attention(qq[i:i + 1], kc, vc, D ** -0.5, torch.full((b,), i), ks, vs, plan=(64, 4, 2, 16))
        assert len(launched) == n + 1 and torch.equal(head, out), (qq.dtype, i)
        # one key block an iteration, where the decoder's plan takes two (then the odd one, then the masked one):
        # the same block steps, the same bytes
        single = exact_attention(qq[i:i + 1], kc, vc, D ** -0.5, torch.full((b,), i), ks, vs, keys_plan=(2, 3, 1))
        assert torch.equal(single, out), (qq.dtype, i)
    # a view of 130 keys: the last query's block passes the length (keys 128-129 of 128-191: the masked block)
    kc, vc, ks, vs = (t[:, :, :130] for t in cache(129, fp8=True))
    out = exact_attention(qq[129:130], kc, vc, D ** -0.5, torch.full((b,), 129), ks, vs)
    assert torch.equal(out[0], train8[129]), qq.dtype
# 7 query heads per group (Qwen2.5's), padded to the key-major kernel's 8 columns: the trainer's bytes
q7 = torch.randn(70, b, 7 * G, D, generator=g).half()
train7 = exact_attention(q7, kt8[:, :, :70], key_major(vt8[:, :, :70]), D ** -0.5, zero, kts[:, :, :70], vts[:, :, :70],
                         plan=TRAIN_PLAN)
kc, vc, ks, vs = cache(69, fp8=True)
assert torch.equal(exact_attention(q7[69:70], kc, vc, D ** -0.5, torch.full((b,), 69), ks, vs)[0], train7[69])
# head_dim = the recipe's group: the key-major kernel also writes the output projection's FP8 input, the bytes and
# scales (row- or column-major) of the activation quantizer kernel on the stored output (the interpreter's E4M3 casts
# round a few ties unlike torch's, for both kernels alike; the GPU tests compare the decoder with the trainer), the
# scales also torch's rule's; no other call writes them
from megatron_jetrl.kernels.triton_quant import quantize_act_triton
(k2, k2s), (v2, v2s) = (quantize_kv(torch.randn(b, 1, 70, 128, generator=g) * 4, rec) for _ in range(2))
q2, p2 = torch.randn(1, b, 4, 128, generator=g).half(), torch.tensor([69, 3, 40])
for col in (False, True):
    out, (xb, xs) = exact_attention(q2, k2, key_major(v2), 0.1, p2, k2s, v2s, quant=rec, scale_col_major=col)
    rb, rs = quantize_act_triton(out[0], rec, scale_col_major=col)
    assert torch.equal(out, exact_attention(q2, k2, key_major(v2), 0.1, p2, k2s, v2s)), col
    assert torch.equal(xb.view(torch.uint8), rb.view(torch.uint8)) and torch.equal(xs, rs) and xs.stride() == rs.stride()
    assert torch.equal(xs, quantize_act(out[0], rec, use_triton=False)[1]) and xs.unique().numel() > 1
assert exact_attention(q2.repeat(3, 1, 1, 1), k2, key_major(v2), 0.1, p2 - 3, k2s, v2s, quant=rec)[1] is None
N, K = 384, 1024
x, w = torch.randn(300, K, generator=g), torch.randn(N, K, generator=g) / 16
assert segments(N, K, 128, x.device) == 2 and segments(N, K, 64, x.device) == 4
y = exact_mm(x, w, split=False)
assert (y - x @ w.t()).abs().max() < 1e-4
r8 = FP8Recipe()
(xq, xs), (xq_c, xs_c), (wq, ws) = quantize_act(x, r8), quantize_act(x, r8, scale_col_major=True), quantize_weight(w, r8)
y8 = exact_block_gemm(xq, xs, wq, ws, torch.float32, split=False)
assert torch.equal(exact_block_gemm(xq_c, xs_c, wq, ws, torch.float32), y8)
assert torch.equal(exact_block_gemm(xq, xs, wq, ws, torch.float32, split=False, config=(32, 256, 4, 2)), y8)  # 3 blocks/tile
assert (y8 - dequantize_act(xq, xs, 128) @ dequantize_blocks(wq, ws, 128, 128).t()).abs().max() < 1e-3
for m in (1, 2, 64, 129):
    assert torch.equal(exact_mm(x[:m], w), y[:m]), m
    assert torch.equal(exact_block_gemm(xq[:m], xs[:m], wq, ws, torch.float32), y8[:m]), m
# autograd: the exact linear's gradients are the plain linear's; with fuse_accum the weight's goes into main_grad
from megatron_jetrl.kernels.exact_attn import ExactAttention
from megatron_jetrl.kernels.exact_gemm import ExactLinearFunction
xr, wr = x[:40].clone().requires_grad_(True), w.clone().requires_grad_(True)
dy = torch.randn(40, N, generator=g)
ExactLinearFunction.apply(xr, wr).backward(dy)
assert torch.allclose(xr.grad, dy @ w, atol=1e-4) and torch.allclose(wr.grad, dy.t() @ x[:40], atol=1e-4)
wf = w.clone().requires_grad_(True)
wf.main_grad, wf.grad_added_to_main_grad = torch.ones(N, K), False
ExactLinearFunction.apply(x[:40], wf, True).backward(dy)
assert wf.grad_added_to_main_grad and torch.allclose(wf.main_grad, 1 + dy.t() @ x[:40], atol=1e-4)
# the exact attention's forward is the kernel's, its gradients SDPA's (recomputed)
qa, ka, va = (t[:70].clone().requires_grad_(True) for t in (q, k, v))
out = ExactAttention.apply(qa, ka, va, D ** -0.5)
assert torch.equal(out, exact_attention(q[:70], kt[:, :, :70], vt[:, :, :70], D ** -0.5, zero))
kv8 = (kt8[:, :, :70], kts[:, :, :70], vt8[:, :, :70].contiguous(), vts[:, :, :70])  # the trainer's bytes: V [L, d]
assert torch.equal(ExactAttention.apply(q16[:70], ka.half(), va.half(), D ** -0.5, kv8), trains[torch.float16][:70])
do = torch.randn(out.shape, generator=g)
out.backward(do)
qb, kb, vb = (t[:70].clone().requires_grad_(True) for t in (q, k, v))
ref = F.scaled_dot_product_attention(qb.permute(1, 2, 0, 3), kb.permute(1, 2, 0, 3), vb.permute(1, 2, 0, 3), is_causal=True,
                                     scale=D ** -0.5, enable_gqa=True).permute(2, 0, 1, 3).reshape(70, b, H * D)
ref.backward(do)
assert all(torch.equal(a.grad, c.grad) for a, c in ((qa, qb), (ka, kb), (va, vb)))
print("ok")
'''
    run_interpreted(code)
