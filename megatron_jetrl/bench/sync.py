"""``jetrl bench sync``: gather + export throughput and bytes sent, BF16 vs FP8, in one run.

Builds the model of a preset (random weights), then streams the HF export the rollout receives:
``bf16`` (every tensor BF16, what BF16 rollout gets) and ``fp8`` (the cached block-FP8 weights and
scales + BF16 rest, what jet rollout gets). The FP8 cache refresh (re-quantization, once per
optimizer step) is timed separately. Optionally writes the disk transport's checkpoint too.
"""
from __future__ import annotations

import argparse
import time

import torch

from megatron_jetrl.bench.timing import dump_json


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> list[dict]:
    from megatron_jetrl.config import preset_path
    from megatron_jetrl.config import load_config
    from megatron_jetrl.distributed import init_distributed
    from megatron_jetrl.models.builder import DTYPES, build_model
    from megatron_jetrl.precision.linear import refresh_fp8_weights
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.sync.export import ExportOptions, iter_hf_tensors
    from megatron_jetrl.sync.transport import DiskTransport, bucketize, nbytes

    ap = argparse.ArgumentParser(prog="jetrl bench sync", description=__doc__)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--disk", help="also push through the disk transport into this directory")
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    cfg = load_config(preset_path(args.preset), [*args.overrides, "precision.mode=jet"])
    init_distributed(cfg.parallel, cfg.seed)
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision),
                               DTYPES[cfg.precision.params_dtype], cfg.precision.backend)
    n_params = sum(p.numel() for p in model.parameters())
    refresh = min(refresh_fp8_weights(model, state) for _ in range(args.repeats))
    rows = []
    for label, opts in (("bf16", ExportOptions(fp8=False)), ("fp8", ExportOptions(fp8=True))):
        best, total, count, buckets = float("inf"), 0, 0, 0
        for _ in range(args.repeats):
            _sync()
            t0 = time.perf_counter()
            total = count = buckets = 0
            for bucket in bucketize(iter_hf_tensors(model, cfg.model, opts), args.bucket_mb << 20):
                buckets += 1
                count += len(bucket)
                total += sum(nbytes(t) for _, t in bucket)
            _sync()
            best = min(best, time.perf_counter() - t0)
        row = {"mode": label, "bytes": total, "tensors": count, "buckets": buckets, "seconds": best,
               "GBps": total / best / 1e9, "params": n_params}
        if args.disk:
            t0 = time.perf_counter()
            DiskTransport(f"{args.disk}/{label}", cfg.model.to_hf_config(),
                          quantization_config=state.recipe.hf_quantization_config() if opts.fp8 else None
                          ).push(1, iter_hf_tensors(model, cfg.model, opts))
            row["disk_seconds"] = time.perf_counter() - t0
        rows.append(row)
    print(f"# {args.preset}: {n_params / 1e9:.2f}B params on {next(model.parameters()).device}; "
          f"FP8 cache refresh (re-quantize all FP8 weights) {refresh * 1e3:.1f} ms")
    print("| mode | bytes sent | tensors | buckets | gather+export s | GB/s |" + (" disk s |" if args.disk else ""))
    print("|---|---|---|---|---|---|" + ("---|" if args.disk else ""))
    for r in rows:
        print(f"| {r['mode']} | {r['bytes'] / 1e9:.3f} GB | {r['tensors']} | {r['buckets']} | {r['seconds']:.3f} | "
              f"{r['GBps']:.1f} |" + (f" {r['disk_seconds']:.2f} |" if args.disk else ""))
    print(f"FP8 / BF16 bytes: {rows[1]['bytes'] / rows[0]['bytes']:.3f}")
    dump_json(args.json, {"rows": rows, "refresh_seconds": refresh})
    return rows


if __name__ == "__main__":
    main()
