"""Shared by the benchmarks: GPU timing (median of CUDA-event-timed calls after warm-up, L2
flushed by do_bench) and writing their rows as JSON."""
from __future__ import annotations

import math
import time

import torch


MODES_HELP = "comma-separated precision modes; each may add +fp8kv (the FP8 KV cache) and +exact (exact on-policy mode)"


def mode_overrides(name: str) -> list[str]:
    """A benchmark row's precision: ``bf16`` / ``fp8_rollout`` / ``jet``, optionally ``+fp8kv`` (the FP8 KV cache,
    ``precision.kv_cache=fp8``) and ``+exact`` (``precision.exact=true``), as config overrides, e.g. ``jet+fp8kv`` ->
    mode jet with the FP8 KV cache."""
    mode, *extras = name.split("+")
    out = [f"precision.mode={mode}"]
    suffixes = {"fp8kv": "precision.kv_cache=fp8", "exact": "precision.exact=true"}
    for e in extras:
        if e not in suffixes:
            raise SystemExit(f"benchmark mode {name!r}: unknown suffix +{e}; use <mode>[+fp8kv][+exact]")
        out.append(suffixes[e])
    return out


def time_ms(fn, warmup: int = 5, rep: int = 30) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def time_sustained_ms(fns: dict, rounds: int = 3, rep: int = 100, heat_ms: int = 500) -> dict:
    """Median milliseconds per call of each ``fns[name]()`` at the GPU's sustained clocks: the GPU is
    first kept busy running ``fns``' first entry (``do_bench`` with ``heat_ms`` of warm-up and ``heat_ms`` of
    timed calls, about ``2 * heat_ms`` in all; H200: a BF16 training-size GEMM runs ~15% faster in the first tens
    of milliseconds after idle than once the board sits at its power limit), then the functions are
    timed in interleaved rounds (order reversed every other round) so each sees the same thermal state;
    the result is the median over rounds of ``do_bench``'s median (L2 flushed per call)."""
    import statistics

    import triton.testing

    names = list(fns)
    triton.testing.do_bench(fns[names[0]], warmup=heat_ms, rep=heat_ms)
    got = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            got[n].append(float(triton.testing.do_bench(fns[n], warmup=10, rep=rep, return_mode="median")))
    return {n: statistics.median(v) for n, v in got.items()}


class GpuSampler:
    """What the board ran at while the ``with`` block runs, sampled by ``nvidia-smi -lms`` in the background: mean SM
    clock (MHz), board power (W), its limit (W) and the share of samples with the software power cap holding the
    clocks down (``clocks_event_reasons.sw_power_cap``); ``None`` values where nvidia-smi is missing or answers
    nothing."""

    FIELDS = "clocks.sm,power.draw,power.limit,clocks_event_reasons.sw_power_cap"

    def __init__(self, period_ms: int = 50):
        self.period_ms, self.proc = period_ms, None
        self.sm_mhz = self.watts = self.limit_watts = self.power_capped = None

    def __enter__(self):
        import shutil
        import subprocess

        if shutil.which("nvidia-smi"):
            idx = torch.cuda.current_device() if torch.cuda.is_available() else 0
            self.proc = subprocess.Popen(["nvidia-smi", "-i", str(idx), f"--query-gpu={self.FIELDS}",
                                          "--format=csv,noheader,nounits", f"-lms={self.period_ms}"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            return False
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        self.parse(out)
        return False

    def parse(self, out: str) -> None:
        """Means over nvidia-smi's sample lines (``FIELDS``; the first two dropped: they can predate the work)."""
        vals = []
        for line in out.splitlines():
            f = [v.strip() for v in line.split(",")]
            try:
                vals.append((float(f[0]), float(f[1]), float(f[2]), f[3].lower() == "active"))
            except (ValueError, IndexError):
                continue
        vals = vals[2:] or vals
        if vals:
            n = len(vals)
            self.sm_mhz, self.watts, self.limit_watts = (sum(v[i] for v in vals) / n for i in range(3))
            self.power_capped = sum(v[3] for v in vals) / n

    def row(self) -> dict:
        """The means as benchmark-row fields."""
        return {"sm_MHz": self.sm_mhz, "power_W": self.watts, "power_limit_W": self.limit_watts,
                "power_capped_share": self.power_capped}


def step_spans_ms(fn, steps: int, rest_s: float = 0.0) -> list[float] | None:
    """Milliseconds of each of ``steps`` calls of ``fn()``: between CUDA events recorded before each call (the GPU's
    time per step, idle time included), or by the host clock off CUDA. ``rest_s`` > 0 (CUDA): the calls queue behind
    a GPU sleep of that long, so they run back to back from a rested board; None where the GPU reached the first
    call before the host had queued them all (the sleep too short)."""
    cuda = torch.cuda.is_available()
    if not cuda:
        out = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    if rest_s > 0:
        torch.cuda.synchronize()
        torch.cuda._sleep(int(rest_s * 2.5e9))  # cycles; >= rest_s below 2.5 GHz
    for i in range(steps):
        marks[i].record()
        fn()
    marks[steps].record()
    early = rest_s > 0 and marks[0].query()
    marks[steps].synchronize()
    return None if early else [marks[i].elapsed_time(marks[i + 1]) for i in range(steps)]


def quarter_medians(spans: list[float] | None) -> tuple[float, float]:
    """(median of the first quarter, median of the last quarter) of per-step times; NaN for None."""
    import statistics

    if not spans:
        return float("nan"), float("nan")
    q = max(1, len(spans) // 4)
    return statistics.median(spans[:q]), statistics.median(spans[-q:])


def time_graph_ms(fn, rep: int = 50) -> float:
    """Median milliseconds of ``fn()`` replayed from a CUDA graph: GPU time without the host's
    launch overhead, which is how a graph-captured decode step runs its linears (at decode sizes
    eager timing measures the Python/launch path, not the kernels)."""
    import triton.testing

    with torch.no_grad():
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def weight_copies(N: int, K: int, rotate_mb: float) -> int:
    """How many copies of an [N, K] FP8 weight add up to ``rotate_mb`` MB (at least one). Cycling through
    them per timed call keeps the weights out of the 50 MB L2 between uses, as in a decode step, which
    reads each layer's weights once."""
    return max(1, math.ceil(rotate_mb * 1e6 / (N * K)))


def time_rotated_ms(fn, copies: int, rep: int = 50) -> float:
    """Per-call milliseconds of ``fn(i)`` for ``i`` over ``copies`` weight copies, all replayed from one
    CUDA graph (``time_graph_ms``); without CUDA one wall-clock pass (to check a script under
    ``TRITON_INTERPRET=1``)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for i in range(copies):
            fn(i)
        return (time.perf_counter() - t0) * 1e3 / copies
    return time_graph_ms(lambda: [fn(i) for i in range(copies)], rep=rep) / copies


def idle_gaps(prof, reps: int, top: int = 8) -> dict:
    """The GPU's idle time between consecutive kernels of a profiled run (``prof``: a finished torch profiler over
    ``reps`` calls), per call, and the kernel pairs it sits between, most first: a CUDA graph's kernels start
    back to back unless a launch waits (a step's wall time minus its kernels' time, located). Gaps over 1 ms
    (between calls, the host's) are left out. Returns ``{"idle_ms_per_call", "top": [(before -> after, ms per
    call, gaps per call)]}``."""
    import json
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    kernels = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                     if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "ts" in e)
    pairs: dict[str, list] = {}
    total, end, last = 0.0, None, ""  # the latest end so far and its kernel (kernels may overlap)
    for start, stop, name in kernels:
        gap = start - end if end is not None else 0.0  # microseconds
        if 0 < gap < 1000:
            total += gap
            key = f"{last[:50]} -> {name[:50]}"
            pairs.setdefault(key, [0.0, 0])
            pairs[key][0] += gap
            pairs[key][1] += 1
        if end is None or stop > end:
            end, last = stop, name
    rows = sorted(((k, v[0] / reps / 1e3, v[1] // reps) for k, v in pairs.items()), key=lambda r: -r[1])
    print(f"  idle between kernels: {total / reps / 1e3:.3f} ms per call; largest:")
    for name, ms, n in rows[:top]:
        print(f"  {ms:8.3f} ms  x{n:<4d} {name}")
    return {"idle_ms_per_call": total / reps / 1e3, "top": rows[:top]}


def kernel_table(fn, reps: int, title: str, top: int = 12, gaps: bool = False) -> dict:
    """Run ``fn()`` ``reps`` times under torch's profiler and print the kernel time per call by
    kernel, most first (CUDA kernels on a GPU; CPU ops elsewhere, to check the harness); with ``gaps`` (CUDA)
    also the idle time between kernels (``idle_gaps``). Returns ``{"ms_per_call", "top": [(name, ms per call,
    launches per call)]}``, and ``"idle_ms_per_call"``, ``"idle_top"`` with ``gaps``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    if cuda:
        rows = [(e.key, e.device_time_total / reps / 1e3, e.count // reps) for e in events if e.device_time_total > 0]
    else:  # CPU: self time, so nested ops are not counted twice
        rows = [(e.key, e.self_cpu_time_total / reps / 1e3, e.count // reps) for e in events if e.self_cpu_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(f"{title}: {total:.3f} ms of {'GPU kernel' if cuda else 'CPU'} time per call; top {top}:")
    for name, ms, n in rows[:top]:
        print(f"  {ms:8.3f} ms  {100 * ms / max(total, 1e-12):5.1f}%  x{n:<4d} {name[:110]}")
    out = {"ms_per_call": total, "top": [(n[:200], ms, c) for n, ms, c in rows[:top]]}
    if gaps and cuda:
        g = idle_gaps(prof, reps)
        out["idle_ms_per_call"], out["idle_top"] = g["idle_ms_per_call"], g["top"]
    return out


def copy_sources(fn, title: str, top: int = 10) -> list[dict]:
    """Run ``fn()`` once under torch's profiler with Python stacks and print where its tensor copies
    (``aten::copy_``: every ``contiguous``/``clone``/``reshape`` that copies, casts and strided assignments)
    come from, most time first: the calling Python frames outside torch (forward ops), or the autograd
    node that ran it (backward ops run on the autograd engine's thread, without a Python stack). Time is
    the copy kernels' GPU time on CUDA, the op's own CPU time elsewhere. Returns the rows
    ``{"ms", "count", "where", "shapes"}``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, with_stack=True, record_shapes=True) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    groups: dict = {}
    for e in prof.events():
        if e.name != "aten::copy_":
            continue
        ms = (e.device_time_total if cuda else e.self_cpu_time_total) / 1e3
        if ms <= 0:
            continue
        frames, node, p = [], None, e.cpu_parent  # the profiler records Python frames as parent events
        while p is not None and len(frames) < 3:
            if p.name.startswith("autograd::engine::evaluate_function: ") and node is None and not frames:
                node = p.name.split(": ", 1)[1]
            elif ".py(" in p.name and not p.name.startswith("torch/"):
                frames.append(p.name)
            p = p.cpu_parent
        key = " <- ".join(([f"backward {node}"] if node else []) + frames) or "(no Python stack)"
        g = groups.setdefault(key, {"ms": 0.0, "count": 0, "where": key, "shapes": str(e.input_shapes)[:80]})
        g["ms"] += ms
        g["count"] += 1
    rows = sorted(groups.values(), key=lambda g: -g["ms"])
    total = sum(g["ms"] for g in rows)
    print(f"{title}: {total:.3f} ms of copies ({'GPU' if cuda else 'CPU'}), {sum(g['count'] for g in rows)} calls; "
          f"top {top} call sites:")
    for g in rows[:top]:
        print(f"  {g['ms']:8.3f} ms  x{g['count']:<4d} {g['shapes']}  {g['where'][:300]}")
    return rows


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
