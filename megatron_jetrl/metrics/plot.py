"""``jetrl plot RUN_DIR``: PNG curves of reward, mismatch, loss and phase times."""
from __future__ import annotations

import os

from megatron_jetrl.metrics.logger import read_metrics

PANELS = [
    ("reward", ["reward_mean", "sft_reward_mean", "eval/accuracy", "eval/pass@*"]),
    ("train-rollout mismatch", ["mismatch_abs_mean", "mismatch_k3_kl"]),
    ("loss / grad norm", ["pg_loss", "sft_loss", "grad_norm"]),
    ("entropy / response length", ["entropy", "response_length_mean"]),
    ("phase time (s)", ["time_rollout", "time_logprob", "time_train", "time_weight_sync"]),
]


def plot_run(run_dir: str, out: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out = out or os.path.join(run_dir, "curves.png")
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (title, keys) in zip(axes, PANELS):
        present = sorted({k for r in rows for k in r})
        for key in [k for want in keys for k in present if k == want or (want.endswith("*") and k.startswith(want[:-1]))]:
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                line, = ax.plot(xs, ys, label=key, lw=0.8, alpha=0.45 if len(pts) > 40 else 1.0,
                                marker="o" if key.startswith("eval/") else None, ms=3)
                if len(pts) > 40:  # a 20-step moving average over the noisy per-step values
                    w = 20
                    smooth = [sum(ys[max(0, i - w + 1): i + 1]) / len(ys[max(0, i - w + 1): i + 1]) for i in range(len(ys))]
                    ax.plot(xs, smooth, color=line.get_color(), lw=1.8, label=f"{key} (avg {w})")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
