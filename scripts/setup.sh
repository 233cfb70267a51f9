#!/usr/bin/env bash
# Create .venv and install fsdp_research with its test tools and the Optuna sweeper. Idempotent.
# Where no NVIDIA GPU is visible, torch's CPU build goes in first, so pip never pulls the multi-GB CUDA
# build; on a GPU machine pip takes the default (CUDA) torch. TORCH_SPEC overrides the choice.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  if [ -n "${TORCH_SPEC:-}" ]; then
    .venv/bin/pip install -q "$TORCH_SPEC"
  elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    .venv/bin/pip install -q "torch>=2.9"
  else
    # A local CPU wheel (this project's dev/CI machines keep 2.13.0's on disk), else PyTorch's CPU index.
    .venv/bin/pip install -q "torch==2.13.0+cpu" 2>/dev/null \
      || .venv/bin/pip install -q torch --extra-index-url https://download.pytorch.org/whl/cpu
  fi
fi
.venv/bin/pip install -q -c scripts/constraints.txt -e '.[test,sweep]'
