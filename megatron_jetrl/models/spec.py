"""Our megatron-core layer spec: the local (no TransformerEngine) modules, with

- FP8-capable column/row-parallel linears (``precision.linear.FP8LinearMixin``) for QKV, out-proj,
  fc1 (gate/up), fc2 and the experts;
- core attention on ``torch.nn.functional.scaled_dot_product_attention`` (flash/efficient kernels
  on GPU). megatron-core's local ``DotProductAttention`` materializes the S x S scores: 3x slower
  and 4.6x the memory at 8K on the H200.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from megatron_jetrl.precision.linear import FP8LinearMixin, exact_kernels
from megatron_jetrl.precision.quant import kv_fake_quant


class FP8ColumnParallelLinear(FP8LinearMixin, ColumnParallelLinear):
    """Megatron ``ColumnParallelLinear`` with the block-FP8 path (QKV, fc1, expert fc1)."""


class FP8RowParallelLinear(FP8LinearMixin, RowParallelLinear):
    """Megatron ``RowParallelLinear`` with the block-FP8 path (out-proj, fc2, expert fc2)."""


class SDPAttention(MegatronModule):
    """Core attention on SDPA. Inputs [s, b, heads, dim] (keys/values with the local query
    groups, keys after RoPE), output [s, b, heads * dim]. BF16; with ``precision.kv_cache=fp8`` (jet) over the
    FP8 KV cache's values of K and V (``quant.kv_fake_quant``: the rollout's cache holds the same values, the
    gradient passes the rounding straight through). With ``precision.exact`` on the batch-invariant kernels
    (``precision.linear.exact_kernels``) the forward is ``kernels/exact_attn.py``'s, the rollout decoder's own."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism; set it to 1")
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        # the model's FP8 state (set by models.builder): with precision.kv_cache=fp8 the keys and values are
        # rounded to the FP8 KV cache's values while ``forward_kv_fp8`` says so
        self.fp8_state = None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is not None:
            raise ValueError("SDPAttention: packed sequences are not supported")
        sq, b, heads, dim = query.shape
        sk = key.shape[0]
        state = self.fp8_state
        if state is not None and state.recipe.exact and exact_kernels(query):
            # exact mode: the kernel the rollout's decoder runs, keys from position 0 in a fixed order (FP8 KV cache:
            # over the cache's bytes and scales)
            if attention_mask is not None or sq != sk:
                raise ValueError("SDPAttention: exact mode runs causal self-attention over whole sequences only")
            from megatron_jetrl.kernels.exact_attn import ExactAttention

            kv8 = None
            if state.forward_kv_fp8:  # the cache's bytes and scales for the kernel, their values for the backward
                key, kq, ks = kv_fake_quant(key, state.recipe, with_bytes=True)  # one pass each: [s, b, groups, d]
                value, vq, vs = kv_fake_quant(value, state.recipe, with_bytes=True)
                kv8 = (kq.permute(1, 2, 0, 3), ks.permute(1, 2, 0).contiguous(),
                       vq.permute(1, 2, 0, 3), vs.permute(1, 2, 0).contiguous())
            return ExactAttention.apply(query, key, value, self.softmax_scale, kv8)
        if state is not None and state.forward_kv_fp8:  # the FP8 KV cache's values; straight-through backward
            key, value = kv_fake_quant(key, state.recipe), kv_fake_quant(value, state.recipe)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        mask, causal = None, False
        if attention_mask is not None and attention_mask.shape[-2:] == (sq, sk):
            mask = ~attention_mask  # megatron: True = masked; SDPA: True = attend
        elif sq == sk:
            causal = True
        elif sq != 1:  # chunked prefill against a cache: bottom-right aligned causal mask
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=k.shape[1] != heads)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)


class JetMLP(MLP):
    """megatron-core's MLP with the SwiGLU fused, in every precision mode (``precision.fuse_swiglu``):

    - fc2 in FP8: fc2 receives fc1's output and runs the SwiGLU inside its activation quantizer
      (``FP8SwigluLinearFunction``: one pass over [gate | up], no BF16 activation written);
    - fc2 in BF16 (``bf16`` / ``fp8_rollout`` training, FP8 off): the SwiGLU is one kernel each way
      (``quant.swiglu_fused``) where megatron-core's unfused MLP runs silu, mul, their backwards and a cat
      (what TransformerEngine's or megatron's fused activation give a BF16 run, so the BF16 baseline is not
      slowed by an unfused activation the FP8 path does not have).

    Same forward bytes as megatron-core's eager ops; everything else (other activations, per-token scales,
    clamps, ``fuse_swiglu=false``) is megatron-core's forward."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        fc2, cfg = self.linear_fc2, self.config
        state = getattr(fc2, "fp8_state", None)
        if (per_token_scale is not None or not getattr(state, "fuse_swiglu", True)
                or not cfg.gated_linear_unit or cfg.activation_func is not F.silu or cfg.use_te_activation_func
                or cfg.activation_func_clamp_value is not None or cfg.glu_linear_offset != 0):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        fc1 = self.linear_fc1
        if state is None or not fc2.fp8_active():  # BF16 fc2: the one-kernel SwiGLU between the linears
            from megatron_jetrl.precision.quant import swiglu_fused

            y, bias = fc1(hidden_states)
            if bias is not None:
                y = y + bias
            return fc2(swiglu_fused(y))
        y, bias = fc1(hidden_states)
        if bias is not None:
            y = y + bias
        with fc2.hinted(swiglu_input=True):
            return fc2(y)


class JetSpecProvider(LocalSpecProvider):
    """megatron-core's local modules with our FP8 linears, SDPA core attention and the one-kernel
    RMSNorm of ``models/norm.py`` (a ``torch.nn.RMSNorm``: same parameters and state dict)."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        from megatron_jetrl.models.norm import JetNorm

        return JetNorm

    def column_parallel_linear(self):
        return FP8ColumnParallelLinear

    def row_parallel_linear(self):
        return FP8RowParallelLinear

    def core_attention(self):
        return SDPAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        from functools import partial

        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import SequentialMLP

        return partial(SequentialMLP, submodules=MLPSubmodules(
            linear_fc1=FP8ColumnParallelLinear, linear_fc2=FP8RowParallelLinear))


def _mlp_spec(backend, num_experts):
    """megatron-core's MLP spec, the dense MLP swapped for ``JetMLP`` (0.19.2 builds it through
    ``partial(MLP.as_mlp_submodule, submodules=...)``; a ModuleSpec form is handled too)."""
    from functools import partial

    spec = get_mlp_module_spec_for_backend(backend=backend, num_experts=num_experts, moe_grouped_gemm=False)
    if num_experts is not None:
        return spec
    if isinstance(spec, partial) and spec.func == MLP.as_mlp_submodule:
        return partial(JetMLP.as_mlp_submodule, *spec.args, **spec.keywords)
    if isinstance(spec, ModuleSpec) and spec.module is MLP:
        spec.module = JetMLP
        return spec
    raise TypeError(f"unexpected megatron-core MLP spec {spec!r}: update models/spec.py for this version")


def layer_spec(qk_norm: bool, num_experts: Optional[int] = None) -> ModuleSpec:
    """The TransformerLayer spec for llama/qwen2/qwen3 (dense) and qwen3_moe (experts)."""
    backend = JetSpecProvider()
    norm = backend.layer_norm(rms_norm=True, for_qk=False, has_residual=True)
    qk = backend.layer_norm(rms_norm=True, for_qk=True) if qk_norm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_linear(),
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=qk,
                    k_layernorm=qk,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=_mlp_spec(backend, num_experts),
            mlp_bda=get_bias_dropout_add,
        ),
    )
