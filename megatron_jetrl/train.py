"""The RL loop: rollout -> reward -> logprobs -> train -> FP8 re-quantization + hand-over.

``rl_step`` is one GRPO step, ``sft_step`` one supervised warm-up step, ``evaluate`` the held-out metrics,
``train`` the loop with evaluation and checkpoints, over a run that ``run.setup`` builds from a config. How rollout
and training share the GPUs is the scheduler's (``scheduler/``), how weights reach the rollout the hand-over's
(``sync/handover.py``).
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from megatron_jetrl.config import JetConfig
from megatron_jetrl.data.prompts import Sample
from megatron_jetrl.distributed import dp_rank_size, is_logging_rank, is_rank0, rank0_decides, reduce_over_dp
from megatron_jetrl.errors import TrainingError
from megatron_jetrl.run import Run, close, setup
from megatron_jetrl.trainer import loss as L
from megatron_jetrl.trainer.actor import build_batch
from megatron_jetrl.trainer.checkpoint import latest_checkpoint, save_checkpoint
from megatron_jetrl.trainer.run_dir import STOP_FILE, clear_stop_request, stop_requested

__all__ = ["Run", "close", "evaluate", "rl_step", "setup", "sft_step", "train"]

log = logging.getLogger("jetrl")


@contextmanager
def timed(metrics: dict, name: str):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    metrics[f"time_{name}"] = time.perf_counter() - t0


def score(run: Run, samples: list[Sample], gens, n: int | None = None) -> torch.Tensor:
    """Rewards of ``gens``, ``n`` (default ``rollout.n_samples_per_prompt``) consecutive ones per sample."""
    n = n or run.cfg.rollout.n_samples_per_prompt
    return torch.tensor([run.reward_fn(run.tokenizer.decode(g.output_ids), samples[i // n].answer,
                                       samples[i // n].metadata) for i, g in enumerate(gens)])


def evaluate(run: Run, step: int) -> dict:
    """Held-out metrics of the current policy, run as a rollout runs (engine, precision, scheduler):
    ``eval/accuracy`` (mean reward of one greedy response per prompt), ``eval/pass@k`` (share of prompts with
    a reward-1 response among k samples at the rollout temperature), ``eval/response_length_mean``. Each DP
    rank takes its share of the prompts; the means are averaged over ranks."""
    from dataclasses import replace

    cfg, m = run.cfg.eval, {}
    if not run.val:
        return m
    prompts = [run.tokenizer.encode_prompt(s.prompt) for s in run.val]
    if cfg.greedy:
        gens = run.scheduler.evaluate(step, prompts, replace(run.sampling, temperature=0.0))
        m["eval/accuracy"] = float(score(run, run.val, gens, 1).mean())
        m["eval/response_length_mean"] = sum(len(g.output_ids) for g in gens) / len(gens)
    if cfg.n_samples >= 2:
        k = cfg.n_samples
        gens = run.scheduler.evaluate(step, [p for p in prompts for _ in range(k)], run.sampling)
        r = score(run, run.val, gens, k).view(len(prompts), k)
        m[f"eval/pass@{k}"] = float((r >= 1).any(1).float().mean())
        m["eval/sample_accuracy"] = float(r.mean())
    return m


def _shaped_rewards(run: Run, samples, gens) -> torch.Tensor:
    """The reward function's score plus DAPO's overlong penalty (``algo.overlong_buffer``)."""
    a = run.cfg.algo
    lengths = torch.tensor([len(g.output_ids) for g in gens])
    return score(run, samples, gens) + L.overlong_penalty(lengths, run.cfg.rollout.max_new_tokens, a.overlong_buffer,
                                                          a.overlong_penalty)


def _rollout(run: Run, step: int, m: dict):
    """The step's groups: one rollout, or with ``algo.dynamic_sampling`` as many as it takes (up to
    ``algo.max_sampling_rounds``) to fill ``rollout.prompts_per_step`` groups whose rewards differ."""
    n, want = run.cfg.rollout.n_samples_per_prompt, run.cfg.rollout.prompts_per_step
    samples, prompts, gens, sched = run.scheduler.rollout(step)
    m.update(sched)
    rewards = _shaped_rewards(run, samples, gens)
    if not run.cfg.algo.dynamic_sampling:
        return samples, prompts, gens, rewards
    kept: list = []  # (sample, its n prompts, generations, rewards) of the informative groups
    rounds, dropped = 1, 0
    while True:
        ok = L.informative_groups(rewards, n).tolist()
        dropped += ok.count(False)
        group = [(samples[i], prompts[i * n:(i + 1) * n], gens[i * n:(i + 1) * n], rewards[i * n:(i + 1) * n])
                 for i in range(len(samples))]
        kept += [g for g, good in zip(group, ok) if good]
        if len(kept) >= want or rounds == run.cfg.algo.max_sampling_rounds:
            kept += [g for g, good in zip(group, ok) if not good][:max(0, want - len(kept))]  # fill, if short
            break
        samples, prompts, gens, sched = run.scheduler.rollout(step)
        rewards = _shaped_rewards(run, samples, gens)
        rounds += 1
    kept = kept[:want]
    m.update(filtered_groups=float(dropped), sampling_rounds=float(rounds))
    return ([g[0] for g in kept], [p for g in kept for p in g[1]], [x for g in kept for x in g[2]],
            torch.cat([g[3] for g in kept]))


def rl_step(run: Run, step: int) -> dict:
    m: dict = {}
    a = run.cfg.algo
    with timed(m, "rollout"):
        samples, prompts, gens, rewards = _rollout(run, step, m)
    adv = L.grpo_advantages(rewards, run.cfg.rollout.n_samples_per_prompt, normalize_std=a.advantage == "grpo")
    batch = build_batch(prompts, [g.output_ids for g in gens], [g.output_logprobs for g in gens], adv,
                        run.tokenizer.pad_id, next(run.actor.module.parameters()).device)
    with timed(m, "logprob"):  # (algo.recompute_logprobs=false, one mini-batch: the training forward fills them in)
        if a.recompute_logprobs or a.mini_batches > 1:
            batch.old_logp = run.actor.compute_logprobs(batch)
    with timed(m, "train"):
        parts = [batch] if a.mini_batches == 1 else batch.split(-(-batch.tokens.shape[0] // a.mini_batches))
        steps = [run.actor.train_step(part) for part in parts]  # the old logprobs stay those before the first
        m.update({k: sum(s[k] for s in steps) / len(steps) for k in steps[0]})  # means over the parts,
        m.update({k: steps[-1][k] for k in ("lr", "skipped_steps") if k in steps[-1]})  # but where the step ends
        m["optimizer_steps"] = float(len(steps))
    with timed(m, "weight_sync"):
        m.update(run.scheduler.hand_over(step + 1))
    lengths = torch.tensor([len(g.output_ids) for g in gens], dtype=torch.float)
    m.update(reward_mean=rewards.mean(), reward_std=rewards.std(), response_length_mean=lengths.mean(),
             response_length_max=lengths.max(), tokens_per_s=lengths.sum() / m["time_rollout"], is_rl=1.0,
             truncated_fraction=sum(g.finish_reason == "length" for g in gens) / max(1, len(gens)))
    if batch.old_logp is not None:  # None on a non-last pipeline stage (whose metrics are not logged)
        m.update({k: float(v) for k, v in L.mismatch_metrics(batch.old_logp, batch.rollout_logp, batch.mask).items()})
    return reduce_over_dp(m)


def sft_step(run: Run) -> dict:
    tok = run.tokenizer
    samples = run.stream.next_share(run.cfg.rollout.prompts_per_step * run.cfg.rollout.n_samples_per_prompt,
                                    *dp_rank_size())
    prompts = [tok.encode_prompt(s.prompt) for s in samples]
    answers = [tok.encode(s.answer) + [tok.eos_id] for s in samples]
    batch = build_batch(prompts, answers, [[0.0] * len(a) for a in answers], torch.zeros(len(samples)),
                        tok.pad_id, next(run.actor.module.parameters()).device)
    m = {}
    with timed(m, "train"):
        m.update(run.actor.sft_step(batch))
    if not run.engine.remote:
        m.update(run.engine.update_weights(run.actor.steps, None))
    elif run.actor.steps == run.cfg.algo.sft_warmup_steps:  # a fleet gets the weights once, before RL
        m.update(run.scheduler.hand_over(run.actor.steps))
    m["is_rl"] = 0.0
    return reduce_over_dp(m)


def train(cfg: JetConfig) -> Run:
    """Run ``cfg.algo.sft_warmup_steps`` supervised steps then ``cfg.steps`` RL steps."""
    run = setup(cfg)
    try:
        _loop(run)
    finally:
        close(run)
    return run


def _loop(run: Run) -> None:
    from tqdm import tqdm

    cfg = run.cfg
    total = cfg.algo.sft_warmup_steps + cfg.steps
    bar = tqdm(range(run.start_step, total), initial=run.start_step, total=total, desc="jetrl",
               disable=not is_logging_rank())
    for step in bar:
        rl = step - cfg.algo.sft_warmup_steps
        due = cfg.eval.interval and rl >= 0 and rl % cfg.eval.interval == 0  # before the first RL step, then every N
        held_out = evaluate(run, rl) if due else {}
        metrics = sft_step(run) if rl < 0 else rl_step(run, step)
        if held_out:
            metrics.update(reduce_over_dp(held_out))
        if run.logger:
            run.logger.log(step, metrics)
        if run.actor.skipped_in_a_row >= cfg.algo.max_skipped_steps:
            raise TrainingError(f"step {step}: {run.actor.skipped_in_a_row} updates in a row skipped for non-finite "
                                f"loss or gradients (algo.max_skipped_steps); lower algo.lr, the newest checkpoint "
                                f"stays {latest_checkpoint(run.ckpt_dir) or 'none'}")
        bar.set_postfix({k: f"{metrics[k]:.3g}" for k in ("reward_mean", "sft_loss", "mismatch_abs_mean")
                         if k in metrics})
        last = step == total - 1
        stop = rank0_decides(is_rank0() and stop_requested(cfg.logging.run_dir))  # after the last step: the end
        due = last or stop or (cfg.checkpoint.save_interval and (step + 1) % cfg.checkpoint.save_interval == 0)
        if due and run.actor.skipped_in_a_row == 0:  # after a skipped update the newest checkpoint already holds it
            run.actor.reload()  # a colocated hand-over leaves the optimizer state on the host
            save_checkpoint(run.ckpt_dir, step, run.actor, {"stream": run.scheduler.stream_state()}, cfg.model,
                            cfg.checkpoint.keep_last)
        if stop and is_rank0():
            clear_stop_request(cfg.logging.run_dir)
        if stop and not last:
            if is_rank0():
                log.info("step %d: stopped on %s; newest checkpoint %s; continue with --resume", step,
                         STOP_FILE, latest_checkpoint(run.ckpt_dir) or "none")
            return
    if cfg.eval.interval and cfg.steps:  # the trained policy: a row of its own, one step past the last
        held_out = reduce_over_dp(evaluate(run, cfg.steps))
        if run.logger and held_out:
            run.logger.log(total, held_out)


