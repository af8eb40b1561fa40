"""Sweep the 1x128 activation quantizer's launch plan (rows x groups per program, warps) on a GPU.

Every plan writes the same bytes (checked here against the current default); the table gives each
plan's GPU time (CUDA-graph replays cycling through input copies of >= 200 MB, so neither the host's
launch path nor L2 hits count) and achieved bandwidth (bf16 read + fp8 write + fp32 scales) per shape,
and the best plan per shape, to set ``kernels.triton_quant.act_quant_plan``.
Usage: python tools/tune_act_quant.py [--shapes M,K;M,K...] [--json out.json]"""
from __future__ import annotations

import argparse
import json

import math

import torch

from megatron_jetrl.bench.timing import time_rotated_ms
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.kernels.triton_quant import act_quant_plan, quantize_act_triton


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="16384,4096;16384,14336;16384,8192;16384,28672;4096,4096;4096,6144;"
                                        "4096,14336;1024,4096")
    ap.add_argument("--rows", default="4,8,16,32,64")
    ap.add_argument("--groups", default="1,2,4,8")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stream", default="0,1", help="evict-first loads (plans with more than one group)")
    ap.add_argument("--json")
    a = ap.parse_args()
    r = FP8Recipe()
    plans = [(bm, ng, nw, st) for bm in map(int, a.rows.split(",")) for ng in map(int, a.groups.split(","))
             for nw in map(int, a.warps.split(",")) for st in map(int, a.stream.split(","))
             if 512 <= bm * ng * 128 <= 16384 and not (st and ng == 1)]
    rows = []
    for shape in a.shapes.split(";"):
        M, K = map(int, shape.split(","))
        xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * 3
              for _ in range(max(1, math.ceil(200e6 / (2 * M * K))))]
        x = xs[0]
        default = act_quant_plan(M, K)
        q0, s0 = quantize_act_triton(x, r, True, plan=default)
        nbytes = M * K * 3 + M * (-(-K // 128)) * 4
        res = []
        for plan in sorted(set(plans) | {default}):
            q, s = quantize_act_triton(x, r, True, plan=plan)
            same = torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
            ms = time_rotated_ms(lambda i: quantize_act_triton(xs[i], r, True, plan=plan), len(xs))
            res.append({"M": M, "K": K, "plan": list(plan), "ms": ms, "TBps": nbytes / ms / 1e9, "same_bytes": same,
                        "default": plan == default})
        res.sort(key=lambda d: d["ms"])
        d = next(v for v in res if v["default"])
        print(f"M={M} K={K}: default {tuple(d['plan'])} {d['ms']:.4f} ms {d['TBps']:.2f} TB/s; best:")
        for v in res[:5]:
            print(f"   {tuple(v['plan'])} {v['ms']:.4f} ms {v['TBps']:.2f} TB/s same_bytes={v['same_bytes']}")
        assert all(v["same_bytes"] for v in res), "a plan changed the bytes"
        rows += res
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
