#!/usr/bin/env bash
# The README's quickstart: install (idempotent), then run the whole pipeline on examples/quickstart.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec ballast quickstart "$@"
