"""The FP8 quantization rule on CPU: every quantizer against an independent float64 statement of the
rule, the references of SGLang and ModelOpt, TP shards, launch plans."""
import numpy as np
import pytest
import torch
from megatron_jetrl.precision.quant import (dequantize_act, quantize_act,
                                            quantize_blocks, quantize_weight)
from megatron_jetrl.precision.recipe import FP8Recipe
from tests.common import blocks_differing, wide_data, one_ulp_apart, sglang_fp8_utils_reference, reference_blocks

@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("shape,block", [((7, 300), (1, 128)), ((64, 256), (1, 128)),
                                         ((300, 200), (128, 128)), ((256, 384), (128, 128))])
def test_quantizer_matches_float64_reference(shape, block, scale_fmt):
    recipe = FP8Recipe(scale_fmt=scale_fmt)
    x = wide_data(shape, seed=shape[0])
    q, s = quantize_blocks(x, *block, recipe)
    ref_q, ref_s = reference_blocks(x.numpy(), *block, scale_fmt)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))  # ceil-div like SGLang
    np.testing.assert_array_equal(s.double().numpy(), ref_s)
    np.testing.assert_array_equal(q.double().numpy(), ref_q)
    if scale_fmt == "ue8m0":  # powers of two
        m, _ = np.frexp(s.numpy())
        assert np.all(m == 0.5)


def test_bf16_input_and_wrappers_agree():
    recipe = FP8Recipe()
    x = wide_data((15, 256), seed=3).view(5, 3, 256).bfloat16()
    q, s = quantize_act(x, recipe)
    assert q.shape == x.shape and s.shape == (5, 3, 2)
    q2, s2 = quantize_blocks(x.reshape(15, 256), 1, 128, recipe)
    assert torch.equal(q.view(15, 256).view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s.view(15, 2), s2)
    w = wide_data((256, 256), seed=4)
    qw, sw = quantize_weight(w, recipe)
    assert sw.shape == (2, 2)


def test_saturation_zero_blocks_and_error_bound():
    recipe = FP8Recipe()
    x = wide_data((4, 256), seed=5)
    x[1, :128] = 0.0
    q, s = quantize_act(x, recipe)
    # every non-zero group's largest magnitude lands on +-448, exactly the format's max
    amax_q = q.float().abs().view(4, 2, 128).amax(-1)
    assert torch.all((amax_q == 448.0) | (s.view(4, 2) < 1e-12))
    # an all-zero group: tiny finite scale, zero bytes
    assert s[1, 0].item() == pytest.approx(1e-10 / 448, rel=1e-6) and torch.all(q[1, :128].float() == 0)
    # dequantized error <= half an E4M3 ulp (2^-4 relative) or the subnormal step
    deq = dequantize_act(q, s)
    bound = torch.maximum(x.abs() * 2.0 ** -4, s.repeat_interleave(128, 1) * 2.0 ** -9)
    assert torch.all((deq - x).abs() <= bound + 1e-30)


def test_tp_shards_quantize_like_the_whole_tensor():
    recipe = FP8Recipe()
    w = wide_data((512, 768), seed=6)
    q, s = quantize_weight(w, recipe)
    for dim in (0, 1):  # column-parallel rows / row-parallel columns, 128-aligned shards
        for r, part in enumerate(w.chunk(2, dim)):
            qp, sp = quantize_weight(part, recipe)
            assert torch.equal(qp.view(torch.uint8), q.chunk(2, dim)[r].view(torch.uint8))
            assert torch.equal(sp, s.chunk(2, dim)[r])


def test_quantized_weights_vs_sglang_and_modelopt_references():
    """Our 128x128 weight quantizer against SGLang's reference quantizers and nvidia-modelopt's
    block quantizer on a [1000, 1300] weight (not 128-aligned) with a zero block and a block of
    magnitude 1e-6. Differences, all explained:
    - ordinary blocks: FP8 bytes identical to all of them, ue8m0 scales identical; fp32 scales
      equal or one float32 ulp apart: the contract (docs/architecture.md) is SGLang's CUDA activation
      kernel's ``amax * fp32(1/448)``, so the rollout's activation scales equal the trainer's;
      these Python references divide (``amax / 448``). Weight scales travel with the weights, so
      the rollout never recomputes them;
    - the zero block: modelopt divides by amax/448 = 0 (NaN bytes); SGLang and we clamp amax;
    - the 1e-6 block: SGLang clamps amax at 1e-4 (so those weights round to ~0 in FP8), we at
      1e-10 (the block keeps its resolution); modelopt has no clamp and agrees with us;
    - modelopt on a bf16 tensor computes amax/448 and the division in bf16 (we always in fp32)."""
    from sglang.benchmark.deepseek_utils import per_block_cast_to_fp8 as sglang_fp32  # pure torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 1300, generator=g) * torch.exp(torch.randn(1000, 1, generator=g))
    w[:128, :128] = 0
    w[128:256, :128] *= 1e-6
    ordinary = torch.ones(8, 11, dtype=torch.bool)
    ordinary[0, 0] = ordinary[1, 0] = False

    q, s = quantize_weight(w, FP8Recipe(scale_fmt="fp32"), use_triton=False)
    qs, ss = sglang_fp32(w)
    d = blocks_differing(q, qs, 8, 11)
    assert d[ordinary].sum() == 0 and d[0, 0] == 0
    one_ulp_apart(s[ordinary], ss[ordinary])
    assert d[1, 0] > 16000  # the 1e-6 block: SGLang's 1e-4 clamp flushes it

    qu, su = quantize_weight(w, FP8Recipe(scale_fmt="ue8m0"), use_triton=False)
    qsu, ssu = sglang_fp8_utils_reference()(w)
    d = blocks_differing(qu, qsu, 8, 11)
    assert torch.equal(su[ordinary], ssu[ordinary]) and d[ordinary].sum() == 0 and d[1, 0] > 16000

    try:
        from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor
    except ImportError as e:
        pytest.skip(f"nvidia-modelopt does not import here ({e}); tools/setup_env.sh installs it")
    mq, ms = FP8QTensor.quantize(w, block_sizes={-1: 128, -2: 128})
    d = blocks_differing(q, mq._quantized_data, 8, 11)
    assert d[ordinary].sum() == 0 and d[1, 0] == 0
    one_ulp_apart(s[ordinary], ms[ordinary])
    assert torch.isnan(mq._quantized_data[:128, :128].float()).all()  # 0 / 0
    mqb, msb = FP8QTensor.quantize(w.bfloat16(), block_sizes={-1: 128, -2: 128})
    assert msb.dtype == torch.bfloat16 and not torch.equal(msb.float()[ordinary], s[ordinary])


def test_act_quant_plan_is_checked():
    """The quantizer's default launch plan by shape; a plan passed in (the tuning tool's) is checked and a
    malformed one refused with one line naming the plan (not a Triton compile error later)."""
    from megatron_jetrl.kernels.triton_quant import act_quant_plan, check_act_quant_plan

    assert act_quant_plan(16384, 4096) == (8, 8, 8, 0) and act_quant_plan(64, 4096) == (4, 1, 4, 0)
    assert check_act_quant_plan((16, 4, 8)) == (16, 4, 8, 0)
    for bad in ((8, 3, 8), (8, 8), (8, 8, 3)):
        with pytest.raises(ValueError, match="activation quantizer plan"):
            check_act_quant_plan(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_kv_cache_quantizer_follows_the_rule(dtype, scale_fmt):
    """``precision.kv_cache=fp8``: keys/values ``[..., head_dim]`` quantized per token and KV head with power-of-two
    scales whatever the weights' ``scale_fmt``, equal to the float64 statement of the rule (1 x head_dim groups,
    ue8m0) for wide data with outliers and an all-zero row; the dequantized values are exact in BF16 (so the
    trainer's BF16 attention sees exactly the values the cache holds), quantize-dequantize is idempotent, and the
    training forward's fake quantization passes gradients straight through."""
    from megatron_jetrl.precision.quant import dequantize_kv, kv_fake_quant, kv_qdq, quantize_kv

    recipe = FP8Recipe(scale_fmt=scale_fmt, kv_cache="fp8")
    for D in (128, 64, 80):
        x = wide_data((6 * 3 * 4, D), seed=D).to(dtype)
        x[5] = 0.0
        x4 = x.view(6, 3, 4, D)
        q, s = quantize_kv(x4, recipe)
        assert q.shape == x4.shape and q.dtype == torch.float8_e4m3fn and s.shape == (6, 3, 4) and s.dtype == torch.float32
        rq, rs = reference_blocks(x.float().numpy(), 1, D, "ue8m0")
        assert np.array_equal(q.reshape(-1, D).float().numpy(), rq) and np.array_equal(s.reshape(-1, 1).numpy(), rs)
        assert bool((torch.log2(s) == torch.log2(s).round()).all())  # powers of two
        deq = dequantize_kv(q, s, torch.bfloat16)
        assert torch.equal(deq.float(), q.float() * s[..., None])  # exact in BF16
        y = kv_qdq(x4, recipe)
        assert y.dtype == dtype and torch.equal(y.float(), deq.float()) and torch.equal(kv_qdq(y, recipe), y)
        qb, sb, yb = kv_qdq(x4, recipe, with_bytes=True)
        assert torch.equal(qb.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sb, s) and torch.equal(yb, y)
    xg = x4.float().requires_grad_()
    dy = torch.randn_like(xg)
    kv_fake_quant(xg, recipe).backward(dy)
    assert torch.equal(xg.grad, dy)
    xg.grad = None
    yg, qg, sg = kv_fake_quant(xg, recipe, with_bytes=True)  # the bytes carry no gradient; the values straight through
    assert not (qg.requires_grad or sg.requires_grad) and torch.equal(yg, kv_qdq(xg.detach(), recipe))
    yg.backward(dy)
    assert torch.equal(xg.grad, dy)
    with pytest.raises(ValueError, match="kv_cache=fp8 needs mode jet"):
        FP8Recipe(mode="bf16", kv_cache="fp8")
    assert FP8Recipe(kv_cache="fp8").train_kv_fp8 and not FP8Recipe(mode="fp8_rollout", kv_cache="fp8").train_kv_fp8
    assert FP8Recipe(mode="fp8_rollout", kv_cache="fp8").rollout_kv_fp8 and not FP8Recipe().rollout_kv_fp8


def test_kv_rule_sensitivity_attention_emulation():
    """``tools/kv_rule_sensitivity.py --attention``: its key tiles cover every key once in either order; its flash
    emulation equals fp32 softmax attention to BF16 rounding; with no input difference the decoder on the trainer's
    tiles and P rounding gives the trainer's bytes while the key-major kernel's does not; one ulp in 10% of the
    elements moves the output more through an FP8 cache than through a BF16 one."""
    import torch.nn.functional as F

    from tools.kv_rule_sensitivity import key_tiles, main, online_attention

    for n in (1, 127, 128, 300):
        for tiles in (key_tiles(n, 128, True), key_tiles(n, 128, False, tail=32)):
            assert sorted(i for a, b in tiles for i in range(a, b)) == list(range(n))
    assert key_tiles(300, 128, True) == [(256, 300), (128, 256), (0, 128)]
    assert key_tiles(300, 128, False, tail=32) == [(0, 128), (128, 256), (256, 288), (288, 300)]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 128, generator=g) for n in (4, 300, 300))
    ref = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
    out = online_attention(q, k, v, key_tiles(300, 128, True), torch.float32)
    assert torch.allclose(out, ref, rtol=2 ** -8, atol=1e-6)
    rows = main(["--keys", "256", "--attention", "--attn-fracs", "0,0.1", "--attn-keys", "256", "--trials", "4"])
    assert len(rows) == 8
    for r in rows:
        if r["frac"] == 0:
            assert r["aligned"] == 0 and r["now"] > 0
    for order in ("from the last", "from key 0"):
        by = {r["cache"]: r for r in rows if r["frac"] == 0.1 and r["trainer"] == order}
        assert by["fp8"]["now"] > 1.5 * by["bf16"]["now"] and by["fp8"]["aligned"] > 1.5 * by["bf16"]["aligned"]
