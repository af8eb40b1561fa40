"""``jetrl bench linear``: block-FP8 linear vs BF16 at training shapes (forward, forward+backward,
quantization share) and, with ``--decode``, at decode sizes, in one run on one GPU."""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from megatron_jetrl.bench.timing import (GpuSampler, dump_json, kernel_table, print_table, time_ms,
                                         time_rotated_ms, time_sustained_ms, weight_copies)
from megatron_jetrl.precision.gemm import block_gemm, resolve_backend
from megatron_jetrl.precision.linear import FP8LinearFunction
from megatron_jetrl.precision.quant import quantize_act, quantize_weight
from megatron_jetrl.precision.recipe import FP8Recipe

TRAIN_SHAPES = [(14336, 4096), (4096, 14336), (28672, 8192), (8192, 28672)]  # (N, K)
DECODE_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)]
DECODE_M = [1, 16, 64, 256, 1024]


def bench_decode_shape(M: int, N: int, K: int, recipe: FP8Recipe, rotate_mb: float = 200.0) -> dict:
    """One decode-size linear as CUDA-graph replays (how the graph-captured decode step runs it; eager
    timing at these sizes measures the host's launch path). A decode step reads each layer's weights
    once, so every timed call cycles through enough weight copies (``rotate_mb`` of FP8 bytes; the
    same number of BF16 copies) that they cannot be served from the 50 MB L2 between uses: per-call
    time is the graph's time over the copies. FP8 cuBLAS = Triton activation quantizer + blockwise
    ``scaled_mm`` (the FP8 linear above ``precision.small_m_max``); Triton small-M = the fused
    kernel as the FP8 linear calls it below (quantization and split-K sum included)."""
    from megatron_jetrl.kernels.triton_gemm import small_m_linear

    dev = torch.device("cuda")
    backend = resolve_backend("auto", dev)
    copies = weight_copies(N, K, rotate_mb)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    qs = [quantize_weight(w, recipe) for w in ws]

    def rotated(fn):
        return time_rotated_ms(fn, copies)

    row = {"M": M, "N": N, "K": K, "backend": backend, "weight_copies": copies}
    row["bf16_fwd_ms"] = rotated(lambda i: F.linear(x, ws[i]))
    row["fp8_fwd_ms"] = rotated(lambda i: FP8LinearFunction.apply(x, ws[i], qs[i][0], qs[i][1], None, None, recipe,
                                                                  backend))
    row["triton_small_m_ms"] = rotated(lambda i: small_m_linear(x, qs[i][0], qs[i][1], recipe))
    row["fp8_fwd_eager_ms"] = time_ms(lambda: FP8LinearFunction.apply(x, ws[0], *qs[0], None, None, recipe, backend))
    row["triton_eager_ms"] = time_ms(lambda: small_m_linear(x, *qs[0], recipe))
    row["fwd_speedup"] = row["bf16_fwd_ms"] / row["fp8_fwd_ms"]
    row["triton_speedup"] = row["bf16_fwd_ms"] / row["triton_small_m_ms"]
    row["triton_weight_TBps"] = (N * K + N * K // 16384 * 4) / row["triton_small_m_ms"] / 1e9
    row["bf16_weight_TBps"] = 2 * N * K / row["bf16_fwd_ms"] / 1e9
    xq, xs = quantize_act(x, recipe, scale_col_major=True)
    ref = block_gemm(xq, xs, *qs[0], "emulated", torch.float32)
    row["scaled_mm_vs_emulated_rel"] = ((block_gemm(xq, xs, *qs[0], backend, torch.float32) - ref).norm() / ref.norm()).item()
    row["triton_vs_emulated_rel"] = ((small_m_linear(x, *qs[0], recipe, torch.float32) - ref).norm() / ref.norm()).item()
    return row


def bench_shape(M: int, N: int, K: int, recipe: FP8Recipe) -> dict:
    """One training-size linear: forward, forward+backward and the quantizers' share, eager, at the
    GPU's sustained clocks (``time_sustained_ms``: heated, interleaved, L2 flushed per call). Also the
    forward timed the old way right after an idle second (``*_burst_ms``: a short ``do_bench``, which
    catches BF16 at its boost clock) and the mean SM clock and board power over 0.4 s of each forward."""
    import time

    dev = torch.device("cuda")
    backend = resolve_backend("auto", dev)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
    qw, sw = quantize_weight(w, recipe)
    xq, xs = quantize_act(x, recipe, scale_col_major=True)
    row = {"M": M, "N": N, "K": K, "backend": backend}
    fwd = {"bf16_fwd": lambda: F.linear(x, w),
           "fp8_fwd": lambda: FP8LinearFunction.apply(x, w, qw, sw, None, None, recipe, backend),
           "fp8_gemm": lambda: block_gemm(xq, xs, qw, sw, backend),
           "act_quant": lambda: quantize_act(x, recipe, scale_col_major=True)}
    for name in ("bf16_fwd", "fp8_fwd"):
        torch.cuda.synchronize()
        time.sleep(1.0)
        row[f"{name}_burst_ms"] = time_ms(fwd[name])
    for name, ms in time_sustained_ms(fwd).items():
        row[f"{name}_ms"] = ms
    for name in ("bf16_fwd", "fp8_fwd"):
        with GpuSampler() as smp:
            time_ms(fwd[name], warmup=50, rep=400)
        row[f"{name}_sm_mhz"], row[f"{name}_watts"] = smp.sm_mhz, smp.watts
    row["weight_quant_ms"] = time_ms(lambda: quantize_weight(w, recipe))
    row["fwd_speedup"] = row["bf16_fwd_ms"] / row["fp8_fwd_ms"]
    row["fwd_speedup_burst"] = row["bf16_fwd_burst_ms"] / row["fp8_fwd_burst_ms"]
    row["act_quant_share_of_gemm"] = row["act_quant_ms"] / row["fp8_gemm_ms"]
    row["act_quant_TBps"] = (M * K * 3 + M * (-(-K // recipe.group_size)) * 4) / row["act_quant_ms"] / 1e9
    flops = 2 * M * N * K
    row["fp8_fwd_tflops"] = flops / row["fp8_fwd_ms"] / 1e9
    row["bf16_fwd_tflops"] = flops / row["bf16_fwd_ms"] / 1e9
    row["fp8_weight_GBps"] = (N * K + N * K // 16384 * 4) / row["fp8_gemm_ms"] / 1e6
    row["bf16_weight_GBps"] = 2 * N * K / row["bf16_fwd_ms"] / 1e6
    # agreement with the dequantized reference (emulated backend, same bytes)
    ref = block_gemm(xq, xs, qw, sw, "emulated", torch.float32)
    out = block_gemm(xq, xs, qw, sw, backend, torch.float32)
    row["scaled_mm_vs_emulated_rel"] = ((out - ref).norm() / ref.norm()).item()
    if N < K:  # an fc2 shape: its input is SwiGLU(fc1 output)
        from megatron_jetrl.precision.linear import FP8SwigluLinearFunction
        from megatron_jetrl.precision.quant import quantize_swiglu, swiglu

        y1 = torch.randn(M, 2 * K, device=dev, dtype=torch.bfloat16)
        sw_ms = time_sustained_ms({
            "swiglu": lambda: swiglu(y1),
            "fused_swiglu_quant": lambda: quantize_swiglu(y1, recipe, scale_col_major=True),
            "bf16_swiglu_fc2_fwd": lambda: F.linear(swiglu(y1), w),
            "fp8_fused_swiglu_fc2_fwd": lambda: FP8SwigluLinearFunction.apply(y1, w, qw, sw, None, None, recipe,
                                                                              backend)})
        for name, ms in sw_ms.items():
            row[f"{name}_ms"] = ms
        # the quantization's cost once fused: what the fused pass adds over the BF16 SwiGLU alone
        row["fused_act_quant_share_of_gemm"] = max(0.0, row["fused_swiglu_quant_ms"] - row["swiglu_ms"]) / row["fp8_gemm_ms"]
        row["swiglu_fc2_fwd_speedup"] = row["bf16_swiglu_fc2_fwd_ms"] / row["fp8_fused_swiglu_fc2_fwd_ms"]
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)

    def bf16_step():
        F.linear(xg, wg).backward(dy)

    def fp8_step():
        FP8LinearFunction.apply(xg, wg, qw, sw, None, None, recipe, backend).backward(dy)

    for name, ms in time_sustained_ms({"bf16_fwdbwd": bf16_step, "fp8_fwdbwd": fp8_step}).items():
        row[f"{name}_ms"] = ms
    row["fwdbwd_speedup"] = row["bf16_fwdbwd_ms"] / row["fp8_fwdbwd_ms"]
    return row


def profile_forward(M: int, N: int, K: int, recipe: FP8Recipe) -> None:
    """Kernel tables of the BF16 forward and of the FP8 autograd forward at one shape."""
    dev = torch.device("cuda")
    backend = resolve_backend("auto", dev)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
    qw, sw = quantize_weight(w, recipe)
    for _ in range(3):  # warm-up (Triton compiles, cuBLAS heuristics)
        FP8LinearFunction.apply(x, w, qw, sw, None, None, recipe, backend)
    kernel_table(lambda: F.linear(x, w), 10, f"bf16 forward M={M} N={N} K={K}", top=5)
    kernel_table(lambda: FP8LinearFunction.apply(x, w, qw, sw, None, None, recipe, backend), 10,
                 f"FP8 forward M={M} N={N} K={K}", top=8)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="jetrl bench linear", description=__doc__)
    ap.add_argument("--tokens", type=int, default=16384, help="M for the training shapes")
    ap.add_argument("--decode", action="store_true", help="decode sizes M in 1..1024 instead")
    ap.add_argument("--rotate-mb", type=float, default=200.0,
                    help="--decode: FP8 weight bytes cycled per timed call so the weights are read from HBM, not L2")
    ap.add_argument("--scale-fmt", choices=["fp32", "ue8m0"], default="fp32")
    ap.add_argument("--profile", action="store_true",
                    help="also print the kernels of the BF16 and FP8 forward per shape (where FP8's time goes)")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("jetrl bench linear needs a CUDA GPU (Hopper for the scaled_mm backend)")
    recipe = FP8Recipe(scale_fmt=args.scale_fmt)
    rows = []
    if args.decode:
        for N, K in DECODE_SHAPES:
            for M in DECODE_M:
                rows.append(bench_decode_shape(M, N, K, recipe, args.rotate_mb))
    else:
        for N, K in TRAIN_SHAPES:
            rows.append(bench_shape(args.tokens, N, K, recipe))
    if args.profile:
        for N, K in (DECODE_SHAPES if args.decode else TRAIN_SHAPES):
            profile_forward(256 if args.decode else args.tokens, N, K, recipe)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}")
    cols = ["M", "N", "K", "bf16_fwd_ms", "fp8_fwd_ms", "fwd_speedup", "triton_small_m_ms", "triton_speedup",
            "triton_weight_TBps", "bf16_weight_TBps", "triton_vs_emulated_rel", "fp8_fwd_eager_ms", "triton_eager_ms",
            "bf16_fwd_burst_ms", "fp8_fwd_burst_ms", "fwd_speedup_burst", "bf16_fwd_sm_mhz", "fp8_fwd_sm_mhz",
            "bf16_fwd_watts", "fp8_fwd_watts", "fp8_gemm_ms", "act_quant_ms", "act_quant_share_of_gemm", "act_quant_TBps",
            "fp8_fwd_tflops", "bf16_fwd_tflops", "bf16_fwdbwd_ms", "fp8_fwdbwd_ms", "fwdbwd_speedup",
            "weight_quant_ms", "swiglu_ms", "fused_swiglu_quant_ms", "fused_act_quant_share_of_gemm",
            "bf16_swiglu_fc2_fwd_ms", "fp8_fused_swiglu_fc2_fwd_ms", "swiglu_fc2_fwd_speedup", "fp8_weight_GBps",
            "bf16_weight_GBps", "scaled_mm_vs_emulated_rel"]
    print_table(rows, [c for c in cols if any(c in r for r in rows)])
    if args.decode:
        # the largest M up to which the small-M kernel takes less time than cuBLAS scaled_mm summed
        # over the shapes (a layer's mix of GEMMs; per shape it may lose by a few percent)
        ok = [M for M in DECODE_M if sum(r["triton_small_m_ms"] for r in rows if r["M"] == M)
              < sum(r["fp8_fwd_ms"] for r in rows if r["M"] == M)]
        best = max((M for M in ok if all(m in ok for m in DECODE_M if m <= M)), default=0)
        print(f"suggested precision.small_m_max={best} (copy-bandwidth ceiling 4.2 TB/s on H200)")
    dump_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
