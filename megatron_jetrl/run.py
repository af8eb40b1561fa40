"""A run: everything ``setup`` builds from a config (model, FP8 state, actor, engine, scheduler, data, logger),
and ``close``, which stops what it started. The loop over it is ``train.py``."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_jetrl.config import ConfigError, JetConfig, save_config
from megatron_jetrl.data.dataset import check_prompts, stop_token_ids, train_samples, val_samples
from megatron_jetrl.data.prompts import PromptStream
from megatron_jetrl.data.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer
from megatron_jetrl.distributed import dp_rank_size, first_of_ranks, is_logging_rank, is_rank0, rank_share
from megatron_jetrl.errors import RunComplete
from megatron_jetrl.files import write_atomic
from megatron_jetrl.metrics.logger import MetricsLogger
from megatron_jetrl.models.builder import DTYPES, apply_precision_settings, build_model
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.rewards import get_reward
from megatron_jetrl.rewards.registry import RewardFn
from megatron_jetrl.rollout.base import RolloutEngine, SamplingParams
from megatron_jetrl.rollout.local import LocalEngine
from megatron_jetrl.scheduler import Scheduler, make_scheduler
from megatron_jetrl.sync.export import iter_hf_tensors
from megatron_jetrl.sync.handover import disk_push, export_options
from megatron_jetrl.trainer.actor import Actor
from megatron_jetrl.trainer.checkpoint import (check_model_matches, checkpoint_step, load_checkpoint,
                                               newest_intact_checkpoint)
from megatron_jetrl.trainer.run_dir import (CHECKPOINTS_DIR, LAUNCH_MARK, STOP_FILE, check_run_dir, clear_run, clear_stop_request,
                                            no_checkpoint)

log = logging.getLogger("jetrl")


@dataclass
class Run:
    cfg: JetConfig
    tokenizer: CharTokenizer | HFTokenizer
    actor: Actor
    engine: RolloutEngine
    stream: PromptStream
    reward_fn: RewardFn
    logger: MetricsLogger | None
    sampling: SamplingParams
    start_step: int
    ckpt_dir: str
    scheduler: Scheduler | None = None  # made by setup, after the run (it holds the run)
    val: list = field(default_factory=list)  # held-out samples (eval), this DP rank's share
    gc_frozen: int = 0  # Python objects frozen at setup (``gc_freeze``); unfrozen by close()


def setup(cfg: JetConfig) -> Run:
    from megatron_jetrl.distributed import init_distributed
    from megatron_jetrl.models.hf_io import load_hf_weights

    samples = train_samples(cfg)  # bad data fails before any process group
    reward_fn = get_reward(cfg.data.reward)
    val = val_samples(cfg) if cfg.eval.interval else []
    resume_path = check_run_dir(cfg)
    if cfg.checkpoint.load_path and not resume_path:
        check_model_matches(cfg.checkpoint.load_path, cfg.model)
    init_distributed(cfg.parallel, cfg.seed)
    run_dir = cfg.logging.run_dir
    ckpt_dir = os.path.join(run_dir, CHECKPOINTS_DIR)
    if is_rank0() and clear_stop_request(run_dir):  # a request made from here on is this run's
        log.warning("removed %s from %s: a request from before this run", STOP_FILE, run_dir)
    if resume_path:  # the CRC-32s, read by every rank, a share each; all take the same checkpoint
        resume_path = newest_intact_checkpoint(ckpt_dir, share=rank_share(), agree=first_of_ranks)
        if resume_path is None:
            raise no_checkpoint(ckpt_dir)
    loop_steps = cfg.algo.sft_warmup_steps + cfg.steps
    if resume_path and checkpoint_step(resume_path) + 1 >= loop_steps:
        raise RunComplete(f"jetrl train: the run in {run_dir} is complete: {resume_path} holds its last "
                          f"step ({loop_steps} steps: algo.sft_warmup_steps + steps); raise steps to train further")
    tok = load_tokenizer(cfg.model.tokenizer, cfg.data.apply_chat_template, cfg.data.system_prompt)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"config error: model.vocab_size: {cfg.model.vocab_size} is smaller than the "
                          f"tokenizer's {tok.vocab_size}; raise model.vocab_size")
    check_prompts(cfg, tok, samples + val)
    recipe = FP8Recipe.from_config(cfg.precision)
    dtype = DTYPES[cfg.precision.params_dtype]
    model, fp8_state = build_model(cfg.model, cfg.parallel, recipe, dtype, cfg.precision.backend)
    apply_precision_settings(fp8_state, cfg.precision)
    if cfg.model.hf_path and not cfg.checkpoint.load_path:
        load_hf_weights(model, cfg.model, cfg.model.hf_path, fp8_state)
    total = cfg.steps * cfg.algo.mini_batches + cfg.algo.sft_warmup_steps  # optimizer steps (the LR schedule's length)
    actor = Actor(model, fp8_state, cfg.algo, cfg.parallel, dtype, total, cfg.rollout.temperature or 1.0)
    engine = LocalEngine.from_config(model, fp8_state, cfg, tok.pad_id) if cfg.rollout.engine == "local" else None
    stream = PromptStream(samples, cfg.seed)
    start, resume_step = 0, None
    if resume_path:
        path = resume_path
        loop = load_checkpoint(path, actor)
        from megatron_jetrl.precision.linear import refresh_fp8_weights

        refresh_fp8_weights(actor.module, fp8_state)
        stream.load_state_dict(loop["stream"])
        start, resume_step = loop["step"] + 1, loop["step"]
        log.info("resumed from %s (next step %d)", path, start)
    elif cfg.checkpoint.load_path:
        from megatron_jetrl.precision.linear import refresh_fp8_weights
        from megatron_jetrl.trainer.checkpoint import load_model_weights

        load_model_weights(cfg.checkpoint.load_path, actor)
        refresh_fp8_weights(actor.module, fp8_state)
        log.info("model weights from %s", cfg.checkpoint.load_path)
    if cfg.checkpoint.overwrite and is_rank0():  # the user asked: the previous run's files go
        clear_run(run_dir)
    if dist.is_initialized():
        dist.barrier()
    if is_logging_rank():
        os.makedirs(ckpt_dir, exist_ok=True)
        save_config(cfg, os.path.join(run_dir, "config.yaml"))
    logger = MetricsLogger(run_dir, cfg.logging.tensorboard, resume_step) if is_logging_rank() else None
    sampling = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p,
                              cfg.rollout.top_k, stop_token_ids(cfg, tok))
    run = Run(cfg, tok, actor, engine, stream, reward_fn, logger, sampling, start, ckpt_dir)
    if cfg.eval.interval:
        rank, dp = dp_rank_size()
        run.val = val[rank::dp]
    run.scheduler = make_scheduler(run)
    if engine is None:  # last: a fleet starts from the trainer's current weights, written to the run dir
        model_dir, _ = disk_push(run, start, iter_hf_tensors(actor.module, cfg.model, export_options(cfg, recipe)))
        if cfg.rollout.launch_id and is_rank0():  # complete on every rank's share: this launch's servers may load them
            write_atomic(os.path.join(run_dir, LAUNCH_MARK), cfg.rollout.launch_id + "\n")
        from megatron_jetrl.rollout.sglang import start_fleet

        run.engine = start_fleet(cfg, recipe, model_dir)
    if cfg.gc_freeze:
        from megatron_jetrl.memory import freeze_python_gc

        run.gc_frozen = freeze_python_gc()
    return run


def close(run: Run) -> None:
    """Stop the scheduler's background work and the fleet's servers; close the logger."""
    if run.scheduler is not None:
        run.scheduler.close()
    if run.engine is not None:
        run.engine.shutdown()
    if run.logger:
        run.logger.close()
    if run.gc_frozen:  # the run's objects become collectable again (a caller may build another model next)
        from megatron_jetrl.memory import unfreeze_python_gc

        unfreeze_python_gc()
        run.gc_frozen = 0
