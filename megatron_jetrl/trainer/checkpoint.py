"""Checkpoints: megatron dist_checkpointing (torch_dist) of model + optimizer + LR schedule, plus
the loop state (step, prompt stream, RNG), written to ``step_N.tmp`` and renamed when complete;
``latest`` names the newest complete one. A crash leaves at most a ``.tmp`` that is ignored."""
from __future__ import annotations

import json
import os
import shutil

import torch

from megatron_jetrl.distributed import barrier, is_rank0


MODEL_CONFIG_FILE = "model_config.json"


def write_model_config(directory: str, model_cfg) -> None:
    """The model description next to its weights (what the converters rebuild the model from)."""
    import dataclasses

    fields = {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(model_cfg)}
    fields["hf_path"] = None  # the checkpoint now holds the weights
    with open(os.path.join(directory, MODEL_CONFIG_FILE), "w") as f:
        json.dump(fields, f, indent=1)


def read_model_config(ckpt_dir: str):
    """The ModelConfig a checkpoint was written with (its model_config.json)."""
    from megatron_jetrl.config import ConfigError, ModelConfig

    path = os.path.join(ckpt_dir, MODEL_CONFIG_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"config error: checkpoint {ckpt_dir!r} has no {MODEL_CONFIG_FILE}; "
                          "give a checkpoint written by jetrl (convert or train)")
    with open(path) as f:
        return ModelConfig(**json.load(f))


def save_checkpoint(ckpt_root: str, step: int, actor, loop_state: dict, model_cfg=None) -> str:
    from megatron.core import dist_checkpointing

    final = os.path.join(ckpt_root, f"step_{step}")
    tmp = final + ".tmp"
    rank0 = is_rank0()
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    released = actor.restore_weights()  # released BF16 weights (precision.release_bf16_weights) are saved too
    try:
        model_sd = actor.module.sharded_state_dict()
        sharded = {"model": model_sd,
                   "optimizer": actor.optimizer.sharded_state_dict(
                       model_sd, metadata={"distrib_optim_sharding_type": "dp_reshardable"})}
        dist_checkpointing.save(sharded, tmp, content_metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    finally:
        if released:
            actor.release_weights()
    if rank0:
        state = dict(loop_state, step=step, scheduler=actor.scheduler.state_dict(), actor_steps=actor.steps,
                     torch_rng=torch.get_rng_state().tolist())
        with open(os.path.join(tmp, "loop_state.json"), "w") as f:
            json.dump(state, f)
        if model_cfg is not None:
            write_model_config(tmp, model_cfg)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(os.path.join(ckpt_root, "latest.tmp"), "w") as f:
            f.write(f"step_{step}\n")
        os.replace(os.path.join(ckpt_root, "latest.tmp"), os.path.join(ckpt_root, "latest"))
    barrier()
    return final


def latest_checkpoint(ckpt_root: str) -> str | None:
    marker = os.path.join(ckpt_root, "latest")
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        path = os.path.join(ckpt_root, f.read().strip())
    return path if os.path.isfile(os.path.join(path, "loop_state.json")) else None


def load_model_weights(path: str, actor) -> None:
    """Only the model weights of a checkpoint (ours or a converted HF one), resharded to this layout."""
    from megatron.core import dist_checkpointing

    from megatron_jetrl.models.hf_io import CheckpointError

    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint error: checkpoint.load_path {path!r} is not a directory; "
                              "convert one with jetrl convert hf-to-megatron")
    actor.restore_weights()  # loaded into: the storage must be there (released again at the next step)
    state = dist_checkpointing.load({"model": actor.module.sharded_state_dict()}, path)
    actor.module.load_state_dict(state["model"])


def load_checkpoint(path: str, actor) -> dict:
    from megatron.core import dist_checkpointing

    actor.restore_weights()
    model_sd = actor.module.sharded_state_dict()
    state = dist_checkpointing.load({"model": model_sd}, path)
    actor.module.load_state_dict(state["model"])
    with torch.no_grad():
        opt_sd = actor.optimizer.sharded_state_dict(
            actor.module.sharded_state_dict(), is_loading=True,
            metadata={"distrib_optim_sharding_type": "dp_reshardable"})
        actor.optimizer.load_state_dict(dist_checkpointing.load({"optimizer": opt_sd}, path)["optimizer"])
    with open(os.path.join(path, "loop_state.json")) as f:
        loop = json.load(f)
    actor.scheduler.load_state_dict(loop["scheduler"])
    actor.steps = loop["actor_steps"]
    torch.set_rng_state(torch.tensor(loop["torch_rng"], dtype=torch.uint8))
    return loop
