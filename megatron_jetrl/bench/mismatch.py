"""``jetrl mismatch``: train-rollout mismatch per precision mode, measured side by side.

For each mode the same model (same weights, same seed) samples responses with the rollout engine
in its rollout precision, then the trainer recomputes the logprobs of those tokens in its training
precision; the metrics are ``trainer.loss.mismatch_metrics``. Expected order: jet ~ bf16 <<
fp8_rollout (the off-policy baseline).
"""
from __future__ import annotations

import argparse

import torch

from megatron_jetrl.bench.timing import MODES_HELP, dump_json, mode_overrides

MODES = ("bf16", "fp8_rollout", "jet")


def measure(cfg, n_prompts: int, prompt_len: int, seed: int = 0, label: str | None = None) -> dict:
    """One mode (cfg.precision.mode) on random prompts (random weights unless model.hf_path)."""
    from megatron_jetrl.distributed import init_distributed
    from megatron_jetrl.models.builder import DTYPES, build_model, exact_length
    from megatron_jetrl.models.hf_io import load_hf_weights
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.rollout.base import SamplingParams
    from megatron_jetrl.rollout.local import LocalEngine
    from megatron_jetrl.trainer import loss as L
    from megatron_jetrl.trainer.actor import build_batch, train_logprobs

    init_distributed(cfg.parallel, cfg.seed)  # same seed: same random weights in every mode
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision),
                               DTYPES[cfg.precision.params_dtype], cfg.precision.backend)
    if cfg.model.hf_path:
        load_hf_weights(model, cfg.model, cfg.model.hf_path, state)
    dev = next(model.parameters()).device
    engine = LocalEngine.from_config(model, state, cfg, pad_id=0, seed=seed)  # the run's rollout.* settings
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, cfg.model.vocab_size, (n_prompts, prompt_len), generator=g).tolist()
    params = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature or 1.0, 1.0, 0, ())
    gens = engine.generate(prompts, params)
    batch = build_batch(prompts, [x.output_ids for x in gens], [x.output_logprobs for x in gens],
                        torch.zeros(len(gens)), 0, dev)
    exact = state.recipe.exact  # the trainer's exact statement over the exact rollout's length
    seq_len = exact_length(model, batch.tokens.shape[1] - 1) if exact else None
    train_lp = train_logprobs(model, batch, params.temperature, cfg.algo.micro_batch_size, seq_len, exact)
    out = {k: float(v) for k, v in L.mismatch_metrics(train_lp, batch.rollout_logp, batch.mask).items()}
    out["tokens"] = float(batch.mask.sum())
    out["mode"] = label or cfg.precision.mode
    out["params"] = sum(p.numel() for p in model.parameters())
    del model, engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> list[dict]:
    from megatron_jetrl.config import preset_path
    from megatron_jetrl.config import load_config

    ap = argparse.ArgumentParser(prog="jetrl mismatch", description=__doc__)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--config")
    ap.add_argument("--modes", default=",".join(MODES), help=MODES_HELP)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    path = args.config or preset_path(args.preset)
    rows = []
    for mode in args.modes.split(","):
        cfg = load_config(path, [*args.overrides, *mode_overrides(mode)])
        rows.append(measure(cfg, args.prompts, args.prompt_len, label=mode))
    print("| mode | mean abs logp diff | max abs logp diff | k3 KL | IS weight min / max | tokens | params |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['mismatch_abs_mean']:.3g} | {r['mismatch_abs_max']:.3g} | "
              f"{r['mismatch_k3_kl']:.3g} | {r['is_weight_min']:.3g} / {r['is_weight_max']:.3g} | "
              f"{int(r['tokens'])} | {r['params'] / 1e6:.1f}M |")
    dump_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
