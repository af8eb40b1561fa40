"""``jetrl mismatch``: train-rollout mismatch per precision mode, measured side by side.

For each mode the same model (same weights, same seed) samples responses with the rollout engine
in its rollout precision, then the trainer recomputes the logprobs of those tokens in its training
precision; the metrics are ``trainer.loss.mismatch_metrics``. Expected order: jet ~ bf16 <<
fp8_rollout (the off-policy baseline).

``--kv``: where the two sides' keys and values part, layer by layer (:class:`KVAgreement`): the share of K and V
elements in which the trainer's attention inputs, as its attention reads them, differ from the rollout's KV cache.
With the FP8 cache a difference is a whole E4M3 step; the first layer's share is what the two sides' GEMMs alone
leave (the same input bytes), the later layers' grow with the hidden states' differences.
"""
from __future__ import annotations

import argparse

import torch

from megatron_jetrl.bench.timing import MODES_HELP, dump_json, mode_overrides

MODES = ("bf16", "fp8_rollout", "jet")


class KVAgreement:
    """Forward pre-hooks on the trainer's core attention modules (``models.spec.SDPAttention``, in layer order) that
    compare the keys and values each receives with the rollout's KV cache (``decoder``, the static decoder kept from
    the rollout of the same tokens): per layer, over rows x ``positions`` x KV groups x head_dim elements, how many
    differ and the largest difference. The trainer's side as its attention reads it: rounded by the FP8 KV cache's
    rule where its forward rounds (``recipe.train_kv_fp8``); the cache's side as its attention reads it (an FP8
    cache's bytes times their scales, exact in the model's dtype). Cache column ``j`` holds position ``j`` (prompts
    of one length, no left pads); micro-batches arrive in row order."""

    def __init__(self, model, decoder, recipe, positions: int):
        from megatron_jetrl.models.spec import SDPAttention

        self.decoder, self.recipe, self.positions = decoder, recipe, positions
        mods = [m for m in model.modules() if isinstance(m, SDPAttention)]
        if decoder is None or len(mods) != decoder.k.shape[0]:
            raise ValueError(f"KVAgreement: {len(mods)} attention modules for a cache of "
                             f"{None if decoder is None else decoder.k.shape[0]} layers (needs the static decoder)")
        n = len(mods)
        self.rows_seen, self.elements = [0] * n, [0] * n
        self.k_differ, self.v_differ, self.k_max, self.v_max = [0] * n, [0] * n, [0.0] * n, [0.0] * n
        self.handles = [m.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, m in enumerate(mods)]

    def _cache(self, t: torch.Tensor, scale, rows: slice, li: int, dtype) -> torch.Tensor:
        """Layer ``li``'s cache values for ``rows`` at positions 0..positions-1: [b, groups, positions, d]."""
        from megatron_jetrl.precision.quant import dequantize_kv

        x = t[li, rows, :, : self.positions]
        return x if scale is None else dequantize_kv(x, scale[li, rows, :, : self.positions], dtype)

    def _hook(self, li: int):
        def hook(mod, args, kwargs):
            from megatron_jetrl.precision.quant import kv_qdq

            key = kwargs["key"] if "key" in kwargs else args[1]
            value = kwargs["value"] if "value" in kwargs else args[2]
            b, d = key.shape[1], self.decoder
            rows = slice(self.rows_seen[li], self.rows_seen[li] + b)
            self.rows_seen[li] += b
            for t, cache, scale, differ, most in ((key, d.k, d.ks, self.k_differ, self.k_max),
                                                   (value, d.v, d.vs, self.v_differ, self.v_max)):
                t = t[: self.positions].detach()  # [positions, b, groups, d]
                if self.recipe is not None and self.recipe.train_kv_fp8:
                    t = kv_qdq(t, self.recipe)
                diff = (t.permute(1, 2, 0, 3).float() - self._cache(cache, scale, rows, li, t.dtype).float()).abs()
                differ[li] += int((diff != 0).sum())
                most[li] = max(most[li], float(diff.max()))
            self.elements[li] += key[: self.positions].numel()
        return hook

    def close(self) -> list[dict]:
        """Remove the hooks; per layer ``{layer, k_differ, v_differ, k_max_abs, v_max_abs}`` (shares of the
        elements compared)."""
        for h in self.handles:
            h.remove()
        return [{"layer": i, "k_differ": self.k_differ[i] / max(1, n), "v_differ": self.v_differ[i] / max(1, n),
                 "k_max_abs": self.k_max[i], "v_max_abs": self.v_max[i]} for i, n in enumerate(self.elements)]


def measure(cfg, n_prompts: int, prompt_len: int, seed: int = 0, label: str | None = None, kv: bool = False) -> dict:
    """One mode (cfg.precision.mode) on random prompts (random weights unless model.hf_path); ``kv``: also the
    per-layer K/V agreement (``kv_layers``, :class:`KVAgreement`)."""
    from megatron_jetrl.distributed import init_distributed
    from megatron_jetrl.errors import ConfigError
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
    # the run's rollout.* settings; with ``kv`` the decoder (and its cache) kept for the comparison
    engine = LocalEngine.from_config(model, state, cfg, pad_id=0, seed=seed, keep_cache=True if kv else None)
    if kv and not engine.static_decoding:
        raise ConfigError("jetrl mismatch --kv: compares the static decoder's KV cache; set rollout.decode=static (in "
                          "exact mode: on CUDA)")
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, cfg.model.vocab_size, (n_prompts, prompt_len), generator=g).tolist()
    params = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature or 1.0, 1.0, 0, ())
    gens = engine.generate(prompts, params)
    batch = build_batch(prompts, [x.output_ids for x in gens], [x.output_logprobs for x in gens],
                        torch.zeros(len(gens)), 0, dev)
    exact = state.recipe.exact  # the trainer's exact statement over the exact rollout's length
    seq_len = exact_length(model, batch.tokens.shape[1] - 1) if exact else None
    agree = None
    if kv:
        # no stop ids: every response max_new_tokens long, cache column j = position j in every row
        agree = KVAgreement(model, engine.decoder, state.recipe, batch.tokens.shape[1] - 1)
    try:
        train_lp = train_logprobs(model, batch, params.temperature, cfg.algo.micro_batch_size, seq_len, exact)
    finally:
        kv_layers = agree.close() if agree is not None else None
    out = {k: float(v) for k, v in L.mismatch_metrics(train_lp, batch.rollout_logp, batch.mask).items()}
    if kv_layers is not None:
        out["kv_layers"] = kv_layers
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
    ap.add_argument("--kv", action="store_true", help="also print, per layer, the share of K and V elements in which "
                    "the trainer's attention inputs differ from the rollout's KV cache")
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    path = args.config or preset_path(args.preset)
    rows = []
    for mode in args.modes.split(","):
        cfg = load_config(path, [*args.overrides, *mode_overrides(mode)])
        rows.append(measure(cfg, args.prompts, args.prompt_len, label=mode, kv=args.kv))
    print("| mode | mean abs logp diff | max abs logp diff | k3 KL | IS weight min / max | tokens | params |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['mismatch_abs_mean']:.3g} | {r['mismatch_abs_max']:.3g} | "
              f"{r['mismatch_k3_kl']:.3g} | {r['is_weight_min']:.3g} / {r['is_weight_max']:.3g} | "
              f"{int(r['tokens'])} | {r['params'] / 1e6:.1f}M |")
    if args.kv:
        print("\n| layer | " + " | ".join(f"{r['mode']}: K / V elements differing (largest difference)" for r in rows) + " |")
        print("|---|" + "---|" * len(rows))
        for li in range(len(rows[0]["kv_layers"])):
            cells = [f"{x['k_differ']:.2%} / {x['v_differ']:.2%} (max {max(x['k_max_abs'], x['v_max_abs']):.1e})"
                     for x in (r["kv_layers"][li] for r in rows)]
            print(f"| {li} | " + " | ".join(cells) + " |")
    dump_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
