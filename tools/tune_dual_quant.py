"""Sweep the backward's one-pass gradient quantizer (``quantize_dual_triton``) against the kernels it replaces,
on a GPU.

Per shape: the separate kernels (1x128 quantizer + transposed 1x128 quantizer) and every (rows per register chunk, warps)
plan of the one-pass kernel, timed as
CUDA-graph replays cycling through input copies of >= 200 MB (no launch path, no L2 hits); every plan's
bytes are checked against the separate kernels'. Prints the best plans and the speedup over the separate
kernels, to set ``kernels.triton_quant.dual_quant_plan``.
Usage: python tools/tune_dual_quant.py [--shapes M,N;...] [--rows 16,32,64,128] [--warps 4,8,16]
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from megatron_jetrl.bench.timing import time_rotated_ms
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.kernels.triton_quant import (dual_quant_plan, quantize_act_triton, quantize_dual_triton,
                                                 quantize_transposed_triton)


def _same(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.dtype != torch.float32 else torch.equal(x, y)
               for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4096,4096;4096,6144", help="plain gradients M,N")
    ap.add_argument("--rows", default="16,32,64,128")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--rotate-mb", type=float, default=200.0, help="input copies cycled per timed pass (MB)")
    ap.add_argument("--json")
    a = ap.parse_args()
    r = FP8Recipe()
    plans = [(rb, nw) for rb in map(int, a.rows.split(",")) for nw in map(int, a.warps.split(","))]
    cases = [("dy", *map(int, s.split(","))) for s in a.shapes.split(";") if s]
    out = []
    for kind, M, N in cases:
        nbytes = M * N * 2
        ins = [(torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 3,)
               for _ in range(max(1, math.ceil(a.rotate_mb * 1e6 / nbytes)))]

        def sep(i):
            d = ins[i][0]
            return (*quantize_act_triton(d, r, True), *quantize_transposed_triton(d, r, tile_scale=False))

        def fused(i, plan):
            return quantize_dual_triton(ins[i][0], r, True, plan=plan)
        ref = sep(0)
        base = time_rotated_ms(sep, len(ins))
        default = dual_quant_plan()
        res = []
        for plan in sorted(set(plans) | {default}):
            same = _same(fused(0, plan), ref)
            ms = time_rotated_ms(lambda i: fused(i, plan), len(ins))
            res.append({"kind": kind, "M": M, "N": N, "plan": list(plan), "ms": ms, "separate_ms": base,
                        "speedup": base / ms, "same_bytes": same, "default": plan == default})
        res.sort(key=lambda v: v["ms"])
        d = next(v for v in res if v["default"])
        print(f"{kind} M={M} N={N}: separate kernels {base:.4f} ms; default {tuple(d['plan'])} {d['ms']:.4f} ms "
              f"({d['speedup']:.2f}x); best:")
        for v in res[:5]:
            print(f"   rows {v['plan'][0]:3d} warps {v['plan'][1]:2d}: {v['ms']:.4f} ms {v['speedup']:.2f}x "
                  f"same_bytes={v['same_bytes']}")
        assert all(v["same_bytes"] for v in res), "a plan changed the bytes"
        out += res
    total = {}  # per kind: each plan's time summed over that kind's shapes
    for v in out:
        total.setdefault(v["kind"], {}).setdefault(tuple(v["plan"]), 0.0)
        total[v["kind"]][tuple(v["plan"])] += v["ms"]
    best = {k: min(t, key=t.get) for k, t in total.items()}
    if best:
        print("best plan (rows, warps) over the shapes: %d,%d (pass it as quantize_dual_triton(plan=...))" % best["dy"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
