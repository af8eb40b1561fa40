"""What a run trains and evaluates on, as the policy sees it: the prompt sets (``data.path`` or the synthetic
task), the held-out prompts, the checks every prompt passes before anything is written, and the ids that end a
response."""
from __future__ import annotations

import logging

from megatron_jetrl.config import ConfigError, JetConfig
from megatron_jetrl.data.prompts import DataError, Sample, load_prompts, synthetic_arithmetic

log = logging.getLogger("jetrl")


def train_samples(cfg: JetConfig) -> list[Sample]:
    """The training prompts: ``data.path``, or the synthetic arithmetic task."""
    if cfg.data.path:
        return load_prompts(cfg.data.path, cfg.data.prompt_key, cfg.data.answer_key)
    return synthetic_arithmetic(cfg.data.synthetic_size, cfg.seed)


def val_samples(cfg: JetConfig) -> list[Sample]:
    """The held-out prompts: ``data.val_path``, or the synthetic task's own (another seed); ``eval.max_prompts``."""
    if cfg.data.val_path:
        out = load_prompts(cfg.data.val_path, cfg.data.prompt_key, cfg.data.answer_key)
    elif not cfg.data.path:
        out = synthetic_arithmetic(cfg.data.val_size, cfg.seed + 1)
    else:
        out = []
    return out[:cfg.eval.max_prompts] if cfg.eval.max_prompts else out


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
    longest = 0
    for n, s in enumerate(samples, 1):
        try:
            ids = tok.encode_prompt(s.prompt)
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
