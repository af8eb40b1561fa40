"""Row layouts of fused weights, shared by the FP8 weight cache and the HF name tables."""
from __future__ import annotations

import torch


def qkv_permutation(rows: int, heads_per_group: int, head_dim: int) -> tuple[torch.Tensor, list[int]]:
    """Row order of Megatron's fused QKV (per query group g: g's q rows, its k rows, its v rows)
    -> [q; k; v] (HF / SGLang ``qkv_proj`` order): ``fused[perm]`` is [q; k; v], with the q, k, v
    row counts returned alongside. The one statement of this layout: the HF name tables
    (models/hf_mapping) and the FP8 weight cache (precision/linear.py) both use it."""
    group = (heads_per_group + 2) * head_dim
    groups = rows // group
    idx = torch.arange(rows).view(groups, group)
    qd = heads_per_group * head_dim
    perm = torch.cat([idx[:, :qd].reshape(-1), idx[:, qd:qd + head_dim].reshape(-1),
                      idx[:, qd + head_dim:].reshape(-1)])
    return perm, [groups * qd, groups * head_dim, groups * head_dim]
