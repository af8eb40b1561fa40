"""Triton kernels compiled for the H200 (sm_90a) on the CPU, with the compiler, ``ptxas`` and ``nvdisasm`` that
Triton's wheel ships (``tools/kernel_sass.py``): the structure of the code the GPU runs, which no interpreter run
shows."""
import importlib.util
import os
import re

import pytest

from tests.common import REPO


def _kernel_sass():
    spec = importlib.util.spec_from_file_location("kernel_sass", os.path.join(REPO, "tools", "kernel_sass.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _gemm_plans():
    """The exact GEMM's configured plans as ``tools/kernel_sass.py`` names them: the large ones (training) with the
    segments summed in the program, the small ones (decode) one segment per program."""
    from megatron_jetrl.kernels.exact_gemm import PLANS

    return [f"{kind}:{int(large)}:{':'.join(map(str, plan))}" for kind, pair in PLANS.items()
            for large, plan in zip((False, True), pair)]


@pytest.mark.parametrize("plan", _gemm_plans())
def test_exact_gemm_pipelined_loop_holds_only_the_promotion(plan):
    """The exact GEMM's (``kernels/exact_gemm.py``) loop over a segment's groups, in the training plans (segments
    summed in the program) and the decoder's (one segment): FP8 does one fused multiply-add per accumulator element
    per group (64 per thread: a 64 x 128 tile over 4 warps or 128 x 128 over 8) and one scale product per row, no
    other fp32 work (the segment sums and their selects stay out of the loop), with no register spills; BF16 does no
    fp32 work and keeps an MMA group in flight while the next one's operands arrive (wait depth 1)."""
    mix, waits, shared = _kernel_sass().gemm_plan(plan)
    assert mix, f"{plan}: no loop with tensor-core instructions found"
    fp32_ops = {op: mix[op] for op in ("FFMA", "FMUL", "FADD", "FSEL") if mix[op]}
    assert not (mix["LDL"] or mix["STL"]), (plan, mix)
    if plan.startswith("fp8"):
        # + x_scale * w_scale once per row (a thread holds 2 of the tile's rows)
        assert mix["QGMMA"] == 4 and fp32_ops.pop("FFMA", 0) == 64 and fp32_ops.pop("FMUL", 0) <= 2, (plan, mix)
        assert not fp32_ops, (plan, fp32_ops)
    else:
        assert mix["HGMMA"] == 4 and not fp32_ops and "0x1" in waits, (plan, fp32_ops, waits)
    assert shared <= 227 * 1024, shared  # a program fits an SM's shared memory


def test_fp8_kv_decode_attention_loop_issues_what_the_bf16_one_does_per_byte():
    """The decode attention over the FP8 KV cache (the key-major kernel over V stored [L, d], the H100 decoder's; its
    plan 128-key tiles, 4 warps, 2 stages) against the BF16 cache's (head-major, 64-key tiles): per KV byte its loop
    issues at most 1.9x the BF16 loop's warp-instructions (1.68x with Triton 3.6 at 239 registers, 1.82x with 3.9;
    the head-major form over FP8 tiles issued 2.3-2.4x) and converts each E4M3 pair once (about 2 x 128 x 128 / 2
    conversions per thread-iteration of 128 keys). Its one loop masks every tile's loads (the split's last tile is
    masked, so all are): 10% more instructions than the unmasked loop over whole tiles that preceded it (1.52x), and
    with Triton 3.9 at 255 registers 43 local-memory spill instructions per iteration (26 loads, 17 stores; bounded
    here at 48); timed with Triton 3.6 the one loop made the H100's decode step 1.5-3.5% faster than whole tiles and
    unpipelined tail tiles (docs/decode_attention.md). V's bytes come out of shared memory one at a time
    there (``LDS.U8``: the P.V operand is contiguous along d, not along the keys it sums over), and yet the kernel is
    as fast as over a key-major V on the H100 (it waits on memory). Over a key-major V (the H200 decoder's and exact
    mode's layout; its loop over whole tiles unmasked) it issues at most 1.4x (0.95x / 1.31x), reads no cache byte on
    its own and spills nothing."""
    ks = _kernel_sass()
    bf16, fp8 = ks.decode_attn_plan("bf16:64:4:2"), ks.decode_attn_plan("fp8:128:4:2")
    assert fp8["loop"] and bf16["loop"]
    assert fp8["per_byte"] <= 1.9 * bf16["per_byte"], (fp8["per_byte"], bf16["per_byte"], fp8["mix"].most_common(8))
    km = ks.decode_attn_plan("fp8km:128:4:2")
    assert km["per_byte"] <= 1.4 * bf16["per_byte"], (km["per_byte"], bf16["per_byte"], km["mix"].most_common(8))
    for plan in (fp8, km):
        assert plan["mix"]["F2FP"] <= 1.1 * 128, plan["mix"]
    assert fp8["mix"]["LDL"] + fp8["mix"]["STL"] <= 48 and not (km["mix"]["LDL"] or km["mix"]["STL"]), (fp8["mix"], km["mix"])
    assert not any("LDS.U8" in ln for ln in km["loop"]), [ln for ln in km["loop"] if "LDS.U8" in ln][:3]


@pytest.mark.parametrize("v", ["fp8", "fp8km"])
def test_fp8_kv_decode_attention_loop_loads_nothing_synchronously_in_the_decoders_call(v):
    """The decoder's call of the decode attention over the FP8 KV cache (``first_key``: a row's valid keys from its
    first one, V [L, d] or key-major) loads all its tiles' bytes asynchronously (``LDGSTS``): no ``LDG`` in the loop.
    Read from ``key_ok`` the validity is a byte per key, which the compiler loads synchronously in every tile
    (``cp.async`` moves 4 bytes or more): one ``LDG.E.U8`` per iteration and two barriers more."""
    ks = _kernel_sass()
    first, ok = ks.decode_attn_plan(f"{v}first:128:4:2"), ks.decode_attn_plan(f"{v}:128:4:2")
    sync = lambda plan: [ln.strip() for ln in plan["loop"] if re.search(r"\bLDG\.", ln)]  # noqa: E731
    assert first["loop"] and not sync(first), sync(first)
    assert len(sync(ok)) == 1 and "U8" in sync(ok)[0], sync(ok)
    assert first["mix"]["BAR"] < ok["mix"]["BAR"] and first["regs"] <= ok["regs"], (first["mix"], ok["mix"])


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_exact_attention_plans_of_decoder_and_trainer_run_one_tensor_core_instruction(kv):
    """Exact mode's attention gives a query the same bits in the decoder's tile (one position, 16 query rows) and the
    trainer's (``TRAIN_PLAN``: eight positions, 32 rows) because both compile to the same warp-level MMA (mma.sync:
    a row's products summed by the same instruction chain whatever the tile's other rows), measured equal on the
    H200; 64 rows per program compile to warpgroup MMAs (wgmma), which gave other bits. The plans of the decoder
    and the trainer must stay below that switch, and so must the key-major decode kernel's (the FP8 cache's decode
    steps: 64-key tiles as the MMAs' rows, under 4 warps)."""
    from megatron_jetrl.kernels.exact_attn import (BLOCK_N, DECODE_KEYS_PLAN, NUM_STAGES, NUM_WARPS, TRAIN_PLAN,
                                                   tile_rows)

    ks = _kernel_sass()
    block_n, warps, stages, rows = TRAIN_PLAN
    decoder = ks.decode_attn_plan(f"{kv}:{BLOCK_N}:{NUM_WARPS}:{NUM_STAGES}:{tile_rows(4)}", exact=True)["mix"]
    trainer = ks.decode_attn_plan(f"{kv}:{block_n}:{warps}:{stages}:{rows}", exact=True)["mix"]
    wide = ks.decode_attn_plan(f"{kv}:{block_n}:{warps}:{stages}:64", exact=True)["mix"]
    for name, mix in (("decoder", decoder), ("trainer", trainer)):
        assert mix["HMMA"] and not mix["HGMMA"], (name, mix)
    assert wide["HGMMA"] and not wide["HMMA"], wide
    if kv == "fp8":  # a decode step over the FP8 cache: the key-major kernel, whose 64-key and 128-feature tiles
        # a compiler may give to warpgroup MMAs from 4 warps on (Triton 3.9 does); its plan stays under that
        warps, stages, per_iter = DECODE_KEYS_PLAN
        kind = "fp8pairs" if per_iter == 2 else "fp8keys"
        keys = ks.decode_attn_plan(f"{kind}:{BLOCK_N}:{warps}:{stages}:8", exact=True)
        assert warps < 4 and keys["mix"]["HMMA"] and not keys["mix"]["HGMMA"], keys["mix"]
        # its whole blocks load K's and V's bytes as 16-byte asynchronous copies, whatever the launch's length
        assert keys["mix"]["LDGSTS"] and not any("LDG.E.U8" in ln for ln in keys["loop"]), keys["mix"]
