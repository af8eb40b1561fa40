"""Config loading/validation and checkpoint-file errors: one line naming the field and the fix."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from megatron_jetrl.config import ConfigError, load_config, save_config
from megatron_jetrl.models.hf_io import CheckpointError, HFCheckpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "examples", "configs", "tiny.yaml")


def test_preset_loads_and_round_trips(tmp_path):
    cfg = load_config(TINY, ["precision.mode=bf16", "rollout.temperature=0.7", "algo.tis_cap=null"])
    assert cfg.precision.mode == "bf16" and cfg.rollout.temperature == 0.7 and cfg.model.head_dim == 64
    save_config(cfg, str(tmp_path / "c.yaml"))
    again = load_config(str(tmp_path / "c.yaml"))
    assert again == cfg


def test_config_written_by_two_writers_at_once(tmp_path, monkeypatch):
    """Every node's `jetrl launch` writes the run's config into the shared run directory at the same time. Here a
    second writer saves the same path while the first is between writing its temporary file and renaming it: both
    complete, the file is whole (the last rename's), and no temporary file is left."""
    path = str(tmp_path / "launch_config.yaml")
    first, second = load_config(TINY, ["seed=1"]), load_config(TINY, ["seed=2"])
    fsync, nested = os.fsync, []

    def fsync_then_another_writer(fd):  # the temporary file written, not yet renamed
        fsync(fd)
        if not nested:  # the other node, once
            nested.append(1)
            save_config(second, path)

    monkeypatch.setattr(os, "fsync", fsync_then_another_writer)
    save_config(first, path)
    monkeypatch.undo()
    assert load_config(path) == first and os.listdir(tmp_path) == ["launch_config.yaml"]
    assert os.stat(path).st_mode & 0o777 == 0o644


@pytest.mark.parametrize("preset", sorted(f for f in os.listdir(os.path.join(REPO, "examples", "configs"))
                                           if f.endswith(".yaml")))
def test_every_preset_loads(preset):
    """Every shipped preset passes validation (the GPU benchmarks and launch plans name them)."""
    cfg = load_config(os.path.join(REPO, "examples", "configs", preset))
    assert cfg.model.num_attention_heads % cfg.model.num_key_value_heads == 0 and cfg.model.num_layers > 0


@pytest.mark.parametrize("overrides,pattern", [
    (["model.hiden_size=3"], r"model.hiden_size: unknown key; valid keys here: .*hidden_size"),
    (["model.hidden_size=abc"], r"model.hidden_size: expected an integer, got 'abc'"),
    (["precision.mode=fp4"], r"precision.mode: 'fp4' is not one of \['bf16', 'fp8_rollout', 'jet'\]"),
    (["parallel.tensor_parallel=3"], r"parallel.tensor_parallel: 3 does not divide model.num_attention_heads=2"),
    (["parallel.pipeline_parallel=3"], r"parallel.pipeline_parallel: 3 does not divide model.num_layers=2"),
    (["parallel.expert_parallel=2"], r"parallel.expert_parallel: qwen3 has no experts"),
    (["model.num_key_value_heads=3", "model.num_attention_heads=4"], r"model.num_key_value_heads: 3 does not divide"),
    (["algo.tis_cap=2.0"], r"algo.tis_cap: truncated importance sampling is for fp8_rollout"),
    (["rollout.top_p=1.5"], r"rollout.top_p: 1.5 not in \(0, 1\]"),
    (["model.model_type=gpt2"], r"model.model_type: 'gpt2' is not one of"),
    (["steps"], r"steps: override without '='"),
    (["model=3"], r"model: expected a mapping"),
    (["scheduler.mode=disaggregated"], r"scheduler.mode: disaggregated needs a server fleet; set rollout.engine=serve or sglang"),
    (["scheduler.async_rollout=true", "rollout.engine=serve"], r"scheduler.async_rollout: one-step-ahead rollout needs separate"),
    (["rollout.engine=sglang", "parallel.pipeline_parallel=2"], r"rollout.weight_transport: distributed sends from one rank"),
    (["rollout.server_addresses=[localhost:3000]"], r"rollout.server_addresses: 'localhost:3000' is not a URL; write http://host:port"),
    (["rollout.mem_fraction=1.5"], r"rollout.mem_fraction: 1.5 not in \(0, 1\)"),
    (["rollout.decode_max_graphs=-1"], r"rollout.decode_max_graphs: must be >= 0, got -1"),
    (["rollout.decode_rows=-8"], r"rollout.decode_rows: must be >= 0, got -8"),
    (["precision.kv_cache=fp8", "precision.mode=bf16"], r"precision.kv_cache: fp8 is an FP8 precision flow, mode is bf16; "
                                                        r"set precision.mode=jet"),
    (["precision.kv_cache=fp8", "rollout.engine=sglang"], r"precision.kv_cache: SGLang 0.5.23's FP8 KV cache keeps one "
                                                          r"static scale per layer.*; use rollout.engine=local or serve"),
    (["precision.kv_cache=fp8", "precision.backend=te"], r"precision.kv_cache: fp8 is applied by our SDPA attention"),
    (["precision.kv_cache=fp16"], r"precision.kv_cache: 'fp16' is not one of \['bf16', 'fp8'\]"),
    (["precision.exact=true", "rollout.engine=sglang"], r"precision.exact: rollout.engine=sglang samples with "
                                                        r"SGLang's kernels, not the trainer's; use rollout.engine=local "
                                                        r"or serve"),
    (["precision.exact=true", "parallel.tensor_parallel=2"], r"precision.exact: the exact logprob is taken over the whole"),
    (["precision.exact=true", "precision.backend=te"], r"precision.exact: TransformerEngine's kernels are not"),
    (["precision.exact=true", "precision.mode=fp8_rollout"], r"precision.exact: fp8_rollout samples in another precision"),
])
def test_bad_config_one_line_errors(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern) as e:
        load_config(TINY, overrides)
    assert "\n" not in str(e.value) and str(e.value).startswith("config error: ")


def test_hf_config_json(tmp_path):
    from tests.hf_models import make_hf_model

    make_hf_model("qwen3_moe", str(tmp_path))
    cfg = load_config(None, [f"model.hf_path={tmp_path}"])
    assert (cfg.model.model_type, cfg.model.num_experts, cfg.model.moe_top_k, cfg.model.head_dim) == ("qwen3_moe", 4, 2, 64)
    with pytest.raises(ConfigError, match=r"model.hf_path: no config.json in"):
        load_config(None, [f"model.hf_path={tmp_path / 'nope'}"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"unsupported model_type 'gpt2'"):
        load_config(None, [f"model.hf_path={bad}"])


def test_checkpoint_file_errors(tmp_path, megatron_single):
    from tests.hf_models import make_hf_model
    from tests.workers import build_loaded

    src = tmp_path / "m"
    make_hf_model("llama", str(src))
    with pytest.raises(CheckpointError, match="is not a directory"):
        HFCheckpoint(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"no \*.safetensors in"):
        HFCheckpoint(str(empty))
    # an index naming a shard that is not there
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002.safetensors listed in the index is missing"):
        HFCheckpoint(str(broken))
    # config.json that disagrees with the weights: shape error naming the tensor
    wrong = tmp_path / "wrong"
    shutil.copytree(src, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["intermediate_size"] = 640
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"mlp.gate_proj.weight.*gives shape \(1024, 256\).*expects \(1280, 256\)"):
        build_loaded(str(wrong), ["precision.mode=bf16"])
    # a missing tensor
    fewer = tmp_path / "fewer"
    shutil.copytree(src, fewer)
    cfg = json.loads((fewer / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (fewer / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.2.input_layernorm.weight' not found"):
        build_loaded(str(fewer), ["precision.mode=bf16"])


def test_cli_help_and_bad_override(capsys):
    from megatron_jetrl.cli import main

    for sub in (["train"], ["serve"], ["launch"], ["plot"], ["bench", "linear"], ["bench", "step"], ["bench", "rollout"],
                ["bench", "train"], ["bench", "sync"], ["mismatch"]):  # in process: argparse prints and exits 0
        with pytest.raises(SystemExit) as ex:
            main([*sub, "--help"])
        assert ex.value.code == 0 and "usage: jetrl" in capsys.readouterr().out, sub
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", "--preset", "tiny",
                          "parallel.tensor_parallel=3"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("config error: parallel.tensor_parallel: 3 does not divide")
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", "--preset", "tiny",
                          "data.path=/nonexistent.jsonl"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith("data.path: '/nonexistent.jsonl' not found")
