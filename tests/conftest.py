import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: multi-process or long CPU test")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def megatron_single():
    """megatron-core initialized in this process at world size 1 (gloo, CPU shim)."""
    from megatron_jetrl.config import ParallelConfig
    from megatron_jetrl.distributed import init_distributed

    init_distributed(ParallelConfig())
    yield
