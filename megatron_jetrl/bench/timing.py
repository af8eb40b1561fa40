"""GPU timing: median of CUDA-event-timed calls after warm-up (L2 flushed by do_bench)."""
from __future__ import annotations


def time_ms(fn, warmup: int = 5, rep: int = 30) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
