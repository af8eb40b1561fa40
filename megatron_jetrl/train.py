"""The RL loop: rollout -> reward -> logprobs -> train -> FP8 re-quantization + hand-over."""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_jetrl.config import ConfigError, JetConfig, save_config
from megatron_jetrl.data.prompts import PromptStream, Sample, load_prompts, synthetic_arithmetic
from megatron_jetrl.data.tokenizer import load_tokenizer
from megatron_jetrl.metrics.logger import MetricsLogger
from megatron_jetrl.models.builder import DTYPES, build_model
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.rewards import get_reward
from megatron_jetrl.rollout.base import SamplingParams
from megatron_jetrl.rollout.local import LocalEngine
from megatron_jetrl.sync.export import ExportOptions, iter_hf_tensors
from megatron_jetrl.sync.transport import InProcessTransport
from megatron_jetrl.trainer import loss as L
from megatron_jetrl.trainer.actor import Actor, RLBatch, build_batch
from megatron_jetrl.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

log = logging.getLogger("jetrl")


@dataclass
class Run:
    cfg: JetConfig
    tokenizer: object
    actor: Actor
    engine: LocalEngine
    stream: PromptStream
    reward_fn: object
    logger: MetricsLogger | None
    sampling: SamplingParams
    start_step: int
    ckpt_dir: str


@contextmanager
def timed(metrics: dict, name: str):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    metrics[f"time_{name}"] = time.perf_counter() - t0


def is_logging_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def setup(cfg: JetConfig) -> Run:
    from megatron_jetrl.distributed import init_distributed
    from megatron_jetrl.models.hf_io import load_hf_weights

    samples = (load_prompts(cfg.data.path, cfg.data.prompt_key, cfg.data.answer_key) if cfg.data.path
               else synthetic_arithmetic(cfg.data.synthetic_size, cfg.seed))  # bad data fails before any process group
    init_distributed(cfg.parallel, cfg.seed)
    tok = load_tokenizer(cfg.model.tokenizer)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"config error: model.vocab_size: {cfg.model.vocab_size} is smaller than the "
                          f"tokenizer's {tok.vocab_size}; raise model.vocab_size")
    recipe = FP8Recipe.from_config(cfg.precision)
    dtype = DTYPES[cfg.precision.params_dtype]
    model, fp8_state = build_model(cfg.model, cfg.parallel, recipe, dtype, cfg.precision.backend)
    if cfg.model.hf_path:
        load_hf_weights(model, cfg.model, cfg.model.hf_path, fp8_state)
    total = cfg.steps + cfg.algo.sft_warmup_steps
    actor = Actor(model, fp8_state, cfg.algo, cfg.parallel, dtype, total, cfg.rollout.temperature or 1.0)
    engine = LocalEngine(model, fp8_state, tok.pad_id, seed=cfg.seed, vocab_size=cfg.model.vocab_size,
                         model_cfg=cfg.model)
    stream = PromptStream(samples, cfg.seed)
    run_dir = cfg.logging.run_dir
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    start, resume_step = 0, None
    if cfg.checkpoint.resume and (path := latest_checkpoint(ckpt_dir)):
        loop = load_checkpoint(path, actor)
        from megatron_jetrl.precision.linear import refresh_fp8_weights

        refresh_fp8_weights(actor.module, fp8_state)
        stream.load_state_dict(loop["stream"])
        start, resume_step = loop["step"] + 1, loop["step"]
        log.info("resumed from %s (next step %d)", path, start)
    if is_logging_rank():
        os.makedirs(ckpt_dir, exist_ok=True)
        save_config(cfg, os.path.join(run_dir, "config.yaml"))
    logger = MetricsLogger(run_dir, cfg.logging.tensorboard, resume_step) if is_logging_rank() else None
    sampling = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p,
                              cfg.rollout.top_k, (tok.eos_id,))
    return Run(cfg, tok, actor, engine, stream, get_reward(cfg.data.reward), logger, sampling, start, ckpt_dir)


def encode_prompt(tok, sample: Sample) -> list[int]:
    ids = tok.encode(sample.prompt)
    return ([tok.bos_id] + ids) if tok.bos_id is not None else ids


def generate_rollouts(run: Run, samples: list[Sample]):
    n = run.cfg.rollout.n_samples_per_prompt
    prompts = [encode_prompt(run.tokenizer, s) for s in samples for _ in range(n)]
    return prompts, run.engine.generate(prompts, run.sampling)


def score(run: Run, samples: list[Sample], gens) -> torch.Tensor:
    n = run.cfg.rollout.n_samples_per_prompt
    return torch.tensor([run.reward_fn(run.tokenizer.decode(g.output_ids), samples[i // n].answer,
                                       samples[i // n].metadata) for i, g in enumerate(gens)])


def hand_over_weights(run: Run, version: int) -> dict:
    """Export the weights as the rollout receives them (FP8 bytes + scales of the trainer's cache
    when the rollout is FP8) and hand them over; the receiver checks the hashes (every
    ``logging.parity_interval`` steps)."""
    every = run.cfg.logging.parity_interval
    if not every or version % every:
        return run.engine.update_weights(version, None)
    opts = ExportOptions(fp8=run.actor.fp8_state.recipe.rollout_fp8)
    return InProcessTransport(run.engine).push(version, iter_hf_tensors(run.actor.module, run.cfg.model, opts))


def _dp() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def my_prompts(run: Run, n: int) -> list[Sample]:
    """This data-parallel rank's ``n`` prompts: every rank draws the same ``n * dp`` from the shared
    stream (so the stream position stays one number) and takes its own slice."""
    rank, dp = _dp()
    return run.stream.next(n * dp)[rank * n:(rank + 1) * n]


def reduce_over_dp(m: dict) -> dict:
    """Step metrics as one number per run: mean over DP ranks (max/min for *_max/*_min)."""
    from megatron.core import parallel_state

    if _dp()[1] == 1:
        return m
    group = parallel_state.get_data_parallel_group()
    keys = sorted(m)
    vals = torch.tensor([float(m[k]) for k in keys], dtype=torch.float64)
    out = {}
    for op, pick in ((dist.ReduceOp.SUM, lambda k: not k.endswith(("_max", "_min"))),
                     (dist.ReduceOp.MAX, lambda k: k.endswith("_max")),
                     (dist.ReduceOp.MIN, lambda k: k.endswith("_min"))):
        t = vals.clone()
        dist.all_reduce(t, op=op, group=group)
        out.update({k: float(t[i]) / (_dp()[1] if op == dist.ReduceOp.SUM else 1) for i, k in enumerate(keys) if pick(k)})
    return out


def rl_step(run: Run, step: int) -> dict:
    m: dict = {}
    rank, dp = _dp()
    run.engine.generator.manual_seed(run.cfg.seed + step * dp + rank)  # per step and DP rank: a resumed run samples the same
    samples = my_prompts(run, run.cfg.rollout.prompts_per_step)
    with timed(m, "rollout"):
        prompts, gens = generate_rollouts(run, samples)
    rewards = score(run, samples, gens)
    adv = L.grpo_advantages(rewards, run.cfg.rollout.n_samples_per_prompt)
    batch = build_batch(prompts, [g.output_ids for g in gens], [g.output_logprobs for g in gens], adv,
                        run.tokenizer.pad_id, next(run.actor.module.parameters()).device)
    with timed(m, "logprob"):
        batch.old_logp = run.actor.compute_logprobs(batch)
    with timed(m, "train"):
        m.update(run.actor.train_step(batch))
    with timed(m, "weight_sync"):
        m.update(hand_over_weights(run, step + 1))
    lengths = torch.tensor([len(g.output_ids) for g in gens], dtype=torch.float)
    m.update(reward_mean=rewards.mean(), reward_std=rewards.std(), response_length_mean=lengths.mean(),
             response_length_max=lengths.max(), tokens_per_s=lengths.sum() / m["time_rollout"], is_rl=1.0)
    m.update({k: float(v) for k, v in L.mismatch_metrics(batch.old_logp, batch.rollout_logp, batch.mask).items()})
    return reduce_over_dp(m)


def sft_step(run: Run) -> dict:
    tok = run.tokenizer
    samples = my_prompts(run, run.cfg.rollout.prompts_per_step * run.cfg.rollout.n_samples_per_prompt)
    prompts = [encode_prompt(tok, s) for s in samples]
    answers = [tok.encode(s.answer) + [tok.eos_id] for s in samples]
    batch = build_batch(prompts, answers, [[0.0] * len(a) for a in answers], torch.zeros(len(samples)),
                        tok.pad_id, next(run.actor.module.parameters()).device)
    m = {}
    with timed(m, "train"):
        m.update(run.actor.sft_step(batch))
    m.update(run.engine.update_weights(run.actor.steps, None), is_rl=0.0)
    return reduce_over_dp(m)


def train(cfg: JetConfig) -> Run:
    """Run ``cfg.algo.sft_warmup_steps`` supervised steps then ``cfg.steps`` RL steps."""
    from tqdm import tqdm

    run = setup(cfg)
    total = cfg.algo.sft_warmup_steps + cfg.steps
    bar = tqdm(range(run.start_step, total), initial=run.start_step, total=total, desc="jetrl",
               disable=not is_logging_rank())
    for step in bar:
        metrics = sft_step(run) if step < cfg.algo.sft_warmup_steps else rl_step(run, step)
        if run.logger:
            run.logger.log(step, metrics)
        bar.set_postfix({k: f"{metrics[k]:.3g}" for k in ("reward_mean", "sft_loss", "mismatch_abs_mean")
                         if k in metrics})
        last = step == total - 1
        if last or (cfg.checkpoint.save_interval and (step + 1) % cfg.checkpoint.save_interval == 0):
            save_checkpoint(run.ckpt_dir, step, run.actor, {"stream": run.stream.state_dict()}, cfg.model)
    if run.logger:
        run.logger.close()
    return run
