"""The rollout fleet over real HTTP on loopback: `jetrl serve` workers, the SGLang client, the
schedulers, fault handling; SGLang's own ServerArgs and request classes where they import."""
import ast
import base64
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch

from megatron_jetrl.rollout.base import SamplingParams
from megatron_jetrl.distributed import free_ports
from megatron_jetrl.rollout.sglang import SGLangClient, ServerError
from tests.hf_models import make_fp8_dir, make_hf_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    make_hf_model("qwen3", str(root / "bf16"), seed=5)
    return make_fp8_dir(str(root / "bf16"), str(root / "fp8"))


def _serve(model_dir, log_path, *extra, port=None):
    port = port or free_ports(1)
    log = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "megatron_jetrl.cli", "serve", "--model-path", model_dir,
                             "--port", str(port), "--params-dtype", "fp32", *extra],
                            env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = SGLangClient(f"http://127.0.0.1:{port}", timeout_s=60,
                          admin_api_key=extra[extra.index("--admin-api-key") + 1] if "--admin-api-key" in extra else None)
    deadline = time.monotonic() + 120
    while not client.healthy(timeout_s=2):
        assert proc.poll() is None and time.monotonic() < deadline, open(log_path).read()[-2000:]
        time.sleep(0.2)
    return proc, client


def _raw(url, body: bytes, headers=None):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _st_payload(tensors):
    from safetensors.torch import save

    return base64.b64encode(save(tensors)).decode()


def _sglang_linears(names) -> int:
    """Linears as SGLang holds them (q/k/v fused to qkv_proj, gate/up to gate_up_proj)."""
    return sum(1 for n in names if n.endswith(("q_proj.weight", "o_proj.weight", "gate_proj.weight", "down_proj.weight")))


PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9, 10, 11, 12, 13], [20, 21]]
SEEDS = [7, 8, 9, 10]


def test_serve_refuses_open_host_without_key(fp8_dir):
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "serve", "--model-path", fp8_dir,
                          "--host", "0.0.0.0"], env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--admin-api-key" in out.stderr.strip().splitlines()[-1]


def test_serve_answers_a_request_its_kv_cache_cannot_hold_with_400():
    """The decoder refuses a batch whose KV cache exceeds the GPU (a ConfigError naming the knobs): ``jetrl serve``
    answers 400 with that line, so the fleet stops at once (every server would refuse it) instead of retrying the
    chunk on the others as it does a 500."""
    from http.server import ThreadingHTTPServer
    from types import SimpleNamespace

    from megatron_jetrl.errors import ConfigError
    from megatron_jetrl.rollout.server import ServeEngine, make_handler

    line = "config error: rollout decode: a KV cache of 2 rows x 40 positions needs 9.0 GB, 1.0 GB free on the GPU"

    def refuse(prompts, params, seeds=None):
        raise ConfigError(line)

    state = object.__new__(ServeEngine)  # the request path alone: no model behind it
    state.model_cfg = SimpleNamespace(vocab_size=64, max_position_embeddings=128)
    state.engine = SimpleNamespace(generate=refuse)
    state.lock, state.running = threading.RLock(), threading.Event()
    state.running.set()
    state.offload_tags, state.sleep_s, state.served, state.weight_version = set(), 0.0, 0, "0"
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state, None, 1 << 20))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = SGLangClient(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=30)
        with pytest.raises(ServerError) as err:
            client.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=8, temperature=1.0))
        assert str(err.value).endswith(f"/generate: HTTP 400: {line}"), err.value
    finally:
        server.shutdown()
        server.server_close()


def test_serve_validates_requests_and_applies_updates_whole(fp8_dir, tmp_path):
    from megatron_jetrl.models.hf_io import HFCheckpoint

    proc, client = _serve(fp8_dir, tmp_path / "s.log", "--admin-api-key", "k3y", "--max-body-mb", "4")
    try:
        url = client.url
        before = client.generate(PROMPTS, PARAMS, SEEDS)
        assert [len(g.output_ids) for g in before] == [6] * 4 and client.get_weight_version() == "0"
        assert all(lp <= 0 for g in before for lp in g.output_logprobs)
        assert client.generate(PROMPTS, PARAMS, SEEDS)[2].output_ids == before[2].output_ids  # seeded

        # malformed requests: 4xx with one line, the server keeps serving
        assert _raw(url + "/generate", b"{not json")[0] == 400
        status, body = _raw(url + "/generate", json.dumps({"input_ids": [1, 2], "bogus": 1, "rid": "q",
                                                           "sampling_params": {"max_new_tokens": 2}}).encode())
        assert status == 200 and body["meta_info"]["id"] == "q"  # unknown top-level fields: ignored, as SGLang does
        status, body = _raw(url + "/generate", json.dumps({"input_ids": [[1, 2], [3]], "rid": "b",
                                                           "sampling_params": {"max_new_tokens": 2}}).encode())
        assert status == 200 and [o["meta_info"]["id"] for o in body] == ["b_0", "b_1"]  # SGLang's batch rids
        status, body = _raw(url + "/generate", json.dumps({"input_ids": [[1, 2], [3]], "sampling_params": [
            {"max_new_tokens": 2, "sampling_seed": 1}, {"max_new_tokens": 3, "sampling_seed": 2}]}).encode())
        assert status == 400 and body["error"]["message"].startswith("sampling_params: jetrl serve runs one setting")
        status, body = _raw(url + "/generate", json.dumps({"input_ids": [[1, 2], [3] * 600],
                                                           "sampling_params": {"max_new_tokens": 2}}).encode())
        assert status == 400 and "a prompt of 600" in body["error"]["message"]  # every prompt, not the first only
        status, body = _raw(url + "/generate", json.dumps({"input_ids": [[1, 2], []]}).encode())
        assert status == 400 and "input_ids" in body["error"]["message"]
        status, body = _raw(url + "/generate", json.dumps({"input_ids": [1], "sampling_params": {"min_p": 0.1}}).encode())
        assert status == 400 and body["error"]["message"].startswith("sampling_params.min_p")
        status, body = _raw(url + "/generate", b'{"input_ids": [' + b"1," * 2_500_000 + b"1]}")
        assert status == 413 and "--max-body-mb" in body["error"]["message"]

        # weight and memory endpoints need the key (generation does not)
        anon = SGLangClient(url)
        with pytest.raises(ServerError, match="HTTP 401"):
            anon.release_memory_occupation()

        # an update is applied whole or not at all, inside a weight-update session (SGLang's rule)
        ckpt = HFCheckpoint(fp8_dir)
        names = sorted(ckpt.keys())
        first = {n: ckpt.raw(n) for n in names[: len(names) // 2]}
        with pytest.raises(ServerError, match="HTTP 400: update_weights_from_tensor must run between begin_weight_update"):
            client.update_weights_from_tensor([_st_payload(first)], "jetrl_safetensors", "1", False)
        with pytest.raises(ServerError, match="HTTP 400: no weight-update session is open"):
            client.end_weight_update()
        client.begin_weight_update()
        with pytest.raises(ServerError, match="HTTP 400: a weight-update session is already open"):
            client.begin_weight_update()
        r = client.update_weights_from_tensor([_st_payload(first)], "jetrl_safetensors", "1", False)
        assert r["success"] and "staged" in r["message"] and client.get_weight_version() == "0"
        bad_name = names[len(names) // 2]
        bad = {bad_name: torch.zeros(3, dtype=ckpt.raw(bad_name).dtype)}
        with pytest.raises(ServerError, match=f"HTTP 400: {bad_name}: got \\(3,\\)"):
            client.update_weights_from_tensor([_st_payload(bad)], "jetrl_safetensors", "1", True)
        rest = {n: ckpt.raw(n) for n in names[len(names) // 2:]}
        r = client.update_weights_from_tensor([_st_payload(rest)], "jetrl_safetensors", "1", True)
        assert "staged" in r["message"] and client.get_weight_version() == "0"  # the first half was dropped
        assert client.generate(PROMPTS, PARAMS, SEEDS)[0].output_ids == before[0].output_ids

        # a full update with changed weights: version moves, the FP8 bytes served are the ones sent
        new = {n: ckpt.raw(n) for n in names}
        w = "model.layers.0.mlp.down_proj.weight"
        new[w] = torch.flip(new[w].view(torch.uint8), dims=[1]).contiguous().view(torch.float8_e4m3fn)
        chunks = [dict(list(new.items())[i:i + 10]) for i in range(0, len(new), 10)]
        for i, c in enumerate(chunks):
            r = client.update_weights_from_tensor([_st_payload(c)], "jetrl_safetensors", "2", i == len(chunks) - 1)
        assert r["message"] == "weights updated to version 2" and client.get_weight_version() == "2"
        client.end_weight_update()
        from megatron_jetrl.sync.sglang_checksum import ExpectedChecksums, compare

        # /weights_checker: SGLang's checksums of the served weights equal those of the bytes sent
        served = client.weights_checksum()
        exp, old = ExpectedChecksums(1, 4, 128), ExpectedChecksums(1, 4, 128)
        for k in new:
            exp.add(k, new[k])
            old.add(k, ckpt.raw(k))
        fused = _sglang_linears(new)
        assert compare(exp.ranks, served) == (fused, 0) and fused == 4 * 2  # two layers
        assert compare(old.ranks, served) == (fused, 1)  # the flipped down_proj is the one that differs
        assert "model.layers.0.self_attn.qkv_proj.weight" in served["ranks"][0]["checksums"]

        # disk: the same directory the fleet's disk transport writes
        r = client.update_weights_from_disk(fp8_dir, "3")
        assert r["success"] and client.get_weight_version() == "3"
        assert client.generate(PROMPTS, PARAMS, SEEDS)[3].output_ids == before[3].output_ids

        # release / resume: resident bytes go to 0, generation is refused, then comes back identical
        with pytest.raises(ServerError, match="HTTP 400: tags: kv_cache not released"):
            client.resume_memory_occupation(["kv_cache"])  # SGLang's scheduler dies on this
        client.release_memory_occupation()
        info = client.server_info()["jetrl"]
        assert info["memory_released"] == ["cuda_graph", "kv_cache", "weights"] and info["resident_bytes"] == 0
        with pytest.raises(ServerError, match="HTTP 503: memory released"):
            client.generate(PROMPTS, PARAMS, SEEDS)
        client.resume_memory_occupation(["weights"])
        assert client.server_info()["jetrl"]["resident_bytes"] > 0
        with pytest.raises(ServerError, match=r"HTTP 503: memory released \(cuda_graph, kv_cache\)"):
            client.generate(PROMPTS, PARAMS, SEEDS)
        client.resume_memory_occupation(["kv_cache", "cuda_graph"])
        assert client.generate(PROMPTS, PARAMS, SEEDS)[1].output_ids == before[1].output_ids
        assert proc.poll() is None
    finally:
        proc.kill()


@pytest.mark.parametrize("router", [False, True], ids=["fleet", "sglang-router"])
def test_fleet_survives_a_killed_server(router, fp8_dir, tmp_path):
    """Kill a server mid-rollout: its chunks are retried elsewhere (same seeds: the same samples,
    none lost or doubled), it is restarted, and it gets the current weights before it serves. With
    ``rollout.router`` the real sglang-router sits in front of the two workers."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.hf_io import HFCheckpoint
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.rollout.sglang import RolloutFleet, SGLangClient, ServerError

    if router:
        pytest.importorskip("sglang_router", reason="sglang-router is not installed (tools/setup_env.sh installs it)")
    cfg = load_config(None, ["rollout.engine=serve", "rollout.num_servers=2", "rollout.chunk_size=1",
                             "rollout.weight_transport=tensor", "precision.params_dtype=fp32",
                             f"rollout.router={str(router).lower()}", "rollout.admin_api_key=fl33t-k3y",
                             "scheduler.mode=disaggregated", f"logging.run_dir={tmp_path}"])
    fleet = RolloutFleet(cfg, FP8Recipe(mode="jet"), str(tmp_path), fp8_dir, colocated=False)
    assert not any("fl33t-k3y" in " ".join(s.cmd) for s in fleet.servers)  # the key reaches them in their environment
    taken = None
    if router:  # another process binds the router's port before the router does: it starts on another one
        import socket
        from urllib.parse import urlparse

        taken = socket.socket()
        taken.bind(("127.0.0.1", urlparse(fleet.router.client.url).port))
        taken.listen()
        first_url = fleet.router.client.url
    fleet.start()
    try:
        if router:
            assert fleet.router.up and fleet.router.client.url != first_url
        prompts = [[i % 50 + 1, 3, 5] for i in range(8)]
        reference = fleet.generate(prompts, PARAMS, seed=100)
        victim = fleet.servers[1]
        victim.client.request("/slow_down", {"forward_sleep_time": 1.5})
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("gens", fleet.generate(prompts, PARAMS, seed=100)))
        th.start()
        time.sleep(1.0)  # the victim is inside a chunk
        os.killpg(victim.proc.pid, signal.SIGKILL)
        th.join(120)
        gens = out["gens"]
        assert [g.prompt_ids for g in gens] == prompts
        assert [g.output_ids for g in gens] == [g.output_ids for g in reference]  # same samples, none doubled
        if not router:
            assert fleet.metrics["fleet_retries"] >= 1 and not victim.up
            assert {g.meta["server"] for g in gens} == {fleet.servers[0].client.url}

        assert fleet.heal() == 1 and victim.up and victim.restarts == 1
        with pytest.raises(ServerError, match="401"):  # the restarted worker guards its admin endpoints with the key
            SGLangClient(victim.client.url, 30).request("/slow_down", {"forward_sleep_time": None})
        ckpt = HFCheckpoint(fp8_dir)
        m = fleet.push_weights(1, ((n, ckpt.raw(n)) for n in ckpt.keys()))
        assert m["parity_checked"] == 2 * _sglang_linears(ckpt.keys())  # SGLang's fused params, per server
        assert m["parity_mismatch"] == 0
        assert [s.client.get_weight_version() for s in fleet.servers] == ["1", "1"]
        again = fleet.generate(prompts, PARAMS, seed=100)
        assert [g.output_ids for g in again] == [g.output_ids for g in reference]
        if not router:
            assert len({g.meta["server"] for g in again}) == 2
        else:  # the router takes the restarted server back (its health check runs every 5 s)
            before = victim.client.server_info()["jetrl"]["requests_served"]
            deadline = time.monotonic() + 60
            while victim.client.server_info()["jetrl"]["requests_served"] == before:
                assert time.monotonic() < deadline, "the router never routed to the restarted server"
                fleet.generate(prompts, PARAMS, seed=100)
    finally:
        fleet.shutdown()
        if taken is not None:
            taken.close()


def test_fleet_restarts_a_hung_server(fp8_dir, tmp_path):
    """A server that stops answering within rollout.request_timeout_s (its /health still answers)
    has its chunks retried elsewhere and is restarted by the next heal."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.rollout.sglang import RolloutFleet

    cfg = load_config(None, ["rollout.engine=serve", "rollout.num_servers=2", "rollout.chunk_size=2",
                             "rollout.request_timeout_s=3", "precision.params_dtype=fp32",
                             "scheduler.mode=disaggregated", f"logging.run_dir={tmp_path}"])
    fleet = RolloutFleet(cfg, FP8Recipe(mode="jet"), str(tmp_path), fp8_dir, colocated=False)
    fleet.start()
    try:
        prompts = [[i + 1, 7] for i in range(8)]
        reference = fleet.generate(prompts, PARAMS, seed=3)
        victim = fleet.servers[0]
        victim.client.request("/slow_down", {"forward_sleep_time": 30.0})
        gens = fleet.generate(prompts, PARAMS, seed=3)
        assert [g.output_ids for g in gens] == [g.output_ids for g in reference]
        assert victim.hung and not victim.up and victim.client.healthy()  # hung, yet /health answers
        old_pid = victim.proc.pid
        assert fleet.heal() == 1 and victim.up and not victim.hung and victim.proc.pid != old_pid
        assert [g.output_ids for g in fleet.generate(prompts, PARAMS, seed=3)] == [g.output_ids for g in reference]
    finally:
        fleet.shutdown()


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("extra", [
    ["scheduler.mode=disaggregated", "rollout.num_servers=2", "rollout.weight_transport=distributed"],
    ["scheduler.mode=disaggregated", "rollout.num_servers=2", "rollout.weight_transport=disk",
     "scheduler.async_rollout=true"],
    ["scheduler.mode=colocated", "rollout.num_servers=1", "rollout.weight_transport=tensor"],
    ["scheduler.mode=colocated", "rollout.num_servers=1", "rollout.weight_transport=tensor", "precision.kv_cache=fp8"],
    ["scheduler.mode=disaggregated", "rollout.num_servers=2", "rollout.weight_transport=distributed",
     "precision.exact=true"],
    ["scheduler.mode=colocated", "rollout.num_servers=1", "rollout.weight_transport=tensor", "precision.kv_cache=fp8",
     "precision.exact=true"],
], ids=["disagg-broadcast", "disagg-disk-async", "colocated-tensor", "colocated-tensor-fp8kv", "disagg-broadcast-exact",
        "colocated-tensor-fp8kv-exact"])
def test_train_over_a_fleet(extra, tmp_path):
    """Training over ``jetrl serve`` workers, per scheduler and weight transport: the FP8 bytes verified after
    every push, the train-rollout mismatch at the emulation's rounding level; with ``precision.kv_cache=fp8`` the
    workers run the FP8 KV cache (``--kv-cache-dtype fp8_e4m3``) and the trainer's attention reads its values; with
    ``precision.exact=true`` the workers run exact mode (``--exact``) and every sampled token's logprob, sent over
    HTTP, is the trainer's bit for bit (mismatch mean and max exactly 0 in every step)."""
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", "--preset", "tiny",
                          "--run-dir", str(run_dir), "steps=3", "algo.sft_warmup_steps=1", "rollout.engine=serve",
                          "rollout.prompts_per_step=4", "rollout.chunk_size=8", *extra],
                         env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _metrics(run_dir)
    rl = [r for r in rows if r.get("is_rl") == 1.0]
    assert len(rl) == 3
    for r in rows[0:1] + rl:  # the push after the warm-up and after every RL step
        assert r["parity_checked"] > 0 and r["parity_mismatch"] == 0
    n_servers = 2 if "rollout.num_servers=2" in extra else 1
    assert all(r["fleet_servers_up"] == n_servers and r["fleet_retries"] == 0 for r in rl)
    if "scheduler.async_rollout=true" in extra:
        assert [r["rollout_staleness"] for r in rl] == [0.0, 1.0, 1.0]
    elif "precision.exact=true" in extra:
        assert all(r["mismatch_abs_mean"] == 0 and r["mismatch_abs_max"] == 0 for r in rl), rl
    else:
        assert all(r["mismatch_abs_mean"] < 1e-4 for r in rl)  # the same FP8 bytes on both sides
    if "scheduler.mode=colocated" in extra:
        assert all(r["trainer_offloaded_gb"] > 0 for r in rl)
    logs = os.listdir(run_dir / "rollout_logs")
    assert len(logs) == n_servers
    # the servers are gone when the run ends
    log = (run_dir / "rollout_logs" / "server0.log").read_text()
    assert "jetrl serve: ready" in log and ("FP8 KV cache" in log) is ("precision.kv_cache=fp8" in extra)
    assert ("exact, " in log) is ("precision.exact=true" in extra)


def test_serve_exact_refuses_a_moe_model_at_start(tmp_path):
    """``jetrl serve --exact`` where the exact kernels run (the GPU; Triton's interpreter here) refuses a MoE model
    when it starts, with one line (its router's GEMM is not batch-invariant there), not at its first request."""
    make_hf_model("qwen3_moe", str(tmp_path / "bf16"))
    fp8 = make_fp8_dir(str(tmp_path / "bf16"), str(tmp_path / "fp8"))
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "serve", "--model-path", fp8, "--port",
                          str(free_ports(1)), "--params-dtype", "fp32", "--exact"], env=dict(ENV, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == ("jetrl serve: --exact: precision.exact: the MoE router's GEMM is "
                                                   "not batch-invariant on the GPU; set precision.exact=false for MoE "
                                                   "models"), out.stderr[-2000:]


def test_exact_fleet_refuses_a_worker_that_does_not_decode_exactly(fp8_dir, tmp_path):
    """``precision.exact`` over attached ``jetrl serve`` workers: one started without ``--exact`` (its
    ``/server_info`` says ``jetrl.exact`` false) is refused at attach with one line naming the fix; one started
    with it attaches."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.rollout.sglang import RolloutFleet

    for flags, ok in (((), False), (("--exact",), True)):
        proc, client = _serve(fp8_dir, tmp_path / "server.log", *flags)
        try:
            assert client.server_info()["jetrl"]["exact"] is ok
            cfg = load_config(None, ["rollout.engine=serve", f"rollout.server_addresses=[{client.url}]",
                                     "precision.exact=true", "scheduler.mode=disaggregated",
                                     f"logging.run_dir={tmp_path}"])
            fleet = RolloutFleet(cfg, FP8Recipe(mode="jet", exact=True), str(tmp_path), None, colocated=False)
            if ok:
                fleet.start()
                assert fleet.servers[0].up
            else:
                with pytest.raises(ServerError, match=r"precision.exact needs rollout workers that decode with the "
                                                      r"trainer's kernels.*start it with jetrl serve --exact$"):
                    fleet.start()
            fleet.shutdown()
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["colocated", "disagg-async"])
def test_pipeline_parallel_trainer_over_a_fleet(asynchronous, tmp_path):
    """The 70B plan's shape in small: a PP=2 trainer under torchrun (2 gloo ranks, one layer each) starting its
    own `jetrl serve` worker. The server must not join the trainer's rendezvous (it inherited torchrun's
    RANK/MASTER_PORT and hung there); the first stage has no logprobs (mismatch metrics on the last stage only);
    the fleet is asked once per step for both stages (the second stage gets the first's generations: in the
    one-step-ahead mode the first stage's worker thread generates and the main thread broadcasts), and the
    logging rank (the last) sees rank 0's hand-over metrics (FP8 parity)."""
    from megatron_jetrl.distributed import free_port

    run_dir, steps = tmp_path / "run", 3 if asynchronous else 2
    extra = ["scheduler.mode=disaggregated", "scheduler.async_rollout=true"] if asynchronous else []
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), "-m", "megatron_jetrl.cli", "train", "--preset", "tiny",
                          "--run-dir", str(run_dir), f"steps={steps}", "algo.sft_warmup_steps=1", "rollout.engine=serve",
                          "rollout.num_servers=1", "rollout.weight_transport=disk", "parallel.pipeline_parallel=2",
                          "rollout.prompts_per_step=2", "rollout.chunk_size=64", "eval.interval=0", *extra],
                         env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _metrics(run_dir)
    rl = [r for r in rows if r.get("is_rl") == 1.0]
    assert [r.get("is_rl") for r in rows] == [0.0] + [1.0] * steps
    for r in rl:
        assert r["parity_checked"] > 0 and r["parity_mismatch"] == 0 and r["fleet_servers_up"] == 1
    if asynchronous:
        assert [r["rollout_staleness"] for r in rl] == [0.0, 1.0, 1.0]
    else:
        assert all(r["mismatch_abs_mean"] < 1e-4 for r in rl)  # the same FP8 bytes on both sides
    log = (run_dir / "rollout_logs" / "server0.log").read_text()
    assert "jetrl serve: ready" in log
    # one request per RL step (16 prompts, one chunk), not one per stage
    assert log.count("generate #") == steps, log[-2000:]


def test_actor_offload_reload_is_bit_identical(tmp_path, megatron_single):
    from megatron_jetrl.config import load_config
    from megatron_jetrl.memory import model_tensors, optimizer_tensors
    from megatron_jetrl.train import close, setup, sft_step

    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"),
                      [f"logging.run_dir={tmp_path}", "steps=1", "algo.sft_warmup_steps=2", "rollout.prompts_per_step=2"])
    run = setup(cfg)
    try:
        sft_step(run)  # optimizer state exists
        actor = run.actor
        tensors = model_tensors(actor.module) + optimizer_tensors(actor.optimizer)
        before = [t.detach().clone() for t in tensors]
        released = actor.offload()
        assert released >= sum(p.numel() * 4 * 3 for p in actor.module.parameters())  # params, master/grad, Adam
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
        assert actor.reload() == released
        assert all(torch.equal(a, b) for a, b in zip(before, tensors))
        assert torch.isfinite(torch.tensor(sft_step(run)["sft_loss"]))
    finally:
        close(run)


# ----------------------------------------------------------------------------------------------
# Against SGLang's own code


def _sglang_file(rel):
    try:
        return str(importlib.metadata.distribution("sglang").locate_file(f"sglang/srt/{rel}"))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sglang is not installed (tools/setup_env.sh installs it with --no-deps)")


def _io_struct_fields() -> dict[str, set]:
    tree = ast.parse(open(_sglang_file("managers/io_struct.py")).read())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return out


def _http_routes() -> set[str]:
    tree = ast.parse(open(_sglang_file("entrypoints/http_server.py")).read())
    routes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "post", "api_route"):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                routes.add(node.args[0].value)
    return routes


def test_fleet_takes_the_admin_key_from_the_environment(monkeypatch):
    """`jetrl launch` hands the trainer the fleet's admin key as JETRL_ADMIN_API_KEY (its run config holds none): the
    fleet's clients send it; a key in the config wins."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.rollout.sglang import RolloutFleet

    monkeypatch.setenv("JETRL_ADMIN_API_KEY", "from-env")
    urls = ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    cfg = load_config(None, ["rollout.engine=sglang", f"rollout.server_addresses={json.dumps(urls)}"])
    fleet = RolloutFleet(cfg, FP8Recipe(), "/nonexistent", None, colocated=False)
    assert [s.client.admin_api_key for s in fleet.servers] == ["from-env", "from-env"]
    cfg = load_config(None, ["rollout.engine=sglang", f"rollout.server_addresses={json.dumps(urls)}",
                             "rollout.admin_api_key=from-config"])
    assert RolloutFleet(cfg, FP8Recipe(), "/nonexistent", None, colocated=False).servers[0].client.admin_api_key == \
        "from-config"


def test_weight_update_group_address_is_reachable_from_other_nodes(monkeypatch):
    """The broadcast push tells each server where the group's store listens: this machine's address on its route to
    that server (for a loopback server, loopback), not its host name's address, which on this machine (as under
    Debian's default /etc/hosts) is 127.0.0.1 and would send a server on another node to itself."""
    import socket

    import megatron_jetrl.distributed as distributed
    from megatron_jetrl.rollout.sglang import Server
    from megatron_jetrl.sync.server_push import DistributedBroadcastPush

    remote = "10.255.255.1"  # a host on another node (a UDP connect picks the route and sends nothing)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((remote, 9))
        except OSError:
            pytest.skip("this machine has no route off itself")
    assert distributed.address_toward("127.0.0.1") == distributed.address_toward("localhost") == "127.0.0.1"
    mine = distributed.address_toward(remote)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((mine, 0))  # one of this machine's own addresses
    assert not mine.startswith("127.")
    asked = []
    monkeypatch.setattr(distributed, "init_custom_group", lambda *a, **k: object())
    monkeypatch.setattr(SGLangClient, "init_weights_update_group", lambda self, addr, *a: asked.append((self.url, addr)))
    servers = [Server(SGLangClient(f"http://{remote}:30000"), tp=2), Server(SGLangClient("http://127.0.0.1:30001"))]
    DistributedBroadcastPush(1 << 20).ensure_group(servers)
    assert sorted(asked) == [("http://10.255.255.1:30000", mine), ("http://127.0.0.1:30001", "127.0.0.1")]


def test_client_requests_match_sglang_source(monkeypatch):
    """Every request the client sends goes to a route SGLang's http_server defines, with fields of
    the io_struct class that route parses; jetrl serve accepts the same field sets."""
    from megatron_jetrl.rollout.server import GENERATE_PASSTHROUGH, REQUEST_FIELDS

    fields, routes = _io_struct_fields(), _http_routes()
    sent = []
    monkeypatch.setattr(SGLangClient, "request", lambda self, path, body=None, **kw: sent.append((path, body)) or {})
    c = SGLangClient("http://x")
    c.begin_weight_update()
    c.end_weight_update()
    c.weights_checksum()
    c.update_weights_from_disk("/m", "1")
    c.update_weights_from_tensor(["YQ=="], "flattened_bucket", "1", True)
    c.init_weights_update_group("127.0.0.1", 1234, 1, 3, "g", "nccl")
    c.update_weights_from_distributed(["a"], ["bfloat16"], [[2, 2]], "1", "g", True)
    c.destroy_weights_update_group("g")
    c.pause_generation()
    c.continue_generation()
    c.release_memory_occupation(["weights"])
    c.resume_memory_occupation(["kv_cache"])
    c.flush_cache()
    c.request("/slow_down", {"forward_sleep_time": 1.0})
    try:
        c.generate([[1, 2]], SamplingParams(max_new_tokens=2, top_k=5, stop_token_ids=(3,)), seeds=[1], rid="r")
    except ServerError:
        pass  # the stub answers {}, which the parser refuses: we only record the request here
    assert len(sent) == 15
    for path, body in sent:
        assert path in routes, path
        if path == "/flush_cache":
            continue
        cls, accepted = REQUEST_FIELDS[path]
        assert set(body) <= fields[cls], (path, set(body) - fields[cls])
        assert set(body) <= accepted, (path, set(body) - accepted)
        own = accepted - GENERATE_PASSTHROUGH if path == "/generate" else accepted  # minus what routers add
        assert own <= fields[cls], (path, own - fields[cls])
    gen = dict(sent)["/generate"]
    sp_fields = _sampling_param_fields()
    assert all(set(row) <= sp_fields for row in gen["sampling_params"])
    for path in ("/health_generate", "/model_info", "/server_info"):
        assert path in routes


def _sampling_param_fields() -> set:
    tree = ast.parse(open(_sglang_file("sampling/sampling_params.py")).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)}


def test_generate_response_parser_matches_sglang_shapes():
    from megatron_jetrl.rollout.sglang import parse_generate_response

    # the shape tokenizer_manager builds: meta_info.output_token_logprobs = [(logprob, id, text|None)]
    ans = [{"text": "", "output_ids": [4, 2], "meta_info": {"id": "r-0", "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": 3, "weight_version": "7", "output_token_logprobs": [[-0.5, 4, None], [-1.0, 2, None]]}}]
    g = parse_generate_response(ans, [[1, 2, 3]])[0]
    assert (g.output_ids, g.output_logprobs, g.finish_reason, g.weight_version) == ([4, 2], [-0.5, -1.0], "stop", 7)
    ans[0]["meta_info"]["output_token_logprobs"][1][1] = 9
    with pytest.raises(ServerError, match="do not match output_ids"):
        parse_generate_response(ans, [[1, 2, 3]])
    with pytest.raises(ServerError, match="expected 2 results"):
        parse_generate_response([], [[1], [2]])


def test_sglang_launch_args_parse_with_real_server_args(fp8_dir, tmp_path):
    """Our launch arguments, parsed by SGLang's own ``prepare_server_args`` into its ServerArgs; the admin key of the
    servers a trainer starts reaches them through a file, not their command line."""
    from sglang.srt.server_args import prepare_server_args

    from megatron_jetrl.config import load_config
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.rollout.sglang import RolloutFleet, sglang_server_argv

    cfg = load_config(None, ["rollout.engine=sglang", "rollout.server_tp=2", "model.num_key_value_heads=4",
                             "rollout.mem_fraction=0.6", "rollout.num_servers=2",
                             "rollout.deterministic=true", "rollout.admin_api_key=s3cret", "seed=7",
                             "rollout.decode_rows=96"])
    for mode, colocated in (("jet", True), ("bf16", False)):
        # the servers a trainer starts: the key from the run directory's 0600 file through SGLang's own --config
        fleet = RolloutFleet(cfg, FP8Recipe(mode=mode), str(tmp_path), fp8_dir, colocated=colocated, trainer_gpus=4)
        assert [s.cmd[s.cmd.index("--base-gpu-id") + 1] for s in fleet.servers] == (["0", "2"] if colocated else ["4", "6"])
        argv = sglang_server_argv(cfg, FP8Recipe(mode=mode), fp8_dir, 31234, base_gpu_id=4, colocated=colocated,
                                  key_file=fleet.servers[0].cmd[-1])
        assert "s3cret" not in " ".join(fleet.servers[0].cmd) and fleet.servers[0].cmd[-2:] == argv[-2:]
        assert os.stat(argv[-1]).st_mode & 0o777 == 0o600
        sa = prepare_server_args(argv)  # what sglang.launch_server runs on its argv
        assert (sa.model_path, sa.port, sa.tp_size, sa.mem_fraction_static, sa.base_gpu_id) == (fp8_dir, 31234, 2, 0.6, 4)
        assert sa.quantization == ("fp8" if mode == "jet" else None) and sa.dtype == "bfloat16"
        assert sa.enable_memory_saver is colocated and sa.enable_deterministic_inference is True
        assert sa.skip_tokenizer_init and sa.random_seed == 7 and sa.admin_api_key == "s3cret"
        assert sa.host == "127.0.0.1" and sa.weight_version == "0" and sa.max_running_requests == 96
    cfg.rollout.decode_rows = 0  # as many as fit: SGLang's own default
    assert prepare_server_args(sglang_server_argv(cfg, FP8Recipe(mode="jet"), fp8_dir, 31234)).max_running_requests is None
    # the launch directory's config.json carries the recipe's block quantization_config
    with open(os.path.join(fp8_dir, "config.json")) as f:
        assert json.load(f)["quantization_config"] == FP8Recipe(mode="jet").hf_quantization_config()


def test_serve_launch_args_parse_with_jetrl_serve_parser():
    """A ``jetrl serve`` fleet's worker arguments, parsed by ``jetrl serve``'s own parser: the FP8 KV cache, exact
    mode and ``rollout.decode_rows`` (SGLang's ``--max-running-requests``) reach the worker; a bound under one row is
    refused in one line before the model loads."""
    import argparse

    from megatron_jetrl.config import load_config
    from megatron_jetrl.rollout.server import add_serve_args, serve
    from megatron_jetrl.rollout.sglang import serve_argv

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    cfg = load_config(None, ["rollout.engine=serve", "precision.kv_cache=fp8", "precision.exact=true",
                             "rollout.decode_rows=48", "seed=3"])
    args = parser.parse_args(serve_argv(cfg, "/ckpt", 31000, index=2))
    assert (args.model_path, args.port, args.seed, args.kv_cache_dtype, args.exact) == ("/ckpt", 31000, 5, "fp8_e4m3", True)
    assert args.max_running_requests == 48
    cfg = load_config(None, ["rollout.engine=serve"])
    assert parser.parse_args(serve_argv(cfg, "/ckpt", 31000, index=0)).max_running_requests is None
    with pytest.raises(SystemExit, match="^jetrl serve: --max-running-requests 0: give at least 1 row$"):
        serve(parser.parse_args(["--model-path", "/ckpt", "--max-running-requests", "0"]))


# ----------------------------------------------------------------------------------------------
# rollout.engine=sglang against servers that follow SGLang 0.5.23's rules (jetrl serve)


@pytest.fixture(scope="module")
def tiny_rollout_dir(tmp_path_factory):
    """The tiny preset's initial weights as its rollout receives them (block FP8, HF layout): what the
    servers of an attached fleet are launched from."""
    run_dir = tmp_path_factory.mktemp("tiny0")
    code = ("import torch\n"
            "from megatron_jetrl.config import load_config\n"
            "from megatron_jetrl.train import setup, close\nfrom megatron_jetrl.sync.handover import disk_push\n"
            "from megatron_jetrl.sync.export import ExportOptions, iter_hf_tensors\n"
            f"cfg = load_config({os.path.join(REPO, 'examples/configs/tiny.yaml')!r}, ['logging.run_dir={run_dir}'])\n"
            "run = setup(cfg)\n"  # what an SGLang server gets: FP8 linears, the rest in BF16
            "path, _ = disk_push(run, 0, iter_hf_tensors(run.actor.module, cfg.model, "
            "ExportOptions(fp8=True, dtype=torch.bfloat16)))\n"
            "close(run)\nprint(path)\n")
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("mode,transport", [("disaggregated", "distributed"), ("disaggregated", "disk"),
                                            ("colocated", "distributed"), ("colocated", "disk")])
def test_train_with_sglang_engine_on_sglang_rules_servers(mode, transport, tiny_rollout_dir, tmp_path):
    """`jetrl train --preset tiny rollout.engine=sglang`, attached to two servers that follow SGLang
    0.5.23's rules (weight-update sessions, memory tags, per-row seeds, /weights_checker), completes in
    both scheduler modes with each transport SGLang takes; the FP8 checksums match after every push."""
    procs = [_serve(tiny_rollout_dir, tmp_path / f"s{i}.log", "--params-dtype", "bf16") for i in range(2)]
    try:
        urls = ",".join(c.url for _, c in procs)
        out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", "--preset", "tiny",
                              "--run-dir", str(tmp_path / "run"), "steps=2", "algo.sft_warmup_steps=1",
                              "rollout.engine=sglang", f"rollout.server_addresses=[{urls}]",
                              f"scheduler.mode={mode}", f"rollout.weight_transport={transport}",
                              "rollout.prompts_per_step=4", "rollout.chunk_size=8"],
                             env=ENV, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        rows = _metrics(tmp_path / "run")
        assert [r.get("is_rl") for r in rows] == [0.0, 1.0, 1.0, None]  # and the evaluation after the last step
        rows, final = rows[:-1], rows[-1]
        assert 0 <= final["eval/accuracy"] <= 1  # the trained policy, on the servers
        for r in rows:  # the push after the warm-up and after each RL step
            assert r["parity_checked"] == 2 * 2 * 4 and r["parity_mismatch"] == 0  # 2 servers x 2 layers x 4
        rl = rows[1:]
        assert all(r["fleet_servers_up"] == 2 and r["fleet_retries"] == 0 for r in rl)
        # the same FP8 linears; SGLang's embeddings, norms and head are BF16 where this trainer's are fp32
        assert all(r["mismatch_abs_mean"] < 0.02 for r in rl)
        if mode == "colocated":
            assert all(r["trainer_offloaded_gb"] > 0 for r in rl)
        for proc, client in procs:
            assert proc.poll() is None and client.get_weight_version() == "3"
            assert "requests_served" in client.server_info()["jetrl"]
    finally:
        for proc, _ in procs:
            proc.kill()


def test_train_refuses_an_unsupported_sglang_version(tmp_path):
    """A server that reports another SGLang release stops the run at attach time with one line."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Old(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"version": "0.4.6"} if self.path == "/server_info" else {}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Old)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", "--preset", "tiny",
                              "--run-dir", str(tmp_path / "run"), "steps=1", "algo.sft_warmup_steps=0",
                              "rollout.engine=sglang", f"rollout.server_addresses=[http://127.0.0.1:{srv.server_address[1]}]",
                              "scheduler.mode=disaggregated"], env=ENV, capture_output=True, text=True, timeout=300)
    finally:
        srv.shutdown()
    assert out.returncode == 3
    last = out.stderr.strip().splitlines()[-1]
    assert "SGLang 0.4.6 is not supported" in last and "sglang==0.5.23" in last


# ----------------------------------------------------------------------------------------------
# Faults around the phases


def test_colocated_fleet_survives_a_server_killed_between_steps(fp8_dir, tmp_path):
    """A worker killed while the trainer trains (its memory released): the rollout's resume leaves it out
    instead of ending the run, generation goes to the others, and the next push restarts it and brings it to
    the current weights."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.hf_io import HFCheckpoint
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.rollout.sglang import RolloutFleet

    cfg = load_config(None, ["rollout.engine=serve", "rollout.num_servers=2", "rollout.chunk_size=2",
                             "rollout.weight_transport=tensor", "precision.params_dtype=fp32",
                             "model.num_key_value_heads=4", f"logging.run_dir={tmp_path}"])
    fleet = RolloutFleet(cfg, FP8Recipe(mode="jet"), str(tmp_path), fp8_dir, colocated=True)
    fleet.start()
    try:
        ckpt = HFCheckpoint(fp8_dir)
        prompts = [[i + 1, 3] for i in range(6)]
        fleet.push_weights(1, ((n, ckpt.raw(n)) for n in ckpt.keys()))
        fleet.resume_memory()
        reference = fleet.generate(prompts, PARAMS, seed=5)
        fleet.release_memory()  # training
        victim = fleet.servers[1]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        fleet.resume_memory()  # the next rollout
        assert not victim.up and fleet.servers[0].up
        gens = fleet.generate(prompts, PARAMS, seed=5)
        assert [g.output_ids for g in gens] == [g.output_ids for g in reference]  # per-row seeds
        fleet.release_memory()
        fleet.resume_memory(["weights"])  # the hand-over
        assert fleet.heal() == 1 and victim.up and victim.restarts == 1
        m = fleet.push_weights(2, ((n, ckpt.raw(n)) for n in ckpt.keys()))
        assert m["parity_mismatch"] == 0 and m["parity_checked"] == 2 * _sglang_linears(ckpt.keys())
        assert [s.client.get_weight_version() for s in fleet.servers] == ["2", "2"]
    finally:
        fleet.shutdown()


def test_servers_die_with_their_launcher(fp8_dir, tmp_path):
    """A trainer killed with SIGKILL takes its rollout workers with it (they run in their own session)."""
    script = (f"import sys, time\nsys.path.insert(0, {REPO!r})\n"
              "from megatron_jetrl.rollout.sglang import Server, SGLangClient\n"
              "from megatron_jetrl.distributed import free_port\n"
              "port = free_port()\n"
              f"s = Server(SGLangClient(f'http://127.0.0.1:{{port}}'), [sys.executable, '-m', 'megatron_jetrl.cli', "
              f"'serve', '--model-path', {fp8_dir!r}, '--port', str(port), '--params-dtype', 'fp32'], "
              f"{str(tmp_path / 's.log')!r})\n"
              "s.start(); s.wait_healthy(120); print(s.proc.pid, flush=True); time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], env=ENV, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split(") ")[1].startswith("Z"):  # exited, waiting to be reaped by init
                break
        time.sleep(0.2)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the server outlived its launcher")


def test_serve_refuses_bad_values_and_holds_64_clients(fp8_dir, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from megatron_jetrl.models.hf_io import HFCheckpoint

    import psutil

    proc, client = _serve(fp8_dir, tmp_path / "s.log")
    try:
        url = client.url
        listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("inet") if c.status == "LISTEN"]
        assert listening and all(a.ip == "127.0.0.1" for a in listening), listening  # loopback only, no store port
        for body, field in (({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "8"}},
                             "sampling_params.max_new_tokens: expected a integer"),
                            ({"input_ids": "12"}, "input_ids: expected a list"),
                            ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob: expected a boolean")):
            status, ans = _raw(url + "/generate", json.dumps(body).encode())
            assert status == 400 and ans["error"]["message"].startswith(field), ans
        status, ans = _raw(url + "/slow_down", json.dumps({"forward_sleep_time": -1}).encode())
        assert status == 400 and ans["message"].startswith("forward_sleep_time")
        status, ans = _raw(url + "/slow_down", json.dumps({"forward_sleep_time": "x"}).encode())
        assert status == 400 and ans["message"].startswith("forward_sleep_time: expected a")
        # a weight update holding NaN is refused whole; generation goes on with the old weights
        ckpt = HFCheckpoint(fp8_dir)
        new = {n: ckpt.raw(n) for n in ckpt.keys()}
        w = "model.layers.0.mlp.up_proj.weight_scale_inv"
        new[w] = new[w].clone()
        new[w][0, 0] = float("inf")
        client.begin_weight_update()
        with pytest.raises(ServerError, match=f"HTTP 400: {w}: holds NaN/inf"):
            client.update_weights_from_tensor([_st_payload(new)], "jetrl_safetensors", "1", True)
        client.end_weight_update()
        assert client.get_weight_version() == "0"
        # 64 concurrent clients: none is reset (the listen backlog was 5)
        with ThreadPoolExecutor(64) as ex:
            outs = list(ex.map(lambda i: client.generate([[i % 50 + 1, 2]], SamplingParams(max_new_tokens=2), [i]),
                               range(64)))
        assert len(outs) == 64 and all(len(o[0].output_ids) == 2 for o in outs)
    finally:
        proc.kill()
