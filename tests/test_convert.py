"""Checkpoint conversion HF <-> Megatron (torch_dist), BF16 and block FP8."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from checkpoint_converters.convert import hf_to_megatron, megatron_to_hf
from megatron_jetrl.config import ConfigError
from megatron_jetrl.models.hf_io import CheckpointError, HFCheckpoint
from megatron_jetrl.precision.quant import dequantize_blocks, expand_blocks, quantize_weight
from megatron_jetrl.precision.recipe import FP8Recipe
from tests.dist import run_workers
from tests.hf_models import make_hf_model
from tests.workers import convert_worker

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {"llama": ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"],
           "qwen2": ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"],
           "qwen3": ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"],
           "qwen3_moe": ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2", "parallel.expert_parallel=2"]}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """bf16 HF source -> megatron torch_dist at TP2xPP2 (xEP2 for MoE) over 4 gloo processes."""
    root = tmp_path_factory.mktemp("convert")
    jobs = []
    for i, mt in enumerate(LAYOUTS):
        src = str(root / f"{mt}-hf")
        make_hf_model(mt, src, seed=20 + i, dtype=torch.bfloat16)
        jobs.append(("hf-to-megatron", src, str(root / f"{mt}-mcore"), LAYOUTS[mt]))
    # and back in another layout across 4 ranks, each writing its own shard files
    back = ["parallel.pipeline_parallel=2"]
    jobs += [("megatron-to-hf", str(root / f"{mt}-mcore"), str(root / f"{mt}-back4"), back, "bf16") for mt in LAYOUTS]
    run_workers(convert_worker, 4, jobs)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(LAYOUTS))
def test_round_trip_bit_identical_and_logits(model_type, converted, megatron_single):
    import transformers

    root = converted
    src, mcore = root / f"{model_type}-hf", root / f"{model_type}-mcore"
    assert json.load(open(mcore / "model_config.json"))["model_type"] == model_type
    out = str(root / f"{model_type}-back")
    megatron_to_hf(str(mcore), out, "bf16", shard_bytes=300_000)
    a = HFCheckpoint(str(src))
    for b in (HFCheckpoint(out), HFCheckpoint(str(root / f"{model_type}-back4"))):  # world size 1 and 4 (PP2, DP2)
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            assert torch.equal(a.raw(k).view(torch.uint8), b.raw(k).view(torch.uint8)), k
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1  # sharded at the given size, with an index
    assert os.path.isfile(os.path.join(out, "generation_config.json"))
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    source = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).eval()
    tokens = torch.randint(0, 384, (2, 16))
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, source(tokens).logits)

    fp8_out = str(root / f"{model_type}-fp8")
    megatron_to_hf(str(mcore), fp8_out, "fp8")
    cfg = json.load(open(os.path.join(fp8_out, "config.json")))
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["fmt"] == "e4m3" and qc["weight_block_size"] == [128, 128]
    assert qc["activation_scheme"] == "dynamic" and "lm_head" in qc["modules_to_not_convert"]
    f = HFCheckpoint(fp8_out)
    for k in a.keys():
        ref = a.raw(k).float()
        if k + "_scale_inv" in f:
            w, s = f.raw(k), f.raw(k + "_scale_inv")
            assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
            assert s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
            deq = dequantize_blocks(w, s, 128, 128)
            bound = expand_blocks(s, 128, 128, *w.shape) * 16
            # at most half an E4M3 ulp at the block's top binade (ties land exactly on it)
            assert torch.all((deq - ref).abs() <= bound * (1 + 1e-5)), k
            assert torch.equal(w.view(torch.uint8), quantize_weight(ref, FP8Recipe())[0].view(torch.uint8)), k
        else:
            assert f.raw(k).dtype == torch.bfloat16 and torch.equal(f.raw(k), a.raw(k)), k


def test_bad_inputs_leave_nothing_behind(tmp_path, megatron_single):
    src = tmp_path / "src"
    make_hf_model("llama", str(src))
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="parallel.tensor_parallel: 3 does not divide"):
        hf_to_megatron(str(src), str(out), ["parallel.tensor_parallel=3"])
    with pytest.raises(ConfigError, match=r"model.hf_path: no config.json"):
        hf_to_megatron(str(tmp_path / "missing"), str(out))
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.load(open(bad / "config.json"))
    (bad / "config.json").write_text(json.dumps(dict(cfg, model_type="mistral")))
    with pytest.raises(ConfigError, match="unsupported model_type 'mistral'"):
        hf_to_megatron(str(bad), str(out))
    (bad / "config.json").write_text(json.dumps(dict(cfg, hidden_size=384, head_dim=64)))
    with pytest.raises(CheckpointError, match="config.json and the weights disagree"):
        hf_to_megatron(str(bad), str(out))
    with pytest.raises(CheckpointError, match="is not a directory"):
        megatron_to_hf(str(tmp_path / "nope"), str(out))
    with pytest.raises(CheckpointError, match="no metadata.json"):
        megatron_to_hf(str(src), str(out))
    assert sorted(os.listdir(tmp_path)) == ["bad", "src"]  # no out, no out.tmp


@pytest.mark.slow
def test_convert_a_checkpoint_written_by_jetrl_train(tmp_path):
    import transformers

    env = dict(os.environ, PYTHONPATH=REPO)
    run = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", "--preset", "tiny", "--run-dir",
                          str(tmp_path / "run"), "steps=2", "algo.sft_warmup_steps=1", "rollout.prompts_per_step=2"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    (tok / "unrelated.txt").write_text("x")
    for dtype in ("bf16", "fp8"):
        out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "convert", "megatron-to-hf", str(ckpt),
                              str(tmp_path / dtype), "--dtype", dtype, "--tokenizer", str(tok)], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        assert (tmp_path / dtype / "tokenizer.json").exists() and not (tmp_path / dtype / "unrelated.txt").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16")).eval()
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 64, (1, 8))).logits).all()
    assert "quantization_config" in json.load(open(tmp_path / "fp8" / "config.json"))


def test_train_starts_from_a_converted_checkpoint(tmp_path):
    """HF -> megatron (hf-to-megatron), then `checkpoint.load_path`: the first steps equal a run
    that loads the HF weights directly."""
    env = dict(os.environ, PYTHONPATH=REPO)
    make_hf_model("qwen3", str(tmp_path / "hf"), seed=3, vocab_size=128)
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "convert", "hf-to-megatron", str(tmp_path / "hf"),
                          str(tmp_path / "mcore"), "--params-dtype", "fp32"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {}
    for name, extra in (("direct", []), ("converted", [f"checkpoint.load_path={tmp_path / 'mcore'}"])):
        run = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", "--preset", "tiny", "--run-dir",
                              str(tmp_path / name), f"model.hf_path={tmp_path / 'hf'}", "steps=1", "algo.sft_warmup_steps=1",
                              "rollout.prompts_per_step=2", *extra], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        rows[name] = [json.loads(x) for x in open(tmp_path / name / "metrics.jsonl")]
    for a, b in zip(rows["direct"], rows["converted"]):
        for k in ("sft_loss", "grad_norm", "pg_loss", "reward_mean"):
            if k in a:
                assert a[k] == b[k], k
    bad = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", "--preset", "tiny", "--run-dir",
                          str(tmp_path / "bad"), "steps=1", f"checkpoint.load_path={tmp_path / 'nope'}"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("checkpoint error: checkpoint.load_path")
    # the converted model described field by field but with Llama-3.1's RoPE scaling: the same tensors would load and
    # compute another function; refused in one line before the run directory is written
    with open(tmp_path / "mcore" / "model_config.json") as f:
        fields = {k: v for k, v in json.load(f).items() if v is not None and k not in ("hf_path", "generation_config")}
    scaled = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    other = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", "--preset", "tiny", "--run-dir",
                            str(tmp_path / "other"), "steps=1", f"checkpoint.load_path={tmp_path / 'mcore'}",
                            *[f"model.{k}={json.dumps(v)}" for k, v in fields.items()],
                            f"model.rope_scaling={json.dumps(scaled)}"], env=env, capture_output=True, text=True,
                           timeout=600)
    assert other.returncode == 2 and other.stderr.strip().splitlines()[-1].startswith(
        f"config error: model.rope_scaling: checkpoint.load_path '{tmp_path / 'mcore'}' holds a model with None, "
        "this config builds {'rope_type': 'llama3'"), other.stderr[-2000:]
    assert not (tmp_path / "other").exists()


def test_special_tokens_generation_config_and_stop_ids_carry_through(tmp_path, megatron_single):
    """bos/eos/pad ids of config.json and the whole generation_config.json (several eos ids, temperature,
    top_p) survive HF -> megatron -> HF; every eos id, plus rollout.stop_token_ids, ends a response."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.data.tokenizer import CharTokenizer
    from megatron_jetrl.data.dataset import stop_token_ids

    src = tmp_path / "hf"
    make_hf_model("llama", str(src), seed=1, bos_token_id=1, eos_token_id=[2, 7], pad_token_id=0)
    gen = {"bos_token_id": 1, "eos_token_id": [2, 7, 9], "temperature": 0.6, "top_p": 0.9, "do_sample": True}
    (src / "generation_config.json").write_text(json.dumps(gen))
    cfg = load_config(None, [f"model.hf_path={src}", "rollout.stop_token_ids=[11]"])
    assert cfg.model.special_tokens == {"bos_token_id": 1, "eos_token_id": [2, 7], "pad_token_id": 0}
    assert stop_token_ids(cfg, CharTokenizer()) == (2, 7, 9, 11)
    hf_to_megatron(str(src), str(tmp_path / "mc"), dtype=torch.float32)
    megatron_to_hf(str(tmp_path / "mc"), str(tmp_path / "back"), "bf16")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: back[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == cfg.model.special_tokens
    assert json.loads((tmp_path / "back" / "generation_config.json").read_text()) == gen
