"""Reward extraction, the registry, prompt files."""
import json

import pytest

from megatron_jetrl.config import ConfigError
from megatron_jetrl.data.prompts import PromptStream, load_prompts, synthetic_arithmetic
from megatron_jetrl.data.tokenizer import CharTokenizer
from megatron_jetrl.rewards import get_reward, register_reward
from megatron_jetrl.rewards.math import answers_equal, extract_answer


@pytest.mark.parametrize("text,answer", [
    ("so the total is 72.\n#### 72", "72"),
    ("The answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("nested \\boxed{x^{2}} here", "x^{2}"),
    ("we get 3 then 1,234", "1,234"),
    ("no number here", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("pred,ref,ok", [
    ("1,234", "1234", True), ("0.5", "\\frac{1}{2}", True), ("1/2", "0.5", True),
    ("$12", "12", True), ("12.0", "12", True), ("13", "12", False), (None, "1", False),
    ("x^{2}", "x^{2}", True),
])
def test_numeric_equivalence(pred, ref, ok):
    assert answers_equal(pred, ref) is ok


def test_registry():
    fn = get_reward("math")
    assert fn("#### 12", "12", {}) == 1.0 and fn("#### 11", "12", {}) == 0.0
    with pytest.raises(ConfigError, match="data.reward: unknown reward .nope."):
        get_reward("nope")

    @register_reward("length_test")
    def _len(resp, ans, meta):
        return float(len(resp))

    assert get_reward("length_test")("abc", "", {}) == 3.0


def test_hash_reward_spreads_every_group():
    """The benchmark reward: deterministic per text, in [0, 1), and different across a group of responses
    (so GRPO's advantages are non-zero: the point of it on random weights, where ``math`` gives all zeros)."""
    import torch

    from megatron_jetrl.trainer.loss import grpo_advantages

    fn = get_reward("hash")
    texts = ["", "a", "b", "12", "1 2", "\\boxed{3}", "3", "33"]
    vals = [fn(t, "3", {}) for t in texts]
    assert vals == [fn(t, "7", {}) for t in texts]  # the text alone decides
    assert all(0.0 <= v < 1.0 for v in vals) and len(set(vals)) == len(vals)
    adv = grpo_advantages(torch.tensor(vals), len(vals))
    assert bool((adv != 0).all())
    assert get_reward("math")("abc", "3", {}) == 0.0  # what a random-weight model's text scores otherwise


def test_jsonl_and_parquet_prompts(tmp_path):
    rows = [{"question": "1+1?", "solution": "2", "level": 1}, {"question": "2+2?", "solution": "4", "level": 2}]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    got = load_prompts(str(p), "question", "solution")
    assert [s.prompt for s in got] == ["1+1?", "2+2?"] and got[1].metadata == {"level": 2}
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert [s.answer for s in load_prompts(str(tmp_path / "d.parquet"), "question", "solution")] == ["2", "4"]
    with pytest.raises(ValueError, match="row 1 of .* has no 'prompt' field"):
        load_prompts(str(p))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 1}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2 is not valid JSON"):
        load_prompts(str(bad))
    with pytest.raises(ValueError, match="data.path: .* not found"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_synthetic_task_tokenizer_and_stream_resume():
    samples = synthetic_arithmetic(50, seed=1)
    tok = CharTokenizer()
    for s in samples:
        assert int(s.answer) == s.metadata["a"] + s.metadata["b"]
        assert tok.decode(tok.encode(s.prompt)) == s.prompt
    a = PromptStream(samples, seed=3)
    a.next(70)
    state = a.state_dict()
    b = PromptStream(samples, seed=3)
    b.load_state_dict(state)
    assert [s.prompt for s in a.next(20)] == [s.prompt for s in b.next(20)]
