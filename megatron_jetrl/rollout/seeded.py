"""Per-row seeded sampling, SGLang 0.5.23's rule (``layers/sampler.py: multinomial_with_seed`` with
``kernels/ops/sampling/murmur_hash.py``), so a row's draw depends on its own seed and position only,
never on the rest of the batch.

For row ``b`` with seed ``s_b`` sampling the token after position ``p_b`` (the position of the last
token fed, ``len(prompt) - 1 + t`` for the t-th new token), over columns ``v``:

    u[b, v] = murmur3_32(s_b as two little-endian 32-bit words, p_b, v) / (2**32 - 1)     (float64)
    g[b, v] = -log(-clamp(log u, max=-2**-32))                                            (Gumbel noise)
    token_b = argmax_v (logprob[b, v] + g[b, v])                                          (float64)

which is an exact draw from ``softmax(logprob[b])``. ``jetrl serve`` samples with it whenever a
request carries ``sampling_seed``; tests check it against SGLang's own kernel and sampler.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 ``x`` in [0, 2**32): two 16-bit halves, so no product leaves int64."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c & 0xFFFF) << 16)) & _M32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One MurmurHash3 block: k scrambled with c1/c2, folded into h."""
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur_hash32(seeds: torch.Tensor, positions: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 (x86, 32-bit, seed 0) of the 16 bytes (seed low word, seed high word, position,
    column): ``seeds``/``positions`` [B] int, ``cols`` [V] int -> [B, V] int64 in [0, 2**32)."""
    s = seeds.to(torch.int64)
    lo, hi = (s & _M32)[:, None], ((s >> 32) & _M32)[:, None]
    pos = (positions.to(torch.int64) & _M32)[:, None]
    col = (cols.to(torch.int64) & _M32)[None, :]
    h = torch.zeros_like(lo)
    for k in (lo, hi, pos):
        h = _mix(h, k)
    h = _mix(h.expand(-1, col.shape[1]), col.expand(h.shape[0], -1))
    return _fmix32(h ^ 16)


def seeded_sample(logprobs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Gumbel-max draw per row: ``logprobs`` [B, V] (masked entries -inf), ``seeds``/``positions`` [B]
    -> token ids [B] (int64). Deterministic in (seed, position) per row."""
    cols = torch.arange(logprobs.shape[1], device=logprobs.device)
    u = murmur_hash32(seeds.to(logprobs.device), positions.to(logprobs.device), cols).to(torch.float64) / _M32
    g = u.log_().clamp_(min=torch.finfo(torch.float64).min, max=-(2.0 ** -32)).neg_().log_().neg_()
    return (g + logprobs.to(torch.float64)).argmax(-1)


def row_seeds(seed: int, rows: range | list[int]) -> list[int]:
    """Distinct per-row sampling seeds (int63) from one step seed and each row's global index
    (SplitMix64 of ``seed * 2**20 + row``): the n samples of one prompt get different seeds, and a
    row keeps its seed whichever request or server carries it."""
    out = []
    for r in rows:
        z = (seed * (1 << 20) + r + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        out.append((z ^ (z >> 31)) >> 1)
    return out
