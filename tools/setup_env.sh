#!/usr/bin/env bash
# Create (or reuse) a virtual environment with everything the CPU run and the tests need.
#   bash tools/setup_env.sh [VENV_DIR]     (default .venv)
# torch is pinned to the 2.13.0 CPU build (an unpinned torch pulls a multi-GB CUDA build);
# megatron-core 0.19.2 declares Python >= 3.12 but builds and runs on 3.11: numpy first, then
# --no-deps --ignore-requires-python; it also needs triton and psutil (undeclared). triton is pinned
# too: the CPU tests run our kernels under its interpreter, and its behaviour follows its version (3.6,
# tried, cannot index a range with a program-id tensor under numpy 2.4; 3.9.0 runs the suite). GPU
# machines keep their own CUDA triton (the H200 image: 3.6).
# A failed install stops the setup with one line naming the package (pip's own output above it);
# the environment takes about 3.1 GB, so the free space is checked before anything is installed.
set -euo pipefail
VENV=${1:-.venv}
NEED_MB=${JETRL_SETUP_NEED_MB:-4000}
cd "$(dirname "$0")/.."

die() { echo "setup_env: $*" >&2; exit 1; }

# pip install with its warnings filtered out; a failure prints pip's last lines and stops here
# (a swallowed failure used to surface later as "No module named 'torch'").
pip_install() {
  local log rc=0
  log=$(mktemp)
  pip install -q "$@" >"$log" 2>&1 || rc=$?
  grep -v -i warning "$log" | { if [ "$rc" -ne 0 ]; then tail -n 25; else cat; fi; } >&2 || true
  rm -f "$log"
  [ "$rc" -eq 0 ] || die "'pip install $*' failed (exit $rc, pip's output above); fix that and rerun tools/setup_env.sh"
}

# Enough free space where the venv goes and where pip builds (TMPDIR)?
check_space() {
  local dir avail
  for dir in "$(dirname "$(realpath -m "$VENV")")" "${TMPDIR:-/tmp}"; do
    avail=$(df -Pm "$dir" 2>/dev/null | awk 'NR == 2 {print $4}') || continue
    [ -n "$avail" ] || continue
    [ "$avail" -ge "$NEED_MB" ] || die "only ${avail} MB free on the file system of ${dir}; the environment needs about ${NEED_MB} MB: free space there (or point TMPDIR / VENV_DIR elsewhere) and rerun"
  done
}

[ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch, megatron.core, megatron_jetrl" 2>/dev/null || check_space
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || die "python3 -m venv $VENV failed"
. "$VENV/bin/activate"
pip_install --upgrade pip
pip_install "torch==2.13.0" "numpy==2.4.6" "packaging>=24.2" psutil "triton==3.9.0"
python -c "import megatron.core" 2>/dev/null || \
  pip_install --no-deps --ignore-requires-python "megatron-core==0.19.2"
pip_install -e ".[test]"
# SGLang's pure-Python parts (weight-sync bucket class, request types) for the CPU tests: no deps,
# so its CUDA kernels and its torch pin stay out of this environment.
python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)" 2>/dev/null || \
  pip_install --no-deps "sglang==0.5.23"
# What sglang.srt.server_args needs to import (the launch-argument test parses our arguments with
# SGLang's own ServerArgs); all pure Python or small wheels, none of them pulls torch.
pip_install orjson msgspec pybase64 requests starlette pyzmq aiohttp pillow ipython
# ... and what the contract tests' imports of SGLang's io_struct, weight-updater manager, weight checker
# and sampler pull in (pure Python or small wheels, --no-deps so none of them brings a CUDA torch).
# torchvision is not among them: its PyPI wheels are CUDA builds (tests/sglang_imports.py stubs it).
pip_install --no-deps dill==0.4.1 sentencepiece==0.2.3 compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0 \
  openai==3.60.0 sniffio==1.3.1 partial-json-parser==0.2.1.1.post7 apache-tvm-ffi==0.1.15.post2
# sglang-router (a Rust binary in a 30 MB wheel): the fleet test runs the real router in front of
# two `jetrl serve` workers.
pip_install "sglang-router==0.3.2"
# nvidia-modelopt's block-FP8 quantizer, compared with ours in tests/test_quant.py: no deps
# (it would pull a CUDA torch), plus the three its quantization package imports.
python -c "import modelopt" 2>/dev/null || \
  pip_install --no-deps "nvidia-modelopt==0.47.0"
pip_install omegaconf pulp scipy
python -c "import torch, megatron.core, megatron_jetrl; print('env ok: torch', torch.__version__)"
