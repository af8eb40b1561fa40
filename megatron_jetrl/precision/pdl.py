"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

A decode step is ~550 short kernels replayed from a CUDA graph; between two of them the GPU drains
the first grid before it starts the second. With PDL (``JETRL_PDL=1``, CUDA sm90+, off by default)
each of our kernels is launched with the programmatic-stream-serialization attribute and begins with
``pdl_enter``: ``griddepcontrol.launch_dependents`` lets the next kernel's programs be scheduled while
this one runs, and ``griddepcontrol.wait`` holds each program until the previous grid has finished
and its writes are visible. Every PDL kernel waits before its first memory access, so the chain stays
ordered whatever reads what (a kernel completes only after its own wait, hence after all earlier
ones); kernels launched without the attribute (torch's, cuDNN's) are ordered as usual. Only the
launch and ramp-up overlap, never data. The flag is read per launch, so tests can switch it.
Measured on the H200 (docs/benchmarks.md): no gain beyond run-to-run noise (a graph-replayed 8B decode
step spends only ~0.25 ms between kernels), so it stays off; the GPU tests check it changes no byte of
a rollout.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # griddepcontrol in Triton's CUDA extras (Triton >= 3.3)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_kwargs(device: torch.device) -> dict:
    """Launch keywords for a kernel that takes ``PDL: tl.constexpr`` and calls ``pdl_enter(PDL)``
    first: ``{}`` (plain launch) unless ``JETRL_PDL=1`` on a CUDA sm90+ device outside the interpreter."""
    if (os.environ.get("JETRL_PDL", "0") != "1" or device.type != "cuda" or gdc_wait is None
            or os.environ.get("TRITON_INTERPRET") == "1"
            or not _hopper(device.index if device.index is not None else torch.cuda.current_device())):
        return {}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
