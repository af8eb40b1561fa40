"""The RL loop: rollout -> reward -> logprobs -> train -> FP8 re-quantization + hand-over."""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_jetrl.config import ConfigError, JetConfig, save_config
from megatron_jetrl.data.prompts import PromptStream, Sample, load_prompts, synthetic_arithmetic
from megatron_jetrl.data.tokenizer import load_tokenizer
from megatron_jetrl.distributed import is_rank0
from megatron_jetrl.metrics.logger import MetricsLogger
from megatron_jetrl.models.builder import DTYPES, build_model
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.rewards import get_reward
from megatron_jetrl.rollout.base import SamplingParams
from megatron_jetrl.rollout.local import LocalEngine
from megatron_jetrl.sync.export import ExportOptions, hf_bf16_linears, iter_hf_tensors
from megatron_jetrl.sync.transport import InProcessTransport
from megatron_jetrl.trainer import loss as L
from megatron_jetrl.trainer.actor import Actor, RLBatch, build_batch
from megatron_jetrl.errors import TrainingError
from megatron_jetrl.trainer.checkpoint import checkpoints, load_checkpoint, newest_intact_checkpoint, save_checkpoint

log = logging.getLogger("jetrl")


@dataclass
class Run:
    cfg: JetConfig
    tokenizer: object
    actor: Actor
    engine: object  # LocalEngine or rollout.sglang.RolloutFleet
    stream: PromptStream
    reward_fn: object
    logger: MetricsLogger | None
    sampling: SamplingParams
    start_step: int
    ckpt_dir: str
    scheduler: object = None
    val: list = field(default_factory=list)  # held-out samples (eval), this DP rank's share
    gc_frozen: int = 0  # Python objects frozen at setup (``gc_freeze``); unfrozen by close()


def export_options(cfg: JetConfig, recipe: FP8Recipe) -> ExportOptions:
    """What the rollout receives: FP8 bytes + scales when it runs FP8; the other tensors in BF16
    (SGLang) or the trainer's parameter dtype (in process, ``jetrl serve``)."""
    dtype = torch.bfloat16 if cfg.rollout.engine == "sglang" else DTYPES[cfg.precision.params_dtype]
    return ExportOptions(fp8=recipe.rollout_fp8, dtype=dtype)


def disk_push(run: "Run", version: int, items, record_hashes: bool = True) -> tuple[str, dict]:
    """Write the rollout's weights as an HF directory in the run dir (every rank its share), with
    weight_hashes.json (what the receiver verifies) when ``record_hashes``: parity-check steps only,
    hashing every tensor is not free on large models (``logging.parity_interval``)."""
    from megatron_jetrl.sync.transport import DiskTransport

    recipe = run.actor.fp8_state.recipe
    path = os.path.abspath(os.path.join(run.cfg.logging.run_dir, "rollout", "weights"))
    qc = (recipe.hf_quantization_config(hf_bf16_linears(run.actor.module, run.cfg.model, run.actor.fp8_state))
          if recipe.rollout_fp8 else None)
    m = DiskTransport(path, run.cfg.model.to_hf_config(), quantization_config=qc, collective=True,
                      bucket_bytes=run.cfg.rollout.bucket_mb << 20, record_hashes=record_hashes).push(version, items)
    return path, m


def start_fleet(cfg: JetConfig, recipe: FP8Recipe, model_dir: str):
    """Rank 0 launches (or attaches to) the servers; every other rank attaches to the same URLs."""
    from megatron_jetrl.rollout.sglang import RolloutFleet

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
        for srv in fleet.servers:
            srv.up = True
    return fleet


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


# What a run directory holds of a run (deleted by checkpoint.overwrite before a fresh run writes).
RUN_FILES = ("checkpoints", "metrics.jsonl", "tb", "rollout", "rollout_logs", "config.yaml")
# The settings a resumed run must share with the run it continues.
SAME_RUN_KEYS = ("model", "seed", "precision.mode", "precision.scale_fmt", "data.path", "data.reward")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_run_dir(cfg: JetConfig) -> str | None:
    """Before anything is written: the checkpoint to resume from (None for a fresh run). ``--resume`` needs an
    intact checkpoint of a run with the same model, seed and precision; a fresh run needs a run directory
    without another run's checkpoints or metrics (or ``checkpoint.overwrite``). One-line ``ConfigError``s."""
    import yaml

    from megatron_jetrl.config import config_to_dict

    run_dir = cfg.logging.run_dir
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if cfg.checkpoint.resume:  # every file read once, by rank 0 (the others check sizes, then take its choice)
        path = newest_intact_checkpoint(ckpt_dir, crc=os.environ.get("RANK", "0") == "0")
        if path is None:
            raise ConfigError(f"config error: checkpoint.resume: no intact checkpoint in {ckpt_dir}; start without "
                              "--resume, or give the run directory that holds the run")
        saved = os.path.join(run_dir, "config.yaml")
        if os.path.isfile(saved):
            with open(saved) as f:
                old = _flat(yaml.safe_load(f) or {})
            new = _flat(config_to_dict(cfg))
            diff = [k for k in sorted(new) if k.startswith(SAME_RUN_KEYS) and k in old and old[k] != new[k]]
            if diff:
                raise ConfigError(f"config error: {diff[0]}: the run in {run_dir} has {old[diff[0]]!r}, this config "
                                  f"{new[diff[0]]!r}{f' (and {len(diff) - 1} more)' if len(diff) > 1 else ''}; "
                                  "resume with the run's own settings (its config.yaml)")
        return path
    held = [os.path.basename(p) for p in checkpoints(ckpt_dir)]
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics):
        held.append("metrics.jsonl")
    if held and not cfg.checkpoint.overwrite:
        raise ConfigError(f"config error: logging.run_dir: {run_dir} holds another run ({', '.join(held[:3])}"
                          f"{', ...' if len(held) > 3 else ''}); resume it with --resume, use another --run-dir, "
                          "or pass --overwrite to delete it")
    return None


def stop_token_ids(cfg: JetConfig, tok) -> tuple[int, ...]:
    """What ends a response: the tokenizer's eos, every eos id of the checkpoint's generation_config.json and
    config.json (instruct models end turns with several), and ``rollout.stop_token_ids``."""
    ids = [tok.eos_id] if tok.eos_id is not None else []
    for source in (cfg.model.generation_config or {}, cfg.model.special_tokens):
        eos = source.get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    return tuple(dict.fromkeys(int(i) for i in ids + list(cfg.rollout.stop_token_ids)))


def check_prompts(cfg: JetConfig, tok, samples: list[Sample]) -> None:
    """Before anything is written: every prompt encodes, and the longest plus ``rollout.max_new_tokens`` fits
    the model's positions (one line each); a group of one sample is warned about."""
    from megatron_jetrl.data.prompts import DataError

    longest = 0
    for n, s in enumerate(samples, 1):
        try:
            ids = encode_prompt(tok, s)
            tok.encode(s.answer)
        except ValueError as e:
            raise DataError(f"data: prompt {n}: {str(e).splitlines()[0]}") from None
        longest = max(longest, len(ids))
        if n == 1:
            log.info("the first prompt as the policy sees it: %r", tok.render(ids))
    need = longest + cfg.rollout.max_new_tokens
    if need > cfg.model.max_position_embeddings:
        raise ConfigError(f"config error: rollout.max_new_tokens: the longest prompt ({longest} tokens) + "
                          f"{cfg.rollout.max_new_tokens} new tokens exceed model.max_position_embeddings="
                          f"{cfg.model.max_position_embeddings}; lower rollout.max_new_tokens to "
                          f"{max(0, cfg.model.max_position_embeddings - longest)} or shorten the prompts")
    if cfg.rollout.n_samples_per_prompt == 1 and cfg.steps:
        log.warning("rollout.n_samples_per_prompt=1: each GRPO group holds one sample, so every advantage is 0 and "
                    "the RL steps change nothing; use 2 or more")


def setup(cfg: JetConfig) -> Run:
    from megatron_jetrl.distributed import init_distributed
    from megatron_jetrl.models.hf_io import load_hf_weights

    samples = (load_prompts(cfg.data.path, cfg.data.prompt_key, cfg.data.answer_key) if cfg.data.path
               else synthetic_arithmetic(cfg.data.synthetic_size, cfg.seed))  # bad data fails before any process group
    reward_fn = get_reward(cfg.data.reward)
    val = val_samples(cfg) if cfg.eval.interval else []
    resume_path = check_run_dir(cfg)
    init_distributed(cfg.parallel, cfg.seed)
    if resume_path and dist.is_initialized() and dist.get_world_size() > 1:
        box = [resume_path]
        dist.broadcast_object_list(box, src=0)
        resume_path = box[0]
    tok = load_tokenizer(cfg.model.tokenizer, cfg.data.apply_chat_template, cfg.data.system_prompt)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"config error: model.vocab_size: {cfg.model.vocab_size} is smaller than the "
                          f"tokenizer's {tok.vocab_size}; raise model.vocab_size")
    check_prompts(cfg, tok, samples + val)
    recipe = FP8Recipe.from_config(cfg.precision)
    dtype = DTYPES[cfg.precision.params_dtype]
    model, fp8_state = build_model(cfg.model, cfg.parallel, recipe, dtype, cfg.precision.backend)
    fp8_state.small_m_max = cfg.precision.small_m_max
    fp8_state.decode_gemm = cfg.precision.decode_gemm
    fp8_state.fuse_swiglu = cfg.precision.fuse_swiglu
    fp8_state.fuse_wgrad_accumulation = cfg.precision.fuse_wgrad_accumulation
    fp8_state.release_bf16_weights = cfg.precision.release_bf16_weights
    fp8_state.cache_dgrad_weights = cfg.precision.cache_dgrad_weights
    if cfg.model.hf_path and not cfg.checkpoint.load_path:
        load_hf_weights(model, cfg.model, cfg.model.hf_path, fp8_state)
    total = cfg.steps * cfg.algo.mini_batches + cfg.algo.sft_warmup_steps  # optimizer steps (the LR schedule's length)
    actor = Actor(model, fp8_state, cfg.algo, cfg.parallel, dtype, total, cfg.rollout.temperature or 1.0)
    engine = None
    if cfg.rollout.engine == "local":
        r = cfg.rollout
        engine = LocalEngine(model, fp8_state, tok.pad_id, seed=cfg.seed, vocab_size=cfg.model.vocab_size,
                             model_cfg=cfg.model, decode=r.decode, cuda_graphs=r.cuda_graphs,
                             bucket=r.decode_bucket, keep_cache=r.keep_decode_cache, attention=r.decode_attention,
                             max_graphs=r.decode_max_graphs)
    stream = PromptStream(samples, cfg.seed)
    run_dir = cfg.logging.run_dir
    ckpt_dir = os.path.join(run_dir, "checkpoints")
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
        import shutil

        for name in RUN_FILES:
            p = os.path.join(run_dir, name)
            shutil.rmtree(p) if os.path.isdir(p) else os.path.exists(p) and os.remove(p)
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
        rank, dp = _dp()
        run.val = val[rank::dp]
    from megatron_jetrl.scheduler import make_scheduler

    run.scheduler = make_scheduler(run)
    if engine is None:  # last: a fleet starts from the trainer's current weights, written to the run dir
        model_dir, _ = disk_push(run, start, iter_hf_tensors(actor.module, cfg.model, export_options(cfg, recipe)))
        run.engine = start_fleet(cfg, recipe, model_dir)
    if cfg.gc_freeze:
        from megatron_jetrl.memory import freeze_python_gc

        run.gc_frozen = freeze_python_gc()
    return run


def encode_prompt(tok, sample: Sample) -> list[int]:
    """The ids the policy sees for ``sample``'s prompt (chat template or bos + text: ``Tokenizer.encode_prompt``)."""
    return tok.encode_prompt(sample.prompt)


def score(run: Run, samples: list[Sample], gens, n: int | None = None) -> torch.Tensor:
    """Rewards of ``gens``, ``n`` (default ``rollout.n_samples_per_prompt``) consecutive ones per sample."""
    n = n or run.cfg.rollout.n_samples_per_prompt
    return torch.tensor([run.reward_fn(run.tokenizer.decode(g.output_ids), samples[i // n].answer,
                                       samples[i // n].metadata) for i, g in enumerate(gens)])


def hand_over_weights(run: Run, version: int) -> dict:
    """Export the weights as the rollout receives them (FP8 bytes + scales of the trainer's cache
    when the rollout is FP8) and hand them over; the receiver checks the hashes (every
    ``logging.parity_interval`` steps)."""
    every = run.cfg.logging.parity_interval
    check = bool(every) and version % every == 0
    opts = export_options(run.cfg, run.actor.fp8_state.recipe)
    if not hasattr(run.engine, "push_weights"):
        if not check:
            return run.engine.update_weights(version, None)
        return InProcessTransport(run.engine).push(version, iter_hf_tensors(run.actor.module, run.cfg.model, opts))
    # Fleet: rank 0 restarts dead servers, then every rank takes part in the export (TP gathers,
    # per-stage disk shards); rank 0 sends.
    fleet, items = run.engine, iter_hf_tensors(run.actor.module, run.cfg.model, opts)
    m = {}
    if dist.is_initialized():
        dist.barrier()  # every rank's in-flight rollout is done before the servers' weights change
    if is_rank0():
        fleet.heal()
        m = fleet.push_weights(version, items, check, lambda v, it: disk_push(run, v, it, check))
        m.update(fleet.metrics)
    elif run.cfg.rollout.weight_transport == "disk":
        disk_push(run, version, items, check)
    else:
        for _ in items:
            pass
    if dist.is_initialized():
        dist.barrier()
        # rank 0's push metrics (sync time and bytes, FP8 parity, fleet health) for every rank: the logging
        # rank is the last one, in another data-parallel group than rank 0 when there are pipeline stages
        box = [m]
        dist.broadcast_object_list(box, src=0)
        m = box[0]
    if not is_rank0():  # rank 0 restarted whatever was down: every server is back for every rank
        for srv in fleet.servers:
            srv.up = True
    return m


def _dp() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def my_prompts(run: Run, n: int) -> list[Sample]:
    """This data-parallel rank's ``n`` prompts: every rank draws the same ``n * dp`` from the shared
    stream (so the stream position stays one number) and takes its own slice."""
    rank, dp = _dp()
    return run.stream.next(n * dp)[rank * n:(rank + 1) * n]


def reduce_over_dp(m: dict) -> dict:
    """Step metrics as one number per run: mean over the DP ranks that report a key (max/min for
    *_max/*_min). Ranks may report different keys (only rank 0 talks to a fleet's servers)."""
    from megatron.core import parallel_state

    if _dp()[1] == 1:
        return m
    mine = {k: float(v) for k, v in m.items()}
    every = [None] * _dp()[1]
    dist.all_gather_object(every, mine, group=parallel_state.get_data_parallel_group())
    out = {}
    for k in sorted(set().union(*every)):
        vals = [d[k] for d in every if k in d]
        out[k] = max(vals) if k.endswith("_max") else min(vals) if k.endswith("_min") else sum(vals) / len(vals)
    return out


def val_samples(cfg: JetConfig) -> list[Sample]:
    """The held-out prompts: ``data.val_path``, or the synthetic task's own (another seed); ``eval.max_prompts``."""
    if cfg.data.val_path:
        out = load_prompts(cfg.data.val_path, cfg.data.prompt_key, cfg.data.answer_key)
    elif not cfg.data.path:
        out = synthetic_arithmetic(cfg.data.val_size, cfg.seed + 1)
    else:
        out = []
    return out[:cfg.eval.max_prompts] if cfg.eval.max_prompts else out


def evaluate(run: Run, step: int) -> dict:
    """Held-out metrics of the current policy, run as a rollout runs (engine, precision, scheduler):
    ``eval/accuracy`` (mean reward of one greedy response per prompt), ``eval/pass@k`` (share of prompts with
    a reward-1 response among k samples at the rollout temperature), ``eval/response_length_mean``. Each DP
    rank takes its share of the prompts; the means are averaged over ranks."""
    from dataclasses import replace

    cfg, m = run.cfg.eval, {}
    if not run.val:
        return m
    prompts = [encode_prompt(run.tokenizer, s) for s in run.val]
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
    samples = my_prompts(run, run.cfg.rollout.prompts_per_step * run.cfg.rollout.n_samples_per_prompt)
    prompts = [encode_prompt(tok, s) for s in samples]
    answers = [tok.encode(s.answer) + [tok.eos_id] for s in samples]
    batch = build_batch(prompts, answers, [[0.0] * len(a) for a in answers], torch.zeros(len(samples)),
                        tok.pad_id, next(run.actor.module.parameters()).device)
    m = {}
    with timed(m, "train"):
        m.update(run.actor.sft_step(batch))
    if not hasattr(run.engine, "push_weights"):
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
                                f"stays {newest_intact_checkpoint(run.ckpt_dir) or 'none'}")
        bar.set_postfix({k: f"{metrics[k]:.3g}" for k in ("reward_mean", "sft_loss", "mismatch_abs_mean")
                         if k in metrics})
        last = step == total - 1
        due = last or (cfg.checkpoint.save_interval and (step + 1) % cfg.checkpoint.save_interval == 0)
        if due and run.actor.skipped_in_a_row == 0:  # after a skipped update the newest checkpoint already holds it
            run.actor.reload()  # a colocated hand-over leaves the optimizer state on the host
            save_checkpoint(run.ckpt_dir, step, run.actor, {"stream": run.scheduler.stream_state()}, cfg.model)


def close(run: Run) -> None:
    """Stop the scheduler's background work and the fleet's servers; close the logger."""
    if run.scheduler is not None:
        run.scheduler.close()
    if hasattr(run.engine, "shutdown"):
        run.engine.shutdown()
    if run.logger:
        run.logger.close()
    if run.gc_frozen:  # the run's objects become collectable again (a caller may build another model next)
        from megatron_jetrl.memory import unfreeze_python_gc

        unfreeze_python_gc()
        run.gc_frozen = 0
