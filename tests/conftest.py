import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The kind of each test file (markers registered in pyproject.toml; ``pytest -m unit``, ``-m e2e``, ``-m gpu``):
# unit: one module or kernel in process; e2e: whole training runs, servers, several processes; gpu: CUDA only.
KIND = {
    "test_quant.py": "unit", "test_fp8_linear.py": "unit", "test_kernels_interpreter.py": "unit",
    "test_grad_accum.py": "unit", "test_gemm_backends.py": "unit",
    "test_fp8_model.py": "unit", "test_loss.py": "unit", "test_config.py": "unit",
    "test_models.py": "unit", "test_rewards_data.py": "unit", "test_sync.py": "unit", "test_partial_fp8.py": "unit",
    "test_architecture.py": "unit", "test_sglang_contract.py": "unit", "test_kernels_compiled.py": "unit",
    "test_rl.py": "e2e", "test_fleet.py": "e2e", "test_chat_eval.py": "e2e", "test_reliability.py": "e2e",
    "test_convert.py": "e2e", "test_launch.py": "e2e", "test_bench.py": "e2e",
    "test_gpu_quant.py": "gpu", "test_gpu_gemm.py": "gpu", "test_gpu_decode.py": "gpu", "test_gpu_model.py": "gpu",
    "test_gpu_exact.py": "gpu",
}


def pytest_collection_modifyitems(config, items):
    import torch

    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        kind = KIND.get(item.path.name)
        if kind is None:
            raise pytest.UsageError(f"{item.path.name}: not in tests/conftest.py's KIND table; add it as unit, e2e or gpu")
        if kind not in item.keywords:
            item.add_marker(getattr(pytest.mark, kind))
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def megatron_single():
    """megatron-core initialized in this process at world size 1 (gloo, CPU shim)."""
    from megatron_jetrl.config import ParallelConfig
    from megatron_jetrl.distributed import init_distributed

    init_distributed(ParallelConfig())
    yield


@pytest.fixture(autouse=True)
def kernel_table():
    """Every test leaves gemm's per-shape kernel table and tuning record (a static decoder on CUDA tunes its GEMMs
    above ``small_m_max`` rows) as it found them; a test that sets the table asks for this fixture by name."""
    from megatron_jetrl.precision import gemm

    saved, tuned = dict(gemm._KERNELS), dict(gemm._TUNED)
    yield gemm
    for table, was in ((gemm._KERNELS, saved), (gemm._TUNED, tuned)):
        table.clear()
        table.update(was)
