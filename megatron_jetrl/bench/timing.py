"""Shared by the benchmarks: GPU timing (median of CUDA-event-timed calls after warm-up, L2
flushed by do_bench) and writing their rows as JSON."""
from __future__ import annotations

import torch


def time_ms(fn, warmup: int = 5, rep: int = 30) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def time_graph_ms(fn, rep: int = 50) -> float:
    """Median milliseconds of ``fn()`` replayed from a CUDA graph: GPU time without the host's
    launch overhead, which is how a graph-captured decode step runs its linears (at decode sizes
    eager timing measures the Python/launch path, not the kernels)."""
    import triton.testing

    with torch.no_grad():
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def print_table(rows: list[dict], cols: list[str]) -> None:
    """The rows as a markdown table (floats to 3 significant digits), columns in ``cols`` order."""
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols) + " |")


def dump_json(path: str | None, obj) -> None:
    """Write a benchmark's rows to ``path`` (``--json``) when given."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
