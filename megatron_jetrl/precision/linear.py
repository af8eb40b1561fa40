"""The FP8 linear: autograd function, the per-step weight cache, Megatron column/row layers.

Forward: x -> 1x128 FP8 (dynamic), weight -> cached 128x128 FP8, one block GEMM, BF16 out.
Backward: dgrad in FP8 (dy in 1x128 groups along N, the *same* cached weight bytes through a
transposed view: no second FP8 copy); wgrad FP8 (dy^T in 1x128 groups along tokens, x re-blocked
128x128 from the saved FP8 activations) or BF16 per recipe; with an FP8 wgrad both of dy's operands come
from one pass over dy (``quant.quantize_dual``); under megatron's DDP the FP8 wgrad adds its
fp32 result straight into the weight's fp32 ``main_grad`` (gradient-accumulation fusion,
``kernels/cublaslt.py``; the wgrad operands' token dimension is padded to a multiple of 512 in the
quantizers' buffers where cuBLAS needs it, ``gemm.wgrad_token_pad``). Only the FP8 activations and their
scales are saved for backward.
Gradients between ops stay BF16; fp32 master weights stay in the optimizer.

Fused weights are quantized per logical sub-matrix in the rollout's (HF/SGLang) layout: Megatron's
``linear_qkv`` interleaves q, k, v per query group, SGLang's ``qkv_proj`` concatenates q, k, v;
``linear_fc1`` is [gate; up] on both sides. The cache holds the weight rows permuted into the
rollout layout (``perm``) so its bytes and ``weight_scale_inv`` are exactly what the rollout
engine loads; the GEMM output is permuted back to Megatron's column order. Where the permutation
moves whole 128-row blocks (head_dim a multiple of 128, as in Llama/Qwen 7B+), the training GEMMs
instead use the same blocks reordered into Megatron's row order once per version
(``FP8WeightCache.train_order``; ``FP8ModelState.qkv_train_order=False``: the permuted path).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Optional

import torch

from megatron_jetrl.precision.layout import qkv_permutation
from megatron_jetrl.precision import gemm
from megatron_jetrl.precision.gemm import block_gemm, resolve_backend
from megatron_jetrl.precision.quant import (dequantize_act, quantize_act, quantize_dual, quantize_transposed,
                                            quantize_weight)
from megatron_jetrl.precision.recipe import FP8Recipe

log = logging.getLogger(__name__)


class FP8ModelState:
    """Shared by all FP8 linears of one model: the recipe, the GEMM backend, the weight version
    (bumped after every optimizer step), and whether the forward runs FP8 right now."""

    def __init__(self, recipe: FP8Recipe, backend: str = "auto"):
        self.recipe = recipe
        self.requested_backend = backend
        self.version = 0
        # Inference forwards with at most this many tokens use the fused small-M Triton GEMM
        # (precision.small_m_max; 0 = off).
        self.small_m_max = 64
        # inference forwards above small_m_max rows: "tune" lets the static decoder pick cuBLAS's, DeepGEMM's or the
        # small-M Triton block-FP8 GEMM per weight shape (precision.decode_gemm; gemm.tune_kernels), "cublas" keeps
        # cuBLAS's
        self.decode_gemm = "tune"
        # jet: FP8 in training and rollout. fp8_rollout: only inside ``rollout_precision()``.
        self.forward_fp8 = recipe.train_fp8
        # the attention reads FP8-rounded K/V (precision.kv_cache=fp8; models.spec.SDPAttention): in jet always (the
        # unified cache), in fp8_rollout only inside ``rollout_precision()`` (the eager decode reference)
        self.forward_kv_fp8 = recipe.train_kv_fp8
        # the gated MLP hands fc2 the pre-activation and SwiGLU runs inside the FP8 activation
        # quantizer (precision.fuse_swiglu; models.spec.JetMLP)
        self.fuse_swiglu = True
        # the FP8 wgrad GEMM accumulates into megatron's fp32 main_grad itself (cuBLASLt beta = 1) instead
        # of returning a BF16 gradient for the DDP hook to add (precision.fuse_wgrad_accumulation)
        self.fuse_wgrad_accumulation = True
        # jet training: the trainer frees the FP8 linears' BF16 weights between the re-quantization and the next
        # optimizer step (precision.release_bf16_weights; trainer.actor.Actor.release_weights)
        self.release_bf16_weights = True
        # jet training: dgrad's K-major FP8 weight made once per step and shared by its micro-batches
        # (precision.cache_dgrad_weights; dropped after each step's backward: drop_dgrad_weights)
        self.cache_dgrad_weights = True
        # the FP8 backward quantizes each output gradient both ways in one pass (quant.quantize_dual; 1.25-1.28x
        # the two separate quantizers on the H200); False: one quantizer per operand, the same bytes (the
        # reference the tests compare with)
        self.fused_dy_quant = True
        # a fused QKV trains on its FP8 blocks gathered into Megatron's row order (no permutation of y, dy or
        # dW; FP8WeightCache.train_order); False: the rollout-order weight with permutations, the same values
        # (the reference the tests compare with)
        self.qkv_train_order = True
        # linears left in BF16 because their shape does not fit the FP8 blocks (attach_fp8); module names
        self.bf16_linears: list[str] = []

    def bump(self) -> None:
        """Invalidate every cached FP8 weight (call after the weights changed)."""
        self.version += 1

    def small_m(self, M: int, N: int, K: int) -> bool:
        """Whether an inference forward of ``M`` rows through an ``[N, K]`` FP8 weight runs the small-M Triton GEMM
        (CUDA, ``scaled_mm`` backend, outside exact mode): up to ``small_m_max`` rows, and above them the shapes the
        static decoder's tuning gave it (``gemm.tune_kernels``)."""
        return M <= self.small_m_max or gemm.kernel_for(M, N, K) == "small_m"

    @contextlib.contextmanager
    def rollout_precision(self):
        """Run the enclosed forwards with the rollout's precision (FP8 when the recipe says so)."""
        before = self.forward_fp8, self.forward_kv_fp8
        self.forward_fp8, self.forward_kv_fp8 = self.recipe.rollout_fp8, self.recipe.rollout_kv_fp8
        try:
            yield
        finally:
            self.forward_fp8, self.forward_kv_fp8 = before


class FP8WeightCache:
    """The FP8 bytes and scales of one linear's weight for one version, in rollout layout."""

    def __init__(self, sub_rows: list[int], perm: Optional[torch.Tensor], block_rows: int = 128):
        self.sub_rows, self.block_rows = sub_rows, block_rows
        self.perm = perm
        self.inv_perm = None if perm is None else torch.argsort(perm)
        self.version = -1
        self.qweight: Optional[torch.Tensor] = None
        self.scale_inv: Optional[torch.Tensor] = None
        self.refreshes = 0
        self.stores = 0  # bumped whenever qweight/scale_inv get new bytes (refresh or install)
        # the training row order as whole rollout blocks (None where the permutation splits blocks)
        self.train_blocks = _whole_block_map(self.inv_perm, block_rows)
        self._train: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._train_stores = -1
        # dgrad's K-major copies of the bytes and of the block scales (dgrad_operands), dropped after each step
        self._t: Optional[torch.Tensor] = None
        self._t_scale: Optional[torch.Tensor] = None
        self._t_key = None

    def get(self, weight: torch.Tensor, state: FP8ModelState) -> tuple[torch.Tensor, torch.Tensor]:
        if self.version != state.version or self.qweight is None:
            self.refresh(weight, state)
        return self.qweight, self.scale_inv

    @torch.no_grad()
    def refresh(self, weight: torch.Tensor, state: FP8ModelState) -> None:
        from megatron_jetrl.memory import is_released

        if is_released(weight):
            raise RuntimeError("FP8 weight cache: the BF16 weight was released (precision.release_bf16_weights) and "
                               "the cache is stale; call Actor.restore_weights() before changing the weights")
        w = weight.detach()
        if self.perm is not None:
            w = w.index_select(0, self.perm.to(w.device))
        if w.is_cuda and self._holds(w, state.recipe):
            # quantized straight into the cache's buffers (no temporaries, no concatenation); the
            # training-order copy straight from the Megatron-order weight (the same blocks and scales)
            from megatron_jetrl.kernels.triton_quant import quantize_weight_triton

            for part, out in zip(w.split(self.sub_rows, 0), self.parts()):
                quantize_weight_triton(part, state.recipe, out=out)
            self.stores += 1
            if self._train is not None:
                quantize_weight_triton(weight.detach(), state.recipe, out=self._train)
                self._train_stores = self.stores
        else:
            qs, ss = zip(*(quantize_weight(part, state.recipe) for part in w.split(self.sub_rows, 0)))
            self._store(qs, ss)
        self.version = state.version
        self.refreshes += 1

    def _holds(self, w: torch.Tensor, recipe: FP8Recipe) -> bool:
        """Whether the cache's buffers exist on ``w``'s device in ``w``'s shape and the recipe's dtypes (refresh
        writes into them)."""
        return (self.qweight is not None and self.qweight.device == w.device and self.qweight.shape == w.shape
                and self.qweight.dtype == recipe.dtype and self.scale_inv.dtype == torch.float32
                and self.scale_inv.shape[0] == sum(-(-n // self.block_rows) for n in self.sub_rows))

    @torch.no_grad()
    def install(self, parts: list[tuple[torch.Tensor, torch.Tensor]], state: FP8ModelState,
                device: torch.device) -> None:
        """Take received FP8 bytes + scales (per logical sub-matrix, rollout layout) as this
        version's cache instead of quantizing the weight (a rollout server runs what it was sent)."""
        for (q, s), rows in zip(parts, self.sub_rows):
            if q.shape[0] != rows or s.shape[0] != -(-rows // self.block_rows):
                raise ValueError(f"FP8 part of {rows} rows expected, got fp8 {tuple(q.shape)} / scale {tuple(s.shape)}")
        self._store([q.to(device) for q, _ in parts], [s.to(device, torch.float32) for _, s in parts])
        self.version = state.version

    def train_order(self, weight: torch.Tensor, state: FP8ModelState) -> tuple[torch.Tensor, torch.Tensor]:
        """This version's FP8 bytes and scales in the module's own (Megatron) row order, when the rollout
        permutation moves whole 128-row blocks (a fused QKV with head_dim a multiple of 128): the same
        blocks with the same scales, reordered once per version (made on first use, then kept current by
        every refresh), so the training GEMMs need no row permutation of y, dy or dW."""
        self.get(weight, state)
        if self._train is None or self._train_stores != self.stores:
            self._reorder()
        return self._train

    def dgrad_operands(self, q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q^T`` and ``s^T`` contiguous ([K, N] bytes, the K-major operand of dgrad's FP8 GEMM: cuBLAS reads
        both FP8 operands K-major; [K/128, N/128] scales, the layout its 128x128 scale operand then needs) for
        ``q, s`` = this cache's bytes and scales in either row order: made once per stored version and kept
        until :meth:`drop_dgrad`, so a step's micro-batches share one transpose of each instead of one per
        call."""
        key = (q.data_ptr(), s.data_ptr(), self.stores, self._train_stores)
        if self._t is None or self._t_key != key:
            from megatron_jetrl.precision.gemm import k_major

            self._t = k_major(q.t())
            self._t_scale = s.t().contiguous()
            self._t_key = key
        return self._t, self._t_scale

    def drop_dgrad(self) -> None:
        self._t = self._t_scale = self._t_key = None

    def _reorder(self) -> None:
        q, s = self.qweight, self.scale_inv
        nb, idx = self.train_blocks.numel(), self.train_blocks.to(q.device)
        # reordered as bytes (uint8 view): index ops are not implemented for every fp8 dtype on every device
        tq = q.view(torch.uint8).view(nb, self.block_rows, q.shape[1]).index_select(0, idx).view(q.shape)
        ts = s.index_select(0, idx)
        if self._train is not None and self._train[0].shape == tq.shape and self._train[0].device == tq.device:
            self._train[0].view(torch.uint8).copy_(tq)
            self._train[1].copy_(ts)
        else:
            self._train = (tq.view(q.dtype), ts)
        self._train_stores = self.stores

    def _store(self, qs, ss) -> None:
        """New bytes go into the existing buffers when the shapes allow: the storage stays put, so
        a rollout's captured CUDA graphs (rollout/decode.py) keep reading the current weights."""
        if (self.qweight is not None and self.qweight.device == qs[0].device
                and self.qweight.shape[0] == sum(q.shape[0] for q in qs) and self.qweight.shape[1:] == qs[0].shape[1:]
                and self.scale_inv.shape[0] == sum(x.shape[0] for x in ss) and self.scale_inv.shape[1:] == ss[0].shape[1:]):
            torch.cat(qs, 0, out=self.qweight)
            torch.cat(ss, 0, out=self.scale_inv)
        else:
            self.qweight, self.scale_inv = torch.cat(qs, 0), torch.cat(ss, 0)
        self.stores += 1
        if self._train is not None:  # training uses the Megatron-order copy: keep it current now
            self._reorder()

    def parts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (fp8, scale_inv) of each logical sub-matrix (q, k, v / gate, up), rollout layout."""
        out, row, srow = [], 0, 0
        for n in self.sub_rows:
            sn = -(-n // self.block_rows)
            out.append((self.qweight[row:row + n], self.scale_inv[srow:srow + sn]))
            row, srow = row + n, srow + sn
        return out


def _forward_gemm(xq, xs, qweight, scale_inv, inv_perm, backend, out_dtype, group, lead, exact=False):
    """The FP8 forward GEMM on quantized activations: ``y = xq @ qweight^T`` in block FP8, its columns put
    back in Megatron's row order (``inv_perm``, the rollout-order fused QKV), shaped ``[*lead, N]``. ``exact``
    (``precision.exact`` on CUDA): the batch-invariant kernel (``kernels/exact_gemm.py``), the same bits for a row
    in the decoder's step and in the trainer's micro-batch."""
    if exact:
        from megatron_jetrl.kernels.exact_gemm import exact_block_gemm

        y = exact_block_gemm(xq, xs, qweight, scale_inv, out_dtype, group)
    else:
        y = block_gemm(xq, xs, qweight, scale_inv, backend, out_dtype=out_dtype, group=group)
    if inv_perm is not None:
        y = y.index_select(1, inv_perm)
    return y.view(*lead, y.shape[-1])


class FP8LinearFunction(torch.autograd.Function):
    """y = x @ W^T in block FP8; see the module docstring for the backward."""

    @staticmethod
    def forward(ctx, x, weight, qweight, scale_inv, inv_perm, perm, recipe, backend, fuse_accum=False, fused_dy=True,
                cache=None, exact=False):
        lead, K = x.shape[:-1], x.shape[-1]
        xq, xs = quantize_act(x.reshape(-1, K), recipe, scale_col_major=backend == "scaled_mm")
        y = _forward_gemm(xq, xs, qweight, scale_inv, inv_perm, backend, x.dtype, recipe.group_size, lead, exact)
        ctx.save_for_backward(xq, xs, qweight, scale_inv, perm, inv_perm)
        ctx.recipe, ctx.backend, ctx.wdtype, ctx.xdtype = recipe, backend, weight.dtype, x.dtype
        ctx.weight = weight if fuse_accum else None
        ctx.fused_dy, ctx.cache = fused_dy, cache
        return y

    @staticmethod
    def backward(ctx, dy):
        xq, xs, qweight, scale_inv, perm, inv_perm = ctx.saved_tensors
        dx, dw = _fp8_backward(ctx, dy, xq, xs, qweight, scale_inv, perm, inv_perm)
        return dx, dw, None, None, None, None, None, None, None, None, None, None


_ACCUMULATE_FAILED: list = []


def _accumulate(a, a_s, b, b_s, main_grad, backend, group) -> bool:
    """The fused wgrad accumulation; a cuBLASLt refusal (a cuBLAS build without these block-scaled kernels)
    turns the fusion off for the process with one warning, and the caller takes the unfused path (nothing
    was written: the refusal comes before the GEMM runs)."""
    from megatron_jetrl.precision.gemm import block_gemm_accumulate

    if _ACCUMULATE_FAILED:
        return False
    try:
        block_gemm_accumulate(a, a_s, b, b_s, main_grad, backend, group)
        return True
    except RuntimeError as e:
        _ACCUMULATE_FAILED.append(str(e))
        log.warning("FP8 wgrad accumulation into main_grad is off for this run (%s); the wgrad is added by "
                    "megatron's DDP hook instead (precision.fuse_wgrad_accumulation=false silences this)", e)
        return False


def _main_grad_target(ctx, inv_perm, a, b):
    """megatron's fp32 ``main_grad`` of the weight when the wgrad GEMM can accumulate into it directly
    (the fusion is on, DDP gave the weight a ``main_grad`` and tracks ``grad_added_to_main_grad``, the rows
    need no permutation, the backend takes the operands), else None."""
    w = getattr(ctx, "weight", None)
    mg = getattr(w, "main_grad", None)
    if (mg is None or inv_perm is not None or not hasattr(w, "grad_added_to_main_grad")
            or mg.dtype != torch.float32 or mg.shape != w.shape or not mg.is_contiguous()):
        return None
    from megatron_jetrl.precision.gemm import accumulate_supported

    return mg if accumulate_supported(a, b, mg, ctx.backend) else None


def _fp8_backward(ctx, dy, xq, xs, qweight, scale_inv, perm, inv_perm):
    """dgrad and wgrad of ``y = x W^T`` from the saved FP8 ``x`` (see the module docstring)."""
    recipe, backend, g = ctx.recipe, ctx.backend, ctx.recipe.group_size
    N = dy.shape[-1]
    dy2 = dy.reshape(-1, N)
    # the wgrad operands' token dimension padded in the quantizers' buffers to what the GEMM takes as is
    # (gemm.wgrad_token_pad)
    pad = gemm.wgrad_token_pad(dy2.shape[0], backend, g)
    if perm is not None:
        dy2 = dy2.index_select(1, perm)  # into the cached weight's (rollout) row order
    if recipe.wgrad == "fp8" and ctx.fused_dy:  # both of dy's operands below in one pass
        dyq, dys, dyt_q, dyt_s = quantize_dual(dy2, recipe, scale_col_major=backend == "scaled_mm", pad_to=pad)
    else:
        dyq, dys = quantize_act(dy2, recipe, scale_col_major=backend == "scaled_mm")
        if recipe.wgrad == "fp8":
            dyt_q, dyt_s = quantize_transposed(dy2, recipe, tile_scale=False, pad_to=pad)
    # dgrad: dy in 1x128 groups along N; the forward weight blocks serve W^T (the same bytes, K-major: the
    # step's one transpose from the cache when precision.cache_dgrad_weights, else one per micro-batch)
    # (and the block scales' K-major copy, which cuBLAS's scale operand would otherwise make per call)
    wt, st = ctx.cache.dgrad_operands(qweight, scale_inv) if ctx.cache is not None else (qweight.t(), scale_inv.t())
    dx = block_gemm(dyq, dys, wt, st, backend, out_dtype=ctx.xdtype, group=g)
    # wgrad: dy^T in 1x128 groups along tokens; x^T re-blocked 128x128 from the saved FP8
    # activations (torch's blockwise scaled_mm needs one operand in 128x128 blocks).
    if recipe.wgrad == "fp8":
        xt_q, xt_s = quantize_transposed(xq, recipe, tile_scale=True, x_scale=xs, pad_to=pad)
        main_grad = _main_grad_target(ctx, inv_perm, dyt_q, xt_q)
        if main_grad is not None and _accumulate(dyt_q, dyt_s, xt_q, xt_s, main_grad, backend, g):
            # megatron's gradient-accumulation-fusion protocol (as with TransformerEngine / APEX)
            w = ctx.weight
            w.grad_added_to_main_grad = True  # the DDP hook drops the placeholder below instead of adding it
            dw = (torch.zeros if getattr(w, "zero_out_wgrad", False) else torch.empty)(
                w.shape, dtype=ctx.wdtype, device=main_grad.device)
            return dx.view(*dy.shape[:-1], dx.shape[-1]), dw
        # written in the weight's dtype by the GEMM's epilogue (one rounding of the fp32 accumulator,
        # as BF16 autograd returns it): no fp32 [N, K] round trip
        dw = block_gemm(dyt_q, dyt_s, xt_q, xt_s, backend, out_dtype=ctx.wdtype, group=g)
    else:
        dw = dy2.t().float() @ dequantize_act(xq, xs, g)
    if inv_perm is not None:
        dw = dw.index_select(0, inv_perm)
    return dx.view(*dy.shape[:-1], dx.shape[-1]), dw.to(ctx.wdtype)


class FP8SwigluLinearFunction(torch.autograd.Function):
    """``out = swiglu(y) @ W^T`` for the MLP's fc2 with the SwiGLU fused into the activation
    quantizer: the forward reads fc1's output ``y = [gate | up]`` once and writes only the FP8
    activation and its scales (``quant.quantize_swiglu``), never the BF16 activation. Saved for
    backward: ``y`` (which the unfused gated MLP saves too) and the FP8 activation; the backward is
    the FP8 linear's (dgrad, wgrad) followed by the SwiGLU derivative in fp32."""

    @staticmethod
    def forward(ctx, y, weight, qweight, scale_inv, inv_perm, perm, recipe, backend, fuse_accum=False, fused_dy=True,
                cache=None, exact=False):
        from megatron_jetrl.precision.quant import quantize_swiglu

        lead = y.shape[:-1]
        xq, xs = quantize_swiglu(y.reshape(-1, y.shape[-1]), recipe, scale_col_major=backend == "scaled_mm")
        out = _forward_gemm(xq, xs, qweight, scale_inv, inv_perm, backend, y.dtype, recipe.group_size, lead, exact)
        ctx.save_for_backward(y, xq, xs, qweight, scale_inv, perm, inv_perm)
        ctx.recipe, ctx.backend, ctx.wdtype, ctx.xdtype = recipe, backend, weight.dtype, y.dtype
        ctx.weight = weight if fuse_accum else None
        ctx.fused_dy, ctx.cache = fused_dy, cache
        return out

    @staticmethod
    def backward(ctx, dout):
        y, xq, xs, qweight, scale_inv, perm, inv_perm = ctx.saved_tensors
        from megatron_jetrl.precision.quant import swiglu_backward

        da, dw = _fp8_backward(ctx, dout, xq, xs, qweight, scale_inv, perm, inv_perm)
        return swiglu_backward(y, da), dw, None, None, None, None, None, None, None, None, None, None


@dataclasses.dataclass(frozen=True)
class CallHints:
    """How the caller that owns a call of an FP8 linear wants it run; set for the call with
    ``FP8LinearMixin.hinted(...)``, the defaults otherwise. ``swiglu_input`` says what the input is; the others
    save work and leave the output's bytes as they are."""

    swiglu_input: bool = False
    """The gated MLP (``models.spec.JetMLP``) around fc2's call: the input is fc1's output ``[gate | up]`` and the
    SwiGLU runs fused into the activation quantizer."""
    prequantized_input: Optional[tuple] = None
    """The static decoder around an inference call whose input's FP8 bytes and scales were computed by the op that
    produced it (fused add + RMSNorm + quantizer): ``(q, scale_inv)``, used instead of quantizing the input again
    (ignored unless its rows are the input's)."""
    defer_split_sum: bool = False
    """The static decoder around an inference call whose output only feeds its fused residual add + RMSNorm kernel
    (attention's output projection, the MLP's fc2; TP=1, no bias): when the small-M GEMM splits K, the call returns
    the unsummed fp32 partials ``[split, tokens, N]`` and sets ``deferred_splits``; the norm kernel sums them."""
    rollout_layout_output: bool = False
    """The static decoder around an inference call of a fused QKV: the FP8 output stays in the cache's rollout row
    order (``[q | k | v]``, what SGLang's ``qkv_proj`` computes) instead of Megatron's interleaved order."""


def exact_kernels(where: torch.Tensor | torch.device) -> bool:
    """Whether exact mode (``precision.exact``) runs on the batch-invariant kernels for a tensor (or device): on CUDA,
    and on the CPU under Triton's interpreter (the tests). Otherwise the CPU emulation's own path
    (``rollout/local.py``)."""
    from megatron_jetrl.env import triton_interpreted

    device = where if isinstance(where, torch.device) else where.device
    return device.type == "cuda" or triton_interpreted()


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 fuse_accum: bool = False) -> torch.Tensor:
    """A BF16 linear in exact mode (``bf16`` mode's linears, the LM head, FP8-shape fallbacks): the forward on the
    batch-invariant GEMM (``kernels/exact_gemm.py``), a plain backward (``fuse_accum``: the layer's megatron
    ``gradient_accumulation_fusion``, the weight gradient added into ``main_grad``). TP = 1 (exact mode's
    requirement)."""
    from megatron_jetrl.kernels.exact_gemm import ExactLinearFunction

    y = ExactLinearFunction.apply(x, weight, bool(fuse_accum))
    return y if bias is None else y + bias


class FP8LinearMixin:
    """Adds the FP8 path to a Megatron parallel linear. ``attach_fp8`` (below) configures it;
    until then, or when the model state says BF16, the layer is the plain Megatron layer."""

    fp8_state: Optional[FP8ModelState] = None
    fp8_cache: Optional[FP8WeightCache] = None
    fp8_backend: Optional[str] = None
    hints: CallHints = CallHints()
    """This call's hints (the defaults outside ``hinted``)."""
    deferred_splits = 0
    """Output of a call with ``defer_split_sum``: the number of fp32 partials returned (1: summed)."""

    @contextlib.contextmanager
    def hinted(self, **changes):
        """Run the enclosed calls of this linear with ``CallHints`` fields changed (restored on exit)."""
        before = self.hints
        self.hints = dataclasses.replace(before, **changes)
        try:
            yield self
        finally:
            self.hints = before

    def fp8_active(self) -> bool:
        return self.fp8_state is not None and self.fp8_state.forward_fp8

    def fp8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached FP8 weight (rollout layout) for the current version."""
        return self.fp8_cache.get(self.weight, self.fp8_state)

    def _fp8_matmul(self, input, weight, bias, allreduce_dgrad, tp_group):
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        if allreduce_dgrad:  # Megatron folds the TP dgrad all-reduce into its GEMM; we use the mapping.
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        qweight, scale_inv = self.fp8_weight()
        cache = self.fp8_cache
        M = input.numel() // input.shape[-1]
        inv_perm, perm = cache.inv_perm, cache.perm
        if self.hints.rollout_layout_output and inv_perm is not None:
            if torch.is_grad_enabled():
                raise RuntimeError("rollout_layout_output is for inference forwards (no autograd)")
            inv_perm, perm = None, None
            bias = None if bias is None else bias.index_select(0, cache.perm.to(bias.device))
        exact = self.fp8_state.recipe.exact and exact_kernels(input)
        if (not exact and not torch.is_grad_enabled() and input.is_cuda and self.fp8_backend == "scaled_mm"
                and self.fp8_state.small_m(M, *qweight.shape)):  # decode: the fused small-M Triton GEMM
            from megatron_jetrl.precision.quant import swiglu
            from megatron_jetrl.kernels.triton_gemm import small_m_linear

            fused = self.hints.swiglu_input and M > 8  # SwiGLU in the activation quantizer (one kernel)
            if self.hints.swiglu_input and not fused:  # a few rows: the activation in torch, its quantization in the GEMM
                input = swiglu(input)
            pre = self.hints.prequantized_input
            if pre is not None and (fused or pre[0].shape[0] != M):
                pre = None
            if self._defers_split_sum(bias, inv_perm):
                out, self.deferred_splits = small_m_linear(input, qweight, scale_inv, self.fp8_state.recipe,
                                                           swiglu=fused, xq=pre, return_partials=True)
                return out
            out = small_m_linear(input, qweight, scale_inv, self.fp8_state.recipe, swiglu=fused, xq=pre)
            if inv_perm is not None:
                out = out.index_select(-1, inv_perm.to(out.device))
            return out if bias is None else out + bias
        if inv_perm is not None and cache.train_blocks is not None and self.fp8_state.qkv_train_order:
            # the same FP8 blocks in Megatron's row order: no permutation of y, dy or dW
            qweight, scale_inv = cache.train_order(self.weight, self.fp8_state)
            inv_perm, perm = None, None
        if exact and not torch.is_grad_enabled():  # the decoder: the trainer's quantizers and exact GEMM, no autograd
            return self._exact_inference(input, qweight, scale_inv, inv_perm, bias, M)
        pre = self._prequantized(input, M)
        if pre is not None and not torch.is_grad_enabled():
            # inference with x's FP8 bytes and scales from the op that produced x (the decoder's norm kernel,
            # scales in cuBLAS's column-major layout): the GEMM alone, no quantizer launch
            y = _forward_gemm(pre[0], pre[1], qweight, scale_inv, inv_perm, self.fp8_backend, input.dtype,
                              self.fp8_state.recipe.group_size, input.shape[:-1])
            return y if bias is None else y + bias
        fn = FP8SwigluLinearFunction if self.hints.swiglu_input else FP8LinearFunction
        out = fn.apply(input, weight, qweight, scale_inv, inv_perm, perm, self.fp8_state.recipe, self.fp8_backend,
                       self.fp8_state.fuse_wgrad_accumulation, self.fp8_state.fused_dy_quant,
                       cache if self.fp8_state.cache_dgrad_weights and torch.is_grad_enabled() else None, exact)
        return out if bias is None else out + bias

    def _prequantized(self, input, M):
        """``input``'s FP8 bytes and scales handed over by the op that produced it (``prequantized_input``: the decoder's
        fused add + RMSNorm + quantizer), when they are this call's operand (M rows, not a SwiGLU input); else None."""
        pre = self.hints.prequantized_input
        if pre is None or self.hints.swiglu_input or pre[0].shape != (M, input.shape[-1]):
            return None
        return pre

    def _defers_split_sum(self, bias, inv_perm) -> bool:
        """Whether an inference call may return its split-K fp32 partials for the decoder's norm kernel to add
        (``defer_split_sum``): no bias to add after the sum, the output in Megatron's order."""
        return (self.hints.defer_split_sum and bias is None and inv_perm is None
                and getattr(self, "bias", None) is None)

    def _exact_inference(self, input, qweight, scale_inv, inv_perm, bias, M):
        """Exact mode's inference forward (the static decoder): the activation bytes the training forward's quantizer
        computes (``quantize_act`` / ``quantize_swiglu``, or the same bytes handed over by the decoder's fused add +
        RMSNorm + quantizer: ``prequantized_input``), the exact GEMM; with ``defer_split_sum`` its K segments' fp32
        partials go to the decoder's norm kernel, which adds them in segment order as the sum kernel would."""
        from megatron_jetrl.kernels.exact_gemm import exact_block_gemm
        from megatron_jetrl.precision.quant import quantize_swiglu

        recipe, pre, lead = self.fp8_state.recipe, self._prequantized(input, M), input.shape[:-1]
        if pre is not None:
            xq, xs = pre
        elif self.hints.swiglu_input:
            xq, xs = quantize_swiglu(input.reshape(M, -1), recipe)
        else:
            xq, xs = quantize_act(input.reshape(M, -1), recipe)
        defer = self._defers_split_sum(bias, inv_perm)
        y, splits = exact_block_gemm(xq, xs, qweight, scale_inv, input.dtype, recipe.group_size,
                                     return_partials=True)
        if splits > 1:
            if defer:
                self.deferred_splits = splits
                return y
            from megatron_jetrl.kernels.triton_gemm import sum_partials

            y = sum_partials(y, torch.empty(y.shape[1:], dtype=input.dtype, device=y.device))
        if inv_perm is not None:
            y = y.index_select(1, inv_perm)
        y = y.view(*lead, y.shape[-1])
        return y if bias is None else y + bias

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not self.fp8_active() or weight is not self.weight:
            if self.hints.swiglu_input:
                from megatron_jetrl.precision.quant import swiglu

                input = swiglu(input)
            if self.fp8_state is not None and self.fp8_state.recipe.exact and exact_kernels(input):
                return exact_linear(input, weight, kwargs.get("bias"), kwargs.get("gradient_accumulation_fusion"))
            return super()._forward_impl(input, weight, *args, **kwargs)
        return self._fp8_matmul(input, weight, kwargs.get("bias"), kwargs.get("allreduce_dgrad", False),
                                kwargs.get("tp_group"))


def _whole_block_map(inv_perm: Optional[torch.Tensor], block: int) -> Optional[torch.Tensor]:
    """For ``train[j] = rollout[inv_perm[j]]``: the rollout block of each ``block``-row block of the
    training order, if every training block is one whole rollout block; else None."""
    if inv_perm is None or inv_perm.numel() % block:
        return None
    v = inv_perm.view(-1, block)
    start = v[:, 0]
    if bool((start % block).any()) or not torch.equal(v, start[:, None] + torch.arange(block, device=v.device)):
        return None
    return start // block


def weight_layout(name: str, module, config) -> tuple[list[int], Optional[torch.Tensor]]:
    rows, cols = module.weight.shape
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "linear_qkv":
        hpg = config.num_attention_heads // config.num_query_groups
        perm, sub = qkv_permutation(rows, hpg, config.kv_channels)
        return sub, perm
    if leaf == "linear_fc1" and config.gated_linear_unit:
        return [rows // 2, rows // 2], None
    return [rows], None


def attach_fp8(model: torch.nn.Module, recipe: FP8Recipe, backend: str = "auto",
               device: Optional[torch.device] = None) -> FP8ModelState:
    """Configure every FP8 linear of ``model``; checks block alignment of each TP shard where FP8 runs
    (``ConfigError``, one line); logs and returns the shared state. In ``bf16`` mode the layers stay BF16
    (state.forward_fp8 False) and any shape is accepted."""
    from megatron_jetrl.errors import ConfigError

    if device is None:
        device = next(model.parameters()).device
    state = FP8ModelState(recipe, backend)
    resolved = resolve_backend(backend, device)
    n = 0
    for name, module in model.named_modules():
        if not isinstance(module, FP8LinearMixin):
            continue
        rows, cols = module.weight.shape
        sub, perm = weight_layout(name, module, module.config)
        g = recipe.group_size
        tp = getattr(module, "tp_size", 1)
        split = cols if hasattr(module, "input_is_parallel") else rows
        if (len(sub) > 1 and any(s % g for s in sub)) or (
                tp > 1 and not getattr(module, "explicit_expert_comm", False) and split % g):
            # 128x128 blocks would straddle q/k/v or gate/up, or a tensor-parallel shard: this linear stays BF16,
            # in the trainer and (listed in the export's modules_to_not_convert) in the rollout
            state.bf16_linears.append(name)
            continue
        module.fp8_state = state
        module.fp8_backend = resolved
        module.fp8_cache = FP8WeightCache(sub, None if perm is None else perm.to(module.weight.device),
                                          recipe.weight_block[0])
        n += 1
    if state.bf16_linears and recipe.mode != "bf16":
        if not n:
            raise ConfigError(f"config error: precision.mode: no linear of this model fits {g}x{g} FP8 blocks (q/k/v, "
                              f"gate/up and tensor-parallel shards in whole blocks); use precision.mode=bf16")
        log.info("FP8 %s: %d linears stay BF16 (their q/k/v, gate/up or tensor-parallel shards are not whole %d-row "
                 "blocks): %s", recipe.mode, len(state.bf16_linears), g, ", ".join(state.bf16_linears[:4])
                 + (", ..." if len(state.bf16_linears) > 4 else ""))
    state.num_fp8_layers = n
    state.backend = resolved
    log.info("FP8 %s: %d linear layers on the %s backend (train forward FP8: %s, rollout FP8: %s)",
             recipe.mode, n, resolved, recipe.train_fp8, recipe.rollout_fp8)
    return state


def fp8_report(model: torch.nn.Module) -> dict[str, bool]:
    """Every linear-like module of the model -> whether its forward runs FP8 right now."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, FP8LinearMixin):
            out[name] = module.fp8_active()
        elif hasattr(module, "weight") and name.rsplit(".", 1)[-1] in ("output_layer", "router"):
            out[name] = False
    return out


def drop_dgrad_weights(model: torch.nn.Module) -> None:
    """Free the step's dgrad copies of the FP8 weights and scales (``FP8WeightCache.dgrad_operands``)."""
    for module in model.modules():
        if isinstance(module, FP8LinearMixin) and module.fp8_cache is not None:
            module.fp8_cache.drop_dgrad()


@torch.no_grad()
def refresh_fp8_weights(model: torch.nn.Module, state: FP8ModelState) -> float:
    """Bump the version and re-quantize every FP8 weight now (once per optimizer step);
    returns seconds spent. In ``bf16`` mode nothing runs FP8, so nothing is quantized."""
    state.bump()
    if not state.recipe.rollout_fp8:
        return 0.0
    t0 = time.perf_counter()
    for module in model.modules():
        if isinstance(module, FP8LinearMixin) and module.fp8_cache is not None:
            module.fp8_cache.refresh(module.weight, state)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0
