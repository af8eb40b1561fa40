"""RL math as pure tensor functions (no config objects, no model, no process groups).

Shapes: per-token tensors are [B, T] over response positions with a 0/1 ``mask`` [B, T]; per-
sequence tensors are [B]. Log-probabilities are natural logs.
"""
from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO: reward minus its group's mean (optionally divided by the group's std).
    ``rewards`` [B] ordered group by group (B = groups * group_size). Returns [B]."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (r.std(dim=1, unbiased=True, keepdim=True) + eps) if group_size > 1 else adv
    return adv.view(-1)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to ``max_len - buffer`` tokens, then falling
    linearly to ``-factor`` at ``max_len``. ``lengths`` [B] response lengths -> [B]."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float)
    over = (lengths.float() - (max_len - buffer)) / buffer
    return -factor * over.clamp(0.0, 1.0)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO's dynamic sampling filter: the groups whose rewards are not all equal (an all-equal group has zero
    advantage everywhere and no gradient). ``rewards`` [B] group by group -> bool [B / group_size]."""
    r = rewards.float().view(-1, group_size)
    return (r != r[:, :1]).any(dim=1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimators on samples from pi: k1 = log(pi/ref),
    k3 = ref/pi - 1 - log(ref/pi) (Schulman; unbiased, always >= 0)."""
    log_ratio = ref_logp - logp
    if kind == "k1":
        return -log_ratio
    if kind == "k3":
        return torch.exp(log_ratio) - 1 - log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; use k1 or k3")


def truncated_is_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (fp8_rollout mode): w = min(pi_old_train / pi_rollout, C),
    correcting for the sampler's different numbers; no gradient flows through it."""
    return torch.exp(old_logp - rollout_logp).clamp(max=cap).detach()


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """``token_mean`` (DAPO: every token weighs the same) or ``seq_mean`` (mean per sequence,
    then over sequences). Returns a scalar."""
    if mode == "token_mean":
        return masked_mean(per_token, mask)
    if mode == "seq_mean":
        return masked_mean(per_token, mask, dim=1).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}; use token_mean or seq_mean")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """PPO-clip per-token loss (to be aggregated): -min(r A, clip(r, 1-lo, 1+hi) A), r = pi/pi_old,
    times optional importance weights. ``advantages`` [B] broadcasts over tokens.
    Returns (per-token loss [B, T], stats)."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        loss = loss * is_weights
    with torch.no_grad():
        clip_frac = masked_mean((clipped < unclipped).float(), mask)
    return loss, {"clip_fraction": clip_frac, "ratio_mean": masked_mean(ratio.detach(), mask)}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits) over the last dim (full vocabulary)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def mismatch_metrics(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """Train-rollout mismatch on the sampled tokens: mean/max |logp_train - logp_rollout|,
    k3 KL(rollout || train) and importance-weight statistics (w = p_train / p_rollout)."""
    m = mask.bool()
    diff = (train_logp - rollout_logp).float()
    absd = diff.abs()[m]
    w = torch.exp(diff)[m]
    kl = kl_estimate(rollout_logp.float(), train_logp.float(), "k3")[m]
    if absd.numel() == 0:
        zero = torch.zeros(())
        return {k: zero for k in ("mismatch_abs_mean", "mismatch_abs_max", "mismatch_k3_kl",
                                  "is_weight_mean", "is_weight_max", "is_weight_min")}
    return {
        "mismatch_abs_mean": absd.mean(),
        "mismatch_abs_max": absd.max(),
        "mismatch_k3_kl": kl.mean(),
        "is_weight_mean": w.mean(),
        "is_weight_max": w.max(),
        "is_weight_min": w.min(),
    }
