"""RL math against hand-computed cases."""
import math
import os

import pytest
import torch

from megatron_jetrl.trainer import loss as L

from tests.common import run_interpreted


def test_grpo_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = L.grpo_advantages(r, 4)
    # group 1: mean 0.5, std (unbiased) = sqrt(1/3)
    s = math.sqrt(1 / 3)
    assert torch.allclose(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (s + 1e-6))
    assert torch.all(adv[4:] == 0)  # all-equal group carries no signal
    assert torch.allclose(L.grpo_advantages(r, 4, normalize_std=False)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError):
        L.grpo_advantages(r, 3)


def test_ppo_clip_hand_computed():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.25, 0.5]]))  # ratios 1.5, 0.5, 1.0
    mask = torch.ones(1, 3)
    loss, st = L.policy_loss(new, old, torch.tensor([1.0]), mask, 0.2, 0.2)
    # A>0: -min(r, clip(r)) -> -1.2 (clipped), -0.5 (unclipped lower), -1.0
    assert torch.allclose(loss, torch.tensor([[-1.2, -0.5, -1.0]]), atol=1e-6)
    assert st["clip_fraction"].item() == pytest.approx(1 / 3)
    loss, _ = L.policy_loss(new, old, torch.tensor([-1.0]), mask, 0.2, 0.3)
    # A<0: -min(-r, -clip(r)) = max(r, clip(r)) -> 1.5, 0.8 (clipped at 1-0.2), 1.0
    assert torch.allclose(loss, torch.tensor([[1.5, 0.8, 1.0]]), atol=1e-6)


def test_aggregation_token_vs_sequence_mean():
    per_tok = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert L.aggregate(per_tok, mask, "token_mean").item() == pytest.approx(8 / 5)
    assert L.aggregate(per_tok, mask, "seq_mean").item() == pytest.approx((1 + 4) / 2)


def test_kl_estimators_and_tis():
    logp = torch.log(torch.tensor([0.5, 0.2]))
    ref = torch.log(torch.tensor([0.25, 0.4]))
    k1 = L.kl_estimate(logp, ref, "k1")
    k3 = L.kl_estimate(logp, ref, "k3")
    assert torch.allclose(k1, torch.tensor([math.log(2), math.log(0.5)]))
    assert torch.allclose(k3, torch.tensor([0.5 - 1 - math.log(0.5), 2 - 1 - math.log(2)]))
    assert torch.all(k3 >= 0)
    w = L.truncated_is_weights(torch.log(torch.tensor([0.9, 0.1])), torch.log(torch.tensor([0.1, 0.2])), 2.0)
    assert torch.allclose(w, torch.tensor([2.0, 0.5]))  # 9 capped at C=2


def test_mismatch_metrics_hand_computed():
    train = torch.log(torch.tensor([[0.5, 0.4, 0.9]]))
    roll = torch.log(torch.tensor([[0.25, 0.4, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    m = L.mismatch_metrics(train, roll, mask)
    assert m["mismatch_abs_mean"].item() == pytest.approx(math.log(2) / 2, rel=1e-6)
    assert m["mismatch_abs_max"].item() == pytest.approx(math.log(2), rel=1e-6)
    assert m["is_weight_max"].item() == pytest.approx(2.0, rel=1e-6)
    assert m["is_weight_min"].item() == pytest.approx(1.0, rel=1e-6)
    # k3 of KL(rollout || train) on rollout samples: train/roll - 1 - log(train/roll)
    assert m["mismatch_k3_kl"].item() == pytest.approx((2 - 1 - math.log(2)) / 2, rel=1e-5)


def test_vocab_parallel_logp_and_entropy_match_plain_torch(megatron_single):
    from megatron_jetrl.trainer.actor import vocab_parallel_logp_entropy

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 50, requires_grad=True)
    labels = torch.randint(0, 50, (3, 5))
    logp, ent = vocab_parallel_logp_entropy(logits, labels, 0.7, True)
    ref = torch.log_softmax(logits.detach() / 0.7, -1)
    assert torch.allclose(logp, ref.gather(-1, labels[..., None]).squeeze(-1), atol=1e-5)
    assert torch.allclose(ent, L.entropy_from_logits(logits.detach() / 0.7), atol=1e-5)
    (logp.sum() + ent.sum()).backward()  # both differentiable
    assert torch.isfinite(logits.grad).all()
    # entropy as a metric only (no entropy bonus): same values, no autograd graph through it, and
    # the logp gradient unchanged
    g_ref = torch.autograd.grad(vocab_parallel_logp_entropy(logits, labels, 0.7, False)[0].sum(), logits)[0]
    logp2, ent2 = vocab_parallel_logp_entropy(logits, labels, 0.7, True, entropy_grad=False)
    assert torch.equal(logp2, logp) and torch.allclose(ent2, ent, atol=1e-6) and not ent2.requires_grad
    assert torch.equal(torch.autograd.grad(logp2.sum(), logits)[0], g_ref)


def test_exact_logp_is_the_samplers_bits(megatron_single):
    """Exact mode's logprob: the trainer's (``vocab_parallel_logp_entropy(exact=True)`` over a [s, b, V] view of
    [b, s, V] memory, as the LM head returns it) and the rollout sampler's (``sample_next(exact=True)`` ->
    ``fused_logp.label_logp`` on one row) are the same bits, on the eager path (``log_softmax(logits.float() / T)``,
    megatron's cross entropy would differ) and on the fused one (its value and gradient, its entropy)."""
    from megatron_jetrl.kernels.fused_logp import label_logp
    from megatron_jetrl.rollout.base import SamplingParams, sample_next
    from megatron_jetrl.trainer.actor import vocab_parallel_logp_entropy

    g = torch.Generator().manual_seed(3)
    base = (torch.randn(6, 4, 3000, generator=g) * 4).bfloat16()
    logits = base.transpose(0, 1).requires_grad_(True)
    labels = torch.randint(0, 3000, (4, 6), generator=g)
    T = 0.7
    statement = torch.log_softmax(logits.detach().float() / T, -1).gather(-1, labels[..., None]).squeeze(-1)
    for fused in (False, True):
        logp, ent = vocab_parallel_logp_entropy(logits, labels, T, True, fused=fused, exact=True)
        for s, b in ((0, 0), (2, 1), (3, 5), (1, 4)):
            assert torch.equal(label_logp(logits.detach()[s, b:b + 1], labels[s, b:b + 1], T, fused=fused), logp[s, b:b + 1])
        if fused:
            ref, ref_ent = vocab_parallel_logp_entropy(logits, labels, T, True, fused=True)
            assert torch.equal(logp, ref) and torch.equal(ent, ref_ent)
            w = torch.randn(labels.shape, generator=g)
            assert torch.equal(torch.autograd.grad((logp * w).sum(), logits)[0],
                               torch.autograd.grad((ref * w).sum(), logits)[0])
        else:
            assert torch.equal(logp, statement)
            assert not torch.equal(vocab_parallel_logp_entropy(logits.contiguous(), labels, T, False, fused=False)[0], statement)
    # the sampler's logprob of the token it drew (eager draw here; label_logp's own decision of the path)
    row = logits.detach()[2, 1:2]
    tok, lp = sample_next(row, SamplingParams(temperature=T), torch.Generator().manual_seed(0), exact=True)
    assert torch.equal(lp, label_logp(row, tok, T)) and torch.equal(lp, label_logp(row, tok, T, fused=False))


def _eager_logp_entropy(logits, labels, temperature):
    """megatron-core's vocab-parallel cross entropy + the entropy (the eager path) at world size 1."""
    from megatron_jetrl.trainer.actor import vocab_parallel_logp_entropy

    return vocab_parallel_logp_entropy(logits, labels, temperature, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_logp_entropy_equals_megatron_cross_entropy(megatron_single, dtype):
    """The fused logprob/entropy (``kernels/fused_logp.py``; CPU statistics here) vs megatron-core's
    vocab-parallel cross entropy and the eager entropy: values and the logits' gradient of a loss
    using both (entropy bonus on), and with the entropy unused (its backward term skipped)."""
    from megatron_jetrl.kernels.fused_logp import fused_logp_entropy

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 300, generator=g) * 4).to(dtype)
    labels = torch.randint(0, 300, (3, 7), generator=g)
    labels[0, 0], labels[0, 1] = 0, 299
    w = torch.randn(3, 7, generator=g)
    for T in (1.0, 0.7):
        a = logits.clone().requires_grad_(True)
        b = logits.clone().requires_grad_(True)
        lp, ent = fused_logp_entropy(a, labels, T)
        lp_r, ent_r = _eager_logp_entropy(b, labels, T)
        assert lp.dtype == torch.float32 and lp.shape == labels.shape
        torch.testing.assert_close(lp, lp_r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ent_r, rtol=1e-5, atol=1e-5)
        ((lp * w).sum() - 0.1 * ent.sum()).backward()
        ((lp_r * w).sum() - 0.1 * ent_r.sum()).backward()
        assert a.grad.dtype == dtype
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=tol, atol=tol)
        a.grad = b.grad = None
        fused_logp_entropy(a, labels, T)[0].sum().backward()  # entropy unused: the logp gradient alone
        _eager_logp_entropy(b, labels, T)[0].sum().backward()
        torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=tol, atol=tol)


def test_fused_logp_entropy_tensor_parallel_over_gloo():
    """TP=2: each rank holds half the vocabulary; the combined statistics give the single-rank
    logprobs and entropy, and each rank's gradient is its slice of the full gradient."""
    from megatron_jetrl.kernels.fused_logp import fused_logp_entropy
    from tests.dist import run_workers
    from tests.workers import fused_logp_tp_worker

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 64, generator=g) * 3
    labels = torch.randint(0, 64, (2, 5), generator=g)
    labels[0, 0], labels[1, 0] = 31, 32  # the last of rank 0's slice, the first of rank 1's
    full = logits.clone().requires_grad_(True)
    lp, ent = fused_logp_entropy(full, labels, 0.9)
    (lp.sum() + 0.3 * ent.sum()).backward()
    res = run_workers(fused_logp_tp_worker, 2, logits, labels, 0.9)
    for rank, (lp_r, ent_r, grad_r) in enumerate(res):
        torch.testing.assert_close(lp_r, lp.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ent_r, ent.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad_r, full.grad[..., rank * 32:(rank + 1) * 32], rtol=1e-5, atol=1e-6)


def test_fused_logp_kernels_under_the_interpreter():
    """The Triton kernels of the fused logprob (CUDA in production) under Triton's CPU interpreter,
    fp32: statistics and gradient equal the torch statement to fp32 rounding, vocabulary slices that
    are not a multiple of the kernel's block, labels outside the slice (TP)."""
    code = r'''
import torch
from megatron_jetrl.kernels import fused_logp as F
g = torch.Generator().manual_seed(0)
for T, V, start in ((5, 3000, 0), (3, 2048, 2048), (4, 100, 50)):
    x = torch.randn(T, V, generator=g) * 5
    lab = torch.randint(start, start + V + 40, (T,), generator=g)
    lab[0] = start + V - 1
    st = F._local_stats(x, lab, 0.7, start)
    lse = st[0] + torch.log(st[1]); ez = st[2] / st[1]
    glp, gent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    dx = F._logits_grad(x, lab, lse, ez, glp, gent, 0.7, start)
    dx0 = F._logits_grad(x, lab, lse, ez, glp, None, 0.7, start)
    F.triton = None  # the torch statement
    ref = F._local_stats(x, lab, 0.7, start)
    torch.testing.assert_close(st, ref, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(dx, F._logits_grad(x, lab, lse, ez, glp, gent, 0.7, start), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dx0, F._logits_grad(x, lab, lse, ez, glp, None, 0.7, start), rtol=1e-5, atol=1e-7)
    import triton as _t
    F.triton = _t
print("ok")
'''
    run_interpreted(code)


def test_overlong_penalty_and_informative_groups():
    lengths = torch.tensor([10, 28, 30, 31, 32])
    assert L.overlong_penalty(lengths, 32, 4, 1.0).tolist() == [0.0, 0.0, -0.5, -0.75, -1.0]
    assert L.overlong_penalty(lengths, 32, 0).tolist() == [0.0] * 5
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0])
    assert L.informative_groups(rewards, 3).tolist() == [False, True, False]
    dr = L.grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, normalize_std=False)  # Dr. GRPO: no std
    assert dr.tolist() == [0.75, -0.25, -0.25, -0.25]


def test_rl_recipe_knobs_in_a_run(tmp_path):
    """mini-batches (old logprobs from before the first update: the ratio moves off 1 in the later parts), DAPO's
    dynamic sampling (informative groups refilled), Dr. GRPO advantages, a linear LR decay to min_lr and the
    overlong penalty, in one tiny run."""
    import json
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", "--preset", "tiny", "--run-dir",
                          str(tmp_path), "steps=3", "algo.sft_warmup_steps=2", "rollout.prompts_per_step=2",
                          "rollout.n_samples_per_prompt=4", "algo.mini_batches=2", "algo.dynamic_sampling=true",
                          "algo.advantage=dr_grpo", "algo.lr_schedule=linear", "algo.min_lr=0.00001",
                          "algo.overlong_buffer=2", "eval.interval=0"],
                         env=dict(os.environ, PYTHONPATH=repo), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    rl = [r for r in rows if r.get("is_rl") == 1.0]
    assert all(r["optimizer_steps"] == 2.0 and r["sampling_rounds"] >= 1 for r in rl)
    assert any(r["ratio_mean"] != 1.0 for r in rl)  # the second part's ratio is new/old, no longer exactly 1
    lrs = [r["lr"] for r in rl]
    assert all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] == pytest.approx(1e-5)


def test_dynamic_sampling_refills_informative_groups(monkeypatch):
    """``train._rollout`` with algo.dynamic_sampling: groups whose rewards are all equal are dropped, more rollouts
    are drawn until prompts_per_step informative groups are kept (or the rounds run out: then the last round's
    groups fill), and what was dropped and how many rounds it took are logged."""
    import types

    from megatron_jetrl.config import load_config
    from megatron_jetrl.data.prompts import Sample
    from megatron_jetrl.rollout.base import Generation
    from megatron_jetrl import train

    cfg = load_config(None, ["rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2", "algo.dynamic_sampling=true",
                             "algo.max_sampling_rounds=3"])
    # each round: 2 groups; answers tell the reward: "1" = the sample is right
    rounds = iter([[("a", [1, 1]), ("b", [0, 1])], [("c", [0, 0]), ("d", [1, 0])], [("e", [1, 1]), ("f", [0, 0])]])

    def rollout(step):
        groups = next(rounds)
        samples = [Sample(p, "1") for p, _ in groups]
        gens = [Generation([1], [r], [0.0]) for _, rs in groups for r in rs]
        return samples, [[1]] * len(gens), gens, {}

    run = types.SimpleNamespace(cfg=cfg, scheduler=types.SimpleNamespace(rollout=rollout),
                                tokenizer=types.SimpleNamespace(decode=lambda ids: str(ids[0])),
                                reward_fn=lambda text, answer, meta: float(text == answer))
    m = {}
    samples, prompts, gens, rewards = train._rollout(run, 0, m)
    assert [s.prompt for s in samples] == ["b", "d"] and rewards.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert m == {"filtered_groups": 2.0, "sampling_rounds": 2.0}
    cfg.algo.max_sampling_rounds = 1  # out of rounds: the round's uninformative groups fill the batch
    rounds = iter([[("a", [1, 1]), ("b", [0, 1])]])
    samples, *_ = train._rollout(run, 0, m)
    assert [s.prompt for s in samples] == ["b", "a"] and m["sampling_rounds"] == 1.0


def test_every_stop_id_ends_a_response():
    from megatron_jetrl.rollout.base import SamplingParams
    from megatron_jetrl.rollout.local import LocalEngine

    engine = LocalEngine.__new__(LocalEngine)
    engine.weight_version = 0
    ids = [torch.tensor([5, 8, 9]), torch.tensor([7, 2, 9]), torch.tensor([9, 9, 9]), torch.tensor([3, 3, 3])]
    lps = [torch.zeros(3)] * 4
    gens = engine._finish([[1]] * 3, ids, lps, SamplingParams(stop_token_ids=(7, 2, 9)))
    assert [(g.output_ids, g.finish_reason) for g in gens] == [([5, 7], "stop"), ([8, 2], "stop"), ([9], "stop")]
