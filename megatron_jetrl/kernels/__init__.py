"""The GPU kernels, below ``precision/`` and ``models/``: Triton quantizers and small-M GEMM, the RMSNorm, RoPE,
decode-attention, sampling and fused-logprob kernels, and the cuBLASLt and DeepGEMM bindings. Each states the
bytes it must produce (the torch statement it equals) where it is defined; the CPU tests run the Triton ones
under Triton's interpreter."""
