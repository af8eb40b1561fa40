"""Exact mode's kernels (``precision.exact``) beside the default ones on this GPU, at the 8B model's shapes, timed as
CUDA-graph replays, side by side in one run: the block-FP8 GEMM (cuBLAS's ``scaled_mm`` and the small-M decode GEMM vs
``kernels/exact_gemm.py`` in each ``--gemm-configs`` plan) at the decoder's rows and a training micro-batch's, the
BF16 LM head (cuBLAS vs the exact BF16 GEMM), the training forward's attention (SDPA vs ``kernels/exact_attn.py``,
which also over the FP8 KV cache's bytes),
a decode step's (SDPA over a bucket, the Triton decode kernel, the exact kernel) and long-context decode steps over
the FP8 KV cache (the key-major decode kernel vs the exact kernel's head-major and key-major plans). Each exact plan
says whether its output has the first plan's bytes (the decoder and the trainer may run different plans only where
they do).
Usage: python tools/exact_bench.py [--parts gemm,attn,long] [--rows 64,4608] [--gemm-configs 64:128:4:4,...]
       [--long-keys 4096,8192] [--long-plans 64:4:2:16,...] [--keys-plans 2:2,2:3:2,...] [--cache-keys 2176] [--json F]"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from megatron_jetrl.bench.timing import time_graph_ms, time_rotated_ms
from megatron_jetrl.kernels.decode_attn import decode_attention, default_splits
from megatron_jetrl.kernels.exact_attn import exact_attention, key_major, keys_plan_of
from megatron_jetrl.kernels.exact_gemm import exact_block_gemm, exact_mm
from megatron_jetrl.kernels.triton_gemm import small_m_linear
from megatron_jetrl.precision.gemm import block_gemm
from megatron_jetrl.precision.quant import quantize_act, quantize_kv, quantize_weight
from megatron_jetrl.precision.recipe import FP8Recipe

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "fc1": (28672, 4096), "fc2": (4096, 14336)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,4608")
    ap.add_argument("--gemm-configs", default="64:128:4:4,64:128:4:3,128:128:8:3,128:256:8:3,128:128:8:4,64:256:4:3",
                    help="exact GEMM plans BLOCK_M:BLOCK_N:warps:stages")
    ap.add_argument("--attn-plans", default="64:4:2:16,64:4:2:64,64:4:3:64,128:8:2:64,64:4:2:32,64:8:2:128",
                    help="exact attention plans BLOCK_N:warps:stages:query rows per program (the first: the decoder's)")
    ap.add_argument("--long-keys", default="4096",
                    help="context lengths of the long-context decode step over the FP8 KV cache (comma-separated)")
    ap.add_argument("--long-plans", default="64:4:2:16,64:4:1:16,64:4:3:16,64:4:4:16,64:8:2:16,64:8:3:16,64:2:3:16,"
                    "64:4:2:32,128:4:2:16", help="exact decoder plans BLOCK_N:warps:stages:rows timed there (the first: the "
                    "decoder's; each says whether it gives the first plan's bytes)")
    ap.add_argument("--keys-plans", default="2:2,2:3,2:4,1:2,1:3,2:2:2,2:3:2,4:2",
                    help="key-major exact decode plans warps:stages[:2] (2: two key blocks an iteration) timed there "
                    "and in the cache part (each says whether it gives the first long plan's bytes, the trainer's)")
    ap.add_argument("--parts", default="gemm,attn,long",
                    help="what to time: gemm (GEMMs, LM head), attn (training forward, 1,024-key decode), long "
                    "(the long-context decode over the FP8 cache), cache (a decode step's calls over a decoder-shaped "
                    "cache of every layer)")
    ap.add_argument("--cache-layers", type=int, default=32)
    ap.add_argument("--cache-len", type=int, default=4224, help="the cache rows' keys (the rollout's max length)")
    ap.add_argument("--cache-keys", type=int, default=2176, help="the keys a step reads (its position + 1)")
    ap.add_argument("--json")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    dev = torch.device("cuda")
    r = FP8Recipe()
    cfgs = [tuple(map(int, c.split(":"))) for c in a.gemm_configs.split(",")]
    rows = []

    def add(kind, shape, variant, ms, flops=None, nbytes=None, same=None):
        row = {"kind": kind, "shape": shape, "variant": variant, "us": round(ms * 1e3, 1)}
        if flops:
            row["tflops"] = round(flops / ms / 1e9, 1)
        if nbytes:
            row["tb_s"] = round(nbytes / ms / 1e9, 2)
        if same is not None:
            row["same_bits_as_first_plan"] = same
        rows.append(row)
        print(row, flush=True)

    g = torch.Generator(device=dev).manual_seed(0)
    for M in map(int, a.rows.split(",")) if "gemm" in parts else ():
        for name, (N, K) in SHAPES.items():
            x = torch.randn(M, K, device=dev, generator=g).bfloat16()
            wq, ws = quantize_weight(torch.randn(N, K, device=dev, generator=g).bfloat16() / 64, r)
            xq, xs = quantize_act(x, r)
            xq_c, xs_c = quantize_act(x, r, scale_col_major=True)
            flops, nbytes = 2 * M * N * K, N * K + M * K
            shape = f"{name} {M}x{N}x{K}"
            add("fp8_gemm", shape, "cublas", time_graph_ms(lambda: block_gemm(xq_c, xs_c, wq, ws, "scaled_mm")), flops, nbytes)
            if M <= 64:
                add("fp8_gemm", shape, "small_m", time_graph_ms(lambda: small_m_linear(x, wq, ws, r)), flops, nbytes)
            first = None
            for c in cfgs:
                y = exact_block_gemm(xq, xs, wq, ws, torch.bfloat16, config=c)
                first = y if first is None else first
                add("fp8_gemm", shape, "exact " + ":".join(map(str, c)),
                    time_graph_ms(lambda: exact_block_gemm(xq, xs, wq, ws, torch.bfloat16, config=c)), flops, nbytes,
                    torch.equal(y, first))
        N, K = 128256, 4096
        x = torch.randn(M, K, device=dev, generator=g).bfloat16()
        w = (torch.randn(N, K, device=dev, generator=g) / 64).bfloat16()
        flops, nbytes, shape = 2 * M * N * K, 2 * (N * K + M * K), f"lm_head {M}x{N}x{K}"
        add("bf16_gemm", shape, "cublas", time_graph_ms(lambda: x @ w.t()), flops, nbytes)
        first = None
        for c in cfgs:
            y = exact_mm(x, w, config=c)
            first = y if first is None else first
            add("bf16_gemm", shape, "exact " + ":".join(map(str, c)), time_graph_ms(lambda: exact_mm(x, w, config=c)),
                flops, nbytes, torch.equal(y, first))
    plans = [tuple(map(int, p.split(":"))) for p in a.attn_plans.split(",")]
    B, H, G, D = 64, 32, 8, 128
    if "attn" in parts:
        # training forward: 4 sequences x 1,024 tokens, 32 heads, 8 groups, head dim 128
        b, S, H, G, D = 4, 1024, 32, 8, 128
        q = torch.randn(S, b, H, D, device=dev, generator=g).bfloat16()
        k = torch.randn(S, b, G, D, device=dev, generator=g).bfloat16()
        v = torch.randn(S, b, G, D, device=dev, generator=g).bfloat16()
        flops = 4 * b * H * S * S * D / 2
        add("attn_train", f"{b}x{S}", "sdpa", time_graph_ms(lambda: F.scaled_dot_product_attention(
            q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True, enable_gqa=True)), flops)
        zero = torch.zeros(b, dtype=torch.long, device=dev)
        first = None
        for p in plans:
            y = exact_attention(q, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), D ** -0.5, zero, plan=p)
            first = y if first is None else first
            add("attn_train", f"{b}x{S}", "exact " + ":".join(map(str, p)), time_graph_ms(lambda: exact_attention(
                q, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), D ** -0.5, zero, plan=p)), flops, None,
                torch.equal(y, first))
        # ... over the FP8 KV cache's bytes (V key-major, as the trainer hands them): the trainer's plan, 64- and 128-key
        rec = FP8Recipe(kv_cache="fp8")
        (k8, ks8), (v8, vs8) = (quantize_kv(t.permute(1, 2, 0, 3), rec) for t in (k, v))
        v8 = key_major(v8)
        for p in ((64, 4, 2, 32), (128, 4, 2, 32)):
            add("attn_train_fp8kv", f"{b}x{S}", "exact " + ":".join(map(str, p)), time_graph_ms(lambda: exact_attention(
                q, k8, v8, D ** -0.5, zero, ks8, vs8, plan=p)), flops)
        # decode step: 64 rows x 1,024 keys
        B, L, n = 64, 1152, 1024
        q = torch.randn(1, B, H, D, device=dev, generator=g).bfloat16()
        kc = torch.randn(B, G, L, D, device=dev, generator=g).bfloat16()
        vc = torch.randn(B, G, L, D, device=dev, generator=g).bfloat16()
        nbytes = 2 * B * G * n * D * 2
        ok = torch.ones(B, L, dtype=torch.bool, device=dev)
        pos = torch.tensor([n - 1], device=dev)
        mask = torch.zeros(B, 1, 1, n, dtype=torch.bfloat16, device=dev)
        add("attn_decode", f"{B}x{n}", "sdpa", time_graph_ms(lambda: F.scaled_dot_product_attention(
            q.permute(1, 2, 0, 3), kc[:, :, :n], vc[:, :, :n], attn_mask=mask, enable_gqa=True)), None, nbytes)
        splits = default_splits(B, G, L, dev)
        add("attn_decode", f"{B}x{n}", "triton", time_graph_ms(lambda: decode_attention(q[0], kc, vc, ok, pos, D ** -0.5,
                                                                                       splits)), None, nbytes)
        qpos = torch.full((B,), n - 1, device=dev)  # every row's query position (the exact decoder's cache: by position)
        for p in plans[:1] + [(bn, w, st, 16) for bn, w, st in ((64, 4, 3), (128, 4, 3), (64, 8, 2), (32, 4, 4))]:
            add("attn_decode", f"{B}x{n}", "exact " + ":".join(map(str, p)), time_graph_ms(lambda: exact_attention(
                q, kc, vc, D ** -0.5, qpos, plan=p)), None, nbytes)
    # decode step over the FP8 KV cache at long contexts, 64 rows x N keys: the default mode's key-major kernel (the
    # decoder's plan, V [L, d] as on the H100) vs the exact kernel in the decoder's plan and others (V key-major, as
    # exact mode's FP8 cache holds it), each with whether it gives the decoder's plan's bytes
    rec = FP8Recipe(kv_cache="fp8")
    for n in map(int, a.long_keys.split(",")) if "long" in parts else ():
        L = n + 64
        q = torch.randn(1, B, H, D, device=dev, generator=g).bfloat16()
        (kq, ks), (vq, vs) = (quantize_kv(torch.randn(B, G, L, D, device=dev, generator=g).bfloat16(), rec)
                              for _ in range(2))
        vq_km = key_major(vq)
        ok = torch.ones(B, L, dtype=torch.bool, device=dev)
        pos = torch.tensor([n - 1], device=dev)
        qpos = torch.full((B,), n - 1, device=dev)
        nbytes = 2 * B * G * n * (D + 4)
        add("attn_decode_fp8kv", f"{B}x{n}", "triton key-major", time_graph_ms(lambda: decode_attention(
            q[0], kq, vq, ok, pos, D ** -0.5, default_splits(B, G, L, dev), 128, 2, 4, ks, vs)), None, nbytes)
        first = None
        for p in [tuple(map(int, p.split(":"))) for p in a.long_plans.split(",")]:
            y = exact_attention(q, kq, vq_km, D ** -0.5, qpos, ks, vs, plan=p)
            first = y if first is None else first
            add("attn_decode_fp8kv", f"{B}x{n}", "exact " + ":".join(map(str, p)), time_graph_ms(
                lambda: exact_attention(q, kq, vq_km, D ** -0.5, qpos, ks, vs, plan=p)), None, nbytes,
                torch.equal(y, first))
        for kp in [tuple(map(int, p.split(":"))) for p in a.keys_plans.split(",")]:
            y = exact_attention(q, kq, vq_km, D ** -0.5, qpos, ks, vs, keys_plan=kp)
            add("attn_decode_fp8kv", f"{B}x{n}", "exact key-major " + ":".join(map(str, kp)), time_graph_ms(
                lambda: exact_attention(q, kq, vq_km, D ** -0.5, qpos, ks, vs, keys_plan=kp)), None, nbytes,
                torch.equal(y, first))
    # one decode step's attention calls over a decoder-shaped FP8 cache ([layers, B, groups, L, d] with its rows
    # 64-key aligned, V also key-major [.., d, L] as on the H200 and in exact mode), every layer in turn as the step
    # calls them, at n of the rows' L keys: the cache's placement and footprint as the rollout's
    if "cache" in parts:
        nl, n, L = a.cache_layers, a.cache_keys, a.cache_len
        La = -(-L // 64) * 64
        kc = torch.empty(nl, B, G, La, D, dtype=torch.float8_e4m3fn, device=dev)
        vr = torch.empty_like(kc)
        vk = torch.empty(nl, B, G, D, La, dtype=torch.float8_e4m3fn, device=dev)
        ksc = torch.empty(nl, B, G, La, device=dev)
        vsc = torch.empty_like(ksc)
        for li in range(nl):
            (k8, k8s), (v8, v8s) = (quantize_kv(torch.randn(B, G, La, D, device=dev, generator=g).bfloat16(), rec)
                                    for _ in range(2))
            kc[li], vr[li], vk[li], ksc[li], vsc[li] = k8, v8, v8.transpose(-1, -2), k8s, v8s
            del k8, v8
        q = torch.randn(1, B, H, D, device=dev, generator=g).bfloat16()
        ok = torch.ones(B, La, dtype=torch.bool, device=dev)
        pos = torch.tensor([n - 1], device=dev)
        qpos = torch.full((B,), n - 1, device=dev)
        nbytes = 2 * B * G * n * (D + 4)
        shape = f"{B}x{n} of {L} keys, {nl} layers"
        vkm = vk.transpose(-1, -2)  # [layers, B, G, La, d] views of [d, La] memory
        decoder_kp = ":".join(map(str, keys_plan_of()))
        for name, fn in (
                ("triton key-major, V [L, d]", lambda li: decode_attention(q[0], kc[li], vr[li], ok, pos, D ** -0.5, 1,
                                                                          128, 2, 4, ksc[li], vsc[li])),
                ("triton key-major, V key-major", lambda li: decode_attention(q[0], kc[li], vkm[li], ok, pos,
                                                                             D ** -0.5, 1, 128, 2, 4, ksc[li],
                                                                             vsc[li])),
                ("exact 64:4:2:16", lambda li: exact_attention(q, kc[li], vkm[li], D ** -0.5, qpos, ksc[li], vsc[li],
                                                               plan=(64, 4, 2, 16))),
                (f"exact key-major {decoder_kp} (the decoder's)", lambda li: exact_attention(
                    q, kc[li], vkm[li], D ** -0.5, qpos, ksc[li], vsc[li]))):
            add("attn_decode_fp8kv_cache", shape, name, time_rotated_ms(fn, nl), None, nbytes)
        for kp in [tuple(map(int, p.split(":"))) for p in a.keys_plans.split(",")]:
            if keys_plan_of(kp) == keys_plan_of():
                continue  # timed above
            add("attn_decode_fp8kv_cache", shape, "exact key-major " + ":".join(map(str, kp)), time_rotated_ms(
                lambda li: exact_attention(q, kc[li], vkm[li], D ** -0.5, qpos, ksc[li], vsc[li], keys_plan=kp), nl),
                None, nbytes)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
