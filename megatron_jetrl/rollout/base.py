"""The rollout-engine interface: the in-process engine and the SGLang fleet both implement it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Generation:
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    """log p(token) under softmax(logits / temperature) of the sampler (before top-p/top-k)."""
    finish_reason: str = "length"
    weight_version: int = 0
    meta: dict = field(default_factory=dict)


class RolloutEngine(Protocol):
    """What the scheduler and the hand-over use of an engine. Two implement it: ``rollout.local.LocalEngine``
    (in process, on the trainer's own model and FP8 cache) and ``rollout.sglang.RolloutFleet`` (SGLang
    servers or ``jetrl serve``)."""

    remote: bool
    """False: the engine runs on the trainer's model in this process (the weights are already there; a
    hand-over only bumps the version, ``update_weights``). True: a fleet of servers (the weights are pushed,
    ``push_weights``; GPU memory is released and resumed around the phases)."""
    weight_version: int
    metrics: dict
    """The last call's health and transport numbers (logged with the step)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, *args, **kwargs) -> list[Generation]: ...

    def update_weights(self, version: int, hashes: dict[str, str] | None = None) -> dict: ...

    def push_weights(self, version: int, items, check_parity: bool = True, disk_push=None) -> dict: ...

    def heal(self) -> int:
        """Restart what is down (a fleet's dead or hung servers; nothing in process); returns how many."""
        ...

    def release_memory(self, tags: list[str] | None = None) -> None: ...

    def resume_memory(self, tags: list[str] | None = None) -> None: ...

    def shutdown(self) -> None: ...


def fused_sampling(logits: torch.Tensor, params: SamplingParams) -> bool:
    """Whether ``sample_next`` takes the one-kernel Triton sampler (``kernels/sample.py``):
    CUDA, plain temperature sampling (no top-k/top-p)."""
    return (logits.is_cuda and params.temperature > 0 and not (params.top_k and params.top_k < logits.shape[-1])
            and params.top_p >= 1.0)


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                seed: int | None = None, row_seeds: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [B, V]; returns (ids [B], logprobs [B]). All on the
    logits' device, no host sync. Greedy when temperature == 0. With a ``seed`` (a new one per
    step) and ``fused_sampling``, one Triton kernel draws from the same distribution (Gumbel-max on
    a Philox stream fixed by the seed) instead of ~12 eager kernels with ``multinomial``. With
    ``row_seeds`` [B] and ``positions`` [B] (the position of each row's last token), each row draws
    with SGLang's seeded rule (``rollout/seeded.py``): its token depends on its seed and position only. ``exact``
    (``precision.exact``, temperature > 0): the token's logprob is ``kernels.fused_logp.label_logp``, the bits the
    trainer's logprob has for the same logits row, whichever way the token was drawn."""
    if row_seeds is None and seed is not None and fused_sampling(logits, params):
        from megatron_jetrl.kernels.sample import fused_sample

        ids, lp = fused_sample(logits, params.temperature, seed)
        return ids, _exact_logp(logits, ids, params) if exact else lp
    ids, lp = _sample_eager(logits, params, generator, row_seeds, positions)
    return ids, _exact_logp(logits, ids, params) if exact and params.temperature > 0 else lp


def _exact_logp(logits: torch.Tensor, ids: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from megatron_jetrl.kernels.fused_logp import label_logp

    return label_logp(logits, ids, params.temperature)


def _sample_eager(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                  row_seeds: torch.Tensor | None, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_next``'s eager path: greedy, top-k / top-p, SGLang's seeded draw or ``multinomial``."""
    logits = logits.float()
    if params.temperature == 0:
        ids = logits.argmax(-1)
        return ids, torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    logprobs = torch.log_softmax(scaled, -1)
    filtered = scaled
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, -1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = filtered.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > params.top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_logits)
    if row_seeds is not None:
        from megatron_jetrl.rollout.seeded import seeded_sample

        ids = seeded_sample(torch.log_softmax(filtered, -1), row_seeds, positions)
    else:
        probs = filtered.softmax(-1)
        try:
            ids = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        except RuntimeError:
            if bool(torch.isfinite(probs).all()):
                raise
            from megatron_jetrl.errors import TrainingError

            raise TrainingError("rollout: the policy's next-token probabilities are not finite (the weights "
                                "diverged); lower algo.lr and resume from the newest checkpoint") from None
    return ids, logprobs.gather(-1, ids[:, None]).squeeze(-1)
