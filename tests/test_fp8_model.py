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


def test_unaligned_fp8_layout_is_refused(megatron_single):
    from megatron_jetrl.config import load_config
    from megatron_jetrl.distributed import init_distributed
    from megatron_jetrl.models.builder import build_model

    cfg = load_config(None, ["model.num_key_value_heads=1", "model.num_attention_heads=4",
                             "model.hidden_size=256", "precision.params_dtype=fp32"])
    init_distributed(cfg.parallel)
    with pytest.raises(ValueError, match=r"linear_qkv splits into sub-matrices of \[256, 64, 64\]"):
        build_model(cfg.model, cfg.parallel, FP8Recipe.from_config(cfg.precision), torch.float32)
