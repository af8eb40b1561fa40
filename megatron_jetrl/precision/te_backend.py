"""TransformerEngine backend (``precision.backend=te``): Megatron's TE layer spec running TE's
``Float8BlockScaling`` recipe, translated from the ``FP8Recipe`` so the training forward quantizes
exactly as the rollout does, and TE's own FP8 weight bytes + scales exported as they are.

What TE does (read from its source, transformer_engine/common/recipe and
pytorch/tensor/float8_blockwise_tensor.py):

- ``Float8BlockScaling``: E4M3; activations 1x128 (``x_block_scaling_dim=1``), weights 128x128
  (``w_block_scaling_dim=2``), gradients 1x128; scales are powers of two unless
  ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` (read when the recipe class is imported); the power-of-two
  scale is ``2^floor(log2(448/amax))``, i.e. ``scale_inv`` rounded up to a power of two: our ue8m0;
  ``amax_epsilon`` is 0.
- A 2D-scaled weight keeps ``_rowwise_data`` (uint8, [N, K]) and ``_rowwise_scale_inv`` fp32
  [ceil(N/128), roundup(ceil(K/128), 4)]: the inner dimension is padded to 4 for the GEMM; the HF
  ``weight_scale_inv`` is the unpadded [ceil(N/128), ceil(K/128)].

Numerics: the forward (what the rollout reproduces) matches ours exactly when the checks below
pass, with one exception megatron-core does not let us configure: it builds
``Float8BlockScaling(fp8_format=...)`` itself (core/fp8_utils.py), so TE's ``amax_epsilon`` stays 0
where ours is the recipe's 1e-10. That changes only groups whose amax is below 1e-10: all-zero groups
give zero bytes either way (only their unused scale differs), and a group of magnitudes < 1e-10 is
quantized by TE with its true scale instead of ours. TE's backward differs from the emulated/scaled_mm backends in one
place: wgrad quantizes
x^T from high precision in 1x128 groups along tokens, ours re-blocks the saved FP8 activations; that
changes training, not the train/rollout match, so it is allowed and stated.

Nothing here needs TE to be installed; the layer spec (models/builder.py) does.
"""
from __future__ import annotations

import math

import torch

from megatron_jetrl.precision.recipe import FP8Recipe

TE_BLOCK = 128


class TEConfigError(ValueError):
    """A TE setting whose numerics would differ from the rollout's; one line."""


def te_env(recipe: FP8Recipe) -> dict[str, str]:
    """Environment TE must see before ``transformer_engine`` is imported."""
    return {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1" if recipe.scale_fmt == "fp32" else "0"}


def te_transformer_config(recipe: FP8Recipe) -> dict:
    """megatron-core ``TransformerConfig`` fields for the TE spec running this recipe."""
    if not recipe.train_fp8:
        return {}  # bf16 / fp8_rollout: the trainer runs BF16 TE layers
    return {"fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": True, "fp8_dot_product_attention": False,
            "fp8_multi_head_attention": False}


def check_te_numerics(recipe: FP8Recipe, model_cfg, env: dict[str, str]) -> None:
    """Refuse every TE setting whose forward would not equal the rollout's block-FP8 forward."""
    if recipe.group_size != TE_BLOCK or tuple(recipe.weight_block) != (TE_BLOCK, TE_BLOCK):
        raise TEConfigError(f"precision.backend: TE blocks are {TE_BLOCK} and {TE_BLOCK}x{TE_BLOCK}, the recipe has "
                            f"{recipe.group_size} / {recipe.weight_block}; use backend=auto")
    want = te_env(recipe)["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"]
    got = env.get("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", want)  # unset: the builder sets it before importing TE
    if got != want:
        raise TEConfigError(f"precision.scale_fmt: {recipe.scale_fmt} needs NVTE_FP8_BLOCK_SCALING_FP32_SCALES={want} "
                            f"before TE is imported (it is {got}); unset it or set it to {want}")
    if recipe.train_fp8 and recipe.wgrad != "fp8":
        raise TEConfigError("precision.wgrad: TE's blockwise recipe runs wgrad in FP8; set precision.wgrad=fp8 "
                            "or precision.backend=auto")
    if recipe.rollout_fp8 and model_cfg.head_dim % TE_BLOCK:
        # Megatron's fused QKV rows interleave q/k/v per query group; sending TE's bytes as they are
        # means moving whole 128-row blocks into HF's q, k, v order.
        raise TEConfigError(f"precision.backend: TE's FP8 QKV bytes move to HF order only in whole 128-row blocks; "
                            f"model.head_dim={model_cfg.head_dim} is not a multiple of {TE_BLOCK}; use backend=auto")


def te_weight_bytes(weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], HF ``weight_scale_inv`` [ceil(N/128), ceil(K/128)]) of a TE 2D-block-scaled
    weight (a ``Float8BlockwiseQTensor`` parameter), without the GEMM padding of the scales."""
    data, scale = getattr(weight, "_rowwise_data", None), getattr(weight, "_rowwise_scale_inv", None)
    if data is None or scale is None or not getattr(weight, "_is_2D_scaled", True):
        raise TEConfigError("TE weight has no 2D block-scaled rowwise data; run with fp8_param (precision.backend=te sets it)")
    n, k = data.shape
    rows, cols = math.ceil(n / TE_BLOCK), math.ceil(k / TE_BLOCK)
    if scale.shape[0] != rows or scale.shape[1] < cols:
        raise TEConfigError(f"TE weight scale_inv {tuple(scale.shape)} does not cover a [{n}, {k}] weight in 128x128 blocks")
    return data.view(torch.float8_e4m3fn), scale[:, :cols].contiguous()


def block_rows_permute(q: torch.Tensor, s: torch.Tensor, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply a row permutation that moves whole 128-row blocks to FP8 bytes and their block scales
    (exact: no re-quantization); refuses a permutation that splits a block."""
    p = perm.view(-1, TE_BLOCK)
    starts = p[:, 0]
    if not (torch.equal(p - starts[:, None], torch.arange(TE_BLOCK).expand_as(p)) and bool((starts % TE_BLOCK == 0).all())):
        raise TEConfigError("row permutation splits 128-row blocks; TE bytes cannot be reordered exactly")
    return q.index_select(0, perm), s.index_select(0, starts // TE_BLOCK)
