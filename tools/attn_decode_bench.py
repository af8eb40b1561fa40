"""Decode-attention variants on this GPU (one query token per row, GQA, left-pad mask), timed as
CUDA-graph replays: the static decoder's matmul/softmax form vs SDPA with a mask. Prints ms and the
KV bytes/s each reaches. Usage: python tools/attn_decode_bench.py [B] [Lb]"""
import sys

import torch
import torch.nn.functional as F

from megatron_jetrl.bench.timing import time_graph_ms

B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
Lb = int(sys.argv[2]) if len(sys.argv) > 2 else 768
H, g, d = 32, 8, 128
q = torch.randn(B, H, 1, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, g, 2048, d, device="cuda", dtype=torch.bfloat16)[:, :, :Lb]
v = torch.randn_like(k)
ok = torch.rand(B, Lb, device="cuda") > 0.1


def manual():
    qh = q.view(B, g, H // g, d)
    s = torch.matmul(qh, k.transpose(-1, -2)).float().mul_(d ** -0.5)
    p = s.masked_fill_(~ok[:, None, None, :], float("-inf")).softmax(-1).to(v.dtype)
    return torch.matmul(p, v)


bias = torch.zeros(B, 1, 1, Lb, device="cuda", dtype=torch.bfloat16).masked_fill_(~ok[:, None, None, :], float("-inf"))


def sdpa_mask():
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ok[:, None, None, :], enable_gqa=True)


def sdpa_bias():
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)


def sdpa_expand():  # K/V repeated to all query heads (what the math path does)
    return F.scaled_dot_product_attention(q, k.repeat_interleave(H // g, 1), v.repeat_interleave(H // g, 1), attn_mask=bias)


ref = manual().reshape(B, H, 1, d).float()
kv = 2 * k.numel() * 2
for name, fn in (("manual matmul+softmax", manual), ("sdpa bool mask gqa", sdpa_mask), ("sdpa bias gqa", sdpa_bias),
                 ("sdpa bias expanded kv", sdpa_expand)):
    try:
        ms = time_graph_ms(fn)
        err = (fn().reshape(B, H, 1, d).float() - ref).abs().max().item()
        print(f"B={B} Lb={Lb} {name:26s} {ms * 1e3:8.1f} us  KV {kv / ms / 1e9:6.2f} TB/s  max diff {err:.2e}")
    except Exception as e:  # noqa: BLE001 - report which variants this torch build refuses
        print(f"B={B} Lb={Lb} {name:26s} failed: {str(e).splitlines()[0][:120]}")
