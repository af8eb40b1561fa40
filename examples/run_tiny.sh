#!/usr/bin/env bash
# The main job on the embedded default: set up, then GRPO on the tiny preset in unified FP8 (jet)
# on CPU (a few minutes on 2 cores). Extra arguments are config overrides, e.g. precision.mode=bf16.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh .venv
. .venv/bin/activate
jetrl train --preset tiny --plot "$@"
