"""Reward registry: ``fn(response_text, answer, metadata) -> float`` by name."""
from __future__ import annotations

from typing import Callable

RewardFn = Callable[[str, str, dict], float]
_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str):
    def deco(fn: RewardFn) -> RewardFn:
        _REGISTRY[name] = fn
        return fn
    return deco


def get_reward(name: str) -> RewardFn:
    from megatron_jetrl.rewards import math as _math  # noqa: F401  (registers the built-ins)

    if name not in _REGISTRY:
        from megatron_jetrl.config import ConfigError

        raise ConfigError(f"config error: data.reward: unknown reward {name!r}; use one of {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]
