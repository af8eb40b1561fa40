"""``jetrl bench rollout``: in-process generation speed, bf16 vs FP8 modes, in one run.

For each mode the same model (preset shapes, same random weights) generates ``--batch`` sequences
of ``--new-tokens`` tokens (no stop tokens, temperature 1) from random ``--prompt-len`` prompts with
the rollout engine the RL loop uses (``rollout.decode``, CUDA graphs per ``rollout.cuda_graphs``).
Per mode it prints the prefill time, the decode step time (median over steps is not observable
without syncs, so: decode wall time / steps), tokens/s, graph-capture time (first rollout: the
timed rollout is the second, which reuses the graphs as the RL loop does; past ``WARMUP_TOKENS`` new tokens the
first is that long, on the same full-length decoder, and the timed rollout's time leaves out the captures of the
length buckets the first did not reach), the weight bytes one
step reads and the weight-bandwidth bound at ``--bandwidth`` TB/s (the H200's measured copy
ceiling), the KV bytes a step reads, and the FP8/bf16 speedup. A batch whose KV cache does not fit the GPU decodes in
waves as the RL loop does (``LocalEngine.wave_plan``): tokens/s is the whole rollout's, the step time and KV bytes a
wave's step's (``waves``, ``step_rows``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch

from megatron_jetrl.bench.timing import (MODES_HELP, GpuSampler, dump_json, mode_overrides, print_table,
                                         quarter_medians, step_spans_ms)
from megatron_jetrl.errors import ConfigError

WARMUP_TOKENS = 1024  # the untimed first rollout's length at most (graph capture and compiles happen there)


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads: every parameter except the input embedding (a
    gather of B rows), FP8 linears at their cached FP8 bytes + scales when the rollout runs FP8."""
    total = 0
    for name, m in model.named_modules():
        for pn, p in m.named_parameters(recurse=False):
            if "word_embeddings" in f"{name}.{pn}":
                continue
            cache = getattr(m, "fp8_cache", None)
            if pn == "weight" and cache is not None and m.fp8_state is not None and m.fp8_state.forward_fp8:
                q, s = cache.get(p, m.fp8_state)
                total += q.numel() * q.element_size() + s.numel() * 4
            else:
                total += p.numel() * p.element_size()
    return total


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_wall(dec, ids: torch.Tensor, steps: int) -> dict:
    """``steps`` decode steps from the decoder's position, twice. First as the rollout runs them (the host launching
    while the GPU works): wall time per step (host clock around the launches and a final sync), the launches' own
    time (a loop whose launches take as long as its wall time is bound by the host), and from CUDA events around
    each step the GPU's time per step and the idle time between steps (medians). Then with the launches queued
    behind a GPU sleep: the GPU's time per step with the steps back to back from a rested board, over the first and
    the last quarter of the steps, from the same position (``dec.seek``): a step's time depends on its length (the
    FP8 cache's decode attention ran its last keys in latency-bound tiles, a sawtooth of period ``BLOCK_N`` keys),
    so both runs cover the same keys. Returns ``{"step_ms", "host_ms", "gpu_ms", "between_ms", "rested_first_ms",
    "rested_last_ms"}`` (the event times NaN off CUDA; the rested ones also where the host's launches outlast the
    sleep)."""
    cuda = torch.cuda.is_available()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)] if cuda else []
    start = dec.position
    _sync()
    t0 = time.perf_counter()
    for i in range(steps):
        if cuda:
            ev[i][0].record()
        dec.step(ids)
        if cuda:
            ev[i][1].record()
    host = time.perf_counter() - t0
    _sync()
    nan = float("nan")
    out = {"step_ms": (time.perf_counter() - t0) / steps * 1e3, "host_ms": host / steps * 1e3, "gpu_ms": nan,
           "between_ms": nan, "rested_first_ms": nan, "rested_last_ms": nan}
    if not cuda:
        return out
    out["gpu_ms"] = statistics.median(a.elapsed_time(b) for a, b in ev)
    out["between_ms"] = statistics.median(ev[i][1].elapsed_time(ev[i + 1][0]) for i in range(steps - 1)) if steps > 1 else 0.0
    # a rested board: the same steps queued behind a GPU sleep longer than their launches take
    dec.seek(start)
    rested = step_spans_ms(lambda: dec.step(ids), steps, rest_s=0.05 + 2 * host)
    out["rested_first_ms"], out["rested_last_ms"] = quarter_medians(rested)
    return out


def profile_steps(dec, steps: int, advance: int = 0) -> dict:
    """Kernel time per decode step by kernel (the same decoder stepped eagerly under the profiler
    after a prefill; kernel durations are the graph's, the host gaps are not), first right after the
    prefill and then, with ``advance``, that many (graph) steps later, where attention reads the
    rollout's mean number of keys; there also the graph's step timed as the rollout launches it (wall, host and GPU
    time) and on a rested board (``step_wall``; the eager step's rested time too), and, profiled over graph replays,
    its kernels as replayed and the idle time between them (``timing.idle_gaps``): where wall time and kernel time
    part."""
    from megatron_jetrl.bench.timing import kernel_table

    ids = torch.zeros(dec.B, dtype=torch.long, device=dec.device)
    dec._host_pos = int(dec.pos)
    out = {}
    for tag, skip in (("", 0), ("_at_mean", advance)):
        if tag and not skip:
            break
        for _ in range(min(skip, dec.L - dec._host_pos - steps - 8)):  # graph steps to the mean length
            dec.step(ids)
        if tag:  # the graph-replayed step's wall time at this length, and its kernels' time as replayed
            out.update({f"graph_{k}{tag}": v for k, v in step_wall(dec, ids, steps).items()})
            if dec.use_graphs:
                g = kernel_table(lambda: dec.step(ids), steps, f"graph-replayed decode step at {dec._host_pos} keys",
                                 top=30, gaps=True)
                out["graph_kernel_ms_per_step" + tag] = g["ms_per_call"]
                out["graph_idle_ms_per_step" + tag] = g.get("idle_ms_per_call", 0.0)
        use, dec.use_graphs = dec.use_graphs, False
        try:
            n = min(steps, (dec.L - dec._host_pos - 2) // 3)  # the KV cache holds L positions
            for _ in range(2):
                dec.step(ids)
            k = kernel_table(lambda: dec.step(ids), n, f"decode step at {dec._host_pos} keys", top=30)
            if tag:  # the same steps launched eagerly, unprofiled, back to back: a graph slower than its kernels shows
                w = step_wall(dec, ids, 2)  # two steps (~900 launches): more may not queue ahead of the GPU
                out["eager_host_ms" + tag], out["eager_gpu_ms" + tag] = w["host_ms"], w["rested_last_ms"]
        finally:
            dec.use_graphs = use
        out["kernel_ms_per_step" + tag], out["top" + tag] = k["ms_per_call"], k["top"]
    return out


def kv_fit(rows: list[dict]) -> list[dict]:
    """Per (mode, batch) measured at two or more response lengths: the least-squares line ``decode_step_ms = base_ms
    + kv_GB_read_per_step_mean / kv_TBps`` (GB / (TB/s) = ms). ``base_ms``: what a step costs besides reading the KV
    cache (weights, launches, the kernels' fixed parts); ``kv_TBps``: the rate the step reads each further byte of
    it (None where the longer rollouts' steps were not slower). Rows out of memory are left out, and rows decoded in
    waves (their steps run a wave's rows, not the batch's)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if not r.get("oom") and r.get("waves", 1) == 1:
            groups.setdefault((r["mode"], r["batch"]), []).append(r)
    out = []
    for (mode, batch), rs in groups.items():
        try:  # slope in ms per GB
            slope, base = statistics.linear_regression([r["kv_GB_read_per_step_mean"] for r in rs],
                                                       [r["decode_step_ms"] for r in rs])
        except statistics.StatisticsError:  # one length only
            continue
        out.append({"mode": mode, "batch": batch, "points": len(rs), "base_ms": base,
                    "kv_TBps": 1.0 / slope if slope > 0 else None})  # None: longer steps no slower (noise)
    return out


def projected(rows: list[dict], fits: list[dict]) -> None:
    """Where a mode's cache did not fit (a row with ``oom``) but the mode was measured at shorter lengths, its step
    from the fit, ``decode_step_ms_fitted = base_ms + kv_GB_read_per_step_mean / kv_TBps``; a measured row whose bf16
    row at the same (batch, length) has only that gets ``step_vs_bf16_fitted`` (bf16's fitted step / its own), e.g.
    jet + FP8 KV against BF16 at a length where not one BF16 row's cache fits the GPU (fewer rows decode in waves,
    ``run_mode``). In place."""
    fit = {(f["mode"], f["batch"]): f for f in fits if f["kv_TBps"]}
    for r in rows:
        f = fit.get((r["mode"], r["batch"]))
        if r.get("oom") and f and "kv_GB_read_per_step_mean" in r:
            r["decode_step_ms_fitted"] = f["base_ms"] + r["kv_GB_read_per_step_mean"] / f["kv_TBps"]
    for r in rows:
        if r.get("oom") or r["mode"] == "bf16":
            continue
        base = bf16_row(rows, r)
        if base and base.get("oom") and "decode_step_ms_fitted" in base:
            r["step_vs_bf16_fitted"] = base["decode_step_ms_fitted"] / r["decode_step_ms"]


def bf16_row(rows: list[dict], r: dict) -> dict | None:
    """bf16's row at row ``r``'s (batch, new tokens), measured or refused (``oom``), or None."""
    return next((b for b in rows if b["mode"] == "bf16" and b["batch"] == r["batch"]
                 and b["new_tokens"] == r["new_tokens"]), None)


def merge_rows(runs: list[list[dict]]) -> list[dict]:
    """Rows of several ``--json`` files (e.g. one process per response length) as one run's: the last row per (mode,
    batch, new tokens), the fits' derived keys dropped (:func:`projected` recomputes them over all lengths). Rows of
    different devices raise ConfigError."""
    derived = ("decode_step_ms_fitted", "step_vs_bf16_fitted")
    devices = {r["device"] for rows in runs for r in rows if "device" in r}
    if len(devices) > 1:
        raise ConfigError(f"bench rollout --from: rows of {len(devices)} devices ({', '.join(sorted(devices))}); "
                          "ratios and fits compare one device's rows: pass one device's --json files")
    last = {(r["mode"], r["batch"], r["new_tokens"]): {k: v for k, v in r.items() if k not in derived}
            for rows in runs for r in rows}
    return sorted(last.values(), key=lambda r: (r["new_tokens"], r["batch"]))


def vs_bf16(rows: list[dict], r: dict) -> tuple[float | None, bool]:
    """Row ``r``'s tokens/s over bf16's at the same (batch, new tokens) -> (ratio, fitted): bf16's measured row, else
    its fitted step (``step_vs_bf16_fitted``: bf16's cache did not fit), else (None, False)."""
    base = bf16_row(rows, r)
    if base and not base.get("oom"):
        return r["tokens_per_s"] / base["tokens_per_s"], False
    return r.get("step_vs_bf16_fitted"), "step_vs_bf16_fitted" in r


def plot(rows: list[dict], path: str, title: str) -> str:
    """Against the response length, one line per (mode, batch): tokens/s over bf16's (left) and the decode step in
    ms (right). Hollow markers: a ratio against bf16's fitted step, or a mode's own fitted step where its cache did not
    fit (:func:`projected`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    keys = sorted({(r["mode"], r["batch"]) for r in rows}, key=lambda k: (k[1], k[0]))
    for i, (mode, batch) in enumerate(keys):
        rs = sorted((r for r in rows if (r["mode"], r["batch"]) == (mode, batch)), key=lambda r: r["new_tokens"])
        style = dict(color=f"C{i}", label=f"{mode}, batch {batch}", linestyle="-" if batch == keys[0][1] else "--")
        ratio = [(r["new_tokens"], *vs_bf16(rows, r)) for r in rs if not r.get("oom")]
        ratio = [x for x in ratio if x[1] is not None]
        step = [(r["new_tokens"], r["decode_step_ms"], False) if not r.get("oom")
                else (r["new_tokens"], r.get("decode_step_ms_fitted"), True) for r in rs]
        step = [x for x in step if x[1] is not None]
        for ax, pts in ((left, ratio), (right, step)):
            if not pts:
                continue
            ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], **style)
            for x, y, fitted in pts:
                ax.plot([x], [y], "o", color=style["color"], markerfacecolor="none" if fitted else style["color"])
    lengths = sorted({r["new_tokens"] for r in rows})
    for ax, label in ((left, "tokens/s vs bf16 (same batch)"), (right, "decode step ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
        ax.minorticks_off()
        ax.set_xlabel("new tokens per response")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.legend(fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def kv_read_gb(cfg, batch: int, prompt_len: int, steps: int) -> float:
    """GB of K and V a decode step reads on average over a rollout of ``steps`` new tokens (its mean length: prompt
    + steps / 2), in the cache's format (``recipe.kv_cache_bytes``: E4M3 + a scale per token and KV head, or the
    parameters' dtype)."""
    from megatron_jetrl.precision.recipe import FP8Recipe, kv_cache_bytes

    m = cfg.model
    return kv_cache_bytes(batch * (prompt_len + steps / 2), layers=m.num_layers, kv_heads=m.num_key_value_heads,
                          head_dim=m.head_dim, fp8=FP8Recipe.from_config(cfg.precision).rollout_kv_fp8,
                          elem_bytes=2 if cfg.precision.params_dtype == "bf16" else 4) / 1e9


def gemm_kernels(tuning: dict[str, dict]) -> str:
    """The decoder's tuning (``{"MxNxK": {..., "kernel"}}``, ``gemm.tune_kernels``) as the weight shapes it moved
    off cuBLAS's GEMM: ``"NxK:kernel,..."``, or ``-``."""
    return ",".join(f"{k.split('x', 1)[1]}:{v['kernel']}" for k, v in tuning.items() if v["kernel"] != "cublas") or "-"


def run_mode(cfg, batch: int, prompt_len: int, new_tokens: int, bandwidth: float, profile: int = 0,
             label: str | None = None) -> dict:
    from megatron_jetrl.distributed import init_distributed
    from megatron_jetrl.models.builder import DTYPES, build_model
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.rollout.base import SamplingParams
    from megatron_jetrl.rollout.local import LocalEngine

    init_distributed(cfg.parallel, cfg.seed)
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision),
                               DTYPES[cfg.precision.params_dtype], cfg.precision.backend)
    state.small_m_max = cfg.precision.small_m_max
    state.decode_gemm = cfg.precision.decode_gemm
    r = cfg.rollout
    # the run's rollout.* settings; the cache and graphs kept, so the timed rollout reuses the warm-up's captures
    engine = LocalEngine.from_config(model, state, cfg, pad_id=0, keep_cache=True)
    g = torch.Generator().manual_seed(cfg.seed)
    prompts = torch.randint(3, cfg.model.vocab_size, (batch, prompt_len), generator=g).tolist()
    params = SamplingParams(new_tokens, 1.0, 1.0, 0, ())
    cuda = torch.cuda.is_available()
    # first rollout: graph capture, Triton compiles; for long rollouts a shorter one on the full-length decoder
    # (the timed rollout's own captures, of buckets the warm-up did not reach, are taken out of its time). More rows
    # than the GPU holds a KV cache for (or than rollout.decode_rows) decode in waves, as the RL loop does: the
    # decoder is one wave's, and the first rollout is one wave
    size = batch
    if engine.static_decoding:
        size, _, shape = engine.wave_plan(batch, prompt_len + new_tokens)
        engine._static_decoder(*shape)
    engine.generate(prompts[:size], SamplingParams(min(new_tokens, WARMUP_TOKENS), 1.0, 1.0, 0, ()))
    first = dict(engine.last_stats)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with GpuSampler() as board:  # the clocks and power of the timed rollout (the power cap can hold clocks down)
        t0 = time.perf_counter()
        gens = engine.generate(prompts, params)
        elapsed = time.perf_counter() - t0
    st, waves = engine.last_stats, engine.metrics.get("rollout_waves", 1)
    capture = st.get("graph_capture_s", 0.0)
    wall = elapsed - capture
    steps = st.get("decode_steps", new_tokens * waves) // waves  # the waves' steps summed: each wave's
    # prefill alone, for the per-step decode time: one more prefill on the same decoder (one wave's rows)
    dec = engine._decoder
    tokens, key_pad = engine._left_pad(prompts[:size])
    if dec is not None:
        tokens, key_pad = engine.pad_rows(tokens, key_pad, dec.B)
    with torch.no_grad(), state.rollout_precision():
        _sync()
        t1 = time.perf_counter()
        if dec is not None:
            dec.prefill(tokens, key_pad)
        _sync()
        prefill = time.perf_counter() - t1 if dec is not None else float("nan")
        wbytes = weight_bytes(model)
        if profile and dec is not None:
            from megatron_jetrl.bench.timing import kernel_table

            pre = kernel_table(lambda: dec.prefill(tokens, key_pad), 1, "prefill")
            kernels = profile_steps(dec, profile, advance=max(0, new_tokens // 2 - 2 * profile - 4))
            kernels["prefill_kernel_ms"] = pre["ms_per_call"]
        else:
            kernels = {}
    tuning = dict(getattr(dec, "gemm_tuning", {}))
    # each wave: a prefill, then steps - 1 decode steps (its first token is sampled from the prefill's logits)
    decode_ms = (st.get("generate_s", elapsed) - capture - waves * prefill) / max(1, waves * (steps - 1)) * 1e3
    step_rows = dec.B if dec is not None else size  # the rows a decode step runs (a wave's, rounded up)
    bound_ms = wbytes / (bandwidth * 1e12) * 1e3
    out = {"mode": label or cfg.precision.mode, "kv_cache": cfg.precision.kv_cache, "batch": batch,
           "prompt_len": prompt_len, "new_tokens": steps,
           "device": torch.cuda.get_device_name() if cuda else "CPU",  # --from merges one device's rows only
           # what ran: exact mode decodes on the static decoder's exact kernels, or (CPU) with the trainer's forward
           "decode": "static" if engine.static_decoding else "trainer forward" if state.recipe.exact else r.decode,
           "attention": ("exact" if getattr(dec, "exact", False)
                         else "triton" if getattr(dec, "triton_attn", False) else "sdpa"),
           # the FP8 cache's V layout the decoder took (rollout.fp8_kv_v_layout)
           "v_layout": ("-" if getattr(dec, "ks", None) is None
                        else "key_major" if dec.v_key_major else "rows"),
           "cuda_graphs": bool(st.get("cuda_graphs", False)),
           # decode waves (LocalEngine.wave_plan) and the rows a step runs: the KV cache the GPU holds, decode_rows
           "waves": waves, "step_rows": step_rows,
           "rollout_s": wall, "prefill_s": prefill, "decode_step_ms": decode_ms,
           "tokens_per_s": batch * steps / wall, "capture_s_first_rollout": first.get("graph_capture_s", 0.0),
           "capture_s_timed_rollout": capture,
           # the SDPA length bucket the decoder used (rollout.decode_bucket, widened by decode_max_graphs for
           # long contexts) and the CUDA graphs it captured
           "decode_bucket": getattr(dec, "bucket", None), "graphs": len(getattr(dec, "graphs", {})),
           "weight_GB": wbytes / 1e9, "weight_bound_ms": bound_ms, "step_vs_weight_bound": decode_ms / bound_ms,
           "kv_GB_read_per_step_mean": kv_read_gb(cfg, step_rows, prompt_len, steps),
           "peak_GiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
           "small_m_max": state.small_m_max,
           # the FP8 GEMM kernel the decoder chose per linear shape (precision.decode_gemm=tune), with the times
           "gemm_tuning": tuning,
           "gemm_kernels": gemm_kernels(tuning),
           "sample_tokens": sum(len(x.output_ids) for x in gens), **board.row()}
    timed = ("kernel_ms", "graph_", "eager_", "prefill_kernel")
    for k, v in kernels.items():
        out[k if k.startswith(timed) else k.replace("top", "top_kernels")] = v
    engine = model = dec = None  # freed before the next mode (the lambdas above hold the names)
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> list[dict]:
    from megatron_jetrl.config import preset_path
    from megatron_jetrl.config import load_config

    ap = argparse.ArgumentParser(prog="jetrl bench rollout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--modes", default="bf16,jet", help=MODES_HELP)
    ap.add_argument("--batch", default="256", help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", default="1024", help="comma-separated response lengths")
    ap.add_argument("--bandwidth", type=float, default=4.2, help="TB/s for the weight-bandwidth bound")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also print the kernel time per decode step by kernel, over STEPS steps, eager and (at the mean "
                    "length) as the CUDA graph replays it, with the idle time between its kernels (CPU ops off CUDA)")
    ap.add_argument("--json")
    ap.add_argument("--plot", help="write the tokens/s-vs-bf16 and decode-step curves over the response lengths here")
    ap.add_argument("--from", dest="from_json", nargs="+", metavar="JSON",
                    help="measure nothing: report (and --plot) the rows of these --json files as one run")
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides for every mode")
    args = ap.parse_intermixed_args(argv)  # flags may follow config overrides (device_check.sh appends both)
    if args.from_json:
        if args.json and any(os.path.abspath(args.json) == os.path.abspath(f) for f in args.from_json):
            ap.error(f"--json {args.json} is one of the --from files: name another file for the merged rows")
        runs = []
        for f in args.from_json:
            with open(f) as fh:
                runs.append(json.load(fh))
        try:
            rows = merge_rows(runs)
        except ConfigError as e:
            ap.error(str(e))
        device = next((r["device"] for r in rows if "device" in r), "unknown device")
        header = f"# {device}: {len(rows)} rows of {', '.join(os.path.basename(f) for f in args.from_json)}"
        return report(rows, header, args.json, args.plot)
    rows = []
    for new_tokens in map(int, args.new_tokens.split(",")):
        for batch in map(int, args.batch.split(",")):
            for mode in args.modes.split(","):
                cfg = load_config(preset_path(args.preset), [*args.overrides, *mode_overrides(mode)])
                try:
                    rows.append(run_mode(cfg, batch, args.prompt_len, new_tokens, args.bandwidth, args.profile, mode))
                except (torch.OutOfMemoryError, ConfigError) as e:  # not one row's KV cache fits the GPU's free
                    # memory (the engine's ConfigError; more rows than fit decode in waves), or an allocation fails;
                    # the row says so and the other modes run
                    why = str(e).splitlines()[0] if isinstance(e, ConfigError) else "out of memory"
                    rows.append({"mode": mode, "batch": batch, "new_tokens": new_tokens, "oom": True, "why": why,
                                 "kv_GB_read_per_step_mean": kv_read_gb(cfg, batch, args.prompt_len, new_tokens)})
                    gc.collect()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                print({k: v for k, v in rows[-1].items() if not k.startswith("top")}, flush=True)
                dump_json(args.json, rows)  # after every row: a run stopped by a time limit keeps what it measured
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    if torch.cuda.is_available():  # what rollout.fp8_kv_v_layout=auto decides by
        from megatron_jetrl.rollout.decode import hbm_gbps_per_sm

        bw = hbm_gbps_per_sm(torch.device("cuda", torch.cuda.current_device()))
        dev += f" ({bw:.1f} GB/s of memory bandwidth per SM)" if bw else " (memory clock not reported)"
    return report(rows, f"# {dev} torch {torch.__version__}, preset {args.preset}, prompt {args.prompt_len}, "
                        f"{args.new_tokens} new tokens", args.json, args.plot)


def report(rows: list[dict], header: str, json_path: str | None, plot_path: str | None) -> list[dict]:
    """Print ``rows`` as the table (tokens/s vs bf16 at the same batch and length), the fit over response lengths
    and the projections it makes (written into the rows, then to ``json_path``); ``plot_path``: :func:`plot`."""
    print(header)
    fits = kv_fit(rows)
    projected(rows, fits)
    dump_json(json_path, rows)
    shown = []
    for r in rows:
        if r.get("oom"):
            fitted = r.get("decode_step_ms_fitted")
            shown.append({"mode": r["mode"], "batch": r["batch"], "new_tokens": r["new_tokens"],
                          "rollout_s": "out of memory" if r["why"] == "out of memory" else "does not fit the GPU",
                          "decode_step_ms": f"{fitted:.2f} fitted" if fitted else "-",
                          "kv_GB_read_per_step_mean": r["kv_GB_read_per_step_mean"]})
            continue
        ratio, fitted = vs_bf16(rows, r)
        vs = "-" if ratio is None else f"{ratio:.3f}" + (" (step vs fitted)" if fitted else "")
        shown.append({**r, "tokens/s vs bf16": vs})
    cols = ["mode", "kv_cache", "batch", "new_tokens", "waves", "step_rows", "attention", "v_layout", "cuda_graphs",
            "rollout_s", "prefill_s",
            "decode_step_ms", "tokens_per_s", "tokens/s vs bf16", "weight_GB", "weight_bound_ms", "step_vs_weight_bound",
            "kv_GB_read_per_step_mean", "decode_bucket", "graphs", "capture_s_first_rollout", "peak_GiB", "small_m_max",
            "gemm_kernels", "sm_MHz", "power_W", "power_capped_share"]
    cols += [c for c in ("prefill_kernel_ms", "kernel_ms_per_step", "kernel_ms_per_step_at_mean",
                         "graph_kernel_ms_per_step_at_mean", "graph_idle_ms_per_step_at_mean", "graph_step_ms_at_mean",
                         "graph_host_ms_at_mean", "graph_gpu_ms_at_mean", "graph_between_ms_at_mean",
                         "graph_rested_first_ms_at_mean", "graph_rested_last_ms_at_mean", "eager_gpu_ms_at_mean")
             if all(c in r for r in rows if not r.get("oom"))]
    print_table(shown, cols)
    if fits:  # two or more response lengths: what a step costs besides its KV read, and the rate of that read
        print("# decode step = base + KV read per step / rate, least squares over the response lengths")
        print_table([{**f, "base_ms": f"{f['base_ms']:.2f}", "kv_TBps": f"{f['kv_TBps']:.2f}" if f["kv_TBps"] else "-"}
                     for f in fits],
                    ["mode", "batch", "points", "base_ms", "kv_TBps"])
    if plot_path:
        print("# wrote", plot(rows, plot_path, header.lstrip("# ")))
    return rows


if __name__ == "__main__":
    main()
