"""Gradient-accumulation fusion for megatron-core's own (BF16) linears without APEX.

With ``gradient_accumulation_fusion`` on, megatron-core's linear backward adds the weight gradient straight
into the fp32 ``main_grad`` that its DDP keeps (``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``, an
APEX extension), marks ``grad_added_to_main_grad`` and hands autograd a placeholder the DDP hook drops;
without it the gradient is written in the parameter dtype and the hook adds it in a second pass over the
weight every micro-batch. APEX is not installed here, so :func:`enable` fills megatron's empty slot with
the same two calls in torch: ``torch.addmm(main_grad, dy^T, x, out_dtype=float32, out=main_grad)`` (one
cuBLAS GEMM with beta = 1 and an fp32 output, BF16 inputs; CUDA) or ``main_grad.addmm_`` where the dtypes
already agree (fp32 parameters, the CPU run). The FP8 linears do the same for their FP8 wgrad
(``precision/linear.py``, ``kernels/cublaslt.py``); this covers what stays BF16: the LM head in every
mode, and every linear in ``bf16`` / ``fp8_rollout`` training, so the baselines get the fusion too. The
input embedding (untied) adds its rows' gradients into its ``main_grad`` the same way
(:class:`_EmbeddingIntoMainGrad`) instead of a dense [vocab, H] gradient added by the hook.

The switch is per layer (megatron reads ``layer.gradient_accumulation_fusion`` at each forward) and is
thrown only after the model is wrapped in megatron's DDP, which is what creates ``main_grad``: a model used
outside DDP keeps the plain path. ``precision.fuse_wgrad_accumulation`` turns both fusions on or off.
"""
from __future__ import annotations

import functools
import logging
import types

import torch

log = logging.getLogger(__name__)


def _accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad [N, K] += grad_output[T, N]^T @ total_input[T, K]`` (fp32 accumulate)."""
    if total_input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    else:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)


def _accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


SHIM = types.SimpleNamespace(wgrad_gemm_accum_fp32=_accum_fp32, wgrad_gemm_accum_fp16=_accum_fp16)


@functools.lru_cache(maxsize=None)
def available(device_type: str, dtype: torch.dtype = torch.bfloat16) -> tuple[bool, str]:
    """Whether the torch calls above run (and add) on this device type for parameters of ``dtype``
    (activations and gradients in that dtype, ``main_grad`` fp32): a small probe. BF16 into fp32 needs
    ``addmm``'s ``out_dtype`` (CUDA); fp32 is a plain ``addmm_`` anywhere."""
    try:
        g = torch.Generator().manual_seed(0)
        x, dy = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
        x, dy = x.to(device_type, dtype), dy.to(device_type, dtype)
        out = torch.ones(8, 16, device=device_type)
        _accum_fp32(x, dy, out)
        ref = 1.0 + dy.float().t() @ x.float()
        if not torch.allclose(out, ref, rtol=1e-3, atol=1e-3):
            return False, "torch.addmm into fp32 gave a wrong sum"
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return True, ""


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward adds the rows' gradients straight into the weight's fp32
    ``main_grad`` (``index_add_`` of the [tokens, H] gradient in fp32) under megatron's protocol
    (``grad_added_to_main_grad``, a placeholder for autograd that the DDP hook drops), instead of writing a
    dense [vocab, H] gradient in the weight's dtype that the hook then adds over the whole table: at a 128K
    vocabulary that was a zero-fill, a scatter and a 2 GB fp32 add per micro-batch (~2.3 ms on the H200). The
    sums are in fp32 from the start (the dense path rounds each micro-batch's rows to BF16 first)."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        w = ctx.weight
        mg = getattr(w, "main_grad", None)
        if mg is None or mg.dtype != torch.float32 or mg.shape != w.shape or not hasattr(w, "grad_added_to_main_grad"):
            return None, torch.ops.aten.embedding_dense_backward(dy, ids, w.shape[0], -1, False)
        mg.index_add_(0, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]).float())
        w.grad_added_to_main_grad = True
        return None, (torch.zeros if getattr(w, "zero_out_wgrad", False) else torch.empty)(
            w.shape, dtype=w.dtype, device=w.device)


def _embedding_forward(self, input_):
    """megatron-core's ``VocabParallelEmbedding.forward`` (TP masking, no reduce-scatter, no remat) with the
    lookup through :class:`_EmbeddingIntoMainGrad`."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp = self.tp_group.size()
    if tp > 1:
        input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        masked_input = input_.clone() - self.vocab_start_index
        masked_input[input_mask] = 0
    else:
        masked_input = input_
    out = _EmbeddingIntoMainGrad.apply(masked_input, self.weight)
    if tp > 1:
        out[input_mask, :] = 0.0
    return reduce_from_tensor_model_parallel_region(out, group=self.tp_group)


def _fuse_embeddings(model: torch.nn.Module, on: bool) -> int:
    """Route each untied ``VocabParallelEmbedding`` whose forward we can mirror through
    :func:`_embedding_forward` (``on``), or back to megatron-core's forward; returns how many are fused. A
    weight shared with the LM head keeps megatron's path (both users of the weight would have to add into
    ``main_grad`` for the placeholder protocol to hold)."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    tied = any(getattr(m, "share_embeddings_and_output_weights", False) for m in model.modules())
    lm_weights = {id(m.weight) for m in model.modules()
                  if not isinstance(m, VocabParallelEmbedding) and isinstance(getattr(m, "weight", None), torch.Tensor)}
    n = 0
    for m in model.modules():
        if not isinstance(m, VocabParallelEmbedding):
            continue
        plain = (getattr(m, "gtp_remat_size", 1) <= 1 and not getattr(m, "reduce_scatter_embeddings", False)
                 and not getattr(m, "deterministic_mode", False) and not tied and id(m.weight) not in lm_weights)
        if on and plain:
            m.forward = types.MethodType(_embedding_forward, m)
            n += 1
        elif "forward" in m.__dict__:
            del m.forward
    return n


def enable(model: torch.nn.Module, on: bool = True) -> int:
    """Set megatron's ``gradient_accumulation_fusion`` on every megatron linear of ``model`` (call after
    wrapping it in megatron's DDP); fills megatron's APEX slot with :data:`SHIM` when APEX is absent. Returns
    the number of layers switched on (0 where the torch calls do not run for this model's device and
    parameter dtype, e.g. BF16 parameters on CPU: the plain path stays)."""
    from megatron.core.tensor_parallel import layers

    mods = [m for m in model.modules() if isinstance(m, (layers.ColumnParallelLinear, layers.RowParallelLinear))]
    if on and getattr(layers, "fused_weight_gradient_mlp_cuda", SHIM) is SHIM:  # APEX absent: ours, if it runs here
        p = next(model.parameters())
        ok, why = available(p.device.type, p.dtype)
        if ok:
            layers.fused_weight_gradient_mlp_cuda = SHIM
            layers._grad_accum_fusion_available = True
        else:
            log.warning("gradient-accumulation fusion for megatron's BF16 linears is off: %s", why)
            on = False
    for m in mods:
        m.gradient_accumulation_fusion = on
    _fuse_embeddings(model, on)
    return len(mods) if on else 0
