#!/usr/bin/env bash
# The prepared GPU check (benchmark/gpu_check.py says what it measures). Two halves:
#   bash benchmark/gpu_check.sh prepare   # here, with PyPI: .gpu_check/ (tokenizer, wheels the GPU machine lacks)
#   bash benchmark/gpu_check.sh           # on the GPU machine (no network; PyTorch, transformers, peft there):
#                                         # installs the wheels to /tmp/site, runs the check, writes ${OUT:-.}/
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = prepare ]; then
  python benchmark/gpu_check.py prepare .gpu_check
  # what the scripts import beyond that machine's packages (Python 3.12 there)
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu_check/wheels \
    tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
    antlr4-python3-runtime==4.13.2
  exit
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_check/wheels/*.whl
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmark/gpu_check.py run .gpu_check "${OUT:-.}"
