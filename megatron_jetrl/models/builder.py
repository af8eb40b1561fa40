"""``ModelConfig`` (HF-style description) -> megatron-core ``GPTModel`` on our layer spec.

The TransformerConfig below is what gives logits parity with transformers for llama, qwen2,
qwen3 and qwen3_moe (shared/MEGATRON_CPU_FACTS.md): RMSNorm, SwiGLU as a gated fc1, no linear
biases except qwen2's QKV bias, qwen3's QK-norm, RoPE with the model's theta, GQA through
``num_query_groups``, and every fusion off (the fused kernels are CUDA/TE only).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from megatron_jetrl.config import ModelConfig, ParallelConfig
from megatron_jetrl.models.spec import layer_spec
from megatron_jetrl.precision.linear import FP8ModelState, attach_fp8
from megatron_jetrl.precision.recipe import FP8Recipe

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def transformer_config(model: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {}
    if model.is_moe:
        moe = dict(num_moe_experts=model.num_experts, moe_router_topk=model.moe_top_k,
                   moe_ffn_hidden_size=model.moe_ffn_hidden_size,
                   # softmax over all experts then top-k (no renormalization) == HF with
                   # norm_topk_prob False; top-k then softmax == HF's renormalized top-k.
                   moe_router_pre_softmax=not model.norm_topk_prob,
                   moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                   moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
                   moe_permute_fusion=False)
    return TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_key_value_heads,
        kv_channels=model.head_dim, ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=model.qkv_bias, qk_layernorm=model.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        expert_model_parallel_size=parallel.expert_parallel, expert_tensor_parallel_size=1,
        use_cpu_initialization=not torch.cuda.is_available(),
        sequence_parallel=False, **moe,
    )


def build_model(model: ModelConfig, parallel: ParallelConfig, recipe: FP8Recipe,
                dtype: torch.dtype = torch.bfloat16, backend: str = "auto"):
    """Build this rank's pipeline stage of the model; returns (GPTModel, FP8ModelState).
    Requires ``distributed.init_distributed`` first."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(model, parallel, dtype)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(model.qk_norm, model.num_experts),
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model.rope_theta) if float(model.rope_theta).is_integer() else model.rope_theta,
    )
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    gpt.to(device)
    state: FP8ModelState = attach_fp8(gpt, recipe, backend, device)
    return gpt, state
