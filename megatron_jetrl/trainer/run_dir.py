"""The run directory: what it holds of a run, whether a run may start in it (fresh, or resuming the run it holds),
clearing it when the user asks (``checkpoint.overwrite``), and the request to save and stop (``STOP_FILE``)."""
from __future__ import annotations

import os
import shutil

from megatron_jetrl.config import ConfigError, JetConfig
from megatron_jetrl.trainer.checkpoint import checkpoints, newest_intact_checkpoint

# The run's checkpoints (``step_N`` directories and ``latest``), in the run directory.
CHECKPOINTS_DIR = "checkpoints"
# What a run directory holds of a run (deleted by checkpoint.overwrite before a fresh run writes).
RUN_FILES = (CHECKPOINTS_DIR, "metrics.jsonl", "tb", "rollout", "rollout_logs", "config.yaml")
# Created in the run directory (by hand, or by a batch script on the scheduler's pre-timeout signal: docs/cluster.md),
# it asks the run to save a checkpoint after its current step and end; the run removes it when it does.
STOP_FILE = "save_and_stop"
# The rollout's weights as the trainer hands them to a fleet's servers (an HF directory), and the file naming the launch
# whose trainer wrote the initial ones (``rollout.launch_id``): that launch's servers start on them.
WEIGHTS_DIR = os.path.join("rollout", "weights")
LAUNCH_MARK = os.path.join("rollout", "weights.launch")
# The settings a resumed run must share with the run it continues.
SAME_RUN_KEYS = ("model", "seed", "precision.mode", "precision.scale_fmt", "data.path", "data.reward")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_run_dir(cfg: JetConfig) -> str | None:
    """Before anything is written: the checkpoint to resume from (None for a fresh run). ``--resume`` needs a
    complete checkpoint (every file there at its size; ``run.setup`` then checks the CRC-32s with all ranks and may
    fall back to an older one) of a run with the same model, seed and precision; a fresh run needs a run directory
    without another run's checkpoints or metrics (or ``checkpoint.overwrite``). One-line ``ConfigError``s."""
    import yaml

    from megatron_jetrl.config import config_to_dict

    run_dir = cfg.logging.run_dir
    ckpt_dir = os.path.join(run_dir, CHECKPOINTS_DIR)
    if cfg.checkpoint.resume:
        path = newest_intact_checkpoint(ckpt_dir, crc=False)
        if path is None:
            raise no_checkpoint(ckpt_dir)
        saved = os.path.join(run_dir, "config.yaml")
        if os.path.isfile(saved):
            with open(saved) as f:
                old = _flat(yaml.safe_load(f) or {})
            new = _flat(config_to_dict(cfg))
            diff = [k for k in sorted(new) if k.startswith(SAME_RUN_KEYS) and k in old and old[k] != new[k]]
            if diff:
                raise ConfigError(f"config error: {diff[0]}: the run in {run_dir} has {old[diff[0]]!r}, this config "
                                  f"{new[diff[0]]!r}{f' (and {len(diff) - 1} more)' if len(diff) > 1 else ''}; "
                                  "resume with the run's own settings (its config.yaml)")
        return path
    held = [os.path.basename(p) for p in checkpoints(ckpt_dir)]
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics):
        held.append("metrics.jsonl")
    if held and not cfg.checkpoint.overwrite:
        raise ConfigError(f"config error: logging.run_dir: {run_dir} holds another run ({', '.join(held[:3])}"
                          f"{', ...' if len(held) > 3 else ''}); resume it with --resume, use another --run-dir, "
                          "or pass --overwrite to delete it")
    return None


def no_checkpoint(ckpt_dir: str) -> ConfigError:
    return ConfigError(f"config error: checkpoint.resume: no intact checkpoint in {ckpt_dir}; start without "
                       "--resume, or give the run directory that holds the run")


def clear_run(run_dir: str) -> None:
    """Delete what a run wrote in ``run_dir`` (``RUN_FILES``; nothing else there is touched)."""
    for name in RUN_FILES:
        p = os.path.join(run_dir, name)
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)


def stop_requested(run_dir: str) -> bool:
    """Whether ``run_dir/STOP_FILE`` exists (read by one rank; ``distributed.rank0_decides`` shares the answer)."""
    return os.path.exists(os.path.join(run_dir, STOP_FILE))


def clear_stop_request(run_dir: str) -> bool:
    """Remove ``run_dir/STOP_FILE``; True if there was one. At a run's start it is a request left from before the run
    (one the previous run ended without acting on), after the stop the request it acted on."""
    try:
        os.remove(os.path.join(run_dir, STOP_FILE))
        return True
    except FileNotFoundError:
        return False
