"""Importing SGLang 0.5.23's own Python code on a CPU machine (its pure-Python parts are installed with
``--no-deps`` by tools/setup_env.sh, plus the small packages its import chain needs).

What cannot import here, and what stands in:
- ``torchvision``: ``sglang.srt.configs`` imports it at import time for vision-model configs
  (``multimodal/internvl_utils.py``, ``configs/deepseek_ocr.py``). torchvision's PyPI wheels are CUDA
  builds that do not load beside the CPU torch, so an empty stub module stands in for it. transformers is
  imported first, so it still sees torchvision as absent. No code path the tests run touches it.
- ``sgl_kernel`` (SGLang's CUDA/CPU C++ kernels): not installed. The seeded sampler's CPU branch of
  ``murmur_hash32`` calls it, so the tests run the kernel's Triton source (its GPU branch) under
  ``TRITON_INTERPRET=1`` instead.
- The model runner, attention backends, CUDA graphs, memory saver: need CUDA. The tests drive SGLang's
  ``SchedulerWeightUpdaterManager`` (the scheduler's weight-update and memory state machine) with stub
  runners and a stub memory saver in their place.
"""
from __future__ import annotations

import importlib.machinery
import sys
import types


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        mod = _Stub(f"{self.__name__}.{name}")
        setattr(self, name, mod)
        return mod

    def __call__(self, *args, **kwargs):
        return self


class _TorchvisionStub:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Stub(spec.name)

    def exec_module(self, module):
        pass


def install_torchvision_stub() -> None:
    import transformers.utils.import_utils  # noqa: F401 - decides "no torchvision" before the stub exists

    try:
        import torchvision  # noqa: F401
        return  # a real one imports: use it
    except Exception:  # noqa: BLE001
        sys.modules.pop("torchvision", None)
    if not any(isinstance(f, _TorchvisionStub) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionStub())


def sglang_srt():
    """``sglang.srt`` with io_struct, the weight-updater manager and the weight checker imported
    (tools/setup_env.sh installs SGLang and what its import chain needs)."""
    install_torchvision_stub()
    import sglang.srt.managers.io_struct  # noqa: F401
    import sglang.srt.managers.scheduler_components.weight_updater  # noqa: F401
    import sglang.srt.utils.weight_checker  # noqa: F401

    return sys.modules["sglang.srt"]
