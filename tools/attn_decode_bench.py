"""Decode-attention variants on this GPU (one query token per row, GQA, left-pad mask), timed as
CUDA-graph replays: the static decoder's SDPA over a 256-key bucket with an additive mask (what
``rollout.decode_attention=sdpa`` runs), the exact-length Triton kernel (``kernels/decode_attn.py``,
``rollout.decode_attention=triton``: keys 0..pos only) with its launch-plan variants, and, for
reference, matmul + fp32 softmax and SDPA with K/V expanded; and the key-major Triton kernel over the FP8 KV
cache (``precision.kv_cache=fp8``: E4M3 K/V with a scale per token and KV head; V stored [L, d], as the decoder
keeps it on the H100, and key-major, [d, L] memory, as on the H200: ``rollout.fp8_kv_v_layout``, ``--v-layout``).
Prints us, the KV bytes/s each reaches
(the bytes the variant must read: the bucket for SDPA, pos + 1 keys for the kernel) and the
difference from the fp32 reference.
Usage: python tools/attn_decode_bench.py [--batch 64,256] [--keys 640,1000] [--bucket 256] [--json F]"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from megatron_jetrl.bench.timing import time_graph_ms
from megatron_jetrl.kernels.decode_attn import decode_attention, default_splits
from megatron_jetrl.precision.quant import dequantize_kv, quantize_kv
from megatron_jetrl.precision.recipe import FP8Recipe

KV_RECIPE = FP8Recipe(kv_cache="fp8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="64,256")
    ap.add_argument("--keys", default="640,1000", help="pos + 1 (the keys a step attends to)")
    ap.add_argument("--bucket", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1152, help="the KV cache's length (prompt + new tokens)")
    ap.add_argument("--heads", default="32,8")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--plans", default="64:2:4,32:2:4,64:3:4,128:2:4,128:3:4,128:2:8,64:2:8",
                    help="Triton plans block_n:num_stages:num_warps")
    ap.add_argument("--v-layout", default="rows,key_major",
                    help="the FP8 cache's V layouts timed: rows ([L, d]), key_major ([d, L] memory)")
    ap.add_argument("--valid", default="ok,first",
                    help="how the FP8 cache's kernel finds a row's valid keys: ok (key_ok's byte per key), first (each "
                    "row's first valid key, the decoder's call)")
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (timings meaningless)")
    ap.add_argument("--dtype", default="bfloat16", help="the KV cache's dtype (the interpreter has no bf16 dot: "
                    "float16/float32 for a CPU smoke run)")
    a = ap.parse_args()
    layouts, valids = [v for v in a.v_layout.split(",") if v], [v for v in a.valid.split(",") if v]
    if not layouts or set(layouts) - {"rows", "key_major"}:
        raise SystemExit(f"--v-layout: {a.v_layout!r}; give rows, key_major or both, comma-separated")
    if not valids or set(valids) - {"ok", "first"}:
        raise SystemExit(f"--valid: {a.valid!r}; give ok, first or both, comma-separated")
    dev, dt = torch.device(a.device), getattr(torch, a.dtype)

    def timed_ms(fn):
        if dev.type == "cuda":
            return time_graph_ms(fn)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    H, G = map(int, a.heads.split(","))
    d, L = a.dim, a.max_len
    rows = []
    for B in map(int, a.batch.split(",")):
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(B, H, d, device=dev, dtype=dt, generator=g)
        kc = torch.randn(B, G, L, d, device=dev, dtype=dt, generator=g)
        vc = torch.randn(B, G, L, d, device=dev, dtype=dt, generator=g)
        # the FP8 KV cache of precision.kv_cache=fp8 (E4M3, a power-of-two scale per token and KV head), and the
        # dequantized values the reference and the BF16 variants below read in the FP8 rows' comparison
        (kq, ks), (vq, vs) = quantize_kv(kc, KV_RECIPE), quantize_kv(vc, KV_RECIPE)
        v_fp8 = {lay: vq if lay == "rows" else vq.transpose(2, 3).contiguous().transpose(2, 3)  # same values
                 for lay in layouts}
        for n in map(int, a.keys.split(",")):
            Lb = min(L, -(-n // a.bucket) * a.bucket)
            ok = torch.ones(B, L, dtype=torch.bool, device=dev)
            ok[::3, :17] = False  # left pads of shorter prompts
            first = torch.where(torch.arange(B, device=dev) % 3 == 0, 17, 0)  # the same as each row's first key
            ok[:, n:] = False  # not yet written
            pos = torch.tensor([n - 1], device=dev)
            bias = torch.zeros(B, 1, 1, Lb, device=dev, dtype=dt).masked_fill_(
                ~ok[:, None, None, :Lb], float("-inf"))
            valid = ok[:, None, None, :n]
            qf, kf, vf = q.float()[:, :, None], kc[:, :, :n].float(), vc[:, :, :n].float()
            s = torch.matmul(qf.view(B, G, H // G, d), kf.transpose(-1, -2)) * d ** -0.5
            ref = torch.matmul(s.masked_fill(~valid, float("-inf")).softmax(-1), vf).reshape(B, H, d)

            def sdpa():
                return F.scaled_dot_product_attention(q[:, :, None], kc[:, :, :Lb], vc[:, :, :Lb], attn_mask=bias,
                                                      enable_gqa=True)[:, :, 0]

            def manual():
                qh = q.view(B, G, H // G, 1, d).squeeze(3)
                sc = torch.matmul(qh, kc[:, :, :Lb].transpose(-1, -2)).float().mul_(d ** -0.5)
                p = sc.masked_fill_(~ok[:, None, None, :Lb], float("-inf")).softmax(-1).to(vc.dtype)
                return torch.matmul(p, vc[:, :, :Lb]).reshape(B, H, d)

            def expanded():
                r = H // G
                return F.scaled_dot_product_attention(q[:, :, None], kc[:, :, :Lb].repeat_interleave(r, 1),
                                                      vc[:, :, :Lb].repeat_interleave(r, 1), attn_mask=bias)[:, :, 0]

            variants = {f"sdpa bucket {Lb}": (sdpa, Lb), f"matmul+softmax bucket {Lb}": (manual, Lb),
                        f"sdpa expanded kv bucket {Lb}": (expanded, Lb)}
            auto = default_splits(B, G, L, q.device)
            for plan in a.plans.split(","):
                bn, st, w = map(int, plan.split(":"))
                for sp in sorted({1, auto, 2 if auto == 1 else auto}):
                    variants[f"triton exact bn{bn} st{st} w{w} split{sp}"] = (
                        (lambda bn=bn, st=st, w=w, sp=sp: decode_attention(q, kc, vc, ok, pos, d ** -0.5, sp, bn, st, w)), n)
                    for lay, how in itertools.product(layouts, valids):
                        variants[f"triton fp8-kv v-{lay} {how} bn{bn} st{st} w{w} split{sp}"] = (
                            (lambda bn=bn, st=st, w=w, sp=sp, vv=v_fp8[lay], fk=first if how == "first" else None:
                             decode_attention(q, kq, vv, ok, pos, d ** -0.5, sp, bn, st, w, k_scale=ks, v_scale=vs,
                                              first_key=fk)), n)
            kd = dequantize_kv(kq[:, :, :n], ks[:, :, :n], torch.float32)
            vd = dequantize_kv(vq[:, :, :n], vs[:, :, :n], torch.float32)
            s8 = torch.matmul(qf.view(B, G, H // G, d), kd.transpose(-1, -2)) * d ** -0.5
            ref8 = torch.matmul(s8.masked_fill(~valid, float("-inf")).softmax(-1), vd).reshape(B, H, d)
            for name, (fn, keys) in variants.items():
                fp8 = "fp8-kv" in name
                try:
                    err = (fn().float() - (ref8 if fp8 else ref)).abs().max().item()
                    ms = timed_ms(fn)
                except Exception as e:  # noqa: BLE001 - report which variants this build refuses
                    print(f"B={B} keys={n} {name:40s} failed: {str(e).splitlines()[0][:120]}")
                    continue
                kv = 2 * B * G * keys * d * ((1 + 4 / d) if fp8 else 2)  # FP8: a byte per value, 4 per scale
                row = {"batch": B, "keys": n, "variant": name, "us": ms * 1e3, "kv_tb_s": kv / ms / 1e9,
                       "max_abs_diff": err}
                rows.append(row)
                print(f"B={B} keys={n} {name:40s} {ms * 1e3:8.1f} us  KV {kv / ms / 1e9:5.2f} TB/s  "
                      f"max diff vs fp32 {err:.1e}", flush=True)
            base = next(r["us"] for r in rows if r["batch"] == B and r["keys"] == n and r["variant"].startswith("sdpa bucket"))
            best = min((r for r in rows if r["batch"] == B and r["keys"] == n and r["variant"].startswith("triton exact")),
                       key=lambda r: r["us"], default=None)
            if best:
                print(f"B={B} keys={n}: best Triton plan {best['variant']} {best['us']:.1f} us, "
                      f"{base / best['us']:.2f}x the SDPA bucket ({base:.1f} us)", flush=True)
            for lay in layouts:
                best8 = min((r for r in rows if r["batch"] == B and r["keys"] == n
                             and f"fp8-kv v-{lay} " in r["variant"]), key=lambda r: r["us"], default=None)
                if best8:
                    print(f"B={B} keys={n}: best FP8-KV plan, V {lay}: {best8['variant']} {best8['us']:.1f} us "
                          f"({best8['kv_tb_s']:.2f} TB/s), {base / best8['us']:.2f}x the SDPA bucket", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
