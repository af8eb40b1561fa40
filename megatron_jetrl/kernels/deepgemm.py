"""DeepGEMM's Hopper block-FP8 GEMM as an alternative to cuBLAS's for the ``scaled_mm`` backend.

The same operands as :func:`megatron_jetrl.precision.gemm.block_gemm` (``a`` in 1x128 groups, ``b`` in
128x128 blocks, fp32 scales), the same bytes: only the kernel that multiplies them differs. The kernels are
DeepGEMM's (fp32 promotion of the FP8 tensor-core partial sums every 128 of K, as cuBLAS's block-scaled kernels
do), as TensorRT-LLM ships them and FlashInfer vendors them, built by ``tools/build_deepgemm_sm90.py`` into one
library with a C entry point (``csrc/deepgemm_sm90.cu``) and loaded here with ctypes: no torch C++ ABI, no
tvm-ffi. Each (N, K, tile plan) not built ahead of time is JIT-compiled with nvcc on its first call (~1-2 s;
TensorRT-LLM's copy has its NVRTC path compiled out; cached on disk), so warm a shape up before capturing it in a
CUDA graph.

``JETRL_DEEPGEMM_DIR`` names the build's output directory; without it nothing here loads and the FP8 linear
uses cuBLAS. Kernels built ahead of time (``--precompile-preset``) are read from ``DIR/cache``; others are compiled
there with nvcc on first use, so ``DIR`` must be writable for them (``TRTLLM_DG_CACHE_DIR`` moves the cache, and
then the ahead-of-time kernels with it). A shape that cannot be built leaves that shape on cuBLAS
(``gemm.tune_kernels``).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from megatron_jetrl import env

LIB_NAME = "libjetrl_deepgemm_sm90.so"
ENV_DIR = env.DEEPGEMM_DIR


class DeepGemmUnavailable(RuntimeError):
    pass


def _preload_global(candidates: list[str], what: str) -> None:
    """Load the first loadable of ``candidates`` with RTLD_GLOBAL: the library leaves libcuda unlinked so that
    it resolves it against the process's own copy."""
    errors = []
    for c in candidates:
        try:
            ctypes.CDLL(c, mode=ctypes.RTLD_GLOBAL)
            return
        except OSError as e:
            errors.append(str(e))
    raise DeepGemmUnavailable(f"{what} not loadable ({'; '.join(errors[-2:]) or 'no candidate'})")


@functools.lru_cache(maxsize=None)
def _lib(directory: str) -> ctypes.CDLL:
    d = Path(directory)
    lib_path, include = d / LIB_NAME, d / "include"
    if not lib_path.is_file() or not (include / "deep_gemm").is_dir():
        raise DeepGemmUnavailable(f"{ENV_DIR}={directory} holds no {LIB_NAME} and include/deep_gemm; "
                                  "build it with tools/build_deepgemm_sm90.py --out DIR")
    # kernels built ahead of time (build_deepgemm_sm90.py --precompile*) are in DIR/cache; new ones JIT there
    env.set_default("TRTLLM_DG_CACHE_DIR", str(d))
    torch.cuda.init()  # the process's libcudart and libcuda first
    _preload_global(["libcuda.so.1"], "libcuda.so.1")
    lib = ctypes.CDLL(str(lib_path))
    lib.jetrl_dg_last_error.restype = ctypes.c_char_p
    lib.jetrl_dg_set_include_dir.argtypes = [ctypes.c_char_p]
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.jetrl_dg_gemm.argtypes = [p, i, p, i, p, i, i, i, i, p, p, p]
    if lib.jetrl_dg_set_include_dir(str(include).encode()):
        raise DeepGemmUnavailable(f"deepgemm include dir: {lib.jetrl_dg_last_error().decode()}")
    return lib


def available(device: torch.device) -> tuple[bool, str]:
    """(available, reason): a Hopper GPU (sm_90; DeepGEMM's kernels are wgmma-only) and a built library."""
    directory = env.deepgemm_dir()
    if not directory:
        return False, f"{ENV_DIR} is unset (build with tools/build_deepgemm_sm90.py)"
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, "device is not CUDA"
    cap = torch.cuda.get_device_capability(device.index or 0)
    if cap != (9, 0):
        return False, f"compute capability {cap[0]}.{cap[1]} is not 9.0 (DeepGEMM's SM90 kernels)"
    try:
        _lib(directory)
    except (DeepGemmUnavailable, OSError) as e:
        return False, str(e)
    return True, ""


def takes(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, group: int = 128) -> bool:
    """Whether :func:`gemm` runs these operands as they are: BF16 output, 128-groups, K a multiple of 128,
    N of 64 (the kernels' tile widths), row-major fp8 ``a`` and ``b`` (dgrad's ``W^T`` is made K-major first
    by the caller, as for cuBLAS)."""
    M, K = a.shape
    N = b.shape[0]
    return (out_dtype == torch.bfloat16 and group == 128 and K % 128 == 0 and N % 64 == 0 and M > 0
            and a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype == torch.float8_e4m3fn)


def gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor) -> torch.Tensor:
    """``(a * a_s) @ (b * b_s)^T`` in BF16; check :func:`takes` first. ``a_s`` [M, K/128] is read M-major
    with M padded to 4 (the kernel's TMA alignment): a column-major ``a_s`` with M % 4 == 0 is used in place,
    anything else copied once into that layout."""
    lib = _lib(env.deepgemm_dir())
    M, K = a.shape
    N = b.shape[0]
    kg = K // 128
    m4 = -(-M // 4) * 4
    if not (a_s.shape == (M, kg) and a_s.stride() == (1, m4) and m4 == M):
        sa = torch.empty((kg, m4), dtype=torch.float32, device=a.device)
        sa[:, :M] = a_s.t()
        a_s = sa
    b_s = b_s.contiguous()
    out = torch.empty((M, N), dtype=torch.bfloat16, device=a.device)
    stream = torch.cuda.current_stream(a.device).cuda_stream
    rc = lib.jetrl_dg_gemm(a.data_ptr(), K, b.data_ptr(), K, out.data_ptr(), N, M, N, K,
                           a_s.data_ptr(), b_s.data_ptr(), stream)
    if rc:
        raise RuntimeError(f"deepgemm GEMM {M}x{N}x{K} failed: {lib.jetrl_dg_last_error().decode()}")
    return out
