"""Gather a (TP/PP/EP-sharded) Megatron model into HF-named tensors, streamed.

Every rank walks its parameters in the same order. A TP-split parameter is all-gathered over its
TP group (every TP rank takes part in the collective); the *exporter* of a parameter then renames
and splits it into HF tensors with the name tables:

- dense parameters: the rank with TP rank 0 and data-parallel rank 0 of each pipeline stage
  (each stage exports its own layers under global layer indices);
- experts: expert-TP rank 0 and expert-data-parallel rank 0 of each EP rank (its experts under
  global expert ids).

FP8 (``fp8=True``): the FP8 linear weights go out as the trainer's cached FP8 bytes and
``weight_scale_inv`` of each logical sub-matrix (q, k, v, gate, up, ...), gathered over TP and
concatenated: no dequantize/requantize round trip. Shards are 128-aligned (checked when the model
is built), so the result is byte-identical to quantizing the full HF tensor. Everything else
(norms, embeddings, lm_head, router) goes as BF16 (or the parameter dtype with ``dtype=None``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_jetrl.memory import is_released
from megatron_jetrl.models import hf_mapping
from megatron_jetrl.models.hf_io import named_global_params


@dataclass
class ExportOptions:
    fp8: bool = False
    """Send FP8 linear weights as cached block-FP8 bytes + weight_scale_inv."""
    dtype: Optional[torch.dtype] = torch.bfloat16
    """dtype of the non-FP8 tensors (None: keep the parameter dtype)."""


def _tp_gather(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
    """All TP ranks' shards of ``t`` in rank order (a collective on the TP group)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return [t]
    is_fp8 = t.dtype == torch.float8_e4m3fn
    src = (t.view(torch.uint8) if is_fp8 else t).contiguous()
    out = [torch.empty_like(src) for _ in range(tp)]
    dist.all_gather(out, src, group=parallel_state.get_tensor_model_parallel_group())
    return [o.view(torch.float8_e4m3fn) if is_fp8 else o for o in out]


def _is_exporter(expert: bool) -> bool:
    from megatron.core import parallel_state

    if expert:  # experts are laid out by expert-TP (=1 here) x EP x expert-DP, not by the dense TP
        return (parallel_state.get_expert_tensor_parallel_rank() == 0
                and parallel_state.get_expert_data_parallel_rank() == 0)
    return parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0


def _te_parts(name: str, module, param) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A TE FP8 parameter's bytes and scales as the (fp8, scale_inv) of each logical sub-matrix in
    rollout (HF) row order: whole 128-row blocks moved, nothing re-quantized."""
    from megatron_jetrl.precision.linear import weight_layout
    from megatron_jetrl.precision.te_backend import TE_BLOCK, block_rows_permute, te_weight_bytes

    q, s = te_weight_bytes(param)
    sub, perm = weight_layout(name, module, module.config)
    if perm is not None:
        q, s = block_rows_permute(q, s, perm.to(q.device))
    out, row = [], 0
    for n in sub:
        out.append((q[row:row + n], s[row // TE_BLOCK:(row + n) // TE_BLOCK]))
        row += n
    return out


def iter_hf_tensors(model, model_cfg, opts: ExportOptions) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for this rank's share of the export (nothing on non-exporters).
    Must be iterated on every rank of the model (it runs TP collectives)."""
    rules = hf_mapping.table(model_cfg.model_type)
    modules = dict(model.named_modules())
    for local, name, param in named_global_params(model, model_cfg):
        rule, idx = hf_mapping.match(rules, name)
        if rule is hf_mapping.OUTPUT and model_cfg.tie_word_embeddings:
            continue  # tied: lm_head is the embedding (HF omits it)
        names = hf_mapping.hf_names(rule, idx)
        tp_dim = None if rule.is_expert else rule.tp_dim
        module = modules[local.rsplit(".", 1)[0]]
        parts = None
        if opts.fp8 and rule.fp8 and getattr(module, "fp8_cache", None) is not None:
            module.fp8_weight()  # current version (re-quantizes only if stale)
            parts = module.fp8_cache.parts()
        elif opts.fp8 and rule.fp8 and hasattr(param, "_rowwise_data"):
            parts = _te_parts(local.rsplit(".", 1)[0], module, param)  # TE's own FP8 bytes + scales
        if parts is not None:
            cat_dim = 0 if tp_dim in (0, None) else 1
            gathered = [(_tp_gather(q, cat_dim) if tp_dim is not None else [q],
                         _tp_gather(s, cat_dim) if tp_dim is not None else [s]) for q, s in parts]
            if _is_exporter(rule.is_expert):
                for hf_name, (qs, ss) in zip(names, gathered):
                    base = hf_name[: -len(".weight")]
                    yield hf_name, torch.cat(qs, cat_dim)
                    yield base + ".weight_scale_inv", torch.cat(ss, cat_dim)
            continue
        if is_released(param):
            raise RuntimeError(f"export: the BF16 weight {name} is released (precision.release_bf16_weights); "
                               "export FP8 weights, or call Actor.restore_weights() first")
        shards = _tp_gather(param.detach(), tp_dim) if tp_dim is not None else [param.detach()]
        if _is_exporter(rule.is_expert):
            for hf_name, t in zip(names, hf_mapping.from_megatron_shards(rule, shards, model_cfg)):
                yield hf_name, (t if opts.dtype is None else t.to(opts.dtype)).contiguous()


def hf_bf16_linears(model, model_cfg, state) -> list[str]:
    """HF module paths (``model.layers.0.self_attn.q_proj``) of the linears ``attach_fp8`` left in BF16, over every
    rank (pipeline stages hold different layers): what the FP8 export lists in ``modules_to_not_convert``."""
    rules = hf_mapping.table(model_cfg.model_type)
    bf16 = set(state.bf16_linears)
    out = set()
    for local, name, _ in named_global_params(model, model_cfg):
        rule, idx = hf_mapping.match(rules, name)
        if rule.fp8 and local.rsplit(".", 1)[0] in bf16:
            out.update(n.removesuffix(".weight") for n in hf_mapping.hf_names(rule, idx))
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, sorted(out))
        out = set().union(*every)
    return sorted(out)


def collect_hf_state_dict(model, model_cfg, opts: ExportOptions, dst: int = 0) -> Optional[dict]:
    """The whole HF state dict on global rank ``dst`` (None elsewhere); CPU tensors. For tests and
    small models: the streaming transports never hold the whole model."""
    mine = {k: v.cpu() for k, v in iter_hf_tensors(model, model_cfg, opts)}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    # FP8 tensors travel as uint8 views (megatron-core's object unpickler rejects float8 storages)
    wire = {k: (v.view(torch.uint8), True) if v.dtype == torch.float8_e4m3fn else (v, False) for k, v in mine.items()}
    parts = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(wire, parts, dst=dst)
    if dist.get_rank() != dst:
        return None
    out = {}
    for p in parts:
        out.update({k: v.view(torch.float8_e4m3fn) if is_fp8 else v for k, (v, is_fp8) in p.items()})
    return out
