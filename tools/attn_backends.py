"""Time torch SDPA backends on the model's training attention shapes (causal, GQA), forward and
forward+backward, BF16, one GPU; outputs compared with the flash backend's. Informs ``JETRL_SDPA``.
Usage: python tools/attn_backends.py [--seqs 4096,8192] [--heads 32,8] [--dim 128] [--json out.json]"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_jetrl.bench.timing import time_sustained_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="4096,8192")
    ap.add_argument("--heads", default="32,8", help="query heads, key/value groups")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--json")
    a = ap.parse_args()
    hq, hk = map(int, a.heads.split(","))
    rows = []
    for S in map(int, a.seqs.split(",")):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, hq, S, a.dim, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        k = torch.randn(1, hk, S, a.dim, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        v = torch.randn(1, hk, S, a.dim, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        dy = torch.randn(1, hq, S, a.dim, device="cuda", generator=g, dtype=torch.bfloat16)

        def run(backend, bwd):
            def f():
                with sdpa_kernel([backend]):
                    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hk)
                if bwd:
                    y.backward(dy)
                return y
            return f

        ok, ref = {}, None
        for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
            try:
                ok[name] = run(getattr(SDPBackend, name), True)().detach()  # forward and backward both run
                torch.cuda.synchronize()
            except RuntimeError as e:
                print(f"S={S} {name}: not available ({str(e).splitlines()[0][:120]})")
        ref = ok.get("FLASH_ATTENTION")
        fns = {}
        for name in ok:
            fns[f"{name}_fwd"] = (lambda f: (lambda: torch.no_grad()(f)()))(run(getattr(SDPBackend, name), False))
            fns[f"{name}_fwdbwd"] = run(getattr(SDPBackend, name), True)
        ms = time_sustained_ms(fns, rounds=3, rep=100, heat_ms=300)
        flops = 4 * S * S * a.dim * hq / 2  # causal
        for name in ok:
            row = {"S": S, "backend": name, "fwd_ms": ms[f"{name}_fwd"], "fwdbwd_ms": ms[f"{name}_fwdbwd"],
                   "fwd_tflops": flops / ms[f"{name}_fwd"] / 1e9,
                   "max_abs_diff_vs_flash": None if ref is None else float((ok[name].float() - ref.float()).abs().max())}
            if ref is not None:
                row["fwd_speedup_vs_flash"] = ms["FLASH_ATTENTION_fwd"] / row["fwd_ms"]
                row["fwdbwd_speedup_vs_flash"] = ms["FLASH_ATTENTION_fwdbwd"] / row["fwdbwd_ms"]
            print(row, flush=True)
            rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
