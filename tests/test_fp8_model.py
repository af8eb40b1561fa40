"""FP8 inside the megatron-core model: which layers run FP8, the weight cache, rollout layout."""
import pytest
import torch

from megatron_jetrl.models.hf_io import HFCheckpoint
from megatron_jetrl.precision.linear import fp8_report, refresh_fp8_weights
from megatron_jetrl.precision.quant import quantize_weight
from megatron_jetrl.precision.recipe import FP8Recipe
from tests.hf_models import make_hf_model
from tests.workers import build_loaded


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3"))
    make_hf_model("qwen3", path, seed=7)
    return path


def _fwd(model, tokens):
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, pos, None)


def test_fp8_layers_reported_per_mode(qwen3_dir, megatron_single):
    tokens = torch.randint(0, 384, (2, 16))
    _, bf16_model, _ = build_loaded(qwen3_dir, ["precision.mode=bf16"])
    report = fp8_report(bf16_model)
    assert len([k for k in report if "linear_" in k]) == 8 and not any(report.values())
    ref = _fwd(bf16_model, tokens)

    _, jet, state = build_loaded(qwen3_dir, ["precision.mode=jet"])
    report = fp8_report(jet)
    assert all(v for k, v in report.items() if "linear_" in k)
    assert report["output_layer"] is False  # lm_head stays BF16
    assert state.num_fp8_layers == 8
    out = _fwd(jet, tokens)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 0.1  # FP8 really runs, and stays close

    _, off, state = build_loaded(qwen3_dir, ["precision.mode=fp8_rollout"])
    assert not any(fp8_report(off).values())  # BF16 training forward
    assert torch.allclose(_fwd(off, tokens), ref)
    with state.rollout_precision():  # FP8 rollout forward
        assert all(v for k, v in fp8_report(off).items() if "linear_" in k)
        assert torch.equal(_fwd(off, tokens), out)


def test_cache_bytes_are_the_rollout_layout_and_refresh_per_step(qwen3_dir, megatron_single):
    _, model, state = build_loaded(qwen3_dir, ["precision.mode=jet"])
    ckpt = HFCheckpoint(qwen3_dir)
    recipe = FP8Recipe()
    attn = model.decoder.layers[1].self_attention.linear_qkv
    mlp = model.decoder.layers[1].mlp.linear_fc1
    tokens = torch.randint(0, 384, (2, 16))
    _fwd(model, tokens)
    _fwd(model, tokens)
    assert attn.fp8_cache.refreshes == 1  # reused by every forward of one version
    for cache, names in ((attn.fp8_cache, ["q_proj", "k_proj", "v_proj"]),
                         (mlp.fp8_cache, ["gate_proj", "up_proj"])):
        for (q, s), hf_name in zip(cache.parts(), names):
            sub = "self_attn" if hf_name.endswith(("q_proj", "k_proj", "v_proj")) else "mlp"
            ref_q, ref_s = quantize_weight(ckpt.get(f"model.layers.1.{sub}.{hf_name}.weight"), recipe)
            assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), hf_name
            assert torch.equal(s, ref_s), hf_name
    before = attn.fp8_cache.qweight.clone()
    with torch.no_grad():  # an optimizer step changes the weights ...
        attn.weight.add_(torch.randn_like(attn.weight) * 0.05)
    seconds = refresh_fp8_weights(model, state)  # ... and the step hook re-quantizes once
    assert seconds >= 0 and attn.fp8_cache.refreshes == 2 and attn.fp8_cache.version == state.version
    assert not torch.equal(before.view(torch.uint8), attn.fp8_cache.qweight.view(torch.uint8))
    _fwd(model, tokens)
    assert attn.fp8_cache.refreshes == 2


def test_bf16_mode_never_quantizes(qwen3_dir, megatron_single):
    _, model, state = build_loaded(qwen3_dir, ["precision.mode=bf16"])
    assert refresh_fp8_weights(model, state) == 0.0
    _fwd(model, torch.randint(0, 384, (2, 16)))
    assert all(m.fp8_cache.refreshes == 0 for m in model.modules() if getattr(m, "fp8_cache", None) is not None)


def test_unaligned_fp8_linears_stay_bf16(megatron_single):
    """q/k/v of [256, 64, 64] rows cannot be cut into 128-row blocks: that linear stays BF16 (no FP8 state, no
    cache: its forward is megatron's own), the others are FP8."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.distributed import init_distributed
    from megatron_jetrl.models.builder import build_model

    cfg = load_config(None, ["model.num_key_value_heads=1", "model.num_attention_heads=4",
                             "model.hidden_size=256", "precision.params_dtype=fp32"])
    init_distributed(cfg.parallel)
    model, state = build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), torch.float32)
    qkv = [f"decoder.layers.{i}.self_attention.linear_qkv" for i in range(cfg.model.num_layers)]
    assert state.bf16_linears == qkv and state.num_fp8_layers == 3 * cfg.model.num_layers
    mods = dict(model.named_modules())
    assert all(mods[n].fp8_cache is None and not mods[n].fp8_active() for n in qkv)
    assert mods["decoder.layers.0.mlp.linear_fc1"].fp8_active()


def test_qkv_training_order_reuses_the_rollout_blocks(tmp_path, megatron_single):
    """With head_dim 128 the rollout permutation of the fused QKV moves whole 128-row blocks, so the
    training GEMMs use the cached blocks reordered into Megatron's row order (no permutation of y, dy,
    dW): those bytes and scales are exactly the 128x128 quantization of the Megatron-order weight, and
    the forward and gradients equal the permuted path's (``FP8ModelState.qkv_train_order=False``). With head_dim
    64 a block holds two heads and the permuted path stays."""
    from megatron_jetrl.precision.linear import _whole_block_map

    path = str(tmp_path / "hf")
    make_hf_model("llama", path, seed=5, head_dim=128, num_attention_heads=4, num_key_value_heads=2)
    tokens = torch.randint(0, 384, (2, 12))
    pos = torch.arange(12).expand_as(tokens)
    results = {}
    for flag in ("1", "0"):
        _, model, state = build_loaded(path, ["precision.mode=jet"])
        state.qkv_train_order = flag == "1"
        qkv = model.decoder.layers[-1].self_attention.linear_qkv  # its dy does not pass through a QKV dgrad
        cache = qkv.fp8_cache
        assert cache.train_blocks is not None
        out = model(tokens, pos, None)
        out.float().square().mean().backward()
        results[flag] = (out.detach(), qkv.weight.grad.clone(), model.embedding.word_embeddings.weight.grad.clone())
        assert (cache._train is not None) == (flag == "1")
        if flag == "1":
            tq, ts = cache._train
            q_ref, s_ref = quantize_weight(qkv.weight.detach(), FP8Recipe())
            assert torch.equal(tq.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(ts, s_ref)
            assert torch.equal(tq.view(torch.uint8), cache.qweight.index_select(0, cache.inv_perm).view(torch.uint8))
            with torch.no_grad():  # an optimizer step: the refresh re-quantizes and reorders in place
                qkv.weight.add_(torch.randn_like(qkv.weight) * 0.05)
            refresh_fp8_weights(model, state)
            q_new, s_new = quantize_weight(qkv.weight.detach(), FP8Recipe())
            assert cache._train[0].data_ptr() == tq.data_ptr() and torch.equal(tq.view(torch.uint8), q_new.view(torch.uint8))
            assert torch.equal(ts, s_new)
    (y1, gw1, ge1), (y0, gw0, ge0) = results["1"], results["0"]
    assert torch.allclose(y1, y0, rtol=1e-6, atol=1e-6)
    # the last layer's QKV wgrad: the same dy rows and x in either order
    assert torch.allclose(gw1, gw0, rtol=1e-6, atol=1e-9)
    # dgrad sums over the QKV rows in another order (fp32 rounding), which the FP8 gradient quantizers of the
    # layers below can turn into a different E4M3 value here and there: close, not equal
    assert ((ge1 - ge0).norm() / ge0.norm()).item() < 1e-2
    # head_dim 64 (the default test models): 128-row blocks hold two heads -> no whole-block map
    from megatron_jetrl.precision.layout import qkv_permutation
    perm, _ = qkv_permutation(8 * 64 + 2 * 4 * 64, 2, 64)
    assert _whole_block_map(torch.argsort(perm), 128) is None
    perm, _ = qkv_permutation(4 * 128 + 2 * 2 * 128, 2, 128)
    assert _whole_block_map(torch.argsort(perm), 128) is not None
