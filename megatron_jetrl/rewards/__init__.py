"""Verifiable rewards, registered by name (``data.reward``)."""
from megatron_jetrl.rewards.registry import get_reward, register_reward

__all__ = ["get_reward", "register_reward"]
