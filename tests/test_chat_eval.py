"""Real-model data paths: chat templates, nested/multi-file prompt sets, held-out evaluation during training
and of a finished checkpoint (`jetrl eval`), over a rollout fleet."""
import json
import os
import subprocess
import sys

import pytest

from megatron_jetrl.config import ConfigError
from megatron_jetrl.data.prompts import DataError, Sample, load_prompts
from megatron_jetrl.data.tokenizer import load_tokenizer
from tests.hf_models import make_chat_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO)


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_chat_tokenizer(str(path))
    return str(path)


def test_chat_template_renders_prompts(chat_tok, tmp_path):
    tok = load_tokenizer(chat_tok, "auto", "be brief")
    assert tok.render(tok.encode_prompt("1+2=")) == "<s><system>be brief<|eot|><user>1+2=<|eot|><assistant>"
    assert tok.render(tok.encode_prompt([{"role": "user", "content": "3*3="}])) == "<s><user>3*3=<|eot|><assistant>"
    raw = load_tokenizer(chat_tok, False)
    assert raw.render(raw.encode_prompt("1+2=")) == "<s>1+2="
    with pytest.raises(DataError, match="list of chat messages but no chat template applies"):
        raw.encode_prompt([{"role": "user", "content": "hi"}])
    with pytest.raises(ConfigError, match="data.apply_chat_template: true, but the built-in tokenizer"):
        load_tokenizer("builtin", True)
    plain = tmp_path / "plain"
    make_chat_tokenizer(str(plain))
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in plain.glob("chat_template.*"):
        f.unlink()
    with pytest.raises(ConfigError, match="has no chat template"):
        load_tokenizer(str(plain), True)
    assert not load_tokenizer(str(plain), "auto").chat


def test_prompt_files_nested_keys_and_messages(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": 2},
                             "data_source": "x"}) + "\n")
    b.write_text(json.dumps({"prompt": "2+2=", "reward_model": {"ground_truth": "4"}}) + "\n")
    got = load_prompts([str(a), str(b)], "prompt", "reward_model.ground_truth")
    assert got == [Sample([{"role": "user", "content": "1+1="}], "2", {"reward_model": {"ground_truth": 2},
                                                                       "data_source": "x"}),
                   Sample("2+2=", "4", {"reward_model": {"ground_truth": "4"}})]
    b.write_text(json.dumps({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "4"}}) + "\n")
    with pytest.raises(DataError, match=r"row 1 of .*b.jsonl: the prompt is a list, not a string or a list of"):
        load_prompts([str(a), str(b)], "prompt", "reward_model.ground_truth")
    with pytest.raises(DataError, match=r"has no 'reward_model.answer' field; .*dotted"):
        load_prompts(str(a), "prompt", "reward_model.answer")


def _sums(path, pairs):
    with open(path, "w") as f:
        for x, y in pairs:
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{x}+{y}="}],
                                "reward_model": {"ground_truth": str(x + y)}}) + "\n")


def test_train_with_chat_data_and_eval_over_a_fleet_then_jetrl_eval(chat_tok, tmp_path):
    """An HF chat tokenizer, two prompt files of chat messages with the answer in a nested column, held-out
    evaluation before the first RL step and after it, on a colocated `jetrl serve` fleet; then `jetrl eval`
    of the checkpoint in two precision modes on the same prompts."""
    _sums(tmp_path / "t1.jsonl", [(x, y) for x in range(5) for y in range(5)])
    _sums(tmp_path / "t2.jsonl", [(x, y) for x in range(5, 9) for y in range(5)])
    _sums(tmp_path / "val.jsonl", [(x, 9) for x in range(6)])
    data = [f"data.path=[{tmp_path / 't1.jsonl'},{tmp_path / 't2.jsonl'}]", "data.prompt_key=prompt",
            "data.answer_key=reward_model.ground_truth", f"data.val_path={tmp_path / 'val.jsonl'}"]
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", "--preset", "tiny", "--run-dir", str(run),
                          "steps=2", "algo.sft_warmup_steps=1", f"model.tokenizer={chat_tok}", "model.vocab_size=128",
                          "model.max_position_embeddings=96", "rollout.max_new_tokens=4", *data,
                          "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2", "rollout.engine=serve",
                          "rollout.chunk_size=16", "eval.interval=1", "eval.n_samples=2"],
                         env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the first prompt as the policy sees it: '<s><user>0+0=<|eot|><assistant>'" in out.stderr
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("is_rl") == 1.0]
    assert len(rl) == 2 and all(0 <= r["eval/accuracy"] <= 1 and 0 <= r["eval/pass@2"] <= 1 for r in rl)
    assert all("truncated_fraction" in r and r["parity_mismatch"] == 0 for r in rl)
    assert not any("eval/accuracy" in r for r in rows if r.get("is_rl") == 0.0)
    assert rows[-1]["step"] == 3 and "is_rl" not in rows[-1] and 0 <= rows[-1]["eval/pass@2"] <= 1  # after the last step
    # the jet evaluation from a config whose model has Llama-3.1's RoPE scaling: eval builds the checkpoint's model
    # (plain RoPE, its model_config.json's null), not the config's
    import yaml

    scaled = yaml.safe_load(open(os.path.join(REPO, "examples", "configs", "tiny.yaml")))
    scaled["model"]["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    with open(tmp_path / "scaled.yaml", "w") as f:
        yaml.safe_dump(scaled, f)
    res = {}
    for mode, config in (("bf16", ["--preset", "tiny"]), ("jet", ["--config", str(tmp_path / "scaled.yaml")])):
        ev = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "eval", str(run / "checkpoints" / "step_2"),
                             "--data", str(tmp_path / "val.jsonl"), *config, f"model.tokenizer={chat_tok}",
                             "data.answer_key=reward_model.ground_truth", "eval.n_samples=2", f"precision.mode={mode}"],
                            env=ENV, capture_output=True, text=True, timeout=300)
        assert ev.returncode == 0, ev.stderr[-3000:]
        res[mode] = json.loads(ev.stdout.strip().splitlines()[-1])
        assert res[mode]["prompts"] == 6 and res[mode]["mode"] == mode and "eval/pass@2" in res[mode]
