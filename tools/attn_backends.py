"""Time torch SDPA backends on the model's training attention shapes (causal, GQA), forward and
forward+backward, BF16, one GPU; outputs compared with the flash backend's. The model's attention leaves the choice to torch
(flash attention for causal BF16 training).

Layouts (``--layouts``): ``bhsd``: contiguous [b, h, s, d] tensors handed to SDPA directly; ``model``:
the model's own core attention (``models.spec.SDPAttention.forward``) on the tensors megatron hands
it: q and k as the RoPE kernel writes them ([s, b, h, d], contiguous), v a strided view of the fused
QKV output, the output permuted back to [s, b, h * d]; ``model_contig``: the same with q, k, v copied
to contiguous [b, h, s, d] first (the copies are timed). ``--profile`` prints the kernels of one
forward+backward per backend and layout.
Usage: python tools/attn_backends.py [--seqs 4096,8192] [--heads 32,8] [--dim 128] [--json out.json]"""
from __future__ import annotations

import argparse
import json
import types

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_jetrl.bench.timing import kernel_table, time_sustained_ms



def _model_inputs(S, hq, hk, d, g):
    """q, k contiguous [S, 1, h, d] (RoPE's outputs); v a view into a fused [S, 1, hk, (hq/hk + 2) * d]."""
    r = hq // hk
    mixed = torch.randn(S, 1, hk, (r + 2) * d, device="cuda", generator=g, dtype=torch.bfloat16)
    q = mixed[..., : r * d].reshape(S, 1, hq, d).contiguous().requires_grad_()
    k = mixed[..., r * d:(r + 1) * d].contiguous().requires_grad_()
    mixed.requires_grad_()
    return q, k, mixed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="4096,8192")
    ap.add_argument("--heads", default="32,8", help="query heads, key/value groups")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layouts", default="bhsd,model,model_contig")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    from megatron_jetrl.models.spec import SDPAttention

    hq, hk, d = *map(int, a.heads.split(",")), a.dim
    rows = []
    for S in map(int, a.seqs.split(",")):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, hq, S, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        k = torch.randn(1, hk, S, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        v = torch.randn(1, hk, S, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        dy = torch.randn(1, hq, S, d, device="cuda", generator=g, dtype=torch.bfloat16)
        mq, mk, mixed = _model_inputs(S, hq, hk, d, g)
        mdy = torch.randn(S, 1, hq * d, device="cuda", generator=g, dtype=torch.bfloat16)
        attn = types.SimpleNamespace(softmax_scale=d ** -0.5, dropout=0.0, training=True)

        def run(layout, name, bwd):
            def f():
                if layout == "bhsd":
                    with sdpa_kernel([getattr(SDPBackend, name)]):
                        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hk)
                    grad = dy
                else:
                    mv = mixed[..., (hq // hk + 1) * d:]
                    qq, kk, vv = mq, mk, mv
                    if layout == "model_contig":  # [b, h, s, d] copies, viewed back as [s, b, h, d]
                        qq, kk, vv = (t.permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3) for t in (mq, mk, mv))
                    with sdpa_kernel([getattr(SDPBackend, name)]):
                        y = SDPAttention.forward(attn, qq, kk, vv, None)
                    grad = mdy
                if bwd:
                    y.backward(grad)
                return y
            return f

        # the raw SDPA output's memory order on the model's inputs: SDPAttention's permute(2, 0, 1, 3).reshape()
        # to [s, b, h * d] is a view only when it is [s, b, h, d]-ordered, else one copy per layer and micro-batch
        for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
            try:
                qkv = (t.permute(1, 2, 0, 3) for t in (mq, mk, mixed[..., (hq // hk + 1) * d:]))
                with torch.no_grad(), sdpa_kernel([getattr(SDPBackend, name)]):
                    o = F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=hq != hk)
                view = o.permute(2, 0, 1, 3).is_contiguous()
                print(f"S={S} model inputs, {name}: SDPA output [b, h, s, d] strides {tuple(o.stride())}; "
                      f"the model's [s, b, h*d] reshape is {'a view' if view else 'a copy'}")
            except RuntimeError as e:
                print(f"S={S} model inputs, {name}: not available ({str(e).splitlines()[0][:120]})")
        ok = {}
        for layout in a.layouts.split(","):
            for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
                try:
                    y = run(layout, name, True)().detach()  # forward and backward both run
                    ok[(layout, name)] = y if layout == "bhsd" else y.view(S, 1, hq, d).permute(1, 2, 0, 3)
                    torch.cuda.synchronize()
                except RuntimeError as e:
                    print(f"S={S} {layout} {name}: not available ({str(e).splitlines()[0][:120]})")
        fns = {}
        for layout, name in ok:
            fns[(layout, name, "fwd")] = (lambda f: (lambda: torch.no_grad()(f)()))(run(layout, name, False))
            fns[(layout, name, "fwdbwd")] = run(layout, name, True)
        ms = time_sustained_ms(fns, rounds=3, rep=100, heat_ms=300)
        flops = 4 * S * S * d * hq / 2  # causal
        for layout, name in ok:
            ref = ok.get((layout, "FLASH_ATTENTION"))
            row = {"S": S, "layout": layout, "backend": name, "fwd_ms": ms[(layout, name, "fwd")],
                   "fwdbwd_ms": ms[(layout, name, "fwdbwd")],
                   "fwd_tflops": flops / ms[(layout, name, "fwd")] / 1e9,
                   "max_abs_diff_vs_flash": (None if ref is None
                                             else float((ok[(layout, name)].float() - ref.float()).abs().max()))}
            if ref is not None:
                row["fwd_speedup_vs_flash"] = ms[(layout, "FLASH_ATTENTION", "fwd")] / row["fwd_ms"]
                row["fwdbwd_speedup_vs_flash"] = ms[(layout, "FLASH_ATTENTION", "fwdbwd")] / row["fwdbwd_ms"]
            print(row, flush=True)
            rows.append(row)
        if a.profile:
            for layout, name in ok:
                if name != "EFFICIENT_ATTENTION":
                    kernel_table(fns[(layout, name, "fwdbwd")], 3, f"S={S} {layout} {name} fwd+bwd", top=8)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
