"""The RL loop pieces that need the model: KV-cache generation, train/resume, killed runs."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_jetrl.rollout.base import SamplingParams
from megatron_jetrl.rollout.local import LocalEngine
from tests.common import first_kv_difference, run_interpreted
from tests.hf_models import make_hf_model
from tests.workers import build_loaded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("mode,model_type,decode,max_graphs", [
    ("bf16", "qwen3", "static", 32), ("jet", "qwen3", "static", 32), ("jet", "qwen2", "static", 32),
    ("jet", "llama", "static", 32), ("jet", "qwen3", "static", 2), ("bf16", "qwen3", "megatron", 32),
    ("jet", "qwen3", "megatron", 32)])
def test_kv_cache_generation_equals_full_reforward(mode, model_type, decode, max_graphs, tmp_path, megatron_single):
    """Both decoders (the static one with a 4-token bucket, so the steps cross bucket edges) give
    the tokens of a full re-forward of the growing sequence; with ``max_graphs=2`` the static decoder
    widens its bucket to a multiple of 4 with at most 2 buckets over its cache, and still does."""
    make_hf_model(model_type, str(tmp_path), seed=11)
    _, model, state = build_loaded(str(tmp_path), [f"precision.mode={mode}"])
    engine = LocalEngine(model, state, pad_id=0, vocab_size=384, decode=decode, bucket=4, max_graphs=max_graphs)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (5, 9, 7)]  # left padding
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    model.eval()
    for prompt, gen in zip(prompts, gens):
        seq = list(prompt)
        with torch.no_grad(), state.rollout_precision():
            for _ in range(8):
                t = torch.tensor([seq])
                logits = model(t, torch.arange(len(seq))[None], None)[0, -1]
                seq.append(int(logits.argmax()))
        assert gen.output_ids == seq[len(prompt):]
        assert len(gen.output_logprobs) == 8 and all(lp <= 0 for lp in gen.output_logprobs)
    if decode == "static":  # the buckets the decoder used: multiples of 4, at most max_graphs of them
        dec = engine._decoder
        n = -(-dec.L // dec.bucket)
        assert dec.bucket % 4 == 0 and n <= max_graphs and (dec.bucket == 4) is (-(-dec.L // 4) <= max_graphs)


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_fp8_kv_cache_holds_the_trainers_keys_and_values(model_type, tmp_path, megatron_single):
    """``precision.kv_cache=fp8`` (jet): after the static decoder's prefill of left-padded prompts of different
    lengths, each row's cache columns of the first layer hold exactly ``quant.quantize_kv``'s E4M3 bytes and scales
    of the keys (after RoPE) and values the training forward computes for that sequence alone (each row's RoPE
    positions count from its own first token: a shifted rotation would round to other E4M3 values); in every layer
    the cache holds the rule's bytes of the K/V the decoder computed (deeper layers' K/V differ from the trainer's
    in the last bits: attention over pad-masked and unpadded keys, and jet's activation quantizer can turn such a
    bit into an E4M3 step, with a BF16 cache too). The decoder's
    attention outputs over its FP8 cache, and its logits over 8 decode steps (4-key buckets: bucket edges crossed),
    equal the training forward's (attention over the quantize-dequantized K/V) on the same tokens, over the keys
    whose bytes in every layer equal the rule's on the trainer's K/V (at least half the logits; past a key where
    the rule turned a last-bit difference into an E4M3 step the two attend over different values), as closely as
    the two agree with an unquantized cache (fp32 model: ~1e-6, or an activation's E4M3 step where jet's quantizer
    turned a last-bit difference into one: a floor of 2e-3); in the first layer, whose inputs are the same bytes, to
    1e-5."""
    from megatron_jetrl.models.spec import SDPAttention
    from megatron_jetrl.precision.quant import quantize_kv

    make_hf_model(model_type, str(tmp_path), seed=5)
    g = torch.Generator().manual_seed(0)
    lens, steps = (5, 11, 8), 8
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in lens]
    nxt = torch.randint(3, 384, (len(lens), steps), generator=g)
    err, compared = {}, {}
    for kv in ("bf16", "fp8"):
        _, model, state = build_loaded(str(tmp_path), ["precision.mode=jet", f"precision.kv_cache={kv}"])
        engine = LocalEngine(model, state, pad_id=0, vocab_size=384, bucket=4)
        tokens, key_pad = engine._left_pad(prompts)
        dec = engine._static_decoder(len(prompts), 24)
        tokens, key_pad = engine.pad_rows(tokens, key_pad, dec.B)
        seen, dec_out = [], []
        hooks = [m.register_forward_hook(lambda m, a, out: seen.append((a[1], a[2], out)))
                 for m in model.modules() if isinstance(m, SDPAttention)]
        orig, orig_write, written = dec._attention, dec._write_kv, []
        dec._attention = lambda *a: dec_out.append(orig(*a)) or dec_out[-1]  # (output [S, b, heads*d], xq)
        dec._write_kv = lambda *a: written.append((a[4], a[5])) or orig_write(*a)  # the RoPE'd k, v [S, b, g, d]
        model.eval()
        with torch.no_grad(), state.rollout_precision():
            logits = [dec.prefill(tokens, key_pad)[: len(lens)].clone()]
            kv_after_prefill = [t.clone() for t in (dec.k, dec.v)] + ([dec.ks.clone(), dec.vs.clone()] if kv == "fp8" else [])
            dec._attention = orig
            pad = torch.zeros(dec.B - len(lens), dtype=torch.long)
            for t in range(steps):
                logits.append(dec.step(torch.cat([nxt[:, t], pad]))[: len(lens)].clone())
            per_row, full = [], []
            for r, p in enumerate(prompts):  # the trainer's forward of each sequence alone (positions 0..n-1)
                seen.clear()
                seq = torch.tensor([p + nxt[r].tolist()])
                full.append(model(seq, torch.arange(seq.shape[1])[None], None)[0, len(p) - 1:, :384])
                per_row.append(list(seen))
        for h in hooks:
            h.remove()
        P, e = tokens.shape[1], 0.0
        k_c, v_c, *scales = kv_after_prefill
        for li, (k, v) in enumerate(written[: len(per_row[0])]):  # the prefill's writes: the rule's bytes, every layer
            k, v = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
            if kv == "bf16":
                assert torch.equal(k_c[li, :, :, :P], k) and torch.equal(v_c[li, :, :, :P], v)
                continue
            (kq, ks), (vq, vs) = quantize_kv(k, state.recipe), quantize_kv(v, state.recipe)
            assert torch.equal(k_c[li, :, :, :P].view(torch.uint8), kq.view(torch.uint8))
            assert torch.equal(v_c[li, :, :, :P].view(torch.uint8), vq.view(torch.uint8))
            assert torch.equal(scales[0][li, :, :, :P], ks) and torch.equal(scales[1][li, :, :, :P], vs)
        for r, n in enumerate(lens):
            cols = slice(P - n, P)
            agree = n + steps  # the trainer's first position whose K/V bytes differ from the cache's (FP8 KV)
            if kv == "fp8":  # the cache after the decode steps against the rule's bytes of the trainer's K/V
                ours = [t[:, r, :, P - n:P + steps] for t in (dec.k, dec.v, dec.ks, dec.vs)]
                kq, vq = ([quantize_kv(t[i][:, 0].transpose(0, 1), state.recipe) for t in per_row[r]] for i in (0, 1))
                theirs = [torch.stack([x[i] for x in layers]) for i in (0, 1) for layers in (kq, vq)]  # K, V, scales
                agree = first_kv_difference(ours, theirs)
            for li, (k, v, out) in enumerate(per_row[r]):  # k, v [n + steps, 1, groups, d] (after RoPE)
                j = min(n, agree)  # the prompt's positions whose keys and values are the same bytes so far
                if j:
                    e = max(e, (dec_out[li][0][cols, r][:j] - out[:j, 0]).abs().max().item())
                if li > 0:
                    continue
                assert (dec_out[0][0][cols, r] - out[:n, 0]).abs().max() < 1e-5  # the same q, K and V in the first layer
                k, v = k[:n, 0].transpose(0, 1), v[:n, 0].transpose(0, 1)
                if kv == "bf16":
                    assert torch.equal(k_c[li, r, :, cols], k) and torch.equal(v_c[li, r, :, cols], v), r
                    continue
                (kq, ks), (vq, vs) = quantize_kv(k, state.recipe), quantize_kv(v, state.recipe)
                assert torch.equal(k_c[li, r, :, cols].view(torch.uint8), kq.view(torch.uint8)), r
                assert torch.equal(v_c[li, r, :, cols].view(torch.uint8), vq.view(torch.uint8)), r
                assert torch.equal(scales[0][li, r, :, cols], ks) and torch.equal(scales[1][li, r, :, cols], vs), r
            shown = [t for t in range(steps + 1) if n + t - 1 < agree]  # logits over keys of equal bytes only
            compared[kv] = compared.get(kv, 0) + len(shown)
            e = max([e] + [(logits[t][r] - full[r][t]).abs().max().item() for t in shown])
        err[kv] = e
    # jet's activation quantizer can turn a last-bit difference into an E4M3 step in either run (the BF16 cache's
    # logits moved by up to 6.4e-4 here): the floor is a few such steps, far below a K/V byte's 2e-2
    assert err["fp8"] <= max(4 * err["bf16"], 2e-3), err
    assert compared["bf16"] == len(lens) * (steps + 1) and 2 * compared["fp8"] >= compared["bf16"], compared


def test_wide_bucket_bounds_the_graphs():
    """``rollout.decode_max_graphs``: the decoder's bucket is the smallest multiple of ``decode_bucket`` that
    leaves at most that many buckets over the cache (0: no limit)."""
    from megatron_jetrl.rollout.decode import wide_bucket

    assert wide_bucket(64, 1152, 32) == 64 and wide_bucket(64, 32768, 32) == 1024 and wide_bucket(64, 32768, 0) == 64
    for base in (1, 16, 64, 256):
        for L in (1, 63, 64, 65, 1152, 4097, 32769, 131072):
            for g in (1, 2, 7, 32):
                b = wide_bucket(base, L, g)
                assert b % base == 0 and -(-L // b) <= g, (base, L, g, b)
                assert b == base or -(-L // (b - base)) > g, (base, L, g, b)  # the smallest such multiple


def test_static_decoder_samples_like_megatron_decode(tmp_path, megatron_single):
    """Sampling (temperature 1, same seed): the static decoder and megatron-core's decode draw the
    same tokens with the same logprobs (fp32 on CPU, jet), across two rollouts that reuse the decoder.
    The two attentions sum in different orders (SDPA over a masked key bucket vs megatron's exact
    length), and the FP8 activation quantization turns such last-bit fp32 differences into a whole
    E4M3 step when an element sits on a rounding boundary: on this machine one row of the second
    rollout takes that step (1e-2 in logprob from its 5th token on, same tokens) on one CPU and not on
    another. So: every token equal, 90% of logprobs equal to 1e-4, none off by more than 0.05."""
    make_hf_model("qwen3", str(tmp_path), seed=5)
    _, model, state = build_loaded(str(tmp_path), ["precision.mode=jet"])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (3, 6, 6, 2)]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=(7,))
    runs = {}
    for decode in ("static", "megatron"):
        engine = LocalEngine(model, state, pad_id=0, vocab_size=384, decode=decode, seed=3, bucket=8)
        runs[decode] = [engine.generate(prompts, params) for _ in range(2)]
    assert engine.last_stats == {}  # megatron's decode keeps no static-decoder stats
    diffs = []
    for a_run, b_run in zip(runs["static"], runs["megatron"]):
        for a, b in zip(a_run, b_run):
            assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
            diffs += [abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)]
    assert max(diffs) < 0.05 and sum(d < 1e-4 for d in diffs) >= 0.9 * len(diffs), sorted(diffs)[-10:]


def _train(run_dir, *extra, wait=True):
    cmd = [sys.executable, "-m", "megatron_jetrl.cli", "train", "--preset", "tiny", "--run-dir", str(run_dir),
           "algo.sft_warmup_steps=2", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4", *extra]
    env = dict(os.environ, PYTHONPATH=REPO)
    if wait:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out
    # its own session, so a test can kill the run with everything it started (torch's helper processes)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_resume_continues_the_same_run(tmp_path):
    _train(tmp_path / "a", "steps=6")
    _train(tmp_path / "b", "steps=6", "checkpoint.save_interval=4")
    # cut b back to its step-3 checkpoint (as if it had stopped there) and resume
    ckpts = tmp_path / "b" / "checkpoints"
    (ckpts / "latest").write_text("step_3\n")
    _train(tmp_path / "b", "steps=6", "checkpoint.save_interval=4", "--resume")
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(9))  # each step once, in order, then the trained policy's evaluation
    assert set(b[-1]) == {"step", "eval/accuracy", "eval/response_length_mean"} and b[-1] == a[-1]
    rl = [r for r in b if r.get("is_rl") == 1.0]
    assert all(r["parity_checked"] > 0 and r["parity_mismatch"] == 0 for r in rl)  # FP8 hand-over verified
    for ra, rb in zip(a, b):
        for key in ("reward_mean", "pg_loss", "sft_loss", "grad_norm"):
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (ra["step"], key)
    assert os.path.isdir(ckpts / "step_7") and not any(p.name.endswith(".tmp") for p in ckpts.iterdir())
    before = (tmp_path / "b" / "metrics.jsonl").read_text()
    out = _train(tmp_path / "b", "steps=6", "--resume")  # a finished run: nothing to train, and nothing written
    assert "is complete" in out.stderr.strip().splitlines()[-1] and "raise steps" in out.stderr
    assert (tmp_path / "b" / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_killed_run_resumes_without_losing_steps(tmp_path):
    proc = _train(tmp_path, "steps=40", "checkpoint.save_interval=3", "checkpoint.keep_last=2", wait=False)
    ckpts = tmp_path / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and not (ckpts / "step_5").exists():
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole job dies at once, as when a node is lost
    proc.wait()
    assert (ckpts / "step_5").exists()
    killed_at = max(r["step"] for r in _rows(tmp_path))
    _train(tmp_path, "steps=12", "checkpoint.save_interval=3", "checkpoint.keep_last=2", "--resume")
    steps = [r["step"] for r in _rows(tmp_path)]
    assert steps == list(range(15)), (killed_at, steps)
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_11", "step_13"]  # the newest two kept


@pytest.mark.slow
def test_run_saves_and_stops_on_request_then_resumes(tmp_path):
    stop = tmp_path / "save_and_stop"
    tmp_path.mkdir(exist_ok=True)
    stop.touch()  # a request left from before the run: removed at its start, not acted on
    proc = _train(tmp_path, "steps=40", wait=False)
    metrics, deadline = tmp_path / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (metrics.exists() and len(_rows(tmp_path)) >= 4):
        time.sleep(0.2)
    assert proc.poll() is None and not stop.exists(), "the run stopped on a request from before it"
    seen = max(r["step"] for r in _rows(tmp_path))  # the request may land before or after this step's check
    stop.touch()  # as a batch script does on the scheduler's pre-timeout signal
    try:
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the run went on past the request to stop")
    assert rc == 0, proc.stderr.read()[-3000:]
    stopped = max(r["step"] for r in _rows(tmp_path))
    assert seen <= stopped <= seen + 2 and not stop.exists()
    assert "reward_mean" in _rows(tmp_path)[-1]  # an RL step last: no final evaluation
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step_{stopped}"  # saved where it stopped
    _train(tmp_path, f"steps={stopped}", "--resume")  # 2 SFT + `stopped` RL steps: one step more
    assert [r["step"] for r in _rows(tmp_path)] == list(range(stopped + 3))  # and the evaluation after the last


@pytest.mark.slow
def test_data_parallel_loop_with_distributed_optimizer(tmp_path):
    from tests.dist import run_workers
    from tests.workers import dp_train_worker

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        r0, r1 = run_workers(dp_train_worker, 2, str(tmp_path))
    finally:
        os.chdir(cwd)
    assert r0["param_sum"] == r1["param_sum"] and r0["param_abs"] == r1["param_abs"]  # replicas stay equal
    assert all("Distributed" in name for name in r0["dist_opt"]), r0["dist_opt"]
    assert r0["stream"] == r1["stream"]  # one shared stream position (each rank took its own slice)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and all(0 <= r.get("reward_mean", 0) <= 1 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "fp8_rollout"])
def test_other_precision_modes_train(mode, tmp_path):
    extra = ["algo.tis_cap=2.0"] if mode == "fp8_rollout" else []
    _train(tmp_path, "steps=3", f"precision.mode={mode}", *extra)
    rl = [r for r in _rows(tmp_path) if r.get("is_rl") == 1.0]
    assert len(rl) == 3
    if mode == "fp8_rollout":  # BF16 trainer vs FP8 sampler: measurable mismatch, TIS weights applied
        assert all(r["mismatch_abs_mean"] > 1e-4 and "tis_weight_mean" in r for r in rl)
        assert all(r["parity_checked"] > 0 and r["parity_mismatch"] == 0 for r in rl)
    else:  # same BF16/fp32 numbers on both sides
        assert all(r["mismatch_abs_mean"] < 1e-5 and r["parity_checked"] == 0 for r in rl)


def _tiny_run(run_dir, *overrides):
    """``setup()`` of the tiny preset in ``run_dir`` with 2 prompts per step and ``overrides``."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.train import setup

    return setup(load_config(os.path.join(REPO, "examples/configs/tiny.yaml"),
                             [f"logging.run_dir={run_dir}", "rollout.prompts_per_step=2", *overrides]))


@pytest.mark.parametrize("mode", ["jet", "bf16", "jet+fp8kv"])
def test_exact_mode_rollout_logprobs_equal_the_trainers(mode, tmp_path, megatron_single):
    """``precision.exact=true`` (the CPU emulation: each token from the trainer's forward, emulated FP8): for batches
    of 1 and 64 prompts of different lengths (3-19 tokens) every sampled token's logprob equals the
    one the trainer's forward computes for it, bit for bit (max abs difference exactly 0), through micro-batches of
    another size than the rollout's batch, and again after the weights change (an optimizer step's worth, the FP8
    caches re-quantized); without the mode a batch of 64 differs from the trainer in the last bits."""
    from megatron_jetrl.bench.timing import mode_overrides
    from tests.workers import gaps_before_and_after_update

    from tests.workers import random_prompts, rollout_train_gap

    make_hf_model("qwen3", str(tmp_path), seed=9)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    gaps = {}
    for exact in (True, False):
        _, model, state = build_loaded(str(tmp_path), [*mode_overrides(mode), f"precision.exact={str(exact).lower()}",
                                                       "model.max_position_embeddings=32"])
        engine = LocalEngine(model, state, pad_id=0, vocab_size=384, seed=5)
        g = torch.Generator().manual_seed(0)
        gaps[exact] = (gaps_before_and_after_update(engine, model, state, params, (1, 64), g, True, pad_to_exact=True)
                       if exact else [rollout_train_gap(engine, model, random_prompts(64, g), params, 24, False)])
    assert gaps[True] == [0.0, 0.0, 0.0] and gaps[False][0] > 0, gaps


def test_exact_mode_static_decoder_on_the_exact_kernels_under_the_interpreter(tmp_path):
    """Exact mode's GPU design run by Triton's CPU interpreter (fp32: its BF16 is not the GPU's): the static decoder
    with the KV cache, no fusions, prefill and decode steps on ``kernels/exact_attn.py`` (over the cache indexed by
    each left-padded row's own positions), the linears' GEMMs and the LM head on ``kernels/exact_gemm.py``; the
    trainer's forward on the same kernels (micro-batches of 3, no common padded length). Every sampled token's logprob
    equals the trainer's, bit for bit, for batches of 2 and 9 prompts of 3-19 tokens and 6 new tokens, in jet and in
    jet with the FP8 KV cache (one process each, at the same time); the exact kernels are the ones called; a prefill
    in chunks of 5 rows gives the same tokens and logprobs (FP8 KV cache, 2 new tokens). With the decode steps' key
    blocks of 16 instead of the trainer's 64 the logprobs differ (the key order is what makes it exact)."""
    make_hf_model("qwen3", str(tmp_path), seed=9)
    code = r'''
import sys, torch
from megatron_jetrl.bench.timing import mode_overrides
from megatron_jetrl.kernels import exact_attn
from megatron_jetrl.rollout.base import SamplingParams
from megatron_jetrl.rollout.local import LocalEngine
from megatron_jetrl.trainer.actor import build_batch, train_logprobs
from tests.workers import build_loaded, random_prompts, rollout_train_gap
_, model, state = build_loaded(sys.argv[1], [*mode_overrides(sys.argv[2]), "precision.exact=true"])
calls = []
orig = exact_attn.exact_attention
exact_attn.exact_attention = lambda *a, **k: calls.append(a[0].shape[0]) or orig(*a, **k)
engine = LocalEngine(model, state, pad_id=0, vocab_size=384, seed=5)
g = torch.Generator().manual_seed(0)
params = SamplingParams(max_new_tokens=6, temperature=1.0)
diffs = []
for B in (2, 9):
    prompts = random_prompts(B, g)
    gens = engine.generate(prompts, params)
    batch = build_batch(prompts, [x.output_ids for x in gens], [x.output_logprobs for x in gens], torch.zeros(B), 0,
                        torch.device("cpu"))
    n_calls = len(calls)
    lp = train_logprobs(model, batch, params.temperature, 3, None, True)
    assert len(calls) > n_calls  # the trainer's attention ran the kernel
    diffs.append(((lp - batch.rollout_logp).abs() * batch.mask).max().item())
assert engine._decoder.exact and 1 in calls, calls  # decode steps (one query) on the kernel
assert diffs == [0.0, 0.0], diffs
# the prefill in chunks of 5 rows (each chunk's rows write the position-indexed cache at their own offsets): the same
if sys.argv[2] == "jet+fp8kv":
    short = SamplingParams(max_new_tokens=2, temperature=1.0)
    whole = engine.generate(prompts, short, list(range(B)))
    engine._decoder.prefill_tokens = 5 * 19
    assert engine._decoder.prefill_rows(19) == 5 < engine._decoder.B
    chunked = engine.generate(prompts, short, list(range(B)))
    assert [(g.output_ids, g.output_logprobs) for g in chunked] == [(g.output_ids, g.output_logprobs) for g in whole]
# the decode steps' keys in blocks of 16, the trainer's in blocks of 64: other bits
exact_attn.exact_attention = lambda *a, **k: orig(*a, **(dict(k, plan=(16, 4, 2, 16)) if a[0].shape[0] == 1 else k))
assert rollout_train_gap(engine, model, prompts, params, 3, True) > 0
print("ok")
'''
    run_interpreted(code, cwd=REPO, each=((str(tmp_path), "jet"), (str(tmp_path), "jet+fp8kv")))


def test_exact_mode_static_decoder_refuses_moe(tmp_path, megatron_single):
    """The static decoder in exact mode refuses a MoE model with one line (its router's GEMM is not batch-invariant
    on the GPU), before allocating anything."""
    from megatron_jetrl.errors import ConfigError
    from megatron_jetrl.rollout.decode import StaticDecoder

    make_hf_model("qwen3_moe", str(tmp_path))
    _, model, _ = build_loaded(str(tmp_path), ["precision.mode=jet", "precision.exact=true"])
    with pytest.raises(ConfigError, match=r"^config error: precision.exact: the MoE router's GEMM is not batch-invariant"):
        StaticDecoder(model, 2, 16, exact=True)


def test_exact_mode_rl_steps_have_zero_mismatch(tmp_path, megatron_single):
    """RL steps of the tiny preset with ``precision.exact=true``: ``mismatch_abs_mean`` and ``mismatch_abs_max`` are
    exactly 0 in every step (the old logprobs from the training forward itself, in training mode with autograd),
    the micro-batches padded to ``max_position_embeddings``; a sequence longer than that is refused with one line."""
    from megatron_jetrl.errors import ConfigError
    from megatron_jetrl.models.builder import exact_length
    from megatron_jetrl.train import close, rl_step

    run = _tiny_run(tmp_path / "run", "steps=3", "algo.sft_warmup_steps=0", "data.reward=hash", "precision.exact=true")
    try:
        rows = [rl_step(run, step) for step in range(3)]
        with pytest.raises(ConfigError, match=r"precision.exact: an input of 65 positions is longer than "
                                              r"model.max_position_embeddings=64"):
            exact_length(run.actor.model, 65)
    finally:
        close(run)
    assert all(r["mismatch_abs_mean"] == 0.0 and r["mismatch_abs_max"] == 0.0 for r in rows), rows
    assert all(r["train_seq_len"] == 64.0 and r["grad_norm"] > 0 for r in rows)


def test_rl_steps_with_the_fp8_kv_cache(tmp_path, megatron_single):
    """RL steps of the tiny preset with ``precision.kv_cache=fp8``: in jet the rollout's cache is E4M3 and the
    trainer's attention reads the same values, so the train-rollout mismatch stays at the unquantized cache's level
    (fp32 emulation: ~1e-7); in fp8_rollout (the rollout alone quantizes K/V, the off-policy baseline) it is orders
    of magnitude higher. Training runs through the straight-through quantization (non-zero gradient norms; the
    reward is a hash of the response: non-zero advantages from random weights). The unified cache's rollout runs
    in waves of 8 of its 16 rows (``rollout.decode_rows``), counted in the step's metrics."""
    from megatron_jetrl.train import close, rl_step

    res = {}
    for mode, kv in (("jet", "bf16"), ("jet", "fp8"), ("fp8_rollout", "fp8")):
        waves = ["rollout.decode_rows=8"] if (mode, kv) == ("jet", "fp8") else []
        run = _tiny_run(tmp_path / f"{mode}_{kv}", "steps=2", "algo.sft_warmup_steps=0", "data.reward=hash",
                        f"precision.mode={mode}", f"precision.kv_cache={kv}", *waves)
        try:
            rows = [rl_step(run, step) for step in range(2)]
            dec = run.engine._decoder
            assert (dec.k.dtype == torch.float8_e4m3fn) is (kv == "fp8")
            assert all(r["grad_norm"] > 0 for r in rows)
            assert [r["rollout_waves"] for r in rows] == [2 if waves else 1] * 2 and dec.B == (8 if waves else 16)
        finally:
            close(run)
        res[(mode, kv)] = max(r["mismatch_abs_mean"] for r in rows)
    assert res[("jet", "fp8")] < 1e-5 and res[("jet", "bf16")] < 1e-5, res
    assert res[("fp8_rollout", "fp8")] > 100 * res[("jet", "fp8")], res


@pytest.mark.parametrize("mode", ["jet", "bf16"])
def test_old_logprobs_from_the_training_forward(mode, tmp_path, megatron_single, monkeypatch):
    """``algo.recompute_logprobs=false``: no separate logprob pass (``compute_logprobs`` is never called), the
    old logprobs come from each micro-batch's training forward. Two RL steps from the same start (same
    rollouts, same seeds) give the run with the separate pass's rollouts, losses, gradient norms, train-rollout
    mismatch and parameters (to fp32 rounding), with the PPO ratio exactly 1 (no token clipped)."""
    from megatron_jetrl.memory import optimizer_tensors
    from megatron_jetrl.train import close, rl_step, sft_step
    from megatron_jetrl.trainer.actor import Actor

    res = {}
    for recompute in (True, False):
        run = _tiny_run(tmp_path / str(recompute), "steps=2", "algo.sft_warmup_steps=1", f"precision.mode={mode}",
                        "algo.micro_batch_size=3", f"algo.recompute_logprobs={str(recompute).lower()}")
        calls = []
        orig = Actor.compute_logprobs
        monkeypatch.setattr(Actor, "compute_logprobs", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
        try:
            sft_step(run)
            ms = [rl_step(run, i) for i in range(2)]
            assert len(calls) == (2 if recompute else 0)
            res[recompute] = (ms, [t.detach().clone() for t in optimizer_tensors(run.actor.optimizer)])
        finally:
            close(run)
    (m1, p1), (m0, p0) = res[True], res[False]
    for a, b in zip(m1, m0):
        assert a["reward_mean"] == b["reward_mean"] and a["response_length_mean"] == b["response_length_mean"]
        assert b["clip_fraction"] == 0.0 and abs(b["ratio_mean"] - 1.0) < 1e-6
        for k in ("pg_loss", "entropy", "grad_norm", "mismatch_abs_mean", "mismatch_abs_max", "mismatch_k3_kl"):
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), (k, a[k], b[k])
    assert a["mismatch_abs_mean"] > 0
    assert len(p1) == len(p0) and all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(p1, p0))


def test_torch_adam_fallback_runs_fused(tmp_path, megatron_single, monkeypatch):
    """Without TE/apex, megatron-core builds torch's Adam; algo.fused_adam switches it to torch's
    fused kernel (the same update as the foreach path: compared on a real step)."""
    from megatron_jetrl.train import close, sft_step

    calls = []
    for name in ("_fused_adam_", "_fused_adamw_"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    results = {}
    for fused in (True, False):
        run = _tiny_run(tmp_path / str(fused), "steps=1", "algo.sft_warmup_steps=2", f"algo.fused_adam={str(fused).lower()}")
        try:
            n = len(calls)
            assert run.actor.fused_adam is fused
            sft_step(run)
            sft_step(run)
            assert (len(calls) > n) is fused
            results[fused] = [p.detach().clone() for p in run.actor.module.parameters()]
        finally:
            close(run)
    for a, b in zip(results[True], results[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_multi_tensor_fallbacks_as_foreach_kernels(tmp_path, megatron_single, monkeypatch):
    """Without TE/APEX megatron-core's gradient norm reads every tensor's norm back to the host and its
    clipping goes through a temporary per gradient; the trainer installs torch's foreach kernels in those
    slots: the same norm (to float rounding) without a host read, bit-identical scaling and copies, and the
    same gradient norms and parameters over clipped bf16 steps as with megatron's fallbacks."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads, optimizer as mopt
    from megatron_jetrl.train import close, sft_step
    from megatron_jetrl.trainer import multi_tensor as mt

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(s, generator=g) for s in [(7,), (3, 5), (64, 33)]]
    with Ops() as theirs:
        ref, _ = mutils.local_multi_tensor_l2_norm(0, None, [ts], False)
    with Ops() as ours:
        got, _ = mt.l2_norm(0, None, [ts, []], False)
    assert any("_local_scalar_dense" in n for n in theirs.names)  # megatron's fallback reads to the host
    assert not any("_local_scalar_dense" in n for n in ours.names), ours.names
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    assert got.shape == (1,) and got.dtype == torch.float32
    for factor in (1.0, 0.3):
        low = [torch.empty_like(t, dtype=torch.bfloat16) for t in ts]
        low_ref = [torch.empty_like(t) for t in low]
        mt.scale(0, None, [ts, low], factor)
        mutils.local_multi_tensor_scale(0, None, [ts, low_ref], factor)
        assert all(torch.equal(a, b) for a, b in zip(low, low_ref))
        inplace, inplace_ref = [t.clone() for t in ts], [t.clone() for t in ts]
        mt.scale(0, None, [inplace, inplace], factor)
        mutils.local_multi_tensor_scale(0, None, [inplace_ref, inplace_ref], factor)
        assert all(torch.equal(a, b) for a, b in zip(inplace, inplace_ref))

    def fallbacks():
        monkeypatch.setattr(clip_grads, "l2_norm_impl", mutils.local_multi_tensor_l2_norm)
        monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", mutils.local_multi_tensor_scale)
        monkeypatch.setattr(mopt, "multi_tensor_scale_impl", mutils.local_multi_tensor_scale)

    fallbacks()
    assert mt.install() == 3 and mt.install() == 0 and clip_grads.l2_norm_impl is mt.l2_norm
    # a real run (bf16 parameters; bf16 mode: jet releases its BF16 linear weights between steps) with a clip
    # that bites (grad_clip 1e-3)
    params, grad_norms = {}, {}
    real_install = mt.install
    for name in ("foreach", "megatron"):
        fallbacks()
        monkeypatch.setattr(mt, "install", real_install if name == "foreach" else (lambda: 0))
        run = _tiny_run(tmp_path / name, "steps=1", "algo.sft_warmup_steps=2", "precision.params_dtype=bf16",
                        "precision.mode=bf16", "algo.grad_clip=0.001")
        try:
            assert (clip_grads.l2_norm_impl is mt.l2_norm) is (name == "foreach")
            grad_norms[name] = [sft_step(run)["grad_norm"] for _ in range(3)]
            assert min(grad_norms[name]) > 0.001  # the clip scaled the gradients
            params[name] = [p.detach().clone() for p in run.actor.module.parameters()]
        finally:
            close(run)
    assert grad_norms["foreach"] == pytest.approx(grad_norms["megatron"], rel=1e-5)
    for a, b in zip(params["foreach"], params["megatron"]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-5)


def test_setup_freezes_the_python_heap_and_close_undoes_it(tmp_path, megatron_single):
    """``gc_freeze`` (default on): after setup every live object sits in the permanent generation, so the
    periodic full collections no longer re-scan torch / megatron-core / the model; a step still runs, and
    close() hands the objects back to the collector (a frozen model's cycles would otherwise keep their
    memory). ``gc_freeze=false`` leaves the collector alone."""
    import gc

    from megatron_jetrl.config import load_config
    from megatron_jetrl.train import close, setup, sft_step

    assert gc.get_freeze_count() == 0
    for freeze in (True, False):
        # the config stays alive here: the frozen count is compared with the objects alive after setup
        cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"),
                          [f"logging.run_dir={tmp_path / str(freeze)}", "steps=1", "algo.sft_warmup_steps=1",
                           "rollout.prompts_per_step=2", f"gc_freeze={str(freeze).lower()}"])
        run = setup(cfg)
        try:
            frozen = gc.get_freeze_count()
            # frozen objects still die by reference counting (the TensorBoard writer's thread frees some
            # after setup returns): the count can only shrink, and only by a few
            assert (frozen > 10_000) is freeze and 0 <= run.gc_frozen - frozen < 1_000
            sft_step(run)
        finally:
            close(run)
        assert gc.get_freeze_count() == 0 and run.gc_frozen == 0


def test_metrics_log_fresh_run_replaces_resume_keeps(tmp_path):
    from megatron_jetrl.metrics.logger import MetricsLogger

    def lines():
        return [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")]

    lg = MetricsLogger(str(tmp_path), tensorboard=False)
    for s in range(3):
        lg.log(s, {"reward_mean": 0.1 * s})
    lg.close()
    lg = MetricsLogger(str(tmp_path), tensorboard=False, resume_step=1)  # resumed after step 1: 2 is redone
    lg.log(2, {"reward_mean": 0.5})
    lg.close()
    assert lines() == [0, 1, 2]
    lg = MetricsLogger(str(tmp_path), tensorboard=False)  # a fresh run in the same directory
    lg.log(0, {"reward_mean": 0.0})
    lg.close()
    assert lines() == [0]


def test_static_decoder_under_tensor_parallelism(tmp_path):
    """TP=2 over gloo (dense jet and MoE bf16, whose routing runs eagerly): the static decoder's
    greedy tokens equal megatron-core's decode on every rank and the world-size-1 generation."""
    from tests.dist import run_workers
    from tests.workers import decode_worker

    jobs = {}
    for mt, mode in (("qwen3", "jet"), ("qwen3_moe", "bf16")):
        make_hf_model(mt, str(tmp_path / mt), seed=2)
        jobs[mt] = (str(tmp_path / mt), [f"precision.mode={mode}"])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (4, 9, 6)]
    tp2 = {k: (d, [*o, "parallel.tensor_parallel=2"]) for k, (d, o) in jobs.items()}
    ranks = run_workers(decode_worker, 2, tp2, prompts, 10)
    single = run_workers(decode_worker, 1, jobs, prompts, 10)[0]
    for mt in jobs:
        ref = [ids for ids, _ in single[(mt, "static")]]
        assert ref == [ids for ids, _ in single[(mt, "megatron")]], mt
        for r in ranks:
            for decode in ("static", "megatron"):
                assert [ids for ids, _ in r[(mt, decode)]] == ref, (mt, decode)
            diffs = [abs(x - y) for (_, a), (_, b) in zip(r[(mt, "static")], single[(mt, "static")]) for x, y in zip(a, b)]
            # bf16 (fp32 here): TP's partial sums round differently in the last bits; jet: such a bit can move an
            # activation across an E4M3 rounding boundary, an isolated ~1e-3 step
            assert sum(diffs) / len(diffs) < 1e-4 and max(diffs) < (1e-4 if mt == "qwen3_moe" else 1e-2), (mt, max(diffs))


def test_static_decoder_reused_across_batch_sizes(tmp_path, megatron_single):
    """Requests of 5, 3 and 7 prompts share one decoder of 8 rows (the extra rows decode pad tokens,
    never sampled); each request's greedy tokens equal a fresh engine's on that request alone, and
    a request of 17 prompts gets a new decoder of 24 rows."""
    make_hf_model("llama", str(tmp_path), seed=3)
    _, model, state = build_loaded(str(tmp_path), ["precision.mode=jet"])
    g = torch.Generator().manual_seed(2)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    shared = LocalEngine(model, state, pad_id=0, vocab_size=384, bucket=4)
    decoders = []
    for n in (5, 3, 7, 17):
        lengths = [8, *torch.randint(2, 9, (n - 1,), generator=g)]
        prompts = [torch.randint(3, 384, (int(k),), generator=g).tolist() for k in lengths]
        got = shared.generate(prompts, params)
        decoders.append(shared._decoder)
        alone = LocalEngine(model, state, pad_id=0, vocab_size=384, bucket=4, decode="megatron").generate(prompts, params)
        assert [x.output_ids for x in got] == [x.output_ids for x in alone], n
        assert len(got) == n
    assert decoders[0] is decoders[1] is decoders[2] and decoders[0].B == 8
    assert decoders[3] is not decoders[0] and decoders[3].B == 24


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
def test_static_decoder_qkv_in_rollout_layout_equals_megatron_split(model_type, tmp_path, megatron_single):
    """jet: the decoder splits the FP8 fused QKV output in the cache's rollout order ([q | k | v]) and
    skips the permutation back; q, k, v equal megatron's ``get_query_key_value_tensors`` exactly
    (qwen3: q/k layernorms on the views; qwen2: the QKV bias permuted with the rows)."""
    from megatron_jetrl.rollout.decode import StaticDecoder

    make_hf_model(model_type, str(tmp_path), seed=2)
    _, model, state = build_loaded(str(tmp_path), ["precision.mode=jet"])
    dec = StaticDecoder(model, 2, 16, use_graphs=False)
    attn = dec.layers[0].self_attention
    assert attn.linear_qkv.fp8_cache.perm is not None
    assert (attn.linear_qkv.bias is not None) == (model_type == "qwen2")
    x = torch.randn(3, 2, dec.cfg.hidden_size)
    with torch.no_grad(), state.rollout_precision():
        *ours, part = dec._qkv(attn, x)
        ref = attn.get_query_key_value_tensors(x, None)
    assert part is None  # the CPU decoder sums no split-K partials in its RoPE
    for a, b in zip(ours, ref, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_static_decoder_prefill_chunks(tmp_path, megatron_single):
    """Prefill in row chunks (bounded by the fp32 score bytes and the tokens per chunk, from the prompt
    length, not the decoder's max length) gives the logits and KV cache of one chunk, jet and bf16."""
    from megatron_jetrl.rollout.decode import StaticDecoder

    make_hf_model("qwen3", str(tmp_path), seed=3)
    for mode in ("bf16", "jet"):
        _, model, state = build_loaded(str(tmp_path), [f"precision.mode={mode}"])
        dec = StaticDecoder(model, 5, 64, use_graphs=False)
        assert dec.prefill_rows(12) == min((2 << 30) // (4 * dec.heads * 12 * 12), 16384 // 12)  # one chunk here
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(3, 384, (5, 12), generator=g)
        key_pad = torch.zeros(5, 12, dtype=torch.bool)
        key_pad[1, :4] = key_pad[3, :7] = True
        with torch.no_grad(), state.rollout_precision():
            whole = dec.prefill(tokens, key_pad).clone()
            kv = (dec.k.clone(), dec.v.clone())
            dec.prefill_tokens = 24  # 2 rows of 12 tokens per chunk: chunks of 2, 2, 1 rows
            assert dec.prefill_rows(12) == 2
            chunked = dec.prefill(tokens, key_pad)
        assert torch.allclose(chunked, whole, rtol=1e-5, atol=1e-5), mode
        assert torch.allclose(dec.k, kv[0], atol=1e-6) and torch.allclose(dec.v, kv[1], atol=1e-6), mode
    inner = key_pad.clone()
    inner[2, 5] = True  # a pad after a row's first token: the attention counts a row's pads as a prefix
    with pytest.raises(ValueError, match="key_pad must mark left padding"):
        dec.prefill(tokens, inner)


def test_fused_sampler_under_the_interpreter():
    """The rollout's one-kernel sampler (CUDA in production) run by Triton's CPU interpreter: token
    frequencies follow softmax(logits / T) (within 4 standard errors per token), the logprobs are
    log_softmax's at the drawn ids, a seed fixes the draw and another seed changes it; bf16 logits of
    a vocabulary wider than one block (several sweeps per row, masked tail) give log_softmax's
    logprobs too."""
    code = r'''
import torch
from megatron_jetrl.kernels.sample import fused_sample
g = torch.Generator().manual_seed(0)
V, B, T = 6, 600, 0.7
logits = torch.tensor([1.0, 0.6, 0.4, -0.2, -0.5, -1.2])
x = logits[None].expand(B, V).contiguous()
ids, lp = fused_sample(x, T, 123)
p = torch.softmax(logits / T, -1)
freq = torch.bincount(ids, minlength=V).double() / B
tol = 4 * (p * (1 - p) / B).sqrt() + 1e-3
assert ((freq - p).abs() <= tol).all(), (freq, p)
ref = torch.log_softmax(x / T, -1).gather(-1, ids[:, None]).squeeze(-1)
assert (lp - ref).abs().max() < 1e-5
assert torch.equal(fused_sample(x[:60], T, 123)[0], ids[:60]) and not torch.equal(fused_sample(x[:60], T, 124)[0], ids[:60])
y = (torch.randn(4, 9000, generator=g) * 3).bfloat16()
i, l = fused_sample(y, 1.3, 5)
assert ((0 <= i) & (i < 9000)).all()
assert (l - torch.log_softmax(y.float() / 1.3, -1).gather(-1, i[:, None]).squeeze(-1)).abs().max() < 1e-5
print("ok")
'''
    run_interpreted(code)


def test_decoder_refuses_a_kv_cache_the_gpu_cannot_hold():
    """The static decoder's KV cache (``recipe.kv_cache_bytes``: an 8B model's BF16 cache of 256 x 4,224 positions is
    the 142 GB no card here holds, the FP8 cache 132/256 of it) checked against the GPU's free memory before it is
    allocated: one line naming the knobs, the FP8 cache among them only where it is not already on."""
    from megatron_jetrl.precision.recipe import kv_cache_bytes
    from megatron_jetrl.rollout.decode import cache_fit_problem

    bf16 = kv_cache_bytes(256 * 4224, layers=32, kv_heads=8, head_dim=128, fp8=False)
    fp8 = kv_cache_bytes(256 * 4224, layers=32, kv_heads=8, head_dim=128, fp8=True)
    assert bf16 / 1e9 == pytest.approx(141.7, abs=0.05) and fp8 * 256 == bf16 * 132
    msg = cache_fit_problem(bf16, 139e9, 256, 4224, fp8=False)
    assert msg.startswith("config error: rollout decode: a KV cache of 256 rows x 4224 positions needs 141.7 GB, "
                          "139.0 GB free") and "rollout.decode_rows" in msg and "precision.kv_cache=fp8" in msg
    assert "\n" not in msg and "kv_cache" not in cache_fit_problem(fp8, 60e9, 256, 4224, fp8=True)
    assert cache_fit_problem(fp8, 139e9, 256, 4224, fp8=True) is None and cache_fit_problem(bf16, bf16, 1, 1, False) is None
    one = cache_fit_problem(bf16 // 256, 0.5e9, 1, 4224, fp8=False)  # not one row: fewer rows is no fix
    assert one.startswith("config error: rollout decode: a KV cache of 1 row x 4224 positions needs 0.6 GB, 0.5 GB free")
    assert "decode_rows" not in one and "rollout.max_new_tokens" in one and "precision.kv_cache=fp8" in one


def test_wave_rows_splits_a_batch_into_balanced_waves_within_its_bound():
    """``wave_rows``: a batch within ``rollout.decode_rows`` and the rows whose KV cache fits decodes at once; a
    larger one in the fewest waves the bound allows, as even as the decoder's 8-row rounding lets them be."""
    from megatron_jetrl.rollout.local import ROW_MULTIPLE, wave_rows

    assert wave_rows(512) == wave_rows(512, 0, 515) == wave_rows(512, 512) == 512
    assert wave_rows(512, 200) == 176  # 176, 176, 160
    assert wave_rows(300, 100) == 80  # bound taken down to 96: 4 waves
    assert wave_rows(20, 8) == 8 and wave_rows(13, 0, 14) == 8  # 13 rows make a 16-row decoder: 14 do not hold it
    assert wave_rows(5, 0, 3) == 3 and wave_rows(5, 2) == 2  # bounds under 8 rows kept as they are
    for rows in range(1, 300, 7):
        for limit, fit in ((0, 9), (8, None), (64, 40), (100, None), (0, 137), (33, 1000), (0, 5)):
            size = wave_rows(rows, limit, fit)
            cap = min(b for b in (limit or None, fit) if b is not None)
            cap8 = cap - cap % ROW_MULTIPLE if cap >= ROW_MULTIPLE else cap
            waves = -(-rows // size)
            if size == rows:
                assert waves == 1 and (rows <= cap8 or rows <= cap and (fit is None or -(-rows // 8) * 8 <= fit)
                                       or cap < ROW_MULTIPLE and rows <= cap)
            else:
                assert size <= cap8 and waves == -(-rows // cap8), (rows, limit, fit, size)
                assert size % ROW_MULTIPLE == 0 or cap < ROW_MULTIPLE, (rows, limit, fit, size)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_decoder_cache_bytes_are_its_allocation(kv, tmp_path, megatron_single):
    """``decode.cache_bytes`` (what the engine sizes its waves with and the decoder checks against the GPU's free
    memory) equals the bytes the static decoder allocates: K, V, the FP8 cache's scales and the validity bytes."""
    from megatron_jetrl.rollout.decode import cache_bytes
    from tests.hf_models import make_hf_model

    make_hf_model("qwen3", str(tmp_path), seed=3)
    _, model, state = build_loaded(str(tmp_path), ["precision.mode=jet", f"precision.kv_cache={kv}"])
    engine = LocalEngine(model, state, pad_id=0, vocab_size=384, bucket=4)
    dec = engine._static_decoder(8, 70)
    held = sum(t.untyped_storage().nbytes() for t in (dec.k, dec.v, dec.ks, dec.vs, dec.key_ok) if t is not None)
    assert dec.cache_bytes == held == cache_bytes(model, 8, 70, kv == "fp8") == 8 * cache_bytes(model, 1, 70, kv == "fp8")


@pytest.mark.parametrize("mode", ["bf16", "jet"])
def test_engine_decodes_more_rows_than_its_bound_in_waves_with_the_same_tokens(mode, tmp_path, megatron_single):
    """20 rows with ``rollout.decode_rows=8`` decode in 3 waves on one static decoder (8 rows, the whole batch's
    length), and with the rows the GPU's memory holds as the bound (``_fit_rows``, here 8) the same: row-seeded
    sampling draws each row's tokens of the batch decoded at once (logprobs within the CPU's batch-shape rounding:
    jet's activation quantizer can turn a last-bit difference into an E4M3 step). Where fewer than 8 rows fit, the
    decoder is not rounded up past them."""
    from tests.hf_models import make_hf_model

    make_hf_model("qwen3", str(tmp_path), seed=5)
    _, model, state = build_loaded(str(tmp_path), [f"precision.mode={mode}"])
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 384, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (20,), generator=g)]
    seeds = list(range(100, 120))
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    whole = LocalEngine(model, state, pad_id=0, vocab_size=384, bucket=4)
    ref = whole.generate(prompts, params, seeds)
    assert whole.metrics == {"rollout_waves": 1} and whole.decoder.B == 24
    bounded = LocalEngine(model, state, pad_id=0, vocab_size=384, bucket=4, decode_rows=8)
    by_memory = LocalEngine(model, state, pad_id=0, vocab_size=384, bucket=4)
    by_memory._fit_rows = lambda rows, max_len: 8  # the GPU holds 8 rows' cache
    diffs = []
    for engine in (bounded, by_memory):
        made = []

        def build(B, L, max_rows=None, original=engine._static_decoder, made=made):
            dec = original(B, L, max_rows)
            made.append((B, L, id(dec)))
            return dec

        engine._static_decoder = build
        out = engine.generate(prompts, params, seeds)
        assert engine.metrics == {"rollout_waves": 3} and engine.decoder.B == 8
        assert made == [(8, max(map(len, prompts)) + 10, id(engine.decoder))] * 3
        assert engine.last_stats["decode_steps"] == 3 * 10 and engine.last_stats["cuda_graphs"] is False
        for a, b in zip(ref, out):
            assert a.prompt_ids == b.prompt_ids and a.output_ids == b.output_ids
            diffs += [abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)]
    # bf16: at most last-bit differences; jet: a row's logprobs match until a last-bit difference moves one of its
    # activations by an E4M3 step, and its later tokens attend over that (which rows and how early depends on the
    # CPU's matmul kernels for 24 and 8 rows: at least 90% of jet's logprobs within 1e-4 on an AMD EPYC, 80% on an
    # Intel Xeon)
    exact = sum(d < 1e-4 for d in diffs) / len(diffs)
    assert max(diffs) < 0.05 and exact >= (0.9 if mode == "bf16" else 0.5), (exact, sorted(diffs)[-5:])
    tight = LocalEngine(model, state, pad_id=0, vocab_size=384, bucket=4)
    tight._fit_rows = lambda rows, max_len: 3  # under ROW_MULTIPLE rows fit: the decoder holds 3, not 8
    out = tight.generate(prompts[:5], params, seeds[:5])
    assert tight.metrics == {"rollout_waves": 2} and tight.decoder.B == 3
    assert [g.output_ids for g in out] == [g.output_ids for g in ref[:5]]


def test_fp8_cache_v_layout_follows_the_gpus_bandwidth_per_sm(monkeypatch):
    """``rollout.fp8_kv_v_layout=auto``: V key-major on a GPU with the H200's memory (3.2 GHz HBM3e x 6,144 bits over
    132 SMs: 37 GB/s per SM), [L, d] ("rows") on the H100 SXM's (2.6 GHz x 5,120 bits: 25) and wherever the driver
    reports no memory clock or there is no GPU; an explicit choice is taken as given, a misspelt one refused."""
    from types import SimpleNamespace

    from megatron_jetrl.config import RolloutConfig
    from megatron_jetrl.rollout.decode import fp8_v_layout, hbm_gbps_per_sm

    cuda = torch.device("cuda", 0)
    boards = {"H200": (3_201_000, 6144), "H100": (2_619_000, 5120), "no clock": (0, 5120)}
    for name, (clock, bits) in boards.items():
        props = SimpleNamespace(memory_clock_rate=clock, memory_bus_width=bits, multi_processor_count=132)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, p=props: p)
        bw = hbm_gbps_per_sm(cuda)
        want = {"H200": "key_major", "H100": "rows", "no clock": "rows"}[name]
        assert fp8_v_layout("auto", cuda) == want, (name, bw)
        assert fp8_v_layout("rows", cuda) == "rows" and fp8_v_layout("key_major", cuda) == "key_major"
        if name == "H200":
            assert bw == pytest.approx(37.2, abs=0.1)
        if name == "H100":
            assert bw == pytest.approx(25.4, abs=0.1)
    assert fp8_v_layout("auto", torch.device("cpu")) == "rows" and RolloutConfig().fp8_kv_v_layout == "auto"
    with pytest.raises(ValueError, match="fp8_kv_v_layout='keymajor'"):
        fp8_v_layout("keymajor", cuda)


def test_decode_attention_kernel_under_the_interpreter(tmp_path):
    """The exact-length decode attention (``kernels/decode_attn.py``, CUDA in production) under Triton's
    CPU interpreter, fp32 (the interpreter's bf16 rounding is not the GPU's): the output equals SDPA with
    the decoder's additive mask over keys 0..pos (left-pad keys masked; keys past pos ignored whatever
    ``key_ok`` says there), for grouped-query and one-head-per-group layouts, a head dim that is not a
    power of two, q as a strided view of a fused QKV output, one split and several (the merge kernel;
    splits left empty at short lengths), and pos = 0. Then the static decoder on it (llama, GQA, fp32,
    unquantized: in jet a last-bit difference can cross an E4M3 rounding boundary): the same sampled
    tokens as the SDPA decoder with the logprobs to 1e-4 (the sums run in another order), one graph key
    for every length, and the kernel actually called at every decode step. The key-major kernel (V key-major:
    whole tiles unmasked, the split's last keys in masked tail tiles; V [L, d]: one loop, its last tile masked) equals
    SDPA alike; over rows of a multiple of 16 keys, whose masked tiles load up to 15 keys past pos, whatever K holds
    there and a finite V weigh nothing. In jet with the FP8 KV cache the Triton decoder's attention (the key-major
    kernel over V stored [L, d], contiguous cache writes; V key-major too) equals SDPA over the dequantized cache at
    every decode step (1e-5), the decoder draws the SDPA decoder's tokens while the two caches hold the same bytes
    (logprobs to 2e-3: jet's activation quantizers can turn the attentions' last-bit differences into an E4M3
    step), and a prefill zeroes the V an earlier rollout left past the prompt (NaN bytes here)."""
    make_hf_model("llama", str(tmp_path), seed=7)
    code = r'''
import sys
import torch, torch.nn.functional as F
from megatron_jetrl.kernels import decode_attn as triton_attn
from megatron_jetrl.kernels.decode_attn import decode_attention
g = torch.Generator().manual_seed(0)
for b, H, G, D, L, pos, splits in ((3, 8, 4, 64, 40, 29, 1), (3, 8, 4, 64, 40, 29, 3), (2, 4, 4, 128, 300, 200, 1),
                                   (2, 6, 2, 80, 70, 69, 4), (2, 4, 1, 32, 20, 0, 2), (2, 8, 2, 16, 600, 30, 8)):
    fused = torch.randn(b, G, (H // G + 2) * D, generator=g)  # [q heads of the group | k | v], as megatron's QKV
    q = fused[..., : (H // G) * D].reshape(b, H, D)
    k, v = torch.randn(b, G, L, D, generator=g), torch.randn(b, G, L, D, generator=g)
    ok = torch.ones(b, L, dtype=torch.bool)
    ok[0, : min(5, pos)] = False  # left pad of a shorter prompt
    ok[:, pos + 1:] = torch.rand(b, L - pos - 1, generator=g) > 0.5  # not yet written: must not be read
    valid = ok.clone()
    valid[:, pos + 1:] = False
    bias = torch.zeros(b, 1, 1, L).masked_fill_(~valid[:, None, None, :], float("-inf"))
    ref = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=bias, scale=D ** -0.5, enable_gqa=H != G)[:, :, 0]
    out = decode_attention(q, k, v, ok, torch.tensor([pos]), D ** -0.5, splits=splits, block_n=16)
    assert out.shape == (b, H, D) and (out - ref).abs().max() < 1e-5, (b, H, G, D, L, pos, splits, (out - ref).abs().max())
    vk = v.transpose(-1, -2).contiguous().transpose(-1, -2)  # V key-major: the key-major kernel
    for bn in (16, 64):  # 64: whole tiles, then up to two masked 32-key tail tiles
        out = decode_attention(q, k, vk, ok, torch.tensor([pos]), D ** -0.5, splits=splits, block_n=bn)
        assert (out - ref).abs().max() < 1e-5, (b, H, G, D, L, pos, splits, bn, (out - ref).abs().max())
# rows of a multiple of 16 keys (the decoder's): masked tiles load keys up to pos + 1 rounded up to 16, which weigh 0
# whatever K holds there (NaN here) as long as V is finite; keys past that are never read (NaN in K and V)
for b, H, G, D, L, pos, splits, bn in ((2, 8, 2, 64, 96, 37, 1, 64), (2, 8, 2, 64, 96, 37, 2, 16),
                                       (2, 4, 4, 128, 160, 100, 1, 128), (3, 4, 2, 32, 64, 0, 1, 64)):
    q = torch.randn(b, H, D, generator=g)
    k, v = torch.randn(b, G, L, D, generator=g), torch.randn(b, G, L, D, generator=g)
    ok = torch.ones(b, L, dtype=torch.bool)
    bias = torch.zeros(b, 1, 1, L)
    bias[..., pos + 1:] = float("-inf")
    ref = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=bias, scale=D ** -0.5, enable_gqa=H != G)[:, :, 0]
    hl = -(-(pos + 1) // 16) * 16
    assert hl > pos + 1
    k[:, :, pos + 1:] = float("nan")
    v[:, :, pos + 1:hl] = 1e4
    v[:, :, hl:] = float("nan")
    for vv in (v, v.transpose(-1, -2).contiguous().transpose(-1, -2)):
        out = decode_attention(q, k, vv, ok, torch.tensor([pos]), D ** -0.5, splits=splits, block_n=bn)
        assert (out - ref).abs().max() < 1e-5, (b, H, G, D, L, pos, splits, bn, vv.stride(), (out - ref).abs().max())

from megatron_jetrl.launch.planner import server_memory
from megatron_jetrl.rollout.base import SamplingParams
from megatron_jetrl.rollout.local import LocalEngine
from tests.workers import build_loaded
_, model, state = build_loaded(sys.argv[1], ["precision.mode=bf16"])
calls = []
orig = triton_attn.decode_attention
triton_attn.decode_attention = lambda *a, **k: calls.append(1) or orig(*a, **k)
prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (3, 7, 5)]
params = SamplingParams(max_new_tokens=10, temperature=1.0)
runs = {}
for attention in ("sdpa", "triton"):
    engine = LocalEngine(model, state, pad_id=0, vocab_size=384, seed=3, bucket=4, attention=attention)
    runs[attention] = engine.generate(prompts, params)
    dec = engine._decoder
    assert dec.triton_attn is (attention == "triton")
    assert (dec.bucket_len(5) == dec.bucket_len(dec.L - 1) == dec.L) is (attention == "triton")
assert len(calls) == 9 * 2, len(calls)  # every decode step after the prefill's token, in both layers
lp = []
for a, b in zip(runs["sdpa"], runs["triton"]):
    assert a.output_ids == b.output_ids, (a.output_ids, b.output_ids)
    lp += [abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)]
assert max(lp) < 1e-4, max(lp)
# jet with the FP8 KV cache: at every decode step the Triton decoder's attention (the key-major kernel; V stored [L, d],
# as the SDPA decoder's: each step's write one contiguous row per KV head) equals SDPA over the same cache's dequantized
# values, and it draws the SDPA decoder's tokens while the two caches hold the same bytes: from the second layer on
# the two attentions' last bits reach the K/V, where the KV rule can turn such a difference into an E4M3 step
# (tests.common.first_kv_difference), and the activation quantizers into an E4M3 step of the next GEMM's input
from megatron_jetrl.precision.quant import dequantize_kv
from tests.common import first_kv_difference

fp8_calls = []

def checked(q, kc, vc, ok, idx, scale, *a, k_scale=None, v_scale=None, **kw):
    """The kernel's output against SDPA over the dequantized keys 0..pos where ``ok`` (fp32: to 1e-5)."""
    res = orig(q, kc, vc, ok, idx, scale, *a, k_scale=k_scale, v_scale=v_scale, **kw)
    calls.append(1)
    if k_scale is not None:
        n = int(idx[0]) + 1
        k, v = (dequantize_kv(c[:, :, :n], s[:, :, :n], torch.float32) for c, s in ((kc, k_scale), (vc, v_scale)))
        ref = F.scaled_dot_product_attention(q[:, :, None].float(), k, v, attn_mask=ok[:, None, None, :n], scale=scale,
                                             enable_gqa=True)[:, :, 0]
        fp8_calls.append((((res[0] if isinstance(res, tuple) else res).float() - ref).abs().max().item(), vc.stride()))
    return res

triton_attn.decode_attention = checked

def same_draws_over_the_same_bytes(da, db, ra, rb):
    """Row by row, the tokens drawn while two decoders' FP8 caches agree byte for byte (token t attends over the
    keys before column P + t) are the same, their logprobs to 2e-3 (an activation's E4M3 step: 2.2e-4 seen here;
    a K/V byte moves them by ~2e-2); returns how many were compared."""
    P, compared = max(map(len, prompts)), 0
    for r, (a, b) in enumerate(zip(ra, rb)):
        agree = first_kv_difference(*([t[:, r, :, :d._written] for t in (d.k, d.v, d.ks, d.vs)] for d in (da, db)))
        n = agree - P + 1
        assert n >= 1 and a.output_ids[:n] == b.output_ids[:n], (r, agree, a.output_ids, b.output_ids)
        assert max(abs(x - y) for x, y in zip(a.output_logprobs[:n], b.output_logprobs[:n])) < 2e-3, (r, agree)
        compared += min(n, len(a.output_ids))
    return compared

cfg, model, state = build_loaded(sys.argv[1], ["precision.mode=jet", "precision.kv_cache=fp8"])
runs, decs, calls[:] = {}, {}, []
for attention in ("sdpa", "triton"):
    engine = LocalEngine(model, state, pad_id=0, vocab_size=384, seed=3, bucket=4, attention=attention)
    runs[attention] = engine.generate(prompts, params)
    dec = decs[attention] = engine._decoder
    assert not dec.v_key_major and dec.v.stride(-1) == 1 and dec.triton_attn is (attention == "triton")
    # rows of the cache start at multiples of 64 keys whatever the length (aligned tile loads)
    assert dec.L % 64 and dec.key_ok.shape[1] == dec.ks.shape[-1] == dec.v.shape[-2] == dec.L, dec.L
    assert dec.key_ok.stride(0) % 64 == dec.ks.stride(-2) % 64 == dec.k.stride(-3) % (64 * dec.dim) == 0
    assert dec.v.stride(-3) % (64 * dec.dim) == 0, dec.v.stride()
    # the launch planner's FP8 KV bytes per token are the decoder's: E4M3 K and V and their fp32 scales
    per_token = sum(t.untyped_storage().nbytes() for t in (dec.k, dec.v, dec.ks, dec.vs)) / (dec.B * dec.key_ok.stride(0))
    assert per_token == server_memory(cfg.model, 1, fp8=True, concurrency=1, context_len=1, mem_fraction=1.0,
                                      gpu_mem=1.0, kv_fp8=True).kv_per_token, per_token
assert len(calls) == 9 * 2, len(calls)
# rollout.fp8_kv_v_layout=key_major: V stored key-major in the default mode too ([d, L] memory), the same tokens
engine = LocalEngine(model, state, pad_id=0, vocab_size=384, seed=3, bucket=4, attention="triton", v_layout="key_major")
km = engine.generate(prompts, params)
dec = engine._decoder
assert dec.v_key_major and dec.v.stride(-2) == 1 and not dec.exact
# every decode step's attention in both layers, over V [L, d] and key-major, equals SDPA's
assert len(fp8_calls) == 2 * 9 * 2 and {s[-1] for _, s in fp8_calls} == {1, dec.v.stride(-1)}, fp8_calls
assert max(e for e, _ in fp8_calls) < 1e-5, max(e for e, _ in fp8_calls)
drawn = len(prompts) * params.max_new_tokens
compared = [same_draws_over_the_same_bytes(decs["sdpa"], d, runs["sdpa"], r)
            for d, r in ((decs["triton"], runs["triton"]), (dec, km))]
assert 2 * min(compared) >= drawn, (compared, drawn)  # most draws attend over the same bytes
del decs
# whatever an earlier rollout left in V past the prompt (NaN bytes here) is zeroed by the next prefill: the kernel's
# masked tiles read up to 15 keys past the step's position
written = dec._written  # the columns the prompts and decode steps wrote
assert written == max(map(len, prompts)) + params.max_new_tokens - 1, written
dec.v[..., :written, :].view(torch.uint8).fill_(0x7F)  # E4M3 NaN in every V byte an earlier rollout wrote
again = engine.generate([p[:2] for p in prompts], params)  # shorter prompts: the decode steps start earlier
assert engine._decoder is dec and all(x == x for r in again for x in r.output_logprobs)
rows = dec._full_rows(dec.v, 3)  # [layers, B, groups, keys the rows hold, d]
assert dec._written == 2 + params.max_new_tokens - 1 and torch.isfinite(rows.float()).all()
assert not rows[..., dec._written:, :].float().any()
# a longer rollout needs a new decoder: the old one (its KV cache) is freed before the new one allocates
import gc
import weakref

from megatron_jetrl.rollout import decode as decode_mod
old, dec = weakref.ref(engine._decoder), None
gc.collect()
assert old() is not None
init, freed = decode_mod.StaticDecoder.__init__, []
decode_mod.StaticDecoder.__init__ = lambda self, *a, **k: freed.append(old() is None) or init(self, *a, **k)
engine.generate(prompts, SamplingParams(max_new_tokens=11, temperature=1.0))  # 7 + 11 positions: past the old 17
assert freed == [True] and engine._decoder.L > 17, (freed, engine._decoder.L)
print("ok")
'''
    run_interpreted(code, str(tmp_path), cwd=REPO)


def test_jet_releases_bf16_weights_between_steps(tmp_path, megatron_single, monkeypatch):
    """``precision.release_bf16_weights`` (jet, BF16 parameters): after each step the FP8 linears' BF16 weights
    are placeholders (the forward and backward read only the FP8 cache) and the next step writes them anew from
    the fp32 masters. Two RL steps (SFT warm-up, rollout through the in-process engine, train) and a checkpoint
    give the same numbers as with the setting off: metrics, fp32 masters, FP8 caches, and the BF16 weights
    restored (what the checkpoint holds). A skipped optimizer step puts the old bytes back; a stale refresh or
    a BF16 export of a released weight fails with a message instead of reading the placeholder; the static
    decoder's graph fingerprint does not change from step to step (the placeholders move, nothing reads them)."""
    from megatron_jetrl.memory import is_released, optimizer_tensors
    from megatron_jetrl.precision.linear import FP8LinearMixin, refresh_fp8_weights
    from megatron_jetrl.sync.export import ExportOptions, collect_hf_state_dict
    from megatron_jetrl.train import close, rl_step, sft_step
    from megatron_jetrl.trainer.checkpoint import load_checkpoint, save_checkpoint

    res = {}
    for release in (True, False):
        run = _tiny_run(tmp_path / str(release), "steps=2", "algo.sft_warmup_steps=1", "precision.mode=jet",
                        "precision.params_dtype=bf16", f"precision.release_bf16_weights={str(release).lower()}")
        try:
            actor = run.actor
            lin = [m for m in actor.module.modules() if isinstance(m, FP8LinearMixin)]
            assert (len(actor._releasable) == len(lin)) is release
            metrics = [sft_step(run), rl_step(run, 0)]
            ws = [m.weight for m in lin]
            assert all(is_released(w) for w in ws) is release and not any(is_released(w) for w in ws) is not release
            if release:
                with pytest.raises(RuntimeError, match="released"):
                    lin[0].fp8_cache.refresh(lin[0].weight, run.actor.fp8_state)
                with pytest.raises(RuntimeError, match="released"):
                    collect_hf_state_dict(actor.module, run.cfg.model, ExportOptions(fp8=False))
            from megatron_jetrl.rollout.decode import fingerprint

            fp = fingerprint(actor.module)  # the rollout's graphs stay valid: placeholders are not in it
            metrics.append(rl_step(run, 1))
            assert fingerprint(actor.module) == fp
            ckpt = save_checkpoint(str(tmp_path / f"ck{release}"), 1, actor, {"stream": {}})
            assert all(is_released(w) for w in ws) is release  # saved, released again
            caches = [(m.fp8_cache.qweight.clone(), m.fp8_cache.scale_inv.clone()) for m in lin]
            masters = [t.clone() for t in optimizer_tensors(actor.optimizer)]
            load_checkpoint(ckpt, actor)  # loads into released weights: restored first, then re-quantized as resume does
            refresh_fp8_weights(actor.module, actor.fp8_state)
            assert all(torch.equal(m.fp8_cache.qweight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(
                m.fp8_cache.scale_inv, sc) for m, (q, sc) in zip(lin, caches))
            assert all(torch.equal(a, b) for a, b in zip(optimizer_tensors(actor.optimizer), masters))
            actor.restore_weights()
            res[release] = (metrics, caches, masters, [w.detach().clone() for w in ws], ckpt)
            if release:  # a skipped step: nothing written by the optimizer, the released bytes come back
                before = [w.detach().clone() for w in ws]
                actor.release_weights()
                monkeypatch.setattr(actor.optimizer, "step", lambda: (False, None, None))
                actor._optimizer_step()  # re-quantizes: from the old bytes, so the same FP8 cache
                assert all(torch.equal(m.fp8_cache.qweight.view(torch.uint8), q.view(torch.uint8))
                           for m, (q, _) in zip(lin, caches))
                actor.restore_weights()
                assert all(torch.equal(a, w) for a, w in zip(before, ws))
        finally:
            close(run)
    (m1, c1, o1, w1, _k1), (m0, c0, o0, w0, _k0) = res[True], res[False]
    for a, b in zip(m1, m0):
        num = {k: v for k, v in a.items() if isinstance(v, float) and not any(t in k for t in ("time", "second", "per_s"))}
        assert num and all(v == b[k] for k, v in num.items()), [(k, v, b[k]) for k, v in num.items() if v != b[k]]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(s, t) for (a, s), (b, t) in zip(c1, c0))
    assert len(o1) == len(o0) and all(torch.equal(a, b) for a, b in zip(o1, o0))
    assert all(torch.equal(a, b) for a, b in zip(w1, w0))


def test_train_seq_len_rule():
    """algo.pad_tokens_to: auto pads FP8-on-GPU micro-batches to a multiple of 16 tokens (the GEMMs' row
    alignment), never past max_position_embeddings; explicit multiples and 0 (off)."""
    from megatron_jetrl.trainer.actor import padded_length, train_seq_len

    assert padded_length(1049, 8, 512) == 1088 and padded_length(1049, 1, 512) == 1536
    assert padded_length(1049, 3, 512) == 1536 and padded_length(1049, 4, 512) == 1152  # 4 x 1152 = 9 x 512
    assert train_seq_len(1049, 8, -1, True, 8192) == 1050  # 8 x 1050 = 525 x 16
    assert train_seq_len(1049, 1, -1, True, 8192) == 1056
    assert train_seq_len(1028, 8, -1, True, 8192) == 1028  # 8 x 1028: aligned (the RL step's shape)
    assert train_seq_len(1049, 1, -1, True, 1050) == 1049  # 1056 passes max_position_embeddings: as is
    assert train_seq_len(1049, 8, -1, False, 8192) == 1049  # bf16 / CPU: off
    assert train_seq_len(1049, 8, 0, True, 8192) == 1049
    assert train_seq_len(1049, 8, 512, False, 8192) == 1088  # 8 x 1088 = 17 x 512
    assert train_seq_len(11, 2, 64, False, 64) == 32 and train_seq_len(40, 2, 64, False, 60) == 40  # 64 > max: as is


@pytest.mark.parametrize("mode", ["bf16", "jet"])
def test_padded_microbatches_equal_the_unpadded(mode, tmp_path, megatron_single):
    """Right-padding each micro-batch (algo.pad_tokens_to) changes nothing the trainer reports: the same
    logprobs, policy loss, entropy and (bf16) weight gradients as the unpadded batch; jet's
    weight gradient sees the pad tokens in its last 128-token block's scale only (grad norm within 1%)."""
    from megatron_jetrl.trainer.actor import build_batch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 60, (n,), generator=g).tolist() for n in (3, 5, 4, 6)]
    responses = [torch.randint(1, 60, (n,), generator=g).tolist() for n in (6, 4, 7, 5)]
    res = {}
    for pad in (0, 64):
        run = _tiny_run(tmp_path / str(pad), "steps=1", "algo.sft_warmup_steps=0", f"precision.mode={mode}",
                        "algo.micro_batch_size=2", f"algo.pad_tokens_to={pad}")
        try:
            actor = run.actor
            dev = next(actor.module.parameters()).device
            batch = build_batch(prompts, responses, [[-1.0] * len(r) for r in responses],
                                torch.tensor([1.0, -1.0, 0.5, -0.5]), 0, dev)
            assert actor.seq_len(batch) == (32 if pad else 10)  # S - 1 = 10; 2 x 32 = 64 tokens
            logp = actor.compute_logprobs(batch)
            assert logp.shape == (4, 10)
            batch.old_logp = logp - 0.1 * batch.mask  # ratios off 1: some tokens clipped
            m = actor.train_step(batch)
            res[pad] = (logp, m, [p.main_grad.detach().clone() for p in actor.module.parameters()])
        finally:
            from megatron_jetrl.train import close

            close(run)
    (lp0, m0, w0), (lp1, m1, w1) = res[0], res[64]
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    for k in ("pg_loss", "entropy"):
        assert abs(m1[k] - m0[k]) <= 1e-5 * max(1.0, abs(m0[k])), (k, m1[k], m0[k])
    if mode == "bf16":  # the weight gradients megatron's DDP accumulated (fp32 main_grad)
        assert abs(m1["grad_norm"] - m0["grad_norm"]) <= 1e-5 * m0["grad_norm"]
        for a, b in zip(w1, w0):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()) + 1e-12)
    else:
        assert m0["grad_norm"] > 0 and abs(m1["grad_norm"] - m0["grad_norm"]) <= 0.01 * m0["grad_norm"]
