"""``jetrl bench train``: one RL training phase, ``bf16`` vs ``jet``, in one run on one GPU.

A training phase = logprob recompute (forward) + forward/backward of the clipped policy loss over
the micro-batches + optimizer step + FP8 re-quantization of the weight cache, over a fixed batch of
synthetic rollouts (random tokens; the second half of each sequence is the "response"). The model
is a slice of a preset (``--layers`` transformer layers of its shapes) with full fp32 master
weights and Adam state. Prints per-phase times, the jet/bf16 ratio and peak memory.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from megatron_jetrl.bench.timing import dump_json


def _host_profile(fn, title: str, top: int) -> None:
    """cProfile of ``fn()`` (synchronized at the end): the host functions by own time, most first (cProfile slows
    the host, so a pass that is GPU-bound outside it can look host-bound here: ``--lag`` says which it is)."""
    import cProfile
    import pstats

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn()
    sync()
    prof.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    print(f"{title}: host profile ({1e3 * wall:.1f} ms under cProfile), top {top} by own time:")
    for (file, line, fname), (cc, nc, tt, ct, _) in rows:
        where = "/".join(file.rsplit("/", 2)[-2:]) + f":{line}"
        print(f"  {1e3 * tt:8.2f} ms own {1e3 * ct:9.2f} ms cum  x{nc:<6d} {fname} ({where})")


class _LagProbe:
    """How far the GPU runs behind the host at every transformer layer's forward: the layer's pre-hook records a
    CUDA event and the host clock; after the pass, the event's GPU time minus the host time of its record (both
    from the pass's start) is the work queued ahead of the GPU there. Near zero (< 0.1 ms: a launch's latency),
    the GPU had run out of work and was waiting for the host: the pass is host-bound at that point. On the H200
    (8-layer slice, docs/benchmarks.md) both modes' passes keep the GPU 30-170 ms behind the host at nearly every
    layer start: their wall time above the profiler's kernel sum is the GPU's own gaps between kernels."""

    def __init__(self, model):
        self.on, self.marks = False, []
        self.handles = [m.register_forward_pre_hook(self._hook) for m in model.modules()
                        if type(m).__name__ == "TransformerLayer"]

    def _hook(self, module, args):
        if self.on:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((time.perf_counter(), ev))

    def run(self, fn, title: str) -> dict:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.marks, self.on = [], True
        t0 = time.perf_counter()
        start.record()
        fn()
        issue = time.perf_counter() - t0
        end.record()
        self.on = False
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        lags = sorted(start.elapsed_time(ev) - 1e3 * (t - t0) for t, ev in self.marks)
        res = {"wall_ms": 1e3 * wall, "issue_ms": 1e3 * issue, "gpu_ms": start.elapsed_time(end),
               "lag_median_ms": lags[len(lags) // 2] if lags else float("nan"),
               "starved_frac": sum(lag < 0.1 for lag in lags) / max(len(lags), 1)}
        print(f"  {title}: wall {res['wall_ms']:.1f} ms, host issued it in {res['issue_ms']:.1f} ms; GPU behind the host "
              f"at layer starts: median {res['lag_median_ms']:.2f} ms, {100 * res['starved_frac']:.0f}% of {len(lags)} "
              f"with the GPU idle (< 0.1 ms: host-bound there)")
        return res

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _phase(cfg, seq: int, n_seqs: int, steps: int, profile: int = 0, cprofile: int = 0, lag: bool = False,
           copies: int = 0) -> dict:
    from megatron_jetrl.distributed import init_distributed
    from megatron_jetrl.models.builder import DTYPES, build_model
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.trainer.actor import Actor, RLBatch

    init_distributed(cfg.parallel, cfg.seed)
    dtype = DTYPES[cfg.precision.params_dtype]
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), dtype,
                               cfg.precision.backend)
    actor = Actor(model, state, cfg.algo, cfg.parallel, dtype, total_steps=steps + 1)
    if cfg.gc_freeze:  # as the trainer does after setup (config: gc_freeze)
        from megatron_jetrl.memory import freeze_python_gc

        freeze_python_gc()
    dev = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (n_seqs, seq + 1), generator=g).to(dev)
    mask = torch.zeros(n_seqs, seq, device=dev)
    mask[:, seq // 2:] = 1.0
    batch = RLBatch(tokens, mask, torch.full((n_seqs, seq), -2.0, device=dev) * mask,
                    torch.randn(n_seqs, generator=g).to(dev))
    torch.cuda.reset_peak_memory_stats()
    times = {"logprob": [], "train": [], "requant": []}
    for i in range(steps + 1):  # the first step warms up (allocator, Triton/cuBLAS autotuning)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch.old_logp = actor.compute_logprobs(batch)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        m = actor.train_step(batch)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i:
            times["logprob"].append(t1 - t0)
            times["train"].append(t2 - t1)
            times["requant"].append(m["time_fp8_requant"])
    out = {k: statistics.median(v) for k, v in times.items()}
    out["phase"] = out["logprob"] + out["train"]
    out["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    # the caching allocator's retries (cudaFree of cached blocks, then again): a sign the slice is too large
    out["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    if profile:  # one more training step under the profiler: GPU kernel time by kernel
        from megatron_jetrl.bench.timing import kernel_table
        from megatron_jetrl.precision.linear import refresh_fp8_weights

        table = kernel_table(lambda: actor.train_step(batch), 1,
                             f"{cfg.precision.mode} train step (fwd/bwd + optimizer), {cfg.model.num_layers} layers, "
                             f"seq {seq}", top=profile)
        out["train_kernel_ms"] = table["ms_per_call"]
        # the GPU's idle time inside the timed step: host work and syncs the kernels do not cover
        print(f"  train step wall {1e3 * out['train']:.1f} ms (median above) vs {table['ms_per_call']:.1f} ms of kernels")
        table = kernel_table(lambda: actor.compute_logprobs(batch), 1, f"{cfg.precision.mode} logprob pass, "
                             f"{cfg.model.num_layers} layers, seq {seq}", top=min(profile, 12))
        out["logprob_kernel_ms"] = table["ms_per_call"]
        print(f"  logprob pass wall {1e3 * out['logprob']:.1f} ms (median above) vs {table['ms_per_call']:.1f} ms of kernels")
        if state.recipe.rollout_fp8:  # the per-step re-quantization alone (reads the BF16 weights: restored)
            actor.restore_weights()
            kernel_table(lambda: refresh_fp8_weights(model, state), 1, f"{cfg.precision.mode} FP8 weight re-quantization, "
                         f"{cfg.model.num_layers} layers (wall {1e3 * out['requant']:.1f} ms)", top=8)
    if lag:  # where the GPU waits for the host (one more logprob pass and training step, probed per layer)
        probe = _LagProbe(model)
        mode = cfg.precision.mode
        out["logprob_lag"] = probe.run(lambda: actor.compute_logprobs(batch), f"{mode} logprob pass")
        out["train_lag"] = probe.run(lambda: actor.train_step(batch), f"{mode} train step (forwards probed)")
        probe.remove()
    if copies:  # where the passes' tensor copies come from (call sites, or the autograd node in backward)
        from megatron_jetrl.bench.timing import copy_sources

        mode = cfg.precision.mode
        copy_sources(lambda: actor.compute_logprobs(batch), f"{mode} logprob pass", copies)
        copy_sources(lambda: actor.train_step(batch), f"{mode} train step", copies)
    if cprofile:  # the host side: where Python spends one training step and one logprob pass
        _host_profile(lambda: actor.train_step(batch), f"{cfg.precision.mode} train step", cprofile)
        _host_profile(lambda: actor.compute_logprobs(batch), f"{cfg.precision.mode} logprob pass", cprofile)
    out["tokens_per_s"] = n_seqs * seq / out["phase"]
    actor = model = state = batch = None  # freed before the next mode
    if cfg.gc_freeze:  # the model's cycles must be collectable before the next mode builds its own
        from megatron_jetrl.memory import unfreeze_python_gc

        unfreeze_python_gc()
    else:
        gc.collect()
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> list[dict]:
    from megatron_jetrl.config import preset_path
    from megatron_jetrl.config import load_config

    ap = argparse.ArgumentParser(prog="jetrl bench train", description=__doc__)
    ap.add_argument("--preset", default="llama3.1-8b-random")
    ap.add_argument("--layers", default="16", help="transformer layers of the preset's shapes (comma-separated: several "
                    "slices). On the H200 with fp32 master weights and Adam state: 24 layers at 4K (121 GiB peak in "
                    "bf16 since its SwiGLU is fused; 127 GiB before) and 16 at 8K (106 GiB) are the largest slices "
                    "measured")
    ap.add_argument("--seqs", default="4096,8192", help="sequence lengths")
    ap.add_argument("--tokens-per-step", type=int, default=65536, help="tokens in the fixed batch")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--profile", type=int, nargs="?", const=30, default=0, metavar="TOP",
                    help="also print the TOP (default 30) kernels of one training step per mode (where the phase's "
                         "time goes) and of the FP8 re-quantization")
    ap.add_argument("--cprofile", type=int, default=0, metavar="TOP",
                    help="also print the TOP host (Python) functions by own time of one training step and one logprob "
                         "pass per mode (cProfile): where a host-bound pass spends its time")
    ap.add_argument("--lag", action="store_true",
                    help="also run one logprob pass and one training step per mode with a CUDA event at every layer's "
                         "forward: how far the GPU runs behind the host there (near 0: the host is the bottleneck)")
    ap.add_argument("--copies", type=int, default=0, metavar="TOP",
                    help="also print the TOP call sites of the tensor copies of one logprob pass and one training step "
                         "per mode (profiler with Python stacks; backward copies by autograd node)")
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)  # flags may follow config overrides (device_check.sh appends both)
    if not torch.cuda.is_available():
        raise SystemExit("jetrl bench train needs a CUDA GPU")
    rows = []
    for layers, seq in ((int(n), int(s)) for n in args.layers.split(",") for s in args.seqs.split(",")):
        res = {}
        for mode in ("bf16", "jet"):
            cfg = load_config(preset_path(args.preset), [
                *args.overrides, f"precision.mode={mode}", f"model.num_layers={layers}",
                f"model.max_position_embeddings={max(seq + 1, 4096)}", f"algo.micro_batch_size={args.micro_batch}"])
            res[mode] = _phase(cfg, seq, max(args.tokens_per_step // seq, 1), args.steps, args.profile, args.cprofile,
                               args.lag, args.copies)
        rows.append({"layers": layers, "seq": seq, **{f"{m}_{k}": v for m, r in res.items() for k, v in r.items()},
                     "phase_speedup": res["bf16"]["phase"] / res["jet"]["phase"],
                     "train_speedup": res["bf16"]["train"] / res["jet"]["train"],
                     "logprob_speedup": res["bf16"]["logprob"] / res["jet"]["logprob"]})
    print(f"# {args.preset}, {args.tokens_per_step} tokens per step, micro-batch {args.micro_batch}, "
          f"{torch.cuda.get_device_name()}")
    print("| layers | seq | bf16 phase s | jet phase s | phase speedup | logprob speedup | fwd/bwd+opt speedup | "
          "jet re-quant s | peak GiB bf16 / jet | allocator retries bf16 / jet |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['seq']} | {r['bf16_phase']:.3f} | {r['jet_phase']:.3f} | {r['phase_speedup']:.2f}x | "
              f"{r['logprob_speedup']:.2f}x | {r['train_speedup']:.2f}x | {r['jet_requant']:.3f} | "
              f"{r['bf16_peak_GiB']:.1f} / {r['jet_peak_GiB']:.1f} | {r['bf16_alloc_retries']} / {r['jet_alloc_retries']} |")
    dump_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
