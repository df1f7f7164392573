#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: GRPO on the tiny embedded default config (FP8 end to end).
# Extra args go to scripts/train.py, e.g. --config=configs/tiny_bf16.py or --config.train.steps=10.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
args=("$@")
[[ " ${args[*]-} " == *" --config="* ]] || args=(--config=configs/tiny_fp8.py "${args[@]}")
exec .venv/bin/python scripts/train.py "${args[@]}"
