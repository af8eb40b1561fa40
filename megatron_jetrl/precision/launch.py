"""Triton launches without Triton's per-call Python dispatch (training's many small kernels).

``kernel[grid](*args, **kw)`` binds the arguments to the signature, specializes each one, builds a cache-key
string, looks the compiled kernel up and asks for launch metadata, in Python, on every call; a jet training
step of an 8B-shaped slice makes ~2800 such launches (quantizers, norms, RoPE, SwiGLU), and its passes ran at the
host's pace (``jetrl bench train --cprofile``: the host issued the logprob pass only a few ms before the GPU
finished it). :func:`launch` makes the same launch: the first call of a specialization goes through
``kernel[grid]`` (compiling if needed) and keeps the compiled kernel; later calls hand the same argument list
(every parameter in signature order, defaults filled in: what ``JITFunction.run`` passes) straight to the
compiled kernel's launcher on the current stream.

The key is a superset of what Triton specializes a compiled kernel on: per tensor its dtype and whether its data
pointer is 16-byte aligned; per integer whether it is 1, divisible by 16 and its width class; per float nothing
(fp32); constexpr parameters and every keyword (launch options such as ``num_warps``) by value. So one key never
maps to two different Triton specializations, and a launch through the key runs the kernel ``kernel[grid]`` would
have run. Off (plain ``kernel[grid]``) under the Triton interpreter, when a launch hook is installed (a profiler
that wants launch metadata), when this Triton's ``JITFunction.run`` does not pass the full bound argument list
to its launcher (checked once), and with ``JETRL_FAST_LAUNCH=0``.
"""
from __future__ import annotations

import inspect
import os

import torch

try:
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - the package needs Triton; keep the module importable for docs
    JITFunction = None
try:
    from triton import knobs  # Triton >= 3.4: the launch hooks live in knobs.runtime
except ImportError:  # pragma: no cover - older Triton: the plain path (see _triton_ok)
    knobs = None

ENABLED = os.environ.get("JETRL_FAST_LAUNCH", "1") != "0"
_CACHE: dict = {}
_META: dict = {}
_USABLE: list = []   # [bool] once checked


def _triton_ok() -> bool:
    """Whether this Triton launches a compiled kernel with ``run(g0, g1, g2, stream, function,
    packed_metadata, launch_metadata, enter_hook, exit_hook, *bound_args.values())`` (Triton >= 3.3's form)."""
    if not _USABLE:
        ok = False
        try:
            src = inspect.getsource(JITFunction.run)
            ok = (knobs is not None and "*bound_args.values()" in src and "kernel.packed_metadata" in src
                  and os.environ.get("TRITON_INTERPRET") != "1")
        except Exception:  # noqa: BLE001 - any surprise: the plain path
            ok = False
        _USABLE.append(ok)
    return _USABLE[0]


def _meta(kernel) -> tuple:
    """(parameter names, constexpr flags, defaults) of a JITFunction, once."""
    m = _META.get(id(kernel))
    if m is None:
        params = kernel.params
        m = (tuple(p.name for p in params), tuple(bool(p.is_constexpr) for p in params),
             tuple(p.default for p in params))
        _META[id(kernel)] = m
    return m


def _spec(a):
    """What Triton may specialize a runtime argument on (see the module doc)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return "b", a
    if isinstance(a, int):
        return "i", a == 1, a % 16 == 0, -2**31 <= a < 2**31, a < 2**63
    if isinstance(a, float):
        return "f"
    if a is None:
        return None
    return "v", a


def bound_values(kernel, args: tuple, kw: dict) -> list:
    """Every parameter's value in signature order (the positional ``args``, then each remaining parameter's
    keyword value or default): the list ``JITFunction.run`` hands the compiled kernel's launcher."""
    names, _, defaults = _meta(kernel)
    return [*args, *[kw[n] if n in kw else d for n, d in zip(names[len(args):], defaults[len(args):])]]


def launch(kernel, grid, *args, **kw) -> None:
    """``kernel[grid](*args, **kw)``, through the compiled kernel's launcher after the first call of each
    specialization (module doc). ``grid``: a tuple of 1-3 ints."""
    if not (ENABLED and JITFunction is not None and isinstance(kernel, JITFunction) and _triton_ok()):
        kernel[grid](*args, **kw)
        return
    if knobs.runtime.launch_enter_hook is not None or knobs.runtime.launch_exit_hook is not None:
        kernel[grid](*args, **kw)
        return
    names, constexpr, defaults = _meta(kernel)
    key = (id(kernel), tuple(a if c else _spec(a) for a, c in zip(args, constexpr)),
           tuple((k, _spec(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()))
    dev = torch.cuda.current_device()
    hit = _CACHE.get((key, dev))
    if hit is None:
        compiled = kernel[grid](*args, **kw)
        rest = tuple(zip(names[len(args):], defaults[len(args):]))
        if all(n in kw or d is not inspect.Parameter.empty for n, d in rest):
            _CACHE[(key, dev)] = (compiled, rest)
        return
    compiled, rest = hit
    g = (*grid, 1, 1)
    compiled.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(dev), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *[kw[n] if n in kw else d for n, d in rest])


def clear() -> None:
    """Forget the kept kernels (tests)."""
    _CACHE.clear()
    _META.clear()
