"""``FP8Recipe``: the single source of truth for the FP8 numbers (the numerics contract,
docs/architecture.md). Training, rollout, weight export, checkpoint conversion, the SGLang launch
arguments, the HF ``quantization_config`` and the TransformerEngine settings are all derived
from one instance; nothing else re-states these numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

# Module names (last component of a Megatron parameter's module path) by precision. The FP8
# set is every linear inside the transformer blocks; everything else stays in BF16.
FP8_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
BF16_MODULES = ("embedding", "output_layer", "input_layernorm", "pre_mlp_layernorm",
                "q_layernorm", "k_layernorm", "final_layernorm", "core_attention", "router")
# HF names that stay unquantized in an FP8 checkpoint (quantization_config.modules_to_not_convert).
HF_MODULES_NOT_CONVERTED = ("lm_head", "embed_tokens", "norm", "mlp.gate")
# The FP8 KV cache's scales are powers of two (``FP8Recipe.kv_cache``).
KV_SCALE_FMT = "ue8m0"


def kv_cache_bytes(positions: int, *, layers: int, kv_heads: int, head_dim: int, fp8: bool, elem_bytes: int = 2) -> int:
    """Bytes of K and V for ``positions`` tokens (rows x positions) over ``layers`` layers of ``kv_heads`` heads: the
    FP8 cache (``FP8Recipe.kv_cache``) holds per token and KV head ``head_dim`` E4M3 bytes and one fp32 scale, for K
    and for V; a BF16 cache ``head_dim x elem_bytes`` per head."""
    per_head = head_dim + 4 if fp8 else head_dim * elem_bytes
    return 2 * positions * layers * kv_heads * per_head


@dataclass(frozen=True, kw_only=True)
class FP8Recipe:
    """Block-scaled E4M3 FP8: 128x128 weight blocks, 1x128 activation/gradient groups."""

    mode: Literal["bf16", "fp8_rollout", "jet"] = "jet"
    """Precision flow (see ``PrecisionConfig.mode``)."""
    scale_fmt: Literal["fp32", "ue8m0"] = "fp32"
    """fp32: ``scale_inv = amax * fp32(1/448)``; ue8m0: ``2^ceil(log2(amax * fp32(1/448)))``."""
    wgrad: Literal["fp8", "bf16"] = "fp8"
    """Weight-gradient GEMM precision in jet mode."""
    weight_block: tuple[int, int] = (128, 128)
    """Weight block [rows (N), cols (K)]."""
    group_size: int = 128
    """Activation and gradient group length along the contraction dimension."""
    amax_eps: float = 1e-10
    """Lower bound of a block's amax (an all-zero block gets a tiny, finite scale)."""
    exact: bool = False
    """Exact on-policy mode (see ``PrecisionConfig.exact``): the rollout's logits are the bits of the trainer's forward
    (on CUDA: batch-invariant GEMMs, ``kernels/exact_gemm.py``, and one causal attention kernel whose key order
    depends only on a query's position, ``kernels/exact_attn.py``; on the CPU emulation: the trainer's forward itself
    over one padded shape), and both sides take log-probabilities with one statement, so every sampled token's
    logprob equals the trainer's bit for bit."""
    kv_cache: Literal["bf16", "fp8"] = "bf16"
    """Attention keys and values (see ``PrecisionConfig.kv_cache``). ``fp8``: K (after RoPE) and V are quantized
    to E4M3 per token and KV head, one group of ``head_dim`` values, with a power-of-two scale (the ue8m0 rule
    above, whatever ``scale_fmt`` says: ``KV_SCALE_FMT``). The rollout stores those bytes and scales in its KV
    cache; the trainer's attention reads their dequantized values, ``e4m3 * 2^e``, which BF16 holds exactly
    (3 mantissa bits in 7). A power of two also makes folding the scales into the attention exact: a kernel that
    multiplies ``q . k8`` by the key's scale, and the softmax weights by the value's, computes with the very
    values the trainer's attention sees."""

    fmt: str = "e4m3"
    dtype: torch.dtype = torch.float8_e4m3fn
    fp8_max: float = 448.0

    def __post_init__(self):
        if self.mode not in ("bf16", "fp8_rollout", "jet"):
            raise ValueError(f"FP8Recipe.mode={self.mode!r}: use bf16, fp8_rollout or jet")
        if self.scale_fmt not in ("fp32", "ue8m0"):
            raise ValueError(f"FP8Recipe.scale_fmt={self.scale_fmt!r}: use fp32 or ue8m0")
        if self.kv_cache not in ("bf16", "fp8"):
            raise ValueError(f"FP8Recipe.kv_cache={self.kv_cache!r}: use bf16 or fp8")
        if self.kv_cache == "fp8" and not self.rollout_fp8:
            raise ValueError("FP8Recipe: kv_cache=fp8 needs mode jet (unified) or fp8_rollout (off-policy baseline)")
        if self.weight_block != (self.group_size, self.group_size):
            raise ValueError("FP8Recipe: weight_block must be (group_size, group_size): the "
                             "backward reuses the forward weight blocks along both dimensions")

    @classmethod
    def from_config(cls, precision) -> "FP8Recipe":
        """From a ``config.PrecisionConfig``."""
        return cls(mode=precision.mode, scale_fmt=precision.scale_fmt, wgrad=precision.wgrad,
                   kv_cache=precision.kv_cache, exact=precision.exact)

    # -- which side runs FP8 ------------------------------------------------------------------
    @property
    def train_fp8(self) -> bool:
        """The training forward runs the FP8 linears (jet mode only)."""
        return self.mode == "jet"

    @property
    def rollout_fp8(self) -> bool:
        """Rollout runs block FP8 (jet and fp8_rollout)."""
        return self.mode in ("jet", "fp8_rollout")

    @property
    def train_kv_fp8(self) -> bool:
        """The training forward's attention reads FP8-rounded K/V (jet with ``kv_cache=fp8``: the unified cache)."""
        return self.kv_cache == "fp8" and self.train_fp8

    @property
    def rollout_kv_fp8(self) -> bool:
        """The rollout's KV cache holds E4M3 K/V (``kv_cache=fp8``, jet or fp8_rollout)."""
        return self.kv_cache == "fp8" and self.rollout_fp8

    @staticmethod
    def is_fp8_module(name: str) -> bool:
        """Whether the Megatron module named ``name`` (dotted path) is an FP8 linear."""
        return name.rsplit(".", 1)[-1] in FP8_MODULES

    # -- derived settings for other systems ------------------------------------------------------
    def hf_quantization_config(self, bf16_linears: tuple[str, ...] | list[str] = ()) -> dict:
        """HF ``config.json`` ``quantization_config`` of the block-FP8 format (DeepSeek-V3 style). ``bf16_linears``:
        HF module paths of linears that stay BF16 (every shard of a fused one: SGLang's ``is_layer_skipped``)."""
        cfg = {
            "quant_method": "fp8",
            "fmt": self.fmt,
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.weight_block),
            "modules_to_not_convert": list(HF_MODULES_NOT_CONVERTED) + list(bf16_linears),
        }
        if self.scale_fmt == "ue8m0":
            cfg["scale_fmt"] = "ue8m0"
        return cfg

    def sglang_args(self) -> dict:
        """SGLang ``ServerArgs`` fields that make a server run this recipe. The block size and
        scale format travel in the model's config.json (``hf_quantization_config``)."""
        if not self.rollout_fp8:
            return {"dtype": "bfloat16"}
        return {"dtype": "bfloat16", "quantization": "fp8"}

    def sglang_tp_problem(self, *, heads: int, kv_heads: int, head_dim: int, ffn: int, tp: int) -> str | None:
        """Why an SGLang 0.5.23 server of tensor-parallel size ``tp`` refuses this model, or None.
        SGLang divides heads, KV heads (replicated when ``tp`` exceeds them) and the FFN width over TP;
        with block FP8 (``layers/quantization/fp8.py: validate_block_quant_shapes``) every sub-matrix of a
        fused q/k/v or gate/up shard, and every row-parallel input shard (o_proj, down_proj; tp > 1), is
        a whole number of ``weight_block`` rows/columns."""
        if heads % tp or ffn % tp or (kv_heads % tp if tp <= kv_heads else tp % kv_heads):
            return f"TP={tp} does not divide {heads} heads, {kv_heads} KV heads and FFN width {ffn}"
        if not self.rollout_fp8:
            return None
        bn, bk = self.weight_block
        kv_rows = max(1, kv_heads // tp) * head_dim
        sizes = {"q rows": heads // tp * head_dim, "k/v rows": kv_rows, "gate/up rows": ffn // tp}
        if tp > 1:
            sizes.update({"o_proj input": heads * head_dim // tp, "down_proj input": ffn // tp})
        bad = [f"{k} {v}" for k, v in sizes.items() if v % (bk if "input" in k else bn)]
        return f"TP={tp} gives per-rank {', '.join(bad)}, not multiples of the {bn}-wide FP8 block" if bad else None

    def te_settings(self) -> dict:
        """TransformerEngine settings that reproduce this recipe (``precision.backend=te``)."""
        return {
            "fp8": "e4m3",
            "fp8_recipe": "blockwise",
            "env": {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1" if self.scale_fmt == "fp32" else "0"},
        }
