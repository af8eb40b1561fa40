"""Buffers and layouts the kernels and their torch references share: the quantizers' output buffers, 2-D row
views, column-major scales, and the contraction multiple cuBLAS's block-scaled GEMMs take.
"""
from __future__ import annotations

import torch
import triton

from megatron_jetrl.precision.recipe import FP8Recipe


def rows_2d(t: torch.Tensor) -> torch.Tensor:
    """``t [..., C]`` as a 2-D [rows, C] tensor with unit column stride (the layout the kernels index)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def wide_offsets(*tensors: torch.Tensor) -> bool:
    """Whether an element offset into any of ``tensors`` can reach 2^31 (the largest is the sum of (size - 1) x stride):
    the Triton kernels then index in 64 bits (e.g. fc1's [tokens, 2 x 28672] output from 37,450 tokens, a 70B
    micro-batch of long responses) and in 32 bits below it (the code the benchmarks measured)."""
    return any(t.numel() and sum((n - 1) * st for n, st in zip(t.shape, t.stride())) >= 2 ** 31 for t in tensors)


def act_outputs(M: int, K: int, recipe: FP8Recipe, device, scale_col_major: bool):
    """Empty (q [M, K], scale_inv [M, groups]) for a 1xG quantizer; column-major scales (strides
    (1, M)) when asked, the form ``scaled_mm`` wants."""
    ng = triton.cdiv(K, recipe.group_size)
    q = torch.empty((M, K), dtype=recipe.dtype, device=device)
    s = (torch.empty((ng, M), dtype=torch.float32, device=device).t() if scale_col_major
         else torch.empty((M, ng), dtype=torch.float32, device=device))
    return q, s, ng


def transposed_outputs(C: int, R: int, scale_rows: int, recipe: FP8Recipe, device, pad_to: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty x^T FP8 [C, Rp] and scales [scale_rows, Rp/G] for a quantizer along R (``quantize_transposed``'s
    outputs), with Rp = R rounded up to ``pad_to`` (a multiple of G; 0: R). The quantizer writes [:, :R] and the
    first ceil(R/G) scale columns (row strides Rp and Rp/G); the padding is zero bytes with scale 1 (the wgrad
    GEMM adds nothing from it)."""
    G = recipe.group_size
    if pad_to and pad_to % G:
        raise ValueError(f"pad_to={pad_to}: must be a multiple of the group size {G}")
    Rp = -(-R // pad_to) * pad_to if pad_to else R
    q = torch.empty((C, Rp), dtype=recipe.dtype, device=device)
    s = torch.empty((scale_rows, -(-Rp // G)), dtype=torch.float32, device=device)
    if Rp > R:
        q.view(torch.uint8)[:, R:].zero_()
        s[:, -(-R // G):].fill_(1.0)
    return q, s


def col_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with column-major strides (a view when it already is one)."""
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def contraction_multiple(group: int = 128) -> int:
    """The contraction length cuBLAS's block-scaled GEMMs take as is: whole groups, a group count that is a
    multiple of 4 (seen on the H200, torch 2.11: scale shapes are checked as [round_up(Kc/G, 4), ...]). The one
    statement of the rule for :func:`precision.gemm._scaled_mm`'s padding, ``gemm.wgrad_token_pad`` and the cuBLASLt
    accumulation's ``shapes_ok``."""
    return 4 * group
