"""DeepGEMM's SM90 block-FP8 GEMM (``kernels/deepgemm.py``) vs cuBLAS's (``scaled_mm``) vs BF16, one GPU,
one run: the GEMM alone on the same FP8 bytes and scales, at the 8B/70B training shapes (forward, dgrad and
wgrad forms) and at decode sizes (CUDA-graph replays, weights cycled past L2). Each row also checks the
DeepGEMM output against the dequantized fp32 reference and cuBLAS's.

    JETRL_DEEPGEMM_DIR=DIR python3 tools/deepgemm_bench.py [--json OUT] [--quick]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from megatron_jetrl.bench.timing import dump_json, print_table, time_rotated_ms, time_sustained_ms, weight_copies
from megatron_jetrl.kernels import deepgemm
from megatron_jetrl.precision.gemm import block_gemm
from megatron_jetrl.precision.quant import quantize_act, quantize_weight
from megatron_jetrl.precision.recipe import FP8Recipe

# (name, M, N, K): y[M, N] = a[M, K] @ b[N, K]^T
TRAIN = [
    ("8b qkv fwd", 8192, 6144, 4096), ("8b o fwd", 8192, 4096, 4096), ("8b fc1 fwd", 8192, 28672, 4096),
    ("8b fc2 fwd", 8192, 4096, 14336),
    ("8b qkv dgrad", 8192, 4096, 6144), ("8b fc1 dgrad", 8192, 4096, 28672), ("8b fc2 dgrad", 8192, 14336, 4096),
    ("8b qkv wgrad", 6144, 4096, 8192), ("8b fc1 wgrad", 28672, 4096, 8192), ("8b fc2 wgrad", 4096, 14336, 8192),
    ("70b fc1 fwd", 8192, 57344, 8192), ("70b fc2 fwd", 8192, 8192, 28672),
]
DECODE_SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (28672, 8192)]
DECODE_M = [1, 16, 64, 128, 256, 512]


def operands(M, N, K, recipe, dev):
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
    xq, xs = quantize_act(x, recipe, scale_col_major=True)
    qw, sw = quantize_weight(w, recipe)
    return x, w, xq, xs, qw, sw


def check(xq, xs, qw, sw, dg_out):
    ref = block_gemm(xq, xs, qw, sw, "emulated", torch.float32)
    cub = block_gemm(xq, xs, qw, sw, "scaled_mm", torch.bfloat16).float()
    d = dg_out.float()
    return {"dg_vs_ref_rel": ((d - ref).norm() / ref.norm()).item(),
            "cublas_vs_ref_rel": ((cub - ref).norm() / ref.norm()).item(),
            "dg_vs_cublas_maxabs_over_ref_maxabs": ((d - cub).abs().max() / ref.abs().max()).item()}


def train_rows(recipe, dev, names):
    rows = []
    for name, M, N, K in TRAIN:
        if names and not any(n in name for n in names):
            continue
        x, w, xq, xs, qw, sw = operands(M, N, K, recipe, dev)
        row = {"shape": name, "M": M, "N": N, "K": K}
        t0 = time.time()
        out = deepgemm.gemm(xq, xs, qw, sw)
        torch.cuda.synchronize()
        row["first_call_s"] = time.time() - t0
        row.update(check(xq, xs, qw, sw, out))
        ms = time_sustained_ms({"bf16": lambda: F.linear(x, w),
                                "cublas": lambda: block_gemm(xq, xs, qw, sw, "scaled_mm"),
                                "deepgemm": lambda: deepgemm.gemm(xq, xs, qw, sw)}, rep=50, heat_ms=300)
        flops = 2 * M * N * K
        for k, v in ms.items():
            row[f"{k}_ms"] = v
            row[f"{k}_tflops"] = flops / v / 1e9
        row["cublas_vs_bf16"] = ms["bf16"] / ms["cublas"]
        row["deepgemm_vs_bf16"] = ms["bf16"] / ms["deepgemm"]
        row["deepgemm_vs_cublas"] = ms["cublas"] / ms["deepgemm"]
        rows.append(row)
        print(row, flush=True)
        x = w = xq = xs = qw = sw = out = None
    return rows


def decode_rows(recipe, dev, ms_list, rotate_mb=200.0):
    rows = []
    for N, K in DECODE_SHAPES:
        copies = weight_copies(N, K, rotate_mb)
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        qs = [quantize_weight(w, recipe) for w in ws]
        for M in ms_list:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            xq, xs = quantize_act(x, recipe, scale_col_major=True)
            row = {"M": M, "N": N, "K": K, "weight_copies": copies}
            t0 = time.time()
            out = deepgemm.gemm(xq, xs, *qs[0])  # JIT here, outside the graph capture
            torch.cuda.synchronize()
            row["first_call_s"] = time.time() - t0
            row.update(check(xq, xs, *qs[0], out))
            row["bf16_us"] = 1e3 * time_rotated_ms(lambda i: F.linear(x, ws[i]), copies)
            row["cublas_us"] = 1e3 * time_rotated_ms(lambda i: block_gemm(xq, xs, *qs[i], "scaled_mm"), copies)
            row["deepgemm_us"] = 1e3 * time_rotated_ms(lambda i: deepgemm.gemm(xq, xs, *qs[i]), copies)
            row["cublas_vs_bf16"] = row["bf16_us"] / row["cublas_us"]
            row["deepgemm_vs_bf16"] = row["bf16_us"] / row["deepgemm_us"]
            row["deepgemm_weight_TBps"] = N * K / row["deepgemm_us"] / 1e6
            rows.append(row)
            print(row, flush=True)
        ws = qs = None
    return rows


def graph_check(recipe, dev):
    """The GEMM captured in a CUDA graph and replayed on new inputs gives the eager output bit for bit."""
    x, w, xq, xs, qw, sw = operands(64, 4096, 4096, recipe, dev)
    deepgemm.gemm(xq, xs, qw, sw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            out = deepgemm.gemm(xq, xs, qw, sw)
    torch.cuda.current_stream().wait_stream(s)
    x2 = torch.randn_like(x)
    xq2, xs2 = quantize_act(x2, recipe, scale_col_major=True)
    xq.copy_(xq2)
    xs.copy_(xs2)
    g.replay()
    torch.cuda.synchronize()
    eager = deepgemm.gemm(xq, xs, qw, sw)
    return {"graph_replay_equals_eager": bool(torch.equal(out, eager))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--train", default="", help="comma-separated substrings of the training rows to run")
    ap.add_argument("--decode-m", default=",".join(map(str, DECODE_M)))
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--no-decode", action="store_true")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    ok, why = deepgemm.available(dev)
    if not ok:
        print(f"deepgemm unavailable: {why}")
        return 2
    recipe = FP8Recipe()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    out["graph"] = graph_check(recipe, dev)
    print(out["graph"], flush=True)
    if not a.no_decode:
        out["decode"] = decode_rows(recipe, dev, [int(m) for m in a.decode_m.split(",") if m])
        print_table(out["decode"], ["M", "N", "K", "bf16_us", "cublas_us", "deepgemm_us", "cublas_vs_bf16",
                                    "deepgemm_vs_bf16", "deepgemm_weight_TBps", "dg_vs_ref_rel", "first_call_s"])
    if not a.no_train:
        out["train"] = train_rows(recipe, dev, [n for n in a.train.split(",") if n])
        print_table(out["train"], ["shape", "M", "N", "K", "bf16_tflops", "cublas_tflops", "deepgemm_tflops",
                                   "cublas_vs_bf16", "deepgemm_vs_bf16", "deepgemm_vs_cublas", "dg_vs_ref_rel",
                                   "cublas_vs_ref_rel", "first_call_s"])
    dump_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
