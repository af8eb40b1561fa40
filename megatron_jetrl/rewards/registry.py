"""Reward registry: ``fn(response_text, answer, metadata) -> float`` by name: the built-ins below, and what
``register_reward`` adds (a user's module, imported before the run)."""
from __future__ import annotations

from typing import Callable

from megatron_jetrl.errors import ConfigError
from megatron_jetrl.rewards.math import exact_reward, hash_reward, math_reward

RewardFn = Callable[[str, str, dict], float]
_REGISTRY: dict[str, RewardFn] = {"math": math_reward, "exact": exact_reward, "hash": hash_reward}


def register_reward(name: str):
    def deco(fn: RewardFn) -> RewardFn:
        _REGISTRY[name] = fn
        return fn
    return deco


def get_reward(name: str) -> RewardFn:
    if name not in _REGISTRY:
        raise ConfigError(f"config error: data.reward: unknown reward {name!r}; use one of {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]
