#!/usr/bin/env bash
# The README's test command: install (idempotent, quick when already installed), then the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec python3 -m pytest -q "$@"
