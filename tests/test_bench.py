"""The benchmark harnesses run on CPU (the numbers they print there are not claims)."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_step_harness(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "bench", "step", "--preset", "tiny", "--steps", "1",
                          "--warmup", "0", "--plot", str(tmp_path / "phases.png"), "--json", str(tmp_path / "rows.json"),
                          "rollout.prompts_per_step=2", "algo.pad_tokens_to=64"],
                         env=dict(os.environ, PYTHONPATH=REPO), cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.load(open(tmp_path / "rows.json"))
    assert [r["mode"] for r in rows] == ["bf16", "fp8_rollout", "jet"]
    for r in rows:
        assert abs(r["step"] - sum(r[p] for p in ("rollout", "logprob", "train", "weight_sync"))) < 1e-9
        assert 0 <= r["requant_handover_share"] < 1
        assert r["train_seq_len"] > 0 and 16 * r["train_seq_len"] % 64 == 0  # 16 sequences per micro-batch
        assert 0 < r["train_fwd_bwd"] + r["train_optimizer"] <= r["train"]
        assert r["reward_std"] > 0.1  # the hash reward: non-zero advantages, a backward on real gradients
    assert rows[0]["requant"] == 0 and rows[2]["requant"] > 0  # bf16 quantizes nothing
    assert "step speedup vs bf16" in out.stdout and "train_fwd_bwd vs bf16" in out.stdout
    assert os.path.getsize(tmp_path / "phases.png") > 10_000


def test_bench_rollout_harness(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "bench", "rollout", "--preset", "tiny", "--batch", "3,5",
                          "--new-tokens", "24", "--prompt-len", "4", "--profile", "2", "--json", str(tmp_path / "rows.json")],
                         env=dict(os.environ, PYTHONPATH=REPO), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.load(open(tmp_path / "rows.json"))
    assert [(r["mode"], r["batch"]) for r in rows] == [("bf16", 3), ("jet", 3), ("bf16", 5), ("jet", 5)]
    for r in rows:  # no stop tokens: every row runs to the end
        assert r["new_tokens"] == 24 and r["sample_tokens"] == 24 * r["batch"] and not r["cuda_graphs"]
        assert r["attention"] == "sdpa" and r["device"] == "CPU"  # what ran, and where, named in every row
        assert r["decode_bucket"] == 64 and r["graphs"] == 0  # the default bucket; no CUDA graphs on CPU
        assert r["rollout_s"] > r["prefill_s"] > 0 and r["decode_step_ms"] > 0
    # the tiny preset keeps fp32 parameters: its FP8 linears read 1 byte + scales instead of 4
    assert rows[1]["weight_GB"] < rows[0]["weight_GB"]
    assert "tokens/s vs bf16" in out.stdout
    # --profile: the prefill and the decode step right after it and at the rollout's mean length (4 + 12 keys)
    assert out.stdout.count("decode step at 6 keys") == 4 and out.stdout.count("decode step at 16 keys") == 4
    assert out.stdout.count("prefill:") == 4
    assert all(r["kernel_ms_per_step"] > 0 and r["kernel_ms_per_step_at_mean"] > 0 and r["graph_step_ms_at_mean"] > 0
               and r["prefill_kernel_ms"] > 0 for r in rows)
    # the host's launch time within the wall time; the GPU's back-to-back time only on CUDA
    assert all(0 < r["graph_host_ms_at_mean"] <= r["graph_step_ms_at_mean"] and r["eager_host_ms_at_mean"] > 0
               and math.isnan(r["graph_gpu_ms_at_mean"]) for r in rows)
    assert all(r["sm_MHz"] is None and r["power_capped_share"] is None for r in rows)  # no nvidia-smi on the CPU


def test_bench_rollout_decodes_in_waves_as_the_rl_loop_does(tmp_path):
    """Rows past ``rollout.decode_rows`` (or past what the GPU holds a KV cache for) decode in waves in the benchmark
    as in the RL loop: each row reports its waves, the rows a step runs, each wave's new tokens, the per-step time
    and KV bytes of one wave's steps; the fit over lengths leaves such rows out (a wave's step, not the batch's)."""
    import megatron_jetrl.bench.rollout as br
    from megatron_jetrl.config import load_config, preset_path

    rows = br.main(["--preset", "tiny", "--batch", "20", "--new-tokens", "12,20", "--prompt-len", "4",
                    "--modes", "bf16,jet+fp8kv", "rollout.decode_rows=8", "--json", str(tmp_path / "rows.json")])
    assert [(r["mode"], r["new_tokens"]) for r in rows] == [("bf16", 12), ("jet+fp8kv", 12), ("bf16", 20),
                                                             ("jet+fp8kv", 20)]
    cfg = load_config(preset_path("tiny"), ["precision.mode=jet", "precision.kv_cache=fp8"])
    for r in rows:  # 20 rows within 8: waves of 8, 8 and 4 on one 8-row decoder
        assert (r["waves"], r["step_rows"], r["sample_tokens"]) == (3, 8, 20 * r["new_tokens"])
        assert r["rollout_s"] > 3 * r["prefill_s"] > 0 and r["decode_step_ms"] > 0
    assert rows[3]["kv_GB_read_per_step_mean"] == pytest.approx(br.kv_read_gb(cfg, 8, 4, 20))
    assert br.kv_fit(rows) == []


def test_bench_rollout_records_a_mode_whose_cache_does_not_fit(tmp_path, monkeypatch, capsys):
    """A mode the engine refuses (its ConfigError: not one row's KV cache fits the GPU's free memory) or whose
    allocation fails becomes a row saying so; the other modes still run and are compared, and the fit leaves those
    rows out."""
    import megatron_jetrl.bench.rollout as br
    from megatron_jetrl.errors import ConfigError
    from megatron_jetrl.rollout.decode import cache_fit_problem

    line = cache_fit_problem(150 << 30, 80 << 30, 256, 4224, fp8=False)

    def fake(cfg, batch, prompt_len, new_tokens, bandwidth, profile=0, label=None):
        if label == "bf16":
            raise ConfigError(line)
        if label == "jet":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"mode": label, "batch": batch, "new_tokens": new_tokens, "tokens_per_s": 1.0, "decode_step_ms": 9.0,
                "kv_GB_read_per_step_mean": 1.0}

    monkeypatch.setattr(br, "run_mode", fake)
    rows = br.main(["--preset", "tiny", "--batch", "256", "--new-tokens", "4096", "--modes", "jet+fp8kv,bf16,jet",
                    "--json", str(tmp_path / "rows.json")])
    assert [(r["mode"], r.get("oom", False)) for r in rows] == [("jet+fp8kv", False), ("bf16", True), ("jet", True)]
    assert rows[1]["why"] == line and rows[2]["why"] == "out of memory"
    out = capsys.readouterr().out
    assert "| bf16 | - | 256 | 4096 | - | - | - | - | - | does not fit the GPU |" in out
    assert "| jet | - | 256 | 4096 | - | - | - | - | - | out of memory |" in out
    assert json.load(open(tmp_path / "rows.json"))[1]["why"] == line


def _fitted_rollout(cfg, batch, prompt_len, new_tokens, bandwidth, profile=0, label=None):
    """``bench rollout``'s ``run_mode`` as a line: step = base + KV read / rate (bf16 5.4 ms + KV at 4.6 TB/s, the
    others 4.1 + KV at 4.5); bf16's cache refused past 2,048 new tokens."""
    import megatron_jetrl.bench.rollout as br
    from megatron_jetrl.errors import ConfigError

    kv = br.kv_read_gb(cfg, batch, prompt_len, new_tokens)
    if label == "bf16" and new_tokens > 2048:
        raise ConfigError("rollout: the KV cache does not fit")
    base, rate = (5.4, 4.6) if label == "bf16" else (4.1, 4.5)
    step = base + kv / rate
    return {"mode": label, "device": "NVIDIA H200", "batch": batch, "new_tokens": new_tokens, "tokens_per_s": batch * 1e3 / step,
            "decode_step_ms": step, "kv_GB_read_per_step_mean": kv}


def test_bench_rollout_projects_a_refused_mode_from_its_fit(tmp_path, monkeypatch, capsys):
    """bf16 measured at two lengths and refused at a third (its cache does not fit) gets the fitted step there,
    from the KV bytes it would have read; a mode measured at that length is compared with the fitted bf16 step."""
    import megatron_jetrl.bench.rollout as br
    from megatron_jetrl.precision.recipe import kv_cache_bytes

    monkeypatch.setattr(br, "run_mode", _fitted_rollout)
    rows = br.main(["--preset", "tiny", "--batch", "256", "--new-tokens", "1024,2048,4096", "--modes",
                    "bf16,jet+fp8kv", "--prompt-len", "128", "--json", str(tmp_path / "rows.json")])
    refused = rows[4]
    assert (refused["mode"], refused["new_tokens"], refused["oom"]) == ("bf16", 4096, True)
    # the tiny preset's cache (fp32 parameters, 4 bytes an element) at the rollout's mean length: 128 + 4096 / 2
    from megatron_jetrl.config import load_config, preset_path

    m = load_config(preset_path("tiny"), []).model
    want = kv_cache_bytes(256 * (128 + 2048), layers=m.num_layers, kv_heads=m.num_key_value_heads,
                          head_dim=m.head_dim, fp8=False, elem_bytes=4) / 1e9
    assert refused["kv_GB_read_per_step_mean"] == pytest.approx(want)
    assert refused["decode_step_ms_fitted"] == pytest.approx(5.4 + want / 4.6)
    fp8 = rows[5]
    assert fp8["step_vs_bf16_fitted"] == pytest.approx((5.4 + want / 4.6) / fp8["decode_step_ms"])
    assert "step_vs_bf16_fitted" not in rows[1]  # measured bf16 at 1K: compared as measured
    out = capsys.readouterr().out
    assert f"| bf16 | - | 256 | 4096 | - | - | - | - | - | does not fit the GPU | - | {5.4 + want / 4.6:.2f} fitted |" in out
    assert f"{fp8['step_vs_bf16_fitted']:.3f} (step vs fitted)" in out
    assert json.load(open(tmp_path / "rows.json"))[4]["decode_step_ms_fitted"] == pytest.approx(5.4 + want / 4.6)


def test_bench_rollout_merges_runs_and_plots(tmp_path, monkeypatch, capsys):
    """``--from``: the rows of two processes (1K and 2K new tokens in one, 4K alone in the other, where bf16's cache
    does not fit and no fit can project it) reported as one run: the fit over all three lengths projects bf16 at 4K
    and compares jet + FP8 KV there; ``--plot`` draws the curves; ``--json`` may not overwrite an input."""
    import megatron_jetrl.bench.rollout as br

    monkeypatch.setattr(br, "run_mode", _fitted_rollout)
    common = ["--preset", "tiny", "--batch", "64", "--modes", "bf16,jet+fp8kv", "--prompt-len", "128"]
    short, long, merged = (str(tmp_path / f"{n}.json") for n in ("short", "long", "merged"))
    br.main([*common, "--new-tokens", "1024,2048", "--json", short])
    alone = br.main([*common, "--new-tokens", "4096", "--json", long])
    assert alone[0]["oom"] and "decode_step_ms_fitted" not in alone[0] and "step_vs_bf16_fitted" not in alone[1]
    capsys.readouterr()
    rows = br.main(["--from", short, long, "--plot", str(tmp_path / "rollout.png"), "--json", merged])
    assert [(r["mode"], r["new_tokens"]) for r in rows] == [(m, n) for n in (1024, 2048, 4096)
                                                            for m in ("bf16", "jet+fp8kv")]
    bf16, fp8 = rows[4], rows[5]
    assert bf16["decode_step_ms_fitted"] == pytest.approx(5.4 + bf16["kv_GB_read_per_step_mean"] / 4.6)
    assert fp8["step_vs_bf16_fitted"] == pytest.approx(bf16["decode_step_ms_fitted"] / fp8["decode_step_ms"])
    assert br.vs_bf16(rows, rows[1]) == (pytest.approx(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]), False)
    out = capsys.readouterr().out
    assert f"{fp8['step_vs_bf16_fitted']:.3f} (step vs fitted)" in out and "rollout.png" in out
    assert "# NVIDIA H200: 6 rows of short.json, long.json" in out  # the plot's title
    assert os.path.getsize(tmp_path / "rollout.png") > 10_000
    assert json.load(open(merged))[4]["decode_step_ms_fitted"] == pytest.approx(bf16["decode_step_ms_fitted"])
    before = open(long).read()
    with pytest.raises(SystemExit):
        br.main(["--from", short, long, "--json", long])
    assert "is one of the --from files" in capsys.readouterr().err and open(long).read() == before
    other = str(tmp_path / "other.json")  # another GPU's rows: not merged
    json.dump([{**r, "device": "NVIDIA H100 80GB HBM3"} for r in json.load(open(long))], open(other, "w"))
    json.dump([{**r, "device": "NVIDIA H200"} for r in json.load(open(short))], open(short, "w"))
    with pytest.raises(SystemExit):
        br.main(["--from", short, other])
    assert "rows of 2 devices" in capsys.readouterr().err


def test_kv_fit_recovers_base_and_rate():
    """``bench rollout``'s fit over response lengths: steps built as base + KV / rate give back base and rate, per
    (mode, batch); a mode at one length or out of memory gets no line."""
    from megatron_jetrl.bench.rollout import kv_fit

    rows = [{"mode": m, "batch": 64, "new_tokens": n, "kv_GB_read_per_step_mean": kv, "decode_step_ms": base + kv / rate}
            for m, base, rate, per in (("bf16", 5.42, 4.57, 1.0), ("jet+fp8kv", 4.09, 4.50, 0.516))
            for n, kv in ((4096, 18.3 * per), (8192, 35.4 * per))]
    rows += [{"mode": "jet", "batch": 64, "new_tokens": 4096, "kv_GB_read_per_step_mean": 18.3, "decode_step_ms": 7.8},
             {"mode": "jet", "batch": 64, "new_tokens": 8192, "oom": True}]
    fits = {f["mode"]: f for f in kv_fit(rows)}
    assert sorted(fits) == ["bf16", "jet+fp8kv"]
    assert fits["bf16"]["base_ms"] == pytest.approx(5.42) and fits["bf16"]["kv_TBps"] == pytest.approx(4.57)
    assert fits["jet+fp8kv"]["base_ms"] == pytest.approx(4.09) and fits["jet+fp8kv"]["kv_TBps"] == pytest.approx(4.50)
    assert fits["bf16"]["points"] == 2
    noisy = [{**r, "decode_step_ms": 10.0 - r["kv_GB_read_per_step_mean"] / 100} for r in rows if r["mode"] == "bf16"]
    assert kv_fit(noisy)[0]["kv_TBps"] is None


def test_step_wall_times_the_rested_steps_over_the_launched_steps_keys(monkeypatch):
    """``bench rollout --profile`` compares the graph's step as the rollout launches it with the same steps on a rested
    board: both runs decode from the same position (a step's time depends on its length: over the FP8 cache a sawtooth
    of period 128 keys), the decoder left where the first run ended. CUDA's events and sleep stand in for the GPU's."""
    from megatron_jetrl.bench import rollout as bench_rollout

    class Event:
        clock = 0.0

        def __init__(self, **_):
            self.t = 0.0

        def record(self):
            Event.clock += 1.0
            self.t = Event.clock

        def elapsed_time(self, other):
            return other.t - self.t

        def query(self):
            return False

        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda *a: None)

    class Decoder:  # the StaticDecoder's position interface
        def __init__(self, pos):
            self.position, self.seen = pos, []

        def seek(self, pos):
            assert 0 < pos <= self.position
            self.position = pos

        def step(self, ids):
            self.seen.append(self.position)
            self.position += 1

    dec = Decoder(700)
    out = bench_rollout.step_wall(dec, torch.zeros(4, dtype=torch.long), 8)
    assert dec.seen == list(range(700, 708)) * 2 and dec.position == 708, dec.seen
    assert out["gpu_ms"] == 1.0 and out["rested_first_ms"] == out["rested_last_ms"] == 1.0, out


def test_static_decoder_seek_moves_the_next_steps_position():
    """``StaticDecoder.seek`` moves the next step back to an earlier position (host and device copies), and refuses
    one past the current position or before the first key."""
    from megatron_jetrl.rollout.decode import StaticDecoder

    dec = StaticDecoder.__new__(StaticDecoder)
    dec.pos, dec._host_pos = torch.tensor([40]), 40
    dec.seek(33)
    assert dec.position == 33 and int(dec.pos) == 33
    for bad in (34, 0):
        with pytest.raises(ValueError, match="StaticDecoder.seek: position"):
            dec.seek(bad)


def test_bench_rollout_names_the_shapes_the_tuning_moved_off_cublas():
    """`bench rollout`'s gemm_kernels column: the weight shapes the decoder's tuning gave another kernel than cuBLAS's."""
    from megatron_jetrl.bench.rollout import gemm_kernels

    tuning = {"88x6144x4096": {"cublas_us": 22.7, "small_m_us": 18.6, "kernel": "small_m"},
              "88x28672x4096": {"cublas_us": 55.9, "small_m_us": 56.2, "kernel": "cublas"},
              "88x4096x14336": {"cublas_us": 49.1, "deepgemm_us": 30.0, "small_m_us": 32.4, "kernel": "deepgemm"}}
    assert gemm_kernels(tuning) == "6144x4096:small_m,4096x14336:deepgemm"
    assert gemm_kernels({}) == "-" and gemm_kernels({"88x28672x4096": tuning["88x28672x4096"]}) == "-"


def test_kernel_table_on_cpu():
    """The profiler table the benchmarks print (--profile): per-call times of the ops, most first."""
    import torch

    from megatron_jetrl.bench.timing import kernel_table

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    out = kernel_table(lambda: (a @ b).relu(), 3, "matmul+relu")
    names = [n for n, _, _ in out["top"]]
    assert any("mm" in n for n in names) and any("relu" in n for n in names)
    times = [ms for _, ms, _ in out["top"]]
    assert times == sorted(times, reverse=True) and out["ms_per_call"] >= sum(times) - 1e-9 > 0


def test_idle_gaps_locates_the_gpu_idle_time_between_kernels():
    """The idle time between a profiled run's consecutive kernels (``--profile``'s graph-replayed step: its wall
    time minus its kernels' time, by where it sits), from the profiler's trace: per call, by kernel pair, most
    first; overlapping kernels and the host's gaps between calls (over 1 ms) count nothing, CPU ops are not kernels."""
    from megatron_jetrl.bench.timing import idle_gaps

    def trace(path):  # two calls of: norm (10 us) | 4 us idle | gemm (20 us) | 1 us idle | attn (30 us, a short
        # kernel beside it) | 2 us idle | sum, then 5 ms of host gap
        ev = []
        for t0 in (0, 5000):
            ev += [{"cat": "kernel", "name": "norm", "ts": t0, "dur": 10}, {"cat": "kernel", "name": "gemm", "ts": t0 + 14,
                   "dur": 20}, {"cat": "kernel", "name": "attn", "ts": t0 + 35, "dur": 30},
                   {"cat": "kernel", "name": "overlapped", "ts": t0 + 40, "dur": 5},
                   {"cat": "kernel", "name": "sum", "ts": t0 + 67, "dur": 3},
                   {"cat": "cpu_op", "name": "aten::mm", "ts": t0 + 70, "dur": 100}]
        with open(path, "w") as f:
            json.dump({"traceEvents": ev}, f)

    out = idle_gaps(type("Prof", (), {"export_chrome_trace": staticmethod(trace)})(), reps=2)
    assert abs(out["idle_ms_per_call"] - 0.007) < 1e-12, out
    assert out["top"] == [("norm -> gemm", 0.004, 1), ("attn -> sum", 0.002, 1), ("gemm -> attn", 0.001, 1)], out["top"]


def test_copy_sources_names_the_calling_frame_and_the_backward_node():
    """bench train --copies: a forward copy is attributed to the Python line that made it, a backward
    copy to its autograd node; ops that do not copy are not listed."""
    import torch

    from megatron_jetrl.bench.timing import copy_sources

    x = torch.randn(64, 8, 256, requires_grad=True)

    def step():
        y = x.transpose(0, 1).contiguous()  # the copy under test
        z = (y * 2).to(torch.float64)  # a cast: copy_ too
        w = x.reshape(64 * 8, 256)  # a view: no copy
        (z.sum() + w.sum()).backward()

    rows = copy_sources(step, "test")
    where = [r["where"] for r in rows]
    assert any("test_bench.py" in w and "step" in w for w in where), where
    assert any("ToCopyBackward" in w for w in where), where  # the cast's backward copies back to fp32
    assert sum(r["count"] for r in rows) >= 3 and all(r["ms"] > 0 for r in rows)
    assert [r["ms"] for r in rows] == sorted((r["ms"] for r in rows), reverse=True)


def test_gpu_sampler_reads_clocks_power_and_the_power_cap():
    """The board telemetry the rollout benchmark records: means over nvidia-smi's sample lines, the first two
    dropped, the power cap's share of samples from its Active / Not Active column, unreadable lines skipped."""
    from megatron_jetrl.bench.timing import GpuSampler

    smp = GpuSampler()
    smp.parse("1980, 300.0, 700.00, Not Active\n1980, 310.0, 700.00, Not Active\n"
              "1980, 650.5, 700.00, Not Active\n[N/A], 690.0, 700.00, Active\n"
              "1755, 699.5, 700.00, Active\n1830, 698.0, 700.00, Active\n")
    assert smp.row() == {"sm_MHz": (1980 + 1755 + 1830) / 3, "power_W": (650.5 + 699.5 + 698.0) / 3,
                         "power_limit_W": 700.0, "power_capped_share": 2 / 3}
    empty = GpuSampler()
    empty.parse("Field \"clocks_event_reasons.sw_power_cap\" is not a valid field to query.\n")
    assert set(empty.row().values()) == {None}
