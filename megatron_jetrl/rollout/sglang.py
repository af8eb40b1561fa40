"""The rollout fleet: SGLang servers (or ``jetrl serve`` workers) behind the rollout-engine interface.

- ``sglang_server_argv``: the ``sglang.launch_server`` arguments, derived from the run config and
  the ``FP8Recipe`` alone (the block size and scale format travel in the model directory's
  config.json ``quantization_config``, written by the same recipe).
- ``SGLangClient``: the HTTP endpoints RL needs, with the request fields of SGLang 0.5.23's io_struct
  request classes and the response shapes of its http_server (tests parse every body with SGLang's own
  classes and drive its weight-update manager with the calls each scheduler mode makes).
- ``RolloutFleet``: launches (or attaches to) the servers, checks their SGLang version, splits a
  rollout into chunks sent concurrently, and survives servers that die or hang: the chunk is retried
  on another server (each row keeps its sampling seed), the server is restarted and gets the current
  weights before it serves again. Weight pushes go over disk, a broadcast group (inside SGLang's
  ``/begin_weight_update`` ... ``/end_weight_update`` session) or, to ``jetrl serve`` only, tensor
  buckets; the FP8 parity is checked with SGLang's ``/weights_checker`` checksums
  (``sync/sglang_checksum.py``). In colocated mode it tracks which memory tags each server released,
  as SGLang does, and resumes only those.

What a retried chunk reproduces: every row carries its own ``sampling_seed`` (``seeded.row_seeds``).
``jetrl serve`` always samples with SGLang's seeded rule, so a retry gives the same tokens; SGLang uses
the seed only with ``--enable-deterministic-inference`` (``rollout.deterministic``), otherwise a retry is
a fresh draw of the same prompts (never a duplicate or a lost sample).

Only global rank 0 launches, restarts and pushes; every data-parallel rank sends its own prompts.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from megatron_jetrl.env import ADMIN_API_KEY, admin_api_key, snapshot
from megatron_jetrl.distributed import free_port, free_ports
from megatron_jetrl.files import write_atomic
from megatron_jetrl.rollout.base import Generation, SamplingParams
from megatron_jetrl.rollout.seeded import row_seeds
from megatron_jetrl.sync.sglang_checksum import ExpectedChecksums, compare
from megatron_jetrl.sync.server_push import DistributedBroadcastPush, TensorBucketPush

log = logging.getLogger("jetrl.fleet")

SGLANG_VERSION = "0.5.23"
"""The SGLang release whose HTTP API and weight-update rules this client follows (``jetrl serve``
reports it too: it follows the same rules)."""
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""SGLang's ``GPU_MEMORY_ALL_TYPES`` (``srt/constants.py``): what ``/release_memory_occupation`` with no
tags releases. Resuming a tag that is not released kills SGLang's scheduler (KeyError)."""


class ServerError(RuntimeError):
    """A server failed a request (connection, timeout, HTTP error or a malformed answer);
    ``timed_out``: it did not answer within the request timeout (hung)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


# ------------------------------------------------------------------------------------------------
# Launch arguments


def sglang_server_argv(cfg, recipe, model_dir: str, port: int, base_gpu_id: int = 0, colocated: bool = True,
                       key_file: Optional[str] = None) -> list[str]:
    """``python -m sglang.launch_server`` arguments for one server of this run; its admin key, if any, from
    ``key_file`` (:func:`write_admin_key_file`) through SGLang's ``--config``, not on its command line."""
    sg = recipe.sglang_args()
    argv = ["--model-path", model_dir, "--host", "127.0.0.1", "--port", str(port),
            "--tp-size", str(cfg.rollout.server_tp), "--mem-fraction-static", str(cfg.rollout.mem_fraction),
            "--dtype", sg["dtype"], "--skip-tokenizer-init", "--random-seed", str(cfg.seed),
            "--base-gpu-id", str(base_gpu_id), "--weight-version", "0"]
    if "quantization" in sg:
        argv += ["--quantization", sg["quantization"]]
    if colocated:
        argv.append("--enable-memory-saver")
    if cfg.rollout.deterministic:
        argv.append("--enable-deterministic-inference")
    if cfg.rollout.decode_rows:  # rows decoded at once: SGLang's running-request bound
        argv += ["--max-running-requests", str(cfg.rollout.decode_rows)]
    if key_file:
        argv += ["--config", key_file]
    return argv


def write_admin_key_file(path: str, key: str) -> None:
    """``path`` holding ``key`` for SGLang's ``--config`` (``admin-api-key: KEY``), readable by this user only
    (YAML-quoted where the key would otherwise parse as a number): the key stays off the server's command line
    (``ps``) and out of printed commands."""
    import yaml

    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    # the key's spelling is the flag's: SGLang passes a config file's keys on as --KEY
    write_atomic(path, yaml.safe_dump({"admin-api-key": key}), mode=0o600)


def router_argv(cfg, worker_urls: list[str], port: int) -> list[str]:
    """``python -m sglang_router.launch_router`` in front of ``worker_urls``."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", "round_robin", "--prometheus-port", str(free_port()),
            "--request-timeout-secs", str(int(cfg.rollout.request_timeout_s)), "--max-payload-size", str(1 << 30),
            # a restarted server rejoins within seconds, not the default minute
            "--health-check-interval-secs", "5", "--cb-timeout-duration-secs", "10"]


def serve_argv(cfg, model_dir: str, port: int, index: int) -> list[str]:
    """``jetrl serve`` arguments for worker ``index`` of this run."""
    argv = ["--model-path", model_dir, "--port", str(port), "--params-dtype", cfg.precision.params_dtype,
            "--seed", str(cfg.seed + index), "--weight-version", "0",
            "--small-m-max", str(cfg.precision.small_m_max),
            "--kv-cache-dtype", "fp8_e4m3" if cfg.precision.kv_cache == "fp8" else "auto"]
    if cfg.precision.exact:
        argv.append("--exact")
    if cfg.rollout.decode_rows:
        argv += ["--max-running-requests", str(cfg.rollout.decode_rows)]
    return argv  # the admin key: JETRL_ADMIN_API_KEY in the worker's environment (server_env)


# ------------------------------------------------------------------------------------------------
# Client


class SGLangClient:
    """One server's endpoints. Requests are JSON; errors raise ``ServerError`` with one line."""

    def __init__(self, url: str, timeout_s: float = 600.0, admin_api_key: Optional[str] = None):
        self.url, self.timeout_s, self.admin_api_key = url.rstrip("/"), timeout_s, admin_api_key

    def request(self, path: str, body: Optional[dict] = None, timeout_s: Optional[float] = None,
                method: Optional[str] = None, retries: int = 0):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.admin_api_key:
            headers["Authorization"] = f"Bearer {self.admin_api_key}"
        for attempt in range(retries + 1):
            req = urllib.request.Request(self.url + path, data=data, headers=headers,
                                         method=method or ("POST" if body is not None else "GET"))
            try:
                with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                    raw = resp.read()
                    if "json" in (resp.headers.get("Content-Type") or ""):
                        return json.loads(raw) if raw else None
                    return raw.decode()
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")
                try:
                    j = json.loads(detail)
                    err = j.get("error")
                    detail = err.get("message") if isinstance(err, dict) else j.get("message", detail)
                except (json.JSONDecodeError, AttributeError):
                    pass
                first = str(detail).strip().splitlines()[0] if detail else ""
                raise ServerError(f"{self.url}{path}: HTTP {e.code}: {first}") from None
            except (urllib.error.URLError, OSError, TimeoutError) as e:
                if attempt == retries:
                    reason = getattr(e, "reason", e)
                    raise ServerError(f"{self.url}{path}: {reason}",
                                      timed_out=isinstance(reason, TimeoutError)) from None
                time.sleep(0.5 * (attempt + 1))

    # -- health and info
    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            self.request("/health_generate", timeout_s=timeout_s)
            return True
        except ServerError:
            return False

    def get_weight_version(self) -> str:
        """``weight_version`` from ``/model_info``."""
        return str(self.request("/model_info", retries=2)["weight_version"])

    def server_info(self) -> dict:
        return self.request("/server_info", retries=2)

    def check_version(self) -> dict:
        """``/server_info``, refused with one line unless the server speaks ``SGLANG_VERSION``'s API."""
        info = self.server_info()
        version = str((info or {}).get("version", "unknown"))
        if version != SGLANG_VERSION:
            raise ServerError(f"{self.url}: SGLang {version} is not supported; megatron_jetrl follows SGLang "
                              f"{SGLANG_VERSION}'s API (pip install sglang=={SGLANG_VERSION})")
        return info

    def weights_checksum(self) -> dict:
        """``/weights_checker`` with ``action="checksum"``: per TP rank, the hash of every parameter
        (block-FP8 weights dequantized to BF16) under SGLang's parameter names."""
        return self.request("/weights_checker", {"action": "checksum"})

    # -- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: Optional[list[int]] = None,
                 rid: Optional[str] = None, per_row: bool = False) -> list[Generation]:
        """``seeds``: one ``sampling_seed`` per prompt (per-row sampling params, as SGLang's batch
        requests take them): the samples of one prompt must not share a seed, or SGLang's seeded sampler
        gives them identical tokens. ``per_row``: one request per prompt, sent concurrently (sglang-router
        parses ``sampling_params`` as one object, so a batch cannot carry per-row seeds through it)."""
        sp = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
              "top_k": params.top_k if params.top_k else -1, "stop_token_ids": list(params.stop_token_ids),
              "no_stop_trim": True}
        rows = [sp if seeds is None else dict(sp, sampling_seed=int(x)) for x in (seeds or [None] * len(prompts))]
        if per_row:
            def one(i):
                body = {"input_ids": prompts[i], "sampling_params": rows[i], "return_logprob": True}
                if rid:
                    body["rid"] = f"{rid}_{i}"  # SGLang's batch rid, so a row has one id however it travels
                return parse_generate_response(self.request("/generate", body), [prompts[i]], self.url)[0]

            with ThreadPoolExecutor(min(16, len(prompts))) as ex:
                return list(ex.map(one, range(len(prompts))))
        body = {"input_ids": prompts, "sampling_params": rows if seeds is not None else sp, "return_logprob": True}
        if rid:
            body["rid"] = rid  # a prefix: SGLang expands it to f"{rid}_{i}"
        out = self.request("/generate", body)
        return parse_generate_response(out, prompts, self.url)

    # -- weights
    def begin_weight_update(self) -> dict:
        """Open SGLang's weight-update session: ``/update_weights_from_distributed`` and
        ``/update_weights_from_tensor`` are refused outside one."""
        return self.request("/begin_weight_update", {})

    def end_weight_update(self) -> dict:
        """Close the session (SGLang finalizes the loaded weights here)."""
        return self.request("/end_weight_update", {})

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> dict:
        return self.request("/update_weights_from_disk", {"model_path": model_path, "weight_version": weight_version,
                                                          "flush_cache": True})

    def update_weights_from_tensor(self, serialized: list[str], load_format: str, weight_version: str,
                                   flush_cache: bool) -> dict:
        return self.request("/update_weights_from_tensor", {"serialized_named_tensors": serialized,
                                                            "load_format": load_format, "weight_version": weight_version,
                                                            "flush_cache": flush_cache})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> dict:
        return self.request("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def destroy_weights_update_group(self, group_name: str) -> dict:
        return self.request("/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        weight_version: str, group_name: str, flush_cache: bool,
                                        load_format: Optional[str] = "flattened_bucket") -> dict:
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "weight_version": weight_version, "flush_cache": flush_cache}
        if load_format:
            body["load_format"] = load_format
        return self.request("/update_weights_from_distributed", body)

    # -- scheduling
    def pause_generation(self, mode: str = "retract") -> dict:
        return self.request("/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        return self.request("/continue_generation", {})

    def flush_cache(self) -> str:
        return self.request("/flush_cache", {})

    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> dict:
        return self.request("/release_memory_occupation", {"tags": tags} if tags else {})

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> dict:
        return self.request("/resume_memory_occupation", {"tags": tags} if tags else {})


def parse_generate_response(out, prompts: list[list[int]], url: str = "") -> list[Generation]:
    """SGLang's ``/generate`` answer (one dict per prompt: ``output_ids`` and ``meta_info`` with
    ``output_token_logprobs`` as ``[logprob, token_id, text]``) -> ``Generation``s; refuses an
    answer of the wrong shape with one line."""
    if isinstance(out, dict):
        out = [out]
    if not isinstance(out, list) or len(out) != len(prompts):
        raise ServerError(f"{url}/generate: expected {len(prompts)} results, got {type(out).__name__}"
                          f"{'' if not isinstance(out, list) else ' of ' + str(len(out))}")
    gens = []
    for p, o in zip(prompts, out):
        try:
            meta = o["meta_info"]
            ids = [int(t) for t in o["output_ids"]]
            lps = meta["output_token_logprobs"]
            if [int(x[1]) for x in lps] != ids:
                raise ServerError(f"{url}/generate: output_token_logprobs do not match output_ids")
            fin = meta.get("finish_reason") or {}
            reason = fin.get("type", "length") if isinstance(fin, dict) else str(fin)
            version = str(meta.get("weight_version", "0"))
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise ServerError(f"{url}/generate: malformed answer ({type(e).__name__}: {e})") from None
        gens.append(Generation(p, ids, [float(x[0]) for x in lps], reason,
                               int(version) if version.isdigit() else 0, {"server": url}))
    return gens


# ------------------------------------------------------------------------------------------------
# Processes

# What torchrun / torch elastic put in a trainer rank's environment. A server started by that rank must not
# see them: it would join the trainer's rendezvous as another "rank 0" (``init_distributed`` reads RANK and
# MASTER_ADDR/PORT; SGLang reads LOCAL_RANK/WORLD_SIZE too) and hang there, or pick the trainer's GPU.
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def server_env(admin_key: Optional[str] = None) -> dict:
    """The environment a rollout server is started with (by a trainer rank or by ``jetrl launch``): this
    process's, without the torch launcher's rank/rendezvous variables (``_LAUNCHER_VARS``,
    ``TORCHELASTIC_*``), unbuffered output, and ``admin_key`` as ``JETRL_ADMIN_API_KEY`` (``jetrl serve``'s
    default key) where given."""
    env = snapshot()
    for k in list(env):
        if k in _LAUNCHER_VARS or k.startswith("TORCHELASTIC_"):
            del env[k]
    env["PYTHONUNBUFFERED"] = "1"
    if admin_key:
        env[ADMIN_API_KEY] = admin_key
    return env


@dataclass
class Server:
    client: SGLangClient
    cmd: Optional[list[str]] = None      # None: attached, not ours to restart
    log_path: Optional[str] = None
    proc: Optional[subprocess.Popen] = None
    up: bool = False
    hung: bool = False                   # a request timed out: restart it even if /health answers
    restarts: int = 0
    tp: int = 1
    released: set = field(default_factory=set)  # memory tags released (SGLang's offload_tags)
    log_file: Optional[object] = field(default=None, repr=False)

    def start(self) -> None:
        """Launch in its own session (its process tree is stopped as one), tied to this process: it gets
        SIGTERM when this process dies, however it dies (Linux ``PR_SET_PDEATHSIG``)."""
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self.log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env=server_env(self.client.admin_api_key),
                                     start_new_session=True, preexec_fn=_die_with_parent(os.getpid()))

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(f"{self.client.url}: server exited with code {self.proc.returncode} while starting; "
                                  f"see {self.log_path}: {_tail(self.log_path)}")
            if self.client.healthy(timeout_s=5.0):
                self.up = True
                return
            time.sleep(0.25)
        raise ServerError(f"{self.client.url}: not healthy after {timeout_s:.0f} s (rollout.health_timeout_s); "
                          f"see {self.log_path}")

    def stop(self) -> None:
        """Terminate the server's whole process group (SGLang's scheduler/detokenizer children hold
        GPU memory), SIGKILL after 15 s."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None
        self.up = False


def _die_with_parent(parent: int):
    """A ``preexec_fn``: the child gets SIGTERM when ``parent`` (its launching thread's process) dies."""
    if not sys.platform.startswith("linux"):
        return None

    def arm():
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


def _tail(path: Optional[str], n: int = 1) -> str:
    try:
        with open(path, "rb") as f:
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        return " | ".join(lines[-n:])
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------------
# Fleet


class RolloutFleet:
    """N servers behind the rollout-engine interface (generate / push weights / release / resume)."""

    remote = True  # rollout.base.RolloutEngine: weights pushed, memory released and resumed

    def __init__(self, cfg, recipe, run_dir: str, model_dir: Optional[str], colocated: bool, trainer_gpus: int = 0):
        self.cfg, self.recipe, self.run_dir, self.colocated = cfg, recipe, run_dir, colocated
        self.weight_version = 0
        self.metrics: dict = {}
        bucket_bytes = cfg.rollout.bucket_mb << 20
        # the transports that move tensors (sync/server_push.py); disk goes through the run's disk_push
        self.pushers = {"tensor": TensorBucketPush(bucket_bytes), "distributed": DistributedBroadcastPush(bucket_bytes)}
        self.lock = threading.Lock()
        r = cfg.rollout
        key = r.admin_api_key or admin_api_key()  # the config's, else JETRL_ADMIN_API_KEY (how `jetrl launch` gives it)
        self.servers: list[Server] = []
        # the ports of the servers this fleet starts, then the router's: consecutive, free, below the ephemeral range
        # (no other process's automatic bind takes one before its server binds it)
        owned = 0 if r.server_addresses else r.num_servers
        base = free_ports(owned + 1)
        if r.server_addresses:
            self.servers = [Server(SGLangClient(a, r.request_timeout_s, key), tp=r.server_tp)
                            for a in r.server_addresses]
        else:
            key_file = os.path.join(run_dir, "admin", "sglang_servers.yaml") if key and r.engine == "sglang" else None
            if key_file:
                write_admin_key_file(key_file, key)
            for i in range(r.num_servers):
                port = base + i
                if r.engine == "sglang":
                    cmd = [sys.executable, "-m", "sglang.launch_server",
                           *sglang_server_argv(cfg, recipe, model_dir, port,
                                               (0 if colocated else trainer_gpus) + i * r.server_tp, colocated,
                                               key_file)]
                else:
                    cmd = [sys.executable, "-m", "megatron_jetrl.cli", "serve", *serve_argv(cfg, model_dir, port, i)]
                self.servers.append(Server(SGLangClient(f"http://127.0.0.1:{port}", r.request_timeout_s, key),
                                           cmd, os.path.join(run_dir, "rollout_logs", f"server{i}.log"),
                                           tp=r.server_tp if r.engine == "sglang" else 1))
        self.router: Optional[Server] = self._router(base + owned) if r.router else None

    def _router(self, port: int) -> Server:
        r = self.cfg.rollout
        return Server(SGLangClient(f"http://127.0.0.1:{port}", r.request_timeout_s), router_argv(self.cfg, self.urls, port),
                      os.path.join(self.run_dir, "rollout_logs", "router.log"))

    def _start_router(self, attempts: int = 3) -> None:
        """Start the router; its port was free when chosen, but another process may bind it before the router
        does (the servers start first): then it starts again on a fresh port."""
        for attempt in range(attempts):
            self.router.start()
            try:
                self.router.wait_healthy(120)
                return
            except ServerError as e:
                if "Address already in use" not in str(e) or attempt == attempts - 1:
                    raise
                log.warning("router port %s was taken before the router bound it; starting it on another port",
                            self.router.client.url)
                self.router = self._router(free_ports(1))

    # -- lifecycle
    def start(self) -> None:
        owned = [s for s in self.servers if s.cmd]
        try:
            for s in owned:
                s.start()
            with ThreadPoolExecutor(max(1, len(self.servers))) as ex:
                list(ex.map(lambda s: s.wait_healthy(self.cfg.rollout.health_timeout_s) if s.cmd else self._attach(s),
                            self.servers))
            for s in self.servers:
                self._ready(s)
            if self.router is not None:
                self._start_router()
        except BaseException:
            self.shutdown()  # no orphan servers when one of them fails to start
            raise
        log.info("rollout fleet up: %s", ", ".join(s.client.url for s in self.servers))

    def _attach(self, s: Server) -> None:
        """Servers started by ``jetrl launch`` next to the trainer may still be loading: wait for them."""
        deadline = time.monotonic() + self.cfg.rollout.health_timeout_s
        while not s.client.healthy(timeout_s=5.0):
            if time.monotonic() > deadline:
                raise ServerError(f"{s.client.url}: not healthy after {self.cfg.rollout.health_timeout_s:.0f} s; "
                                  "check rollout.server_addresses and the server's log")
            time.sleep(1.0)
        s.up = True

    def _ready(self, s: Server) -> None:
        """A server just (re)started or attached: its SGLang version is checked, and in exact mode that it decodes
        exactly (``jetrl serve --exact``); colocated, it releases all its GPU memory (weights, KV cache, CUDA
        graphs) for the trainer until a phase resumes it."""
        info = s.client.check_version()
        if self.recipe.exact and (info.get("jetrl") or {}).get("exact") is not True:
            raise ServerError(f"{s.client.url}: precision.exact needs rollout workers that decode with the trainer's "
                              "kernels; this server does not report exact mode: start it with jetrl serve --exact")
        s.released = set()
        if self.colocated:
            self._release(s, list(MEMORY_TAGS))

    def shutdown(self) -> None:
        for pusher in self.pushers.values():
            pusher.close([])  # this process's side of a weight-update group; the servers stop below
        for s in self.servers + ([self.router] if self.router is not None else []):
            if s.cmd:
                s.stop()

    def assume_up(self) -> None:
        """On a rank that does not talk to the servers: every server counts as up (rank 0 attached to them, or
        restarted whatever was down before a push)."""
        for s in self.servers:
            s.up = True

    @property
    def urls(self) -> list[str]:
        return [s.client.url for s in self.servers]

    # -- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int = 0) -> list[Generation]:
        """All prompts, in order, whatever servers fail on the way. Row ``i`` is sampled with
        ``row_seeds(seed, [i])`` on whichever server runs its chunk, so a retried chunk replaces the
        failed one whole: never a duplicate or a lost sample."""
        cs = self.cfg.rollout.chunk_size
        chunks = [(c, list(range(i, min(i + cs, len(prompts))))) for c, i in enumerate(range(0, len(prompts), cs))]
        results: dict[int, list[Generation]] = {}
        pending, retries, last_error = chunks, 0, ""
        while pending:
            up = [s for s in self.servers if s.up]
            if self.router is not None:  # the router balances over the servers it sees healthy
                if retries > 4 * len(chunks):
                    raise ServerError(f"rollout through the router keeps failing (last error: {last_error})")
                up = [self.router] if up else []
            if not up:
                raise ServerError(f"no rollout server is up (last error: {last_error}); see rollout_logs/ in the run directory")
            with ThreadPoolExecutor(max(1, min(len(pending), 4 * len(up)))) as ex:
                futs = [(ex.submit(s.client.generate, [prompts[i] for i in idx], params, row_seeds(seed, idx),
                                   f"s{seed}c{c}", s is self.router), s, c, idx)
                        for k, (c, idx) in enumerate(pending) for s in [up[k % len(up)]]]
            failed = []
            for f, s, c, idx in futs:
                try:
                    results[c] = f.result()
                except ServerError as e:
                    if "HTTP 4" in str(e):
                        raise  # our request is wrong: retrying elsewhere would fail the same way
                    log.warning("rollout server %s failed (%s); chunk %d retried elsewhere", s.client.url, e, c)
                    last_error = str(e)
                    if s is self.router:  # which server failed: the ones not answering their health check
                        for w in self.servers:
                            if w.up and not w.client.healthy(timeout_s=2.0):
                                w.up = False
                    else:
                        s.up = False
                        s.hung = s.hung or e.timed_out
                    failed.append((c, idx))
            retries += len(failed)
            pending = failed
        self.metrics = {"fleet_retries": retries, "fleet_servers_up": sum(s.up for s in self.servers)}
        return [g for c, _ in chunks for g in results[c]]

    # -- healing
    def heal(self) -> int:
        """Restart dead servers (ours). Called right before a weight push, which brings a restarted
        server (launched from the initial weights) to the current version before it serves again."""
        dead = [s for s in self.servers if not s.up or (s.proc is not None and s.proc.poll() is not None)]
        dead = [s for s in dead if s.hung or not s.client.healthy(timeout_s=5.0)]
        for s in dead:
            if not s.cmd:
                log.error("attached server %s is down; continuing with %d servers", s.client.url,
                          sum(x.up for x in self.servers))
                continue
            if s.restarts >= self.cfg.rollout.max_restarts:
                raise ServerError(f"{s.client.url} died {s.restarts + 1} times (rollout.max_restarts); see {s.log_path}")
            s.stop()
            s.hung = False
            s.restarts += 1
            log.warning("restarting rollout server %s (restart %d)", s.client.url, s.restarts)
            s.start()
            s.wait_healthy(self.cfg.rollout.health_timeout_s)
            self._ready(s)
            self.pushers["distributed"].members = ()  # the broadcast group lost a member: rebuilt at the next push
        self.metrics["fleet_restarts"] = sum(s.restarts for s in self.servers)
        return len(dead)

    # -- weights
    def push_weights(self, version: int, items: Iterable[tuple[str, torch.Tensor]], check_parity: bool = True,
                     disk_push: Optional[Callable[[int, Iterable], tuple[str, dict]]] = None) -> dict:
        """Send one version to every server over ``rollout.weight_transport``; returns metrics,
        including the FP8 parity check of what each server then runs (``/weights_checker``)."""
        t0 = time.perf_counter()
        transport = self.cfg.rollout.weight_transport
        if self.colocated:
            self.resume_memory(["weights"])  # a server restarted by heal() came back released
        up = [s for s in self.servers if s.up]
        expected = {tp: ExpectedChecksums(tp, self.cfg.model.num_key_value_heads, self.recipe.weight_block[0])
                    for tp in {s.tp for s in up}} if check_parity and self.recipe.rollout_fp8 else {}
        for e in expected.values():
            items = e.wrap(items)
        if transport == "disk":  # SGLang loads a directory outside any weight-update session
            path, m = disk_push(version, items)
            sent = m.get("sync_bytes", 0)
            self._each(up, lambda s: s.client.update_weights_from_disk(path, str(version)), tolerate=True)
        else:
            self._each(up, lambda s: s.client.begin_weight_update(), tolerate=True)
            up = [s for s in up if s.up]
            try:
                sent = self.pushers[transport].send(up, version, items, lambda ss, fn: self._each(ss, fn, tolerate=True))
            finally:  # closed even when a bucket failed: SGLang refuses the next begin while one is open
                self._each(up, self._end_session)
        self.weight_version = version
        out = {"sync_seconds": time.perf_counter() - t0, "sync_bytes": sent, "parity_checked": 0, "parity_mismatch": 0}
        for s in [s for s in up if s.up]:
            served = s.client.get_weight_version()
            if served != str(version):
                raise ServerError(f"{s.client.url}: serves weight_version {served} after pushing {version}")
            if s.tp in expected:
                checked, bad = compare(expected[s.tp].ranks, s.client.weights_checksum())
                out["parity_checked"] += checked
                out["parity_mismatch"] += bad
                if bad:  # the rollout would sample from other weights than the trainer's: off-policy again
                    hint = ("; SGLang re-quantizes fp32 block scales to UE8M0 for DeepGEMM on SM100/SM120 GPUs: set "
                            "precision.scale_fmt=ue8m0 there") if self.recipe.scale_fmt == "fp32" else ""
                    raise ServerError(f"{s.client.url}: {bad} of {checked} FP8 linears differ from the bytes sent "
                                      f"(/weights_checker checksums, weight_version {version}){hint}")
        return out

    @staticmethod
    def _end_session(s: Server) -> None:
        try:
            s.client.end_weight_update()
        except ServerError as e:
            log.error("%s: /end_weight_update failed (%s)", s.client.url, e)

    def _each(self, servers: list[Server], fn, tolerate: bool = False) -> list:
        """``fn(server)`` on every server, concurrently. ``tolerate``: a server that fails (dead, hung; not a
        4xx, which is our request's fault) is marked down and left out, as a failed generation chunk is;
        ``heal()`` restarts it before the next push. Raises when no server is left."""
        def call(s):
            try:
                return fn(s)
            except ServerError as e:
                if not tolerate or "HTTP 4" in str(e):
                    raise
                log.warning("rollout server %s failed (%s); left out until the next push restarts it", s.client.url, e)
                s.up, s.hung = False, s.hung or e.timed_out
                return None

        with ThreadPoolExecutor(max(1, len(servers))) as ex:
            out = list(ex.map(call, servers))
        if tolerate and servers and not any(s.up for s in servers):
            raise ServerError("no rollout server is up (see rollout_logs/ in the run directory)")
        return out

    # -- memory (colocated)
    def _release(self, s: Server, tags: list[str]) -> None:
        tags = [t for t in tags if t not in s.released]
        if tags:
            s.client.release_memory_occupation(tags)
            s.released.update(tags)

    def _resume(self, s: Server, tags: list[str]) -> None:
        tags = [t for t in tags if t in s.released]  # resuming an unreleased tag kills SGLang's scheduler
        if tags:
            s.client.resume_memory_occupation(tags)
            s.released.difference_update(tags)

    def release_memory(self, tags: Optional[list[str]] = None) -> None:
        """Release ``tags`` (default: all of ``MEMORY_TAGS``) on every server that holds them."""
        self._each([s for s in self.servers if s.up], lambda s: self._release(s, list(tags or MEMORY_TAGS)),
                   tolerate=True)

    def resume_memory(self, tags: Optional[list[str]] = None) -> None:
        """Resume those of ``tags`` (default: all) each server released: ``weights`` before a push, next to the
        trainer's params; ``kv_cache`` and ``cuda_graph`` (and ``weights``, if no push came first) before a
        rollout, once the trainer is offloaded."""
        self._each([s for s in self.servers if s.up], lambda s: self._resume(s, list(tags or MEMORY_TAGS)),
                   tolerate=True)

    def update_weights(self, version: int, hashes=None) -> dict:  # RolloutEngine protocol (in-process form)
        raise NotImplementedError("the fleet receives weights through push_weights")


def start_fleet(cfg, recipe, model_dir: str) -> "RolloutFleet":
    """Rank 0 launches (or attaches to) the servers of ``cfg.rollout``; every other rank attaches to the same
    URLs. ``model_dir``: the HF directory the servers start from."""
    import torch.distributed as dist

    from megatron_jetrl.distributed import is_rank0

    urls = [None]
    if is_rank0():
        fleet = RolloutFleet(cfg, recipe, cfg.logging.run_dir, model_dir, cfg.scheduler.mode == "colocated",
                             trainer_gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)
        fleet.start()
        urls = [fleet.urls]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(urls, src=0)
    if not is_rank0():
        import dataclasses

        attached = dataclasses.replace(cfg.rollout, server_addresses=urls[0])
        fleet = RolloutFleet(dataclasses.replace(cfg, rollout=attached), recipe, cfg.logging.run_dir, None, False)
        fleet.assume_up()
    return fleet
