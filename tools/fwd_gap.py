"""Where does the eager FP8 forward's time go between kernels? (a diagnostic of the FP8 linear's launch overhead)

For one training shape: do_bench (L2 flushed, eager) vs CUDA-graph replay of the BF16 and FP8 forwards,
whether the FP8 forward synchronizes the host (torch's sync debug mode), and the CUDA runtime calls and
GPU idle time of a do_bench-like loop under torch's profiler."""
import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

from megatron_jetrl.precision.gemm import block_gemm, resolve_backend
from megatron_jetrl.precision.linear import FP8LinearFunction
from megatron_jetrl.precision.quant import quantize_act, quantize_weight
from megatron_jetrl.precision.recipe import FP8Recipe

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="16384,14336,4096")
ap.add_argument("--json")
a = ap.parse_args()
M, N, K = map(int, a.shape.split(","))
r = FP8Recipe()
dev = torch.device("cuda")
be = resolve_backend("auto", dev)
x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
qw, sw = quantize_weight(w, r)
xq, xs = quantize_act(x, r, scale_col_major=True)
fns = {
    "bf16_fwd": lambda: F.linear(x, w),
    "fp8_fwd": lambda: FP8LinearFunction.apply(x, w, qw, sw, None, None, r, be),
    "fp8_gemm": lambda: block_gemm(xq, xs, qw, sw, be),
    "act_quant": lambda: quantize_act(x, r, scale_col_major=True),
}
out = {}
for name, fn in fns.items():
    fn()
    out[name] = {
        "do_bench_ms": triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median"),
        "do_bench_long_ms": triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median"),
        "graph_ms": triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"),
    }
    # host wall per call with the GPU kept busy (enqueue cost)
    torch.cuda.synchronize()
    import time
    t0 = time.perf_counter()
    for _ in range(20):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    out[name]["host_enqueue_us"] = (t1 - t0) / 20 * 1e6
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        out[name]["syncs"] = "none"
    except RuntimeError as e:
        out[name]["syncs"] = str(e).splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    print(name, out[name], flush=True)

# a do_bench-like loop under the profiler: GPU idle between events, slow runtime calls
from torch.profiler import ProfilerActivity, profile  # noqa: E402  (a section of its own below)

cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int, device=dev)
for name in ("bf16_fwd", "fp8_fwd"):
    fn = fns[name]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            cache.zero_()
            fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    ev.sort(key=lambda e: e.time_range.start)
    busy = sum(e.time_range.elapsed_us() for e in ev)
    span = ev[-1].time_range.end - ev[0].time_range.start
    rt = {}
    for e in prof.key_averages():
        if e.key.startswith("cuda") or e.key.startswith("cu"):
            rt[e.key] = [e.count, round(e.cpu_time_total / 10, 1)]
    gaps = sorted(((ev[i + 1].time_range.start - ev[i].time_range.end, ev[i].name[:50], ev[i + 1].name[:50])
                   for i in range(len(ev) - 1)), reverse=True)[:6]
    out[name]["profile"] = {"gpu_busy_us_per_iter": busy / 10, "span_us_per_iter": span / 10,
                            "runtime_calls_us_per_iter": rt, "largest_gaps": gaps}
    print(name, json.dumps(out[name]["profile"], indent=1), flush=True)
for k in ("do_bench_ms", "do_bench_long_ms", "graph_ms"):
    print(f"fwd speedup by {k}: {out['bf16_fwd'][k] / out['fp8_fwd'][k]:.3f}x")
if a.json:
    json.dump(out, open(a.json, "w"), indent=1, default=str)
