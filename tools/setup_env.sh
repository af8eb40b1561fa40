#!/usr/bin/env bash
# Create (or reuse) a virtual environment with everything the CPU run and the tests need.
#   bash tools/setup_env.sh [VENV_DIR]     (default .venv)
# torch is pinned to the 2.13.0 CPU build (an unpinned torch pulls a multi-GB CUDA build);
# megatron-core 0.19.2 declares Python >= 3.12 but builds and runs on 3.11: numpy first, then
# --no-deps --ignore-requires-python; it also needs triton and psutil (undeclared).
set -euo pipefail
VENV=${1:-.venv}
cd "$(dirname "$0")/.."
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q --upgrade pip 2>&1 | grep -v -i warning || true
pip install -q "torch==2.13.0" "numpy==2.4.6" "packaging>=24.2" psutil triton 2>&1 | grep -v -i warning || true
python -c "import megatron.core" 2>/dev/null || \
  pip install -q --no-deps --ignore-requires-python "megatron-core==0.19.2" 2>&1 | grep -v -i warning || true
pip install -q -e ".[test]" 2>&1 | grep -v -i warning || true
# SGLang's pure-Python parts (weight-sync bucket class, request types) for the CPU tests: no deps,
# so its CUDA kernels and its torch pin stay out of this environment.
python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)" 2>/dev/null || \
  pip install -q --no-deps "sglang==0.5.23" 2>&1 | grep -v -i warning || true
# What sglang.srt.server_args needs to import (the launch-argument test parses our arguments with
# SGLang's own ServerArgs); all pure Python or small wheels, none of them pulls torch.
pip install -q orjson msgspec pybase64 requests starlette pyzmq aiohttp pillow ipython 2>&1 | grep -v -i warning || true
# sglang-router (a Rust binary in a 30 MB wheel): the fleet test runs the real router in front of
# two `jetrl serve` workers.
pip install -q "sglang-router==0.3.2" 2>&1 | grep -v -i warning || true
# nvidia-modelopt's block-FP8 quantizer, compared with ours in tests/test_precision.py: no deps
# (it would pull a CUDA torch), plus the three its quantization package imports.
python -c "import modelopt" 2>/dev/null || \
  pip install -q --no-deps "nvidia-modelopt==0.47.0" 2>&1 | grep -v -i warning || true
pip install -q omegaconf pulp scipy 2>&1 | grep -v -i warning || true
python -c "import torch, megatron.core, megatron_jetrl; print('env ok: torch', torch.__version__)"
