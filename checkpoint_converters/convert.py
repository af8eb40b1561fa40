"""HF <-> Megatron (torch_dist) checkpoint conversion, BF16 and block FP8.

- ``hf_to_megatron``: an HF directory (BF16/FP32, or block FP8 with ``quantization_config``,
  dequantized on read) -> a megatron-core distributed checkpoint. Run it with the layout you want
  (``torchrun --nproc-per-node N -m megatron_jetrl.cli convert hf-to-megatron ...
  parallel.tensor_parallel=2``): each rank reads only the HF tensors of its own shard. torch_dist
  checkpoints reshard on load, so any layout can read the result.
- ``megatron_to_hf``: a checkpoint written by ``hf_to_megatron`` or by ``jetrl train`` (any layout)
  -> an HF directory: config.json, safetensors shards (<= 5 GB) + index, generation_config.json,
  tokenizer files when given; run it under torchrun with a layout (``parallel.*``) to keep each rank to its shard;
  ``dtype="fp8"`` writes the block-FP8 format with its
  ``quantization_config``: the bytes the rollout engine receives for those weights (the FP8 cache
  is a function of the parameters: same parameters, same recipe, same bytes).

Both stream tensor by tensor, show a progress bar, and write into ``OUT.tmp`` renamed to ``OUT``
at the end; on failure nothing is left behind. Before anything is written they refuse (one line): an
``OUT`` that is the source, holds it or lies inside it; a non-empty ``OUT`` or a leftover ``OUT.tmp``
without ``overwrite``; weights that are not finite without ``allow_nonfinite``.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch

from megatron_jetrl.distributed import barrier, is_rank0
from megatron_jetrl.trainer.checkpoint import read_model_config, write_model_config


def check_output(src: str, out: str, overwrite: bool) -> None:
    """Refuse, before anything is written, an output directory that would destroy or pollute the source,
    or replace something the user has not agreed to."""
    from megatron_jetrl.models.hf_io import CheckpointError

    s, o = os.path.realpath(src), os.path.realpath(out.rstrip("/"))
    if s == o or s.startswith(o + os.sep) or o.startswith(s + os.sep):
        where = "is" if s == o else "contains" if s.startswith(o) else "is inside"
        raise CheckpointError(f"checkpoint error: OUT {out!r} {where} "
                              f"the source {src!r}; give an output directory outside it")
    if os.path.exists(o) and not overwrite and (not os.path.isdir(o) or os.listdir(o)):
        raise CheckpointError(f"checkpoint error: OUT {out!r} exists and is not empty; give a new directory or pass "
                              "--overwrite to replace it")
    if os.path.exists(o + ".tmp") and not overwrite:
        raise CheckpointError(f"checkpoint error: {o + '.tmp'!r} exists (an interrupted conversion?); remove it or "
                              "pass --overwrite")


def _check_finite(model, where: str, allow: bool) -> None:
    from megatron_jetrl.models.hf_io import CheckpointError
    from megatron_jetrl.trainer.checkpoint import nonfinite_tensors

    bad = nonfinite_tensors(model)
    if bad and not allow:
        raise CheckpointError(f"checkpoint error: {where}: {len(bad)} weight tensors hold NaN/inf (e.g. {bad[0]}); "
                              "pass --allow-nonfinite to convert them anyway")


def _build(model_cfg, overrides: list[str], dtype: torch.dtype, mode: str = "bf16"):
    from megatron_jetrl.config import JetConfig, parallel_from_overrides
    from megatron_jetrl.distributed import init_distributed
    from megatron_jetrl.models.builder import build_model
    from megatron_jetrl.precision.recipe import FP8Recipe

    parallel = parallel_from_overrides(overrides)
    JetConfig(model=model_cfg, parallel=parallel)  # validates the layout against the model
    init_distributed(parallel)
    return build_model(model_cfg, parallel, FP8Recipe(mode=mode), dtype, backend="auto")


def hf_to_megatron(hf_dir: str, out_dir: str, parallel_overrides: list[str] = (),
                   dtype: torch.dtype = torch.bfloat16, overwrite: bool = False, allow_nonfinite: bool = False) -> str:
    from megatron.core import dist_checkpointing

    from megatron_jetrl.config import ModelConfig
    from megatron_jetrl.models.hf_io import CheckpointError, load_hf_weights

    check_output(hf_dir, out_dir, overwrite)
    model_cfg = ModelConfig(hf_path=hf_dir)
    model, state = _build(model_cfg, list(parallel_overrides), dtype)
    tmp = out_dir.rstrip("/") + ".tmp"
    try:
        try:
            load_hf_weights(model, model_cfg, hf_dir, state, progress=is_rank0())
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors/json errors of a damaged file: one line
            raise CheckpointError(f"checkpoint error: {hf_dir!r} cannot be read ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200] if str(e) else ''}); is a file truncated?") from None
        _check_finite(model, hf_dir, allow_nonfinite)
        if is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        barrier()
        dist_checkpointing.save({"model": model.sharded_state_dict()}, tmp)
        if is_rank0():
            write_model_config(tmp, model_cfg)
            if os.path.exists(out_dir):
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
        barrier()
    except BaseException:
        if is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def megatron_to_hf(ckpt_dir: str, out_dir: str, dtype: str = "bf16", tokenizer_dir: Optional[str] = None,
                   shard_bytes: int = 5 << 30, model_cfg=None, parallel_overrides: list[str] = (),
                   overwrite: bool = False, allow_nonfinite: bool = False) -> str:
    from megatron.core import dist_checkpointing
    from tqdm import tqdm

    from megatron_jetrl.models.hf_io import CheckpointError
    from megatron_jetrl.precision.linear import refresh_fp8_weights
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.sync.export import ExportOptions, hf_bf16_linears, iter_hf_tensors
    from megatron_jetrl.sync.transport import DiskTransport

    if dtype not in ("bf16", "fp8"):
        raise ValueError(f"--dtype {dtype!r}: use bf16 or fp8")
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint error: {ckpt_dir!r} is not a directory; give a megatron checkpoint "
                              "directory (e.g. runs/NAME/checkpoints/step_N)")
    if not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")):
        raise CheckpointError(f"checkpoint error: {ckpt_dir!r} has no metadata.json: not a torch_dist checkpoint "
                              "(or an unfinished one); pick a complete checkpoint directory")
    check_output(ckpt_dir, out_dir, overwrite)
    model_cfg = model_cfg or read_model_config(ckpt_dir)
    # Under torchrun with a layout (parallel.*), each rank loads only its shard from the torch_dist
    # checkpoint and writes its own safetensors files: no rank holds the whole model.
    # the FP8 model only for an FP8 export: a BF16 one takes any shape
    model, state = _build(model_cfg, list(parallel_overrides), torch.bfloat16, "jet" if dtype == "fp8" else "bf16")
    try:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt_dir)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - megatron raises several types; torch's CheckpointException
        # (a truncated .distcp shard) derives from BaseException
        what = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"checkpoint error: {ckpt_dir!r} cannot be loaded ({type(e).__name__}: {what}); a file "
                              "may be truncated or damaged, or model_config.json does not describe it") from None
    model.load_state_dict(loaded["model"])
    _check_finite(model, ckpt_dir, allow_nonfinite)
    refresh_fp8_weights(model, state)
    recipe = FP8Recipe()
    opts = ExportOptions(fp8=dtype == "fp8")
    items = iter_hf_tensors(model, model_cfg, opts)
    if is_rank0():
        items = tqdm(items, desc=f"megatron-to-hf ({dtype})", unit="tensor")
    hf_cfg = model_cfg.to_hf_config()
    writer = DiskTransport(out_dir, hf_cfg, shard_bytes=shard_bytes,
                           quantization_config=recipe.hf_quantization_config(hf_bf16_linears(model, model_cfg, state))
                           if dtype == "fp8" else None,
                           collective=True, record_hashes=False)
    try:
        writer.push(0, items)
    except BaseException:
        if is_rank0():
            shutil.rmtree(out_dir.rstrip("/") + ".tmp", ignore_errors=True)
        raise
    if not is_rank0():
        return out_dir
    gen = model_cfg.generation_config or {"do_sample": True, **model_cfg.special_tokens}  # the source's, unchanged
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=1)
    if tokenizer_dir:
        for fname in os.listdir(tokenizer_dir):
            if fname.startswith(("tokenizer", "special_tokens_map", "vocab", "merges")) or fname.endswith(".model"):
                shutil.copy(os.path.join(tokenizer_dir, fname), out_dir)
    return out_dir
