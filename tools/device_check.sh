#!/usr/bin/env bash
# One device call: GPU tests + linear benchmarks, outputs under $OUT. Usage (device tool):
#   bash tools/device_check.sh    (with .whl carried: megatron-core's cp312 wheel)
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
timeout 240 python3 -m pytest -q -s -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.txt | grep -vi warn | tail -40
timeout 150 python3 -m megatron_jetrl.bench.linear --json $OUT/bench_linear.json 2>&1 | tee $OUT/bench_linear.txt
timeout 120 python3 -m megatron_jetrl.bench.linear --decode --json $OUT/bench_linear_decode.json 2>&1 | tee $OUT/bench_linear_decode.txt
