"""Nothing lost: every command that refuses leaves the run directory byte-identical (issue 11 §4).

One real pipeline run (`ballast run`, real Prefect through its test harness, MLflow on SQLite) with two
checkpoints; then each refusal we could think of, through the CLI as a user types it, with every file of the run
directory hashed before and after. The bug that started this: a refused `--resume` (changed spec) overwrote the
run's spec.yaml with the refused spec — the very file the error told the user to resume with.
"""

import hashlib
import json
import shutil
from pathlib import Path

import mlflow
import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import tiny_spec


def ballast(*args) -> int:
    from flows.cli import main

    return main([str(a) for a in args])


def hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def write(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def pipeline_run(tiny_model, tmp_path_factory, prefect_api):
    """A finished 2-step pipeline run with checkpoints at steps 1 and 2: (spec file, run id, run directory)."""
    root = tmp_path_factory.mktemp("lost")
    spec = write(
        root / "spec.yaml",
        tiny_spec(
            tiny_model,
            name="keep-me",
            project_dir=str(root / "project"),
            probe={"enabled": False},
            optim={"steps": 2},
            checkpoint={"every": 1, "keep_last": 5},
        ),
    )
    assert ballast("run", spec) == 0
    (run_dir,) = (root / "project" / "runs").iterdir()
    return spec, run_dir.name, run_dir


@pytest.fixture
def unchanged(pipeline_run):
    """Asserts, after the test's refusal, that the run directory holds exactly the bytes it held before."""
    run_dir = pipeline_run[2]
    before = hashes(run_dir)
    yield run_dir
    assert hashes(run_dir) == before


def changed_spec(spec_file: Path, tmp_path: Path, **sections) -> Path:
    spec = yaml.safe_load(spec_file.read_text())
    for name, value in sections.items():
        spec.setdefault(name, {}).update(value)
    return write(tmp_path / "changed.yaml", spec)


def newest_adapter(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step-*"))[-1] / "adapter" / "adapter_model.safetensors"


# ── ballast train on the run's directory ───────────────────────────────────────────────────────────


def test_train_resume_with_a_changed_spec_is_refused_and_keeps_the_runs_spec(pipeline_run, unchanged, tmp_path, capsys):
    spec, _, run_dir = pipeline_run
    assert ballast("train", changed_spec(spec, tmp_path, lora={"r": 4}), "--output", run_dir, "--resume") == 2
    assert "spec field lora.r was 8 and is now 4" in capsys.readouterr().err


def test_train_resume_with_fewer_steps_than_the_run_has_is_refused(pipeline_run, unchanged, capsys):
    """It said the run was done, and rewrote the run's spec.yaml with the smaller optim.steps."""
    spec, _, run_dir = pipeline_run
    assert ballast("train", spec, "--output", run_dir, "--resume", "--steps", "1") == 2
    assert "past optim.steps 1; give more steps than" in capsys.readouterr().err


def test_probe_refuses_a_bad_prompts_file_and_an_output_folder_before_loading(
    pipeline_run, unchanged, tmp_path, capsys
):
    """Both were found after the checkpoint and the model had loaded: the prompts exit 1, the folder a traceback."""
    checkpoint = newest_adapter(pipeline_run[2]).parent.parent
    (tmp_path / "p.jsonl").write_text('{"question": "2+2"}\n')
    assert ballast("probe", checkpoint, "--prompts", tmp_path / "p.jsonl") == 2
    assert "p.jsonl:1: each line must be a JSON object with a non-empty 'prompt'" in capsys.readouterr().err
    assert ballast("probe", checkpoint, "--html", tmp_path) == 2
    assert f"--html {tmp_path}: is a folder" in capsys.readouterr().err


def test_train_into_a_directory_with_checkpoints_without_resume_is_refused(pipeline_run, unchanged, capsys):
    spec, _, run_dir = pipeline_run
    assert ballast("train", spec, "--output", run_dir) == 2
    assert "already holds checkpoints; pass --resume" in capsys.readouterr().err


def test_train_resume_with_bad_steps_is_refused(pipeline_run, unchanged, capsys):
    spec, _, run_dir = pipeline_run
    assert ballast("train", spec, "--output", run_dir, "--resume", "--steps", "-1") == 2
    assert "--steps -1" in capsys.readouterr().err


@pytest.fixture
def corrupt_newest_checkpoint(pipeline_run):
    """The newest checkpoint's adapter weights with one byte flipped (put back after the test)."""
    weights = newest_adapter(pipeline_run[2])
    good = weights.read_bytes()
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    yield weights
    weights.write_bytes(good)


def test_train_resume_from_a_corrupt_checkpoint_is_refused(pipeline_run, corrupt_newest_checkpoint, unchanged, capsys):
    spec, _, run_dir = pipeline_run
    assert ballast("train", spec, "--output", run_dir, "--resume") == 2
    err = capsys.readouterr().err
    assert "adapter_model.safetensors" in err and "step-000002" in err


@pytest.fixture
def damaged_record(pipeline_run):
    """metrics.jsonl with its first line no longer JSON (an edit gone wrong; put back after the test)."""
    record = pipeline_run[2] / "metrics.jsonl"
    good = record.read_text()
    first, rest = good.split("\n", 1)
    record.write_text(first[: len(first) // 2] + "\n" + rest)
    yield record
    record.write_text(good)


def test_train_resume_of_a_run_with_a_damaged_record_is_refused(pipeline_run, damaged_record, unchanged, capsys):
    spec, _, run_dir = pipeline_run
    assert ballast("train", spec, "--output", run_dir, "--resume") == 2
    assert "metrics.jsonl: line 1 is not a JSON row" in capsys.readouterr().err


# ── ballast run --resume ───────────────────────────────────────────────────────────────────────────


def test_run_resume_with_a_changed_spec_is_refused(pipeline_run, unchanged, tmp_path, capsys):
    spec, run_id, run_dir = pipeline_run
    assert ballast("run", changed_spec(spec, tmp_path, grpo={"beta": 0.5}), "--resume", run_id) == 2
    assert f"differs from the spec run {run_id} started with (grpo.beta" in capsys.readouterr().err


def test_run_resume_with_set_is_refused(pipeline_run, unchanged, capsys):
    _, run_id, run_dir = pipeline_run
    assert ballast("run", "--resume", run_id, "--project-dir", run_dir.parent.parent, "--set", "lora.r=4") == 2
    assert "--set cannot change run" in capsys.readouterr().err


def test_run_resume_from_a_corrupt_checkpoint_is_refused_and_the_mlflow_run_keeps_its_status(
    pipeline_run, corrupt_newest_checkpoint, unchanged, capsys
):
    spec, run_id, run_dir = pipeline_run
    uri = f"sqlite:///{run_dir.parent.parent / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    status = MlflowClient(uri).get_run(run_id).info.status
    assert ballast("run", "--resume", run_id, "--project-dir", run_dir.parent.parent) == 2
    assert "adapter_model.safetensors" in capsys.readouterr().err
    assert MlflowClient(uri).get_run(run_id).info.status == status


def test_run_resume_of_a_run_with_a_damaged_record_is_refused(pipeline_run, damaged_record, unchanged, capsys):
    _, run_id, run_dir = pipeline_run
    assert ballast("run", "--resume", run_id, "--project-dir", run_dir.parent.parent) == 2
    assert "metrics.jsonl: line 1 is not a JSON row" in capsys.readouterr().err


# ── ballast run forking from the run ───────────────────────────────────────────────────────────────


def test_validate_of_a_fork_from_a_checkpoint_opens_no_tracking_store(pipeline_run, tmp_path):
    """It made the project's mlflow.db, for a fork found where it is."""
    spec, _, run_dir = pipeline_run
    source = newest_adapter(run_dir).parent.parent
    fresh = tmp_path / "fresh-project"
    forked = {**yaml.safe_load(spec.read_text()), "fork": {"checkpoint": str(source)}, "project_dir": str(fresh)}
    assert ballast("validate", write(tmp_path / "fork.yaml", forked)) == 0
    assert not (fresh / "mlflow.db").exists()


def test_a_fork_from_a_tampered_checkpoint_is_refused_before_any_run_exists(pipeline_run, unchanged, tmp_path, capsys):
    spec, _, run_dir = pipeline_run
    source = tmp_path / "tampered"
    shutil.copytree(newest_adapter(run_dir).parent.parent, source)
    (source / "adapter" / "adapter_config.json").write_text("{}")
    copy = hashes(source)
    runs = sorted(p.name for p in run_dir.parent.iterdir())
    assert ballast("run", changed_spec(spec, tmp_path, fork={"checkpoint": str(source)})) == 2
    assert "adapter/adapter_config.json" in capsys.readouterr().err
    assert hashes(source) == copy and sorted(p.name for p in run_dir.parent.iterdir()) == runs


def test_a_fork_that_does_not_reproduce_its_fingerprint_is_refused_before_any_run_exists(
    pipeline_run, unchanged, tmp_path, capsys
):
    """The adapter's scale changed and the manifest re-hashed: the files verify, the logprobs do not."""
    spec, _, run_dir = pipeline_run
    source = tmp_path / "rescaled"
    shutil.copytree(newest_adapter(run_dir).parent.parent, source)
    config = source / "adapter" / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 16', '"lora_alpha": 64'))
    manifest = json.loads((source / "manifest.json").read_text())
    manifest["files"]["adapter/adapter_config.json"] = hashlib.sha256(config.read_bytes()).hexdigest()
    (source / "manifest.json").write_text(json.dumps(manifest))
    copy = hashes(source)
    runs = sorted(p.name for p in run_dir.parent.iterdir())
    assert ballast("run", changed_spec(spec, tmp_path, fork={"checkpoint": str(source)})) == 2
    assert "does not reproduce its logprob fingerprint" in capsys.readouterr().err
    assert hashes(source) == copy and sorted(p.name for p in run_dir.parent.iterdir()) == runs
