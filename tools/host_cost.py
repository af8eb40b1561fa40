"""Host (CPU) time per call of the FP8 linear's GPU work, with the GPU kept busy (CUDA, e.g. the H200).

A pass whose host side issues kernels slower than the GPU runs them is host-bound (``jetrl bench train --lag``
says where). This times what one call costs the host, not the GPU: the GPU first gets a long sleep kernel, then
each variant is issued ``--calls`` times behind it and the host clock measures the issue alone (the run checks
the sleep was still running when the issue ended, so no call waited on the GPU). Variants: torch's blockwise
``scaled_mm`` (training's forward GEMM), the same GEMM through ``precision/cublaslt.py`` (cached plan,
bf16 output, beta 0), a BF16 ``torch.matmul``, and the Triton quantizers through ``kernel[grid]`` vs
``precision.launch.launch``. Also checks that the two launch paths and the two GEMM paths give the same bytes.

    python3 tools/host_cost.py [--calls 200] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _host_us(fn, calls: int, reps: int = 5) -> float:
    """Median over ``reps`` of the host time per call of ``calls`` calls issued behind a sleeping GPU."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(600_000_000)  # ~0.3 s of GPU time at ~2 GHz: the queue is never drained below
        ev = torch.cuda.Event()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        dt = time.perf_counter() - t0
        ev.record()
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        if not busy:
            raise RuntimeError("the GPU finished the sleep before the issue ended: raise the sleep")
        out.append(1e6 * dt / calls)
    return statistics.median(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from megatron_jetrl.precision import cublaslt, launch
    from megatron_jetrl.precision.gemm import _scaled_mm
    from megatron_jetrl.precision.quant import quantize_act, quantize_dual, quantize_weight
    from megatron_jetrl.precision.recipe import FP8Recipe

    torch.manual_seed(0)
    dev = torch.device("cuda")
    M, N, K = 4096, 4096, 4096
    r = FP8Recipe()
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    xq, xs = quantize_act(x, r, scale_col_major=True)
    wq, ws = quantize_weight(w, r)
    res = {}

    def row(name, us):
        res[name] = us
        print(f"{name:58s} {us:8.1f} us per call (host)")

    ref = _scaled_mm(xq, xs, wq, ws, torch.bfloat16, 128)
    row("torch scaled_mm blockwise 4096^3 (gemm._scaled_mm)", _host_us(lambda: _scaled_mm(xq, xs, wq, ws, torch.bfloat16, 128), args.calls))
    ok, why = cublaslt.available()
    if ok:
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        cublaslt.block_gemm_accumulate(xq, xs, wq, ws, out, beta=0.0)
        print(f"  cuBLASLt bf16 output == scaled_mm: {torch.equal(out, ref)} (max |diff| "
              f"{(out.float() - ref.float()).abs().max().item():.3g})")
        res["lt_equal"] = bool(torch.equal(out, ref))
        row("cuBLASLt ctypes, cached plan, bf16 out (cublaslt.block_gemm_accumulate)",
            _host_us(lambda: cublaslt.block_gemm_accumulate(xq, xs, wq, ws, out, beta=0.0), args.calls))
    else:
        print(f"  cuBLASLt path unavailable: {why}")
    row("torch.matmul bf16 4096^3", _host_us(lambda: x @ w.t(), args.calls))
    for name, fn in (("quantize_act (Triton 1x128)", lambda: quantize_act(x, r, scale_col_major=True)),
                     ("quantize_dual (Triton, both gradient operands)", lambda: quantize_dual(dy, r, scale_col_major=True))):
        launch.ENABLED = False
        a = fn()
        plain = _host_us(fn, args.calls)
        launch.ENABLED = True
        fn()  # first call of the specialization through launch(): keeps the compiled kernel
        b = fn()
        same = all(torch.equal(u.view(torch.uint8) if u.dtype.itemsize == 1 else u, v.view(torch.uint8) if v.dtype.itemsize == 1 else v)
                   for u, v in zip(a, b))
        fast = _host_us(fn, args.calls)
        row(f"{name}: kernel[grid]", plain)
        row(f"{name}: launch() (same bytes: {same})", fast)
        res[f"{name} same"] = same
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
