"""Sweep the small-M FP8 GEMM's launch plan (layout, TMA, BLOCK_N, split-K, stages, row tile) on this GPU.

Usage (CUDA): ``python tools/tune_small_m.py [--json out.json]``. For each decode shape and M it
times every plan as a CUDA-graph replay next to bf16 ``F.linear`` and cuBLAS block-FP8 ``scaled_mm``
and prints the best plan, the default plan's time and the ratios to bf16, so the defaults in
``triton_gemm.plan`` can be checked against measurements.

What is timed is what the decoder runs: the GEMM kernel with x already quantized (the decoder's
norm kernel quantizes it) and the split-K partials left unsummed (summed by the next norm kernel
for the output projection and fc2; ``--with-sum`` adds the sum kernel). ``--input`` adds the FP8
linear's standalone call, what ``jetrl bench linear --decode`` times: ``quant`` = the activation
quantizer kernel, then the GEMM, then the split-K sum (``--fused-sum 1``: summed by each tile's last
program instead); ``inkernel`` = x quantized inside the GEMM per N tile (no quantizer launch; TMA off). A decode step reads each
layer's weights once, so each timed call cycles through enough copies of the weight (``--rotate-mb``,
bf16 and FP8 alike) that they cannot stay in the 50 MB L2 between uses; per-call time is the graph's
time divided by the copies.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from megatron_jetrl.bench.linear import DECODE_SHAPES
from megatron_jetrl.bench.timing import dump_json, print_table, time_rotated_ms, weight_copies
from megatron_jetrl.precision.gemm import block_gemm
from megatron_jetrl.precision.quant import quantize_weight
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.kernels.triton_quant import quantize_act_triton
from megatron_jetrl.kernels.triton_gemm import small_m_linear

HBM_TBPS = 4.2  # copy-bandwidth ceiling measured on the H200


def _rotated(fn, copies: int):
    return time_rotated_ms(fn, copies, rep=30)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--m", default="16,64,256", help="token counts to sweep")
    ap.add_argument("--swap", default="0,1", help="1: y^T = W x^T per tile (weight rows on the MMA's wide side)")
    ap.add_argument("--tma", default="0,1", help="1: FP8 tiles loaded by the bulk tensor copy engine")
    ap.add_argument("--block-n", default="128")
    ap.add_argument("--split", default="0,1,2,4,8", help="0: the plan's choice")
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--block-m", default="0", help="row tile (0: the plan's choice by M)")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--rotate-mb", type=float, default=200.0, help="FP8 weight bytes cycled per timed call")
    ap.add_argument("--with-sum", action="store_true", help="time the split-K sum kernel too")
    ap.add_argument("--shapes", default="", help="N:K,... (default: the decode shapes)")
    ap.add_argument("--input", default="xq", help="xq (x pre-quantized, the decoder's call), quant, inkernel: "
                    "comma-separated; the last two time the standalone linear call (summed output)")
    ap.add_argument("--top", type=int, default=5, help="plans printed per shape and M, fastest first")
    ap.add_argument("--fused-sum", default="0", help="1: split-K summed by each tile's last program (standalone)")
    args = ap.parse_args(argv)
    recipe = FP8Recipe()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    ints = lambda a: [int(v) for v in a.split(",")]  # noqa: E731
    shapes = [tuple(map(int, s.split(":"))) for s in args.shapes.split(",")] if args.shapes else DECODE_SHAPES
    for (N, K), M in itertools.product(shapes, ints(args.m)):
        copies = weight_copies(N, K, args.rotate_mb)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        qs = [quantize_weight(w, recipe) for w in ws]
        xq = quantize_act_triton(x, recipe)
        xq_col = (xq[0], xq[1].t().contiguous().t())
        bf16 = _rotated(lambda i: F.linear(x, ws[i]), copies)
        cublas = _rotated(lambda i: block_gemm(xq_col[0], xq_col[1], qs[i][0], qs[i][1],
                                            "scaled_mm" if dev == "cuda" else "emulated"), copies)
        ref = block_gemm(xq_col[0], xq_col[1], qs[0][0], qs[0][1], "emulated", torch.float32)

        def inputs(mode):  # small_m_linear's input arguments for an --input mode
            if mode == "xq":
                return dict(xq=xq, return_partials=not args.with_sum)
            return dict(prequant=mode == "quant")

        def call(i, **kw):
            return small_m_linear(x, qs[i][0], qs[i][1], recipe, **{**inputs("xq"), **kw})

        default = _rotated(call, copies)
        results = []
        for mode in args.input.split(","):
            for sw, tm, bn, sp, st, bm, nw, fs in itertools.product(*(ints(a) for a in (
                    args.swap, args.tma, args.block_n, args.split, args.stages, args.block_m, args.warps,
                    args.fused_sum if mode != "xq" else "0"))):
                kw = dict(swap=bool(sw), tma=bool(tm), block_n=bn, split_k=sp or None, num_stages=st,
                          block_m=bm or None, num_warps=nw, fused_sum=bool(fs), **inputs(mode))
                try:
                    t = _rotated(lambda i: small_m_linear(x, qs[i][0], qs[i][1], recipe, **kw), copies)
                    ekw = {k: v for k, v in kw.items() if k != "return_partials"}
                    out = small_m_linear(x, qs[0][0], qs[0][1], recipe, torch.float32, **ekw)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                except Exception as e:  # a plan this GPU/compiler rejects (shared memory, registers)
                    print(f"M={M} N={N} K={K} {mode} {kw.keys()}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                results.append((t, err, f"{mode} swap{sw} tma{tm} bn{bn} split{sp or 'auto'} st{st} bm{bm or 'auto'} "
                                        f"w{nw}{' fsum' if fs else ''}"))
        results.sort()
        best = results[0]
        for t, err, name in results[:args.top]:  # the runners-up too: how flat the optimum is
            print(f"  M={M} N={N} K={K}: {t * 1e3:8.2f} us  {N * K / t / 1e9:5.2f} TB/s  {name}", flush=True)
        by = {}
        for t, _, name in results:  # best of each (input, swap, tma) family
            fam = " ".join(name.split()[:3])
            by.setdefault(fam, (t, name))
        row = {"M": M, "N": N, "K": K, "copies": copies, "bf16_us": bf16 * 1e3, "cublas_fp8_us": cublas * 1e3,
               "default_us": default * 1e3, "default_vs_bf16": bf16 / default, "best_us": best[0] * 1e3,
               "best_vs_bf16": bf16 / best[0], "best_plan": best[2], "best_rel_err": best[1],
               "best_TBps": N * K / best[0] / 1e9, "bf16_TBps": 2 * N * K / bf16 / 1e9,
               "families": {f: (round(t * 1e3, 2), n) for f, (t, n) in by.items()}}
        rows.append(row)
        print(row, flush=True)
        dump_json(args.json, rows)  # after every point: a sweep stopped by a time limit keeps what it measured
    print(f"(HBM copy ceiling {HBM_TBPS} TB/s)")
    print_table(rows, [c for c in rows[0] if c != "families"])
    return rows


if __name__ == "__main__":
    main()
