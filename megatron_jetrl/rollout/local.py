"""In-process rollout engine over the trainer's own megatron-core model object.

It runs the model with the rollout precision (``FP8ModelState.rollout_precision``): in ``jet``
mode the same cached FP8 weight bytes the training forward uses, in ``fp8_rollout`` mode FP8
while training stays BF16. Batched generation with a KV cache (megatron-core's
``StaticInferenceContext``): left-padded prompts, one prefill, then one token per step. Pad keys
are masked; RoPE is relative, so left padding does not change the result beyond rounding.
"""
from __future__ import annotations

import torch

from megatron_jetrl.rollout.base import Generation, SamplingParams, sample_next
from megatron_jetrl.sync.transport import is_fp8_payload, tensor_hash


SYNC_EVERY = 8


class LocalEngine:
    def __init__(self, model, fp8_state, pad_id: int, seed: int = 0, vocab_size: int | None = None,
                 model_cfg=None):
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise ValueError("rollout.engine=local needs parallel.pipeline_parallel=1; pipelined "
                             "trainers need the SGLang fleet (rollout.engine=sglang, not implemented yet)")
        self.model, self.fp8_state, self.pad_id, self.model_cfg = model, fp8_state, pad_id, model_cfg
        self.vocab_size = vocab_size
        self.weight_version = 0
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.last_parity: dict = {}

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        out = gather_from_tensor_model_parallel_region(out)
        return out[..., : self.vocab_size] if self.vocab_size else out

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        from megatron.core.inference.contexts import StaticInferenceContext

        B, P = len(prompts), max(len(p) for p in prompts)
        dev = self.device
        tokens = torch.full((B, P), self.pad_id, dtype=torch.long, device=dev)
        key_pad = torch.ones((B, P), dtype=torch.bool, device=dev)
        for i, p in enumerate(prompts):
            tokens[i, P - len(p):] = torch.tensor(p, device=dev)
            key_pad[i, P - len(p):] = False
        ctx = StaticInferenceContext(B, P + params.max_new_tokens)
        causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
        allowed = causal[None] & ~key_pad[:, None, :]
        allowed |= torch.eye(P, dtype=torch.bool, device=dev)[None]  # pad rows see themselves (no NaN)
        was_training = self.model.training
        self.model.eval()
        out_ids, out_lp = [], []
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        stops = torch.tensor(list(params.stop_token_ids) or [-1], device=dev)
        try:
            with self.fp8_state.rollout_precision():
                pos = torch.arange(P, device=dev).expand(B, P)
                logits = self._logits(self.model(tokens, pos, ~allowed[:, None], inference_context=ctx))[:, -1]
                ctx.increment_sequence_len_offset(P)
                ctx.enable_decode_mode()
                for t in range(params.max_new_tokens):
                    ids, lp = sample_next(logits, params, self.generator)
                    ids = torch.where(done, torch.full_like(ids, self.pad_id), ids)
                    out_ids.append(ids)
                    out_lp.append(lp)
                    done |= torch.isin(ids, stops)
                    # the all-stopped check syncs with the host: every SYNC_EVERY tokens, not per token
                    # (tokens drawn after a row stopped are pad and trimmed below)
                    if t == params.max_new_tokens - 1 or (t % SYNC_EVERY == SYNC_EVERY - 1 and bool(done.all())):
                        break
                    key_pad = torch.cat([key_pad, torch.zeros(B, 1, dtype=torch.bool, device=dev)], 1)
                    pos = torch.full((B, 1), P + t, device=dev)
                    logits = self._logits(self.model(ids[:, None], pos, key_pad[:, None, None, :],
                                                     inference_context=ctx))[:, -1]
                    ctx.increment_sequence_len_offset(1)
        finally:
            self.model.train(was_training)
        ids = torch.stack(out_ids, 1).tolist()
        lps = torch.stack(out_lp, 1).tolist()
        stop_set = set(params.stop_token_ids)
        gens = []
        for i in range(B):
            n, reason = len(ids[i]), "length"
            for j, tok in enumerate(ids[i]):
                if tok in stop_set:
                    n, reason = j + 1, "stop"
                    break
            gens.append(Generation(prompts[i], ids[i][:n], lps[i][:n], reason, self.weight_version))
        return gens

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

    def release_memory(self) -> None:
        """Nothing to release in process: the KV cache lives only inside ``generate``."""

    def resume_memory(self) -> None:
        pass
