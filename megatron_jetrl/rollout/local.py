"""In-process rollout engine over the trainer's own megatron-core model object.

It runs the model with the rollout precision (``FP8ModelState.rollout_precision``): in ``jet``
mode the same cached FP8 weight bytes the training forward uses, in ``fp8_rollout`` mode FP8
while training stays BF16; with ``precision.kv_cache=fp8`` an E4M3 KV cache whose values the ``jet`` trainer's
attention reads too. Batched generation with a KV cache: left-padded prompts, one prefill,
then one token per step, sampled on the device. Pad keys are masked; the static decoder numbers each row's
positions from its own first token, so left padding changes nothing (the megatron reference decoder numbers
columns: RoPE is relative, so only the rounding differs). Decoding runs on ``rollout/decode.py``'s
static-shape decoder (CUDA graphs on GPU; ``decode="static"``) or on megatron-core's eager
``StaticInferenceContext`` (``decode="megatron"``, the reference).
"""
from __future__ import annotations

import gc
import logging
import time

import torch

from megatron_jetrl.config import RolloutConfig
from megatron_jetrl.errors import ConfigError
from megatron_jetrl.rollout.base import Generation, SamplingParams, fused_sampling, sample_next
from megatron_jetrl.sync.transport import is_fp8_payload, tensor_hash


log = logging.getLogger(__name__)
SYNC_EVERY = 8
ROW_MULTIPLE = 8  # static decoders are allocated for a multiple of this many rows


def decoder_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of ``ROW_MULTIPLE``: the rows a static decoder for them holds."""
    return -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE


def wave_rows(rows: int, limit: int = 0, fit: int | None = None) -> int:
    """Rows per decode wave for a batch of ``rows``: all of them where they are within ``limit``
    (``rollout.decode_rows``; 0: none) and ``fit`` (the most decoder rows whose KV cache the GPU holds; None: no
    bound), else balanced waves of at most the smaller bound taken down to a multiple of ``ROW_MULTIPLE`` (the
    decoder's row rounding; a bound under it is kept as is), each wave that many rows rounded up to a multiple of
    it, the last one the rest: 512 rows within 200 -> 3 waves of 176 (176, 176, 160). ``fit`` 0 (not one row) is
    the caller's to refuse."""
    bounds = [b for b in (limit or None, fit) if b is not None]
    if not bounds or rows <= min(bounds) and (fit is None or decoder_rows(rows) <= fit):
        return rows
    cap = min(bounds)
    if cap >= ROW_MULTIPLE:
        cap -= cap % ROW_MULTIPLE
    waves = -(-rows // max(1, cap))
    size = -(-rows // waves)
    if cap >= ROW_MULTIPLE:
        size = decoder_rows(size)
    return size


class LocalEngine:
    remote = False  # rollout.base.RolloutEngine: in process, on the trainer's model

    def __init__(self, model, fp8_state, pad_id: int, seed: int = 0, vocab_size: int | None = None,
                 model_cfg=None, decode: str = "static", cuda_graphs: bool = True,
                 bucket: int = RolloutConfig.decode_bucket, keep_cache: bool = True, attention: str = "sdpa",
                 max_graphs: int = RolloutConfig.decode_max_graphs,
                 v_layout: str = RolloutConfig.fp8_kv_v_layout, decode_rows: int = RolloutConfig.decode_rows):
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise ValueError("rollout.engine=local needs parallel.pipeline_parallel=1; pipelined trainers use a "
                             "rollout fleet: rollout.engine=sglang (or serve) with rollout.weight_transport=disk")
        self.model, self.fp8_state, self.pad_id, self.model_cfg = model, fp8_state, pad_id, model_cfg
        self.vocab_size = vocab_size
        self.weight_version = 0
        self.metrics: dict = {}
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.last_parity: dict = {}
        self.decode, self.cuda_graphs, self.bucket, self.keep_cache = decode, cuda_graphs, bucket, keep_cache
        self.max_graphs = max_graphs
        self.attention = attention  # the static decoder's decode-step attention: "sdpa" or "triton"
        self.v_layout = v_layout  # the FP8 KV cache's V layout (rollout.fp8_kv_v_layout)
        self.decode_rows = decode_rows  # rows per decode wave at most (rollout.decode_rows; 0: as many as fit)
        self._decoder = None
        self.last_stats: dict = {}

    @property
    def decoder(self):
        """The static decoder kept from the last rollout (``keep_cache``), whose KV cache still holds that rollout's
        keys and values; None without one."""
        return self._decoder

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        out = gather_from_tensor_model_parallel_region(out)
        return out[..., : self.vocab_size] if self.vocab_size else out

    def _refresh_fp8(self) -> None:
        """Bring every FP8 weight cache to the current version before decoding, so a captured
        graph never records (or misses) a refresh: it reads the caches' buffers, refreshed in place."""
        if self.fp8_state is not None and self.fp8_state.forward_fp8:
            for m in self.model.modules():
                if getattr(m, "fp8_cache", None) is not None:
                    m.fp8_weight()

    def _static_decoder(self, B: int, max_len: int, max_rows: int | None = None):
        """The static decoder for ``B`` rows up to ``max_len`` tokens: the kept one when it has
        room (length, and at most twice the rows rounded up: its extra rows decode pad tokens), else a
        new one with the rows rounded up to a multiple of ``ROW_MULTIPLE`` (varying request sizes, as a
        ``jetrl serve`` worker sees, then share one KV cache and one set of CUDA graphs), and to ``max_rows`` at
        most (fewer rows than ``ROW_MULTIPLE`` fit the GPU)."""
        from megatron_jetrl.rollout.decode import StaticDecoder

        d, rows = self._decoder, decoder_rows(B)
        if max_rows is not None:
            rows = max(B, min(rows, max_rows))
        if d is None or not B <= d.B <= 2 * rows or d.L < max_len:
            if d is not None:  # free the old cache (and its graphs' pool) before allocating the new one
                self._decoder = d = None
                gc.collect()
            recipe = getattr(self.fp8_state, "recipe", None)
            d = StaticDecoder(self.model, rows, max_len,
                              self.vocab_size, self.bucket, use_graphs=self.cuda_graphs and self.device.type == "cuda",
                              attention=self.attention, max_graphs=self.max_graphs,
                              kv_recipe=recipe if recipe is not None and recipe.rollout_kv_fp8 else None,
                              exact=recipe is not None and recipe.exact, v_layout=self.v_layout)
        self._decoder = d if self.keep_cache else None
        return d

    @classmethod
    def from_config(cls, model, fp8_state, cfg, pad_id: int, seed: int | None = None,
                    keep_cache: bool | None = None) -> "LocalEngine":
        """The engine ``rollout.engine=local`` builds over the trainer's model (``cfg``: the run's JetConfig; ``seed``:
        the sampling seed, ``cfg.seed`` when None; ``keep_cache``: ``rollout.keep_decode_cache`` when None)."""
        r = cfg.rollout
        return cls(model, fp8_state, pad_id, seed=cfg.seed if seed is None else seed,
                   vocab_size=cfg.model.vocab_size, model_cfg=cfg.model, decode=r.decode, cuda_graphs=r.cuda_graphs,
                   bucket=r.decode_bucket, keep_cache=r.keep_decode_cache if keep_cache is None else keep_cache,
                   attention=r.decode_attention, max_graphs=r.decode_max_graphs, v_layout=r.fp8_kv_v_layout,
                   decode_rows=r.decode_rows)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> list[Generation]:
        """``seeds``: one sampling seed per prompt (SGLang's seeded rule, ``rollout/seeded.py``: a row's
        tokens depend on its prompt, seed and the weights, not on the rest of the batch); None: the
        engine's generator. More rows than ``decode_rows``, or than the GPU's free memory holds a KV cache for,
        decode in waves (``wave_rows``; ``metrics["rollout_waves"]``)."""
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds: {len(seeds)} for {len(prompts)} prompts")
        size, fit, shape = len(prompts), None, None
        if prompts:
            size, fit, shape = self.wave_plan(len(prompts), max(len(p) for p in prompts) + params.max_new_tokens)
        self.metrics = {"rollout_waves": -(-len(prompts) // size) if prompts else 0}
        if size >= len(prompts):
            return self._generate_wave(prompts, params, seeds, shape)
        by_memory = fit is not None and (not self.decode_rows or fit < self.decode_rows)
        log.info("rollout: %d rows decoded in %d waves of up to %d (%s)", len(prompts), self.metrics["rollout_waves"],
                 size, f"the KV cache of {fit} rows fits the GPU's free memory" if by_memory
                 else f"rollout.decode_rows={self.decode_rows}")
        gens, stats = [], {}
        for i in range(0, len(prompts), size):  # one static decoder for every wave: its rows, the longest prompt's length
            gens += self._generate_wave(prompts[i:i + size], params, None if seeds is None else seeds[i:i + size],
                                        shape)
            for k, v in self.last_stats.items():  # summed over the waves (decode_steps: the waves' steps)
                stats[k] = v if isinstance(v, bool) else stats.get(k, 0) + v
        self.last_stats = stats
        return gens

    def wave_plan(self, rows: int, max_len: int) -> tuple[int, int | None, tuple[int, int, int | None]]:
        """How :meth:`generate` decodes ``rows`` rows of up to ``max_len`` positions: (rows per wave, the most
        decoder rows whose KV cache fits or None: no bound, the static decoder's (rows, positions) at least and rows
        at most). Under ``ROW_MULTIPLE`` rows fit: that many at most, not rounded up."""
        fit = self._fit_rows(rows, max_len)
        size = wave_rows(rows, self.decode_rows, fit)
        return size, fit, (size, max_len, fit if fit is not None and fit < ROW_MULTIPLE else None)

    def _fit_rows(self, rows: int, max_len: int) -> int | None:
        """The most static-decoder rows of ``max_len`` positions whose KV cache the GPU's free memory holds beside the
        decoder's own work (``decode.work_bytes``; the kept decoder's cache counted as free: a larger one replaces
        it), or None: no bound (off CUDA, another decode path, or the kept decoder already has room). Not one row:
        refused in one line (``cache_fit_problem``)."""
        if not self.static_decoding or self.device.type != "cuda":
            return None
        from megatron_jetrl.rollout.decode import cache_bytes, cache_fit_problem, free_bytes, work_bytes

        d = self._decoder
        if d is not None and rows <= d.B and d.L >= max_len:
            return None
        fp8 = getattr(getattr(self.fp8_state, "recipe", None), "rollout_kv_fp8", False)
        per_row = cache_bytes(self.model, 1, max_len, fp8)
        free = max(0, free_bytes(self.device) + (d.cache_bytes if d is not None else 0) - work_bytes(self.model))
        fit = free // per_row
        if fit < 1:
            raise ConfigError(cache_fit_problem(per_row, free, 1, max_len, fp8))
        return fit

    def _generate_wave(self, prompts: list[list[int]], params: SamplingParams, seeds=None,
                       shape: tuple[int, int, int | None] | None = None) -> list[Generation]:
        """One batch of rows decoded at once; ``shape``: the static decoder's (rows, positions) at least and its
        rows at most (None: no bound)."""
        if self.static_decoding:
            return self._generate_static(prompts, params, seeds, shape)
        if self.fp8_state is not None and self.fp8_state.recipe.exact:
            return self._generate_exact(prompts, params, seeds)
        return self._generate_megatron(prompts, params, seeds)

    @property
    def static_decoding(self) -> bool:
        """Whether :meth:`generate` runs the static decoder: ``decode=static``, and in exact mode wherever the
        batch-invariant kernels run (elsewhere exact mode decodes with the trainer's forward, ``_generate_exact``)."""
        if self.fp8_state is not None and self.fp8_state.recipe.exact:
            from megatron_jetrl.precision.linear import exact_kernels

            return exact_kernels(self.device)
        return self.decode == "static"

    def _finish(self, prompts, out_ids, out_lp, params) -> list[Generation]:
        ids = torch.stack(out_ids, 1).tolist()
        lps = torch.stack(out_lp, 1).tolist()
        stop_set = set(params.stop_token_ids)
        gens = []
        for i in range(len(prompts)):
            n, reason = len(ids[i]), "length"
            for j, tok in enumerate(ids[i]):
                if tok in stop_set:
                    n, reason = j + 1, "stop"
                    break
            gens.append(Generation(prompts[i], ids[i][:n], lps[i][:n], reason, self.weight_version))
        return gens

    def _left_pad(self, prompts):
        B, P = len(prompts), max(len(p) for p in prompts)
        tokens = torch.full((B, P), self.pad_id, dtype=torch.long, device=self.device)
        key_pad = torch.ones((B, P), dtype=torch.bool, device=self.device)
        for i, p in enumerate(prompts):
            tokens[i, P - len(p):] = torch.tensor(p, device=self.device)
            key_pad[i, P - len(p):] = False
        return tokens, key_pad

    def pad_rows(self, tokens: torch.Tensor, key_pad: torch.Tensor, rows: int):
        """Left-padded ``tokens``/``key_pad`` extended to ``rows`` rows of pad tokens (all masked)."""
        extra, P = rows - tokens.shape[0], tokens.shape[1]
        if extra <= 0:
            return tokens, key_pad
        return (torch.cat([tokens, torch.full((extra, P), self.pad_id, dtype=tokens.dtype, device=tokens.device)]),
                torch.cat([key_pad, torch.ones((extra, P), dtype=torch.bool, device=key_pad.device)]))

    @torch.no_grad()
    def _generate_static(self, prompts: list[list[int]], params: SamplingParams, seeds=None,
                         shape: tuple[int, int, int | None] | None = None) -> list[Generation]:
        tokens, key_pad = self._left_pad(prompts)
        B, P = tokens.shape
        rows, length, max_rows = shape or (B, 0, None)
        was_training = self.model.training
        self.model.eval()
        try:
            with self.fp8_state.rollout_precision():
                self._refresh_fp8()
                dec = self._static_decoder(max(B, rows), max(P + params.max_new_tokens, length), max_rows)
                extra = dec.B - B  # rows beyond the batch decode pad tokens and are never sampled
                tokens, key_pad = self.pad_rows(tokens, key_pad, dec.B)
                pads = torch.full((extra,), self.pad_id, dtype=torch.long, device=self.device)
                captured = dec.capture_s
                t0 = time.perf_counter()
                step = (lambda ids, t: dec.step(torch.cat([ids, pads]))[:B]) if extra else (lambda ids, t: dec.step(ids))
                out_ids, out_lp = self._sample_loop(dec.prefill(tokens, key_pad)[:B], step, params,
                                                    self._row_seeds(prompts, seeds))
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.last_stats = {"decode_steps": len(out_ids), "graph_capture_s": dec.capture_s - captured,
                                   "generate_s": time.perf_counter() - t0, "cuda_graphs": dec.use_graphs}
        finally:
            self.model.train(was_training)
        return self._finish(prompts, out_ids, out_lp, params)

    def _row_seeds(self, prompts, seeds):
        """(seeds [B], positions of each row's last prompt token [B]) on the device, or None."""
        if seeds is None:
            return None
        return (torch.tensor(seeds, dtype=torch.int64, device=self.device),
                torch.tensor([len(p) - 1 for p in prompts], dtype=torch.int64, device=self.device))

    def _sample_loop(self, logits, step, params: SamplingParams, seeded=None):
        """Sample a token per row from ``logits``, get the next logits from ``step(ids, t)``, until
        ``max_new_tokens`` or every row stopped; returns the per-step ids and logprobs (device).
        ``seeded``: (row seeds, last prompt positions) for SGLang's per-row seeded draw."""
        B = logits.shape[0]
        out_ids, out_lp = [], []
        done = torch.zeros(B, dtype=torch.bool, device=logits.device)
        stops = torch.tensor(list(params.stop_token_ids) or [-1], device=logits.device)
        # the fused sampler's Philox stream: one seed per rollout from the engine's generator, + step
        # (exact mode: the drawn token's logprob with the trainer's code, fused_logp.label_logp)
        exact = self.fp8_state is not None and self.fp8_state.recipe.exact
        seed = (int(torch.randint(0, 2**30, (1,), generator=self.generator, device=self.generator.device))
                if fused_sampling(logits, params) and seeded is None else None)
        for t in range(params.max_new_tokens):
            ids, lp = sample_next(logits, params, self.generator, None if seed is None else seed + 7919 * t,
                                  *((seeded[0], seeded[1] + t) if seeded is not None else ()), exact=exact)
            ids = torch.where(done, torch.full_like(ids, self.pad_id), ids)
            out_ids.append(ids)
            out_lp.append(lp)
            done |= torch.isin(ids, stops)
            # the all-stopped check syncs with the host: every SYNC_EVERY tokens, not per token
            # (tokens drawn after a row stopped are pad and trimmed by _finish)
            if t == params.max_new_tokens - 1 or (t % SYNC_EVERY == SYNC_EVERY - 1 and bool(done.all())):
                break
            logits = step(ids, t)
        return out_ids, out_lp

    @torch.no_grad()
    def _generate_exact(self, prompts: list[list[int]], params: SamplingParams, seeds=None) -> list[Generation]:
        """``precision.exact`` on the CPU emulation (CUDA runs the static decoder on the batch-invariant kernels):
        every token from the trainer's own forward (``model(tokens, positions, None)``, causal,
        the call the trainer's micro-batches make) over the batch right-padded to ``models.builder.exact_length``
        positions, the length the trainer pads its micro-batches to: a row's logits at position p are then the bits
        the trainer's forward computes there (the GEMMs give a row the same bits at any row count, the causal
        attention ignores the positions after p, checked in the tests), and ``sample_next`` takes
        ``log_softmax(logits / T)``, the trainer's exact statement. No KV cache: one full forward per token."""
        from megatron_jetrl.models.builder import exact_length

        B, dev = len(prompts), self.device
        L = exact_length(self.model, max(len(p) for p in prompts) + params.max_new_tokens)
        tokens = torch.full((B, L), self.pad_id, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p, device=dev)
        last = torch.tensor([len(p) - 1 for p in prompts], device=dev)  # each row's last token
        positions, rows = torch.arange(L, device=dev).expand(B, L), torch.arange(B, device=dev)
        was_training = self.model.training
        self.model.eval()

        def forward():  # the logits as the trainer's log_softmax reads them (one rank holds the vocabulary)
            return self.model(tokens, positions, None)[rows, last]

        def step(ids, t):
            last.add_(1)
            tokens[rows, last] = ids
            return forward()

        try:
            with self.fp8_state.rollout_precision():
                self._refresh_fp8()
                t0 = time.perf_counter()
                out_ids, out_lp = self._sample_loop(forward(), step, params, self._row_seeds(prompts, seeds))
                self.last_stats = {"decode_steps": len(out_ids), "generate_s": time.perf_counter() - t0,
                                   "cuda_graphs": False}
        finally:
            self.model.train(was_training)
        return self._finish(prompts, out_ids, out_lp, params)

    @torch.no_grad()
    def _generate_megatron(self, prompts: list[list[int]], params: SamplingParams, seeds=None) -> list[Generation]:
        from megatron.core.inference.contexts import StaticInferenceContext

        tokens, key_pad = self._left_pad(prompts)
        (B, P), dev = tokens.shape, self.device
        ctx = StaticInferenceContext(B, P + params.max_new_tokens)
        causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
        allowed = causal[None] & ~key_pad[:, None, :]
        allowed |= torch.eye(P, dtype=torch.bool, device=dev)[None]  # pad rows see themselves (no NaN)
        was_training = self.model.training
        self.model.eval()
        state = {"key_pad": key_pad}

        def step(ids, t):
            state["key_pad"] = torch.cat([state["key_pad"], torch.zeros(B, 1, dtype=torch.bool, device=dev)], 1)
            pos = torch.full((B, 1), P + t, device=dev)
            logits = self._logits(self.model(ids[:, None], pos, state["key_pad"][:, None, None, :],
                                             inference_context=ctx))[:, -1]
            ctx.increment_sequence_len_offset(1)
            return logits

        try:
            with self.fp8_state.rollout_precision():
                pos = torch.arange(P, device=dev).expand(B, P)
                logits = self._logits(self.model(tokens, pos, ~allowed[:, None], inference_context=ctx))[:, -1]
                ctx.increment_sequence_len_offset(P)
                ctx.enable_decode_mode()
                out_ids, out_lp = self._sample_loop(logits, step, params, self._row_seeds(prompts, seeds))
        finally:
            self.model.train(was_training)
        return self._finish(prompts, out_ids, out_lp, params)

    def fp8_hashes(self) -> dict[str, str]:
        """Receiving side: hashes (by HF name) of the FP8 weights and scales this engine runs with,
        read through the same export path an SGLang server is fed from."""
        from megatron_jetrl.sync.export import ExportOptions, iter_hf_tensors

        if self.model_cfg is None or not self.fp8_state.recipe.rollout_fp8:
            return {}
        return {n: tensor_hash(t) for n, t in iter_hf_tensors(self.model, self.model_cfg, ExportOptions(fp8=True))
                if is_fp8_payload(n, t)}

    def update_weights(self, version: int, hashes: dict[str, str] | None = None) -> dict:
        """In process the engine already shares the trainer's parameters and FP8 cache: the
        hand-over is the version bump plus the parity check of the bytes it will run with."""
        self.weight_version = version
        if hashes is None:
            self.last_parity = {"parity_checked": 0, "parity_mismatch": 0}
            return self.last_parity
        mine = self.fp8_hashes()
        bad = [k for k, v in hashes.items() if mine.get(k) != v]
        self.last_parity = {"parity_checked": len(hashes), "parity_mismatch": len(bad)}
        return self.last_parity

    def push_weights(self, version: int, items, check_parity: bool = True, disk_push=None) -> dict:
        """In process the weights are the trainer's own: nothing is pushed (``update_weights``)."""
        raise NotImplementedError("the in-process engine runs the trainer's weights; use update_weights")

    def heal(self) -> int:
        return 0  # nothing to restart in process

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the static decoder's KV cache and CUDA graphs (rebuilt by the next ``generate``)."""
        self._decoder = None

    def resume_memory(self, tags: list[str] | None = None) -> None:
        pass

    def shutdown(self) -> None:
        self._decoder = None
