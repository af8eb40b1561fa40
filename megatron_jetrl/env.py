"""The process environment: the one module of the package that reads ``os.environ``.

Settings are typed config (``megatron_jetrl/config.py``); the environment carries only
- our two variables, a secret and a path: ``JETRL_ADMIN_API_KEY`` (the admin key of ``jetrl serve``, of the
  SGLang servers ``jetrl launch`` starts and of the trainer's requests to them; one value on every node) and
  ``JETRL_DEEPGEMM_DIR`` (a DeepGEMM build, ``tools/build_deepgemm_sm90.py``);
- what other programs set for us: the launcher's rank variables (torchrun, Slurm) and Triton's
  ``TRITON_INTERPRET`` (the CPU tests run our kernels under its interpreter);
- what we hand to libraries that read their own variables (TransformerEngine's numerics switches, DeepGEMM's
  cache directory) and to child processes.
"""
from __future__ import annotations

import functools
import os

ADMIN_API_KEY = "JETRL_ADMIN_API_KEY"
DEEPGEMM_DIR = "JETRL_DEEPGEMM_DIR"


def admin_api_key() -> str | None:
    return os.environ.get(ADMIN_API_KEY) or None


def deepgemm_dir() -> str | None:
    return os.environ.get(DEEPGEMM_DIR) or None


@functools.lru_cache(maxsize=None)
def triton_interpreted() -> bool:
    """Triton kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by the tests). Read once:
    the kernels ask on every launch, and Triton fixes its own choice when a kernel is defined."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def launched() -> bool:
    """The process was started by torchrun or Slurm's env:// launcher (``RANK`` is set)."""
    return "RANK" in os.environ


def launcher_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def snapshot() -> dict[str, str]:
    """A copy of the environment (for a child process, or for checks of library variables)."""
    return dict(os.environ)


def set_default(name: str, value: str) -> None:
    """Set a library's own variable unless the user already set it (read by that library, not by us)."""
    os.environ.setdefault(name, value)
