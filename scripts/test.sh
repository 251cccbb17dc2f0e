#!/usr/bin/env bash
# The README's test command: install (idempotent, quick when already installed), lint, then the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m ruff check .            # lint (pyproject.toml [tool.ruff])
python3 -m ruff format --check .   # and the formatter's layout
# One test file at a time by default. BALLAST_TEST_WORKERS=2 runs two at a time (pytest-xdist, a file per worker so
# its module fixtures load once): about 21 minutes on 2 cores instead of about 35, but under that load the terminal
# Ctrl-C test of `ballast ui` has failed in 2 of 4 full runs, so the default stays one at a time.
exec python3 -m pytest -q -n "${BALLAST_TEST_WORKERS:-0}" --dist loadfile "$@"
