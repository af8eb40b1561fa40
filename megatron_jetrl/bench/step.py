"""``jetrl bench step``: full RL steps (rollout, reward, logprob recompute, train, FP8
re-quantization, weight hand-over) per precision mode, side by side in one run. The logprob
recompute is a phase of its own only with ``algo.recompute_logprobs=true`` (the paper's training
phase); by default the training forward supplies the old logprobs and ``logprob`` is ~0.

Each mode runs the same preset (same seed, prompts, batch sizes) colocated on one machine with the
in-process engine, for ``--steps`` measured RL steps after ``--warmup`` steps. It prints the median
time of each phase, the end-to-end step time and the ratio to ``bf16`` measured in the same run,
the share of FP8 re-quantization + hand-over in the step, the peak CUDA memory, and writes one
stacked phase-time PNG for all modes (``--plot``) and the rows as JSON (``--json``).

On CPU this runs (the tiny preset) to check the harness; speed claims are GPU runs recorded in
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics

import torch

from megatron_jetrl.bench.timing import MODES_HELP, dump_json, mode_overrides, print_table

PHASES = ("rollout", "logprob", "train", "weight_sync")


def run_mode(preset_path: str, mode: str, overrides: list[str], steps: int, warmup: int) -> dict:
    from megatron_jetrl.config import load_config
    from megatron_jetrl.run import close, setup
    from megatron_jetrl.train import rl_step

    # the hand-over is timed without the optional hash-parity verification (sha256 of every FP8
    # tensor on the host, both sides: seconds on an 8B model); pass logging.parity_interval=N to include it
    # the reward is a hash of the response unless given: on random weights the verifiable reward is 0 for
    # every response, GRPO's advantages then are 0 and the training step would run its backward on zero
    # gradients (rewards/math.py: hash_reward)
    # its own run directory, replaced by the next benchmark (checkpoint.overwrite)
    cfg = load_config(preset_path, ["logging.parity_interval=0", "data.reward=hash", *overrides, *mode_overrides(mode),
                                    "algo.sft_warmup_steps=0",
                                    f"steps={steps + warmup}", "logging.tensorboard=false", "checkpoint.overwrite=true",
                                    f"logging.run_dir={os.path.join('runs', 'bench_step', mode)}"])
    run = setup(cfg)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    rows = []
    try:
        for step in range(steps + warmup):
            m = rl_step(run, step)
            if step >= warmup:
                rows.append(m)
    finally:
        close(run)
    out = {"mode": mode}
    for p in PHASES:
        out[p] = statistics.median(r[f"time_{p}"] for r in rows)
    out["requant"] = statistics.median(r.get("time_fp8_requant", 0.0) for r in rows)
    out["step"] = statistics.median(sum(r[f"time_{p}"] for p in PHASES) for r in rows)
    out["requant_handover_share"] = (out["requant"] + out["weight_sync"]) / out["step"]
    out["mismatch_abs_mean"] = statistics.mean(r["mismatch_abs_mean"] for r in rows)
    out["train_seq_len"] = statistics.median(r.get("train_seq_len", 0.0) for r in rows)  # padded (algo.pad_tokens_to)
    # the train phase's parts: forward/backward over the micro-batches, optimizer step (re-quantization apart)
    out["train_fwd_bwd"] = statistics.median(r["time_fwd_bwd"] for r in rows)
    out["train_optimizer"] = statistics.median(r["time_optimizer"] for r in rows)
    # the spread of the rewards within a step (0 would mean zero advantages: a backward on zero gradients)
    out["reward_std"] = statistics.median(float(r["reward_std"]) for r in rows)
    out["tokens_per_s_rollout"] = float(statistics.median(float(r["tokens_per_s"]) for r in rows))
    out["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    del run
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def plot(rows: list[dict], path: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    left = [0.0] * len(rows)
    colors = {"rollout": "#4c72b0", "logprob": "#dd8452", "train": "#55a868", "weight_sync": "#c44e52"}
    for p in PHASES:
        vals = [r[p] for r in rows]
        ax.barh([r["mode"] for r in rows], vals, left=left, label=p, color=colors[p])
        left = [a + b for a, b in zip(left, vals)]
    base = next((r["step"] for r in rows if r["mode"] == "bf16"), None)
    for i, r in enumerate(rows):
        ax.text(left[i], i, f"  {r['step']:.3g} s" + (f" ({base / r['step']:.2f}x)" if base else ""), va="center")
    ax.set_xlabel("seconds per RL step (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(PHASES), fontsize=8, frameon=False)
    ax.set_xlim(0, max(left) * 1.35)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> list[dict]:
    from megatron_jetrl.config import preset_path

    ap = argparse.ArgumentParser(prog="jetrl bench step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--modes", default="bf16,fp8_rollout,jet", help=MODES_HELP)
    ap.add_argument("--steps", type=int, default=5, help="measured RL steps per mode")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--plot", help="write the phase-time PNG here")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides for every mode")
    args = ap.parse_intermixed_args(argv)  # flags may follow config overrides (device_check.sh appends both)
    rows = []
    for m in args.modes.split(","):
        rows.append(run_mode(preset_path(args.preset), m, args.overrides, args.steps, args.warmup))
        print({k: v for k, v in rows[-1].items() if isinstance(v, (str, int, float))}, flush=True)
        dump_json(args.json, rows)  # after every mode: a run stopped by a time limit keeps what it measured
    base = next((r for r in rows if r["mode"] == "bf16"), None)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"# {dev} torch {torch.__version__}, preset {args.preset}, {args.steps} steps after {args.warmup} warm-up")
    cols = ["mode", *PHASES, "requant", "step", "requant_handover_share", "mismatch_abs_mean", "reward_std",
            "tokens_per_s_rollout", "train_seq_len", "peak_GiB"]
    shown = rows
    if base:  # the ratios are printed, not stored in the rows
        shown = [{**r, "step speedup vs bf16": f"{base['step'] / r['step']:.3f}",
                  "rollout speedup": f"{base['rollout'] / r['rollout']:.3f}",
                  "train-phase speedup": f"{(base['logprob'] + base['train']) / (r['logprob'] + r['train']):.3f}"}
                 for r in rows]
        cols += ["step speedup vs bf16", "rollout speedup", "train-phase speedup"]
    print_table(shown, cols)
    # the train phase by part, and each part's ratio to bf16's (where the FP8 training gain is, or is not)
    parts = ["logprob", "train_fwd_bwd", "train_optimizer", "requant"]
    print_table([{**{p: r[p] for p in ["mode", *parts]}, **({f"{p} vs bf16": f"{base[p] / r[p]:.3f}" if r[p] else "-"
                                                             for p in parts[:3]} if base else {})} for r in rows],
                ["mode", *parts] + ([f"{p} vs bf16" for p in parts[:3]] if base else []))
    if args.plot:
        print(f"plot: {plot(rows, args.plot, f'{dev}, preset {args.preset}')}")
    return rows


if __name__ == "__main__":
    main()
