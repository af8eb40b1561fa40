"""Megatron<->HF name tables, one per HF model_type."""
