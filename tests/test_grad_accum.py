"""Gradient-accumulation fusion under megatron-core's real DDP (gloo): the FP8 wgrad and megatron's
BF16 linears write into the fp32 main_grad, placeholders dropped."""
import os
import pytest
import torch
from megatron_jetrl.precision.recipe import FP8Recipe
from tests.common import REPO, graph_names, megatron_linears, ddp_main_grads_fused_vs_unfused

def test_fp8_wgrad_accumulates_into_megatron_main_grad(megatron_single):
    """precision.fuse_wgrad_accumulation under megatron's real DDP (gloo, CPU): the FP8 wgrad adds its fp32
    product straight into each weight's ``main_grad`` and marks ``grad_added_to_main_grad``, so megatron's
    backward hook drops the placeholder gradient instead of adding it a second time. Over two micro-batches
    and two steps every ``main_grad`` equals the unfused path's (fp32 parameters: the unfused wgrad is fp32
    too, so the same numbers up to the order of fp32 additions); the fused path ran for the FP8 linears whose
    rows need no permutation and for megatron's BF16 LM head (``models/grad_accum.py``)."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.builder import build_model

    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), ["precision.mode=jet"])
    torch.manual_seed(0)
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), torch.float32,
                               backend="emulated")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.model.vocab_size, (2, 16), generator=g) for _ in range(2)]
    grads, fused = ddp_main_grads_fused_vs_unfused(model, state, batches, torch.arange(16).expand(2, 16))
    assert fused
    for step in range(2):
        for n, ref in grads[False, step].items():
            got = grads[True, step][n]
            assert ref.abs().sum() > 0, n
            assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6), (n, (got - ref).abs().max())


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_gradient_goes_into_main_grad_unless_tied(tied, megatron_single):
    """The untied input embedding's backward adds its rows into ``main_grad`` (``grad_accum._EmbeddingIntoMainGrad``;
    the same main_grads as the dense gradient: checked with the linears in the test above); a weight tied to the
    LM head keeps megatron-core's forward, and switching the fusion off restores it."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.models.builder import build_model
    from megatron_jetrl.models.grad_accum import enable

    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"),
                      ["precision.mode=bf16", f"model.tie_word_embeddings={str(tied).lower()}"])
    model, _ = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), torch.float32,
                           backend="emulated")
    emb = model.embedding.word_embeddings
    enable(model, True)
    assert ("forward" in emb.__dict__) == (not tied)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 8))
    out = emb(tokens)
    assert torch.equal(out, torch.nn.functional.embedding(tokens, emb.weight))
    assert ("_EmbeddingIntoMainGradBackward" in graph_names(out)) == (not tied)
    out.sum().backward()  # outside DDP (no main_grad): the dense gradient, as megatron's path gives it
    ref = torch.zeros_like(emb.weight).index_add_(0, tokens.reshape(-1), torch.ones(16, emb.weight.shape[1]))
    assert torch.equal(emb.weight.grad, ref)
    enable(model, False)
    assert "forward" not in emb.__dict__


def test_grad_accum_fusion_probe_follows_device_and_dtype(megatron_single):
    """models/grad_accum.py switches megatron's fusion on only where its torch call runs for the model's
    parameters: fp32 on CPU (``addmm_``) yes, BF16 on CPU (``addmm`` with an fp32 ``out_dtype`` is CUDA-only) no,
    leaving every layer on megatron's plain path."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.models import grad_accum
    from megatron_jetrl.models.builder import build_model

    assert grad_accum.available("cpu", torch.float32) == (True, "")
    ok, why = grad_accum.available("cpu", torch.bfloat16)
    assert not ok and why
    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), ["precision.mode=bf16"])
    for dtype, expect_on in ((torch.bfloat16, False), (torch.float32, True)):
        model, _ = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), dtype, backend="emulated")
        n = grad_accum.enable(model)
        flags = {m.gradient_accumulation_fusion for m in megatron_linears(model)}
        assert (n > 0) == expect_on and flags == {expect_on}, (dtype, n, flags)
