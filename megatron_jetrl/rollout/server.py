"""``jetrl serve``: the in-process engine behind SGLang 0.5.23's HTTP endpoints (the subset RL uses),
following SGLang's rules, so that a client that works against it works against SGLang.

A CPU or single-GPU user runs rollout workers as separate processes with it, and CI runs the
fleet client and the schedulers over real HTTP against it. Request and response shapes follow
SGLang's ``io_struct`` request classes and ``http_server`` routes; the rules that follow SGLang's:

- ``/update_weights_from_distributed`` and ``/update_weights_from_tensor`` are refused outside a
  ``/begin_weight_update`` ... ``/end_weight_update`` session (SGLang's message); a second begin is refused.
- Memory tags (``kv_cache``, ``weights``, ``cuda_graph``): a release without tags releases all three;
  resuming a tag that is not released is refused (SGLang's scheduler dies on it); generation needs every
  tag resumed, a weight update needs ``weights``.
- ``sampling_params`` is one dict or one per row; ``sampling_seed`` draws with SGLang's seeded rule
  (``rollout/seeded.py``: the token depends on the row's seed and position only); a string ``rid`` of a
  batch becomes ``f"{rid}_{i}"``; unknown top-level fields are ignored.
- ``/weights_checker`` (``action="checksum"``) answers SGLang's per-rank checksums (BF16-dequantized
  block-FP8 weights, fused q/k/v and gate/up names: ``sync/sglang_checksum.py``) of what it serves.
- ``/server_info`` reports ``version`` 0.5.23 (the rules it follows) and ``frontend`` ``jetrl-serve``,
  plus a ``jetrl`` block (memory released, resident bytes, ``exact``).

``--exact`` (``precision.exact``): the engine decodes with the trainer's batch-invariant kernels and takes each
token's logprob with the trainer's statement, as the in-process engine does in exact mode, so a trainer with
``rollout.engine=serve`` gets the logprobs its own forward computes, bit for bit, over HTTP (a float32 logprob
round-trips through JSON exactly).

Where it differs from SGLang (README, "SGLang compatibility"): token ids only (no tokenizer, no
``text``); one process (TP=1); per-token logprobs are the sampler's (``softmax(logits / temperature)``,
the trainer's definition); an update is applied whole or not at all (buckets of one ``weight_version``
are staged until every tensor has arrived, validated, then swapped in; SGLang loads each bucket as it
comes); ``/update_weights_from_tensor`` takes ``load_format="jetrl_safetensors"`` (base64 safetensors per
element) where SGLang takes CUDA IPC handles; rows of one request share every sampling parameter but
the seed.

Safety: binds 127.0.0.1 unless ``--host`` says otherwise; bound elsewhere it refuses to start
without ``--admin-api-key``, which then guards every endpoint but ``/generate`` and the health and
info GETs (``Authorization: Bearer <key>``, as SGLang's ``--admin-api-key``); bodies are
size-limited (413) and validated (400 with a one-line reason).
"""
from __future__ import annotations

import argparse
import base64
import ipaddress
import json
import logging
import os
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from megatron_jetrl import env
from megatron_jetrl.errors import ConfigError
from megatron_jetrl.rollout.sglang import MEMORY_TAGS, SGLANG_VERSION

log = logging.getLogger("jetrl.serve")

# Fields a router (sglang-router) fills in when it forwards /generate: accepted at their default
# values, refused when they ask for something this server does not do. Other unknown fields are
# ignored, as SGLang's request parsing does.
GENERATE_PASSTHROUGH = {"model", "return_text_in_logprobs", "log_metrics", "return_hidden_states", "background",
                        "no_logs", "return_bytes", "return_entropy", "top_logprobs_num", "return_routed_experts"}
IGNORED_WHEN_SET = {"model", "log_metrics", "no_logs"}
# Request fields accepted per endpoint: the names of SGLang's io_struct request classes (a test
# checks each set against SGLang's source). Fields SGLang has and we ignore are listed too.
REQUEST_FIELDS = {
    "/generate": ("GenerateReqInput", {"rid", "input_ids", "sampling_params", "return_logprob",
                                      "logprob_start_len", "stream", "text"} | GENERATE_PASSTHROUGH),
    "/update_weights_from_disk": ("UpdateWeightFromDiskReqInput", {
        "model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
        "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache"}),
    "/update_weights_from_tensor": ("UpdateWeightsFromTensorReqInput", {
        "serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version",
        "torch_empty_cache"}),
    "/init_weights_update_group": ("InitWeightsUpdateGroupReqInput", {
        "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}),
    "/update_weights_from_distributed": ("UpdateWeightsFromDistributedReqInput", {
        "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
        "load_format", "torch_empty_cache"}),
    "/destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput", {"group_name"}),
    "/pause_generation": ("PauseGenerationReqInput", {"mode"}),
    "/continue_generation": ("ContinueGenerationReqInput", {"torch_empty_cache"}),
    "/begin_weight_update": ("BeginWeightUpdateReqInput", {"selector"}),
    "/end_weight_update": ("EndWeightUpdateReqInput", set()),
    "/weights_checker": ("CheckWeightsReqInput", {"action", "allow_quant_error", "skip_tensor_list", "selector"}),
    "/release_memory_occupation": ("ReleaseMemoryOccupationReqInput", {"tags"}),
    "/resume_memory_occupation": ("ResumeMemoryOccupationReqInput", {"tags"}),
    "/slow_down": ("SlowDownReqInput", {"forward_sleep_time"}),
}
# The JSON type of every field read (SGLang's pydantic models refuse others the same way): one 400 naming it.
_INT, _NUM, _STR, _BOOL, _LIST, _DICT = (int,), (int, float), (str,), (bool,), (list,), (dict,)
FIELD_TYPES = {
    "/generate": {"rid": _STR + _LIST, "input_ids": _LIST, "sampling_params": _DICT + _LIST, "return_logprob": _BOOL,
                  "logprob_start_len": _INT, "stream": _BOOL, "text": _STR + _LIST},
    "/update_weights_from_disk": {"model_path": _STR, "load_format": _STR, "weight_version": _STR,
                                  "flush_cache": _BOOL},
    "/update_weights_from_tensor": {"serialized_named_tensors": _LIST, "load_format": _STR, "weight_version": _STR,
                                    "flush_cache": _BOOL},
    "/init_weights_update_group": {"master_address": _STR, "master_port": _INT, "rank_offset": _INT,
                                   "world_size": _INT, "group_name": _STR, "backend": _STR},
    "/update_weights_from_distributed": {"names": _LIST, "dtypes": _LIST, "shapes": _LIST, "group_name": _STR,
                                         "weight_version": _STR, "load_format": _STR, "flush_cache": _BOOL},
    "/destroy_weights_update_group": {"group_name": _STR},
    "/weights_checker": {"action": _STR, "skip_tensor_list": _LIST},
    "/release_memory_occupation": {"tags": _LIST},
    "/resume_memory_occupation": {"tags": _LIST},
    "/slow_down": {"forward_sleep_time": _NUM},
}
SAMPLING_TYPES = {"max_new_tokens": _INT, "temperature": _NUM, "top_p": _NUM, "top_k": _INT, "stop_token_ids": _LIST,
                  "sampling_seed": _INT, "skip_special_tokens": _BOOL, "no_stop_trim": _BOOL}


def check_types(body: dict, types: dict, prefix: str = "") -> None:
    """Each present, non-null field of ``body`` has its JSON type (a bool is no number here)."""
    for k, want in types.items():
        v = body.get(k)
        if v is not None and (not isinstance(v, want) or (isinstance(v, bool) and bool not in want)):
            names = "/".join({int: "integer", float: "number", str: "string", bool: "boolean", list: "list",
                              dict: "object"}[t] for t in want)
            raise RequestError(f"{prefix}{k}: expected a {names}, got {json.dumps(v)[:40]}")


SAMPLING_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed",
                   "skip_special_tokens", "no_stop_trim"}
OPEN_ENDPOINTS = {"/generate", "/health", "/health_generate", "/model_info", "/get_model_info",
                  "/server_info", "/get_server_info", "/ready"}
NO_SESSION = "{} must run between begin_weight_update() and end_weight_update()"
_TOP_K_ALL = 1 << 30  # SGLang's "top_k off"


class RequestError(Exception):
    """A bad request: answered with ``status`` and this one-line message."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.status = status


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise RequestError(message)


def _is_int_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


class ServeEngine:
    """The model, the engine over it, and the weight-update state machine."""

    def __init__(self, model_path: str, params_dtype: str = "bf16", seed: int = 0, backend: str = "auto",
                 small_m_max: int = 64, kv_cache: str = "bf16", exact: bool = False, decode_rows: int = 0):
        from megatron_jetrl.config import ModelConfig, ParallelConfig, PrecisionConfig
        from megatron_jetrl.distributed import init_distributed
        from megatron_jetrl.models.builder import DTYPES, build_model
        from megatron_jetrl.models.hf_io import load_hf_weights
        from megatron_jetrl.precision.recipe import FP8Recipe
        from megatron_jetrl.rollout.local import LocalEngine
        from megatron_jetrl.sync.export import ExportOptions, iter_hf_tensors

        with open(os.path.join(model_path, "config.json")) as f:
            qc = json.load(f).get("quantization_config") or {}
        mode = "fp8_rollout" if qc.get("quant_method") == "fp8" else "bf16"
        if kv_cache == "fp8" and mode == "bf16":
            raise SystemExit(f"jetrl serve: --kv-cache-dtype fp8_e4m3 is the FP8 precision flow's KV cache; {model_path} "
                             "is a BF16 checkpoint (no block-FP8 quantization_config): serve its FP8 export")
        self.precision = PrecisionConfig(mode=mode, scale_fmt=qc.get("scale_fmt", "fp32"), backend=backend,
                                         params_dtype=params_dtype, kv_cache=kv_cache, exact=exact)
        self.model_cfg = ModelConfig(hf_path=model_path)
        self.model_path = model_path
        init_distributed(ParallelConfig(), seed)
        self.recipe = FP8Recipe.from_config(self.precision)
        self.dtype = DTYPES[params_dtype]
        self.model, self.fp8_state = build_model(self.model_cfg, ParallelConfig(), self.recipe, self.dtype, backend)
        self.fp8_state.small_m_max = small_m_max
        load_hf_weights(self.model, self.model_cfg, model_path, self.fp8_state)
        self.engine = LocalEngine(self.model, self.fp8_state, pad_id=0, seed=seed,
                                  vocab_size=self.model_cfg.vocab_size, model_cfg=self.model_cfg,
                                  decode_rows=decode_rows)
        if exact and self.engine.static_decoding:  # refused at start, not at the first request
            from megatron_jetrl.rollout.decode import exact_refusal

            why = exact_refusal(self.model)
            if why:
                raise SystemExit(f"jetrl serve: --exact: {why}")
        self.export_opts = ExportOptions(fp8=self.recipe.rollout_fp8, dtype=self.dtype)
        # What a complete update carries: every tensor the rollout runs with, by HF name.
        self.manifest = {n: (tuple(t.shape), t.dtype) for n, t in iter_hf_tensors(self.model, self.model_cfg, self.export_opts)}
        self.weight_version = "0"
        self.lock = threading.RLock()          # generation and weight swaps never interleave
        self.running = threading.Event()
        self.running.set()                     # cleared by /pause_generation
        self.staged: dict[str, torch.Tensor] = {}
        self.staged_version: str | None = None
        self.groups: dict[str, Any] = {}
        self.offloader = None
        self.offload_tags: set[str] = set()    # released memory tags, as SGLang's weight updater keeps them
        self.session_open = False              # inside /begin_weight_update ... /end_weight_update
        self.sleep_s = 0.0
        self.served = 0
        self.last_parity: dict = {}

    # -- generation ---------------------------------------------------------------------------------
    def generate(self, body: dict) -> Any:
        from megatron_jetrl.rollout.base import SamplingParams

        _need(body.get("text") is None, "text: jetrl serve takes token ids; send input_ids")
        for k in GENERATE_PASSTHROUGH - IGNORED_WHEN_SET:
            _need(not body.get(k), f"{k}: not supported by jetrl serve; leave it unset")
        _need(not body.get("stream"), "stream: not supported by jetrl serve; send stream=false")
        ids = body.get("input_ids")
        single = _is_int_list(ids) and len(ids) > 0
        _need(single or (isinstance(ids, list) and len(ids) > 0 and all(_is_int_list(p) and p for p in ids)),
              "input_ids: need a non-empty list of token ids or a list of such lists")
        prompts = [ids] if single else ids
        _need(all(0 <= t < self.model_cfg.vocab_size for p in prompts for t in p),
              f"input_ids: token ids must be in [0, {self.model_cfg.vocab_size})")
        rows = body.get("sampling_params")
        rows = rows if isinstance(rows, list) else [rows or {}] * len(prompts)
        _need(len(rows) == len(prompts) and all(isinstance(r, dict) for r in rows),
              f"sampling_params: one dict, or one per prompt ({len(prompts)})")
        for r in rows:
            check_types(r, SAMPLING_TYPES, "sampling_params.")
            _need(all(_is_int_list(x) for x in [r.get("stop_token_ids") or []]),
                  "sampling_params.stop_token_ids: a list of token ids")
            unknown = set(r) - SAMPLING_FIELDS
            if unknown:
                raise RequestError(f"sampling_params.{sorted(unknown)[0]}: not supported by jetrl serve; "
                                   f"use {', '.join(sorted(SAMPLING_FIELDS))}")
        shared = [{k: v for k, v in r.items() if k != "sampling_seed"} for r in rows]
        _need(all(r == shared[0] for r in shared), "sampling_params: jetrl serve runs one setting per request; "
              "rows may differ in sampling_seed only (send other settings as separate requests)")
        sp = rows[0]
        seeds = [r.get("sampling_seed") for r in rows]
        _need(all(x is None for x in seeds) or all(isinstance(x, int) and not isinstance(x, bool)
                                                   and -2**63 <= x < 2**63 for x in seeds),
              "sampling_params.sampling_seed: an int64 on every row or on none")
        top_k = int(sp.get("top_k", 0) or 0)
        params = SamplingParams(max_new_tokens=int(sp.get("max_new_tokens", 128)),
                                temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
                                top_k=0 if top_k in (-1, _TOP_K_ALL) else top_k,
                                stop_token_ids=tuple(sp.get("stop_token_ids") or ()))
        _need(params.max_new_tokens >= 1, "sampling_params.max_new_tokens: must be >= 1")
        _need(params.temperature >= 0 and 0 < params.top_p <= 1 and params.top_k >= 0,
              "sampling_params: temperature >= 0, 0 < top_p <= 1, top_k >= 0 (or -1)")
        longest = max(len(p) for p in prompts)
        _need(longest + params.max_new_tokens <= self.model_cfg.max_position_embeddings,
              f"max_new_tokens: a prompt of {longest} + {params.max_new_tokens} new tokens exceeds the model's "
              f"{self.model_cfg.max_position_embeddings} positions")
        rid = body.get("rid")
        if single:
            rids = [rid if isinstance(rid, str) else uuid.uuid4().hex]
        elif isinstance(rid, list):
            _need(len(rid) == len(prompts) and len(set(rid)) == len(rid), "rid: one unique id per prompt")
            rids = [str(r) for r in rid]
        else:  # SGLang's GenerateReqInput._normalize_rid
            rids = [f"{rid}_{i}" if isinstance(rid, str) else uuid.uuid4().hex for i in range(len(prompts))]
        deadline = time.monotonic() + 600
        while not self.running.wait(0.05):  # paused: wait for /continue_generation (in_place semantics)
            if time.monotonic() > deadline:
                raise RequestError("generation paused for 600 s; call /continue_generation", HTTPStatus.SERVICE_UNAVAILABLE)
        with self.lock:
            if self.offload_tags:
                raise RequestError(f"memory released ({', '.join(sorted(self.offload_tags))}): call "
                                   "/resume_memory_occupation first", HTTPStatus.SERVICE_UNAVAILABLE)
            if self.sleep_s:
                time.sleep(self.sleep_s)
            t0 = time.perf_counter()
            try:
                gens = self.engine.generate(prompts, params, None if seeds[0] is None else seeds)
            except ConfigError as e:  # e.g. the decoder's KV cache for these rows x length does not fit this GPU:
                raise RequestError(str(e)) from None  # every server would refuse it too (a 4xx: the fleet stops)
            version = self.weight_version
            self.served += 1
            log.info("generate #%d (rid %s): %d prompts, %d new tokens in %.2f s, weight_version %s", self.served,
                     rid, len(prompts), sum(len(g.output_ids) for g in gens), time.perf_counter() - t0, version)
        out = []
        for i, g in enumerate(gens):
            finish = ({"type": "stop", "matched": g.output_ids[-1]} if g.finish_reason == "stop"
                      else {"type": "length", "length": len(g.output_ids)})
            meta = {"id": rids[i], "finish_reason": finish,
                    "prompt_tokens": len(g.prompt_ids), "completion_tokens": len(g.output_ids),
                    "weight_version": version}
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(g.output_logprobs, g.output_ids)]
            out.append({"text": "", "output_ids": g.output_ids, "meta_info": meta})
        return out[0] if single else out

    # -- weight updates: stage, validate, swap whole ----------------------------------------------
    def stage(self, tensors: dict[str, torch.Tensor], version: str | None) -> dict:
        """Add received tensors to the pending update; apply it once complete. Returns a response."""
        version = str(version) if version is not None else str(int(self.weight_version) + 1
                                                              if self.weight_version.isdigit() else self.weight_version)
        if self.staged_version != version:
            if self.staged:
                log.warning("dropping an incomplete update (version %s, %d/%d tensors) for version %s",
                            self.staged_version, len(self.staged), len(self.manifest), version)
            self.staged, self.staged_version = {}, version
        try:
            for name, t in tensors.items():
                if name not in self.manifest:
                    raise RequestError(f"{name}: not a tensor of this model; send the rollout's HF names")
                shape, dtype = self.manifest[name]
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise RequestError(f"{name}: got {tuple(t.shape)} {t.dtype}, the model needs {shape} {dtype}")
                if t.is_floating_point() and not bool(torch.isfinite(t.float()).all()):
                    raise RequestError(f"{name}: holds NaN/inf; the update is refused (the sender's weights diverged)")
        except RequestError:
            self.staged, self.staged_version = {}, None
            raise
        self.staged.update(tensors)
        missing = len(self.manifest) - len(self.staged)
        if missing:
            return {"success": True, "message": f"staged {len(self.staged)}/{len(self.manifest)} tensors of version {version}"}
        self._apply(self.staged, version)
        self.staged, self.staged_version = {}, None
        return {"success": True, "message": f"weights updated to version {version}"}

    def _apply(self, tensors: dict[str, torch.Tensor], version: str) -> None:
        from megatron_jetrl.models.hf_io import TensorDict, load_hf_weights

        with self.lock:
            _need("weights" not in self.offload_tags,
                  "memory released: call /resume_memory_occupation (tags weights) before updating weights")
            load_hf_weights(self.model, self.model_cfg, TensorDict(tensors), self.fp8_state)
            self.weight_version = version
            self.engine.weight_version = int(version) if version.isdigit() else self.engine.weight_version

    def checksums(self, body: dict) -> dict:
        """``/weights_checker``: SGLang's answer shape, one ``ChecksumInfo`` for the one (TP=1) rank, of
        the weights served (read back through the export path the sender's bytes came in by)."""
        import hashlib

        from megatron_jetrl.sync.export import iter_hf_tensors
        from megatron_jetrl.sync.sglang_checksum import ExpectedChecksums, sglang_tensor_hash

        _need(body.get("action", "checksum") == "checksum",
              "action: jetrl serve implements 'checksum' (snapshot/compare/reset_tensors are SGLang's debugging aids)")
        skip = body.get("skip_tensor_list") or []
        with self.lock:
            _need("weights" not in self.offload_tags, "memory released: call /resume_memory_occupation first")
            linears = ExpectedChecksums(1, self.model_cfg.num_key_value_heads, self.recipe.weight_block[0],
                                        unquantized=True)
            raw = {n: sglang_tensor_hash(t) for n, t in iter_hf_tensors(self.model, self.model_cfg, self.export_opts)
                   if not linears.add(n, t)}
        sums = {n: h for n, h in {**raw, **linears.ranks[0]}.items() if not any(p in n for p in skip)}
        overall = hashlib.sha256()
        for n in sorted(sums):
            overall.update(n.encode())
            overall.update(sums[n].encode())
        info = {"checksums": sums, "per_gpu_checksum": overall.hexdigest(),
                "parallelism_info": [{"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                                      "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}]}
        return {"success": True, "message": "Success.", "ranks": [info],
                "per_engine_checksum": hashlib.sha256(info["per_gpu_checksum"].encode()).hexdigest()}

    def begin_session(self) -> dict:
        _need(not self.session_open, "a weight-update session is already open; call end_weight_update() first")
        self.session_open = True
        return {"success": True, "message": "Success"}

    def end_session(self) -> dict:
        _need(self.session_open, "no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        if self.staged:
            log.warning("session closed with an incomplete update (version %s, %d/%d tensors): dropped",
                        self.staged_version, len(self.staged), len(self.manifest))
            self.staged, self.staged_version = {}, None
        return {"success": True, "message": "Success"}

    def update_from_disk(self, body: dict) -> dict:
        from megatron_jetrl.models.hf_io import CheckpointError, HFCheckpoint
        from megatron_jetrl.sync.transport import verify_disk

        path = body.get("model_path")
        _need(isinstance(path, str) and os.path.isdir(path), f"model_path: {path!r} is not a directory")
        try:
            ckpt = HFCheckpoint(path)
            missing = [n for n in self.manifest if n not in ckpt]
            if missing:
                raise RequestError(f"model_path: {missing[0]} missing from {path} ({len(missing)} tensors missing)")
            tensors = {n: ckpt.raw(n) for n in self.manifest}
        except CheckpointError as e:
            raise RequestError(str(e)) from None
        if os.path.isfile(os.path.join(path, "weight_hashes.json")):
            self.last_parity = verify_disk(path)
            _need(self.last_parity["parity_mismatch"] == 0,
                  f"model_path: {self.last_parity['parity_mismatch']} tensors differ from weight_hashes.json")
        version = body.get("weight_version")
        self.staged, self.staged_version = {}, None
        return self.stage(tensors, version)

    def update_from_tensor(self, body: dict) -> dict:
        from safetensors.torch import load as st_load

        _need(self.session_open, NO_SESSION.format("update_weights_from_tensor"))
        _need(body.get("load_format") == "jetrl_safetensors",
              "load_format: jetrl serve takes 'jetrl_safetensors' (base64 safetensors bytes per element)")
        items = body.get("serialized_named_tensors")
        _need(isinstance(items, list) and items and all(isinstance(x, str) for x in items),
              "serialized_named_tensors: a non-empty list of base64 strings")
        tensors = {}
        try:
            for x in items:
                tensors.update(st_load(base64.b64decode(x, validate=True)))
        except Exception as e:  # noqa: BLE001 - any decoding problem is the client's
            raise RequestError(f"serialized_named_tensors: not base64 safetensors ({type(e).__name__})") from None
        return self.stage(tensors, body.get("weight_version"))

    def init_group(self, body: dict) -> dict:
        from megatron_jetrl.distributed import init_custom_group

        for k in ("master_address", "master_port", "rank_offset", "world_size"):
            _need(k in body, f"{k}: required")
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            backend = "gloo"  # CPU server: the same protocol over gloo
        self.groups[name] = init_custom_group(backend, body["master_address"], int(body["master_port"]),
                                              rank=int(body["rank_offset"]), world_size=int(body["world_size"]),
                                              group_name=name)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, body: dict) -> dict:
        import torch.distributed as dist

        name = body.get("group_name", "weight_update_group")
        _need(name in self.groups, f"group_name: no group {name!r}")
        dist.destroy_process_group(self.groups.pop(name))
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def update_from_distributed(self, body: dict) -> dict:
        import torch.distributed as dist

        from megatron_jetrl.sync.sglang_bucket import sglang_bucket_class

        _need(self.session_open, NO_SESSION.format("update_weights_from_distributed"))
        name = body.get("group_name", "weight_update_group")
        _need(name in self.groups, f"group_name: no group {name!r}; call /init_weights_update_group first")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        _need(isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
              and len(names) == len(dtypes) == len(shapes) and names, "names, dtypes, shapes: equal-length non-empty lists")
        try:
            torch_dtypes = [getattr(torch, d) for d in dtypes]
            _need(all(isinstance(d, torch.dtype) for d in torch_dtypes), "dtypes: torch dtype names")
        except AttributeError as e:
            raise RequestError(f"dtypes: {e}") from None
        group, dev = self.groups[name], torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        # Receive first (the sender is already broadcasting), validate after.
        if body.get("load_format") == "flattened_bucket":
            bucket = sglang_bucket_class().empty(names, torch_dtypes, shapes, dev)
            dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
            received = dict(bucket.reconstruct_tensors())
        else:
            received = {}
            for n, d, s in zip(names, torch_dtypes, shapes):
                t = torch.empty(s, dtype=d, device=dev)
                dist.broadcast(t, src=0, group=group)
                received[n] = t
        return self.stage({k: v.cpu() for k, v in received.items()}, body.get("weight_version"))

    def slow_down(self, body: dict) -> dict:
        """SGLang's testing aid: every forward sleeps this long (null or 0: off)."""
        t = body.get("forward_sleep_time") or 0.0
        _need(0 <= t <= 3600, "forward_sleep_time: seconds in [0, 3600] (or null)")
        self.sleep_s = float(t)
        return {}

    # -- memory ------------------------------------------------------------------------------------
    @staticmethod
    def _tags(body: dict) -> list[str]:
        tags = body.get("tags") or list(MEMORY_TAGS)  # SGLang: no tags means all of them
        _need(isinstance(tags, list) and set(tags) <= set(MEMORY_TAGS), f"tags: a list of {', '.join(MEMORY_TAGS)}")
        return tags

    def release(self, body: dict) -> dict:
        """The weights go to host memory; the KV cache and CUDA graphs live inside ``/generate`` here, so
        their tags are bookkeeping (what generation and resume check)."""
        from megatron_jetrl.memory import Offloader, model_tensors

        tags = self._tags(body)
        with self.lock:
            if "weights" in tags and "weights" not in self.offload_tags:
                self.offloader = Offloader(model_tensors(self.model))
                self.offloader.offload()
            self.offload_tags.update(tags)
        return None  # SGLang answers 200 with a null body

    def resume(self, body: dict) -> dict:
        tags = self._tags(body)
        with self.lock:
            missing = [t for t in tags if t not in self.offload_tags]
            _need(not missing, f"tags: {', '.join(missing)} not released (SGLang 0.5.23's scheduler dies on "
                  "this with a KeyError); resume only released tags")
            if "weights" in tags:
                self.offloader.reload()
            self.offload_tags.difference_update(tags)
        return None

    def resident_bytes(self) -> int:
        from megatron_jetrl.memory import model_tensors

        return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in model_tensors(self.model)}.values())


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_handler(state: ServeEngine, admin_key: str | None, max_body: int):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # into the server log, not stderr noise per request
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, payload: Any, text: bool = False) -> None:
            data = payload.encode() if text else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _path(self) -> str:
            return self.path.split("?", 1)[0]

        def _authorized(self, path: str) -> bool:
            if not admin_key or path in OPEN_ENDPOINTS:
                return True
            return self.headers.get("Authorization", "") == f"Bearer {admin_key}"

        def _body(self, path: str) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            if n > max_body:
                self.close_connection = True
                left = n  # drain without keeping it, so the client reads the answer instead of a broken pipe
                while left > 0:
                    chunk = self.rfile.read(min(left, 1 << 20))
                    if not chunk:
                        break
                    left -= len(chunk)
                raise RequestError(f"request body of {n} bytes exceeds the {max_body}-byte limit "
                                   "(--max-body-mb); send smaller buckets", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            raw = self.rfile.read(n) if n else b""
            if not raw:
                return {}
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(f"body: not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
            if not isinstance(body, dict):
                raise RequestError("body: a JSON object is required")
            if path in REQUEST_FIELDS:  # SGLang's request parsing drops unknown fields
                unknown = sorted(set(body) - REQUEST_FIELDS[path][1])
                if unknown:
                    log.debug("%s: ignoring unknown fields %s", path, ", ".join(unknown))
                body = {k: v for k, v in body.items() if k not in unknown}
            check_types(body, FIELD_TYPES.get(path, {}))
            return body

        def _dispatch(self, method: str) -> None:
            path = self._path()
            try:
                if not self._authorized(path):
                    raise RequestError(f"{path} needs 'Authorization: Bearer <admin key>'", HTTPStatus.UNAUTHORIZED)
                body = self._body(path) if method == "POST" else {}
                routes = {
                    "/health": lambda: "", "/health_generate": lambda: "", "/ready": lambda: "",
                    "/generate": lambda: state.generate(body),
                    "/model_info": self._model_info, "/get_model_info": self._model_info,
                    "/server_info": self._server_info, "/get_server_info": self._server_info,
                    "/update_weights_from_disk": lambda: {**state.update_from_disk(body), "num_paused_requests": 0},
                    "/update_weights_from_tensor": lambda: state.update_from_tensor(body),
                    "/init_weights_update_group": lambda: state.init_group(body),
                    "/destroy_weights_update_group": lambda: state.destroy_group(body),
                    "/update_weights_from_distributed": lambda: state.update_from_distributed(body),
                    "/begin_weight_update": state.begin_session,
                    "/end_weight_update": state.end_session,
                    "/weights_checker": lambda: state.checksums(body),
                    "/pause_generation": lambda: (state.running.clear(),
                                                  {"message": "Generation paused successfully.", "status": "ok"})[1],
                    "/continue_generation": lambda: (state.running.set(),
                                                     {"message": "Generation continued successfully.", "status": "ok"})[1],
                    "/flush_cache": lambda: "Cache flushed.\n",
                    "/release_memory_occupation": lambda: state.release(body),
                    "/resume_memory_occupation": lambda: state.resume(body),
                    "/slow_down": lambda: state.slow_down(body),
                }
                if path not in routes:
                    raise RequestError(f"{path}: no such endpoint", HTTPStatus.NOT_FOUND)
                out = routes[path]()
                self._send(HTTPStatus.OK, out, text=isinstance(out, str))
            except RequestError as e:
                key = "error" if path == "/generate" else "message"
                payload = {"error": {"message": str(e), "code": int(e.status)}} if key == "error" else \
                    {"success": False, "message": str(e)}
                self._send(e.status, payload)
            except Exception as e:  # noqa: BLE001 - a server never dies on one request
                log.exception("request %s failed", path)
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"success": False, "message": f"{type(e).__name__}: {e}"})

        def _model_info(self):
            return {"model_path": state.model_path, "weight_version": state.weight_version, "is_generation": True,
                    "model_type": state.model_cfg.model_type, "quantization": "fp8" if state.recipe.rollout_fp8 else None}

        def _server_info(self):
            released = sorted(state.offload_tags)
            return {"weight_version": state.weight_version, "version": SGLANG_VERSION, "frontend": "jetrl-serve",
                    "jetrl": {"memory_released": released, "resident_bytes": state.resident_bytes(),
                              "exact": state.recipe.exact,
                              "requests_served": state.served, "paused": not state.running.is_set(),
                              "last_parity": state.last_parity}}

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

        do_PUT = do_POST

    return Handler


def serve(args: argparse.Namespace) -> int:
    if not _loopback(args.host) and not args.admin_api_key:
        raise SystemExit(f"jetrl serve: --host {args.host} is reachable from other machines; "
                         "give --admin-api-key to guard the weight and memory endpoints")
    if args.max_running_requests is not None and args.max_running_requests < 1:
        raise SystemExit(f"jetrl serve: --max-running-requests {args.max_running_requests}: give at least 1 row")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Take the port before loading the model: the load's process group (gloo/NCCL) and a sibling
    # server's bind ephemeral ports, which could otherwise land on ours while the model loads
    # (seen in CI: "Address already in use"). Listening starts once the engine is ready.
    server = ThreadingHTTPServer((args.host, args.port), BaseHTTPRequestHandler, bind_and_activate=False)
    server.request_queue_size = 256  # listen backlog (the default 5 reset concurrent clients of a busy worker)
    try:
        server.server_bind()
        state = ServeEngine(args.model_path, args.params_dtype, args.seed, args.backend, args.small_m_max,
                            "fp8" if args.kv_cache_dtype == "fp8_e4m3" else "bf16", args.exact,
                            args.max_running_requests or 0)
        state.weight_version = str(args.weight_version)
        server.RequestHandlerClass = make_handler(state, args.admin_api_key, int(args.max_body_mb * (1 << 20)))
        server.server_activate()
    except BaseException:
        server.server_close()
        raise
    server.daemon_threads = True
    print(f"jetrl serve: ready on http://{args.host}:{server.server_address[1]} "
          f"({state.model_cfg.model_type}, {'block FP8' if state.recipe.rollout_fp8 else 'BF16'}, "
          f"{'FP8 KV cache, ' if state.recipe.rollout_kv_fp8 else ''}{'exact, ' if state.recipe.exact else ''}"
          f"weight_version {state.weight_version})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def add_serve_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model-path", required=True, help="HF directory (BF16, or block FP8 with quantization_config)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--admin-api-key", default=env.admin_api_key(),
                    help="required when --host is not loopback; guards weight/memory endpoints (env JETRL_ADMIN_API_KEY)")
    ap.add_argument("--params-dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--backend", default="auto", choices=["auto", "scaled_mm", "emulated"])
    ap.add_argument("--small-m-max", type=int, default=64,
                    help="decode forwards with <= this many tokens use the small-M Triton FP8 GEMM "
                         "(0 = off; precision.small_m_max)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto",
                    help="fp8_e4m3: the FP8 KV cache of precision.kv_cache=fp8 (E4M3 per token and KV head, power-of-two "
                         "scales: the values a jet trainer's attention reads; not SGLang's per-layer static scale); "
                         "needs a block-FP8 checkpoint")
    ap.add_argument("--exact", action="store_true",
                    help="exact on-policy mode (precision.exact): the trainer's batch-invariant kernels and logprob "
                         "statement, so every sampled token's logprob is the trainer's bit for bit (docs/rollout.md)")
    ap.add_argument("--max-running-requests", type=int, default=None,
                    help="rows (prompts x samples) decoded at once at most, SGLang's flag; a request's further rows "
                         "decode in later waves (rollout.decode_rows; default: as many as the GPU's memory holds)")
    ap.add_argument("--max-body-mb", type=float, default=2048.0, help="largest request body accepted")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weight-version", default="0")
