#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install expgpu into it.
#   usage: scripts/setup-env.sh [VENV]     (default .venv)
# On a machine without an NVIDIA GPU, torch is installed first as EXPGPU_TORCH
# (default torch==2.13.0, the CPU build this project is tested with), so that
# installing expgpu does not pull torch's multi-GB CUDA build. With a GPU, pip picks
# torch as pyproject.toml allows (or set EXPGPU_TORCH to your CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3}

if [[ ! -x $VENV/bin/python ]]; then
  echo "setup: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if [[ -n ${EXPGPU_TORCH:-} ]]; then
    "${pip[@]}" "$EXPGPU_TORCH"
  elif ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: no NVIDIA GPU here: installing torch==2.13.0 (CPU build)" >&2
    "${pip[@]}" "torch==2.13.0"
  fi
fi
echo "setup: installing expgpu (editable) and its dependencies" >&2
"${pip[@]}" -e ".[dev]"
touch "$VENV/.expgpu-setup"
