// A C-ABI entry point to the block-FP8 GEMM that TensorRT-LLM ships for Hopper and FlashInfer vendors
// (flashinfer/data/csrc/nv_internal/tensorrt_llm: DeepGEMM's 1x128 x 128x128 kernels, JIT-compiled per
// (N, K, tile plan) with nvcc on first use: this copy's NVRTC path is compiled out). Built by tools/build_deepgemm_sm90.py against an installed or
// unpacked flashinfer-python; loaded with ctypes by megatron_jetrl/precision/deepgemm.py, so it depends on
// neither torch's C++ ABI nor tvm-ffi. Errors come back as a nonzero return and jetrl_dg_last_error().
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include "tensorrt_llm/deep_gemm/compiler.cuh"
#include "tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm.h"

namespace fbg = tensorrt_llm::kernels::fp8_blockscale_gemm;

namespace {
thread_local std::string last_error;

fbg::CutlassFp8BlockScaleGemmRunner<__nv_fp8_e4m3, __nv_fp8_e4m3, __nv_bfloat16>& runner() {
  static fbg::CutlassFp8BlockScaleGemmRunner<__nv_fp8_e4m3, __nv_fp8_e4m3, __nv_bfloat16> r;
  return r;
}

// Runs `body` (returning the entry point's result); a C++ exception becomes `failed` and last_error.
template <typename Body>
int guarded(int failed, Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown C++ exception";
  }
  return failed;
}
}  // namespace

extern "C" {

const char* jetrl_dg_last_error() { return last_error.c_str(); }

// The directory holding deep_gemm/*.cuh (…/nv_internal/tensorrt_llm): without it the runner falls back to
// TensorRT-LLM's precompiled (non-DeepGEMM) Hopper kernel.
int jetrl_dg_set_include_dir(const char* dir) {
  return guarded(1, [&] {
    deep_gemm::jit::Compiler::setIncludeDirs({std::filesystem::path(dir)});
    return 0;
  });
}

// d[m, n] (bf16, leading dim ldd) = (a * sa) @ (b * sb)^T with a [m, k] fp8 e4m3 row-major (lda), its
// scales sa fp32 [k/128][m padded to 4] (1x128 groups, M-major); b [n, k] fp8 row-major (ldb), scales sb
// fp32 [ceil(n/128)][k/128] row-major (128x128 blocks). Enqueued on `stream`, no host sync.
int jetrl_dg_gemm(const void* a, int lda, const void* b, int ldb, void* d, int ldd, int m, int n, int k,
                  const float* sa, const float* sb, void* stream) {
  return guarded(1, [&] {
    runner().gemm(static_cast<const __nv_fp8_e4m3*>(a), lda, static_cast<const __nv_fp8_e4m3*>(b), ldb,
                  static_cast<__nv_bfloat16*>(d), ldd, m, n, k, sa, sb, static_cast<cudaStream_t>(stream));
    cudaError_t err = cudaPeekAtLastError();
    if (err != cudaSuccess) {
      last_error = std::string("CUDA error after the launch: ") + cudaGetErrorString(err);
      return 2;
    }
    return 0;
  });
}

// The kernel the GEMM above would JIT-compile for (m, n, k) on a GPU with `num_sms` SMs, without a GPU: its cache
// directory name (the one Compiler::build looks up under $TRTLLM_DG_CACHE_DIR/cache) and its source, so that
// tools/build_deepgemm_sm90.py --precompile can build the cubins ahead of time. Mirrors gemm_dispatch's choice
// (swapped operands below 32 rows) and Compiler::build's naming; returns the bytes needed (truncates at `cap`).
int jetrl_dg_kernel_plan(int m, int n, int k, int num_sms, char* name, int name_cap, char* code, int code_cap) {
  return guarded(-1, [&] {
    bool swap = m < 32;
    auto cfg = swap ? deep_gemm::jit::get_best_gemm_config(n, m, k, 1, num_sms, false, true)
                    : deep_gemm::jit::get_best_gemm_config(m, n, k, 1, num_sms);
    auto [block_m, block_n, stages, multicast, smem] = cfg;
    (void)smem;
    constexpr uint32_t block_k = 128, groups = 1;
    auto type = deep_gemm::GemmType::Normal;
    std::string s = std::string(swap ? "gemm_swapAB_" : "gemm_") + std::to_string(n) + "_" + std::to_string(k) +
                    "_" + std::to_string(block_m) + "_" + std::to_string(block_n) + "_" + std::to_string(block_k) +
                    "_" + std::to_string(groups) + "_" + std::to_string(stages) + std::to_string(groups) + "_" +
                    std::to_string(stages) + "_" + std::to_string(multicast) + "_" +
                    deep_gemm::jit::gemm_type_to_string(type);
    std::string c = deep_gemm::jit::generateKernel(n, k, block_m, block_n, block_k, groups, stages, multicast,
                                                   type, swap);
    snprintf(name, name_cap, "%s", s.c_str());
    snprintf(code, code_cap, "%s", c.c_str());
    return static_cast<int>(std::max(s.size(), c.size()) + 1);
  });
}

}  // extern "C"
