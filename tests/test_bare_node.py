"""`ballast train` on a bare GPU node: torch, transformers, peft and the trainer's light dependencies only.

The README says the trainer runs where only those are installed; S3 (boto3), MLflow, Prefect and Optuna load when
a command uses them. Each test starts a fresh interpreter in which those packages are hidden from every import
finder, as if they were not installed (importlib's availability probes then say "absent", as they would there).
"""

import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import REPO, tiny_spec

HIDDEN = ("boto3", "botocore", "prefect", "mlflow", "optuna")

# Run in the child: every finder on sys.meta_path is wrapped so that the hidden packages are not found, then the CLI
# runs with the arguments given; at exit, no hidden package may have been imported.
BARE_NODE = """
import importlib.abc, sys

HIDDEN = {hidden!r}


class NotInstalled(importlib.abc.MetaPathFinder):
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def find_distributions(self, context=None):  # importlib.metadata: the packages' metadata is gone too
        found = getattr(self.finder, "find_distributions", lambda context=None: [])
        args = () if context is None else (context,)
        return [d for d in found(*args) if (d.metadata["Name"] or "").lower() not in HIDDEN]

    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()


sys.meta_path[:] = [NotInstalled(f) for f in sys.meta_path]
from flows.cli import main

try:
    code = main(sys.argv[1:])
except SystemExit as stop:  # argparse's --help
    code = stop.code
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in HIDDEN)
print("hidden packages imported:", loaded)
sys.exit(code or (3 if loaded else 0))
"""


def bare_node(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BARE_NODE.format(hidden=HIDDEN), *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_bare_node_check_hides_the_packages():
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            BARE_NODE.format(hidden=HIDDEN).replace("from flows.cli", "import boto3\nfrom flows.cli"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 1 and "ModuleNotFoundError: No module named 'boto3'" in probe.stderr


def test_ballast_train_help_runs_without_boto3_prefect_mlflow_optuna():
    result = bare_node("train", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: ballast train" in result.stdout and "hidden packages imported: []" in result.stdout


def test_ballast_train_trains_a_step_without_boto3_prefect_mlflow_optuna(tiny_model, tmp_path: Path):
    spec = tiny_spec(tiny_model, rewards=[{"name": "exact_answer"}], checkpoint={"every": 1, "keep_last": 1})
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "run"
    result = bare_node("train", str(spec_path), "--output", str(out), "--steps", "1", "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hidden packages imported: []" in result.stdout
    assert (out / "metrics.jsonl").read_text().count('"step"') >= 1
    assert any((out / "checkpoints").iterdir())
