"""Tiny random HF models (built with transformers from local configs) saved as safetensors."""
from __future__ import annotations

import os

import torch

# Shapes chosen so every FP8 sub-matrix (q, k, v, gate, up) is a multiple of 128 rows at TP=1 and 2.
BASE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
            head_dim=64, intermediate_size=512, vocab_size=384, rms_norm_eps=1e-6,
            max_position_embeddings=256, tie_word_embeddings=False)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def hf_config(model_type: str, **over):
    import transformers

    rope = over.pop("rope_parameters", ROPE)
    kw = dict(BASE, **over)
    if model_type == "llama":
        cfg = transformers.LlamaConfig(**kw, attention_bias=False, mlp_bias=False, rope_parameters=rope)
    elif model_type == "qwen2":
        cfg = transformers.Qwen2Config(**kw, rope_parameters=rope)
    elif model_type == "qwen3":
        cfg = transformers.Qwen3Config(**kw, rope_parameters=rope)
    elif model_type == "qwen3_moe":
        kw.setdefault("num_experts", 4)
        kw.setdefault("num_experts_per_tok", 2)
        kw.setdefault("moe_intermediate_size", 256)
        cfg = transformers.Qwen3MoeConfig(**kw, decoder_sparse_step=1, mlp_only_layers=[],
                                          norm_topk_prob=True, rope_parameters=rope)
    else:
        raise ValueError(model_type)
    return cfg


def make_hf_model(model_type: str, path: str, seed: int = 0, dtype=torch.float32, **over):
    """Random tiny model of ``model_type`` saved to ``path`` in ``dtype``; returns the
    transformers model (in ``dtype``)."""
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(model_type, **over)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at 1: perturb so a swapped norm would show in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model = model.to(dtype)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return model


def make_fp8_dir(src: str, dst: str, scale_fmt: str = "fp32") -> str:
    """The block-FP8 HF format of ``src`` (a BF16/FP32 HF dir): every attention/MLP projection as
    E4M3 bytes + ``weight_scale_inv`` (128x128 blocks), the rest as stored, config.json with the
    recipe's ``quantization_config`` (what a rollout server is launched from)."""
    import json

    from safetensors.torch import load_file, save_file

    from megatron_jetrl.precision.quant import quantize_weight
    from megatron_jetrl.precision.recipe import FP8Recipe

    recipe = FP8Recipe(mode="jet", scale_fmt=scale_fmt)
    out = {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if name.endswith("proj.weight") and "mlp.gate.weight" not in name:
            q, s = quantize_weight(t.float(), recipe)
            out[name], out[name[: -len(".weight")] + ".weight_scale_inv"] = q, s
        else:
            out[name] = t
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = recipe.hf_quantization_config()
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|eot|>{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def make_chat_tokenizer(path: str) -> int:
    """A character-level HF tokenizer (built locally with ``tokenizers``) with a chat template and an
    end-of-turn token; saved to ``path``. Returns its vocabulary size."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(string.digits + string.ascii_letters + "+-*=?<>|_ .,:!"))
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<|eot|>"] + chars)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tk.decoder = decoders.Fuse()  # characters back without spaces between them
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  additional_special_tokens=["<|eot|>"])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return len(vocab)
