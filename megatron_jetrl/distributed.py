"""Process groups: torch.distributed (NCCL on GPU, gloo on CPU) + megatron-core model parallel."""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from megatron_jetrl.env import launched, local_rank
from megatron_jetrl.config import ConfigError, ParallelConfig


def free_port() -> int:
    """A TCP port free on this host right now (for a rendezvous, a server, a store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive TCP ports free on this host right now, below the kernel's ephemeral range (a
    server fleet's ports: no socket another process binds to port 0 can take one of them before the servers
    start, as it can take a :func:`free_port`)."""
    import random

    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(200):
        base = random.randrange(10000, max(10001, low - n))
        socks = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"free_ports: no {n} consecutive free ports below {low}")


def address_toward(host: str) -> str:
    """This machine's address as seen from ``host``: the local address of its route there (a process on ``host``
    connects back to it, e.g. to a weight-update group's store); loopback for a loopback host. Not the host name's
    own address: clusters (and Debian's default /etc/hosts) often map a node's name to 127.0.0.1 or 127.0.1.1,
    which a process on another node cannot reach. A UDP ``connect`` picks the route and sends nothing."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)
        target = infos[0][4][0]
        if target.startswith("127."):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:  # unresolvable or unroutable from here: the host name's address is all there is
        return socket.gethostbyname(socket.gethostname())


def init_distributed(parallel: ParallelConfig, seed: int = 1234) -> None:
    """Initialize torch.distributed from the torchrun environment (or as a single process) and
    megatron-core's TP/PP/EP/DP groups. On a CPU-only machine installs ``platform``'s redirections."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron_jetrl.platform import enable_cpu_megatron

    cuda = torch.cuda.is_available()
    if not cuda:
        enable_cpu_megatron()
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(local_rank())
        if launched():  # torchrun / Slurm: env:// rendezvous
            dist.init_process_group("nccl" if cuda else "gloo")
        else:  # a single process; nothing is written to the environment (child processes stay clean)
            # an in-memory store: no port at all (torch's TCPStore listens on every interface, and a port
            # picked first and bound later raced with other processes starting at the same moment)
            dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    mp = parallel.tensor_parallel * parallel.pipeline_parallel
    if world % mp:
        raise ConfigError(f"config error: parallel.tensor_parallel: {world} process(es) are not divisible by "
                          f"tensor_parallel x pipeline_parallel = {mp}; launch a multiple of {mp} processes "
                          f"(torchrun --nproc-per-node {mp}) or lower the model parallelism")
    sizes = (parallel.tensor_parallel, parallel.pipeline_parallel, parallel.expert_parallel)
    if parallel_state.model_parallel_is_initialized() and _megatron_sizes() != sizes:
        parallel_state.destroy_model_parallel()
    # Called again in one process with the same layout (a second model, the tests), the existing groups
    # are kept: re-creating them each time left every old gloo group's threads running (torch keeps a
    # group until destroy_process_group(group); megatron's destroy_model_parallel only drops its references).
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_parallel,
            pipeline_model_parallel_size=parallel.pipeline_parallel,
            expert_model_parallel_size=parallel.expert_parallel,
            expert_tensor_parallel_size=1,  # experts are split over EP only (name tables assume it)
        )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _megatron_sizes() -> tuple[int, int, int]:
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size())


def is_rank0() -> bool:
    """Global rank 0, or no process group at all (a plain single process)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    """``dist.barrier()`` when there is a process group; nothing otherwise."""
    if dist.is_initialized():
        dist.barrier()


def rank0_decides(flag: bool) -> bool:
    """Global rank 0's ``flag`` on every rank (a one-element broadcast; ``flag`` itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([float(flag)], device=dev)
    dist.broadcast(t, 0)
    return bool(t.item())


def rank_share() -> tuple[int, int]:
    """(global rank, world size); (0, 1) without a process group."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def first_of_ranks(value):
    """The first non-None of every rank's ``value``, in rank order (the same on every rank); ``value`` itself
    without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return next((v for v in every if v is not None), None)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def init_custom_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str, timeout_s: float = 600.0):
    """A process group outside the default one, between a trainer (rank 0) and rollout servers
    (ranks ``rank_offset + tp_rank``), for ``/update_weights_from_distributed``.

    Built the way SGLang's ``init_custom_process_group`` builds the servers' side (TCP rendezvous at
    ``master_address:master_port``, a store prefixed with the group name, torch's process-group
    helper, identity rank map), so the trainer's side here and a real SGLang server join the same
    group. torch has no public API for a group that is not a subgroup of the default one; this is
    the one place that reaches into ``distributed_c10d``."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    # The TCP store directly, not ``rendezvous("tcp://...")``: under torchrun that one sees
    # TORCHELASTIC_USE_AGENT_STORE and makes rank 0 a client of a store nobody serves. Same wire
    # protocol as the store SGLang's side builds.
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def dp_rank_size() -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel world size)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def reduce_over_dp(m: dict) -> dict:
    """Step metrics as one number per run: mean over the DP ranks that report a key (max/min for
    *_max/*_min). Ranks may report different keys (only rank 0 talks to a fleet's servers)."""
    from megatron.core import parallel_state

    if dp_rank_size()[1] == 1:
        return m
    mine = {k: float(v) for k, v in m.items()}
    every = [None] * dp_rank_size()[1]
    dist.all_gather_object(every, mine, group=parallel_state.get_data_parallel_group())
    out = {}
    for k in sorted(set().union(*every)):
        vals = [d[k] for d in every if k in d]
        out[k] = max(vals) if k.endswith("_max") else min(vals) if k.endswith("_min") else sum(vals) / len(vals)
    return out


def is_logging_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
