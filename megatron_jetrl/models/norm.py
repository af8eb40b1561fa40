"""The models' RMSNorm: ``torch.nn.RMSNorm`` whose CUDA forward and backward are the one-kernel-per-call
Triton RMSNorm of :mod:`megatron_jetrl.kernels.rmsnorm` (batch-invariant rows: the trainer's forward and the
decoder's step give the same bytes for the same hidden state), and megatron-core's norm builder around it.
CPU keeps torch's ``rms_norm``."""
from __future__ import annotations

import torch

from megatron_jetrl.kernels.rmsnorm import RMSNormFunction


class JetRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with the one-kernel CUDA forward above (see the module docstring)."""

    def eps_for(self, dtype: torch.dtype) -> float:
        """The epsilon torch's RMSNorm uses for ``dtype`` (its own, or the dtype's when None)."""
        return self.eps if self.eps is not None else torch.finfo(dtype).eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.is_cuda and self.weight is not None
                and len(self.normalized_shape) == 1 and x.shape[-1] <= 65536):
            return RMSNormFunction.apply(x, self.weight, self.eps_for(x.dtype))
        return super().forward(x)


class JetNorm:
    """megatron-core's norm builder (``WrappedTorchNorm``'s signature and checks) that builds
    ``JetRMSNorm`` for RMSNorm models and torch's LayerNorm otherwise."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        if config.normalization != "RMSNorm":
            return WrappedTorchNorm(config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "sequence_parallel",
                     "memory_efficient_layer_norm"):
            if getattr(config, flag, False):
                raise ValueError(f"model: {flag} is not supported by the RMSNorm of models/norm.py; turn it off")
        return JetRMSNorm(normalized_shape=hidden_size, eps=eps)
