"""Per-step metrics: one JSON object per line in ``metrics.jsonl`` and TensorBoard scalars."""
from __future__ import annotations

import json
import logging
import math
import os

from megatron_jetrl.files import write_atomic

log = logging.getLogger("jetrl")


class MetricsLogger:
    def __init__(self, run_dir: str, tensorboard: bool = True, resume_step: int | None = None):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if resume_step is not None and os.path.exists(self.path):
            # A resumed run recomputes the steps after its checkpoint: drop their old lines so each
            # step appears exactly once.
            with open(self.path) as f:
                keep = [line for line in f if line.strip() and json.loads(line)["step"] <= resume_step]
            write_atomic(self.path, "".join(keep))
        elif os.path.exists(self.path):
            # A fresh run in a used run directory starts its own curves (--resume continues them).
            log.warning("%s: starting a fresh run; the previous metrics.jsonl and TensorBoard curves are replaced "
                        "(use --resume to continue, or another --run-dir to keep them)", run_dir)
        self.file = open(self.path, "a" if resume_step is not None else "w")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=resume_step + 1 if resume_step is not None else 0)

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step}
        for k, v in metrics.items():
            v = float(v)
            row[k] = v if math.isfinite(v) else None
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and v is not None:
                    self.tb.add_scalar(k.replace("time_", "time/").replace("mismatch_", "mismatch/"), v, step)
            self.tb.flush()

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
