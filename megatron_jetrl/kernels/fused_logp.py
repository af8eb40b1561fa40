"""Log-probability of the labels and the entropy from the lm_head's logits, vocabulary split over TP
ranks, without fp32 copies of the [tokens x vocab] logits.

The eager path (megatron-core's ``vocab_parallel_cross_entropy`` on ``logits.float() / T``, plus the
entropy) makes about ten passes over fp32 [tokens x vocab] tensors per micro-batch and keeps an
fp32 softmax for backward: at a 128K vocabulary and 4096 tokens that is 2.1 GB per tensor and, on
the H200, ~10 ms per micro-batch in both training precisions. Here:

- forward: one kernel per rank reads each row of the logits (in their own dtype) twice, first for
  the local max ``m``, then for ``s = sum exp(z - m)``, ``sz = sum exp(z - m) * z`` and the label's
  ``z`` when the label is in this rank's vocabulary slice (``z = logits / T`` in fp32). Ranks combine
  those [tokens]-sized statistics (max, then sums rescaled by ``exp(m_r - M)``):
  ``lse = M + log s``, ``logp = z_label - lse``, ``entropy = lse - sz / s``.
- backward: one kernel, one read of each row, recomputes ``p = exp(z - lse)`` and writes the
  logits' gradient in their dtype: ``(g_logp * (onehot - p) - g_ent * p * (z - E[z])) / T``. Only the logits (already alive) and
  four floats per token are saved.

On CUDA the per-row passes are Triton kernels; elsewhere the same statistics in torch (the CPU path
of the tests, and TP over gloo). ``trainer.actor.vocab_parallel_logp_entropy`` uses this on CUDA
(``fused=False``: megatron's path), megatron's path on CPU.
"""
from __future__ import annotations


import torch
import torch.distributed as dist
from megatron_jetrl.env import triton_interpreted

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - triton is a dependency; CPU-only installs may lack it
    triton = None


def _tp():
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None, 1, 0
    return (parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank())


if triton is not None:
    @triton.jit
    def _stats_kernel(x_ptr, lab_ptr, out_ptr, V, stride_x, temp, vocab_start,
                      BLOCK_V: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_x
        m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m = tl.maximum(m, tl.math.div_rn(z, temp))
        mx = tl.max(m, axis=0)
        s = tl.zeros((BLOCK_V,), tl.float32)
        sz = tl.zeros((BLOCK_V,), tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            ok = cols < V
            z = tl.math.div_rn(tl.load(base + cols, mask=ok, other=0.0).to(tl.float32), temp)
            if LIBDEVICE_EXP:
                e = libdevice.exp(z - mx)
            else:
                e = tl.exp(z - mx)
            e = tl.where(ok, e, 0.0)
            s += e
            sz += e * z
        label = tl.load(lab_ptr + row) - vocab_start
        own = (label >= 0) & (label < V)
        zl = tl.math.div_rn(tl.load(base + label, mask=own, other=0.0).to(tl.float32), temp)
        zl = tl.where(own, zl, 0.0)
        tl.store(out_ptr + row, mx)
        tl.store(out_ptr + row + tl.num_programs(0), tl.sum(s, axis=0))
        tl.store(out_ptr + row + 2 * tl.num_programs(0), tl.sum(sz, axis=0))
        tl.store(out_ptr + row + 3 * tl.num_programs(0), zl)

    @triton.jit
    def _grad_kernel(x_ptr, lab_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, dx_ptr, V, stride_x, stride_dx, temp,
                     vocab_start, BLOCK_V: tl.constexpr, HAS_ENT: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        lse = tl.load(lse_ptr + row)
        glp = tl.load(glp_ptr + row)
        label = tl.load(lab_ptr + row) - vocab_start
        if HAS_ENT:
            ez = tl.load(ez_ptr + row)
            gent = tl.load(gent_ptr + row)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            ok = cols < V
            z = tl.math.div_rn(tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32), temp)
            if LIBDEVICE_EXP:
                p = libdevice.exp(z - lse)
            else:
                p = tl.exp(z - lse)
            g = glp * (tl.where(cols == label, 1.0, 0.0) - p)
            if HAS_ENT:
                g -= gent * p * (z - ez)
            tl.store(dx_ptr + row * stride_dx + cols, tl.math.div_rn(g, temp).to(dx_ptr.dtype.element_ty), mask=ok)


def _use_triton(x: torch.Tensor) -> bool:
    """The kernels on CUDA, and on CPU tensors under Triton's interpreter (the CPU tests)."""
    return triton is not None and (x.is_cuda or triton_interpreted())


def _local_stats(x: torch.Tensor, labels: torch.Tensor, temperature: float, vocab_start: int) -> torch.Tensor:
    """[4, T] float32: per row local max of z, sum exp(z - max), sum exp(z - max) * z, z at the label
    (0 when the label is another rank's)."""
    T, V = x.shape
    if _use_triton(x):
        out = torch.empty((4, T), dtype=torch.float32, device=x.device)
        if T:
            _stats_kernel[(T,)](x, labels, out, V, x.stride(0), float(temperature), vocab_start, BLOCK_V=2048,
                                LIBDEVICE_EXP=not triton_interpreted(), num_warps=8)
        return out
    z = x.float() / temperature
    m = z.max(-1).values
    e = torch.exp(z - m[:, None])
    local = labels - vocab_start
    own = (local >= 0) & (local < V)
    zl = torch.where(own, z.gather(1, local.clamp(0, V - 1)[:, None]).squeeze(1), torch.zeros_like(m))
    return torch.stack([m, e.sum(-1), (e * z).sum(-1), zl])


def _logits_grad(x, labels, lse, ez, g_logp, g_ent, temperature, vocab_start) -> torch.Tensor:
    T, V = x.shape
    if _use_triton(x):
        dx = torch.empty_like(x)
        if T:
            has_ent = g_ent is not None
            _grad_kernel[(T,)](x, labels, lse, ez, g_logp, g_ent if has_ent else g_logp, dx, V, x.stride(0),
                               dx.stride(0), float(temperature), vocab_start, BLOCK_V=2048, HAS_ENT=has_ent,
                               LIBDEVICE_EXP=not triton_interpreted(), num_warps=8)
        return dx
    z = x.float() / temperature
    p = torch.exp(z - lse[:, None])
    local = labels - vocab_start
    own = ((local >= 0) & (local < V)).float()
    onehot = torch.zeros_like(p).scatter_(1, local.clamp(0, V - 1)[:, None], own[:, None])
    g = g_logp[:, None] * (onehot - p)
    if g_ent is not None:
        g = g - g_ent[:, None] * p * (z - ez[:, None])
    return (g / temperature).to(x.dtype)


def _combine(m, s, sz, zl) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole vocabulary's statistics [T] -> (logp, lse, E[z]) [T]: ``lse = m + log s``, ``logp = z_label - lse``,
    ``E[z] = sz / s`` (elementwise fp32, so a row's values depend on that row's statistics only)."""
    lse = m + torch.log(s)
    return zl - lse, lse, sz / s


class _FusedLogpEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, labels, temperature, vocab_start, group, world):
        ctx.set_materialize_grads(False)  # an unused entropy gets no gradient pass
        st = _local_stats(x, labels, temperature, vocab_start)
        if world > 1:
            m = st[0].clone()
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            sums = st[1:3] * torch.exp(st[0] - m)[None]
            sums = torch.cat([sums, st[3:4]])
            dist.all_reduce(sums, group=group)
            s, sz, zl = sums
        else:
            m, s, sz, zl = st
        logp, lse, ez = _combine(m, s, sz, zl)
        ctx.save_for_backward(x, labels, lse, ez)
        ctx.temperature, ctx.vocab_start = temperature, vocab_start
        return logp, lse - ez

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        x, labels, lse, ez = ctx.saved_tensors
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        g_ent = None if g_ent is None else g_ent.float().contiguous()
        dx = _logits_grad(x, labels, lse, ez, g_logp.float().contiguous(), g_ent, ctx.temperature, ctx.vocab_start)
        return dx, None, None, None, None, None


def fused_logp_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [..., V_local]`` (this TP rank's vocabulary slice, any float dtype), ``labels [...]``
    (global ids) -> (log p(label), entropy), each ``[...]`` float32, both differentiable."""
    group, world, rank = _tp()
    lead, V = logits.shape[:-1], logits.shape[-1]
    x = logits.reshape(-1, V)
    if x.stride(-1) != 1:
        x = x.contiguous()
    lab = labels.reshape(-1).to(torch.int64).contiguous()
    logp, ent = _FusedLogpEntropy.apply(x, lab, float(temperature), rank * V, group, world)
    return logp.view(lead), ent.view(lead)


def label_logp(logits: torch.Tensor, labels: torch.Tensor, temperature: float, fused: bool | None = None
               ) -> torch.Tensor:
    """Exact mode's logprob (``precision.exact``, one rank holds the vocabulary): ``logits [B, V]``, ``labels [B]``
    -> log p(label) under softmax(logits / T) [B] float32, without autograd. The trainer's logprob for the same
    logits row has the same bits: where the fused kernel runs (``fused``; None: ``fused_enabled``) this is its value
    (one program per row, a fixed block order: a row's statistics do not depend on the rows beside it, so B sampled
    rows and the trainer's micro-batch of thousands give the same bits), elsewhere the eager statement
    ``log_softmax(logits.float() / T)`` at the label, which ``trainer.actor.vocab_parallel_logp_entropy`` takes
    off the fused path."""
    use_fused = fused_enabled(logits) if fused is None else fused
    with torch.no_grad():
        if not use_fused:
            return torch.log_softmax(logits.float() / temperature, -1).gather(-1, labels[:, None]).squeeze(-1)
        x = logits if logits.stride(-1) == 1 else logits.contiguous()
        return _combine(*_local_stats(x, labels.to(torch.int64).contiguous(), float(temperature), 0))[0]


def fused_enabled(logits: torch.Tensor) -> bool:
    """The fused path is the default on CUDA."""
    return logits.is_cuda and triton is not None
