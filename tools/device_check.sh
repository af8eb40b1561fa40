#!/usr/bin/env bash
# One device call: GPU tests, linear benchmarks, mismatch study, a GPU smoke run of the RL loop;
# outputs under $OUT. Usage (device tool, .whl carried with megatron-core's cp312 wheel):
#   bash tools/device_check.sh [tests|linear|mismatch|train ...]   (default: all)
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
want() { [ $# -eq 0 ] || [ -z "$PARTS" ] || [[ " $PARTS " == *" $1 "* ]]; }
PARTS="$*"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
if want tests; then
  timeout 300 python3 -m pytest -q -s -m gpu tests/test_gpu.py -p no:cacheprovider -p no:warnings 2>&1 | tee $OUT/gpu_tests.txt | tail -15
fi
if want linear; then
  timeout 150 python3 -m megatron_jetrl.cli bench linear --json $OUT/bench_linear.json 2>&1 | tee $OUT/bench_linear.txt
fi
if want mismatch; then
  timeout 300 python3 -m megatron_jetrl.cli mismatch --preset qwen2.5-0.5b-random --prompts 64 --prompt-len 64 \
    --json $OUT/mismatch_h200.json 2>&1 | grep -v -i warn | tee $OUT/mismatch_h200.txt
fi
if want train; then
  timeout 300 python3 -m megatron_jetrl.cli train --preset tiny --run-dir /tmp/gputiny steps=40 \
    algo.sft_warmup_steps=20 precision.backend=scaled_mm 2>&1 | grep -v -i warn | tail -5 | tee $OUT/train_tiny_gpu.txt
  cp /tmp/gputiny/metrics.jsonl $OUT/train_tiny_gpu_metrics.jsonl
fi
