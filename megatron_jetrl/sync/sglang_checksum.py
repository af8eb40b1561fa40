"""FP8 parity through SGLang 0.5.23's ``/weights_checker`` (``action="checksum"``).

What the server reports (``srt/utils/weight_checker.py``), per TP rank: for every parameter of its
model, ``f"{tensor_hash(x):016x}"`` of ``x`` = the BF16 dequantization of a block-FP8 weight with its
``weight_scale_inv`` (``fp8_utils.block_quant_dequant``: ``(w.float() * repeat(scale)).to(bf16)``), or
the raw parameter otherwise; names are SGLang's, with q/k/v fused into ``qkv_proj`` and gate/up into
``gate_up_proj``, each rank holding its TP shard. ``tensor_hash`` is sha256 of the bytes on CPU tensors
(its first 8 bytes, big-endian) and a Triton hash on CUDA tensors.

The sender computes the same numbers from the FP8 bytes + scales it pushed (``expected_checksums``):
shard per rank as SGLang's parallel linears do, fuse, dequantize, hash on the device the tensors are
on (CUDA: SGLang's own hash function, imported; without SGLang the CPU rule on a host copy, which is
what ``jetrl serve`` does too). Only the FP8 linears are compared: they are the bytes the precision
flow promises; embeddings are vocab-padded per rank in SGLang and norms are BF16 anyway.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable, Mapping

import torch

from megatron_jetrl.sync.transport import tensor_hash

# HF linear -> (SGLang's fused parameter, position in it). Column-parallel: rows split across TP ranks.
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
FUSED_PARTS = {"qkv_proj": 3, "gate_up_proj": 2}
# Row-parallel: columns (K) split across TP ranks.
ROW_PARALLEL = ("o_proj", "down_proj")
KV = ("k_proj", "v_proj")


def dequant_bf16(w: torch.Tensor, scale_inv: torch.Tensor, block: int) -> torch.Tensor:
    """[N, K] E4M3 with [ceil(N/b), ceil(K/b)] fp32 scales -> [N, K] BF16, SGLang's rule:
    fp32 product, one rounding to BF16."""
    n, k = w.shape
    s = scale_inv.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return (w.float() * s).to(torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _gpu_hash() -> Callable | None:
    try:  # SGLang's own Triton hash; present where SGLang is installed (the training container)
        from sglang.srt.managers.mm_utils import gpu_tensor_hash
    except Exception:  # noqa: BLE001 - any import failure means: hash on CPU
        return None
    return gpu_tensor_hash


def sglang_tensor_hash(t: torch.Tensor) -> str:
    """``weight_checker._hash_tensor``: the hex form of ``mm_utils.tensor_hash``. CUDA tensors use
    SGLang's GPU hash where SGLang imports, otherwise the CPU rule on a host copy."""
    fn = _gpu_hash() if t.is_cuda else None
    if fn is not None:
        return f"{fn(t.contiguous()):016x}"
    return tensor_hash(t)  # sha256(bytes)[:8] big-endian == hexdigest()[:16]


def _shard(leaf: str, w: torch.Tensor, s: torch.Tensor | None, rank: int, tp: int, num_kv_heads: int,
           block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank ``rank``'s part of one HF linear (weight [N, K], FP8 scales [N/b, K/b] or None) under
    SGLang's TP: row-parallel layers split K, column-parallel ones split N, KV heads are replicated when
    there are fewer than ranks."""
    if tp == 1:
        return w, s
    if leaf in ROW_PARALLEL:
        lo, hi = rank * w.shape[1] // tp, (rank + 1) * w.shape[1] // tp
        return w[:, lo:hi], None if s is None else s[:, lo // block:hi // block]
    if leaf in KV and tp > num_kv_heads:
        h = rank // (tp // num_kv_heads)
        lo, hi = h * w.shape[0] // num_kv_heads, (h + 1) * w.shape[0] // num_kv_heads
    else:
        lo, hi = rank * w.shape[0] // tp, (rank + 1) * w.shape[0] // tp
    return w[lo:hi], None if s is None else s[lo // block:hi // block]


def sglang_name(hf_weight_name: str) -> str | None:
    """SGLang's parameter name for an HF FP8 linear weight, or None for weights not compared."""
    if not hf_weight_name.endswith(".weight") or hf_weight_name.count(".") < 2:
        return None
    base, leaf = hf_weight_name.removesuffix(".weight").rsplit(".", 1)
    if leaf in FUSED:
        return f"{base}.{FUSED[leaf][0]}.weight"
    return f"{base}.{leaf}.weight" if leaf in ROW_PARALLEL else None


class ExpectedChecksums:
    """Consumes a (HF name, tensor) stream and keeps, per TP rank, the checksum each linear must have
    on an SGLang server: the block-FP8 ones (dequantized), and with ``unquantized`` the BF16/FP32 ones
    too (raw, fused). Holds only the parts of fused parameters not yet complete (one layer's q/k/v or
    gate/up at a time, in export order)."""

    def __init__(self, tp: int, num_kv_heads: int, block: int, unquantized: bool = False):
        self.tp, self.num_kv_heads, self.block, self.unquantized = tp, num_kv_heads, block, unquantized
        self.ranks: list[dict[str, str]] = [{} for _ in range(tp)]
        self._weights: dict[str, torch.Tensor] = {}
        self._scales: dict[str, torch.Tensor] = {}
        self._parts: dict[str, dict[int, list[torch.Tensor]]] = {}

    def add(self, name: str, t: torch.Tensor) -> bool:
        """Record one tensor; False when it is not a linear this check covers."""
        if name.endswith(".weight_scale_inv"):
            w_name = name.removesuffix("_scale_inv")
            self._scales[w_name] = t
        elif sglang_name(name) is not None and (t.dtype == torch.float8_e4m3fn or self.unquantized):
            w_name = name
            self._weights[w_name] = t
        else:
            return False
        w = self._weights.get(w_name)
        if w is not None and (w.dtype != torch.float8_e4m3fn or w_name in self._scales):
            self._linear(w_name, self._weights.pop(w_name), self._scales.pop(w_name, None))
        return True

    def _linear(self, w_name: str, w: torch.Tensor, s: torch.Tensor | None) -> None:
        leaf = w_name.removesuffix(".weight").rsplit(".", 1)[1]
        target = sglang_name(w_name)
        shards = [_shard(leaf, w, s, r, self.tp, self.num_kv_heads, self.block) for r in range(self.tp)]
        deq = [x if sx is None else dequant_bf16(x, sx, self.block) for x, sx in shards]
        if leaf not in FUSED:
            for r in range(self.tp):
                self.ranks[r][target] = sglang_tensor_hash(deq[r])
            return
        parts = self._parts.setdefault(target, {})
        parts[FUSED[leaf][1]] = deq
        if len(parts) == FUSED_PARTS[FUSED[leaf][0]]:
            for r in range(self.tp):
                self.ranks[r][target] = sglang_tensor_hash(torch.cat([parts[i][r] for i in sorted(parts)]))
            del self._parts[target]

    def wrap(self, items: Iterable[tuple[str, torch.Tensor]]):
        """Pass ``items`` through, recording each."""
        for name, t in items:
            self.add(name, t)
            yield name, t


def compare(expected: list[dict[str, str]], answer: Mapping) -> tuple[int, int]:
    """(checked, mismatched) between ``expected`` (per rank) and a ``/weights_checker`` answer
    (``ranks``: one ``ChecksumInfo`` per TP rank). A tensor the server does not report counts as a
    mismatch."""
    ranks = answer.get("ranks") or []
    by_rank = {}
    for info in ranks:
        target = [p for p in info.get("parallelism_info") or [] if p.get("role") == "target"]
        by_rank[target[0]["tp_rank"] if target else len(by_rank)] = info.get("checksums") or {}
    checked = mismatched = 0
    for r, exp in enumerate(expected):
        got = by_rank.get(r, {})
        for name, h in exp.items():
            checked += 1
            mismatched += got.get(name) != h
    return checked, mismatched
