#!/usr/bin/env bash
# The README's test command: install (idempotent, quick when already installed), lint, then the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m ruff check .            # lint (pyproject.toml [tool.ruff])
python3 -m ruff format --check .   # and the formatter's layout
exec python3 -m pytest -q "$@"
