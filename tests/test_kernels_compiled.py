"""Triton kernels compiled for the H200 (sm_90a) on the CPU, with the compiler, ``ptxas`` and ``nvdisasm`` that
Triton's wheel ships (``tools/kernel_sass.py``): the structure of the code the GPU runs, which no interpreter run
shows."""
import importlib.util
import os

import pytest

from tests.common import REPO


def _kernel_sass():
    spec = importlib.util.spec_from_file_location("kernel_sass", os.path.join(REPO, "tools", "kernel_sass.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("plan", ["fp8:1:64:128:4:4", "fp8:0:64:128:4:4", "bf16:1:128:128:8:3", "bf16:0:64:128:4:4"])
def test_exact_gemm_pipelined_loop_holds_only_the_promotion(plan):
    """The exact GEMM's (``kernels/exact_gemm.py``) loop over a segment's groups, in the training plans (segments
    summed in the program) and the decoder's (one segment): FP8 does one fused multiply-add per accumulator element
    per group (64 per thread of a 64 x 128 tile) and one scale product per row, no other fp32 work (the segment sums
    and their selects stay out of the loop), with no register spills; BF16 does no fp32 work and keeps an MMA group in
    flight while the next one's operands arrive (wait depth 1)."""
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
    assert shared <= 114 * 1024, shared  # two programs per SM (228 KiB)
