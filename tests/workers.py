"""Functions run inside spawned gloo processes (see tests/dist.py)."""
from __future__ import annotations

import torch


def build_loaded(hf_dir: str, overrides: list[str], backend: str = "emulated"):
    """init megatron for the layout in ``overrides`` and load the HF checkpoint (fp32)."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.distributed import init_distributed
    from megatron_jetrl.models.builder import build_model
    from megatron_jetrl.models.hf_io import load_hf_weights
    from megatron_jetrl.precision.recipe import FP8Recipe

    cfg = load_config(None, [f"model.hf_path={hf_dir}", "precision.params_dtype=fp32", *overrides])
    init_distributed(cfg.parallel)
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision),
                               torch.float32, backend=backend)
    load_hf_weights(model, cfg.model, hf_dir, state)
    return cfg, model, state


def random_prompts(B: int, g: torch.Generator, vocab: int = 384) -> list[list[int]]:
    """``B`` prompts of 3-19 token ids in ``[3, vocab)``: lengths drawn first, then each prompt, from ``g``."""
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (B,), generator=g)]


def perturb_weights(model, state, g: torch.Generator) -> None:
    """An optimizer step's worth of change to every parameter (2% of its spread), the FP8 caches invalidated."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p) * 0.02 * p.float().std().clamp_min(1e-3))
    state.bump()


def rollout_train_gap(engine, model, prompts, params, micro_batch: int, exact: bool, pad_to_exact: bool = False
                      ) -> float:
    """Max over the sampled tokens of ``|logp_train - logp_rollout|``: ``engine`` generates for ``prompts``, the
    trainer's forward recomputes the tokens' logprobs in micro-batches of ``micro_batch`` (``exact``: exact mode's
    logprob; ``pad_to_exact``: padded to ``models.builder.exact_length``, the CPU emulation's length)."""
    from megatron_jetrl.models.builder import exact_length
    from megatron_jetrl.trainer.actor import build_batch, train_logprobs

    gens = engine.generate(prompts, params)
    batch = build_batch(prompts, [x.output_ids for x in gens], [x.output_logprobs for x in gens],
                        torch.zeros(len(prompts)), 0, engine.device)
    seq_len = exact_length(model, batch.tokens.shape[1] - 1) if pad_to_exact else None
    lp = train_logprobs(model, batch, params.temperature, micro_batch, seq_len, exact)
    return ((lp - batch.rollout_logp).abs() * batch.mask).max().item()


def gaps_before_and_after_update(engine, model, state, params, sizes, g: torch.Generator, exact: bool,
                                 pad_to_exact: bool = False) -> list[float]:
    """:func:`rollout_train_gap` (micro-batches of 24) for a batch of :func:`random_prompts` of each size in
    ``sizes``, then after :func:`perturb_weights` for a batch of 64: the gaps in that order."""
    diffs = [rollout_train_gap(engine, model, random_prompts(B, g), params, 24, exact, pad_to_exact) for B in sizes]
    perturb_weights(model, state, g)
    return diffs + [rollout_train_gap(engine, model, random_prompts(64, g), params, 24, exact, pad_to_exact)]


def mean_nll(model, tokens: torch.Tensor, forward_only: bool = True):
    """Mean next-token NLL through the pipeline schedule; None on non-last stages."""
    from megatron.core import parallel_state

    from megatron_jetrl.trainer.pipeline import run_microbatches

    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    mb = {"tokens": inputs, "labels": labels,
          "position_ids": torch.arange(inputs.shape[1]).expand_as(inputs)}

    def loss_func(mb, nll):
        loss = nll.float().mean()
        return loss, {"loss": loss.detach()}

    out = run_microbatches(model, [mb], loss_func, forward_only)
    if parallel_state.is_pipeline_last_stage():
        return float(out[0]["loss"])
    return None


def layouts_worker(rank, world, layouts, tokens):
    """For each ``name: (hf_dir, overrides)``: the mean NLL, and (PP=1) the full logits
    gathered over TP."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from megatron_jetrl.distributed import destroy_distributed

    results = {}
    for name, (hf_dir, overrides) in layouts.items():
        cfg, model, _ = build_loaded(hf_dir, overrides)
        model.eval()
        with torch.no_grad():
            loss = mean_nll(model, tokens)
            logits = None
            if cfg.parallel.pipeline_parallel == 1:
                pos = torch.arange(tokens.shape[1]).expand_as(tokens)
                logits = gather_from_tensor_model_parallel_region(model(tokens, pos, None))
        results[name] = {"loss": loss, "logits": logits}
        dist.barrier()
    destroy_distributed()
    return results


def export_worker(rank, world, layouts):
    """For each ``name: (hf_dir, overrides)``: the gathered HF state dict (global rank 0), in the
    parameter dtype and in FP8 (jet)."""
    import torch.distributed as dist

    from megatron_jetrl.distributed import destroy_distributed
    from megatron_jetrl.sync.export import ExportOptions, collect_hf_state_dict

    results = {}
    for name, (hf_dir, overrides) in layouts.items():
        cfg, model, _ = build_loaded(hf_dir, ["precision.mode=jet", *overrides])
        plain = collect_hf_state_dict(model, cfg.model, ExportOptions(fp8=False, dtype=None))
        fp8 = collect_hf_state_dict(model, cfg.model, ExportOptions(fp8=True))
        results[name] = (plain, fp8)
        dist.barrier()
    destroy_distributed()
    return results if rank == 0 else None


def broadcast_worker(rank, world, hf_dir):
    """Both ranks build the model (DP=2, which creates the groups collectively); rank 0 exports in
    FP8 and broadcasts over a dedicated group; rank 1 plays the rollout side and receives."""
    import torch.distributed as dist

    from megatron_jetrl.sync.export import ExportOptions, iter_hf_tensors
    from megatron_jetrl.sync.transport import BroadcastTransport

    cfg, model, _ = build_loaded(hf_dir, ["precision.mode=jet"])
    group = dist.new_group([0, 1])
    transport = BroadcastTransport(group, src=0, device=torch.device("cpu"), bucket_bytes=300_000)
    if rank == 0:
        sent = {k: v.clone() for k, v in iter_hf_tensors(model, cfg.model, ExportOptions(fp8=True))}
        stats = transport.push(7, iter(sent.items()))
        return {"sent": sent, "stats": stats}
    version, tensors, parity = transport.receive()
    return {"version": version, "tensors": tensors, "parity": parity}


def convert_worker(rank, world, jobs):
    """For each (direction, src, out, layout overrides[, dtype]): the conversion, all ranks together."""
    import torch.distributed as dist

    from checkpoint_converters.convert import hf_to_megatron, megatron_to_hf
    from megatron_jetrl.distributed import destroy_distributed

    for direction, src, out, overrides, *dtype in jobs:
        if direction == "hf-to-megatron":
            hf_to_megatron(src, out, overrides)
        else:
            megatron_to_hf(src, out, dtype[0], shard_bytes=300_000, parallel_overrides=overrides)
        dist.barrier()
    destroy_distributed()
    return True


def dp_train_worker(rank, world, run_dir):
    """The RL loop at DP=2 with the distributed optimizer: returns a checksum of the parameters
    and of this rank's first rollout prompts."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.train import train

    cfg = load_config("examples/configs/tiny.yaml", [
        f"logging.run_dir={run_dir}", "steps=3", "algo.sft_warmup_steps=1", "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=4", "parallel.distributed_optimizer=true", "logging.tensorboard=false"])
    run = train(cfg)
    params = torch.cat([p.detach().float().reshape(-1) for p in run.actor.module.parameters()])
    return {"param_sum": float(params.double().sum()), "param_abs": float(params.double().abs().sum()),
            "dist_opt": [type(o).__name__ for o in getattr(run.actor.optimizer, "chained_optimizers", [run.actor.optimizer])],
            "stream": run.stream.state_dict()}


def decode_worker(rank, world, jobs, prompts, max_new):
    """For each ``name: (hf_dir, overrides)``: greedy generations of ``prompts`` with the static
    decoder and with megatron-core's decode."""
    import torch.distributed as dist

    from megatron_jetrl.distributed import destroy_distributed
    from megatron_jetrl.rollout.base import SamplingParams
    from megatron_jetrl.rollout.local import LocalEngine

    out = {}
    for name, (hf_dir, overrides) in jobs.items():
        cfg, model, state = build_loaded(hf_dir, overrides)
        for decode in ("static", "megatron"):
            engine = LocalEngine(model, state, pad_id=0, vocab_size=cfg.model.vocab_size, decode=decode, bucket=8)
            gens = engine.generate(prompts, SamplingParams(max_new_tokens=max_new, temperature=0.0))
            out[(name, decode)] = [(g.output_ids, g.output_logprobs) for g in gens]
        dist.barrier()
    destroy_distributed()
    return out


def fused_logp_tp_worker(rank, world, logits, labels, temperature):
    """TP=world: the fused logprob/entropy on this rank's vocabulary slice (CPU statistics, ranks
    combined over gloo); returns (logp, entropy, this slice's gradient of sum(logp) + sum(entropy))."""
    from megatron_jetrl.config import ParallelConfig
    from megatron_jetrl.distributed import destroy_distributed, init_distributed
    from megatron_jetrl.kernels.fused_logp import fused_logp_entropy

    init_distributed(ParallelConfig(tensor_parallel=world))
    v = logits.shape[-1] // world
    x = logits[..., rank * v:(rank + 1) * v].clone().requires_grad_(True)
    logp, ent = fused_logp_entropy(x, labels, temperature)
    (logp.sum() + 0.3 * ent.sum()).backward()
    destroy_distributed()
    return logp.detach(), ent.detach(), x.grad


def newest_intact_worker(rank, world, ckpt_root):
    """``newest_intact_checkpoint`` as a resumed job's ranks run it: each checks its share of the CRC-32s and all
    take the first problem any rank found."""
    import torch.distributed as dist

    from megatron_jetrl.distributed import first_of_ranks, rank_share
    from megatron_jetrl.trainer.checkpoint import newest_intact_checkpoint

    dist.init_process_group("gloo")
    try:
        return newest_intact_checkpoint(ckpt_root, share=rank_share(), agree=first_of_ranks)
    finally:
        dist.destroy_process_group()
