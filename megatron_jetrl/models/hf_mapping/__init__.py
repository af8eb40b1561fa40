"""Megatron <-> HF parameter names: declarative tables registered by HF ``model_type``.

One table serves loading HF weights into a sharded model, the live weight push to the rollout
engine and the checkpoint converters. A :class:`Rule` names one Megatron parameter (templated by
global ``{layer}`` and ``{expert}``), the HF tensors it is made of, how they fuse, and how the
Megatron tensor is split over tensor-parallel ranks:

- ``copy``: one HF tensor; TP split along ``tp_dim`` (None = replicated).
- ``qkv``: [q_proj; k_proj; v_proj] -> Megatron's fused QKV, per query group g: the q rows of
  g's heads, then g's k rows, then g's v rows (weight or bias). TP shards whole query groups.
- ``gate_up``: [gate_proj; up_proj] -> ``linear_fc1``; each TP rank holds [gate_r; up_r].
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_jetrl.precision.layout import qkv_permutation


@dataclass(frozen=True)
class Rule:
    megatron: str
    """Megatron parameter name, ``{layer}``/``{expert}`` are global indices."""
    hf: tuple[str, ...]
    """HF tensor names this parameter is made of, in fuse order."""
    fuse: str = "copy"
    """copy | qkv | gate_up."""
    tp_dim: Optional[int] = None
    """Split dimension over tensor-parallel ranks (None: replicated)."""
    fp8: bool = False
    """An FP8 linear weight: exported in block FP8 with ``weight_scale_inv``."""

    @property
    def pattern(self) -> re.Pattern:
        return _compile(self.megatron)

    @property
    def is_expert(self) -> bool:
        return "{expert}" in self.megatron


def _compile(template: str) -> re.Pattern:
    rx = re.escape(template).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
    return re.compile(rx + "$")


L = "decoder.layers.{layer}."
H = "model.layers.{layer}."

EMBED = Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), tp_dim=0)
FINAL_NORM = Rule("decoder.final_layernorm.weight", ("model.norm.weight",))
OUTPUT = Rule("output_layer.weight", ("lm_head.weight",), tp_dim=0)
ATTENTION = (
    Rule(L + "input_layernorm.weight", (H + "input_layernorm.weight",)),
    Rule(L + "self_attention.linear_qkv.weight",
         tuple(H + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv", 0, fp8=True),
    Rule(L + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",), tp_dim=1, fp8=True),
    Rule(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",)),
)
QKV_BIAS = (Rule(L + "self_attention.linear_qkv.bias", tuple(H + f"self_attn.{p}_proj.bias" for p in "qkv"),
                 "qkv", 0),)
QK_NORM = (
    Rule(L + "self_attention.q_layernorm.weight", (H + "self_attn.q_norm.weight",)),
    Rule(L + "self_attention.k_layernorm.weight", (H + "self_attn.k_norm.weight",)),
)
DENSE_MLP = (
    Rule(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), "gate_up", 0, fp8=True),
    Rule(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",), tp_dim=1, fp8=True),
)
E = L + "mlp.experts.local_experts.{expert}."
HE = H + "mlp.experts.{expert}."
MOE_MLP = (
    Rule(L + "mlp.router.weight", (H + "mlp.gate.weight",)),
    # Experts are split over EP ranks, not TP (expert tensor parallel = 1).
    Rule(E + "linear_fc1.weight", (HE + "gate_proj.weight", HE + "up_proj.weight"), "gate_up", None, fp8=True),
    Rule(E + "linear_fc2.weight", (HE + "down_proj.weight",), None, fp8=True),
)
# TransformerEngine's layer spec fuses the norms into the next linear (precision.backend=te).
TE_FUSED_NORMS = (
    Rule(L + "self_attention.linear_qkv.layer_norm_weight", (H + "input_layernorm.weight",)),
    Rule(L + "mlp.linear_fc1.layer_norm_weight", (H + "post_attention_layernorm.weight",)),
)
GLOBAL = (EMBED, FINAL_NORM, OUTPUT) + TE_FUSED_NORMS

TABLES: dict[str, tuple[Rule, ...]] = {
    "llama": GLOBAL + ATTENTION + DENSE_MLP,
    "qwen2": GLOBAL + ATTENTION + QKV_BIAS + DENSE_MLP,
    "qwen3": GLOBAL + ATTENTION + QK_NORM + DENSE_MLP,
    "qwen3_moe": GLOBAL + ATTENTION + QK_NORM + MOE_MLP,
}


def table(model_type: str) -> tuple[Rule, ...]:
    if model_type not in TABLES:
        raise ValueError(f"no Megatron<->HF name table for model_type {model_type!r}; "
                         f"supported: {', '.join(TABLES)}")
    return TABLES[model_type]


def match(rules: tuple[Rule, ...], name: str) -> tuple[Rule, dict]:
    """Global Megatron name -> (rule, {"layer": i, "expert": e})."""
    for rule in rules:
        m = rule.pattern.match(name)
        if m:
            return rule, {k: int(v) for k, v in m.groupdict().items()}
    raise KeyError(f"no name-table rule for Megatron parameter {name!r}")


def hf_names(rule: Rule, idx: dict) -> list[str]:
    return [n.format(**idx) for n in rule.hf]


# ---- tensor transforms (dims from the model description) -----------------------------------

def _qkv_split(fused: torch.Tensor, heads_per_group: int, head_dim: int) -> list[torch.Tensor]:
    perm, sizes = qkv_permutation(fused.shape[0], heads_per_group, head_dim)
    return list(fused.index_select(0, perm.to(fused.device)).split(sizes, 0))


def _qkv_fuse(q, k, v, heads_per_group: int, head_dim: int) -> torch.Tensor:
    stacked = torch.cat([q, k, v], 0)
    perm, _ = qkv_permutation(stacked.shape[0], heads_per_group, head_dim)
    return stacked.index_select(0, torch.argsort(perm).to(stacked.device))


def to_megatron_shard(rule: Rule, hf: list[torch.Tensor], tp_rank: int, tp_size: int, model) -> torch.Tensor:
    """HF tensors of one rule -> this TP rank's Megatron tensor. ``model`` is a ModelConfig."""
    if rule.fuse == "qkv":
        fused = _qkv_fuse(*hf, model.num_attention_heads // model.num_key_value_heads, model.head_dim)
        return fused.chunk(tp_size, 0)[tp_rank] if rule.tp_dim is not None else fused
    if rule.fuse == "gate_up":
        if rule.tp_dim is None:
            return torch.cat(hf, 0)
        return torch.cat([t.chunk(tp_size, 0)[tp_rank] for t in hf], 0)
    t = hf[0]
    return t.chunk(tp_size, rule.tp_dim)[tp_rank] if rule.tp_dim is not None else t


def from_megatron_shards(rule: Rule, shards: list[torch.Tensor], model) -> list[torch.Tensor]:
    """All TP ranks' Megatron tensors of one rule (rank order) -> the HF tensors, ``rule.hf`` order."""
    if rule.fuse == "qkv":
        full = torch.cat(shards, 0) if rule.tp_dim is not None else shards[0]
        return _qkv_split(full, model.num_attention_heads // model.num_key_value_heads, model.head_dim)
    if rule.fuse == "gate_up":
        halves = [s.chunk(2, 0) for s in (shards if rule.tp_dim is not None else shards[:1])]
        return [torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)]
    if rule.tp_dim is None:
        return [shards[0]]
    return [torch.cat(shards, rule.tp_dim)]
