"""``jetrl launch``: from the run config and the cluster shape, the trainer layout, the SGLang fleet,
the per-GPU memory estimate and the per-node commands; ``--dry-run`` prints them, otherwise this
node's share runs (SGLang servers in the background, then the checkpoint conversion and the
trainer under torchrun).

Cluster shape: ``--nodes/--gpus-per-node`` or Slurm's environment (SLURM_JOB_NUM_NODES,
SLURM_GPUS_ON_NODE, SLURM_NODEID, SLURM_JOB_NODELIST). Placement:

- colocated: every GPU runs a trainer rank and belongs to one SGLang server (``server_tp`` GPUs, on
  the same node, ``--enable-memory-saver``); the trainer offloads while the servers generate.
- disaggregated: the last ``--rollout-gpus`` GPUs (whole nodes when more than one node) run the
  servers; the rest train; weights go over an NCCL broadcast group.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading

from megatron_jetrl.env import ADMIN_API_KEY, admin_api_key, snapshot
from megatron_jetrl.files import write_atomic
from megatron_jetrl.launch.planner import (FRAGMENTATION, GB, OVERHEAD, Layout, PlanError, ServerMemory, param_counts,
                                           search_layouts, server_memory, trainer_memory, valid_tp)
from megatron_jetrl.precision.recipe import FP8Recipe

TRAIN_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1",      # Megatron's TP comm/compute overlap ordering
             "NCCL_NVLS_ENABLE": "0",                 # NVLink SHARP multicast off (see docs/cluster.md)
             "TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}  # frees NCCL buffers promptly
RDZV_PORT = 29500
SERVER_BASE_PORT = 30000


def expand_nodelist(spec: str) -> list[str]:
    """Slurm's compressed host list (``gpu[001-003,007],login1``) -> host names."""
    hosts = []
    parts = re.findall(r"[^,\[]+(?:\[[^\]]*\])?", spec)
    for part in parts:
        m = re.fullmatch(r"(.*)\[(.*)\]", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges = m.groups()
        for r in ranges.split(","):
            if "-" in r:
                a, b = r.split("-")
                hosts += [f"{prefix}{str(k).zfill(len(a))}" for k in range(int(a), int(b) + 1)]
            else:
                hosts.append(prefix + r)
    return hosts


@dataclasses.dataclass
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_mem_gb: float
    hosts: list[str]
    node_rank: int = 0

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def cluster_from(args, env: dict | None = None) -> Cluster:
    env = snapshot() if env is None else env
    nodes = args.nodes or int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    gpn = args.gpus_per_node or int(re.sub(r"\D.*", "", env.get("SLURM_GPUS_ON_NODE", "") or "0") or 0) or 8
    hosts = expand_nodelist(env["SLURM_JOB_NODELIST"]) if env.get("SLURM_JOB_NODELIST") else \
        (args.hosts.split(",") if args.hosts else [f"node{i}" for i in range(nodes)])
    if len(hosts) < nodes:
        raise PlanError(f"launch: {nodes} nodes but {len(hosts)} host names; give --hosts h1,h2,...")
    node_rank = args.node_rank if args.node_rank is not None else int(env.get("SLURM_NODEID", 0))
    return Cluster(nodes, gpn, args.gpu_mem_gb, hosts[:nodes], node_rank)


def launch_identity(given: str | None, env: dict | None = None) -> str:
    """The launch's identity, the same on every node (``rollout.launch_id``): ``--launch-id``, else Slurm's job id,
    restart count and step id (every node's task of one ``srun`` shares them; a requeued job keeps its id and counts
    a restart, a resumed one has another id), else none."""
    if given is not None:
        return given
    env = snapshot() if env is None else env
    job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID")
    return f"{job}.{env.get('SLURM_RESTART_COUNT') or 0}.{step}" if job and step else ""


@dataclasses.dataclass
class Plan:
    cluster: Cluster
    mode: str
    layout: Layout
    trainer_gpus: int
    trainer_nodes: list[int]
    trainer_mem: object
    server_tp: int
    servers: list[tuple[int, list[int]]]   # (node, gpu ids) per server
    server_mem: ServerMemory
    peak_gb: float
    tried: list
    params_b: float
    server_base_port: int = SERVER_BASE_PORT
    rdzv_port: int = RDZV_PORT

    def summary(self) -> dict:
        return {
            "model_params_B": round(self.params_b, 3),
            "cluster": f"{self.cluster.nodes}x{self.cluster.gpus_per_node} GPUs, {self.cluster.gpu_mem_gb:g} GB each",
            "scheduler": self.mode,
            "trainer": {"gpus": self.trainer_gpus, "tensor_parallel": self.layout.tp,
                        "pipeline_parallel": self.layout.pp, "data_parallel": self.layout.dp,
                        "memory_gb_per_gpu": {k: round(v, 2) for k, v in self.trainer_mem.rows().items()}},
            "rollout": {"servers": len(self.servers), "tp_per_server": self.server_tp,
                        "placement": [f"node{n}:gpus{','.join(map(str, g))}" for n, g in self.servers],
                        "memory_gb_per_gpu": {"weights": round(self.server_mem.weights / GB, 2),
                                              "kv_pool": round(self.server_mem.kv_pool / GB, 2),
                                              "mem_fraction_budget": round(self.server_mem.budget / GB, 2)}},
            "peak_gb_per_gpu": round(self.peak_gb, 2),
        }


def make_plan(cfg, cluster: Cluster, *, seq_len: int, concurrency: int, rollout_gpus: int = 0,
              fixed_tp: int = 0, fixed_pp: int = 0) -> Plan:
    m, mode = cfg.model, cfg.precision.mode
    gpu_mem = cluster.gpu_mem_gb * GB
    colocated = cfg.scheduler.mode == "colocated"
    fp8_rollout = mode in ("jet", "fp8_rollout")
    context_len = seq_len

    # SGLang: the smallest TP it accepts for this model (FP8 blocks per shard) whose weights + KV pool
    # fit in mem_fraction (within one node).
    server_tp, smem, refused = 0, None, []
    recipe = FP8Recipe.from_config(cfg.precision)
    for t in ((1,) if cfg.rollout.engine == "serve" else (1, 2, 4, 8, 16)):  # jetrl serve is one process
        if t > cluster.gpus_per_node:
            continue
        why = recipe.sglang_tp_problem(heads=m.num_attention_heads, kv_heads=m.num_key_value_heads,
                                       head_dim=m.head_dim, ffn=m.ffn_hidden_size, tp=t)
        if why is not None:
            refused.append(why)
            continue
        smem = server_memory(m, t, fp8=fp8_rollout, concurrency=concurrency, context_len=context_len,
                             mem_fraction=cfg.rollout.mem_fraction, gpu_mem=gpu_mem, kv_fp8=recipe.rollout_kv_fp8)
        if smem.fits:
            server_tp = t
            break
    if not server_tp and smem is None:
        raise PlanError(f"launch: SGLang accepts no server TP up to {cluster.gpus_per_node} GPUs for this model "
                        f"({'; '.join(refused)}); use precision.mode=bf16 or rollout.engine=serve")
    if not server_tp:
        raise PlanError(f"launch: one SGLang server does not fit even at TP={cluster.gpus_per_node}: weights "
                        f"{smem.weights / GB:.1f} GB + KV {smem.kv_pool / GB:.1f} GB per GPU > "
                        f"{smem.budget / GB:.1f} GB; lower --concurrency / --seq-len or raise rollout.mem_fraction")

    if colocated:
        trainer_gpus, rollout_gpu_ids = cluster.gpus, list(range(cluster.gpus))
    else:
        rollout_gpus = rollout_gpus or max(server_tp, cluster.gpus // 2)
        if cluster.nodes > 1 and rollout_gpus % cluster.gpus_per_node:
            raise PlanError(f"launch: --rollout-gpus {rollout_gpus} must be whole nodes of {cluster.gpus_per_node} "
                            "GPUs on a multi-node cluster")
        if rollout_gpus % server_tp or rollout_gpus >= cluster.gpus:
            raise PlanError(f"launch: --rollout-gpus {rollout_gpus} must be a multiple of the server TP {server_tp} "
                            f"and leave GPUs for training (of {cluster.gpus})")
        trainer_gpus = cluster.gpus - rollout_gpus
        rollout_gpu_ids = list(range(trainer_gpus, cluster.gpus))
    servers = []
    for i in range(0, len(rollout_gpu_ids), server_tp):
        ids = rollout_gpu_ids[i:i + server_tp]
        servers.append((ids[0] // cluster.gpus_per_node, [g % cluster.gpus_per_node for g in ids]))

    def fits(lay: Layout):
        if not valid_tp(m, lay.tp, mode):
            return False, f"TP={lay.tp} does not divide the heads/FFN/vocab in whole 128-row FP8 blocks"
        if m.num_layers % lay.pp:
            return False, f"PP={lay.pp} does not divide {m.num_layers} layers"
        tm = trainer_memory(m, lay, mode=mode, params_dtype=cfg.precision.params_dtype,
                            micro_batch=cfg.algo.micro_batch_size, seq_len=seq_len, recompute=cfg.parallel.recompute,
                            distributed_optimizer=cfg.parallel.distributed_optimizer)
        peak = tm.total
        if colocated:  # the push: trainer params + FP8 cache next to the servers' weights (the rest offloaded)
            push = (tm.params + tm.fp8_cache + OVERHEAD) * FRAGMENTATION + smem.weights
            peak = max(peak, push, smem.budget + OVERHEAD)
        ok = peak <= gpu_mem
        return ok, (tm, peak)

    per_node = min(cluster.gpus_per_node, trainer_gpus)
    lay, tried = search_layouts(m, trainer_gpus, per_node, fits, fixed_tp, fixed_pp)
    if lay is None:
        best = min((d for _, d in tried if isinstance(d, tuple)), key=lambda d: d[1], default=None)
        need = f"{best[1] / GB:.1f} GB per GPU at best" if best else "no valid layout"
        knob = ("add nodes (--nodes), " + ("" if cfg.parallel.recompute == "full" else "set parallel.recompute=full, ")
                + "lower algo.micro_batch_size or --seq-len"
                + (", or use scheduler.mode=disaggregated" if colocated else ", or give training more GPUs (--rollout-gpus)"))
        raise PlanError(f"launch: {m.model_type} ({param_counts(m).total / 1e9:.1f}B) does not fit {trainer_gpus} x "
                        f"{cluster.gpu_mem_gb:g} GB for training: {need}; {knob}")
    tm, peak = fits(lay)[1]
    trainer_nodes = sorted({g // cluster.gpus_per_node for g in range(trainer_gpus)})
    return Plan(cluster, cfg.scheduler.mode, lay, trainer_gpus, trainer_nodes, tm, server_tp, servers, smem,
                peak / GB, tried, param_counts(m).total / 1e9)


def server_urls(plan: Plan) -> list[tuple[int, int, str]]:
    """(node, port, url) of every SGLang server."""
    out, per_node = [], {}
    for node, _ in plan.servers:
        k = per_node[node] = per_node.get(node, -1) + 1
        port = plan.server_base_port + k
        out.append((node, port, f"http://{plan.cluster.hosts[node]}:{port}"))
    return out


def resolve_config(cfg, plan: Plan, run_dir: str, ckpt_dir: str | None, launch_id: str = ""):
    """The run config the trainer gets: the planned layout, the fleet's addresses, the launch's identity
    (:func:`launch_identity`). It holds no admin key (it is
    written to the shared run directory): the trainer and ``jetrl serve`` workers get the key in their environment
    (``JETRL_ADMIN_API_KEY``), SGLang servers in a YAML file of their ``--config`` (:func:`admin_key_file`)."""
    cfg = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, tensor_parallel=plan.layout.tp, pipeline_parallel=plan.layout.pp),
        rollout=dataclasses.replace(cfg.rollout, engine="serve" if cfg.rollout.engine == "serve" else "sglang",
                                    server_addresses=[u for *_, u in server_urls(plan)], launch_id=launch_id,
                                    admin_api_key=None, server_tp=plan.server_tp,
                                    weight_transport="distributed" if plan.layout.pp == 1 else "disk"),
        checkpoint=dataclasses.replace(cfg.checkpoint, load_path=ckpt_dir or cfg.checkpoint.load_path),
        logging=dataclasses.replace(cfg.logging, run_dir=run_dir))
    return dataclasses.replace(cfg)  # every cross-check again on the resolved tree


def admin_key_file(run_dir: str, node: int) -> str:
    """The YAML file (``admin-api-key: KEY``, mode 0600) a node's SGLang servers read their admin key from through
    SGLang's ``--config``: the key stays off their command lines (``ps``) and out of the printed commands."""
    return os.path.join(run_dir, "admin", f"sglang_node{node}.yaml")


def commands(plan: Plan, cfg, config_path: str, *, hf_checkpoint: str | None, ckpt_dir: str | None,
             python: str = "python") -> dict[int, list[list[str]]]:
    """Per node, in order. Servers (background) wait for this launch's trainer's initial weights
    (``RUN_DIR/rollout/weights``, block FP8 in the recipe's format, written at setup: those the file
    ``rollout/weights.launch`` says are of ``rollout.launch_id``; without an identity, those newer than ``config_path``,
    which the launch writes before it starts them) and load them;
    trainer nodes convert the HF checkpoint (if given; again over an earlier conversion with
    ``checkpoint.overwrite``; a resumed run gives none: it loads its own checkpoint) and train under torchrun. No
    command holds the admin key:
    SGLang servers read it from :func:`admin_key_file`, the trainer and ``jetrl serve`` workers from
    ``JETRL_ADMIN_API_KEY`` in the environment ``jetrl launch`` starts them with."""
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.rollout.sglang import serve_argv, sglang_server_argv
    from megatron_jetrl.trainer.run_dir import LAUNCH_MARK, WEIGHTS_DIR

    c = plan.cluster
    recipe = FP8Recipe.from_config(cfg.precision)
    model_dir = os.path.join(cfg.logging.run_dir, WEIGHTS_DIR)
    if cfg.rollout.launch_id:  # the weights this launch's trainer wrote, whenever this node starts
        mark = shlex.quote(os.path.join(cfg.logging.run_dir, LAUNCH_MARK))
        fresh = f'[ "$(cat {mark} 2>/dev/null)" = {shlex.quote(cfg.rollout.launch_id)} ]'
    else:  # newer than this launch's config (a launch again in the run directory finds the earlier launch's, which
        # its trainer is about to replace); a node whose launch starts after the trainer wrote them never starts
        fresh = f"[ {shlex.quote(model_dir + '/config.json')} -nt {shlex.quote(config_path)} ]"
    out: dict[int, list[list[str]]] = {n: [] for n in range(c.nodes)}
    env = ["env", *[f"{k}={v}" for k, v in TRAIN_ENV.items()]]
    for i, ((node, gpus), (_, port, _)) in enumerate(zip(plan.servers, server_urls(plan))):
        if cfg.rollout.engine == "serve":  # jetrl serve workers (CPU clusters, CI)
            argv = [*serve_argv(cfg, model_dir, port, i), "--host", "0.0.0.0"]
            launch = shlex.join([*env, f"CUDA_VISIBLE_DEVICES={gpus[0]}", python, "-m", "megatron_jetrl.cli", "serve", *argv])
        else:
            argv = sglang_server_argv(cfg, recipe, model_dir, port, base_gpu_id=gpus[0], colocated=plan.mode == "colocated",
                                      key_file=admin_key_file(cfg.logging.run_dir, node))
            argv[argv.index("--host") + 1] = "0.0.0.0"
            launch = shlex.join([*env, python, "-m", "sglang.launch_server", *argv])
        out[node].append(["bash", "-c", f"until {fresh}; do sleep 2; done; exec {launch}"])
    master = c.hosts[plan.trainer_nodes[0]]
    torchrun = [python, "-m", "torch.distributed.run", f"--nnodes={len(plan.trainer_nodes)}",
                f"--nproc-per-node={min(c.gpus_per_node, plan.trainer_gpus)}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={master}:{plan.rdzv_port}", "--rdzv-id=jetrl"]
    for rank, node in enumerate(plan.trainer_nodes):
        base = [*env, *torchrun, f"--node-rank={rank}"]
        if hf_checkpoint:
            out[node].append([*base, "-m", "megatron_jetrl.cli", "convert", "hf-to-megatron", hf_checkpoint, ckpt_dir,
                              *(["--overwrite"] if cfg.checkpoint.overwrite else []),
                              f"parallel.tensor_parallel={plan.layout.tp}", f"parallel.pipeline_parallel={plan.layout.pp}"])
        out[node].append([*base, "-m", "megatron_jetrl.cli", "train", "--config", config_path])
    return out


READY_MARKERS = ("jetrl serve: ready", "ready to roll")  # `jetrl serve`'s and SGLang's ready lines


def _said_ready(log_path: str) -> bool:
    try:
        with open(log_path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return False
    return any(m in text for m in READY_MARKERS)


DONE_FILE = "launch_done.json"  # in the run directory: the training's end, for the rollout-only nodes


def write_done(path: str, rc: int, launch_id: str = "") -> None:
    """The first trainer node's launch says the training ended (its exit code; its launch's identity), atomically."""
    write_atomic(path, json.dumps({"rc": rc, "launch": launch_id}))


def _done_rc(done_path: str, since_path: str, launch_id: str) -> int | None:
    """The training's exit code if ``done_path`` is this launch's: it names ``launch_id``, or without an identity it
    is newer than ``since_path`` (this launch's config; an earlier launch's file is older); else None."""
    try:
        if not launch_id and os.path.getmtime(done_path) <= os.path.getmtime(since_path):
            return None
        with open(done_path) as f:
            done = json.load(f)
    except (OSError, ValueError):  # not written yet
        return None
    if launch_id and done.get("launch") != launch_id:
        return None
    return int(done.get("rc", 0))


def serve_until_trained(servers: list[subprocess.Popen], done_path: str, since_path: str, poll_s: float = 5.0,
                        launch_id: str = "") -> int:
    """A rollout-only node (disaggregated, more than one node) serves until the first trainer node's launch writes
    this launch's ``done_path`` (:func:`_done_rc`), then returns the training's exit code (the caller stops its
    servers: every node of a failed training ends failed); or, if every server exits first, their worst exit code.
    Without it the node's servers would outlive the training and hold the job's allocation until its time limit."""
    import time

    while True:
        codes = [p.poll() for p in servers]
        if all(c is not None for c in codes):
            return max(codes)
        rc = _done_rc(done_path, since_path, launch_id)
        if rc is not None:
            print(f"launch: the training ended with code {rc}: stopping this node's rollout servers", file=sys.stderr)
            return rc
        time.sleep(poll_s)


def run_beside_servers(cmd: list[str], servers: list[subprocess.Popen], logs: list[str], poll_s: float = 1.0,
                       env: dict | None = None) -> int:
    """Run ``cmd`` (the trainer) while this node's rollout servers run in the background. A server that exits
    with an error before its log says it is ready stops the job at once, its log named, instead of leaving
    the trainer waiting ``rollout.health_timeout_s`` for a server that will never answer. A server that
    fails after it was ready is left to the fleet (it retries that server's prompts elsewhere). ``env``: the
    trainer's environment (None: this process's)."""
    trainer = subprocess.Popen(cmd, env=env)
    done: set[int] = set()
    try:
        while True:
            try:
                return trainer.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                pass
            for i, (p, log) in enumerate(zip(servers, logs)):
                rc = p.poll()
                if i in done or rc is None:
                    continue
                done.add(i)
                if rc != 0 and not _said_ready(log):
                    print(f"launch: rollout server {i} exited with code {rc} before it was ready; its log: {log}",
                          file=sys.stderr)
                    trainer.terminate()
                    try:
                        trainer.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        trainer.kill()
                    return rc
    finally:  # stopped from outside (a signal, Ctrl-C): torchrun gets SIGTERM, which it passes to its workers
        if trainer.poll() is None:
            trainer.terminate()
            try:
                trainer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                trainer.kill()
                trainer.wait()


class Terminated(Exception):
    """SIGTERM reached ``jetrl launch`` (``scancel``, a job's time limit, ``kill``): raised where it waits, so that it
    stops its trainer and servers and says the training ended before it exits."""


def _on_sigterm(signum, frame):
    raise Terminated()


def load_launch_config(path: str | None, overrides: list[str], hf_checkpoint: str | None, dry_run: bool = False,
                       notes: list | None = None):
    """The run config; with ``hf_checkpoint``, its model as the checkpoint states it (shapes, RoPE scaling, special
    tokens, generation config: ``model.hf_path``) and its tokenizer, whatever the preset says: the plan is made for
    that model, and the trainer builds the model the conversion wrote (``check_model_matches`` holds it to that). A
    dry run away from the checkpoint (no config.json there) plans with the config's own model and says so in
    ``notes``; a run refuses it (``ConfigError``)."""
    from megatron_jetrl.config import ConfigError, load_config

    if not hf_checkpoint:
        return load_config(path, overrides)
    try:
        return load_config(path, [*overrides, f"model.hf_path={hf_checkpoint}", f"model.tokenizer={hf_checkpoint}"])
    except ConfigError:
        if not (dry_run and not os.path.isfile(os.path.join(hf_checkpoint, "config.json"))):
            raise
    if notes is not None:
        notes.append(f"launch: {hf_checkpoint} has no config.json here: the plan takes the config's model (a run "
                     "takes the checkpoint's)")
    return load_config(path, overrides)


def main(argv=None) -> int:
    from megatron_jetrl.config import ConfigError, save_config
    from megatron_jetrl.rollout.sglang import server_env, write_admin_key_file

    ap = argparse.ArgumentParser(prog="jetrl launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", help="preset in examples/configs")
    ap.add_argument("--config", help="YAML config")
    ap.add_argument("--nodes", type=int, help="nodes (default SLURM_JOB_NUM_NODES or 1)")
    ap.add_argument("--gpus-per-node", type=int, help="GPUs per node (default SLURM_GPUS_ON_NODE or 8)")
    ap.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory per GPU in GB (H100/H800 80, H200 141)")
    ap.add_argument("--hosts", help="comma-separated host names (default from SLURM_JOB_NODELIST)")
    ap.add_argument("--node-rank", type=int, help="this node's index (default SLURM_NODEID or 0)")
    ap.add_argument("--seq-len", type=int, default=8192, help="prompt + response tokens per sample")
    ap.add_argument("--concurrency", type=int, default=32,
                    help="full-length sequences in flight per SGLang server (sizes its KV pool)")
    ap.add_argument("--rollout-gpus", type=int, default=0, help="disaggregated: GPUs for the SGLang fleet")
    ap.add_argument("--tp", type=int, default=0, help="force the trainer's tensor parallel size")
    ap.add_argument("--pp", type=int, default=0, help="force the trainer's pipeline parallel size")
    ap.add_argument("--server-base-port", type=int, default=SERVER_BASE_PORT, help="first rollout server port per node")
    ap.add_argument("--rdzv-port", type=int, default=RDZV_PORT, help="torchrun rendezvous port")
    ap.add_argument("--hf-checkpoint", help="HF model dir: converted to a megatron checkpoint before training")
    ap.add_argument("--run-dir", default=None, help="run directory (default logging.run_dir)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in the run directory from its newest intact checkpoint (no conversion)")
    ap.add_argument("--overwrite", action="store_true",
                    help="start over in a run directory that holds a run: convert --hf-checkpoint again and delete the "
                    "run's checkpoints and metrics")
    ap.add_argument("--launch-id", default=None,
                    help="this launch's identity, the same on every node (default under Slurm: the job id, restart count "
                    "and step id): "
                    "servers start on the weights of the trainer of this launch, however late their node starts")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, memory and commands; start nothing")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = ap.parse_args(argv)
    if args.hf_checkpoint:  # the trainer's config and every node's conversion name it: one absolute path
        args.hf_checkpoint = os.path.abspath(args.hf_checkpoint)
    from megatron_jetrl.config import preset_path

    path = args.config or (preset_path(args.preset) if args.preset else None)
    overrides = [*args.overrides, *(["checkpoint.resume=true"] if args.resume else []),
                 *(["checkpoint.overwrite=true"] if args.overwrite else [])]
    notes = []  # said on a dry run
    try:
        cfg = load_launch_config(path, overrides, args.hf_checkpoint, args.dry_run, notes)
        cluster = cluster_from(args)
        plan = make_plan(cfg, cluster, seq_len=args.seq_len, concurrency=args.concurrency,
                         rollout_gpus=args.rollout_gpus, fixed_tp=args.tp, fixed_pp=args.pp)
    except (ConfigError, PlanError) as e:
        print(str(e), file=sys.stderr)
        return 2
    plan.server_base_port, plan.rdzv_port = args.server_base_port, args.rdzv_port
    run_dir = os.path.abspath(args.run_dir or cfg.logging.run_dir)
    config_path = os.path.join(run_dir, "launch_config.yaml")
    ckpt_dir = os.path.join(run_dir, "mcore_init") if args.hf_checkpoint else None
    refusals = []  # what a real run refuses before it writes anything (a dry run says it and shows the commands)
    # one key for the whole fleet: each node's launch starts its own servers, so a key made up here would differ
    # from node to node and the trainer's weight pushes would be refused by every other node's servers
    admin_key = cfg.rollout.admin_api_key or admin_api_key()
    if admin_key is None and cluster.nodes > 1:
        refusals.append(f"launch: the servers of {cluster.nodes} nodes need one admin key: export "
                        "JETRL_ADMIN_API_KEY=$(openssl rand -hex 16) before srun (the same value on every node), or "
                        "set rollout.admin_api_key")
    admin_key = admin_key or secrets.token_hex(16)
    # a launch again in the same run directory (after a crash, say) finds the first one's conversion
    if ckpt_dir and not (args.resume or args.overwrite) and os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        refusals.append(f"launch: {ckpt_dir} holds an earlier launch's conversion; --resume continues that run from "
                        "its newest checkpoint, --overwrite converts again and starts over")
    if refusals and not args.dry_run:
        print(refusals[0], file=sys.stderr)
        return 2
    for line in refusals:
        notes.append(line + " (a dry run shows the commands regardless)")
    launch_id = launch_identity(args.launch_id)
    if not launch_id and plan.servers and cluster.nodes > 1:
        notes.append("launch: no launch identity (no Slurm job, no --launch-id): every node's launch must start before "
                     "the trainer writes its initial weights; give each node the same --launch-id for late nodes to join")
    for line in notes:
        print(line, file=sys.stderr)
    try:
        resolved = resolve_config(cfg, plan, run_dir, ckpt_dir, launch_id)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    cmds = commands(plan, resolved, config_path, hf_checkpoint=None if args.resume else args.hf_checkpoint,
                    ckpt_dir=ckpt_dir, python=sys.executable)
    summary = {**plan.summary(), "launch_id": launch_id}
    if args.json:
        print(json.dumps({**summary, "commands": {str(k): [shlex.join(c) for c in v] for k, v in cmds.items()}}, indent=1))
    else:
        print(json.dumps(summary, indent=1))
        for node, cs in cmds.items():
            print(f"# node {node} ({cluster.hosts[node]})")
            for c in cs:
                print(shlex.join(c) + (" &" if c[0] == "bash" else ""))
    if args.dry_run:
        return 0
    os.makedirs(run_dir, exist_ok=True)
    save_config(resolved, config_path)
    mine = cmds[cluster.node_rank]
    if resolved.rollout.engine == "sglang" and any(c[0] == "bash" for c in mine):
        write_admin_key_file(admin_key_file(run_dir, cluster.node_rank), admin_key)
    done_path = os.path.join(run_dir, DONE_FILE)
    procs, logs, rc = [], [], 0
    # servers run in sessions of their own (a signal to this process group does not reach them): on SIGTERM this
    # launch stops them itself
    on_term = signal.signal(signal.SIGTERM, _on_sigterm) if threading.current_thread() is threading.main_thread() else None
    try:
        for c in mine:
            if c[0] == "bash":  # a server: in the background
                logs.append(os.path.join(run_dir, f"sglang_node{cluster.node_rank}_{len(procs)}.log"))
                with open(logs[-1], "ab") as log:
                    procs.append(subprocess.Popen(c, stdout=log, stderr=subprocess.STDOUT,
                                                  env=server_env(admin_key), start_new_session=True))
            else:
                rc = run_beside_servers(c, procs, logs, env={**snapshot(), ADMIN_API_KEY: admin_key})
                if rc:
                    break
        if procs and all(c[0] == "bash" for c in mine):  # a rollout-only node serves until the training ends
            rc = serve_until_trained(procs, done_path, config_path, launch_id=resolved.rollout.launch_id)
    except KeyboardInterrupt:
        rc = 130
    except Terminated:
        rc = 128 + signal.SIGTERM
        print("launch: terminated (SIGTERM): stopping the trainer and this node's rollout servers", file=sys.stderr)
    finally:
        if on_term is not None:  # a second SIGTERM does not cut the cleanup short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for p in procs:  # each server with its children (SGLang's scheduler processes)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        if plan.trainer_nodes and cluster.node_rank == plan.trainer_nodes[0]:
            write_done(done_path, rc, resolved.rollout.launch_id)
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
    return rc
