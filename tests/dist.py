"""Run a function in N gloo processes (spawned) and collect what each returns."""
from __future__ import annotations

import os
import pickle
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

from megatron_jetrl.distributed import free_port


class _FP8:
    """A float8 tensor in transit (megatron-core replaces torch's tensor unpickler with a
    weights-only one that rejects float8 storages)."""

    def __init__(self, t):
        self.data = t.view(torch.uint8)


def _encode(x):
    if isinstance(x, torch.Tensor) and x.dtype == torch.float8_e4m3fn:
        return _FP8(x)
    if isinstance(x, dict):
        return {k: _encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_encode(v) for v in x)
    return x


def _decode(x):
    if isinstance(x, _FP8):
        return x.data.view(torch.float8_e4m3fn)
    if isinstance(x, dict):
        return {k: _decode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_decode(v) for v in x)
    return x


def _entry(rank, world, port, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), CUDA_VISIBLE_DEVICES="")
    try:
        result = fn(rank, world, *args)
        payload = ("ok", _encode(result))
    except BaseException:  # report the worker's traceback to the test
        payload = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(payload, f)


def run_workers(fn, world: int, *args, timeout: float = 900):
    """``fn(rank, world, *args)`` in ``world`` processes; returns the list of results by rank."""
    out_dir = tempfile.mkdtemp(prefix="jetrl-dist-")
    ctx = mp.start_processes(_entry, args=(world, free_port(), out_dir, fn, args), nprocs=world,
                             join=False, start_method="spawn")
    while not ctx.join(timeout=timeout):
        pass
    results = []
    for rank in range(world):
        with open(os.path.join(out_dir, f"{rank}.pkl"), "rb") as f:
            status, value = pickle.load(f)
        if status != "ok":
            raise AssertionError(f"worker {rank} failed:\n{value}")
        results.append(_decode(value))
    return results
