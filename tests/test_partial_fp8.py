"""Small real models in FP8: linears whose q/k/v (or gate/up) cannot be cut into 128-row blocks stay BF16 in the
trainer and the rollout, and the FP8 export says so in the form SGLang 0.5.23 honours."""
import json
import os
import subprocess
import sys

import torch

from tests.hf_models import make_hf_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO)
SMOL = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536)


def test_smollm_shape_trains_in_jet_with_bf16_attention_over_a_fleet(tmp_path):
    """A SmolLM-shaped llama (q/k/v rows 576/192/192) trains two steps in jet on a `jetrl serve` fleet: q/k/v in
    BF16 on both sides, o_proj (K = 576: a partial last 128-group) and the MLP in FP8; the weights the servers load
    list exactly the q/k/v projections beside the recipe's usual BF16 modules in modules_to_not_convert; the
    rollout samples from the trainer's own bytes (checksums equal, mismatch 10x below a server on other bytes);
    SGLang's own parser skips quantizing qkv_proj and quantizes gate_up_proj."""
    from megatron_jetrl.models.hf_io import HFCheckpoint
    from megatron_jetrl.precision.quant import dequantize_blocks
    from megatron_jetrl.precision.recipe import HF_MODULES_NOT_CONVERTED
    from tests.sglang_imports import sglang_srt

    make_hf_model("llama", str(tmp_path / "hf"), seed=4, **SMOL)
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", "--preset", "tiny", "--run-dir", str(run),
                          f"model.hf_path={tmp_path / 'hf'}", "precision.mode=jet", "steps=2", "algo.sft_warmup_steps=1",
                          "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2", "rollout.engine=serve",
                          "rollout.weight_transport=disk", "eval.interval=0"],
                         env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 linears stay BF16" in out.stderr
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("is_rl") == 1.0]
    # the trainer's bytes on both sides: the servers' logprobs differ from the trainer's in last bits only, except
    # where jet's activation quantizer turns such a bit into an E4M3 step (on a CPU with AVX-512/AMX: 3e-4 at the
    # second step, 2e-7 with the in-process engine); a server holding other bytes (fp8_rollout) is at ~1e-2
    assert all(r["mismatch_abs_mean"] < 1e-3 and r["parity_checked"] > 0 and r["parity_mismatch"] == 0 for r in rl)

    pushed = run / "rollout" / "weights"
    qc = json.loads((pushed / "config.json").read_text())["quantization_config"]
    qkv = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkv"]
    assert sorted(qc["modules_to_not_convert"]) == sorted(list(HF_MODULES_NOT_CONVERTED) + qkv)
    ckpt = HFCheckpoint(str(pushed))
    q = ckpt.raw("model.layers.0.self_attn.q_proj.weight")
    assert q.dtype != torch.float8_e4m3fn and "model.layers.0.self_attn.q_proj.weight_scale_inv" not in ckpt
    w = ckpt.raw("model.layers.0.self_attn.o_proj.weight")
    s = ckpt.raw("model.layers.0.self_attn.o_proj.weight_scale_inv")
    assert w.dtype == torch.float8_e4m3fn and tuple(s.shape) == (5, 5)  # ceil(576 / 128): a partial last block
    # the block rule on every block, the partial ones included: its largest element is +-448 (amax / 448 scale)
    for i in range(5):
        for j in range(5):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            assert blk.abs().max().item() == 448.0, (i, j, blk.shape)
    deq = dequantize_blocks(w, s, 128, 128).double()
    assert torch.isfinite(deq).all()

    sglang_srt()
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.quantization.utils import is_layer_skipped

    cfg = Fp8Config.from_config(qc)
    assert is_layer_skipped("model.layers.0.self_attn.qkv_proj", cfg.ignored_layers)
    assert not is_layer_skipped("model.layers.0.mlp.gate_up_proj", cfg.ignored_layers)
    assert not is_layer_skipped("model.layers.0.self_attn.o_proj", cfg.ignored_layers)


def test_smollm_shape_trains_in_bf16(tmp_path, megatron_single):
    """The same model in bf16 (no FP8 anywhere, so no shape rule): a supervised and two RL steps in process."""
    from megatron_jetrl.config import load_config
    from megatron_jetrl.train import close, rl_step, setup, sft_step

    make_hf_model("llama", str(tmp_path / "hf"), seed=4, **SMOL)
    run = setup(load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), [
        f"logging.run_dir={tmp_path / 'run'}", f"model.hf_path={tmp_path / 'hf'}", "precision.mode=bf16",
        "algo.sft_warmup_steps=1", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2", "eval.interval=0"]))
    try:
        rows = [sft_step(run), rl_step(run, 1), rl_step(run, 2)]
    finally:
        close(run)
    assert [r.get("is_rl") for r in rows] == [0.0, 1.0, 1.0] and all(r["update_ok"] == 1.0 for r in rows)
    assert run.actor.fp8_state.num_fp8_layers == 6 and len(run.actor.fp8_state.bf16_linears) == 2
