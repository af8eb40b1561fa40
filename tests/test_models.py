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
