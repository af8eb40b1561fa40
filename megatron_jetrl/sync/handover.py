"""The hand-over of the trainer's weights to the rollout after an optimizer step: export them as the rollout
receives them (``sync.export``), then hand them to the in-process engine (in place, or through
``InProcessTransport`` on parity-check steps) or push them to a fleet over its transport (``push_weights``:
distributed broadcast, tensor or disk), every rank taking part in the export, rank 0 sending.

``run`` below is any object with the run's ``cfg``, ``actor`` (``trainer.actor.Actor``) and ``engine``
(``rollout.base.RolloutEngine``).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_jetrl.config import JetConfig
from megatron_jetrl.distributed import is_rank0
from megatron_jetrl.models.builder import DTYPES
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.sync.export import ExportOptions, hf_bf16_linears, iter_hf_tensors
from megatron_jetrl.sync.transport import DiskTransport, InProcessTransport
from megatron_jetrl.trainer.run_dir import WEIGHTS_DIR


def export_options(cfg: JetConfig, recipe: FP8Recipe) -> ExportOptions:
    """What the rollout receives: FP8 bytes + scales when it runs FP8; the other tensors in BF16
    (SGLang) or the trainer's parameter dtype (in process, ``jetrl serve``)."""
    dtype = torch.bfloat16 if cfg.rollout.engine == "sglang" else DTYPES[cfg.precision.params_dtype]
    return ExportOptions(fp8=recipe.rollout_fp8, dtype=dtype)


def disk_push(run, version: int, items, record_hashes: bool = True) -> tuple[str, dict]:
    """Write the rollout's weights as an HF directory in the run dir (every rank its share), with
    weight_hashes.json (what the receiver verifies) when ``record_hashes``: parity-check steps only,
    hashing every tensor is not free on large models (``logging.parity_interval``)."""
    recipe = run.actor.fp8_state.recipe
    path = os.path.abspath(os.path.join(run.cfg.logging.run_dir, WEIGHTS_DIR))
    qc = (recipe.hf_quantization_config(hf_bf16_linears(run.actor.module, run.cfg.model, run.actor.fp8_state))
          if recipe.rollout_fp8 else None)
    m = DiskTransport(path, run.cfg.model.to_hf_config(), quantization_config=qc, collective=True,
                      bucket_bytes=run.cfg.rollout.bucket_mb << 20, record_hashes=record_hashes).push(version, items)
    return path, m


def hand_over_weights(run, version: int) -> dict:
    """Export the weights as the rollout receives them (FP8 bytes + scales of the trainer's cache
    when the rollout is FP8) and hand them over; the receiver checks the hashes (every
    ``logging.parity_interval`` steps). ``run``: the run's ``cfg``, ``actor`` and ``engine``."""
    every = run.cfg.logging.parity_interval
    check = bool(every) and version % every == 0
    opts = export_options(run.cfg, run.actor.fp8_state.recipe)
    if not run.engine.remote:
        if not check:
            return run.engine.update_weights(version, None)
        return InProcessTransport(run.engine).push(version, iter_hf_tensors(run.actor.module, run.cfg.model, opts))
    # Fleet: rank 0 restarts dead servers, then every rank takes part in the export (TP gathers,
    # per-stage disk shards); rank 0 sends.
    fleet, items = run.engine, iter_hf_tensors(run.actor.module, run.cfg.model, opts)
    m = {}
    if dist.is_initialized():
        dist.barrier()  # every rank's in-flight rollout is done before the servers' weights change
    if is_rank0():
        fleet.heal()
        m = fleet.push_weights(version, items, check, lambda v, it: disk_push(run, v, it, check))
        m.update(fleet.metrics)
    elif run.cfg.rollout.weight_transport == "disk":
        disk_push(run, version, items, check)
    else:
        for _ in items:
            pass
    if dist.is_initialized():
        dist.barrier()
        # rank 0's push metrics (sync time and bytes, FP8 parity, fleet health) for every rank: the logging
        # rank is the last one, in another data-parallel group than rank 0 when there are pipeline stages
        box = [m]
        dist.broadcast_object_list(box, src=0)
        m = box[0]
    if not is_rank0():  # rank 0 restarted whatever was down: every server is back for every rank
        fleet.assume_up()
    return m
