"""``ModelConfig`` (HF-style description) -> megatron-core ``GPTModel`` on our layer spec.

The TransformerConfig below is what gives logits parity with transformers for llama, qwen2,
qwen3 and qwen3_moe: RMSNorm, SwiGLU as a gated fc1, no linear
biases except qwen2's QKV bias, qwen3's QK-norm, RoPE with the model's theta, GQA through
``num_query_groups``, and every fusion off (the fused kernels are CUDA/TE only).
"""
from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

from megatron_jetrl.config import ModelConfig, ParallelConfig
from megatron_jetrl.models.rope_scaling import rope_inv_freq, rope_problem
from megatron_jetrl.models.spec import SDPAttention, layer_spec
from megatron_jetrl.precision.linear import FP8ModelState, attach_fp8
from megatron_jetrl.precision.recipe import FP8Recipe

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def fused_rope_available() -> bool:
    """Whether megatron's fused-RoPE slot holds our Triton RoPE (``kernels.rope_train``: CUDA, no
    TransformerEngine); then ``apply_rope_fusion`` routes to it."""
    from megatron_jetrl.kernels import rope_train as rope

    return rope.install()


def transformer_config(model: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype, extra: dict | None = None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute = {}
    if parallel.recompute == "full":  # keep only each layer's input; re-run the layer in backward
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
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
    why = rope_problem(model.rope_scaling)
    if why:
        from megatron_jetrl.config import ConfigError

        raise ConfigError(f"config error: model.rope_scaling: {why}; use a checkpoint with one of those")
    attention = rope_inv_freq(model.head_dim, model.rope_theta, model.rope_scaling)[1]
    # YaRN scales cos and sin by its attention factor: q.k by its square, applied as the softmax scale
    scale = {"softmax_scale": attention ** 2 / model.head_dim ** 0.5} if attention != 1.0 else {}
    return TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_key_value_heads,
        kv_channels=model.head_dim, ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=model.qkv_bias, qk_layernorm=model.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=fused_rope_available(), gradient_accumulation_fusion=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        expert_model_parallel_size=parallel.expert_parallel, expert_tensor_parallel_size=1,
        use_cpu_initialization=not torch.cuda.is_available(),
        sequence_parallel=False, **moe, **recompute, **scale, **(extra or {}),
    )


def _te_spec(model: ModelConfig, recipe: FP8Recipe):
    """Megatron's TransformerEngine layer spec and the TransformerConfig fields of the recipe."""
    from megatron_jetrl import env
    from megatron_jetrl.config import ConfigError
    from megatron_jetrl.precision.te_backend import te_env, te_transformer_config

    for k, v in te_env(recipe).items():
        env.set_default(k, v)  # before TE reads it (config validation refused a contradicting value)
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    except ImportError as e:
        raise ConfigError(f"config error: precision.backend: te needs TransformerEngine ({e}); use the NGC "
                          "container (Dockerfile) or precision.backend=auto") from None
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=model.num_experts, moe_grouped_gemm=False,
                                                      qk_layernorm=model.qk_norm)
    return spec, te_transformer_config(recipe)


def _batch_major_output(self, input_, weight=None, runtime_gather_output=None):
    """The LM head (megatron's ``ColumnParallelLinear.forward``) run on the batch-major view of the hidden states
    ``[s, b, h]``: it returns the logits ``[s, b, V]`` as a transposed view of ``[b, s, V]`` memory, so
    ``GPTModel``'s closing ``logits.transpose(0, 1).contiguous()`` is a view instead of a strided copy of the
    whole [tokens x vocab] tensor, and its backward copies nothing either. At micro-batch 8 x 1152 tokens
    and a 128K vocabulary that copy was 2.4 GB each way, ~4 ms per micro-batch forward and again backward
    (both modes; docs/benchmarks.md). The hidden states' transpose costs a copy of ``[s, b, h]`` (1/31 of the
    logits at Llama-3.1-8B's shapes; its gradient, one of the same size, goes back sequence-major: see
    :class:`_ToBatchMajor`). Same GEMM, same rows, same bytes. Only when the model returns the logits
    (``GPTModel.forward`` without ``labels``: megatron's own loss views them ``[s * b, V]``; set by
    :func:`_note_labels`), for ``s, b > 1``, without sequence parallelism (which gathers along ``s``) or deferred
    embedding wgrads."""
    plain = type(self).forward
    if (not getattr(self, "batch_major_logits", False) or input_.dim() != 3 or input_.shape[0] == 1
            or input_.shape[1] == 1 or self.sequence_parallel or self.config.defer_embedding_wgrad_compute):
        return plain(self, input_, weight=weight, runtime_gather_output=runtime_gather_output)
    out, bias = plain(self, _ToBatchMajor.apply(input_), weight=weight, runtime_gather_output=runtime_gather_output)
    return out.transpose(0, 1), bias


class _ToBatchMajor(torch.autograd.Function):
    """``[s, b, h] -> [b, s, h]`` contiguous; its gradient goes back contiguous ``[s, b, h]`` (autograd's own
    transpose would hand the layers below a view of batch-major memory, and every linear's backward that wants
    a contiguous gradient would copy it again)."""

    @staticmethod
    def forward(ctx, x):
        return x.transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx, g):
        return g.transpose(0, 1).contiguous()


def _exact_output_impl(self, input, weight, *args, **kwargs):
    """The LM head's GEMM in exact mode (``precision.exact``): the batch-invariant kernel where it runs
    (``precision.linear.exact_kernels``), so the decoder's last-position logits are the trainer's bits; megatron's
    otherwise (the CPU emulation, whose GEMM is row-invariant from 2 rows up)."""
    from megatron_jetrl.precision.linear import exact_kernels, exact_linear

    if exact_kernels(input):
        return exact_linear(input, weight, kwargs.get("bias"), kwargs.get("gradient_accumulation_fusion"))
    return type(self)._forward_impl(self, input, weight, *args, **kwargs)


def _note_labels(gpt, args, kwargs):
    """``GPTModel`` forward pre-hook: the LM head may write batch-major logits only when the model returns them
    (no ``labels``, the 5th argument of ``GPTModel.forward``)."""
    labels = kwargs["labels"] if "labels" in kwargs else (args[4] if len(args) > 4 else None)
    gpt.output_layer.batch_major_logits = labels is None


def build_model(model: ModelConfig, parallel: ParallelConfig, recipe: FP8Recipe,
                dtype: torch.dtype = torch.bfloat16, backend: str = "auto"):
    """Build this rank's pipeline stage of the model; returns (GPTModel, FP8ModelState).
    Requires ``distributed.init_distributed`` first."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    te = backend == "te"
    if te:
        spec, extra = _te_spec(model, recipe)
    else:
        spec, extra = layer_spec(model.qk_norm, model.num_experts), None
    config = transformer_config(model, parallel, dtype, extra)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
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
    if model.rope_scaling:  # megatron builds plain RoPE frequencies (its own llama3 option fixes 3 of 4 parameters)
        rope = gpt.rotary_pos_emb
        rope.inv_freq = rope_inv_freq(model.head_dim, model.rope_theta, model.rope_scaling)[0].to(rope.inv_freq.device)
    # every parameter in the model's dtype, as megatron's Float16Module leaves them: torch-built modules (the
    # RMSNorms) start fp32, and megatron's Float16 optimizer neither checkpoints fp32 parameters beside BF16
    # ones ("Param id ... does not match any model sharded param") nor is that what the rollout engine runs
    with torch.no_grad():
        for p in gpt.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    if gpt.post_process:
        gpt.output_layer.forward = types.MethodType(_batch_major_output, gpt.output_layer)
        gpt.register_forward_pre_hook(_note_labels, with_kwargs=True)
        if recipe.exact:  # the LM head on the batch-invariant GEMM too (precision.exact)
            gpt.output_layer._forward_impl = types.MethodType(_exact_output_impl, gpt.output_layer)
    if te:  # TE owns the FP8 forward/backward and the FP8 weight bytes (exported as they are)
        state = FP8ModelState(recipe, "te")
        state.forward_fp8 = False  # our FP8 linears are not in this model
        return gpt, state
    state: FP8ModelState = attach_fp8(gpt, recipe, backend, device)
    for m in gpt.modules():  # the attention reads the state's forward_kv_fp8 (precision.kv_cache)
        if isinstance(m, SDPAttention):
            m.fp8_state = state
    return gpt, state


def apply_precision_settings(state: FP8ModelState, precision) -> None:
    """The FP8 model state's settings from the config's ``precision`` section (read once, here)."""
    state.small_m_max = precision.small_m_max
    state.decode_gemm = precision.decode_gemm
    state.fuse_swiglu = precision.fuse_swiglu
    state.fuse_wgrad_accumulation = precision.fuse_wgrad_accumulation
    state.release_bf16_weights = precision.release_bf16_weights
    state.cache_dgrad_weights = precision.cache_dgrad_weights


def exact_length(model, tokens: int) -> int:
    """``precision.exact``: the input length of every forward, the trainer's and the rollout's:
    ``max_position_embeddings`` of ``model`` (a wrapped GPTModel too), refused with one line when an input of
    ``tokens`` positions does not fit."""
    from megatron_jetrl.errors import ConfigError

    while not hasattr(model, "max_position_embeddings") and hasattr(model, "module"):
        model = model.module
    L = model.max_position_embeddings
    if tokens > L:
        raise ConfigError(f"config error: precision.exact: an input of {tokens} positions is longer than "
                          f"model.max_position_embeddings={L}, the length exact mode pads every forward to; "
                          "shorten rollout.max_new_tokens or the prompts")
    return L
