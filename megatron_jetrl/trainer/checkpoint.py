"""Checkpoints: megatron dist_checkpointing (torch_dist) of model + optimizer + LR schedule, plus
the loop state (step, prompt stream, RNG), written to ``step_N.tmp`` and renamed when complete;
``latest`` names the newest complete one. A crash leaves at most a ``.tmp`` that is ignored.

Integrity: ``checksums.json`` (size and CRC-32 of every file, written last) lets a resume skip a
checkpoint that was truncated or corrupted afterwards and fall back to the newest intact one. A
checkpoint is never written from non-finite weights (``TrainingError``)."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Callable

import torch

from megatron_jetrl.distributed import barrier, is_rank0
from megatron_jetrl.errors import TrainingError
from megatron_jetrl.files import replace_dir, write_atomic

log = logging.getLogger("jetrl.checkpoint")
CHECKSUMS_FILE = "checksums.json"


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_checksums(directory: str, keep=lambda rel: True) -> dict[str, list[int]]:
    """{relative path: [size, crc32]} of the files under ``directory`` that ``keep`` selects (never the checksum
    file itself)."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, directory)
            if rel != CHECKSUMS_FILE and keep(rel):
                out[rel] = [os.path.getsize(path), _crc32(path)]
    return out


def _own_shard(rel: str, rank: int) -> bool:
    """torch_dist writes ``__{rank}_{n}.distcp`` per rank: each rank checksums its own (in parallel, each file
    read once, by the rank that wrote it)."""
    return re.fullmatch(rf"__{rank}_\d+\.distcp", rel) is not None


def checkpoint_problem(path: str, crc: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed from (missing, truncated or, with ``crc``, changed files),
    or None. ``share = (r, n)``: the CRC-32s of the r-th of n interleaved shares of its files only (every size is
    checked), so n ranks read a checkpoint once between them."""
    sums = os.path.join(path, CHECKSUMS_FILE)
    if not os.path.isfile(sums):
        return f"no {CHECKSUMS_FILE} (unfinished)"
    try:
        with open(sums) as f:
            want = json.load(f)
    except (OSError, ValueError) as e:
        return f"{CHECKSUMS_FILE} unreadable ({type(e).__name__})"
    for i, (rel, (size, want_crc)) in enumerate(sorted(want.items())):
        p = os.path.join(path, rel)
        if not os.path.isfile(p):
            return f"{rel} missing"
        if os.path.getsize(p) != size:
            return f"{rel} is {os.path.getsize(p)} bytes, {size} were written"
        if crc and i % share[1] == share[0] and _crc32(p) != want_crc:
            return f"{rel} changed since it was written (CRC-32)"
    return None


def nonfinite_tensors(module) -> list[str]:
    """Names of ``module``'s parameters that hold a NaN or inf."""
    return [n for n, p in module.named_parameters() if p.numel() and not bool(torch.isfinite(p.detach()).all())]


MODEL_CONFIG_FILE = "model_config.json"


def write_model_config(directory: str, model_cfg) -> None:
    """The model description next to its weights (what the converters rebuild the model from)."""
    import dataclasses

    fields = {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(model_cfg)}
    fields["hf_path"] = None  # the checkpoint now holds the weights
    with open(os.path.join(directory, MODEL_CONFIG_FILE), "w") as f:
        json.dump(fields, f, indent=1)


# The ModelConfig fields that define the function a checkpoint's weights compute: a model built with other values
# loads the same tensors and computes something else (RoPE scaling, epsilon, theta), or fails to load them.
ARCH_FIELDS = ("model_type", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "ffn_hidden_size", "vocab_size", "rope_theta", "rope_scaling", "rms_norm_eps", "tie_word_embeddings",
               "num_experts", "moe_top_k", "moe_ffn_hidden_size", "norm_topk_prob")


def check_model_matches(ckpt_dir: str, model_cfg) -> None:
    """Before a run starts from ``checkpoint.load_path``: the model it builds is the one the checkpoint was written
    with (its model_config.json), field by field over ``ARCH_FIELDS``; else one ``ConfigError`` line naming the
    first field that differs. Checkpoints without a model_config.json (written elsewhere) are not checked."""
    from megatron_jetrl.config import ConfigError

    path = os.path.join(ckpt_dir, MODEL_CONFIG_FILE)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        saved = json.load(f)
    diff = [k for k in ARCH_FIELDS if k in saved and saved[k] != getattr(model_cfg, k)]
    if diff:
        k = diff[0]
        raise ConfigError(f"config error: model.{k}: checkpoint.load_path {ckpt_dir!r} holds a model with "
                          f"{saved[k]!r}, this config builds {getattr(model_cfg, k)!r}"
                          f"{f' (and {len(diff) - 1} more)' if len(diff) > 1 else ''}; set model.hf_path to the "
                          "checkpoint's HF directory, or the model fields to its model_config.json")


def read_model_config(ckpt_dir: str):
    """The ModelConfig a checkpoint was written with (its model_config.json)."""
    from megatron_jetrl.config import ConfigError, ModelConfig

    path = os.path.join(ckpt_dir, MODEL_CONFIG_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"config error: checkpoint {ckpt_dir!r} has no {MODEL_CONFIG_FILE}; "
                          "give a checkpoint written by jetrl (convert or train)")
    with open(path) as f:
        return ModelConfig(**json.load(f))


def save_checkpoint(ckpt_root: str, step: int, actor, loop_state: dict, model_cfg=None, keep_last: int = 0) -> str:
    from megatron.core import dist_checkpointing

    final = os.path.join(ckpt_root, f"step_{step}")
    tmp = final + ".tmp"
    rank0 = is_rank0()
    released = actor.restore_weights()  # released BF16 weights (precision.release_bf16_weights) are saved too
    try:
        bad = nonfinite_tensors(actor.module)
        count = torch.tensor([float(len(bad))], device=next(actor.module.parameters()).device)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(count)
        if count.item():
            raise TrainingError(f"refusing to checkpoint step {step}: {int(count.item())} weight tensors are not "
                                f"finite ({', '.join(bad[:3]) or 'on another rank'}); the newest checkpoint stays "
                                f"{latest_checkpoint(ckpt_root) or 'none'}")
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        barrier()
        model_sd = actor.module.sharded_state_dict()
        sharded = {"model": model_sd,
                   "optimizer": actor.optimizer.sharded_state_dict(
                       model_sd, metadata={"distrib_optim_sharding_type": "dp_reshardable"})}
        dist_checkpointing.save(sharded, tmp, content_metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    finally:
        if released:
            actor.release_weights()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    sums = [file_checksums(tmp, lambda rel: _own_shard(rel, rank))]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        sums = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(sums, file_checksums(tmp, lambda rel: _own_shard(rel, rank)))
    if rank0:
        state = dict(loop_state, step=step, scheduler=actor.scheduler.state_dict(), actor_steps=actor.steps,
                     skipped_steps=actor.skipped_steps, torch_rng=torch.get_rng_state().tolist())
        with open(os.path.join(tmp, "loop_state.json"), "w") as f:
            json.dump(state, f)
        if model_cfg is not None:
            write_model_config(tmp, model_cfg)
        merged = {k: v for part in sums for k, v in part.items()}
        merged.update(file_checksums(tmp, lambda rel: rel not in merged))  # metadata, loop state, model config
        with open(os.path.join(tmp, CHECKSUMS_FILE), "w") as f:
            json.dump(merged, f)
        replace_dir(tmp, final)
        write_atomic(os.path.join(ckpt_root, "latest"), f"step_{step}\n")
        if keep_last:  # checkpoint.keep_last: older ones go once this one is complete and named latest
            found = checkpoints(ckpt_root)  # newest first: those after this one are older
            for old in found[found.index(final) + 1:][keep_last - 1:]:
                shutil.rmtree(old)
    barrier()
    return final


def latest_checkpoint(ckpt_root: str) -> str | None:
    marker = os.path.join(ckpt_root, "latest")
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        path = os.path.join(ckpt_root, f.read().strip())
    return path if os.path.isfile(os.path.join(path, "loop_state.json")) else None


def checkpoints(ckpt_root: str) -> list[str]:
    """The complete checkpoint directories (``step_N``, renamed from ``.tmp``), newest first."""
    if not os.path.isdir(ckpt_root):
        return []
    steps = [(int(m.group(1)), d) for d in os.listdir(ckpt_root) if (m := re.fullmatch(r"step_(\d+)", d))]
    return [os.path.join(ckpt_root, d) for _, d in sorted(steps, reverse=True)]


def newest_intact_checkpoint(ckpt_root: str, crc: bool = True, share: tuple[int, int] = (0, 1),
                             agree: Callable[[str | None], str | None] = lambda why: why) -> str | None:
    """The newest checkpoint, from the one ``latest`` names down, whose files match their checksums (sizes only
    without ``crc``). In a job each rank checks its ``share`` of the CRC-32s and ``agree`` turns the ranks'
    answers into one (``distributed.first_of_ranks``), so every rank picks the same checkpoint; each newer one
    skipped is named in a one-line warning (by the share's first rank)."""
    found = checkpoints(ckpt_root)
    marker = os.path.join(ckpt_root, "latest")
    try:
        with open(marker) as f:
            named = os.path.join(ckpt_root, f.read().strip())
        found = found[found.index(named):] if named in found else found
    except OSError:
        pass
    for path in found:
        why = agree(checkpoint_problem(path, crc, share))
        if why is None:
            return path
        if share[0] == 0:
            log.warning("skipping checkpoint %s: %s", path, why)
    return None


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


def checkpoint_step(path: str) -> int:
    """The RL loop's step a checkpoint was saved after (its ``loop_state.json``)."""
    with open(os.path.join(path, "loop_state.json")) as f:
        return int(json.load(f)["step"])


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
    actor.skipped_steps = loop.get("skipped_steps", 0)
    torch.set_rng_state(torch.tensor(loop["torch_rng"], dtype=torch.uint8))
    return loop
