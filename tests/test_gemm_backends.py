"""The GEMM backends' dispatch: the per-shape kernel table, DeepGEMM's availability answers and its
ahead-of-time build plans."""
import pytest
import torch
from megatron_jetrl.precision.gemm import block_gemm
from megatron_jetrl.precision.quant import (quantize_act,
                                            quantize_weight)
from megatron_jetrl.precision.recipe import FP8Recipe

def test_gemm_kernel_table_and_deepgemm_availability(tmp_path, monkeypatch, kernel_table):
    """The per-shape kernel table (cuBLAS unless a shape is set to DeepGEMM or the small-M GEMM), its validation,
    the FP8 linears' small-M rule (up to ``small_m_max`` rows, and the shapes the table gives it), and DeepGEMM's
    availability answers: unset directory, a directory without the build, not CUDA; tuning on CPU times and sets
    nothing but the kernels of shapes it recorded before. (``kernel_table`` restores the table.)"""
    from megatron_jetrl.kernels import deepgemm
    from megatron_jetrl.precision.linear import FP8ModelState

    gemm = kernel_table
    assert gemm.kernel_for(256, 4096, 4096) == "cublas"
    gemm.set_kernel(256, 4096, 4096, "deepgemm")
    assert gemm.kernel_for(256, 4096, 4096) == "deepgemm" and gemm.kernel_for(255, 4096, 4096) == "cublas"
    gemm.set_kernel(256, 4096, 4096, "cublas")
    assert (256, 4096, 4096) not in gemm._KERNELS
    with pytest.raises(ValueError, match="use one of cublas, deepgemm, small_m"):
        gemm.set_kernel(1, 2, 3, "cutlass")
    state = FP8ModelState(FP8Recipe())
    assert state.small_m(64, 4096, 4096) and not state.small_m(88, 4096, 4096)
    gemm.set_kernel(88, 4096, 4096, "small_m")
    assert state.small_m(88, 4096, 4096) and not state.small_m(88, 4096, 14336) and not state.small_m(96, 4096, 4096)
    state.small_m_max = 0
    assert state.small_m(88, 4096, 4096) and not state.small_m(64, 4096, 4096)
    # a table entry never reaches the emulated backend: the same result as without it
    recipe = FP8Recipe()
    xq, xs = quantize_act(torch.randn(8, 256), recipe)
    qw, sw = quantize_weight(torch.randn(128, 256), recipe)
    ref = block_gemm(xq, xs, qw, sw, "emulated")
    gemm.set_kernel(8, 128, 256, "deepgemm")
    assert torch.equal(block_gemm(xq, xs, qw, sw, "emulated"), ref)
    before = dict(gemm._KERNELS)
    for recipe_arg in (None, recipe):  # CPU: nothing timed, nothing set, with or without the small-M candidate
        assert gemm.tune_kernels(8, {(128, 256): [(qw, sw)]}, recipe_arg) == {} and gemm._KERNELS == before
    # a shape timed before at these rows is not timed again: its record comes back and the table is set from it,
    # over the kernel set by hand above (the record stands in for a GPU's timing); an unrecorded shape is left alone
    assert gemm.kernel_for(8, 128, 256) == "deepgemm"
    gemm._TUNED[(8, 128, 256)] = record = {"cublas_us": 9.0, "small_m_us": 6.0, "kernel": "small_m"}
    got = gemm.tune_kernels(8, {(128, 256): [(qw, sw)], (256, 128): [(qw.t().contiguous(), sw.t().contiguous())]}, recipe)
    assert got == {"8x128x256": record} and got["8x128x256"] is record and gemm.kernel_for(8, 128, 256) == "small_m"
    assert gemm.kernel_for(8, 256, 128) == "cublas"
    monkeypatch.delenv(deepgemm.ENV_DIR, raising=False)
    ok, why = deepgemm.available(torch.device("cpu"))
    assert not ok and "JETRL_DEEPGEMM_DIR is unset" in why and "build_deepgemm_sm90.py" in why
    monkeypatch.setenv(deepgemm.ENV_DIR, str(tmp_path))
    assert deepgemm.available(torch.device("cpu")) == (False, "device is not CUDA")
    with pytest.raises(deepgemm.DeepGemmUnavailable, match="holds no libjetrl_deepgemm_sm90.so"):
        deepgemm._lib(str(tmp_path))
    a = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    assert deepgemm.takes(a, torch.zeros(1024, 512, dtype=torch.float8_e4m3fn), torch.bfloat16)
    assert not deepgemm.takes(a, torch.zeros(1000, 512, dtype=torch.float8_e4m3fn), torch.bfloat16)  # N % 64
    assert not deepgemm.takes(a, torch.zeros(1024, 512, dtype=torch.float8_e4m3fn), torch.float32)
    assert not deepgemm.takes(a[:, :384], torch.zeros(1024, 384, dtype=torch.float8_e4m3fn), torch.bfloat16)


def test_deepgemm_build_plans_every_gemm_of_a_preset():
    """The build script's ahead-of-time shape list: every decode row count for each linear, and at every
    training micro-batch the forward, dgrad and wgrad forms; bad input names the flag."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "build_deepgemm_sm90.py"
    spec = importlib.util.spec_from_file_location("build_deepgemm_sm90", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    shapes = set(mod.preset_shapes(["llama3.1-8b"], decode_m=[64, 256], tokens=[8192]))
    for n, k in mod.PRESET_LINEARS["llama3.1-8b"]:
        assert {(64, n, k), (256, n, k), (8192, n, k), (8192, k, n), (n, k, 8192)} <= shapes
    assert len(shapes) == len(set(shapes))
    with pytest.raises(SystemExit, match="unknown 'llama9'"):
        mod.preset_shapes(["llama9"])
    with pytest.raises(SystemExit, match="--precompile: 'x' is not M:N:K"):
        mod.main(["--skip-library", "--out", "/nonexistent", "--precompile", "x", "--nvcc", "sh"])
    with pytest.raises(SystemExit, match="--skip-library: no /nonexistent/libjetrl_deepgemm_sm90.so"):
        mod.main(["--skip-library", "--out", "/nonexistent", "--precompile", "1:128:128", "--nvcc", "sh"])
    with pytest.raises(SystemExit, match="--flashinfer: required"):
        mod.main(["--out", "/nonexistent", "--nvcc", "sh"])
    with pytest.raises(SystemExit, match="--nvcc: no-such-nvcc not found"):
        mod.main(["--out", "/nonexistent", "--nvcc", "no-such-nvcc"])
