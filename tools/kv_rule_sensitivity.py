"""How the FP8 KV cache's rule (``quant.kv_qdq``: E4M3 per token and KV head, power-of-two scale) scales a small
difference between two computations of the same keys, as the decoder's and the trainer's K differ outside exact mode
(their GEMMs sum in other orders: some elements one BF16 ulp apart). For each fraction of elements moved by one ulp
(random sign), the mean and RMS of the key difference before and after the rule, and of the score error ``q . dK``
it gives a query. CPU, seconds.

Usage: python tools/kv_rule_sensitivity.py [--fracs 0.05,0.2] [--keys 4096] [--dim 128] [--std 2.0]"""
from __future__ import annotations

import argparse

import torch

from megatron_jetrl.precision.quant import kv_qdq
from megatron_jetrl.precision.recipe import FP8Recipe


def ulp_apart(x: torch.Tensor, frac: float, g: torch.Generator) -> torch.Tensor:
    """``x`` (BF16) with a fraction ``frac`` of its elements moved one ulp, up or down at random."""
    step = torch.where(torch.rand(x.shape, generator=g) < 0.5, -1, 1).to(torch.int16)
    step = torch.where(torch.rand(x.shape, generator=g) < frac, step, torch.zeros_like(step))
    return (x.view(torch.int16) + step).view(torch.bfloat16)


def rms(t: torch.Tensor) -> float:
    return t.pow(2).mean().sqrt().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fracs", default="0.05,0.2")
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--std", type=float, default=2.0, help="the keys' standard deviation")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    recipe = FP8Recipe(kv_cache="fp8")
    k = (torch.randn(a.keys, a.dim, generator=g) * a.std).bfloat16()
    q = torch.randn(a.keys, a.dim, generator=g)
    print("| elements 1 ulp apart | dK mean abs bf16 -> fp8 | dK rms bf16 -> fp8 | q.dK rms bf16 -> fp8 | ratio |")
    print("|---|---|---|---|---|")
    for frac in map(float, a.fracs.split(",")):
        k2 = ulp_apart(k, frac, g)
        d16 = k2.float() - k.float()
        d8 = kv_qdq(k2, recipe, use_triton=False).float() - kv_qdq(k, recipe, use_triton=False).float()
        s16, s8 = (q * d16).sum(1), (q * d8).sum(1)
        print(f"| {frac:.2f} | {d16.abs().mean():.2e} -> {d8.abs().mean():.2e} | {rms(d16):.2e} -> {rms(d8):.2e} | "
              f"{rms(s16):.2e} -> {rms(s8):.2e} | {rms(s8) / rms(s16):.1f}x |")


if __name__ == "__main__":
    main()
