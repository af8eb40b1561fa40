"""Temperature sampling of one token per row in one Triton kernel (CUDA; the rollout's default sampler).

The eager sampler (``base.sample_next``: fp32 copy of the logits, scale, log-softmax, softmax,
multinomial, gather) is ~12 kernels per decode step that each sweep the [batch, vocab] logits
(33 MB in fp32 at batch 64 and Llama-3's 128256-token vocabulary), outside the decode step's CUDA
graph. Here one program per row reads the bf16 logits once and keeps three running values:
the max and the rescaled sum of exp(x/T) (for the logprob, as log_softmax computes it) and the
Gumbel-max winner argmax(x/T + G) with G = -log(-log(U)), U uniform from Philox (``tl.rand``):
an exact draw from softmax(x/T), as multinomial's is, from a different random stream. The stream
is fixed by ``seed`` (one per decode step, from the engine's generator), so a rollout is
reproducible. Plain temperature sampling only (top-k/top-p and greedy use ``sample_next``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_kernel(x_ptr, ids_ptr, lp_ptr, V, stride, temperature, seed, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride
    cols0 = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + cols0
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) / temperature
        new_m = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
        m = new_m
        u = tl.rand(seed, row * V + cols)
        g = tl.where(mask, x - tl.log(-tl.log(u)), float("-inf"))
        gmax = tl.max(g, 0)
        i = tl.argmax(g, 0).to(tl.int32) + start
        best_i = tl.where(gmax > best, i, best_i)
        best = tl.maximum(best, gmax)
    xb = tl.load(base + best_i).to(tl.float32) / temperature
    tl.store(ids_ptr + row, best_i.to(tl.int64))
    tl.store(lp_ptr + row, xb - m - tl.log(s))


def fused_sample(logits: torch.Tensor, temperature: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [B, V]`` -> (ids [B] int64, logprobs [B] fp32 of the ids under softmax(logits / T))."""
    if logits.dim() != 2 or temperature <= 0:
        raise ValueError(f"fused_sample: logits [B, V] and a positive temperature expected, got "
                         f"{tuple(logits.shape)} and {temperature}")
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    B, V = x.shape
    if B * V >= 2**31:
        raise ValueError(f"fused_sample: {B} x {V} logits exceed the kernel's int32 random-stream offsets")
    ids = torch.empty(B, dtype=torch.long, device=x.device)
    lp = torch.empty(B, dtype=torch.float32, device=x.device)
    if B:
        _sample_kernel[(B,)](x, ids, lp, V, x.stride(0), float(temperature), seed & 0x7FFFFFFF,
                             BLOCK=min(4096, triton.next_power_of_2(V)), num_warps=8)
    return ids, lp
