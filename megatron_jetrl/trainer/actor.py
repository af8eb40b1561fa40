"""The trainer actor: megatron-core model + DDP + optimizer; logprobs, RL and SFT steps.

After every optimizer step the FP8 weight cache is re-quantized once (``refresh_fp8_weights``):
the bytes every micro-batch of the next step, the rollout and the weight export use.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_jetrl.config import AlgoConfig, ParallelConfig
from megatron_jetrl.precision.linear import FP8ModelState, drop_dgrad_weights, refresh_fp8_weights
from megatron_jetrl.trainer import loss as L
from megatron_jetrl.trainer.pipeline import run_microbatches

log = logging.getLogger("jetrl")


@dataclass
class RLBatch:
    """Right-padded sequences [N, S] (prompt + response + pad) and per-label-position tensors
    [N, S-1] (position j predicts token j+1)."""

    tokens: torch.Tensor
    mask: torch.Tensor           # 1 where label j+1 is a response token
    rollout_logp: torch.Tensor   # sampler's logprobs at those positions (0 elsewhere)
    advantages: torch.Tensor     # [N]
    old_logp: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None

    def split(self, size: int) -> list["RLBatch"]:
        n = self.tokens.shape[0]
        out = []
        for i in range(0, n, size):
            sl = slice(i, i + size)
            out.append(RLBatch(self.tokens[sl], self.mask[sl], self.rollout_logp[sl], self.advantages[sl],
                               None if self.old_logp is None else self.old_logp[sl],
                               None if self.ref_logp is None else self.ref_logp[sl]))
        return out


def build_batch(prompts: list[list[int]], responses: list[list[int]], response_logps: list[list[float]],
                advantages: torch.Tensor, pad_id: int, device) -> RLBatch:
    seqs = [p + r for p, r in zip(prompts, responses)]
    S = max(len(s) for s in seqs)
    N = len(seqs)
    tokens = torch.full((N, S), pad_id, dtype=torch.long)
    mask = torch.zeros((N, S - 1))
    rlp = torch.zeros((N, S - 1))
    for i, (p, r, lp) in enumerate(zip(prompts, responses, response_logps)):
        tokens[i, : len(p) + len(r)] = torch.tensor(p + r)
        if r:
            mask[i, len(p) - 1: len(p) - 1 + len(r)] = 1.0
            rlp[i, len(p) - 1: len(p) - 1 + len(r)] = torch.tensor(lp)
    return RLBatch(tokens.to(device), mask.to(device), rlp.to(device), advantages.float().to(device))


def vocab_parallel_logp_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                                with_entropy: bool, entropy_grad: bool = True, fused: Optional[bool] = None,
                                exact: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log p(label) under softmax(logits / T) and the entropy, with the vocabulary split over TP
    ranks (megatron-core's vocab-parallel cross entropy; entropy from all-reduced partial sums).

    ``entropy_grad=False``: the entropy is a metric only (no entropy bonus): computed without
    autograd before the cross entropy consumes ``z`` in place, so neither a second fp32 copy of the
    [tokens x vocab] logits nor the exp() of it is kept for backward (several GB per micro-batch
    at a 128K vocabulary). On CUDA both come from ``fused_logp.fused_logp_entropy`` (one Triton kernel
    over the bf16 logits each way, no fp32 copy); this eager path is the CPU one and the reference
    (``fused=False``; None: the fused kernels wherever they run). ``exact`` (``precision.exact``, one rank holds
    the vocabulary): the logprob is the rollout sampler's (``fused_logp.label_logp``) bit for bit for the same logits
    row: the fused kernel's value where it runs, ``log_softmax(logits.float() / T)`` at the labels elsewhere."""
    from megatron.core import tensor_parallel

    from megatron_jetrl.kernels.fused_logp import fused_enabled, fused_logp_entropy

    use_fused = fused_enabled(logits) if fused is None else fused
    if exact and not use_fused:
        z = logits.float() / temperature
        logp = torch.log_softmax(z, -1).gather(-1, labels[..., None]).squeeze(-1)
        if not with_entropy:
            return logp, None
        return logp, _entropy(z) if entropy_grad else _entropy(z.detach())
    # CUDA: one kernel forward, one backward, no fp32 logits (kernels/fused_logp.py)
    if use_fused:
        logp, entropy = fused_logp_entropy(logits, labels, temperature)
        if not with_entropy:
            return logp, None
        return logp, entropy if entropy_grad else entropy.detach()
    z = logits.float() / temperature
    entropy = None
    if with_entropy and not entropy_grad:
        with torch.no_grad():
            entropy = _entropy(z)
    # megatron's vocab-parallel cross entropy works in place on its input: give it its own copy
    # when z is needed afterwards.
    need_z = with_entropy and entropy_grad
    logp = -tensor_parallel.vocab_parallel_cross_entropy(z.clone() if need_z else z, labels)
    if need_z:
        entropy = _entropy(z)
    return logp, entropy


def _entropy(z: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) over the TP-split last dim (differentiable when z is)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    with torch.no_grad():
        zmax = z.max(-1, keepdim=True).values
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - zmax)
    sums = torch.stack([e.sum(-1), (e * z).sum(-1)])
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        sums = reduce_from_tensor_model_parallel_region(sums)
    lse = torch.log(sums[0]) + zmax.squeeze(-1)
    return lse - sums[1] / sums[0]


def padded_length(s: int, micro_batch: int, multiple: int, max_len: Optional[int] = None) -> int:
    """The smallest length >= ``s`` at which ``micro_batch`` sequences hold a multiple of ``multiple`` tokens
    (``s`` itself for ``multiple`` <= 1 or when that length passes ``max_len``)."""
    import math

    if multiple <= 1:
        return s
    step = multiple // math.gcd(multiple, micro_batch)
    p = -(-s // step) * step
    return s if max_len is not None and p > max_len else p


def train_seq_len(s: int, micro_batch: int, pad_tokens_to: int, fp8_gpu: bool, max_len: Optional[int]) -> int:
    """The model's input length for micro-batches of ``micro_batch`` sequences of ``s`` positions under
    ``algo.pad_tokens_to`` (see its doc; ``fp8_gpu``: the training linears run FP8 GEMMs on a GPU)."""
    multiple = pad_tokens_to if pad_tokens_to >= 0 else (16 if fp8_gpu else 0)
    return padded_length(s, micro_batch, multiple, max_len)


def _microbatch(b: RLBatch, seq_len: Optional[int] = None, exact: bool = False) -> dict:
    """The model inputs of a micro-batch (positions 0..S-2), right-padded to ``seq_len`` positions; ``targets``
    are the labels (positions 1..S-1) padded alike. Pad positions come after every real one, so under the
    causal mask they change nothing before them; :func:`_logp` cuts them off the logprobs. ``exact``: the
    logprobs are the rollout sampler's bits (``precision.exact``; ``vocab_parallel_logp_entropy``)."""
    inputs, targets = b.tokens[:, :-1], b.tokens[:, 1:]
    if seq_len is not None and seq_len > inputs.shape[1]:
        pad = (0, seq_len - inputs.shape[1])
        inputs, targets = torch.nn.functional.pad(inputs, pad), torch.nn.functional.pad(targets, pad)
    return {"tokens": inputs, "position_ids": torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs),
            "targets": targets, "batch": b, "exact": exact}


def _logp(mb: dict, logits: torch.Tensor, temperature: float, with_entropy: bool, entropy_grad: bool = True
          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`vocab_parallel_logp_entropy` of a micro-batch's targets, without its pad positions ([b, S-1])."""
    logp, ent = vocab_parallel_logp_entropy(logits, mb["targets"], temperature, with_entropy, entropy_grad,
                                            exact=mb.get("exact", False))
    n = mb["batch"].tokens.shape[1] - 1
    if logp.shape[1] != n:
        logp, ent = logp[:, :n], None if ent is None else ent[:, :n]
    return logp, ent


@torch.no_grad()
def train_logprobs(model, batch: RLBatch, temperature: float, micro_batch_size: int,
                   seq_len: Optional[int] = None, exact: bool = False) -> Optional[torch.Tensor]:
    """Logprobs of ``batch``'s labels [N, S-1] from a forward of ``model`` in its current (training)
    precision, through the pipeline schedule (inputs right-padded to ``seq_len``; ``exact``: see
    :func:`_microbatch`); None on non-last pipeline stages."""
    from megatron.core import parallel_state

    out = []

    def loss_func(mb, logits):
        logp, _ = _logp(mb, logits, temperature, False)
        out.append(logp)
        return logp.sum() * 0, {}

    was = model.training
    model.eval()
    run_microbatches(model, [_microbatch(b, seq_len, exact) for b in batch.split(micro_batch_size)], loss_func, True)
    model.train(was)
    return torch.cat(out) if parallel_state.is_pipeline_last_stage() else None


def _fuse_torch_adam(opt) -> bool:
    """Switch megatron's torch-Adam fallback to torch's fused kernel (same math, one kernel per
    group instead of a foreach loop over tensors). TE's/apex's FusedAdam are left alone. Returns
    whether any group was switched."""
    switched = False
    for inner in getattr(opt, "chained_optimizers", None) or [opt]:
        torch_opt = getattr(inner, "optimizer", None)
        if type(torch_opt) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        for group in torch_opt.param_groups:
            if all(p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in group["params"]):
                group["fused"], group["foreach"] = True, False
                switched = True
    return switched


def _fp8_wgrad_fusion(state: FP8ModelState) -> str:
    """How the FP8 wgrad reaches main_grad in this run (for the log line)."""
    if not state.recipe.train_fp8:
        return "no FP8 training in this mode"
    if not state.fuse_wgrad_accumulation:
        return "unfused (precision.fuse_wgrad_accumulation=false)"
    backend = getattr(state, "backend", state.requested_backend)
    if backend == "scaled_mm":
        from megatron_jetrl.kernels import cublaslt

        ok, why = cublaslt.available()
        return "fused (cuBLASLt, beta = 1)" if ok else f"unfused ({why})"
    return "TransformerEngine's own" if backend == "te" else f"fused ({backend} backend)"


class Actor:
    def __init__(self, model, fp8_state: FP8ModelState, algo: AlgoConfig, parallel: ParallelConfig,
                 params_dtype: torch.dtype, total_steps: int, temperature: float = 1.0):
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.algo, self.fp8_state, self.temperature = algo, fp8_state, temperature
        # the training linears run FP8 GEMMs on a GPU (algo.pad_tokens_to's auto rule)
        self._fp8_gpu = fp8_state.recipe.train_fp8 and next(model.parameters()).is_cuda
        self.dp = parallel_state.get_data_parallel_world_size()
        use_dist_opt = parallel.distributed_optimizer and self.dp > 1
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=use_dist_opt)
        self.model = DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model)
        model.config.finalize_model_grads_func = finalize_model_grads
        # weight gradients straight into DDP's fp32 main_grad: megatron's BF16 linears here (models/grad_accum.py),
        # the FP8 linears in their own backward (precision/linear.py); precision.fuse_wgrad_accumulation
        from megatron_jetrl.models.grad_accum import enable as enable_grad_accum_fusion

        self.grad_accum_fused_layers = enable_grad_accum_fusion(model, fp8_state.fuse_wgrad_accumulation)
        log.info("gradient-accumulation fusion: on for megatron's BF16 path in %d linears; FP8 wgrad: %s",
                 self.grad_accum_fused_layers, _fp8_wgrad_fusion(fp8_state))
        min_lr = algo.lr if algo.lr_schedule == "constant" else algo.min_lr  # megatron keeps it per param group
        opt_cfg = OptimizerConfig(optimizer="adam", lr=algo.lr, min_lr=min_lr, weight_decay=algo.weight_decay,
                                  adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
                                  clip_grad=algo.grad_clip, bf16=params_dtype == torch.bfloat16,
                                  params_dtype=params_dtype, use_distributed_optimizer=use_dist_opt)
        self.optimizer = get_megatron_optimizer(opt_cfg, [self.model])
        from megatron_jetrl.trainer import multi_tensor

        multi_tensor.install()  # megatron's no-TE/APEX gradient norm and clipping as foreach kernels
        self.fused_adam = algo.fused_adam and _fuse_torch_adam(self.optimizer)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if algo.lr_warmup_steps else algo.lr, max_lr=algo.lr,
            min_lr=min_lr,
            lr_warmup_steps=algo.lr_warmup_steps, lr_decay_steps=max(total_steps, algo.lr_warmup_steps + 1),
            lr_decay_style=algo.lr_schedule, start_wd=algo.weight_decay, end_wd=algo.weight_decay,
            wd_incr_steps=max(total_steps, 1), wd_incr_style="constant")
        self.steps = 0
        self.skipped_steps = 0     # optimizer steps skipped for non-finite gradients (in a checkpoint's loop state)
        self.skipped_in_a_row = 0
        self.ref_model = None
        self._offloader = None
        self._releasable = self._release_candidates()
        self._released = False
        # released from the start: the rollout engine's graphs see the placeholders from their first capture
        # (checkpoint loads restore the weights first; every write after setup is the optimizer's)
        self.release_weights()

    @property
    def module(self):
        return self.model.module

    # -- colocated scheduling: give the device to the rollout engine and take it back ---------------
    OFFLOAD_PARTS = ("optimizer", "grads", "params")

    def offload(self, parts: tuple[str, ...] = OFFLOAD_PARTS) -> int:
        """Move ``parts`` of the trainer's state to host memory (``optimizer``: master weights and
        Adam moments; ``grads``: gradient buffers; ``params``: parameters and the FP8 cache);
        returns bytes released. The weight push needs only the params, so the scheduler offloads
        the optimizer and grads first, the params after the push. Every tensor stays the same object
        (``memory.Offloader``)."""
        from megatron_jetrl.memory import Offloader, grad_tensors, optimizer_tensors, param_tensors

        if self._offloader is None:  # claim storages once, params first (an fp32 master may be the param)
            bufs = [buf for group in (getattr(self.model, "buffers", []), getattr(self.model, "expert_parallel_buffers", []))
                    for buf in group]
            seen: set = set()
            self._offloader = {
                "params": Offloader(param_tensors(self.module) + [b.param_data for b in bufs if b.param_data is not None], seen),
                "grads": Offloader(grad_tensors(self.module) + [b.grad_data for b in bufs if b.grad_data is not None], seen),
                "optimizer": Offloader(optimizer_tensors(self.optimizer), seen)}
        return sum(self._offloader[p].offload() for p in parts)

    def offloaded_bytes(self) -> int:
        return sum(o.nbytes() for o in self._offloader.values() if o.offloaded) if self._offloader else 0

    def reload(self) -> int:
        """Everything offloaded comes back (bit-identical)."""
        if self._offloader is None:
            return 0
        n = sum(o.reload() for o in self._offloader.values())
        self._offloader = None  # storages are claimed afresh next time (the optimizer may add state)
        return n

    # -- the FP8 linears' BF16 weights between steps (precision.release_bf16_weights) -------------------
    def _release_candidates(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(BF16 weight, its fp32 master) of each FP8 linear whose BF16 copy nothing reads between the
        re-quantization and the next optimizer step: ``jet`` training (forward and backward read only the FP8
        cache), a mixed-precision optimizer holding a separate fp32 master, a standalone storage (not a view
        into a DDP buffer, which megatron's distributed optimizer keeps)."""
        st = self.fp8_state
        if not (st.recipe.train_fp8 and st.release_bf16_weights):
            return []
        master = {}
        for inner in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
            for model_group, main_group in zip(getattr(inner, "float16_groups", []),
                                               getattr(inner, "fp32_from_float16_groups", [])):
                master.update({id(p): m for p, m in zip(model_group, main_group)})
        from megatron_jetrl.precision.linear import FP8LinearMixin

        out = []
        for m in self.module.modules():
            w = getattr(m, "weight", None)
            if (isinstance(m, FP8LinearMixin) and m.fp8_cache is not None and isinstance(w, torch.Tensor)
                    and id(w) in master and w.is_contiguous()
                    and w.untyped_storage().nbytes() == w.numel() * w.element_size()):
                out.append((w, master[id(w)]))
        return out

    def release_weights(self) -> int:
        """Free the BF16 storage of the FP8 linears' weights (the FP8 caches are made current first): each
        parameter keeps its identity and shape over a one-element stride-0 placeholder (a stray read gets
        garbage, never freed memory). The next optimizer step writes them anew from the fp32 masters;
        ``restore_weights`` brings them back for anything else that reads them (checkpoints). Returns bytes
        freed."""
        if self._released or not self._releasable:
            return 0
        from megatron_jetrl.precision.linear import FP8LinearMixin

        for m in self.module.modules():
            if isinstance(m, FP8LinearMixin) and m.fp8_cache is not None and m.fp8_active():
                m.fp8_weight()  # current version (re-quantizes only if stale), before the BF16 bytes go
        n = 0
        for w, _ in self._releasable:
            n += w.numel() * w.element_size()
            w.data = torch.empty(1, dtype=w.dtype, device=w.device).expand(w.shape)
        self._released = True
        return n

    @torch.no_grad()
    def restore_weights(self, values: bool = True) -> bool:
        """Give released BF16 weights their storage back; ``values``: and their bytes (the fp32 master rounded
        to BF16, which is what they held). Returns whether anything was released."""
        if not self._released:
            return False
        for w, _ in self._releasable:
            w.data = torch.empty(w.shape, dtype=w.dtype, device=w.device)
        if values:
            self._restore_values()
        self._released = False
        return True

    # -- forward passes ---------------------------------------------------------------------------
    def compute_logprobs(self, batch: RLBatch, model=None) -> Optional[torch.Tensor]:
        """Per-position logprobs of the labels [N, S-1] in training precision (last PP stage;
        None elsewhere)."""
        if model is None:
            self.release_weights()
        return train_logprobs(model or self.model, batch, self.temperature, self.algo.micro_batch_size,
                              self.seq_len(batch), self.fp8_state.recipe.exact)

    def seq_len(self, batch: RLBatch) -> int:
        """The model's input length for ``batch``'s micro-batches (``algo.pad_tokens_to``; ``precision.exact`` on the
        CPU emulation: the model's ``max_position_embeddings``, the length its exact rollout decodes at; the
        batch-invariant kernels need no common length)."""
        from megatron_jetrl.precision.linear import exact_kernels

        s = batch.tokens.shape[1] - 1
        if self.fp8_state.recipe.exact and not exact_kernels(batch.tokens):
            from megatron_jetrl.models.builder import exact_length

            return exact_length(self.module, s)
        return train_seq_len(s, min(self.algo.micro_batch_size, batch.tokens.shape[0]), self.algo.pad_tokens_to,
                             self._fp8_gpu, getattr(self.module, "max_position_embeddings", None))

    def _global_count(self, x: float) -> float:
        from megatron.core import parallel_state

        t = torch.tensor([x], dtype=torch.float64, device=next(self.module.parameters()).device)
        if self.dp > 1:
            dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
        return float(t)

    def _optimizer_step(self, lr: Optional[float] = None) -> dict:
        t0 = time.perf_counter()
        if lr is not None:  # a fixed rate for this step (SFT warm-up); the schedule sets it back
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        released = self.restore_weights(values=False)  # storage only: the step writes every byte from the masters
        if self._grads_finite():
            ok, grad_norm, _ = self.optimizer.step()
        else:  # megatron's BF16/FP32 optimizers would apply them: NaN weights from here on
            ok, grad_norm = False, float("nan")
        self.skipped_steps += not ok
        self.skipped_in_a_row = 0 if ok else self.skipped_in_a_row + 1
        if released and not ok:  # a skipped step (non-finite gradients) wrote nothing: the old bytes back
            self._restore_values()
        self.scheduler.step(increment=1)
        self.steps += 1
        requant = refresh_fp8_weights(self.module, self.fp8_state)
        self.release_weights()
        return {"grad_norm": float(grad_norm) if grad_norm is not None else 0.0, "update_ok": float(bool(ok)),
                "skipped_steps": float(self.skipped_steps),
                "lr": self.optimizer.param_groups[0]["lr"], "time_fp8_requant": requant,
                "time_optimizer": time.perf_counter() - t0 - requant}

    @torch.no_grad()
    def _grads_finite(self) -> bool:
        """Every gradient of this step finite, agreed by every rank (one pass over the DDP gradient buffers
        and one all-reduce of a flag): a non-finite loss or gradient skips the update everywhere."""
        bad = torch.zeros((), dtype=torch.float32, device=next(self.module.parameters()).device)
        for buf in self.model.buffers + self.model.expert_parallel_buffers:
            if buf.grad_data is not None:
                bad = torch.maximum(bad, (~torch.isfinite(buf.grad_data)).any().float())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad)

    @torch.no_grad()
    def _restore_values(self) -> None:
        for w, main in self._releasable:
            w.copy_(main)

    def train_step(self, batch: RLBatch) -> dict:
        """One optimizer step of the clipped policy-gradient objective over ``batch``. Without
        ``batch.old_logp`` (``algo.recompute_logprobs=false``) each micro-batch's own forward, detached, is
        the old policy's logprobs (this is the batch's only optimizer step) and is written to
        ``batch.old_logp`` for the mismatch metrics."""
        from megatron.core import parallel_state

        self.release_weights()
        a = self.algo
        # (a non-last pipeline stage has no logprobs: its loss_func never runs)
        fill_old = batch.old_logp is None and parallel_state.is_pipeline_last_stage()
        if fill_old:
            batch.old_logp = torch.zeros_like(batch.rollout_logp)
        mbs = batch.split(a.micro_batch_size)
        n_mb = len(mbs)
        # Normalizer over the whole global batch (all micro-batches, all DP ranks); megatron
        # divides each micro-batch loss by n_mb and DDP averages over DP: undo both.
        if a.loss_agg == "token_mean":
            denom = self._global_count(float(batch.mask.sum()))
        else:
            denom = self._global_count(float(batch.tokens.shape[0]))
        scale = n_mb * self.dp / max(denom, 1.0)
        stats: list[dict] = []

        def loss_func(mb, logits):
            b = mb["batch"]
            logp, ent = _logp(mb, logits, self.temperature, with_entropy=True, entropy_grad=bool(a.entropy_coef))
            if fill_old:  # a view into batch.old_logp: the logprobs under the weights before this step's update
                b.old_logp.copy_(logp.detach())
            is_w = None
            if a.tis_cap is not None:
                is_w = L.truncated_is_weights(b.old_logp, b.rollout_logp, a.tis_cap)
            per_tok, st = L.policy_loss(logp, b.old_logp, b.advantages, b.mask, a.clip_eps_low,
                                        a.clip_eps_high, is_w)
            if a.kl_coef and b.ref_logp is not None:
                kl = L.kl_estimate(logp, b.ref_logp, a.kl_estimator)
                per_tok = per_tok + a.kl_coef * kl
                st["kl_ref"] = L.masked_mean(kl.detach(), b.mask)
            if a.entropy_coef:
                per_tok = per_tok - a.entropy_coef * ent
            if a.loss_agg == "token_mean":
                loss = (per_tok * b.mask).sum() * scale
            else:
                loss = L.masked_mean(per_tok, b.mask, dim=1).sum() * scale
            st["entropy"] = L.masked_mean(ent.detach(), b.mask)
            st["pg_loss"] = L.masked_mean(per_tok.detach(), b.mask)
            if is_w is not None:
                st["tis_weight_mean"] = L.masked_mean(is_w, b.mask)
            stats.append({k: v.detach() if torch.is_tensor(v) else v for k, v in st.items()})  # no host sync here
            return loss, {}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        t0 = time.perf_counter()
        seq_len = self.seq_len(batch)
        exact = self.fp8_state.recipe.exact
        run_microbatches(self.model, [_microbatch(b, seq_len, exact) for b in mbs], loss_func, forward_only=False)
        drop_dgrad_weights(self.module)
        if torch.cuda.is_available():  # the optimizer waits for the backward anyway (its non-finite check):
            torch.cuda.synchronize()  # waiting here puts the backward's GPU time in fwd_bwd, not in the optimizer's
        fwd_bwd = time.perf_counter() - t0
        out = self._optimizer_step()
        out["time_fwd_bwd"] = fwd_bwd
        # the model's input length and the share of it that is padding (algo.pad_tokens_to)
        out["train_seq_len"], out["train_pad_frac"] = float(seq_len), 1.0 - (batch.tokens.shape[1] - 1) / seq_len
        if stats:  # one host sync for all micro-batches' statistics
            for k in stats[0]:
                out[k] = float(sum(s[k] for s in stats) / len(stats))
        return out

    def sft_step(self, batch: RLBatch) -> dict:
        """Supervised warm-up: masked NLL of the response tokens (same FP8 flow as RL)."""
        self.release_weights()
        mbs = batch.split(self.algo.micro_batch_size)
        scale = len(mbs) * self.dp / max(self._global_count(float(batch.mask.sum())), 1.0)
        losses = []

        def loss_func(mb, logits):
            b = mb["batch"]
            logp, _ = _logp(mb, logits, 1.0, False)
            losses.append(L.masked_mean(-logp.detach(), b.mask))  # summed on the host once, below
            return -(logp * b.mask).sum() * scale, {}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        seq_len = self.seq_len(batch)
        exact = self.fp8_state.recipe.exact
        run_microbatches(self.model, [_microbatch(b, seq_len, exact) for b in mbs], loss_func, forward_only=False)
        drop_dgrad_weights(self.module)
        out = self._optimizer_step(self.algo.sft_lr)
        out["sft_loss"] = float(sum(losses) / len(losses)) if losses else 0.0
        return out
