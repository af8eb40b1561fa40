"""How the FP8 KV cache's rule (``quant.kv_qdq``: E4M3 per token and KV head, power-of-two scale) scales a small
difference between two computations of the same keys, as the decoder's and the trainer's K differ outside exact mode
(their GEMMs sum in other orders: some elements one BF16 ulp apart). For each fraction of elements moved by one ulp
(random sign), the mean and RMS of the key difference before and after the rule, and of the score error ``q . dK``
it gives a query. CPU, seconds.

Then (``--attention``) the same at the attention's output, where it reaches the output projection: query, keys and
values of one KV group computed twice (a fraction of their elements one ulp apart), the trainer's attention as a
flash kernel computes it (key tiles of 128 from the last one, as FlashAttention 2 and 3 visit them, or from key 0;
an online softmax in fp32, P rounded to BF16 for the P.V product), the decoder's either as its key-major kernel does
(128-key tiles from key 0, 32-key tails, P carried in fp16) or with exactly the trainer's tiles and rounding; mean
abs difference of the BF16 outputs, over a BF16 and over an FP8 cache. With no input difference the aligned
decoder leaves less (or nothing); from 1% of the elements apart the inputs decide it, and the more precise P of the
key-major kernel is as close or closer. Seconds.

Usage: python tools/kv_rule_sensitivity.py [--fracs 0.05,0.2] [--keys 4096] [--dim 128] [--std 2.0]
       [--attention] [--attn-fracs 0,0.01,0.1] [--attn-keys 1024] [--trials 16]"""
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


def key_tiles(n: int, block: int, from_last: bool, tail: int | None = None) -> list[tuple[int, int]]:
    """The (start, end) key tiles a kernel visits over keys 0..n-1: ``block``-key tiles from key 0 (the last partial
    one in ``tail``-key pieces when given), or (``from_last``) the tile holding key n-1 first, then down to key 0."""
    if from_last:
        last = (n - 1) // block * block
        return [(last, n)] + [(s, s + block) for s in range(last - block, -1, -block)]
    full = n // block * block
    return [(s, s + block) for s in range(0, full, block)] + [(s, min(s + (tail or block), n))
                                                              for s in range(full, n, tail or block)]


def online_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: list[tuple[int, int]],
                     p_dtype: torch.dtype) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for q [H, d] over k, v [L, d] (fp32 values) as a flash kernel computes it: the tiles
    in the given order, running max and sum in fp32 (the sum of the unrounded P), P rounded to ``p_dtype`` for the
    P.V product, fp32 accumulation; the output rounded to BF16. [H, d] fp32."""
    scale = q.shape[-1] ** -0.5
    m = torch.full((q.shape[0],), float("-inf"))
    total = torch.zeros(q.shape[0])
    acc = torch.zeros(q.shape)
    for a, b in tiles:
        s = q @ k[a:b].T * scale
        m_new = torch.maximum(m, s.amax(1))
        alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
        total = total * alpha + p.sum(1)
        acc = acc * alpha[:, None] + p.to(p_dtype).float() @ v[a:b]
        m = m_new
    return (acc / total[:, None]).bfloat16().float()


def attention_table(fracs: list[float], keys: int, dim: int, trials: int, g: torch.Generator) -> list[dict]:
    """Per input fraction, cache and trainer tile order: the mean abs difference of the decoder's attention output
    from the trainer's, with the decoder as the key-major kernel (``now``) and with the trainer's tiles and P rounding
    (``aligned``). 4 query heads (an 8B model's group), unit-variance inputs."""
    recipe = FP8Recipe(kv_cache="fp8")
    rows = []
    for frac in fracs:
        for cache in ("bf16", "fp8"):
            cached = ((lambda t: t.float()) if cache == "bf16"
                      else (lambda t: kv_qdq(t, recipe, use_triton=False).float()))
            for from_last in (True, False):
                trainer = key_tiles(keys, 128, from_last)
                now = key_tiles(keys, 128, False, tail=32)
                d_now = d_aligned = 0.0
                for _ in range(trials):
                    q, k, v = (torch.randn(n, dim, generator=g).bfloat16() for n in (4, keys, keys))
                    q2, k2, v2 = (ulp_apart(t, frac, g) for t in (q, k, v))
                    ref = online_attention(q.float(), cached(k), cached(v), trainer, torch.bfloat16)
                    q2, k2, v2 = q2.float(), cached(k2), cached(v2)  # the decoder's inputs, for both of its forms
                    d_now += (online_attention(q2, k2, v2, now, torch.float16) - ref).abs().mean()
                    d_aligned += (online_attention(q2, k2, v2, trainer, torch.bfloat16) - ref).abs().mean()
                rows.append({"frac": frac, "cache": cache, "trainer": "from the last" if from_last else "from key 0",
                             "now": float(d_now) / trials, "aligned": float(d_aligned) / trials})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fracs", default="0.05,0.2")
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--std", type=float, default=2.0, help="the keys' standard deviation")
    ap.add_argument("--attention", action="store_true", help="also the attention output's difference")
    ap.add_argument("--attn-fracs", default="0,0.01,0.1")
    ap.add_argument("--attn-keys", type=int, default=1024)
    ap.add_argument("--trials", type=int, default=64)
    a = ap.parse_args(argv)
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
    if not a.attention:
        return []
    rows = attention_table([float(f) for f in a.attn_fracs.split(",")], a.attn_keys, a.dim, a.trials, g)
    print("\n| elements 1 ulp apart | cache | trainer's tiles | mean abs dO, decoder as the key-major kernel | "
          "as the trainer's kernel |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['frac']:g} | {r['cache']} | {r['trainer']} | {r['now']:.2e} | {r['aligned']:.2e} |")
    return rows


if __name__ == "__main__":
    main()
