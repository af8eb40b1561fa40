"""The fleet's weight transports to rollout servers: one class per ``rollout.weight_transport`` that moves tensors
(``disk`` writes an HF directory, ``transport.DiskTransport``, which the servers load by path).

- ``TensorBucketPush`` (``tensor``, ``jetrl serve`` only): buckets as base64 safetensors over HTTP
  (``/update_weights_from_tensor``, ``load_format=jetrl_safetensors``).
- ``DistributedBroadcastPush`` (``distributed``, SGLang's protocol): a weight-update process group with every
  server rank (``/init_weights_update_group``), then per bucket ``/update_weights_from_distributed`` on every
  server while this process broadcasts SGLang's ``FlattenedTensorBucket`` (``load_format=flattened_bucket``).

Both run inside the server's weight-update session (the fleet opens and closes it). A server is any object with
``client`` (the SGLang HTTP client), ``tp`` and ``up``; ``each(servers, fn)`` calls ``fn`` on every server
concurrently and leaves out the ones that fail (the fleet's ``_each``). ``send`` returns the bytes sent.
"""
from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable
from urllib.parse import urlsplit

import torch

from megatron_jetrl.sync.sglang_bucket import sglang_bucket_class
from megatron_jetrl.sync.transport import aligned_order, bucketize, host_copy, nbytes

Each = Callable[[list, Callable], list]


class TensorBucketPush:
    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes

    def send(self, servers: list, version: int, items: Iterable[tuple[str, torch.Tensor]], each: Each) -> int:
        from safetensors.torch import save as st_save

        total, buckets = 0, bucketize(items, self.bucket_bytes)
        bucket = next(buckets, None)
        while bucket is not None:  # one bucket in memory at a time (plus the next one's tensors as they stream)
            nxt = next(buckets, None)
            payload = base64.b64encode(st_save({n: host_copy(t) for n, t in bucket})).decode()
            total += sum(nbytes(t) for _, t in bucket)
            last = nxt is None
            each([s for s in servers if s.up], lambda s: s.client.update_weights_from_tensor(
                [payload], "jetrl_safetensors", str(version), last))
            bucket = nxt
        return total

    def close(self, servers: list) -> None:
        pass


class DistributedBroadcastPush:
    """Rank 0 of a process group whose other ranks are the servers' (``tp`` consecutive ranks each); the group
    is made again when the set of servers changes (a restart)."""

    def __init__(self, bucket_bytes: int, group_name: str = "jetrl_weight_update"):
        self.bucket_bytes, self.group_name = bucket_bytes, group_name
        self.group, self.members = None, ()

    def ensure_group(self, servers: list) -> None:
        from megatron_jetrl.distributed import address_toward, free_port, init_custom_group

        members = tuple(s.client.url for s in servers)
        if self.group is not None and members == self.members:
            return
        self.close(servers)
        offsets = [1]  # rank 0 is this process; server i's ranks start at offsets[i]
        for s in servers:
            offsets.append(offsets[-1] + s.tp)
        world, port = offsets[-1], free_port()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # where each server reaches this process's store; all loopback: the store listens on loopback only
        addresses = [address_toward(urlsplit(s.client.url).hostname) for s in servers]
        local = all(a == "127.0.0.1" for a in addresses)
        with ThreadPoolExecutor(len(servers)) as ex:
            futs = [ex.submit(s.client.init_weights_update_group, a, port, offset, world, self.group_name, backend)
                    for s, a, offset in zip(servers, addresses, offsets)]
            self.group = init_custom_group(backend, "127.0.0.1" if local else "0.0.0.0", port, 0, world, self.group_name)
            for f in futs:
                f.result()
        self.members = members

    def broadcast(self, flat: torch.Tensor) -> None:
        """One bucket, from this process (rank 0) to every server rank of the weight-update group."""
        import torch.distributed as dist

        dist.broadcast(flat, src=0, group=self.group)

    def send(self, servers: list, version: int, items: Iterable[tuple[str, torch.Tensor]], each: Each) -> int:
        self.ensure_group(servers)
        cls, total = sglang_bucket_class(), 0
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        buckets = bucketize(items, self.bucket_bytes)
        bucket = next(buckets, None)
        while bucket is not None:
            nxt = next(buckets, None)
            bucket = aligned_order([(n, t.to(dev)) for n, t in bucket])
            b = cls(named_tensors=bucket)
            names = [n for n, _ in bucket]
            dtypes = [str(t.dtype).replace("torch.", "") for _, t in bucket]
            shapes = [list(t.shape) for _, t in bucket]
            with ThreadPoolExecutor(len(servers)) as ex:  # the servers block in the broadcast until we send
                futs = [ex.submit(s.client.update_weights_from_distributed, names, dtypes, shapes, str(version),
                                  self.group_name, nxt is None) for s in servers]
                self.broadcast(b.get_flattened_tensor())
                for f in futs:
                    f.result()
            total += sum(nbytes(t) for _, t in bucket)
            bucket = nxt
        return total

    def close(self, servers: list) -> None:
        """Tear the group down: on ``servers`` (those that fail to answer are past caring) and here."""
        if self.group is None:
            return
        import torch.distributed as dist

        for s in servers:
            try:
                s.client.destroy_weights_update_group(self.group_name)
            except Exception:  # noqa: BLE001 - a dead server has no group to destroy
                pass
        dist.destroy_process_group(self.group)
        self.group, self.members = None, ()
