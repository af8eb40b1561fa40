"""Weight transports behind one interface: ``push(version, items) -> metrics``.

``items`` is the stream of (HF name, tensor) from ``export.iter_hf_tensors``; transports cut it
into buckets of at most ``bucket_bytes`` (default 512 MiB) so memory stays bounded. Every push
carries the weight version and a per-tensor hash of the bytes sent (FP8 bytes and scales
included), which the receiving side checks where it can.

- ``InProcessTransport``: the embedded engine shares the trainer's model: hand over version + hashes.
- ``DiskTransport``: an HF directory (safetensors shards + index + config.json with the block-FP8
  ``quantization_config`` when FP8), written to a temp dir and renamed; for
  ``update_weights_from_disk``.
- ``BroadcastTransport``: a process group (NCCL on GPU, gloo in tests) from one sender to the
  rollout ranks, bucket by bucket; for ``update_weights_from_distributed``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_jetrl.files import replace_dir

DEFAULT_BUCKET_BYTES = 512 << 20


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with ``t``'s values that does not share ``t``'s storage. numpy (under
    safetensors and hashing) pins a storage's size, and the colocated scheduler must be able to
    resize parameter storages to 0 (``memory.Offloader``)."""
    out = t.detach().contiguous().cpu()
    return out.clone() if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() else out


def tensor_hash(t: torch.Tensor, owned: bool = False) -> str:
    """sha256 (first 16 hex) of a tensor's raw bytes (``owned``: ``t`` is already a private host copy)."""
    data = (t.contiguous() if owned else host_copy(t)).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def is_fp8_payload(name: str, t: torch.Tensor) -> bool:
    """The tensors the hand-over parity check covers: FP8 weights and their scales."""
    return t.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv")


def aligned_order(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Largest element size first: every offset is then a multiple of each later element size."""
    return sorted(bucket, key=lambda nt: -nt[1].element_size())


def bucketize(items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into buckets of at most ``bucket_bytes``. A single tensor larger than
    that (an 8B model's 1 GB embedding vs the 512 MiB default) travels alone in its own bucket: the
    receivers need whole tensors, and the tensor exists whole on the sender anyway."""
    bucket, size = [], 0
    for name, t in items:
        n = nbytes(t)
        if size + n > bucket_bytes and bucket:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


class InProcessTransport:
    """The embedded engine runs the trainer's own model object: no bytes move; the engine checks
    the sender's hashes against the FP8 bytes it will run with."""

    def __init__(self, engine):
        self.engine = engine

    def push(self, version: int, items: Iterable[tuple[str, torch.Tensor]]) -> dict:
        t0 = time.perf_counter()
        hashes = {name: tensor_hash(t) for name, t in items if is_fp8_payload(name, t)}
        out = self.engine.update_weights(version, hashes)
        out["sync_seconds"] = time.perf_counter() - t0
        return out


class DiskTransport:
    """Writes an HF checkpoint directory (what SGLang's ``update_weights_from_disk`` loads).

    With ``collective=True`` every rank of the default process group calls ``push`` with its own
    share of the export (e.g. each pipeline stage's exporter its layers): each writes its own
    shard files, rank 0 gathers the names and writes the index; no rank holds the whole model.
    ``record_hashes=False`` (the converters) skips hashing every tensor and weight_hashes.json."""

    def __init__(self, out_dir: str, hf_config: dict, shard_bytes: int = 5 << 30,
                 quantization_config: Optional[dict] = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 collective: bool = False, record_hashes: bool = True):
        self.out_dir, self.hf_config, self.shard_bytes = out_dir, hf_config, shard_bytes
        self.quantization_config, self.bucket_bytes = quantization_config, bucket_bytes
        self.record_hashes = record_hashes
        self.collective = collective and dist.is_initialized() and dist.get_world_size() > 1

    def push(self, version: int, items: Iterable[tuple[str, torch.Tensor]]) -> dict:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        rank = dist.get_rank() if self.collective else 0
        tmp = self.out_dir.rstrip("/") + ".tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        if self.collective:
            dist.barrier()
        weight_map, hashes, shard, size, files, total = {}, {}, {}, 0, [], 0

        def flush():
            nonlocal shard, size
            if shard:
                fname = f"part-{rank:05d}-{len(files) + 1:05d}.safetensors"
                save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt", "weight_version": str(version)})
                files.append(fname)
                weight_map.update({k: fname for k in shard})
                shard, size = {}, 0

        for bucket in bucketize(items, min(self.bucket_bytes, self.shard_bytes)):
            for name, t in bucket:
                n = nbytes(t)
                if size + n > self.shard_bytes:
                    flush()
                shard[name] = host_copy(t)
                if self.record_hashes:
                    hashes[name] = tensor_hash(shard[name], owned=True)
                size += n
                total += n
        flush()
        shares = [(files, weight_map, hashes, total)]
        if self.collective:
            shares = [None] * dist.get_world_size()
            dist.all_gather_object(shares, (files, weight_map, hashes, total))
        if rank == 0:
            self._finalize(tmp, version, shares)
        if self.collective:
            dist.barrier()
        n_tensors = sum(len(wm) for _, wm, _, _ in shares)
        return {"sync_seconds": time.perf_counter() - t0, "sync_bytes": sum(t for *_, t in shares),
                "sync_tensors": n_tensors}

    def _finalize(self, tmp: str, version: int, shares) -> None:
        # Shards get their final names (HF convention model-0000i-of-0000n) once all are known.
        all_files = [f for files, *_ in shares for f in files]
        renamed = {f: f"model-{i:05d}-of-{len(all_files):05d}.safetensors" for i, f in enumerate(all_files, 1)}
        for old, new in renamed.items():
            os.replace(os.path.join(tmp, old), os.path.join(tmp, new))
        final_map = {k: renamed[v] for _, wm, _, _ in shares for k, v in wm.items()}
        hashes = {k: v for _, _, h, _ in shares for k, v in h.items()}
        total = sum(t for *_, t in shares)
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total, "weight_version": version}, "weight_map": final_map}, f, indent=1)
        cfg = dict(self.hf_config)
        if self.quantization_config:
            cfg["quantization_config"] = self.quantization_config
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        if self.record_hashes:
            with open(os.path.join(tmp, "weight_hashes.json"), "w") as f:
                json.dump({"weight_version": version, "hashes": hashes}, f)
        replace_dir(tmp, self.out_dir)  # a server starting during a push finds one whole version


def verify_disk(out_dir: str) -> dict:
    """Receiving side of the disk transport: re-hash every tensor against weight_hashes.json."""
    from megatron_jetrl.models.hf_io import HFCheckpoint

    with open(os.path.join(out_dir, "weight_hashes.json")) as f:
        meta = json.load(f)
    ckpt = HFCheckpoint(out_dir)
    bad = [k for k, h in meta["hashes"].items() if tensor_hash(ckpt.raw(k)) != h]
    return {"parity_checked": len(meta["hashes"]), "parity_mismatch": len(bad), "weight_version": meta["weight_version"]}


_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64)}


class BroadcastTransport:
    """Bucketed broadcast from ``src`` over ``group``: per bucket one metadata object (names,
    shapes, dtypes), then one flat uint8 tensor; a final message carries version and hashes."""

    def __init__(self, group, src: int, device: torch.device, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.group, self.src, self.device, self.bucket_bytes = group, src, device, bucket_bytes

    def push(self, version: int, items: Iterable[tuple[str, torch.Tensor]]) -> dict:
        t0 = time.perf_counter()
        hashes, total = {}, 0
        for bucket in bucketize(items, self.bucket_bytes):
            bucket = aligned_order(bucket)  # every tensor at an offset aligned to its element size
            meta = [(n, list(t.shape), str(t.dtype)) for n, t in bucket]
            dist.broadcast_object_list([{"bucket": meta}], src=self.src, group=self.group)
            flat = torch.cat([t.detach().contiguous().view(torch.uint8).reshape(-1).to(self.device) for _, t in bucket])
            dist.broadcast(flat, src=self.src, group=self.group)
            for n, t in bucket:
                hashes[n] = tensor_hash(t)
            total += flat.numel()
        dist.broadcast_object_list([{"done": version, "hashes": hashes}], src=self.src, group=self.group)
        return {"sync_seconds": time.perf_counter() - t0, "sync_bytes": total, "sync_tensors": len(hashes)}

    def receive(self) -> tuple[int, dict[str, torch.Tensor], dict]:
        """Receiver side: returns (version, tensors, parity metrics). Applied only when whole."""
        tensors = {}
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            msg = box[0]
            if "done" in msg:
                bad = [k for k, h in msg["hashes"].items() if k not in tensors or tensor_hash(tensors[k]) != h]
                return msg["done"], tensors, {"parity_checked": len(msg["hashes"]), "parity_mismatch": len(bad)}
            sizes = [int(torch.Size(shape).numel()) * torch.empty((), dtype=_DTYPES[dt]).element_size()
                     for _, shape, dt in msg["bucket"]]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            dist.broadcast(flat, src=self.src, group=self.group)
            offset = 0
            for (name, shape, dt), n in zip(msg["bucket"], sizes):
                tensors[name] = flat[offset:offset + n].view(_DTYPES[dt]).view(shape).clone()
                offset += n
