"""Block-FP8 GEMM that accumulates into an fp32 output, through cuBLASLt (ctypes; CUDA, Hopper+).

``out[M, N] += (a * a_scale) @ (b * b_scale)^T`` with ``a`` [M, Kc] in 1x128 groups along Kc and ``b``
[N, Kc] in 128x128 blocks: the FP8 weight-gradient GEMM written straight into megatron's fp32
``main_grad`` (beta = 1), which is what TransformerEngine's and APEX's gradient-accumulation fusion do.
torch's ``scaled_mm`` has no accumulate-into-output, so without this the wgrad is rounded to BF16, written,
and megatron's DDP hook adds it to ``main_grad`` in a separate pass (read 2 + 4 bytes, write 4 per element,
every micro-batch: 12% of jet's training step on an 8B-shaped slice, docs/benchmarks.md).

The call is the one torch makes for ``scaled_mm`` (``ATen/cuda/CUDABlas.cpp: scaled_gemm``: the row-major
product computed as its column-major transpose, cuBLASLt's "TN" form), with C = D = ``out`` and beta = 1:
cuBLASLt's A is ``b`` (scale mode BLK128x128_32F, scales [N/128, Kc/128] row-major), its B is ``a`` (VEC128_32F,
scales stored [Kc/128][M]: ``a_scale`` column-major). Same operands and scales as ``gemm.block_gemm``; only the
epilogue differs (fp32 ``out + acc`` instead of ``round_bf16(acc)``).

Used by ``linear._fp8_backward`` when a weight has a fp32 ``main_grad`` (megatron DDP) and
``precision.fuse_wgrad_accumulation`` is on; :func:`available` says why not where it cannot run (no
CUDA, no libcublasLt in the process, cuBLAS older than 12.9, shapes cuBLASLt rejects), and the FP8 linear then
keeps the unfused path. The enum values below are cuBLASLt's (cublasLt.h, CUDA 12.9+; checked against the
H200 image's CUDA 13.0 header).
"""
from __future__ import annotations

import ctypes
import functools
import threading

import torch

from megatron_jetrl.kernels.layout import col_major as _col_major, contraction_multiple

_OP_N, _OP_T = 0, 1
_COMPUTE_32F = 68
_R_32F, _R_16BF, _R_8F_E4M3 = 0, 14, 28
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_VEC128_32F, _SCALE_BLK128X128_32F = 4, 5
_PREF_MAX_WORKSPACE_BYTES = 1
_WORKSPACE = 32 << 20


class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _find_library() -> str | None:
    """The libcublasLt torch itself loaded (its own CUDA build's copy), from this process's maps."""
    for attempt in range(2):
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if "libcublasLt" in path:
                    return path
        if attempt == 0:  # cuBLAS(Lt) loads lazily: one tiny matmul brings it in
            torch.ones(16, 16, device="cuda", dtype=torch.bfloat16) @ torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
    return None


class _Lt:
    def __init__(self, path: str):
        lib = self.lib = ctypes.CDLL(path)
        vp, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        sig = {
            "cublasLtCreate": [ctypes.POINTER(vp)],
            "cublasLtGetVersion": [],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i32, i32],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i32, u64, u64, i64],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_Heuristic),
                                               ctypes.POINTER(i32)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
        }
        for name, args in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, (sz if name == "cublasLtGetVersion" else ctypes.c_int)
        self.version = int(lib.cublasLtGetVersion())
        self.handles: dict = {}
        self.workspaces: dict = {}
        self.plans: dict = {}
        self.lock = threading.Lock()

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLASLt {what} failed with status {status} (cuBLASLt {self.version})")

    def handle(self, dev: int):
        if dev not in self.handles:
            h = ctypes.c_void_p()
            self.check(self.lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
            self.handles[dev] = h
            self.workspaces[dev] = torch.empty(_WORKSPACE, dtype=torch.uint8, device=f"cuda:{dev}")
        return self.handles[dev]

    def _set(self, desc, attr: int, value) -> None:
        self.check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                   f"MatmulDescSetAttribute({attr})")

    def _layout(self, dtype: int, rows: int, cols: int, ld: int):
        lay = ctypes.c_void_p()
        self.check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, rows, cols, ld), "MatrixLayoutCreate")
        return lay

    def plan(self, dev: int, M: int, N: int, Kc: int, out_type: int, a_s, b_s):
        """(desc, A, B, C/D layouts, algo) for out[M, N] (row-major) += a[M, Kc] b[N, Kc]^T; kept per shape
        (descriptors are reused; only the scale pointers change per call, set under ``lock``). The scale
        pointers are set before the algorithm query, as torch's ``scaled_gemm`` does."""
        key = (dev, M, N, Kc, out_type)
        if key in self.plans:
            return self.plans[key]
        handle = self.handle(dev)
        desc = ctypes.c_void_p()
        self.check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "MatmulDescCreate")
        self._set(desc, _DESC_TRANSA, ctypes.c_int32(_OP_T))
        self._set(desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
        self._set(desc, _DESC_A_SCALE_MODE, ctypes.c_int32(_SCALE_BLK128X128_32F))
        self._set(desc, _DESC_B_SCALE_MODE, ctypes.c_int32(_SCALE_VEC128_32F))
        self._set(desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(b_s.data_ptr()))
        self._set(desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(a_s.data_ptr()))
        a_lay = self._layout(_R_8F_E4M3, Kc, N, Kc)   # b [N, Kc] row-major = column-major [Kc, N], used transposed
        b_lay = self._layout(_R_8F_E4M3, Kc, M, Kc)   # a [M, Kc] row-major = column-major [Kc, M]
        d_lay = self._layout(out_type, N, M, N)        # out [M, N] row-major = column-major [N, M]
        pref = ctypes.c_void_p()
        self.check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        ws = ctypes.c_uint64(_WORKSPACE)
        self.check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                                 ctypes.sizeof(ws)), "MatmulPreferenceSetAttribute")
        res, n = _Heuristic(), ctypes.c_int32(0)
        self.check(self.lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, a_lay, b_lay, d_lay, d_lay, pref, 1,
                                                           ctypes.byref(res), ctypes.byref(n)), "MatmulAlgoGetHeuristic")
        if n.value == 0:
            raise RuntimeError(f"cuBLASLt has no block-FP8 algorithm for [{M}, {Kc}] x [{N}, {Kc}]^T "
                               f"(cuBLASLt {self.version})")
        self.plans[key] = plan = (desc, a_lay, b_lay, d_lay, res)
        return plan

    def matmul(self, a, a_s, b, b_s, out, beta: float) -> None:
        dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
        M, Kc = a.shape
        N = b.shape[0]
        out_type = {torch.float32: _R_32F, torch.bfloat16: _R_16BF}[out.dtype]
        with self.lock:
            desc, a_lay, b_lay, d_lay, res = self.plan(dev, M, N, Kc, out_type, a_s, b_s)
            self._set(desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(b_s.data_ptr()))
            self._set(desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(a_s.data_ptr()))
            alpha, beta_ = ctypes.c_float(1.0), ctypes.c_float(beta)
            ws = self.workspaces[dev]
            self.check(self.lib.cublasLtMatmul(
                self.handles[dev], desc, ctypes.byref(alpha), ctypes.c_void_p(b.data_ptr()), a_lay,
                ctypes.c_void_p(a.data_ptr()), b_lay, ctypes.byref(beta_), ctypes.c_void_p(out.data_ptr()), d_lay,
                ctypes.c_void_p(out.data_ptr()), d_lay, ctypes.byref(res.algo), ctypes.c_void_p(ws.data_ptr()),
                _WORKSPACE, ctypes.c_void_p(torch.cuda.current_stream(out.device).cuda_stream)), "cublasLtMatmul")


@functools.lru_cache(maxsize=None)
def _lt() -> tuple[_Lt | None, str]:
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    if torch.cuda.get_device_capability()[0] < 9:
        return None, "block-FP8 cuBLASLt needs compute capability >= 9.0"
    path = _find_library()
    if path is None:
        return None, "libcublasLt is not loaded in this process"
    try:
        lt = _Lt(path)
    except (OSError, AttributeError) as e:
        return None, f"{path}: {e}"
    if lt.version < 120900:
        return None, f"cuBLASLt {lt.version} < 12.9 has no 1x128 / 128x128 block scaling"
    return lt, ""


def available() -> tuple[bool, str]:
    """(usable here, why not)."""
    lt, why = _lt()
    return lt is not None, why


def shapes_ok(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Operands the accumulate call takes as they are (anything else keeps the unfused path): whole 128-wide
    Kc groups in a multiple of 4 (cuBLASLt's scale tiling, as torch checks it), M and N multiples of 16,
    contiguous row-major FP8 operands and a contiguous fp32/bf16 output on one CUDA device."""
    M, Kc = a.shape
    N = b.shape[0]
    return (a.is_cuda and Kc % contraction_multiple() == 0 and M % 16 == 0 and N % 16 == 0 and b.shape[1] == Kc
            and a.is_contiguous() and b.is_contiguous() and out.is_contiguous() and out.shape == (M, N)
            and out.dtype in (torch.float32, torch.bfloat16) and a.device == b.device == out.device)


def block_gemm_accumulate(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                          out: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """``out = beta * out + (a * a_s) @ (b * b_s)^T`` in place (fp32 accumulate; see the module doc).
    ``a_s`` [M, Kc/128] (made column-major here), ``b_s`` [N/128, Kc/128] (made row-major)."""
    lt, why = _lt()
    if lt is None:
        raise RuntimeError(f"block_gemm_accumulate: cuBLASLt unavailable: {why}")
    if not shapes_ok(a, b, out):
        raise ValueError(f"block_gemm_accumulate: operands a {tuple(a.shape)} b {tuple(b.shape)} out "
                         f"{tuple(out.shape)} {out.dtype} are not in the form cuBLASLt takes (see shapes_ok)")
    lt.matmul(a, _col_major(a_s), b, b_s.contiguous(), out, beta)
    return out
