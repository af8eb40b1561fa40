"""Sweep the small-M FP8 GEMM's launch plan (BLOCK_N, split-K, pipeline stages) on this GPU.

Usage (CUDA): ``python tools/tune_small_m.py [--json out.json]``. For each decode shape and M it
times every plan as a CUDA-graph replay next to bf16 ``F.linear`` and prints the best plan, the
default plan's time and both ratios to bf16, so the defaults in ``triton_gemm.plan`` can be checked
against measurements.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from megatron_jetrl.bench.linear import DECODE_M, DECODE_SHAPES
from megatron_jetrl.bench.timing import dump_json, print_table, time_graph_ms
from megatron_jetrl.precision.quant import quantize_weight
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.precision.triton_gemm import small_m_linear


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--split", default="1,2,4,8,16")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--prequant", default="0,1", help="1: x quantized once beforehand (FP8 tiles streamed)")
    ap.add_argument("--block-m", default="0", help="row tile (0: the plan's choice by M)")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--m", default=",".join(map(str, DECODE_M)), help="token counts to sweep")
    args = ap.parse_args(argv)
    recipe = FP8Recipe()
    rows = []
    ints = lambda a: [int(v) for v in a.split(",")]  # noqa: E731
    for (N, K), M in itertools.product(DECODE_SHAPES, ints(args.m)):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, sw = quantize_weight(w, recipe)
        bf16 = time_graph_ms(lambda: F.linear(x, w))
        default = time_graph_ms(lambda: small_m_linear(x, qw, sw, recipe))
        best = (float("inf"), None)
        for bn, sp, st, pq, bm, nw in itertools.product(*(ints(a) for a in (args.block_n, args.split, args.stages,
                                                                             args.prequant, args.block_m, args.warps))):
            t = time_graph_ms(lambda: small_m_linear(x, qw, sw, recipe, block_n=bn, split_k=sp, num_stages=st,
                                                     prequant=bool(pq), block_m=bm or None, num_warps=nw), rep=20)
            best = min(best, (t, f"bn{bn} split{sp} st{st} pre{pq} bm{bm or 'auto'} w{nw}"), key=lambda b: b[0])
        rows.append({"M": M, "N": N, "K": K, "bf16_ms": bf16, "default_ms": default, "default_speedup": bf16 / default,
                     "best_ms": best[0], "best_speedup": bf16 / best[0], "best_plan": best[1],
                     "best_weight_TBps": (N * K) / best[0] / 1e9})
        print(rows[-1], flush=True)
    print_table(rows, list(rows[0]))
    dump_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
