#!/usr/bin/env bash
# The README's test command: install (idempotent, quick when already installed), lint, then the tests.
# `--fast`: the unit tier a developer runs on every change — lint, then the tests that need no real model, server
# process or CLI subprocess (`-m "not integration"`, marked in tests/conftest.py from what each test asks for), a file
# per core at a time, without the install; the slowest ten printed. Further arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Test files at a time: one per core for the unit tier (all CPU), one more than the cores for the whole suite, whose
# tests spend a quarter of their time waiting (servers starting, a process polled, a signal's safe point): 3 files at
# a time on 2 cores ran `bash .ci/run` in 24 min 11 s against 28 min 26 s with 2 (measured 2026-11-29 on an idle 2-core
# machine, fresh clones, every test passing, CPU 169 % of 200 against 75 %), and in 22 min 58 s against 23 min 46 s
# with 4 (2026-12-07, the same conditions: 4 left no core idle, and the suite was slower). BALLAST_TEST_WORKERS sets
# it (0: one file at a time, in this process).
cores=$(nproc)
if [[ "${1:-}" == "--fast" ]]; then workers="${BALLAST_TEST_WORKERS:-$cores}"; else workers="${BALLAST_TEST_WORKERS:-$(( cores + 1 ))}"; fi
# Each worker, and every process a test starts (the CLI, ranks, nodes), gets its share of the cores as torch's thread
# count (at least one): two workers with torch's default of a thread per core put 4 threads on 2 cores, and torch's
# small CPU kernels slow down when their threads wait for a core (measured 2026-11-28 on 2 cores: the unit tier 186 ->
# 88 s of CPU, the whole suite 31.4 -> 28.6 min, every test passing). OMP_NUM_THREADS you set is kept.
share=$(( cores / (workers > 0 ? workers : 1) ))
parallel=(env "OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( share > 0 ? share : 1 ))}")
if [[ "${1:-}" == "--fast" ]]; then
    shift
    python3 -m ruff check .
    python3 -m ruff format --check .
    exec "${parallel[@]}" python3 -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder -m "not integration" --durations=10 "$@"
fi
bash scripts/install.sh
python3 -m ruff check .            # lint (pyproject.toml [tool.ruff])
python3 -m ruff format --check .   # and the formatter's layout
# Test files in parallel (pytest-xdist, a file per worker so its module fixtures load once; the longest files first,
# tests/conftest.py and tests/test_costs.json). The terminal tests (a real pty, Ctrl-C, and how long a stop takes)
# run after the others, alone: a machine busy with other test files is not the machine a user types Ctrl-C on. Test
# paths or -k given as arguments run as asked, in one pytest.
for arg in "$@"; do
    if [[ "$arg" != -* ]] || [[ "$arg" == -k ]]; then
        exec "${parallel[@]}" python3 -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
    fi
done
status=0
"${parallel[@]}" python3 -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder --ignore=tests/test_terminal.py "$@" || status=$?
python3 -m pytest -q -n 0 tests/test_terminal.py "$@" || status=$((status ? status : $?))
exit "$status"
