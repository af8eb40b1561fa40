"""The fleet against SGLang 0.5.23's own code (not against our reading of it): request bodies parsed by
its io_struct classes, weight pushes and the colocated memory phases driven through its real
``SchedulerWeightUpdaterManager``, parity through its real ``WeightChecker``, GRPO groups sampled by its
seeded sampler. What cannot run here (CUDA parts) and what stands in: tests/sglang_imports.py,
tests/sglang_server.py."""
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from megatron_jetrl.rollout.base import SamplingParams
from megatron_jetrl.rollout.seeded import row_seeds
from megatron_jetrl.rollout.sglang import SGLANG_VERSION, SGLangClient, ServerError
from tests.hf_models import make_fp8_dir, make_hf_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
URLS = ["http://sglang-0:30000", "http://sglang-1:30000"]


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    from megatron_jetrl.models.hf_io import HFCheckpoint

    root = tmp_path_factory.mktemp("contract")
    make_hf_model("qwen3", str(root / "bf16"), seed=3)
    path = make_fp8_dir(str(root / "bf16"), str(root / "fp8"))
    ckpt = HFCheckpoint(path)
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    return path, {n: ckpt.raw(n) for n in ckpt.keys()}, qc


@pytest.fixture
def sglang(megatron_single, fp8_model, monkeypatch, tmp_path):
    """Two SGLang control planes, launched (in spirit) with our own launch arguments, and the client
    routed to them."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.rollout.sglang import sglang_server_argv
    from tests.sglang_server import SGLangServer, setup_sglang_runtime

    path, tensors, qc = fp8_model
    cfg = load_config(None, ["rollout.engine=sglang"])
    setup_sglang_runtime(sglang_server_argv(cfg, FP8Recipe(mode="jet"), path, 30000, colocated=True))
    servers = {u: SGLangServer(tensors, qc) for u in URLS}
    sent = []

    def route(self, path, body=None, **kw):
        sent.append((self.url, path, body))
        return servers[self.url].handle(path, body)

    monkeypatch.setattr(SGLangClient, "request", route)
    return types.SimpleNamespace(servers=servers, sent=sent, tensors=tensors, path=path, tmp=tmp_path)


def _fleet(sg, mode: str, transport: str = "distributed"):
    from megatron_jetrl.config import load_config
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.rollout.sglang import RolloutFleet

    cfg = load_config(None, ["rollout.engine=sglang", f"scheduler.mode={mode}", f"rollout.weight_transport={transport}",
                             f"rollout.server_addresses=[{','.join(URLS)}]", "rollout.chunk_size=4",
                             "rollout.n_samples_per_prompt=4", "rollout.prompts_per_step=2",
                             f"logging.run_dir={sg.tmp}"])
    fleet = RolloutFleet(cfg, FP8Recipe(mode="jet"), str(sg.tmp), None, colocated=mode == "colocated")
    push = fleet.pushers["distributed"]
    push.ensure_group = lambda up: None  # no process group in one process: buckets go on each server's wire
    push.broadcast = lambda flat: [s.wire.put(flat.clone()) for s in sg.servers.values()]
    fleet.start()
    return cfg, fleet


def _changed(tensors, step: int):
    """The checkpoint's tensors with every FP8 linear's bytes changed (a new version)."""
    out = {}
    for n, t in tensors.items():
        if t.dtype == torch.float8_e4m3fn:
            t = torch.roll(t.view(torch.uint8), step, dims=1).view(torch.float8_e4m3fn)
        out[n] = t
    return out


def _disk_push(sg, cfg):
    from megatron_jetrl.sync.transport import DiskTransport

    with open(os.path.join(sg.path, "config.json")) as f:
        hf = json.load(f)
    qc = hf.pop("quantization_config")
    out = str(sg.tmp / "weights")
    return lambda v, items: (out, DiskTransport(out, hf, quantization_config=qc).push(v, items))


def _sglang_linears(names) -> int:
    return sum(1 for n in names if n.endswith(("q_proj.weight", "o_proj.weight", "gate_proj.weight", "down_proj.weight")))


@pytest.mark.parametrize("transport", ["distributed", "disk"])
def test_push_follows_sglang_weight_update_rules(sglang, transport):
    """A push to SGLang's real manager: the broadcast buckets inside /begin_weight_update ...
    /end_weight_update (refused outside), the disk load outside; the new version is served, and SGLang's
    own WeightChecker checksums of the loaded FP8 weights equal the ones the sender computed."""
    cfg, fleet = _fleet(sglang, "disaggregated", transport)
    new = _changed(sglang.tensors, 1)
    m = fleet.push_weights(1, iter(new.items()), True, _disk_push(sglang, cfg))
    assert m["parity_checked"] == 2 * _sglang_linears(new) > 0 and m["parity_mismatch"] == 0
    for s in sglang.servers.values():
        assert s.weight_version == "1"
        qkv = dict(s.model.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"]
        want = torch.cat([new[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(qkv.view(torch.uint8), want.view(torch.uint8))
        calls = [c[0] for c in s.calls]
        if transport == "distributed":
            first, last = calls.index("/begin_weight_update"), calls.index("/end_weight_update")
            pushes = [i for i, c in enumerate(calls) if c == "/update_weights_from_distributed"]
            assert pushes and first < min(pushes) and max(pushes) < last
            assert ("runner.end", False) in s.calls  # SGLang finalizes after loading
        else:
            assert "/begin_weight_update" not in calls and "runner.load_disk" in calls

    # a server that kept one old tensor is caught by the checksums
    old_load = sglang.servers[URLS[1]].model.load
    sglang.servers[URLS[1]].model.load = lambda named: old_load(
        [(n, t) for n, t in named if n != "model.layers.1.mlp.down_proj.weight"])
    with pytest.raises(ServerError, match=r"sglang-1:30000: 1 of 8 FP8 linears differ .* precision.scale_fmt=ue8m0"):
        fleet.push_weights(2, iter(_changed(sglang.tensors, 2).items()), True, _disk_push(sglang, cfg))


def test_push_without_session_is_refused_by_sglang(sglang, monkeypatch):
    """The rule the push follows is SGLang's, not ours: skip /begin_weight_update and SGLang's manager
    refuses the first bucket (what a run on the real server died of)."""
    _, fleet = _fleet(sglang, "disaggregated")
    monkeypatch.setattr(SGLangClient, "begin_weight_update", lambda self: {})
    with pytest.raises(ServerError, match="must run between begin_weight_update"):
        fleet.push_weights(1, iter(_changed(sglang.tensors, 1).items()))


@pytest.mark.parametrize("warmup_push", [False, True], ids=["rollout-first", "push-first"])
def test_colocated_scheduler_follows_sglang_memory_rules(sglang, monkeypatch, warmup_push):
    """The colocated scheduler's real phase code over SGLang's manager: every resume names a released tag
    (else SGLang's scheduler dies), generation runs with weights, KV cache and CUDA graphs resumed, a push
    with the weights resumed, and training with all three released."""
    from megatron_jetrl.scheduler import Colocated
    from megatron_jetrl.sync import handover

    cfg, fleet = _fleet(sglang, "colocated")
    for s in sglang.servers.values():
        assert s.manager.offload_tags == {"weights", "kv_cache", "cuda_graph"}  # the trainer gets the GPU

    class Actor:
        def offload(self, what=None):
            return 0

        def reload(self):
            return 0

        def offloaded_bytes(self):
            return 0

    run = types.SimpleNamespace(cfg=cfg, engine=fleet, actor=Actor(), sampling=SamplingParams(max_new_tokens=3))
    prompts = [[1, 2, 3]] * 4 + [[7, 8]] * 4  # two GRPO groups of 4
    monkeypatch.setattr(Colocated, "draw", lambda self, step: ([None, None], prompts))
    monkeypatch.setattr(handover, "hand_over_weights",
                        lambda run, v: run.engine.push_weights(v, iter(_changed(sglang.tensors, v).items())))
    sched = Colocated(run)
    if warmup_push:
        sched.hand_over(1)
    for step in range(2):
        _, _, gens, _ = sched.rollout(step)
        assert len(gens) == 8
        for s in sglang.servers.values():
            assert s.manager.offload_tags == {"weights", "kv_cache", "cuda_graph"}  # released for training
        m = sched.hand_over(step + 2)
        assert m["parity_mismatch"] == 0 and m["parity_checked"] > 0
    for s in sglang.servers.values():
        resumes = [tags for path, tags in s.calls if path == "/resume_memory_occupation"]
        assert all(tags for tags in resumes)  # never "all" blindly
        assert any("cuda_graph" in tags for tags in resumes)  # the graphs decoding replays
    # per-row seeds: the 4 samples of a prompt differ in seed; SGLang's batch rids are f"{rid}_{i}"
    rows = [g for s in sglang.servers.values() for g in s.generated]
    groups: dict = {}
    for r in rows:  # rid = f"s{step seed}c{chunk}_{row}"
        groups.setdefault((r["rid"].split("c")[0], tuple(r["prompt"])), []).append(r["seed"])
    assert len(groups) == 4 and all(len(v) == 4 and len(set(v)) == 4 for v in groups.values())
    assert all(r["rid"].rsplit("_", 1)[1].isdigit() for r in rows)


def test_resume_of_an_unreleased_tag_kills_sglang(sglang):
    """Why the fleet tracks tags: what the colocated scheduler used to send first."""
    from tests.sglang_server import SchedulerDied

    with pytest.raises(SchedulerDied, match="kv_cache"):
        SGLangClient(URLS[0]).resume_memory_occupation(["kv_cache"])


def test_client_bodies_parse_as_sglang_parses_them(sglang):
    """Every body the client sends, through the route's io_struct class (pydantic, as FastAPI does) and,
    for /generate, GenerateReqInput's own normalization: per-row sampling params with distinct seeds,
    rids expanded as SGLang expands them."""
    import pydantic
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    from megatron_jetrl.rollout.server import REQUEST_FIELDS

    c = SGLangClient(URLS[0])
    c.begin_weight_update()
    c.end_weight_update()
    c.update_weights_from_disk(sglang.path, "3")
    c.init_weights_update_group("127.0.0.1", 1234, 1, 3, "g", "nccl")
    c.destroy_weights_update_group("g")
    c.release_memory_occupation(["weights"])
    c.resume_memory_occupation(["weights"])
    c.weights_checksum()
    c.generate([[1, 2], [1, 2], [3]], SamplingParams(max_new_tokens=2, top_k=5, stop_token_ids=(3,)),
               row_seeds(11, range(3)), rid="s11c0")
    bodies = {p: b for _, p, b in sglang.sent if b is not None}
    for path, body in bodies.items():
        if path == "/generate":
            continue
        cls = getattr(io_struct, REQUEST_FIELDS[path][0])
        parsed = pydantic.TypeAdapter(cls).validate_json(json.dumps(body))
        assert {k: getattr(parsed, k) for k in body} == body, path  # no field dropped or reinterpreted
        assert set(body) <= set(cls.__struct_fields__), (path, set(body) - set(cls.__struct_fields__))
    gen = GenerateReqInput(**bodies["/generate"])
    gen.normalize_batch_and_arguments()
    assert gen.rid == ["s11c0_0", "s11c0_1", "s11c0_2"]
    seeds = [SGLangSamplingParams(**sp).sampling_seed for sp in gen.sampling_params]
    assert seeds == row_seeds(11, range(3)) and len(set(seeds)) == 3
    # the tensor transport's body is jetrl serve's (SGLang takes CUDA IPC handles): refused by the config
    from megatron_jetrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.weight_transport: tensor"):
        load_config(None, ["rollout.engine=sglang", "rollout.weight_transport=tensor"])


def test_version_check_names_the_pinned_release(sglang):
    import sglang as sg

    assert sg.__version__ == SGLANG_VERSION  # the installed source the tests run is the pinned one
    sglang.servers[URLS[0]].version = "0.5.9"
    with pytest.raises(ServerError, match=r"SGLang 0.5.9 is not supported.*sglang==0.5.23"):
        _fleet(sglang, "disaggregated")


def test_checksums_equal_sglang_weight_checker_sharded(tmp_path):
    """The sender's per-rank checksums at server TP 2 and 4 (sharding, fusing, dequantization, hash)
    equal SGLang's own WeightChecker arithmetic on the shards SGLang's TP loading gives each rank."""
    from tests.sglang_imports import sglang_srt

    sglang_srt()
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
    from sglang.srt.utils.weight_checker import _hash_tensor

    from megatron_jetrl.models.hf_io import HFCheckpoint
    from megatron_jetrl.sync.sglang_checksum import ExpectedChecksums

    # 4 heads, 2 KV heads of 128: whole 128-row blocks per rank up to TP 4 (SGLang's rule)
    make_hf_model("qwen3", str(tmp_path / "bf16"), num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    ckpt = HFCheckpoint(make_fp8_dir(str(tmp_path / "bf16"), str(tmp_path / "fp8")))
    t = {n: ckpt.raw(n) for n in ckpt.keys()}
    layer = "model.layers.0"
    for tp in (2, 4):  # 2 KV heads: TP 4 replicates each KV head on 2 ranks
        exp = ExpectedChecksums(tp, num_kv_heads=2, block=128)
        for n in t:
            exp.add(n, t[n])
        for r in range(tp):
            def rows(name, heads):
                w, s = t[f"{layer}.self_attn.{name}.weight"], t[f"{layer}.self_attn.{name}.weight_scale_inv"]
                per = w.shape[0] // heads
                h = r * heads // tp if tp <= heads else r // (tp // heads)
                n = max(1, heads // tp)
                return w[h * per:(h + n) * per], s[h * per // 128:(h + n) * per // 128]
            q, k, v = rows("q_proj", 4), rows("k_proj", 2), rows("v_proj", 2)
            w, s = torch.cat([q[0], k[0], v[0]]), torch.cat([q[1], k[1], v[1]])
            want = _hash_tensor(block_quant_dequant(w, s, [128, 128], dtype=torch.bfloat16))
            assert exp.ranks[r][f"{layer}.self_attn.qkv_proj.weight"] == want, (tp, r)
            d, ds = t[f"{layer}.mlp.down_proj.weight"], t[f"{layer}.mlp.down_proj.weight_scale_inv"]
            kk = d.shape[1] // tp
            if kk % 128 == 0:
                want = _hash_tensor(block_quant_dequant(d[:, r * kk:(r + 1) * kk], ds[:, r * kk // 128:(r + 1) * kk // 128],
                                                        [128, 128], dtype=torch.bfloat16))
                assert exp.ranks[r][f"{layer}.mlp.down_proj.weight"] == want, (tp, r)


SAMPLER_SCRIPT = r"""
import sys, torch, triton
sys.path.insert(0, {repo!r})
from tests.sglang_imports import install_torchvision_stub
install_torchvision_stub()
import sglang.srt.layers.sampler as sampler
from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32_kernel
from megatron_jetrl.rollout.seeded import murmur_hash32, row_seeds, seeded_sample

def sglang_hash(seed, positions, cols):  # murmur_hash32's GPU branch: SGLang's Triton kernel, interpreted
    out = torch.empty((seed.shape[0], cols.shape[0]), dtype=torch.uint32)
    murmur_hash32_kernel[(seed.shape[0], triton.cdiv(cols.shape[0], 1024))](seed, positions, cols, out,
                         seed.shape[0], cols.shape[0], BLOCK_SIZE=1024)
    return out
sampler.murmur_hash32 = sglang_hash
draw = sampler.multinomial_with_seed._torchdynamo_orig_callable  # its eager body (torch.compile off on CPU)

torch.manual_seed(0)
V, n = 300, 8
group = torch.log_softmax(torch.randn(1, V), -1).expand(n, V).contiguous()  # one prompt, n samples
pos = torch.full((n,), 17)
ours = torch.tensor(row_seeds(42, range(n)))
old = torch.full((n,), 42 * 1009)  # one seed for the whole chunk
print("per_row", sorted(set(draw(group, ours, pos).flatten().tolist())).__len__())
print("one_seed", sorted(set(draw(group, old, pos).flatten().tolist())).__len__())
lp = torch.log_softmax(torch.randn(64, V) * 3, -1)
seeds = torch.tensor(row_seeds(7, range(64)))
positions = torch.randint(0, 4096, (64,))
print("equal", torch.equal(draw(lp, seeds, positions).flatten(), seeded_sample(lp, seeds, positions)))
print("hash", torch.equal(sglang_hash(seeds, positions, torch.arange(V)).to(torch.int64) & 0xFFFFFFFF,
                          murmur_hash32(seeds, positions, torch.arange(V))))
"""


def test_grpo_group_samples_differ_under_sglang_seeded_sampler():
    """SGLang's seeded sampler (``multinomial_with_seed`` with its murmur-hash kernel) on one GRPO group:
    with the per-row seeds the client sends, the 8 samples of one prompt differ; with one seed for the
    chunk (as sent before) they are all the same token, and every advantage would be zero. jetrl serve's
    sampler draws exactly SGLang's tokens."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", SAMPLER_SCRIPT.format(repo=REPO)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = dict(line.split() for line in out.stdout.strip().splitlines())
    assert int(res["per_row"]) >= 4 and int(res["one_seed"]) == 1
    assert res["equal"] == "True" and res["hash"] == "True"
