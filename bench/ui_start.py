"""How long the UIs take to accept connections: MLflow as `mlflow ui` starts it by default (4 workers and its job
runner) against the way `ballast ui` starts it (1 worker, no job runner), and Prefect's server with and without its
background services. Each is started `--repeats` times on a store that already has its tables; the table gives the
seconds until its health endpoint first answers 200 (median and max), side by side.

    python3 bench/ui_start.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flows.commands import ui_commands  # noqa: E402

TIMEOUT_S = 600


def seconds_to_ready(argv: list[str], env: dict, url: str) -> float:
    proc = subprocess.Popen(
        [sys.executable, "-m", *argv],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    start = time.monotonic()
    try:
        while time.monotonic() - start < TIMEOUT_S:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except OSError:
                time.sleep(0.25)
        raise RuntimeError(f"{' '.join(argv)}: no answer from {url} in {TIMEOUT_S} s")
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        from mlflow.tracking import MlflowClient

        MlflowClient(f"sqlite:///{project / 'mlflow.db'}").create_experiment("ballast")  # the tables exist already
        ours = ui_commands(project, "127.0.0.1", 5091, 4291)
        default_mlflow = ["mlflow", "ui", "--backend-store-uri", f"sqlite:///{project / 'mlflow.db'}", "--port", "5092"]
        default_prefect = ["prefect", "server", "start", "--port", "4292"]
        cases = [
            ("MLflow: mlflow ui (defaults: 4 workers, job runner)", default_mlflow, {}, "http://127.0.0.1:5092/health"),
            (
                "MLflow: ballast ui (1 worker, no job runner)",
                ours["mlflow"][1],
                ours["mlflow"][0],
                "http://127.0.0.1:5091/health",
            ),
            (
                "Prefect: prefect server start (services on)",
                default_prefect,
                {"PREFECT_HOME": str(project / "prefect")},
                "http://127.0.0.1:4292/api/health",
            ),
            (
                "Prefect: ballast ui (--no-services)",
                ours["prefect"][1],
                ours["prefect"][0],
                "http://127.0.0.1:4291/api/health",
            ),
        ]
        rows = []
        for name, argv, env, url in cases:
            times = [seconds_to_ready(argv, env, url) for _ in range(args.repeats)]
            rows.append((name, statistics.median(times), max(times)))
    print(
        f"{'UI start-up, seconds to accept connections':<52} {'median':>8} {'max':>8}   (repeats={args.repeats}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})"
    )
    for name, median, worst in rows:
        print(f"{name:<52} {median:>8.1f} {worst:>8.1f}")


if __name__ == "__main__":
    main()
