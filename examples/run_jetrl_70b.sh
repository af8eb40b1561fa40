#!/usr/bin/env bash
# Llama-3.1-70B, GRPO in unified FP8 (jet) on 4 nodes x 8 H100 80GB (planned: trainer TP=8 PP=2
# DP=2 with full recompute, 8 SGLang servers of TP=4, colocated). The HF checkpoint is converted to
# a megatron checkpoint first, then training starts from it. Run on every node, e.g. under Slurm:
#
#   export JETRL_ADMIN_API_KEY=$(openssl rand -hex 16)   # the servers' admin key, the same on every node
#   srun --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 \
#     env HF=/models/Llama-3.1-70B-Instruct DATA=/data/deepmath.jsonl bash examples/run_jetrl_70b.sh
#   bash examples/run_jetrl_70b.sh --dry-run --nodes 4     # anywhere: the plan, memory and commands
#
# A job that stopped continues with the same srun line plus --resume (--overwrite starts it over);
# examples/slurm_jetrl_70b.sbatch runs it in time-limited jobs that save before the limit and resume.
#
# Nodes, node rank and host names come from Slurm's environment (or --nodes/--hosts/--node-rank).
# The run directory must be on a filesystem all nodes share (the servers load the trainer's
# initial FP8 weights from it). 2 nodes are refused by the memory planner (it says why).
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${HF:-/models/Llama-3.1-70B-Instruct}
DATA=${DATA:-/data/deepmath.jsonl}
RUN=${RUN:-runs/llama3.1-70b-jet}
exec python -m megatron_jetrl.cli launch --preset llama3.1-70b-jet --gpus-per-node 8 \
  --gpu-mem-gb "${GPU_MEM_GB:-80}" --seq-len 8192 --hf-checkpoint "$HF" --run-dir "$RUN" \
  "data.path=$DATA" "$@"
