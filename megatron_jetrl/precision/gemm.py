"""Block-FP8 GEMM: ``out = (a * a_scale) @ (b * b_scale)^T``.

``a`` [M, Kc] fp8 in 1x128 groups along Kc (scale [M, ceil(Kc/128)]); ``b`` [Nout, Kc] fp8 in
128x128 blocks (scale [ceil(Nout/128), ceil(Kc/128)]); ``b`` may be a transposed view. All three
GEMMs of a linear layer take this form (see ``linear.py``):

    forward  y  = x  @ W^T : a = x  (groups along K),   b = W          (blocks)
    dgrad    dx = dy @ W   : a = dy (groups along N),   b = W^T (same blocks and bytes: no re-quantization)
    wgrad    dW = dy^T @ x : a = dy^T (groups along M), b = x^T in 128x128 blocks

torch's blockwise ``scaled_mm`` rejects 1x128 x 1x128, which is why wgrad re-blocks ``x``.

Backends:
- ``scaled_mm``: ``torch.nn.functional.scaled_mm`` BlockWise1x128 x BlockWise128x128 (cuBLAS,
  Hopper and newer, CUDA). Shapes listed by :func:`set_kernel` (the static decoder's tuning:
  :func:`tune_kernels`) run DeepGEMM's kernel instead (``kernels/deepgemm.py``; same operands), or, in
  inference forwards, the small-M Triton GEMM (``kernels/triton_gemm.py``; the FP8 linear routes those).
- ``emulated``: any device; the same fp8 values and scales, dequantized and multiplied in
  float32. The reference for the other backend.
"""
from __future__ import annotations

import functools
import logging

import torch

from megatron_jetrl.kernels.layout import col_major, contraction_multiple
from megatron_jetrl.precision.quant import dequantize_blocks

log = logging.getLogger(__name__)

BACKENDS = ("scaled_mm", "emulated")


class BackendUnavailable(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def scaled_mm_available(device_index: int = 0) -> tuple[bool, str]:
    """(available, reason)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if not hasattr(torch.nn.functional, "scaled_mm"):
        return False, f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (need >= 2.10)"
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 9:
        return False, f"compute capability {major}.{minor} < 9.0 (block-FP8 cuBLAS needs Hopper)"
    return True, ""


def resolve_backend(requested: str, device: torch.device) -> str:
    """``auto`` -> scaled_mm on a capable CUDA device, else emulated; a named backend that
    cannot run raises a one-line error."""
    if requested == "auto":
        if device.type == "cuda" and scaled_mm_available(device.index or 0)[0]:
            return "scaled_mm"
        return "emulated"
    if requested == "scaled_mm":
        ok, why = scaled_mm_available(device.index or 0) if device.type == "cuda" else (False, "device is CPU")
        if not ok:
            raise BackendUnavailable(f"precision.backend=scaled_mm is unavailable: {why}; "
                                     "use precision.backend=emulated or auto")
        return "scaled_mm"
    if requested == "emulated":
        return "emulated"
    raise BackendUnavailable(f"precision.backend={requested!r} is not an FP8 GEMM backend; "
                             f"use one of auto, {', '.join(BACKENDS)}")


def _emulated(a, a_s, b, b_s, out_dtype, group):
    a_deq = dequantize_blocks(a, a_s, 1, group)
    b_deq = dequantize_blocks(b, b_s, group, group)
    return (a_deq @ b_deq.t()).to(out_dtype)


def k_major(b: torch.Tensor) -> torch.Tensor:
    """A row-major copy of ``b`` (dgrad's ``W^T`` view): the tiled Triton transpose on CUDA when
    ``b`` is the transpose of a contiguous tensor (torch's strided fp8 copy was ~10x slower)."""
    if b.is_cuda and b.t().is_contiguous():
        from megatron_jetrl.kernels.triton_quant import transpose_bytes_triton

        return transpose_bytes_triton(b.t())
    return b.contiguous()


def wgrad_token_pad(tokens: int, backend: str, group: int = 128) -> int:
    """The multiple the weight-gradient operands' token (contraction) dimension is padded to, in the
    quantizers' own buffers (``quant.quantize_transposed(..., pad_to=)``): ``4 * group`` on ``scaled_mm`` when
    ``tokens`` is not one already (cuBLAS's block-scaled kernels take whole multiples of 4 groups: otherwise
    :func:`_scaled_mm` pads copies of both operands and the cuBLASLt accumulation into ``main_grad`` refuses
    them), else 0 (nothing to pad; the emulated backend takes any length)."""
    kq = contraction_multiple(group)
    return kq if backend == "scaled_mm" and tokens % kq else 0


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if t.shape == (rows, cols):
        return t
    out = torch.zeros((rows, cols), dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


KERNELS = ("cublas", "deepgemm", "small_m")
_KERNELS: dict[tuple[int, int, int], str] = {}
"""(M, N, K) -> the kernel the ``scaled_mm`` backend runs for that GEMM when it is not cuBLAS's: ``deepgemm``
(:func:`_scaled_mm` calls it), ``small_m`` (inference forwards only: the FP8 linear calls the small-M Triton GEMM
for these as for any call of at most ``precision.small_m_max`` rows)."""


def set_kernel(M: int, N: int, K: int, kernel: str) -> None:
    """Run the ``scaled_mm`` backend's (M, N, K) GEMMs on ``kernel``: ``cublas`` (the default), ``deepgemm`` or
    ``small_m``."""
    if kernel not in KERNELS:
        raise ValueError(f"FP8 GEMM kernel {kernel!r}: use one of {', '.join(KERNELS)}")
    if kernel == "cublas":
        _KERNELS.pop((M, N, K), None)
    else:
        _KERNELS[(M, N, K)] = kernel


def kernel_for(M: int, N: int, K: int) -> str:
    return _KERNELS.get((M, N, K), "cublas")


_TUNED: dict[tuple[int, int, int], dict] = {}
""":func:`tune_kernels`' record per (M, N, K) it timed: a GEMM is timed once per process, so every decoder of that row
count (the next rollout's, an eager one beside a captured one) runs the kernel the first one chose."""


def _graph_us(fn, reps: int = 20) -> float:
    """Median microseconds of one ``fn()`` replayed from a CUDA graph (warmed up eagerly on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    del g
    return sorted(times)[len(times) // 2]


def tune_kernels(M: int, weights: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]],
                 recipe=None, min_gain: float = 0.03) -> dict[str, dict]:
    """Per FP8 weight shape (N, K), time cuBLAS's GEMM on ``M`` rows against DeepGEMM's (where built and taking
    the shape) and, given the ``recipe``, the small-M Triton GEMM's (x pre-quantized with row-major scales, as the
    decoder's norm kernel writes them, its split-K partials summed), each over all of ``weights[(N, K)]`` (a
    model's layers: the weights stream from HBM as in a decode step) in one CUDA graph, and run the shape on the
    fastest from now on when it is more than ``min_gain`` faster than cuBLAS (:func:`set_kernel`). Same FP8 bytes
    and scales on every kernel; each rounds its fp32 sums to BF16 after adding them in its own order. CUDA only
    (elsewhere nothing is timed); a shape timed before at ``M`` rows in this process is not timed again: its record
    is returned and the table set from it (a kernel set by hand since then is replaced). Returns ``{"MxNxK":
    {"cublas_us", "deepgemm_us", "small_m_us", "kernel"}}`` per shape (microseconds per weight; a kernel not timed
    has no entry)."""
    from megatron_jetrl.kernels import deepgemm

    out: dict[str, dict] = {}
    for N, K in [nk for nk in weights if (M, *nk) in _TUNED]:
        set_kernel(M, N, K, _TUNED[(M, N, K)]["kernel"])
        out[f"{M}x{N}x{K}"] = _TUNED[(M, N, K)]
    weights = {nk: ws for nk, ws in weights.items() if (M, *nk) not in _TUNED}
    if not weights:
        return out
    dev = next(iter(weights.values()))[0][0].device
    with_dg = deepgemm.available(dev)[0]
    if dev.type != "cuda" or not (with_dg or recipe is not None):
        return out
    for (N, K), ws in weights.items():
        g = torch.Generator(device=dev).manual_seed(0)  # the operands' values do not matter; the global RNG stays
        xq = (torch.randn(M, K, device=dev, generator=g) * 100).to(torch.float8_e4m3fn)
        xs = (torch.rand(K // 128, M, device=dev, generator=g) + 0.5).t()  # column-major, as cuBLAS reads it
        run = lambda: [_scaled_mm(xq, xs, q, sc, torch.bfloat16, 128) for q, sc in ws]  # noqa: E731
        set_kernel(M, N, K, "cublas")
        times = {"cublas": _graph_us(run) / len(ws)}
        if with_dg and deepgemm.takes(xq, ws[0][0], torch.bfloat16):
            try:
                deepgemm.gemm(xq, xs, *ws[0])  # its first call may JIT-compile (nvcc): before any capture
                set_kernel(M, N, K, "deepgemm")
                times["deepgemm"] = _graph_us(run) / len(ws)
            except RuntimeError as e:  # e.g. no nvcc for a shape built on no machine ahead of time
                log.warning("DeepGEMM %dx%dx%d unavailable, not timed: %s", M, N, K, e)
            set_kernel(M, N, K, "cublas")
        if recipe is not None:
            from megatron_jetrl.kernels.triton_gemm import small_m_linear

            x = torch.empty(M, K, device=dev, dtype=torch.bfloat16)  # shape and output dtype only: xq is the operand
            pre = (xq, xs.contiguous())  # row-major scales, the small-M GEMM's layout
            times["small_m"] = _graph_us(lambda: [small_m_linear(x, q, sc, recipe, xq=pre) for q, sc in ws]) / len(ws)
        best = min(times, key=times.get)
        kernel = best if times[best] < (1 - min_gain) * times["cublas"] else "cublas"
        set_kernel(M, N, K, kernel)
        out[f"{M}x{N}x{K}"] = _TUNED[(M, N, K)] = {**{f"{k}_us": round(v, 2) for k, v in times.items()},
                                                    "kernel": kernel}
    return out


def _scaled_mm(a, a_s, b, b_s, out_dtype, group):
    from torch.nn.functional import ScalingType, scaled_mm

    M, Kc = a.shape
    N = b.shape[0]
    if _KERNELS and _KERNELS.get((M, N, Kc)) == "deepgemm":
        from megatron_jetrl.kernels import deepgemm

        if b.stride(1) != 1:
            b = k_major(b)
        if deepgemm.takes(a, b, out_dtype, group):
            return deepgemm.gemm(a, a_s, b, b_s)
    # cuBLAS (seen on the H200, torch 2.11): Kc a multiple of contraction_multiple(group), M and N
    # multiples of 16 (M=1 and M=77 fail with CUBLAS_STATUS_NOT_SUPPORTED). Zero-pad otherwise: zero
    # elements add nothing; padded groups get scale 1.
    kq = contraction_multiple(group)
    if Kc % kq or N % 16 or M % 16:
        Kp, Np, Mp = -(-Kc // kq) * kq, -(-N // 16) * 16, -(-M // 16) * 16
        a = _pad_to(a.view(torch.uint8), Mp, Kp).view(a.dtype)
        a_s = _pad_to(a_s, Mp, Kp // group)
        a_s[:, -(-Kc // group):] = 1.0
        b = _pad_to(b.contiguous().view(torch.uint8), Np, Kp).view(b.dtype)
        b_s = _pad_to(b_s, -(-Np // group), Kp // group)
        b_s[:, -(-Kc // group):] = 1.0
        return _scaled_mm(a, a_s, b, b_s, out_dtype, group)[:M, :N]
    # cuBLASLt multiplies a row-major mat1 by a column-major mat2 only: mat2 = b^T must be a view
    # of a row-major b. For dgrad (b = W^T, a view of the cached W) that is one byte-for-byte
    # transposed copy of the same FP8 blocks: no re-quantization, same bytes as the forward.
    if b.stride(1) != 1:
        b = k_major(b)
    return scaled_mm(a, b.t(), col_major(a_s), ScalingType.BlockWise1x128,
                     col_major(b_s.t()), ScalingType.BlockWise128x128, output_dtype=out_dtype)


def block_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
               backend: str, out_dtype: torch.dtype = torch.bfloat16, group: int = 128) -> torch.Tensor:
    """``(a * a_s) @ (b * b_s)^T`` with a in 1xG groups and b in GxG blocks (see module doc)."""
    if backend == "scaled_mm":
        return _scaled_mm(a, a_s, b, b_s, out_dtype, group)
    if backend == "emulated":
        return _emulated(a, a_s, b, b_s, out_dtype, group)
    raise BackendUnavailable(f"unknown FP8 GEMM backend {backend!r}; use one of {', '.join(BACKENDS)}")


def block_gemm_accumulate(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                          out: torch.Tensor, backend: str, group: int = 128) -> torch.Tensor:
    """``out += (a * a_s) @ (b * b_s)^T`` in fp32, in place: the product is never rounded to ``out``'s
    neighbours' BF16 (the weight-gradient GEMM into megatron's fp32 ``main_grad``). ``scaled_mm``: one
    cuBLASLt call with beta = 1 (``kernels/cublaslt.py``; check :func:`accumulate_supported` first);
    ``emulated``: the dequantized fp32 product added."""
    if backend == "scaled_mm":
        from megatron_jetrl.kernels.cublaslt import block_gemm_accumulate as lt_accumulate

        return lt_accumulate(a, a_s, b, b_s, out)
    if backend == "emulated":
        return out.add_(_emulated(a, a_s, b, b_s, torch.float32, group))
    raise BackendUnavailable(f"unknown FP8 GEMM backend {backend!r}; use one of {', '.join(BACKENDS)}")


def accumulate_supported(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, backend: str) -> bool:
    """Whether :func:`block_gemm_accumulate` takes these operands on this backend."""
    if backend == "emulated":
        return out.dtype == torch.float32 and out.shape == (a.shape[0], b.shape[0])
    if backend == "scaled_mm":
        from megatron_jetrl.kernels import cublaslt

        return cublaslt.available()[0] and cublaslt.shapes_ok(a, b, out)
    return False
