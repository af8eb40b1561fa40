"""megatron-core's multi-tensor optimizer ops without TransformerEngine or APEX, as torch foreach calls.

megatron-core's optimizer takes the gradient norm and clips the gradients through
``multi_tensor_applier(op, ...)`` with TransformerEngine's or APEX's fused kernels as ``op``. With neither
installed it falls back to two functions of ``megatron.core.utils``:

- ``local_multi_tensor_l2_norm``: a ``torch.norm`` per tensor, then ``torch.tensor(list_of_norms)``, which
  reads every norm back to the host: one synchronization with the GPU per parameter tensor (~50 per step
  for 8 Llama layers), each leaving the GPU idle until the host issues the next norm;
- ``local_multi_tensor_scale``: ``dst.copy_(src * scale)`` per tensor, so a clip that bites first writes
  an fp32 temporary as large as each gradient (2 GB for a 128K x 4096 embedding) and then copies it back
  (the same op copies fp16 main parameters into the model; BF16 runs copy them in a plain loop).

:func:`install` puts torch's multi-tensor (foreach) kernels in those two slots: ``torch._foreach_norm``
and one norm over the stacked norms on the device (no synchronization; megatron's clip reads the total
once, as with TE), and ``torch._foreach_mul_`` / ``_foreach_copy_`` (the clip scales in place, no temporary). Same math:
the norm may differ from megatron's fallback in the last bits (another reduction order); the scaling and
copies are bit-identical. Only megatron's own fallbacks are replaced; TE's or APEX's kernels are left alone.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for ``local_multi_tensor_l2_norm``: the l2 norm over all tensors of ``tensor_lists`` as a
    one-element fp32 tensor on their device (per-tensor norms are not returned, as megatron's fallback)."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=torch.cuda.current_device()), None
    norms = torch._foreach_norm(tensors, 2)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    return total.reshape(1), None


def scale(chunk_size, noop_flag, tensor_lists, factor):
    """Drop-in for ``local_multi_tensor_scale``: ``dst = src * factor`` for the pairs of ``tensor_lists``
    (in place when they are the same tensors: megatron's gradient clipping)."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)):
        if factor != 1.0:
            torch._foreach_mul_(dst, factor)
    elif factor == 1.0:  # a copy (fp16 main -> model parameters)
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor))


def install() -> int:
    """Replace megatron-core's local multi-tensor fallbacks (norm and scale) in its optimizer modules with
    :func:`l2_norm` and :func:`scale`. Returns how many slots were replaced (0 when TE or APEX provide the
    ops, or when done already)."""
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads, optimizer

    swaps = {"l2_norm_impl": (mutils.local_multi_tensor_l2_norm, l2_norm),
             "multi_tensor_scale_impl": (mutils.local_multi_tensor_scale, scale)}
    n = 0
    for module in (clip_grads, optimizer):
        for name, (fallback, ours) in swaps.items():
            if getattr(module, name, None) is fallback:
                setattr(module, name, ours)
                n += 1
    if n:
        log.info("megatron-core's multi-tensor fallbacks (no TE/APEX): %d replaced by torch foreach kernels", n)
    return n
