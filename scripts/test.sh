#!/usr/bin/env bash
# The README's test command: install (idempotent, quick when already installed), lint, then the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m ruff check .            # lint (pyproject.toml [tool.ruff])
python3 -m ruff format --check .   # and the formatter's layout
# Two test files at a time (pytest-xdist, a file per worker so its module fixtures load once): most tests wait on a
# subprocess, a server or the disk for part of their time. BALLAST_TEST_WORKERS=0 runs them one at a time.
exec python3 -m pytest -q -n "${BALLAST_TEST_WORKERS:-2}" --dist loadfile "$@"
