"""The rollout fleet: SGLang servers (or ``jetrl serve`` workers) behind the rollout-engine interface.

- ``sglang_server_argv``: the ``sglang.launch_server`` arguments, derived from the run config and
  the ``FP8Recipe`` alone (the block size and scale format travel in the model directory's
  config.json ``quantization_config``, written by the same recipe).
- ``SGLangClient``: the HTTP endpoints RL needs, with the request fields of SGLang's io_struct
  request classes and the response shapes of its http_server (tests check both against SGLang's
  source).
- ``RolloutFleet``: launches (or attaches to) the servers, splits a rollout into chunks sent
  concurrently, and survives servers that die or hang: the chunk is retried on another server
  (same sampling seed, so no sample is lost or counted twice), the server is restarted and gets the
  current weights before it serves again. Weight pushes go over disk, a broadcast group or tensor
  buckets, with the FP8 parity hashes checked where the server exposes them (``jetrl serve``).

Only global rank 0 launches, restarts and pushes; every data-parallel rank sends its own prompts.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import signal
import socket
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

from megatron_jetrl.distributed import free_port
from megatron_jetrl.rollout.base import Generation, SamplingParams
from megatron_jetrl.sync.transport import bucketize, host_copy, is_fp8_payload, nbytes, tensor_hash

log = logging.getLogger("jetrl.fleet")


class ServerError(RuntimeError):
    """A server failed a request (connection, timeout, HTTP error or a malformed answer);
    ``timed_out``: it did not answer within the request timeout (hung)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


# ------------------------------------------------------------------------------------------------
# Launch arguments


def sglang_server_argv(cfg, recipe, model_dir: str, port: int, base_gpu_id: int = 0, colocated: bool = True) -> list[str]:
    """``python -m sglang.launch_server`` arguments for one server of this run."""
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
    if cfg.rollout.admin_api_key:
        argv += ["--admin-api-key", cfg.rollout.admin_api_key]
    return argv


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
            "--small-m-max", str(cfg.precision.small_m_max)]
    if cfg.rollout.admin_api_key:
        argv += ["--admin-api-key", cfg.rollout.admin_api_key]
    return argv


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
                    detail = (j.get("error") or {}).get("message") if isinstance(j.get("error"), dict) else j.get("message", detail)
                except (json.JSONDecodeError, AttributeError):
                    pass
                raise ServerError(f"{self.url}{path}: HTTP {e.code}: {str(detail).strip().splitlines()[0] if detail else ''}") from None
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
        """``weight_version`` from ``/model_info`` (SGLang >= 0.5); ``/get_weight_version`` on older servers."""
        try:
            return str(self.request("/model_info", retries=2)["weight_version"])
        except ServerError:
            return str(self.request("/get_weight_version", retries=2)["weight_version"])

    def server_info(self) -> dict:
        return self.request("/server_info", retries=2)

    def weight_hashes(self) -> Optional[dict]:
        """FP8 parity hashes of what the server runs (``jetrl serve`` only; None on SGLang)."""
        try:
            return self.request("/jetrl/weight_hashes", retries=1)
        except ServerError as e:
            if "HTTP 404" in str(e):
                return None
            raise

    # -- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: Optional[int] = None,
                 rid: Optional[str] = None) -> list[Generation]:
        sp = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
              "top_k": params.top_k if params.top_k else -1, "stop_token_ids": list(params.stop_token_ids),
              "no_stop_trim": True}
        if seed is not None:
            sp["sampling_seed"] = seed
        body = {"input_ids": prompts, "sampling_params": sp, "return_logprob": True}
        if rid:
            body["rid"] = rid  # a prefix: SGLang expands it per item (sglang-router takes only a string)
        out = self.request("/generate", body)
        return parse_generate_response(out, prompts, self.url)

    # -- weights
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


def server_env() -> dict:
    """The environment a rollout server is started with (by a trainer rank or by ``jetrl launch``): this
    process's, without the torch launcher's rank/rendezvous variables (``_LAUNCHER_VARS``,
    ``TORCHELASTIC_*``), unbuffered output."""
    env = dict(os.environ)
    for k in list(env):
        if k in _LAUNCHER_VARS or k.startswith("TORCHELASTIC_"):
            del env[k]
    env["PYTHONUNBUFFERED"] = "1"
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
    rank_offset: int = 0
    tp: int = 1
    log_file: Optional[object] = field(default=None, repr=False)

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self.log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env=server_env(), start_new_session=True)

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
        raise ServerError(f"{self.client.url}: not healthy after {timeout_s:.0f} s (rollout.health_timeout_s); see {self.log_path}")

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

    def __init__(self, cfg, recipe, run_dir: str, model_dir: Optional[str], colocated: bool, trainer_gpus: int = 0):
        self.cfg, self.recipe, self.run_dir, self.colocated = cfg, recipe, run_dir, colocated
        self.weight_version = 0
        self.metrics: dict = {}
        self.group_name, self._group, self._group_members = "jetrl_weight_update", None, ()
        self.lock = threading.Lock()
        r = cfg.rollout
        self.servers: list[Server] = []
        if r.server_addresses:
            self.servers = [Server(SGLangClient(a, r.request_timeout_s, r.admin_api_key), tp=r.server_tp)
                            for a in r.server_addresses]
        else:
            for i in range(r.num_servers):
                port = free_port()
                if r.engine == "sglang":
                    cmd = [sys.executable, "-m", "sglang.launch_server",
                           *sglang_server_argv(cfg, recipe, model_dir, port, (0 if colocated else trainer_gpus) + i * r.server_tp, colocated)]
                else:
                    cmd = [sys.executable, "-m", "megatron_jetrl.cli", "serve", *serve_argv(cfg, model_dir, port, i)]
                self.servers.append(Server(SGLangClient(f"http://127.0.0.1:{port}", r.request_timeout_s, r.admin_api_key),
                                           cmd, os.path.join(run_dir, "rollout_logs", f"server{i}.log"),
                                           tp=r.server_tp if r.engine == "sglang" else 1))
        offset = 1
        for s in self.servers:
            s.rank_offset, offset = offset, offset + s.tp
        self.router: Optional[Server] = None
        if r.router:
            port = free_port()
            self.router = Server(SGLangClient(f"http://127.0.0.1:{port}", r.request_timeout_s), router_argv(cfg, self.urls, port),
                                 os.path.join(run_dir, "rollout_logs", "router.log"))

    # -- lifecycle
    def start(self) -> None:
        owned = [s for s in self.servers if s.cmd]
        try:
            for s in owned:
                s.start()
            with ThreadPoolExecutor(max(1, len(self.servers))) as ex:
                list(ex.map(lambda s: s.wait_healthy(self.cfg.rollout.health_timeout_s) if s.cmd else self._attach(s),
                            self.servers))
            if self.router is not None:
                self.router.start()
                self.router.wait_healthy(120)
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

    def shutdown(self) -> None:
        if self._group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self._group)
            self._group = None
        for s in self.servers + ([self.router] if self.router is not None else []):
            if s.cmd:
                s.stop()

    @property
    def urls(self) -> list[str]:
        return [s.client.url for s in self.servers]

    # -- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int = 0) -> list[Generation]:
        """All prompts, in order, whatever servers fail on the way. Chunk ``c`` is sampled with seed
        ``seed + c`` on whichever server runs it, so a retried chunk is a fresh draw of the same
        chunk, never a duplicate."""
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
                futs = [(ex.submit(s.client.generate, [prompts[i] for i in idx], params, seed + c, f"s{seed}c{c}"), s, c, idx)
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
            self._group_members = ()  # the broadcast group lost a member: rebuild it at the next push
        self.metrics["fleet_restarts"] = sum(s.restarts for s in self.servers)
        return len(dead)

    # -- weights
    def push_weights(self, version: int, items: Iterable[tuple[str, torch.Tensor]], check_parity: bool = True,
                     disk_push: Optional[Callable[[int, Iterable], tuple[str, dict]]] = None) -> dict:
        """Send one version to every server over ``rollout.weight_transport``; returns metrics,
        including the FP8 parity check against what each server reports it runs with."""
        t0 = time.perf_counter()
        transport = self.cfg.rollout.weight_transport
        hashes: dict[str, str] = {}

        def hashed(it):
            for name, t in it:
                if check_parity and is_fp8_payload(name, t):
                    hashes[name] = tensor_hash(t)
                yield name, t

        up = [s for s in self.servers if s.up]
        sent = 0
        if transport == "disk":
            path, m = disk_push(version, hashed(items))
            sent = m.get("sync_bytes", 0)
            self._each(up, lambda s: s.client.update_weights_from_disk(path, str(version)))
        elif transport == "tensor":
            sent = self._push_tensor(up, version, hashed(items))
        else:
            sent = self._push_distributed(up, version, hashed(items))
        self.weight_version = version
        out = {"sync_seconds": time.perf_counter() - t0, "sync_bytes": sent, "parity_checked": 0, "parity_mismatch": 0}
        if check_parity and hashes:
            for s in up:
                got = s.client.weight_hashes()
                if got is None:
                    continue
                if str(got["weight_version"]) != str(version):
                    raise ServerError(f"{s.client.url}: serves weight_version {got['weight_version']} after pushing {version}")
                out["parity_checked"] += len(hashes)
                out["parity_mismatch"] += sum(got["hashes"].get(k) != v for k, v in hashes.items())
        return out

    def _each(self, servers: list[Server], fn) -> list:
        with ThreadPoolExecutor(max(1, len(servers))) as ex:
            return list(ex.map(fn, servers))

    def _push_tensor(self, up: list[Server], version: int, items) -> int:
        from safetensors.torch import save as st_save

        total, buckets = 0, bucketize(items, self.cfg.rollout.bucket_mb << 20)
        bucket = next(buckets, None)
        while bucket is not None:  # one bucket in memory at a time (plus the next one's tensors as they stream)
            nxt = next(buckets, None)
            payload = base64.b64encode(st_save({n: host_copy(t) for n, t in bucket})).decode()
            total += sum(nbytes(t) for _, t in bucket)
            last = nxt is None
            self._each(up, lambda s: s.client.update_weights_from_tensor([payload], "jetrl_safetensors", str(version), last))
            bucket = nxt
        return total

    def _ensure_group(self, up: list[Server]) -> None:
        import torch.distributed as dist

        from megatron_jetrl.distributed import init_custom_group

        members = tuple(s.client.url for s in up)
        if self._group is not None and members == self._group_members:
            return
        if self._group is not None:
            for s in up:
                try:
                    s.client.destroy_weights_update_group(self.group_name)
                except ServerError:
                    pass
            dist.destroy_process_group(self._group)
            self._group = None
        offset = 1
        for s in up:
            s.rank_offset, offset = offset, offset + s.tp
        world, port = offset, free_port()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        with ThreadPoolExecutor(len(up)) as ex:
            futs = [ex.submit(s.client.init_weights_update_group, "127.0.0.1" if s.client.url.startswith("http://127.")
                              else socket.gethostbyname(socket.gethostname()), port, s.rank_offset, world,
                              self.group_name, backend) for s in up]
            self._group = init_custom_group(backend, "0.0.0.0" if not all("127.0.0.1" in s.client.url for s in up)
                                            else "127.0.0.1", port, 0, world, self.group_name)
            for f in futs:
                f.result()
        self._group_members = members

    def _push_distributed(self, up: list[Server], version: int, items) -> int:
        import torch.distributed as dist

        from megatron_jetrl.sync.sglang_bucket import aligned_order, sglang_bucket_class

        self._ensure_group(up)
        cls, total = sglang_bucket_class(), 0
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        buckets = bucketize(items, self.cfg.rollout.bucket_mb << 20)
        bucket = next(buckets, None)
        while bucket is not None:
            nxt = next(buckets, None)
            bucket = aligned_order([(n, t.to(dev)) for n, t in bucket])
            b = cls(named_tensors=bucket)
            names = [n for n, _ in bucket]
            dtypes = [str(t.dtype).replace("torch.", "") for _, t in bucket]
            shapes = [list(t.shape) for _, t in bucket]
            with ThreadPoolExecutor(len(up)) as ex:  # the servers block in the broadcast until we send
                futs = [ex.submit(s.client.update_weights_from_distributed, names, dtypes, shapes, str(version),
                                  self.group_name, nxt is None) for s in up]
                dist.broadcast(b.get_flattened_tensor(), src=0, group=self._group)
                for f in futs:
                    f.result()
            total += sum(nbytes(t) for _, t in bucket)
            bucket = nxt
        return total

    # -- memory (colocated)
    def release_memory(self) -> None:
        self._each([s for s in self.servers if s.up], lambda s: s.client.release_memory_occupation())

    def resume_memory(self, tags: Optional[list[str]] = None) -> None:
        """SGLang's tags: ``weights`` (before a push, while the trainer is resident) and ``kv_cache``
        (before the rollout, once the trainer is offloaded)."""
        self._each([s for s in self.servers if s.up], lambda s: s.client.resume_memory_occupation(tags))

    def update_weights(self, version: int, hashes=None) -> dict:  # RolloutEngine protocol (in-process form)
        raise NotImplementedError("the fleet receives weights through push_weights")
