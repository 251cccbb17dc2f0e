#!/usr/bin/env bash
# Issue 32's GPU check: one table (decode vs the HBM bound, Ballast vs TRL s/step and peak memory, update MFU,
# concurrent trials N = 1, 2, 4) in under 8 minutes of one GPU; bench/gpu_check.py says what each row measures.
# Needs .ballast/gpu-assets/ (wheels + tokenizer; build it with `python3 bench/gpu_assets.py` where there is
# network, carry it to the GPU machine). Writes the table to $OUT/gpu_check.txt too when OUT is set.
#
#   bash bench/gpu_check.sh               # on the GPU
#   bash bench/gpu_check.sh --cpu-smoke   # on CPU, a 2-layer model: checks that every section runs (~2 min)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
exec python3 bench/gpu_check.py "$@"
