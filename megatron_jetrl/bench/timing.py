"""Shared by the benchmarks: GPU timing (median of CUDA-event-timed calls after warm-up, L2
flushed by do_bench) and writing their rows as JSON."""
from __future__ import annotations


def time_ms(fn, warmup: int = 5, rep: int = 30) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def dump_json(path: str | None, obj) -> None:
    """Write a benchmark's rows to ``path`` (``--json``) when given."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
