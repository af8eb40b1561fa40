"""Let megatron-core run on a CPU-only machine over gloo (tests and the embedded CPU run only).

megatron-core assumes CUDA in a handful of places that have nothing to do with the math. On a
machine without CUDA, :func:`enable_cpu_megatron` redirects exactly those calls (found by running
megatron-core 0.19.2 on CPU):

| call | where megatron-core makes it | redirected to |
| --- | --- | --- |
| ``torch.cuda.{get,set}_rng_state``, ``manual_seed`` | RNG tracker (``model_parallel_cuda_manual_seed``) | the CPU generator |
| ``torch.cuda.current_device()`` | ``GlobalMemoryBuffer``, optimizer, p2p | ``"cpu"`` |
| ``torch.cuda.current_stream/stream/Stream/Event/synchronize`` | DP grad buffers, p2p, inference | no-op stand-ins |
| ``device="cuda"``, ``.cuda()``, ``.to("cuda")`` | pipeline schedules, inference | the CPU (a ``TorchFunctionMode``) |
| ``Tensor.type()`` | optimizer asserts ``'torch.cuda.FloatTensor'`` | the ``torch.cuda.*`` name |
| ``moe_utils.maybe_move_tensor_to_cpu`` | MoE all-to-all split sizes | also converts CPU tensors |

On a machine with CUDA it does nothing. Nothing else in the package imports it implicitly: the
CLI calls it for a CPU run and tests call it from ``conftest.py``.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False


class _Stream:
    """Stand-in for ``torch.cuda.Stream``/``Event``: every method is a no-op that returns another
    stand-in (``record_event()`` gives an event to ``synchronize()`` later)."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *a, **k: 0.0 if name == "elapsed_time" else _Stream()


def _cpu_device(value):
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, int) and not isinstance(value, bool):
        return "cpu"
    return value


class _CudaToCpu(TorchFunctionMode):
    """Maps tensor creation / moves that name the CUDA device onto the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda":
            return args[0]
        if name == "to" and len(args) > 1 and isinstance(args[1], (str, torch.device)):
            args = (args[0], _cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def enable_cpu_megatron() -> bool:
    """Install the CPU redirections once per process; returns True when installed (no CUDA)."""
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True
    cuda = torch.cuda
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: None  # the CPU generator is seeded by torch.manual_seed
    cuda.current_device = lambda: "cpu"
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    cuda.Stream = _Stream
    cuda.Event = _Stream
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None

    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    original_type = torch.Tensor.type

    @functools.wraps(original_type)
    def _type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and self.device.type == "cpu":
            name = original_type(self)  # may re-enter through the TorchFunctionMode: map once
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = _type

    from megatron.core.transformer.moe import moe_utils

    def _to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            return tensor.numpy() if as_numpy else tensor
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = _to_cpu
    try:
        from megatron.core.transformer.moe import token_dispatcher

        token_dispatcher.maybe_move_tensor_to_cpu = _to_cpu
    except ImportError:  # pragma: no cover - older megatron-core
        pass

    _CudaToCpu().__enter__()  # process-wide: the CPU run never leaves it
    _ENABLED = True
    return True
