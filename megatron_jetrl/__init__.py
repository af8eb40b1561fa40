"""megatron_jetrl: on-policy FP8 RL post-training (Jet-RL)."""
__version__ = "0.1.0"
