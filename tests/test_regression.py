"""`ballast regress` end to end on real code refs: a temporary git repository holds this project as it
is now (uncommitted work included) at tag `good`, a documentation-only commit at `good-docs`, and a
commit at `defect` whose checkpoint saver scales the saved LoRA B weights by 16 — a bug in-training
metrics cannot see. Each ref trains the same tiny spec with its own code (a worktree, a subprocess),
every final artifact is probed by this checkout's probe, and the two sides are compared: good vs
defect is a regression, good vs good-docs is not, and each records one MLflow comparison run.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

CODE = ["flows", "tasks", "trainer", "sweeps", "infra", "examples", "pyproject.toml"]
GIT_ENV = {
    "GIT_AUTHOR_NAME": "ballast-test",
    "GIT_AUTHOR_EMAIL": "test@ballast.invalid",
    "GIT_COMMITTER_NAME": "ballast-test",
    "GIT_COMMITTER_EMAIL": "test@ballast.invalid",
}
DEFECT = '''

def _injected_defect_scale_lora_b(directory, factor):
    """Injected by tests/test_regression.py: the saver scales the saved LoRA B weights."""
    from safetensors.torch import load_file, save_file
    path = Path(directory) / "adapter" / "adapter_model.safetensors"
    if path.exists():
        weights = load_file(str(path))
        save_file({k: v * factor if "lora_B" in k else v for k, v in weights.items()}, str(path))
'''


def git(repo: Path, *args: str) -> str:
    proc = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, env={**os.environ, **GIT_ENV}
    )
    assert proc.returncode == 0, f"git {' '.join(args)}: {proc.stderr}"
    return proc.stdout.strip()


def inject_defect(checkpoint_py: Path) -> None:
    """After the line that saves the adapter, scale what was saved."""
    source = checkpoint_py.read_text()
    anchor = re.search(r"^( *)model\.save_pretrained\(tmp / weights.*$", source, re.MULTILINE)
    assert anchor, (
        "trainer/checkpoint.py no longer saves with `model.save_pretrained(tmp / weights, ...)`; update the defect "
        "injection"
    )
    line = f"\n{anchor.group(1)}_injected_defect_scale_lora_b(tmp, 16.0)"
    checkpoint_py.write_text(source[: anchor.end()] + line + source[anchor.end() :] + DEFECT)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A git repository with three tags: good (the working tree as it is), good-docs, defect."""
    root = tmp_path_factory.mktemp("refs") / "repo"
    root.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in CODE:
        src = REPO / name
        shutil.copytree(src, root / name, ignore=ignore) if src.is_dir() else shutil.copy2(src, root / name)
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "good")
    git(root, "tag", "good")
    (root / "NOTES.md").write_text("documentation only\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "docs")
    git(root, "tag", "good-docs")
    git(root, "checkout", "-q", "good")
    inject_defect(root / "trainer" / "checkpoint.py")
    git(root, "commit", "-q", "-am", "defect: the saver scales LoRA B")
    git(root, "tag", "defect")
    return root


@pytest.fixture(scope="module")
def spec_file(tiny_model, tmp_path_factory) -> Path:
    """3 short steps on the tiny model (built-in rewards only: each ref's code must be able to run it)."""
    project = tmp_path_factory.mktemp("regress-project")
    spec = {
        "model": {"name_or_path": str(tiny_model), "device": "cpu"},
        "project_dir": str(project),
        "lora": {"r": 8, "alpha": 16},
        "data": {"num_prompts": 64, "num_eval_prompts": 8},
        "rewards": [
            {"name": "exact_answer"},
            {"name": "format", "weight": 0.2},  # length: spread in every group
            {"name": "length_penalty", "weight": 0.1, "kwargs": {"target_chars": 10}},
        ],
        "grpo": {"num_generations": 4, "prompts_per_step": 2},
        "rollout": {"max_tokens": 24},
        "optim": {"steps": 3, "learning_rate": 2e-3},
        "checkpoint": {"every": 3, "keep_last": 1},
        "eval": {"every": 0, "max_tokens": 24},
        "probe": {"n": 4, "max_tokens": 32, "expected_length": 20},
    }
    path = project / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("prefect-home")


def regress(spec_file: Path, repo: Path, work: Path, prefect_home: Path, *refs: str) -> subprocess.CompletedProcess:
    """`ballast regress` as a user runs it: its own process, Prefect's local ephemeral API (state in a
    temporary home)."""
    args = [sys.executable, "-m", "flows.cli", "regress", str(spec_file), "--repo", str(repo), "--work-dir", str(work)]
    for ref in refs:
        args += ["--ref", ref]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(prefect_home)
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)


def mlflow_run(spec_file: Path, run_id: str):
    from mlflow.tracking import MlflowClient

    project = yaml.safe_load(spec_file.read_text())["project_dir"]
    return MlflowClient(f"sqlite:///{project}/mlflow.db").get_run(run_id)


def test_a_ref_with_a_defect_in_the_saver_is_a_regression(repo, spec_file, prefect_home, tmp_path):
    proc = regress(spec_file, repo, tmp_path / "work", prefect_home, "good", "defect")
    assert proc.returncode == 1, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("regression: defect malformed")
    result = json.loads((tmp_path / "work" / "comparison.json").read_text())
    assert result["verdict"] == "regression"
    assert result["refs"]["a"]["commit"] == git(repo, "rev-parse", "good")
    assert result["refs"]["b"]["commit"] == git(repo, "rev-parse", "defect")
    assert result["a"]["parity_ok"] and not result["b"]["parity_ok"] and result["parity_regression"]
    assert result["rate_regression"] and result["p_value"] < 0.01  # and its outputs are malformed far more often
    assert result["b"]["n_malformed"] > result["a"]["n_malformed"]
    assert result["a"]["n_samples"] == result["b"]["n_samples"] == 8 * 4  # probe.num_prompts held-out prompts x n=4
    probe_b = json.loads((tmp_path / "work" / "probes" / "b-0.json").read_text())
    assert probe_b["code_ref"]["commit"] == result["refs"]["b"]["commit"]  # the defect ref's code wrote it
    run_id = re.search(r"MLflow run: (\w+)", out).group(1)
    run = mlflow_run(spec_file, run_id)
    assert run.data.tags["ballast.kind"] == "regression" and run.data.tags["ballast.verdict"] == "regression"
    assert run.data.params["ref_b"] == "defect" and run.data.metrics["parity_failed_b"] == 1.0
    assert (tmp_path / "work" / "plots" / "curves.png").is_file()
    assert not (tmp_path / "work" / "worktrees" / "a-good").exists()  # worktrees are removed


def test_two_refs_with_the_same_trainer_are_no_regression(repo, spec_file, prefect_home, tmp_path):
    proc = regress(spec_file, repo, tmp_path / "work", prefect_home, "good", "good-docs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("no regression")
    result = json.loads((tmp_path / "work" / "comparison.json").read_text())
    assert result["a"]["parity_ok"] and result["b"]["parity_ok"]
    assert result["a"]["n_malformed"] == result["b"]["n_malformed"]  # same seeds, same code: same samples
    run = mlflow_run(spec_file, re.search(r"MLflow run: (\w+)", out).group(1))
    assert run.data.tags["ballast.verdict"] == "no regression" and run.data.metrics["regression"] == 0.0


def test_regress_refuses_bad_refs_with_exit_2(repo, spec_file, tmp_path, capsys):
    from flows.cli import main

    base = ["regress", str(spec_file), "--repo", str(repo), "--ref", "good"]
    assert main(base + ["--work-dir", str(tmp_path / "w1")]) == 2
    assert "exactly two refs" in capsys.readouterr().err
    assert main(base + ["--ref", "no-such-ref", "--work-dir", str(tmp_path / "w2")]) == 2
    assert "'no-such-ref' is not a commit" in capsys.readouterr().err
    assert not (tmp_path / "w2").exists()
