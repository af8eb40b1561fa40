"""Reading HF safetensors checkpoints and loading them into a (TP/PP/EP-sharded) Megatron model.

Tensors are read one at a time through ``safe_open`` (memory stays at one tensor plus this rank's
shard). A block-FP8 checkpoint (``weight`` float8 + ``weight_scale_inv``) is dequantized on read.
"""
from __future__ import annotations

import json
import os
import re
from typing import Iterator

import torch

from megatron_jetrl.models import hf_mapping

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


class CheckpointError(ValueError):
    """A missing or inconsistent checkpoint file/tensor; one line naming it and the fix."""


def _get_dequantized(self, name: str) -> torch.Tensor:
    """The tensor, dequantized to float32 when stored in block FP8."""
    t = self.raw(name)
    if t.dtype == torch.float8_e4m3fn:
        from megatron_jetrl.precision.quant import dequantize_blocks

        scale = self.raw(name + "_scale_inv")
        br = -(-t.shape[0] // scale.shape[0])
        bc = -(-t.shape[1] // scale.shape[1])
        t = dequantize_blocks(t, scale.float(), br, bc)
    return t


class TensorDict:
    """An in-memory set of HF-named tensors with the reader interface of ``HFCheckpoint`` (what a
    rollout server receives over a bucket or a broadcast)."""

    def __init__(self, tensors: dict[str, torch.Tensor], origin: str = "update"):
        self.tensors, self.path = tensors, origin

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self):
        return self.tensors.keys()

    def raw(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"checkpoint error: tensor {name!r} missing from the {self.path}; send every tensor")
        return self.tensors[name]

    get = _get_dequantized


class HFCheckpoint:
    """Lazy reader over an HF directory's safetensors (single file or sharded with an index)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint error: {path!r} is not a directory; give an HF model directory")
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"checkpoint error: no *.safetensors in {path!r}; "
                                      "save the model with safetensors (save_pretrained)")
            weight_map = {}
            for fname in files:
                with safe_open(os.path.join(path, fname), "pt") as f:
                    weight_map.update({k: fname for k in f.keys()})
        self.weight_map = weight_map
        self._open = {}
        for fname in set(weight_map.values()):
            full = os.path.join(path, fname)
            if not os.path.isfile(full):
                raise CheckpointError(f"checkpoint error: {fname} listed in the index is missing from {path!r}; "
                                      "copy the complete checkpoint")
            self._open[fname] = safe_open(full, "pt")

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def keys(self):
        return self.weight_map.keys()

    def raw(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise CheckpointError(f"checkpoint error: tensor {name!r} not found in {self.path!r}; "
                                  "the checkpoint does not match model_type/num_layers of config.json")
        return self._open[self.weight_map[name]].get_tensor(name)

    get = _get_dequantized


def global_name(local: str, model, ep_rank: int, experts_per_rank: int) -> str:
    """This rank's parameter name -> the global name (global layer and expert indices)."""
    m = _LAYER.match(local)
    if m:
        layer = model.decoder.layers[int(m.group(1))].layer_number - 1  # layer_number is 1-based, global
        local = f"decoder.layers.{layer}." + local[m.end():]
    e = _EXPERT.search(local)
    if e:
        expert = ep_rank * experts_per_rank + int(e.group(1))
        local = local[:e.start()] + f".mlp.experts.local_experts.{expert}." + local[e.end():]
    return local


def named_global_params(model, model_cfg) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """(local name, global name, parameter) for every parameter of this rank's model."""
    from megatron.core import parallel_state

    ep_rank = parallel_state.get_expert_model_parallel_rank()
    ep = parallel_state.get_expert_model_parallel_world_size()
    per_rank = (model_cfg.num_experts // ep) if model_cfg.num_experts else 0
    for local, p in model.named_parameters():
        yield local, global_name(local, model, ep_rank, per_rank), p


@torch.no_grad()
def load_hf_weights(model, model_cfg, hf_dir, fp8_state=None, progress: bool = False) -> int:
    """Load an HF checkpoint (a directory, or an ``HFCheckpoint``/``TensorDict``) into this rank's
    shard of ``model``; returns tensors loaded.

    Block-FP8 tensors are dequantized into the parameters; in addition, when the model runs FP8
    rollout (``fp8_state``) and the source carries a linear's FP8 bytes, those exact bytes and
    scales are installed in its FP8 weight cache (world size 1: a rollout server), so the engine
    runs what the trainer sent, not a re-quantization of it."""
    from megatron.core import parallel_state

    ckpt = hf_dir if hasattr(hf_dir, "raw") else HFCheckpoint(hf_dir)
    rules = hf_mapping.table(model_cfg.model_type)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    modules = dict(model.named_modules())
    n, exact = 0, []
    params = named_global_params(model, model_cfg)
    if progress:
        from tqdm import tqdm

        params = tqdm(list(params), desc="load HF weights", unit="tensor")
    for local, name, param in params:
        rule, idx = hf_mapping.match(rules, name)
        names = hf_mapping.hf_names(rule, idx)
        if rule is hf_mapping.OUTPUT and model_cfg.tie_word_embeddings and names[0] not in ckpt:
            names = list(hf_mapping.EMBED.hf)  # tied: the last PP stage keeps its own copy
        shard = hf_mapping.to_megatron_shard(rule, [ckpt.get(h) for h in names], tp_rank, tp, model_cfg)
        if shard.shape != param.shape:
            raise CheckpointError(
                f"checkpoint error: {'+'.join(names)} gives shape {tuple(shard.shape)} for {name} but the "
                f"model expects {tuple(param.shape)}; config.json and the weights disagree")
        param.copy_(shard.to(param.dtype))
        n += 1
        module = modules.get(local.rsplit(".", 1)[0])
        if (fp8_state is not None and fp8_state.recipe.rollout_fp8 and tp == 1 and rule.fp8
                and getattr(module, "fp8_cache", None) is not None
                and all(ckpt.raw(h).dtype == torch.float8_e4m3fn for h in names)):
            exact.append((module, [(ckpt.raw(h), ckpt.raw(h[: -len(".weight")] + ".weight_scale_inv")) for h in names]))
    if fp8_state is not None:
        fp8_state.bump()
        for module, parts in exact:
            module.fp8_cache.install(parts, fp8_state, module.weight.device)
    return n
