#!/usr/bin/env bash
# GPU checks on one CUDA machine: GPU tests, linear benchmarks, mismatch study, rollout / training / RL-step benchmarks;
# tables and plots under $OUT (default gpu_out/). megatron-core: installed already, or its wheel in .whl/ (installed
# into /tmp/site). Usage:
#   bash tools/device_check.sh [tests|linear|decode|tune|rollout|attn|decattn|exact|deepgemm|step|benchtrain|mismatch|train|dualtune ...]   (default: all)
# GPU_K=expr limits the tests part to pytest -k expr (GPU_TESTS: the test files, TESTS_TIMEOUT its limit); BT_LAYERS, BT_SEQS, BT_STEPS, BT_PROFILE ('' = off), BT_TAG, BT_TIMEOUT
# set the benchtrain part's slices (BT_ARGS: more bench-train arguments, e.g. --micro-batch 2); TUNE_M/TUNE_STAGES/TUNE_TAG/TUNE_TIMEOUT (TUNE_ARGS: all sweep arguments) the tune part's, RO_BATCH/RO_MODES/
# RO_TOKENS/RO_PROFILE/RO_TAG/RO_TIMEOUT/RO_ARGS (config overrides)/RO_ATTN (decode attentions, e.g. "sdpa triton") the rollout
# part's; part attn times the SDPA backends (training shapes), part decattn the decode attentions (DA_ARGS); part deepgemm times DeepGEMM's GEMM (DG_ARGS; needs .dg), part
# dualtune sweeps the one-pass gradient quantizer (DUAL_ARGS, DUAL_TIMEOUT), part exact times exact mode's kernels against the default ones (EX_ARGS); STEP_STEPS/STEP_TIMEOUT set the step part's
# measured steps (medians over more steps narrow its ~1% run-to-run spread), STEP_ARGS adds config overrides
# (e.g. algo.recompute_logprobs=false), STEP_TAG suffixes its files; MM_ARGS replaces the mismatch part's arguments
# (e.g. --kv: where the two sides' K/V part, per layer), MM_TAG suffixes its files, MM_TIMEOUT its limit. Output filters are line-buffered, and the
# rollout, step and small-M sweep benchmarks write their JSON after every row: a part cut off by a time limit keeps
# what it measured.
set -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
# DeepGEMM's kernels (tools/build_deepgemm_sm90.py --out .dg): precision.decode_gemm=tune can pick them
[ -f .dg/libjetrl_deepgemm_sm90.so ] && export JETRL_DEEPGEMM_DIR=$PWD/.dg
want() { [ $# -eq 0 ] || [ -z "$PARTS" ] || [[ " $PARTS " == *" $1 "* ]]; }
PARTS="$*"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
# the card in file names (h100, h200, ...; "gpu" for another)
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i -E 'h100|h200|h20|b200|a100' | head -1 | tr 'A-Z' 'a-z')
CARD=${CARD:-gpu}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
if want tests; then
  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -s -m gpu ${GPU_TESTS:-tests/test_gpu_exact.py tests/test_gpu_quant.py tests/test_gpu_gemm.py tests/test_gpu_decode.py tests/test_gpu_model.py} -p no:cacheprovider -p no:warnings ${GPU_K:+-k "$GPU_K"} 2>&1 | tee $OUT/gpu_tests.txt | tail -15
fi
if want linear; then
  timeout 150 python3 -m megatron_jetrl.cli bench linear --profile --json $OUT/bench_linear.json 2>&1 | tee $OUT/bench_linear.txt
fi
if want decode; then
  timeout 90 python3 -m megatron_jetrl.cli bench linear --decode --json $OUT/bench_decode.json 2>&1 | tee $OUT/bench_decode.txt
fi
if want tune; then  # the small-M kernel's plans (layout, TMA, split-K, stages), weights cycled past L2
  timeout ${TUNE_TIMEOUT:-330} python3 tools/tune_small_m.py ${TUNE_ARGS:---m ${TUNE_M:-16,64,256} --swap 0,1 --tma 0,1 \
    --split 0,1,2,4,8 --stages ${TUNE_STAGES:-4}} --json $OUT/tune_small_m${TUNE_TAG}.json 2>&1 | tee $OUT/tune_small_m${TUNE_TAG}.txt | tail -16
fi
if want rollout; then  # once per decode attention in RO_ATTN (sdpa, triton: one process each, files tagged _triton)
  for at in ${RO_ATTN:-sdpa}; do
    tag=${RO_TAG}$([ "$at" = sdpa ] || echo "_$at")
    timeout ${RO_TIMEOUT:-300} python3 -m megatron_jetrl.cli bench rollout --preset llama3.1-8b-random --batch ${RO_BATCH:-64,256} \
      --modes ${RO_MODES:-bf16,jet} --new-tokens ${RO_TOKENS:-1024} --prompt-len 128 --profile ${RO_PROFILE:-5} \
      --json $OUT/bench_rollout${tag}.json --plot $OUT/bench_rollout${tag}.png rollout.decode_attention=$at $RO_ARGS 2>&1 | grep --line-buffered -v -i warn | tee $OUT/bench_rollout${tag}.txt
  done
fi
if want deepgemm; then  # DeepGEMM's GEMM alone vs cuBLAS's vs BF16 (DG_ARGS), training and decode shapes
  timeout ${DG_TIMEOUT:-300} python3 tools/deepgemm_bench.py ${DG_ARGS} --json $OUT/deepgemm.json 2>&1 | grep --line-buffered -v "^{" | tee $OUT/deepgemm.txt
fi
if want decattn; then  # decode attention alone: SDPA over the bucket vs the exact-length Triton kernel's plans
  timeout ${DA_TIMEOUT:-150} python3 tools/attn_decode_bench.py ${DA_ARGS} --json $OUT/attn_decode.json 2>&1 | grep --line-buffered -v -i warn | tee $OUT/attn_decode.txt
fi
if want exact; then  # exact mode's GEMMs (every plan, with a same-bits column) and attention vs the default kernels
  timeout ${EX_TIMEOUT:-240} python3 tools/exact_bench.py ${EX_ARGS} --json $OUT/exact_bench.json 2>&1 | grep --line-buffered -v -i warn | tee $OUT/exact_bench.txt
fi
if want attn; then
  timeout ${ATTN_TIMEOUT:-120} python3 tools/attn_backends.py --profile ${ATTN_ARGS} --json $OUT/attn_backends.json 2>&1 | grep --line-buffered -v -i warn | tee $OUT/attn_backends.txt
fi
if want step; then
  timeout ${STEP_TIMEOUT:-240} python3 -m megatron_jetrl.cli bench step --preset llama3.1-8b-random --steps ${STEP_STEPS:-2} --warmup 1 \
    --plot $OUT/step_phases_${CARD}${STEP_TAG}.png --json $OUT/bench_step${STEP_TAG}.json model.num_layers=8 rollout.max_new_tokens=1024 \
    rollout.prompts_per_step=8 rollout.n_samples_per_prompt=8 $STEP_ARGS 2>&1 | grep --line-buffered -v -i warn | tee $OUT/bench_step${STEP_TAG}.txt
fi
if want benchtrain; then  # one training phase bf16 vs jet, with the kernels of a training step (BT_* override)
  timeout ${BT_TIMEOUT:-300} python3 -m megatron_jetrl.cli bench train --layers ${BT_LAYERS:-8} --seqs ${BT_SEQS:-4096} \
    --steps ${BT_STEPS:-2} ${BT_PROFILE---profile} $BT_ARGS --json $OUT/bench_train${BT_TAG}.json 2>&1 | grep --line-buffered -v -i warn | tee $OUT/bench_train${BT_TAG}.txt
fi
if want mismatch; then
  timeout ${MM_TIMEOUT:-300} python3 -m megatron_jetrl.cli mismatch ${MM_ARGS:---preset qwen2.5-0.5b-random --prompts 64 --prompt-len 64} \
    --json $OUT/mismatch_${CARD}${MM_TAG}.json 2>&1 | grep --line-buffered -v -i warn | tee $OUT/mismatch_${CARD}${MM_TAG}.txt
fi
if want train; then
  timeout 300 python3 -m megatron_jetrl.cli train --preset tiny --run-dir /tmp/gputiny steps=40 \
    algo.sft_warmup_steps=20 precision.backend=scaled_mm 2>&1 | grep --line-buffered -v -i warn | tail -5 | tee $OUT/train_tiny_gpu.txt
  cp /tmp/gputiny/metrics.jsonl $OUT/train_tiny_gpu_metrics.jsonl
fi
if want dualtune; then  # the one-pass gradient quantizer's plans vs the separate kernels (DUAL_ARGS: sweep arguments)
  timeout ${DUAL_TIMEOUT:-200} python3 tools/tune_dual_quant.py ${DUAL_ARGS} --json $OUT/tune_dual_quant.json 2>&1 | grep --line-buffered -v -i warn | tee $OUT/tune_dual_quant.txt
fi
