"""megatron-core models built from an HF-style description (``config.ModelConfig``)."""
