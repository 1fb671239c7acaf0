#!/usr/bin/env bash
# The prepared GPU check (benchmark/gpu_check.py says what it measures). Two halves:
#   bash benchmark/gpu_check.sh prepare   # here, with PyPI: .gpu_check/ (tokenizer, every wheel beyond PyTorch)
#   bash benchmark/gpu_check.sh           # on the GPU machine (no network; Python 3.12 and PyTorch with CUDA are all
#                                         # it needs): installs the wheels to /tmp/site, runs the check, writes
#                                         # ${OUT:-.}/gpu_check.md and nothing else
# A trial run on a CPU: PYTHON_VERSION=3.11 (its Python) bash benchmark/gpu_check.sh prepare, then
# bash benchmark/gpu_check.sh --tiny (a 2-layer model)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = prepare ]; then
  # afresh: a model an earlier --tiny run built there would travel with it (16 MB)
  rm -rf .gpu_check
  python benchmark/gpu_check.py prepare .gpu_check
  # everything the scripts and the check import beyond torch and what torch's wheel brings (filelock, fsspec, jinja2,
  # networkx, sympy): transformers, peft, accelerate, tensorboard, tyro, math-verify and what they import, at the
  # versions tested here; no more (--no-deps: what they declare and the check never imports stays out, such as
  # tensorboard's server, grpcio and werkzeug, and the CLIs' typer); typing_extensions >= 4.14 for typeguard
  python -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu_check/wheels \
    transformers==5.25.0 huggingface-hub==2.5.0 tokenizers==0.23.3 safetensors==0.8.0 numpy==2.4.6 packaging==26.2 \
    pyyaml==6.0.3 regex==2026.5.9 tqdm==4.70.1 httpx2==2.17.0 httpcore2==2.17.0 h11==0.16.0 idna==3.21 \
    truststore==0.10.5 peft==0.22.0 accelerate==1.16.0 psutil==7.2.2 tensorboard==2.21.0 protobuf==7.36.2 \
    absl-py==2.5.1 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 typing-extensions==4.16.0 \
    math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 kernels==0.19.1 tomlkit==0.15.3
  du -sh .gpu_check
  exit
fi
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu_check/wheels/*.whl
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmark/gpu_check.py run .gpu_check "${OUT:-.}" "$@"
