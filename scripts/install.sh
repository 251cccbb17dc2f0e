#!/usr/bin/env bash
# Install Ballast and its tested set of versions into the current Python environment.
# On a machine without a GPU, torch's CPU build is installed first so nothing pulls CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch>=2.4"
  else
    "$PY" -m pip install -q torch==2.13.0
  fi
fi
"$PY" -m pip install -q -c constraints.txt -e ".[dev,bench,cloud]"
