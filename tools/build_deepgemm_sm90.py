"""Build ``libjetrl_deepgemm_sm90.so``: the Hopper block-FP8 GEMM (DeepGEMM's 1x128 x 128x128 kernels, as
TensorRT-LLM ships them and FlashInfer vendors them) behind a C-ABI entry point
(``megatron_jetrl/kernels/csrc/deepgemm_sm90.cu``), for ``precision.fp8_gemm=deepgemm``.

The kernel sources are not in this repository: they are read from a flashinfer-python wheel or an installed
``flashinfer`` package (SGLang's Hopper images carry one). Needs ``nvcc`` >= 12.8 (no GPU: it builds anywhere)
and the headers ``nvrtc.h`` and ``cublasLt.h`` (a full CUDA toolkit, or the pip wheels ``nvidia-cuda-nvrtc`` and
``nvidia-cublas``: ``--cuda-headers WHEEL``).

    python3 tools/build_deepgemm_sm90.py --flashinfer WHEEL_OR_PACKAGE_DIR --out DIR [--cuda-headers WHEEL ...]

``DIR`` gets the library and ``include/deep_gemm/*.cuh``, which the library JIT-compiles with nvcc at run time
(one kernel per (N, K, tile plan), cached under ``$TRTLLM_DG_CACHE_DIR``, default ``~/.tensorrt_llm``). Point
``JETRL_DEEPGEMM_DIR`` at ``DIR`` to use it.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BINDING = REPO / "megatron_jetrl" / "kernels" / "csrc" / "deepgemm_sm90.cu"
LIB_NAME = "libjetrl_deepgemm_sm90.so"

TRT = "nv_internal/tensorrt_llm"
SOURCES = [
    f"{TRT}/kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm.cu",
    "nv_internal/cpp/common/envUtils.cpp",
    "nv_internal/cpp/common/logger.cpp",
    "nv_internal/cpp/common/stringUtils.cpp",
    "nv_internal/cpp/common/tllmException.cpp",
]
# what the sources include (flashinfer's own JIT spec for this module: jit/gemm/fp8_blockscale.py)
INCLUDES = ["nv_internal", "nv_internal/include", f"{TRT}/cutlass_extensions/include",
            f"{TRT}/kernels/cutlass_kernels/include", f"{TRT}/kernels/cutlass_kernels"]
DEFINES = ["-DCOMPILE_HOPPER_TMA_GEMMS", "-DENABLE_BF16", "-DENABLE_FP8", "-DENABLE_FP8_BLOCK_SCALE",
           "-DCUTLASS_ENABLE_GDC_FOR_SM90=1", "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED", "-DNDEBUG"]


def _unpack(wheel: Path, prefix: str, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith(prefix)]
        if not names:
            sys.exit(f"--flashinfer: {wheel} holds no {prefix}; pass a flashinfer-python wheel or package dir")
        z.extractall(dest, names)
    return dest / prefix


def flashinfer_data(arg: str, tmp: Path) -> Path:
    p = Path(arg)
    if p.is_file() and p.suffix == ".whl":
        return _unpack(p, "flashinfer/data/", tmp)
    for cand in (p / "data", p / "flashinfer" / "data", p):
        if (cand / "csrc" / TRT).is_dir():
            return cand
    sys.exit(f"--flashinfer: no csrc/{TRT} under {p}; pass a flashinfer-python wheel or its package dir")


def cuda_headers(args: list[str], tmp: Path) -> list[str]:
    """-I flags for CUDA headers the toolkit may lack (nvrtc.h, cublasLt.h): the ``include`` of each pip
    CUDA wheel (``nvidia-cuda-nvrtc``, ``nvidia-cublas``) or directory given."""
    flags = []
    for n, arg in enumerate(args):
        p = Path(arg)
        if p.is_file() and p.suffix == ".whl":
            with zipfile.ZipFile(p) as z:
                names = [x for x in z.namelist() if "/include/" in x]
                z.extractall(tmp / f"hdr{n}", names)
            p = tmp / f"hdr{n}"
        found = sorted({h.parent for h in p.rglob("*.h") if h.parent.name == "include"})
        if not found:
            sys.exit(f"--cuda-headers: no include/*.h under {arg}")
        flags += [f"-I{d}" for d in found]
    return flags


# (N, K) of each FP8 linear of a preset's layer: fused QKV, attention output, fused gate/up (fc1), fc2
PRESET_LINEARS = {"llama3.1-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
                  "llama3.1-70b": [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)]}
# the decode rows a rollout batch runs (the static decoder's batch) and the training micro-batch token counts
DECODE_M = [1, 16, 64, 128, 256, 512]
TRAIN_TOKENS = [4096, 8192]
JIT_FLAGS = ["-std=c++17", "--gpu-architecture=sm_90a", "--ptxas-options=-allow-expensive-optimizations=true",
             "--ptxas-options=--register-usage-level=10", "--diag-suppress=161,174,177,940",
             "-D__FORCE_INCLUDE_CUDA_FP16_HPP_FROM_FP16_H__=1", "-D__FORCE_INCLUDE_CUDA_BF16_HPP_FROM_BF16_H__=1",
             "-O3", "-cubin", "--expt-relaxed-constexpr", "--expt-extended-lambda",
             "--compiler-options=-fPIC,-O3,-Wno-deprecated-declarations,-Wno-abi"]


def preset_shapes(names: list[str], decode_m=DECODE_M, tokens=TRAIN_TOKENS) -> list[tuple[int, int, int]]:
    """(M, N, K) of every GEMM a preset's FP8 linears run: decode forwards at ``decode_m`` rows; at each
    training micro-batch of ``tokens`` the forward (tokens, N, K), dgrad (tokens, K, N) and wgrad (N, K, tokens)."""
    out = set()
    for name in names:
        if name not in PRESET_LINEARS:
            sys.exit(f"--precompile-preset: unknown {name!r}; use one of {', '.join(PRESET_LINEARS)}")
        for n, k in PRESET_LINEARS[name]:
            out.update((m, n, k) for m in decode_m)
            for t in tokens:
                out.update({(t, n, k), (t, k, n), (n, k, t)})
    return sorted(out)


def precompile(lib: Path, shapes: list[tuple[int, int, int]], nvcc: str, jobs: int, num_sms: int) -> int:
    """Build the cubins the library would JIT on first use for ``shapes`` into ``lib.parent/cache`` (the loader
    points ``TRTLLM_DG_CACHE_DIR`` there), with the library's own tile-plan choice and naming
    (``jetrl_dg_kernel_plan``) and its JIT's nvcc flags. No GPU needed. Returns the number of kernels built."""
    import ctypes

    for dep in ("libcudart.so.13", "/usr/local/cuda/lib64/libcudart.so.13"):
        try:
            ctypes.CDLL(dep, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError:
            continue
    so = ctypes.CDLL(str(lib), mode=os.RTLD_LAZY)  # libcuda's symbols stay unresolved: never called here
    so.jetrl_dg_kernel_plan.restype = ctypes.c_int
    plans = {}
    for m, n, k in shapes:
        name, code = ctypes.create_string_buffer(512), ctypes.create_string_buffer(1 << 16)
        if so.jetrl_dg_kernel_plan(m, n, k, num_sms, name, 512, code, 1 << 16) < 0:
            sys.exit(f"kernel plan for {m}x{n}x{k} failed")
        plans[name.value.decode()] = code.value.decode()
    cache = lib.parent / "cache"
    todo = [(nm, c) for nm, c in plans.items() if not (cache / nm / "nvcc_kernel.cubin").is_file()]

    def build(item):
        nm, c = item
        with tempfile.TemporaryDirectory() as td:
            src, cubin = Path(td) / "kernel.cu", Path(td) / "nvcc_kernel.cubin"
            src.write_text(c)
            r = subprocess.run([nvcc, str(src), "-o", str(cubin), *JIT_FLAGS, f"-I{lib.parent / 'include'}"],
                               capture_output=True, text=True)
            if r.returncode:
                return f"{nm}: {r.stdout}{r.stderr}"
            (cache / nm).mkdir(parents=True, exist_ok=True)
            os.replace(cubin, cache / nm / "nvcc_kernel.cubin")
        return None

    with cf.ThreadPoolExecutor(max(1, jobs)) as ex:
        for err in ex.map(build, todo):
            if err:
                sys.exit(f"precompile failed: {err}")
    return len(todo)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flashinfer", default=None, help="flashinfer-python wheel, or the installed package dir")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--cuda-headers", action="append", default=[],
                    help="a CUDA wheel or dir whose include/ the toolkit lacks (nvrtc.h, cublasLt.h); repeatable")
    ap.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--precompile-preset", action="append", default=[],
                    help=f"build the kernels of a preset's FP8 linears ahead of time ({', '.join(PRESET_LINEARS)})")
    ap.add_argument("--precompile", default="", help="more M:N:K shapes to build ahead of time, comma-separated")
    ap.add_argument("--num-sms", type=int, default=132, help="the target GPU's SM count (H100/H200 SXM: 132)")
    ap.add_argument("--skip-library", action="store_true", help="only precompile, with the library in --out")
    a = ap.parse_args(argv)
    if shutil.which(a.nvcc) is None:
        sys.exit(f"--nvcc: {a.nvcc} not found; install the CUDA toolkit (>= 12.8) or pass --nvcc PATH")
    shapes = preset_shapes(a.precompile_preset) if a.precompile_preset else []
    for item in filter(None, a.precompile.split(",")):
        try:
            m, n, k = (int(v) for v in item.split(":"))
        except ValueError:
            sys.exit(f"--precompile: {item!r} is not M:N:K")
        shapes.append((m, n, k))
    lib = a.out / LIB_NAME
    t0 = time.time()
    if a.skip_library and not lib.is_file():
        sys.exit(f"--skip-library: no {lib}; build it first (without --skip-library)")
    if not a.skip_library:
        if a.flashinfer is None:
            sys.exit("--flashinfer: required to build the library (a flashinfer-python wheel or package dir)")
        build_library(a, lib)
        print(f"built {lib} ({lib.stat().st_size / 1e6:.1f} MB) in {time.time() - t0:.0f} s", flush=True)
    # the JIT's scratch and cache directories exist up front: a DIR made read-only after the build still serves
    # the kernels built ahead of time (the library creates both on first use)
    for sub in ("tmp", "cache"):
        (a.out / sub).mkdir(parents=True, exist_ok=True)
    if shapes:
        t1 = time.time()
        built = precompile(lib, shapes, a.nvcc, a.jobs, a.num_sms)
        print(f"precompiled {built} kernels for {len(shapes)} shapes into {a.out / 'cache'} in "
              f"{time.time() - t1:.0f} s", flush=True)
    return 0


def build_library(a, lib: Path) -> None:
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        data = flashinfer_data(a.flashinfer, tmp)
        csrc = data / "csrc"
        inc = [f"-I{csrc / d}" for d in INCLUDES] + [f"-I{data / 'include'}", f"-I{data / 'cutlass' / 'include'}",
                                                     f"-I{data / 'cutlass' / 'tools' / 'util' / 'include'}"]
        inc += cuda_headers(a.cuda_headers, tmp)
        flags = ["-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
                 "--compiler-options=-fPIC", "-static-global-template-stub=false", *DEFINES, *inc]
        objs, jobs = [], []
        for src in [BINDING] + [csrc / s for s in SOURCES]:
            obj = tmp / (src.name + ".o")
            objs.append(obj)
            jobs.append([a.nvcc, *flags, "-c", str(src), "-o", str(obj)])
        with cf.ThreadPoolExecutor(max(1, a.jobs)) as ex:
            for cmd, r in zip(jobs, ex.map(lambda c: subprocess.run(c, capture_output=True, text=True), jobs)):
                if r.returncode:
                    sys.stderr.write(r.stdout + r.stderr)
                    sys.exit(f"build failed: {' '.join(cmd[-3:])}")
        a.out.mkdir(parents=True, exist_ok=True)
        # libcuda stays unlinked: the loader (kernels/deepgemm.py) loads the process's own copy globally
        # first, so the library works wherever torch's CUDA does (its JIT calls nvcc, not libnvrtc)
        r = subprocess.run([a.nvcc, "-shared", "-gencode=arch=compute_90a,code=sm_90a", *map(str, objs),
                            "-lcudart", "-o", str(lib) + ".tmp"], capture_output=True, text=True)
        if r.returncode:
            sys.stderr.write(r.stdout + r.stderr)
            sys.exit("link failed")
        os.replace(str(lib) + ".tmp", lib)
        dst = a.out / "include" / "deep_gemm"
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(csrc / TRT / "deep_gemm", dst)


if __name__ == "__main__":
    sys.exit(main())
