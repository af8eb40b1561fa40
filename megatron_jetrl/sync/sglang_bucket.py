"""Buckets for SGLang's ``/update_weights_from_tensor`` (``load_format="flattened_bucket"``), built
with SGLang's own ``FlattenedTensorBucket``: one flat uint8 tensor + per-tensor metadata per bucket.

The fleet's HTTP client (``send``) serializes and posts each bucket; this module only cuts the
export stream into buckets, orders each bucket so every tensor starts at a byte offset aligned to
its element size (SGLang's receiving ``FlattenedTensorBucket.empty`` refuses unaligned offsets), and
records the per-tensor hashes for the parity check.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import time
from typing import Callable, Iterable

import torch

from megatron_jetrl.sync.transport import DEFAULT_BUCKET_BYTES, aligned_order, bucketize, nbytes, tensor_hash


def sglang_bucket_class():
    """SGLang's ``FlattenedTensorBucket``: the normal import where SGLang is fully installed, else
    the module file loaded on its own (it imports only torch; SGLang's package ``__init__`` needs the
    server's dependencies, absent on CPU machines that install ``sglang --no-deps``)."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        return FlattenedTensorBucket
    except ImportError:
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[name]  # drop the half-imported package
        try:
            path = str(importlib.metadata.distribution("sglang").locate_file("sglang/srt/weight_sync/tensor_bucket.py"))
        except importlib.metadata.PackageNotFoundError:
            raise ImportError("the SGLang bucket transport needs sglang: pip install 'megatron_jetrl[sglang]'") from None
        mod_spec = importlib.util.spec_from_file_location("_sglang_tensor_bucket", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        return module.FlattenedTensorBucket


class SGLangTensorBucketTransport:
    """``push(version, items)`` -> ``send(payload, version, last)`` once per bucket, where payload is
    ``{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata, ...]}``."""

    def __init__(self, send: Callable[[dict, int, bool], None], bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.send, self.bucket_bytes = send, bucket_bytes
        self.bucket_cls = sglang_bucket_class()
        self.last_hashes: dict[str, str] = {}

    def push(self, version: int, items: Iterable[tuple[str, torch.Tensor]]) -> dict:
        t0 = time.perf_counter()
        hashes, total, pending = {}, 0, None
        for bucket in bucketize(items, self.bucket_bytes):
            if pending is not None:
                self.send(pending, version, False)
            b = self.bucket_cls(named_tensors=aligned_order(bucket))
            for name, t in bucket:
                hashes[name] = tensor_hash(t)
                total += nbytes(t)
            pending = {"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()}
        if pending is not None:
            self.send(pending, version, True)
        self.last_hashes = hashes
        return {"sync_seconds": time.perf_counter() - t0, "sync_bytes": total, "sync_tensors": len(hashes)}


def receive_bucket(payload: dict) -> list[tuple[str, torch.Tensor]]:
    """What an SGLang server does with a payload (reconstruct views), for tests and the in-process
    server of ``jetrl serve``."""
    cls = sglang_bucket_class()
    return cls(flattened_tensor=payload["flattened_tensor"], metadata=payload["metadata"]).reconstruct_tensors()
