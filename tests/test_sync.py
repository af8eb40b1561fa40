"""Weight sync: gather over TP/PP/EP, HF names, FP8 export without re-quantization, buckets,
transports (disk, broadcast over gloo, in-process)."""
import json
import os

import pytest
import torch

from megatron_jetrl.errors import ConfigError
from megatron_jetrl.models.hf_io import HFCheckpoint
from megatron_jetrl.precision.quant import quantize_weight
from megatron_jetrl.precision.recipe import FP8Recipe
from megatron_jetrl.sync.export import ExportOptions, collect_hf_state_dict, iter_hf_tensors
from megatron_jetrl.sync.transport import DiskTransport, bucketize, nbytes, tensor_hash, verify_disk
from tests.dist import run_workers
from tests.hf_models import make_hf_model
from tests.workers import broadcast_worker, build_loaded, export_worker

FP8_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                "up_proj.weight", "down_proj.weight")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for mt in ("qwen2", "qwen3", "qwen3_moe"):
        path = str(tmp_path_factory.mktemp(mt))
        make_hf_model(mt, path, seed=3)
        out[mt] = path
    return out


def _expected(hf_dir, fp8: bool):
    """What the rollout must receive, straight from the HF files: the tensors (fp32 or BF16) and,
    for FP8, the recipe's quantization of each linear weight."""
    ckpt = HFCheckpoint(hf_dir)
    out = {}
    for name in ckpt.keys():
        t = ckpt.get(name)
        if fp8 and name.endswith(FP8_SUFFIXES) and ".mlp.gate." not in name:
            q, s = quantize_weight(t, FP8Recipe())
            out[name], out[name[: -len(".weight")] + ".weight_scale_inv"] = q, s
        else:
            out[name] = t.to(torch.bfloat16) if fp8 else t
    return out


def _assert_bytes_equal(got: dict, want: dict, label: str):
    assert sorted(got) == sorted(want), (label, set(got) ^ set(want))
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, (label, k)
        assert torch.equal(got[k].view(torch.uint8), want[k].contiguous().view(torch.uint8)), (label, k)


def test_world_size_1_export_round_trips_and_matches_hf(hf_dirs, megatron_single):
    for mt, path in hf_dirs.items():
        cfg, model, _ = build_loaded(path, ["precision.mode=jet"])
        # tables round-trip: HF -> Megatron -> HF equal, bit for bit (fp32)
        _assert_bytes_equal(collect_hf_state_dict(model, cfg.model, ExportOptions(fp8=False, dtype=None)),
                            _expected(path, False), mt)
        _assert_bytes_equal(collect_hf_state_dict(model, cfg.model, ExportOptions(fp8=True)), _expected(path, True), mt)


def test_jet_export_sends_the_forward_bytes_without_requantizing(hf_dirs, megatron_single):
    cfg, model, state = build_loaded(hf_dirs["qwen3"], ["precision.mode=jet"])
    tokens = torch.randint(0, 384, (2, 8))
    with torch.no_grad():
        model(tokens, torch.arange(8).expand(2, 8), None)  # the forward fills the cache
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    refreshes = qkv.fp8_cache.refreshes
    exported = dict(iter_hf_tensors(model, cfg.model, ExportOptions(fp8=True)))
    assert qkv.fp8_cache.refreshes == refreshes  # no re-quantization on export
    for (q, s), proj in zip(qkv.fp8_cache.parts(), "qkv"):
        name = f"model.layers.0.self_attn.{proj}_proj"
        assert torch.equal(exported[name + ".weight"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(exported[name + ".weight_scale_inv"], s)
    bf16 = sum(nbytes(t) for _, t in iter_hf_tensors(model, cfg.model, ExportOptions(fp8=False)))
    fp8 = sum(nbytes(t) for t in exported.values())
    # FP8 linears: 1 byte per weight plus one 4-byte scale per 128x128 block, vs 2 bytes in BF16;
    # embeddings, lm_head and norms stay BF16 in both
    assert fp8 < 0.75 * bf16


@pytest.mark.slow
def test_parallel_layouts_export_identical_to_world_size_1(hf_dirs):
    tp2, pp2, ep2 = "parallel.tensor_parallel=2", "parallel.pipeline_parallel=2", "parallel.expert_parallel=2"
    layouts = {
        "qwen2-tp2": (hf_dirs["qwen2"], [tp2]), "qwen3-pp2": (hf_dirs["qwen3"], [pp2]),
        "qwen3-tp2pp2": (hf_dirs["qwen3"], [tp2, pp2]), "qwen3_moe-ep2": (hf_dirs["qwen3_moe"], [ep2]),
        "qwen3_moe-tp2ep2": (hf_dirs["qwen3_moe"], [tp2, ep2]),
    }
    results = run_workers(export_worker, 4, layouts)[0]
    for name, (plain, fp8) in results.items():
        path = layouts[name][0]
        _assert_bytes_equal(plain, _expected(path, False), name)
        _assert_bytes_equal(fp8, _expected(path, True), name)


def test_buckets_never_exceed_their_size():
    g = torch.Generator().manual_seed(0)
    items = [(f"t{i}", torch.zeros(int(n))) for i, n in enumerate(torch.randint(1, 5000, (200,), generator=g))]
    buckets = list(bucketize(iter(items), 40_000))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in items]  # order kept, nothing lost
    assert all(sum(nbytes(t) for _, t in b) <= 40_000 for b in buckets)
    big = list(bucketize(iter([("a", torch.zeros(5)), ("big", torch.zeros(20_000)), ("b", torch.zeros(5))]), 40_000))
    assert [[n for n, _ in b] for b in big] == [["a"], ["big"], ["b"]]  # an oversize tensor goes alone


def test_disk_transport_writes_hf_fp8_checkpoint_and_verifies(hf_dirs, tmp_path, megatron_single):
    cfg, model, _ = build_loaded(hf_dirs["qwen3"], ["precision.mode=jet"])
    out = str(tmp_path / "push")
    recipe = FP8Recipe()
    stats = DiskTransport(out, cfg.model.to_hf_config(), shard_bytes=400_000,
                          quantization_config=recipe.hf_quantization_config(), bucket_bytes=300_000).push(
        5, iter_hf_tensors(model, cfg.model, ExportOptions(fp8=True)))
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    assert all(os.path.getsize(os.path.join(out, f)) <= 400_000 + 50_000 for f in files)  # + safetensors header
    conf = json.load(open(os.path.join(out, "config.json")))
    assert conf["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128],
                                           "modules_to_not_convert": ["lm_head", "embed_tokens", "norm", "mlp.gate"]}
    assert verify_disk(out) == {"parity_checked": stats["sync_tensors"], "parity_mismatch": 0, "weight_version": 5}
    ckpt = HFCheckpoint(out)
    w = ckpt.raw("model.layers.0.self_attn.q_proj.weight")
    s = ckpt.raw("model.layers.0.self_attn.q_proj.weight_scale_inv")
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (w.shape[0] // 128, w.shape[1] // 128)
    assert not os.path.exists(out + ".tmp")
    # a flipped byte is caught by the receiving side
    from safetensors.torch import load_file, save_file

    fname = os.path.join(out, index["weight_map"]["model.layers.0.self_attn.q_proj.weight"])
    sd = load_file(fname)
    sd["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8)[0, 0] ^= 1
    save_file(sd, fname, metadata={"format": "pt"})
    assert verify_disk(out)["parity_mismatch"] == 1


def test_disk_push_never_leaves_the_directory_without_weights(tmp_path, monkeypatch):
    """A second push replaces the first by renames: whenever a directory is deleted, the weights directory already
    holds the new version, and nothing else is left beside it."""
    from megatron_jetrl.sync import transport

    out = str(tmp_path / "weights")
    seen = []
    real = transport.shutil.rmtree

    def rmtree(path, *a, **k):
        if os.path.exists(path):
            index = os.path.join(out, "model.safetensors.index.json")
            seen.append((os.path.basename(path),
                         json.load(open(index))["metadata"]["weight_version"] if os.path.exists(index) else None))
        return real(path, *a, **k)

    monkeypatch.setattr(transport.shutil, "rmtree", rmtree)
    push = DiskTransport(out, {"model_type": "llama"})
    push.push(1, iter([("w", torch.ones(4))]))
    push.push(2, iter([("w", torch.full((4,), 2.0))]))
    assert seen == [("weights.old", 2)]  # the old version deleted once the new one holds the name
    assert sorted(os.listdir(tmp_path)) == ["weights"]
    assert verify_disk(out)["weight_version"] == 2
    os.makedirs(out + ".old")  # an interrupted push's leftover is cleared, not in the way of the rename
    push.push(3, iter([("w", torch.full((4,), 3.0))]))
    assert sorted(os.listdir(tmp_path)) == ["weights"] and verify_disk(out)["weight_version"] == 3


@pytest.mark.slow
def test_broadcast_transport_over_gloo(hf_dirs):
    sender, receiver = run_workers(broadcast_worker, 2, hf_dirs["qwen3"])
    assert receiver["version"] == 7 and receiver["parity"]["parity_mismatch"] == 0
    assert receiver["parity"]["parity_checked"] == len(sender["sent"])
    _assert_bytes_equal(receiver["tensors"], sender["sent"], "broadcast")
    assert sender["stats"]["sync_bytes"] == sum(nbytes(t) for t in sender["sent"].values())


def test_bench_sync_and_mismatch_cli_numbers(tmp_path, megatron_single):
    """The two CPU-runnable benchmarks end to end: FP8 sends fewer bytes; jet's mismatch is far
    below fp8_rollout's on the same weights (fp32 parameters, emulated FP8)."""
    from megatron_jetrl.bench import mismatch, sync

    rows = sync.main(["--preset", "tiny", "--repeats", "1", "--json", str(tmp_path / "s.json")])
    assert rows[1]["bytes"] < 0.6 * rows[0]["bytes"] and json.load(open(tmp_path / "s.json"))["rows"]
    mm = {r["mode"]: r for r in mismatch.main(["--prompts", "16", "--prompt-len", "6", "rollout.max_new_tokens=8"])}
    assert mm["jet"]["mismatch_abs_mean"] * 50 < mm["fp8_rollout"]["mismatch_abs_mean"]
    assert mm["bf16"]["mismatch_abs_mean"] < 1e-5


def test_mismatch_kv_agreement_per_layer(monkeypatch, capsys, megatron_single):
    """``jetrl mismatch --kv``: per layer, the share of K / V elements where the trainer's attention inputs differ
    from the rollout's cache. Unified FP8 KV (V key-major, micro-batches of 4 rows): the first layer's keys and
    values are the cache's exactly (same input bytes; a misplaced row or position would differ), later layers within
    a few elements; the off-policy baseline (BF16 training over an FP8 rollout cache) differs almost everywhere. One
    element changed in the cache after the rollout is counted as one, at its layer."""
    from megatron_jetrl.bench import mismatch

    args = ["--kv", "--prompts", "8", "--prompt-len", "6", "rollout.max_new_tokens=8", "algo.micro_batch_size=4",
            "rollout.fp8_kv_v_layout=key_major"]
    rows = {r["mode"]: r for r in mismatch.main([*args, "--modes", "jet+fp8kv,fp8_rollout+fp8kv"])}
    unified, offp = rows["jet+fp8kv"]["kv_layers"], rows["fp8_rollout+fp8kv"]["kv_layers"]
    assert len(unified) == len(offp) == 2
    assert unified[0]["k_differ"] == unified[0]["v_differ"] == 0 == unified[0]["k_max_abs"]
    assert all(x["k_differ"] < 1e-3 and x["v_differ"] < 1e-3 for x in unified)
    assert all(x["k_differ"] > 0.9 and x["v_differ"] > 0.9 for x in offp)
    out = capsys.readouterr().out
    assert "| layer | jet+fp8kv: K / V elements differing (largest difference) |" in out and "| 0 | 0.00% / 0.00%" in out

    init = mismatch.KVAgreement.__init__

    def changed(self, model, decoder, recipe, positions):  # one key element and one value element of the cache
        init(self, model, decoder, recipe, positions)
        decoder.k[0, 5, 1, 3, 7] += 1.0
        decoder.v[0, 2, 0, positions - 1, 0] -= 0.5

    monkeypatch.setattr(mismatch.KVAgreement, "__init__", changed)
    (row,) = mismatch.main([*args, "--modes", "jet"])
    first, n = row["kv_layers"][0], 8 * (6 + 8 - 1) * 2 * 64  # rows x positions x KV groups x head_dim (tiny)
    assert (first["k_differ"], first["v_differ"]) == (1 / n, 1 / n)
    assert first["k_max_abs"] == pytest.approx(1.0, rel=0.01) and first["v_max_abs"] == pytest.approx(0.5, rel=0.01)
    with pytest.raises(ConfigError, match="rollout.decode=static"):  # exact mode on the CPU decodes without a cache
        mismatch.main([*args, "--modes", "jet+exact"])


def test_mismatch_rolls_out_with_the_runs_rollout_settings(monkeypatch, megatron_single):
    """``jetrl mismatch`` builds its engine from the run's ``rollout.*`` settings (the decode attention, the FP8
    cache's V layout, the bucket), as training does, instead of the engine's defaults."""
    from megatron_jetrl.bench import mismatch
    from megatron_jetrl.rollout.local import LocalEngine

    seen = {}

    def stop(self, prompts, params, seeds=None):
        seen.update(attention=self.attention, v_layout=self.v_layout, bucket=self.bucket)
        raise KeyboardInterrupt  # what the engine was built with is all this test needs

    monkeypatch.setattr(LocalEngine, "generate", stop)
    with pytest.raises(KeyboardInterrupt):
        mismatch.main(["--prompts", "2", "--prompt-len", "4", "--modes", "jet+fp8kv", "rollout.max_new_tokens=4",
                       "rollout.decode_attention=triton", "rollout.fp8_kv_v_layout=key_major", "rollout.decode_bucket=32"])
    assert seen == {"attention": "triton", "v_layout": "key_major", "bucket": 32}


def test_sglang_flattened_bucket_transport(hf_dirs, megatron_single):
    """Buckets built with SGLang's own FlattenedTensorBucket; reconstructed the way a server does;
    every offset aligned for SGLang's receiving side (FlattenedTensorBucket.empty)."""
    import importlib.metadata

    try:  # its package __init__ needs the server's deps: look for the distribution, don't import it
        importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sglang is not installed (tools/setup_env.sh installs it with --no-deps)")
    from megatron_jetrl.sync.sglang_bucket import SGLangTensorBucketTransport, receive_bucket, sglang_bucket_class

    cfg, model, _ = build_loaded(hf_dirs["qwen3"], ["precision.mode=jet"])
    sent = dict(iter_hf_tensors(model, cfg.model, ExportOptions(fp8=True)))
    payloads = []
    transport = SGLangTensorBucketTransport(lambda p, v, last: payloads.append((p, v, last)), bucket_bytes=200_000)
    stats = transport.push(3, iter(sent.items()))
    assert len(payloads) > 1 and [last for *_, last in payloads] == [False] * (len(payloads) - 1) + [True]
    assert all(v == 3 for _, v, _ in payloads)
    got = {}
    cls = sglang_bucket_class()
    for payload, _, _ in payloads:
        assert payload["flattened_tensor"].numel() <= 200_000 or len(payload["metadata"]) == 1
        meta = payload["metadata"]
        cls.empty([m.name for m in meta], [m.dtype for m in meta], [m.shape for m in meta], "cpu")  # aligned
        got.update(receive_bucket(payload))
    _assert_bytes_equal(got, sent, "sglang-bucket")
    assert {k: tensor_hash(v) for k, v in got.items()} == transport.last_hashes
    assert stats["sync_tensors"] == len(sent)
