"""Release device memory and take it back without rebuilding anything (colocated scheduling).

``Offloader`` copies the storages behind a set of tensors to host memory and resizes the device
storages to 0 bytes; ``reload`` resizes them back and copies the bytes in. Every tensor object, view
and optimizer reference stays valid (the storage object is the same), so Megatron's contiguous
param/grad buffers, the optimizer's master weights and moments, and the FP8 weight cache come back
bit-identical. On CPU the storages are resized too (this is what the tests check); the memory only
matters on GPU, where ``torch.cuda.memory_allocated`` drops by the offloaded bytes.
"""
from __future__ import annotations

from typing import Iterable

import torch


class Offloader:
    def __init__(self, tensors: Iterable[torch.Tensor], seen: set | None = None):
        """``seen``: storage keys already claimed by another Offloader (shared across groups)."""
        seen = set() if seen is None else seen
        self.storages = []
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key = (st.device, st.data_ptr())
            if st.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            self.storages.append(st)
        self.host: list[torch.Tensor] | None = None

    @property
    def offloaded(self) -> bool:
        return self.host is not None

    def nbytes(self) -> int:
        return sum(h.numel() for h in self.host) if self.host else sum(s.nbytes() for s in self.storages)

    @torch.no_grad()
    def offload(self) -> int:
        """Copy to host, free on device; returns the bytes released."""
        if self.offloaded:
            return 0
        pin = torch.cuda.is_available()
        self.host = []
        for st in self.storages:
            src = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
            host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=pin and st.device.type == "cuda")
            host.copy_(src)
            self.host.append(host)
        for st in self.storages:
            st.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return self.nbytes()

    @torch.no_grad()
    def reload(self) -> int:
        if not self.offloaded:
            return 0
        for st, host in zip(self.storages, self.host):
            st.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=st.device).set_(st).copy_(host)
        n, self.host = self.nbytes(), None
        return n


def is_released(t: torch.Tensor) -> bool:
    """Whether ``t`` is a released weight's placeholder (``Actor.release_weights``: one element expanded to the
    weight's shape, so its values are not the weight's)."""
    return t.numel() > 1 and not any(t.stride())


def optimizer_tensors(opt) -> list[torch.Tensor]:
    """Every tensor a Megatron optimizer (plain, mixed-precision, distributed or chained) holds:
    master parameters and the torch optimizer's state (Adam moments)."""
    out = []
    for inner in getattr(opt, "chained_optimizers", None) or [opt]:
        torch_opt = getattr(inner, "optimizer", inner)
        for group in torch_opt.param_groups:
            out.extend(group["params"])
        for state in torch_opt.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


def param_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters and the FP8 weight caches."""
    out = list(module.parameters())
    for m in module.modules():
        cache = getattr(m, "fp8_cache", None)
        if cache is not None and cache.qweight is not None:
            out += [cache.qweight, cache.scale_inv]
    return out


def grad_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Gradient buffers (Megatron's ``main_grad``, or ``.grad``)."""
    return [g for p in module.parameters() for g in (getattr(p, "main_grad", None), p.grad) if g is not None]


def model_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters, their gradient buffers and FP8 weight caches."""
    return param_tensors(module) + grad_tensors(module)


def freeze_python_gc() -> int:
    """Collect once, then move every live Python object into the permanent generation (``gc.freeze``):
    later full collections scan only objects created after this call. Returns how many were frozen.
    Frozen objects are still freed by reference counting; only cyclic garbage among them waits for
    :func:`unfreeze_python_gc` (call it before dropping a frozen model, or its cycles keep device memory)."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze_python_gc() -> None:
    """Undo :func:`freeze_python_gc` (the objects go back to the oldest generation) and collect."""
    import gc

    gc.unfreeze()
    gc.collect()
