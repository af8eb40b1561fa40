"""Foundation: HF -> megatron-core logits parity, all model types, all layouts (CPU, gloo)."""
import pytest
import torch

from tests.dist import run_workers
from tests.hf_models import make_hf_model
from tests.workers import build_loaded, layouts_worker

MODEL_TYPES = ["llama", "qwen2", "qwen3", "qwen3_moe"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for mt in MODEL_TYPES:
        path = str(tmp_path_factory.mktemp(mt))
        out[mt] = (path, make_hf_model(mt, path, seed=MODEL_TYPES.index(mt)))
    return out


def _tokens(vocab=384, b=2, s=24, seed=0):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def _hf_loss(model, tokens):
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).item()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_logits_parity_world_size_1(model_type, hf_dirs, megatron_single):
    path, hf = hf_dirs[model_type]
    cfg, model, _ = build_loaded(path, ["precision.mode=bf16"])
    assert cfg.model.model_type == model_type
    tokens = _tokens()
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        ours = model.eval()(tokens, pos, None)
        ref = hf(tokens).logits
    assert (ours - ref).abs().max().item() <= 1e-4
    # The check has teeth: one perturbed norm weight moves the logits far past the bound.
    with torch.no_grad():
        model.decoder.layers[0].input_layernorm.weight.mul_(1.5)
        assert (model(tokens, pos, None) - ref).abs().max().item() > 1e-2


@pytest.mark.slow
def test_parallel_layouts_match_hf(hf_dirs):
    tp2, pp2, ep2 = "parallel.tensor_parallel=2", "parallel.pipeline_parallel=2", "parallel.expert_parallel=2"
    layouts = {}
    for mt in ["llama", "qwen2", "qwen3"]:
        layouts[f"{mt}-tp2"] = (hf_dirs[mt][0], [tp2, "precision.mode=bf16"])
        layouts[f"{mt}-pp2"] = (hf_dirs[mt][0], [pp2, "precision.mode=bf16"])
        layouts[f"{mt}-tp2pp2"] = (hf_dirs[mt][0], [tp2, pp2, "precision.mode=bf16"])
    layouts["qwen3_moe-ep2"] = (hf_dirs["qwen3_moe"][0], [ep2, "precision.mode=bf16"])
    layouts["qwen3_moe-tp2ep2"] = (hf_dirs["qwen3_moe"][0], [tp2, ep2, "precision.mode=bf16"])
    tokens = _tokens()
    results = run_workers(layouts_worker, 4, layouts, tokens)
    for name, (path, overrides) in layouts.items():
        hf = hf_dirs[name.split("-")[0]][1]
        ref_loss = _hf_loss(hf, tokens)
        losses = [r[name]["loss"] for r in results if r[name]["loss"] is not None]
        assert losses, name
        for loss in losses:  # every last-stage rank (all DP replicas) agrees with transformers
            assert abs(loss - ref_loss) <= 1e-5, (name, loss, ref_loss)
        if "pp2" not in name:
            with torch.no_grad():
                ref_logits = hf(tokens).logits
            for r in results:
                assert (r[name]["logits"] - ref_logits).abs().max().item() <= 1e-4, name


# RoPE scaling as the families ship it, shrunk so it matters at test length: Llama-3.1's llama3 rule and
# Qwen2.5's YaRN with an original context of 32 positions, factor 8 and 4, compared over 200 tokens.
SCALED = {
    "llama3": ("llama", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "yarn": ("qwen2", {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                       "original_max_position_embeddings": 32}),
    "linear": ("qwen3", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
}


@pytest.mark.parametrize("kind", list(SCALED))
def test_rope_scaling_matches_transformers(kind, tmp_path, megatron_single):
    """inv_freq and attention factor equal transformers' own ROPE_INIT_FUNCTIONS; the model's fp32 logits over
    200 tokens equal the HF model's within 1e-4 (plain RoPE here would be far off); the exported config.json
    carries the scaling unchanged and transformers reads back the same rope parameters."""
    import json

    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_jetrl.models.rope_scaling import rope_inv_freq

    mt, rope = SCALED[kind]
    hf = make_hf_model(mt, str(tmp_path / "hf"), seed=7, rope_parameters=dict(rope))
    want_inv, want_att = ROPE_INIT_FUNCTIONS[kind](hf.config, "cpu")
    got_inv, got_att = rope_inv_freq(hf.config.head_dim, rope["rope_theta"],
                                     {k: v for k, v in rope.items() if k != "rope_theta"})
    assert torch.equal(got_inv, want_inv) and got_att == pytest.approx(want_att, rel=1e-12)

    cfg, model, _ = build_loaded(str(tmp_path / "hf"), ["precision.mode=bf16"])
    assert cfg.model.rope_scaling["rope_type"] == kind and cfg.model.rope_theta == rope["rope_theta"]
    tokens = _tokens(s=200, b=1)
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        ours = model.eval()(tokens, pos, None)
        ref = hf(tokens).logits
    assert (ours - ref).abs().max().item() <= 1e-4
    scaling = dict(cfg.model.rope_scaling)
    model.rotary_pos_emb.inv_freq = rope_inv_freq(cfg.model.head_dim, cfg.model.rope_theta, None)[0]
    model.rotary_pos_emb.forward.cache_clear()
    with torch.no_grad():
        assert (model(tokens, pos, None) - ref).abs().max().item() > 1e-2  # the scaling is what matched
    out = cfg.model.to_hf_config()
    assert out["rope_scaling"] == scaling and out["rope_theta"] == rope["rope_theta"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text(json.dumps(out))
    assert AutoConfig.from_pretrained(str(tmp_path / "out")).rope_parameters == hf.config.rope_parameters


def test_unsupported_rope_type_is_one_line(tmp_path, megatron_single):
    from megatron_jetrl.config import ConfigError

    make_hf_model("llama", str(tmp_path / "hf"), rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                  "factor": 2.0})
    with pytest.raises(ConfigError, match="model.rope_scaling: rope_type 'dynamic' is not supported"):
        build_loaded(str(tmp_path / "hf"), ["precision.mode=bf16"])


def test_small_real_shapes_run_in_bf16_and_keep_unblockable_linears_bf16(tmp_path, megatron_single):
    """A SmolLM-shaped llama (hidden 576, 9 heads of 64, 3 KV heads, FFN 1536): q/k/v rows of 576/192/192 cannot
    be cut into 128-row blocks. In bf16 nothing is FP8, so it loads and matches transformers; in jet its q/k/v
    linears stay BF16 (the rest FP8); it converts to BF16 HF and back."""
    from checkpoint_converters.convert import hf_to_megatron, megatron_to_hf
    from megatron_jetrl.models.hf_io import HFCheckpoint

    hf = make_hf_model("llama", str(tmp_path / "hf"), seed=4, hidden_size=576, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, intermediate_size=1536)
    _, model, _ = build_loaded(str(tmp_path / "hf"), ["precision.mode=bf16"])
    tokens = _tokens()
    with torch.no_grad():
        assert (model.eval()(tokens, torch.arange(24).expand_as(tokens), None) - hf(tokens).logits).abs().max() <= 1e-4
    _, _, state = build_loaded(str(tmp_path / "hf"), ["precision.mode=jet"])
    assert state.bf16_linears == [f"decoder.layers.{i}.self_attention.linear_qkv" for i in range(2)]
    assert state.num_fp8_layers == 6  # o_proj, fc1, fc2 of both layers
    hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mc"), dtype=torch.float32)
    megatron_to_hf(str(tmp_path / "mc"), str(tmp_path / "back"), "bf16")
    a, b = HFCheckpoint(str(tmp_path / "hf")), HFCheckpoint(str(tmp_path / "back"))
    assert sorted(a.keys()) == sorted(b.keys())
    assert all(torch.equal(a.raw(k).to(torch.bfloat16), b.raw(k)) for k in a.keys())
