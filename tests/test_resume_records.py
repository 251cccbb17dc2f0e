"""A pipeline run SIGKILLed at either edge of the hand-off between its record and MLflow, then resumed: MLflow must
hold every per-step metric — held-out evals included — exactly once per step, with the values of an uninterrupted
run, its samples tables each row once, and the final adapter must equal the uninterrupted run's
(tasks/metrics_sink.py says how). The kills are placed deterministically (BALLAST_FAULT, trainer/checkpoint.py):

* `kill-before-logged:3` — the window that lost steps for good (issue 28): the checkpoint of step 3 (an eval point)
  is written, and the process dies before step 3's metrics reach MLflow; the resume starts after that checkpoint,
  so only the record (metrics.jsonl) has them.
* `kill-after-logged:5` — MLflow took steps 4 and 5, past the checkpoint of step 3; the resume replays them, and
  MLflow cannot delete a value. The kill is made to land in the middle of the next step's appends too: each record
  file ends in a torn row (no newline), as a SIGKILL during a write leaves it (trainer/records.py).

bench/kill_resume.py repeats this at random moments.
"""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from tasks.record import EVAL_SAMPLES_TABLE, HEADLINE, HEADLINE_KEYS, SAMPLES_TABLE
from tests.conftest import REPO, tiny_spec
from trainer.checkpoint import step_dir_name
from trainer.config import TrainerConfig
from trainer.loop import GRPOTrainer
from trainer.records import read_rows
from trainer.samples import EVAL_SAMPLES_FILE, SAMPLES_FILE

STEPS = 6
SECTIONS = dict(
    optim={"steps": STEPS, "learning_rate": 3e-3},
    checkpoint={"every": 3, "keep_last": 10},
    eval={"every": 3, "on_start": True, "max_tokens": 24, "log_samples": 2},
    rollout={"max_tokens": 24, "log_samples": 2},
)
CLI = "import sys; from flows.cli import main; sys.exit(main())"
TIMING = ("time/", "step_time", "tokens_per_second")
COPIED = {HEADLINE + name: source for source, name in HEADLINE_KEYS.items()}  # `_headline/x` copies metric x
FAULTS = ["kill-before-logged:3", "kill-after-logged:5"]


def ballast(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "BALLAST_FAULT"}
    return subprocess.run(
        [sys.executable, "-c", CLI, *args],
        cwd=REPO,
        env={**environment, **(env or {})},
        capture_output=True,
        text=True,
        timeout=900,
    )


def steps_in_mlflow(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


@pytest.fixture(scope="module")
def uninterrupted(tiny_model, tmp_path_factory):
    """The run directory of the same training, never interrupted (the trainer alone: the pipeline adds nothing to a
    step's metrics, samples or weights)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    trainer = GRPOTrainer(TrainerConfig.model_validate(tiny_spec(tiny_model, **SECTIONS)), out, progress=False)
    trainer.train(STEPS)
    trainer.close()
    return out


@pytest.fixture(scope="module", params=FAULTS)
def killed_and_resumed(request, tiny_model, tmp_path_factory):
    """(MLflow client, run id, run directory) of a run SIGKILLed at the fault point, then resumed to the end; what
    MLflow held at the kill is checked first: the kill fell in the window it names."""
    fault = request.param
    project = tmp_path_factory.mktemp(fault.split(":")[0]) / "project"
    spec = project.parent / "spec.yaml"
    sections = {**SECTIONS, "probe": {"enabled": False}}
    spec.write_text(yaml.safe_dump(tiny_spec(tiny_model, name="replayed", project_dir=str(project), **sections)))
    killed = ballast("run", str(spec), env={"BALLAST_FAULT": fault})
    assert killed.returncode == -9, killed.stderr[-3000:]
    run_id = next((project / "runs").iterdir()).name
    run_dir = project / "runs" / run_id
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    if fault == "kill-before-logged:3":  # checkpointed, in the record, not in MLflow
        assert (run_dir / "checkpoints" / step_dir_name(3)).is_dir()
        assert 3 in {m["step"] for m in read_rows(run_dir / "metrics.jsonl")}
        assert 3 not in steps_in_mlflow(client, run_id, "reward") + steps_in_mlflow(client, run_id, "eval/reward")
    else:  # MLflow had steps 4-5, past the checkpoint of step 3
        assert not (run_dir / "checkpoints" / step_dir_name(6)).exists()
        assert {4, 5} <= set(steps_in_mlflow(client, run_id, "reward"))
        for name in ("metrics.jsonl", "prompts.jsonl", SAMPLES_FILE, EVAL_SAMPLES_FILE):
            with open(run_dir / name, "a") as f:
                f.write('{"step": 6, "reward": 0.4')  # the row the kill cut short
    resumed = ballast("run", "--resume", run_id, "--project-dir", str(project))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return client, run_id, run_dir


def per_step_keys(client: MlflowClient, run_id: str) -> list[str]:
    """The run's per-step metrics in MLflow: the trainer's (eval/* of eval points included) and their `_headline/`
    copies; not the probe's, nor the stages' own figures."""
    return [k for k in client.get_run(run_id).data.metrics if not COPIED.get(k, k).startswith("probe/")]


def by_step(out) -> dict[int, dict]:
    return {m["step"]: m for m in read_rows(out / "metrics.jsonl")}


def test_every_per_step_metric_is_in_mlflow_once_per_step_the_uninterrupted_run_has_it(
    killed_and_resumed, uninterrupted
):
    client, run_id, _ = killed_and_resumed
    reference = by_step(uninterrupted)
    keys = per_step_keys(client, run_id)
    assert {"reward", "kl", "loss", "step_time", "eval/reward", "_headline/reward", "_headline/eval_reward"} <= set(
        keys
    )
    for key in keys:
        name = COPIED.get(key, key)
        steps = Counter(m.step for m in client.get_metric_history(run_id, key))
        has_it = sorted(s for s, m in reference.items() if isinstance(m.get(name), (int, float)) and m[name] == m[name])
        assert sorted(steps) == has_it, key
        assert set(steps.values()) == {1}, (key, steps)


def test_the_held_out_evals_are_in_mlflow_at_step_0_and_every_eval_point(killed_and_resumed):
    client, run_id, _ = killed_and_resumed
    assert steps_in_mlflow(client, run_id, "eval/reward") == [0, 3, 6]
    assert steps_in_mlflow(client, run_id, "_headline/eval_reward") == [0, 3, 6]


def test_mlflow_holds_the_uninterrupted_runs_values_and_no_mismatch(killed_and_resumed, uninterrupted):
    client, run_id, _ = killed_and_resumed
    reference = by_step(uninterrupted)
    for key in per_step_keys(client, run_id):
        if COPIED.get(key, key).startswith(TIMING):
            continue
        for m in client.get_metric_history(run_id, key):
            assert m.value == pytest.approx(reference[m.step][COPIED.get(key, key)], rel=1e-6, abs=1e-9), (key, m.step)
    assert "ballast.resume_mismatch" not in client.get_run(run_id).data.tags


def logged_rows(client, run_id, table) -> list[dict]:
    logged = json.loads(Path(client.download_artifacts(run_id, table)).read_text())
    return [dict(zip(logged["columns"], values)) for values in logged["data"]]


def same_rows(logged: list[dict], rows: list[dict]) -> bool:
    """The rows of an MLflow table against the file's, in order (pandas writes a float to 10 decimals)."""

    def same(a, b) -> bool:
        return abs(a - b) <= 1e-9 if isinstance(b, float) else a == b

    return len(logged) == len(rows) and all(
        a.keys() == b.keys() and all(same(a[k], b[k]) for k in b) for a, b in zip(logged, rows)
    )


def test_the_samples_tables_hold_each_row_of_the_uninterrupted_run_once(killed_and_resumed, uninterrupted):
    client, run_id, run_dir = killed_and_resumed
    assert same_rows(logged_rows(client, run_id, SAMPLES_TABLE), read_rows(uninterrupted / SAMPLES_FILE))
    in_training = read_rows(uninterrupted / EVAL_SAMPLES_FILE)
    assert read_rows(run_dir / EVAL_SAMPLES_FILE)[: len(in_training)] == in_training  # the final eval's rows after
    assert same_rows(logged_rows(client, run_id, EVAL_SAMPLES_TABLE), read_rows(run_dir / EVAL_SAMPLES_FILE))


def test_the_final_adapter_equals_the_uninterrupted_runs(killed_and_resumed, uninterrupted):
    _, _, run_dir = killed_and_resumed
    final = f"step-{STEPS:06d}/adapter/adapter_model.safetensors"
    a, b = load_file(str(run_dir / "checkpoints" / final)), load_file(str(uninterrupted / "checkpoints" / final))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
