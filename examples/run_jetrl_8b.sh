#!/usr/bin/env bash
# Llama-3.1-8B, GRPO in unified FP8 (jet) on one 8-GPU node: SGLang fleet colocated with the
# Megatron trainer. The HF checkpoint is converted to a megatron checkpoint first (under the
# planned layout), then training starts from it.
#
#   HF=/models/Llama-3.1-8B-Instruct DATA=/data/deepmath.jsonl bash examples/run_jetrl_8b.sh
#   bash examples/run_jetrl_8b.sh --dry-run        # the plan, memory and commands; runs anywhere
#
# Inside the container (Dockerfile) or an environment with torch+CUDA, megatron-core, TE, SGLang.
# Extra arguments go to `jetrl launch` (e.g. --gpu-mem-gb 141 on H200, steps=100).
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${HF:-/models/Llama-3.1-8B-Instruct}
DATA=${DATA:-/data/deepmath.jsonl}
RUN=${RUN:-runs/llama3.1-8b-jet}
exec python -m megatron_jetrl.cli launch --preset llama3.1-8b-jet --nodes "${NODES:-1}" --gpus-per-node 8 \
  --gpu-mem-gb "${GPU_MEM_GB:-80}" --seq-len 8192 --hf-checkpoint "$HF" --run-dir "$RUN" \
  "data.path=$DATA" "$@"
