#!/usr/bin/env bash
# The wheels bench/gpu_check.sh installs on a device machine, which reaches no package index: what this package
# needs there beyond that machine's own python3 (CUDA torch, transformers, safetensors, accelerate, pytest are
# there). Run here, once, in the repo's root; .whl/ is ignored by git and travels with `carry: [".whl"]`.
#   bash bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
PY="${PYTHON:-.venv/bin/python}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .whl "hydra-core==1.3.2" "omegaconf==2.3.0"
# Published as a source archive only (pure Python): built into a wheel here.
"$PY" -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==4.9.3"
ls .whl
