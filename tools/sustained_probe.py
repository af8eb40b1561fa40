"""Which part of the decode step over the FP8 KV cache slows under sustained load (CUDA; CUDA graphs).

The rollout's graph-replayed step with the FP8 cache ran ~0.5 ms (9%) slower after some hundred milliseconds of
continuous work than on a rested board while the decoder kept V key-major, where jet's step over the BF16 cache does
not (docs/benchmarks.md, "FP8 KV cache", "Rested and sustained"). This probe captures the step's parts as separate
CUDA graphs over the 8B decode shapes (``--layers`` layers, ``--batch`` rows at ``--pos`` keys; every replay advances
the position, as decoding does) and times each two ways: rested (queued behind a GPU sleep; the median step of the
first and of the last quarter of ``--steps``) and sustained (after ``--heat`` seconds of replays; the median step).
Parts:

- ``write+attn fp8``: per layer the RoPE + FP8 cache write and the key-major decode attention over V stored
  ``[L, d]`` (the decoder's pair on the H100, ``rollout.fp8_kv_v_layout``);
- ``write fp8`` / ``attn fp8``: each alone;
- ``write+attn fp8, V key-major``: the pair with V stored ``[d, L]`` (a write of one byte per feature row,
  key-contiguous attention tiles: the decoder's pair on the H200);
- ``write+sdpa bf16``: the BF16 cache written by the same kernel and read by SDPA over the length bucket (jet);
- ``gemms``: the 4 small-M FP8 GEMMs per layer at the 8B shapes (``--gemm-shapes none`` skips their 7 GB of weights);
- ``step fp8`` / ``step fp8, V key-major`` / ``step bf16``: per layer the cache write, the attention and the 4 GEMMs,
  in the decoder's order (the parts together, as a decode step interleaves them);
- ``full step ...``: also the fused add + RMSNorm + quantizer twice per layer, the SwiGLU quantizer and, per step, the
  BF16 LM head (``--vocab``) and an argmax: the decoder's kernels in its order.

The cache's length is rounded up to ``--align`` keys (the decoder's 64; 8 times a cache whose rows are only 8-byte
aligned).

A part whose sustained step exceeds its rested one by more than the others carries the slowdown.
Usage: python tools/sustained_probe.py [--layers 32] [--batch 64] [--pos 2048] [--steps 40] [--heat 2] [--json F]
``--device cpu`` runs each part eagerly under ``TRITON_INTERPRET=1`` on small shapes (a smoke run; times meaningless).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from megatron_jetrl.bench.timing import quarter_medians, step_spans_ms
from megatron_jetrl.kernels.decode_attn import decode_attention
from megatron_jetrl.kernels.rmsnorm import add_rmsnorm_quant
from megatron_jetrl.kernels.rope import rope_and_cache
from megatron_jetrl.kernels.triton_gemm import small_m_linear
from megatron_jetrl.kernels.triton_quant import swiglu_quant_triton
from megatron_jetrl.precision.quant import quantize_act, quantize_weight
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.rollout.decode import CACHE_ALIGN

KV = FP8Recipe(kv_cache="fp8")


def parts(a, dev: torch.device) -> dict:
    """name -> a function running one decode step's part over every layer (and advancing ``pos``)."""
    H, G = map(int, a.heads.split(","))
    B, d, nl = a.batch, a.dim, a.layers
    L = -(-(a.pos + a.steps * 4 + a.heat_steps + 8) // a.align) * a.align
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    pos = torch.tensor([a.pos], device=dev)
    q = torch.randn(nl, 1, B, H, d, device=dev, dtype=dt, generator=g)
    k = torch.randn(nl, 1, B, G, d, device=dev, dtype=dt, generator=g)
    v = torch.randn(nl, 1, B, G, d, device=dev, dtype=dt, generator=g)
    ang = torch.rand(B, d, device=dev, generator=g)
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)
    ok = torch.ones(B, L, dtype=torch.bool, device=dev)
    kc = torch.randn(nl, B, G, L, d, device=dev, generator=g).to(torch.float8_e4m3fn)
    vkm = torch.randn(nl, B, G, d, L, device=dev, generator=g).to(torch.float8_e4m3fn).transpose(3, 4)  # key-major
    vrow = vkm.contiguous()  # V [L, d]
    ks = torch.full((nl, B, G, L), 2.0 ** -6, device=dev)
    vs = ks.clone()
    kb = torch.randn(nl, B, G, L, d, device=dev, dtype=dt, generator=g)
    vb = torch.randn_like(kb)
    scale = d ** -0.5

    shapes = [tuple(map(int, x.split(":"))) for x in a.gemm_shapes.split(",") if x and a.gemm_shapes != "none"]
    if shapes:
        # the inputs pre-quantized, as the decoder's fused norm / SwiGLU / attention kernels hand them over
        xs = {kk: torch.randn(B, kk, device=dev, dtype=dt, generator=g) for kk in {kk for _, kk in shapes}}
        xq = {kk: quantize_act(x, FP8Recipe()) for kk, x in xs.items()}
        w = [[quantize_weight(torch.randn(n, kk, device=dev, dtype=dt, generator=g) / 64, FP8Recipe())
              for n, kk in shapes] for _ in range(nl)]
        hid, ffn2 = shapes[0][1], shapes[2][0]  # the hidden size (QKV's K) and fc1's [gate | up] width
        h = torch.randn(B, hid, device=dev, dtype=dt, generator=g)
        delta = torch.randn_like(h) / 8
        nw = torch.ones(hid, device=dev, dtype=dt)
        y1 = torch.randn(B, ffn2, device=dev, dtype=dt, generator=g)  # fc1's output
        head = torch.randn(a.vocab, hid, device=dev, dtype=dt, generator=g) / 64
    Lb = min(L, -(-(a.pos + 1) // 256) * 256)  # the SDPA bucket at the probe's start
    mask = torch.zeros(B, 1, 1, Lb, device=dev, dtype=dt)

    def gemm(i):
        def run(li):
            kk, (qw, sw) = shapes[i][1], w[li][i]
            small_m_linear(xs[kk], qw, sw, FP8Recipe(), xq=xq[kk])
        return run

    def write(v_cache, k_cache=kc, k_scale=ks, v_scale=vs, recipe=KV):
        return lambda li: rope_and_cache(q[li], k[li], v[li], cos, sin, k_cache[li], v_cache[li], pos,
                                         None if recipe is None else k_scale[li], None if recipe is None else v_scale[li],
                                         recipe)

    def attn(v_cache):
        return lambda li: decode_attention(q[li, 0], kc[li], v_cache[li], ok, pos, scale, 1, 128, 2, 4,
                                           k_scale=ks[li], v_scale=vs[li])

    def sdpa(li):
        F.scaled_dot_product_attention(q[li].permute(1, 2, 0, 3), kb[li, :, :, :Lb], vb[li, :, :, :Lb],
                                       attn_mask=mask, scale=scale, enable_gqa=True)

    # the decoder's per-layer kernels (the GEMMs, norms and SwiGLU at the 8B shapes) and its per-step LM head
    ops = {"write8": write(vrow), "attn8": attn(vrow), "write8km": write(vkm), "attn8km": attn(vkm),
           "write16": write(vb, kb, recipe=None), "sdpa": sdpa}
    if shapes:
        ops.update({"qkv": gemm(0), "proj": gemm(1), "fc1": gemm(2), "fc2": gemm(3),
                    "norm": lambda li: add_rmsnorm_quant(h, delta, nw, 1e-5, FP8Recipe()),
                    "swiglu": lambda li: swiglu_quant_triton(y1, FP8Recipe()),
                    "head": lambda li: torch.argmax(F.linear(h, head).float(), dim=-1)})
    gemms = ("qkv", "proj", "fc1", "fc2")
    full = ("norm", "qkv", "{w}", "{a}", "proj", "norm", "fc1", "swiglu", "fc2")
    compose = {  # part -> (per-layer ops in order, per-step ops)
        "write+attn fp8": (("write8", "attn8"), ()), "write fp8": (("write8",), ()), "attn fp8": (("attn8",), ()),
        "write+attn fp8, V key-major": (("write8km", "attn8km"), ()), "write+sdpa bf16": (("write16", "sdpa"), ()),
        "gemms": (gemms, ()), "step fp8": (("write8", "attn8", *gemms), ()),
        "step fp8, V key-major": (("write8km", "attn8km", *gemms), ()), "step bf16": (("write16", "sdpa", *gemms), ()),
        "full step fp8": (tuple(x.format(w="write8", a="attn8") for x in full), ("head",)),
        "full step fp8, V key-major": (tuple(x.format(w="write8km", a="attn8km") for x in full), ("head",)),
        "full step bf16": (tuple(x.format(w="write16", a="sdpa") for x in full), ("head",)),
    }

    def layers(per_layer, per_step):
        def run():
            for li in range(nl):
                for op in per_layer:
                    ops[op](li)
            for op in per_step:
                ops[op](0)
            pos.add_(1)
        return run

    out = {name: layers(*c) for name, c in compose.items() if all(op in ops for op in c[0] + c[1])}
    return out, pos


def probe(fn, pos: torch.Tensor, start: int, a) -> dict:
    """Rested (first and last quarter of ``a.steps`` steps queued behind a GPU sleep) and sustained (after
    ``a.heat`` s of steps) median step times in ms of ``fn`` (a CUDA graph's replay on CUDA)."""
    pos.fill_(start)
    rested = step_spans_ms(fn, a.steps, rest_s=0.3)  # a rested board; the steps queue behind a GPU sleep
    pos.fill_(start)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < a.heat:  # sustained: keep the GPU busy, positions cycling over a window
        for _ in range(a.heat_steps):
            fn()
        pos.fill_(start)
        if pos.is_cuda:
            torch.cuda.synchronize()
    first, last = quarter_medians(rested)
    return {"rested_first_ms": first, "rested_last_ms": last,
            "sustained_ms": statistics.median(step_spans_ms(fn, a.steps))}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", default="32,8")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--pos", type=int, default=2048, help="keys before the first step")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--heat", type=float, default=2.0, help="seconds of steps before the sustained timing")
    ap.add_argument("--heat-steps", type=int, default=64, help="steps per heating round (positions then restart)")
    ap.add_argument("--gemm-shapes", default="6144:4096,4096:4096,28672:4096,4096:14336",
                    help="N:K of the FP8 GEMMs per layer (the 8B QKV, output projection, fc1, fc2); none skips them")
    ap.add_argument("--vocab", type=int, default=128_256, help="the LM head's rows (the full steps)")
    ap.add_argument("--align", type=int, default=CACHE_ALIGN, help="the cache's length is a multiple of this many keys")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    fns, pos = parts(a, dev)
    rows = []
    for name, fn in fns.items():
        run = fn
        if dev.type == "cuda":  # warm up (compiles), then capture one step
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
        r = {"part": name, **probe(run, pos, a.pos, a)}
        r["sustained_vs_rested"] = r["sustained_ms"] / r["rested_first_ms"]
        rows.append(r)
        print(f"{name:28s} rested {r['rested_first_ms']:7.3f} -> {r['rested_last_ms']:7.3f} ms   sustained "
              f"{r['sustained_ms']:7.3f} ms   ({r['sustained_vs_rested']:.3f}x)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
