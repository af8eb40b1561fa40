"""RL math against hand-computed cases."""
import math

import pytest
import torch

from megatron_jetrl.trainer import loss as L


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
