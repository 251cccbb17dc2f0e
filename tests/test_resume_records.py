"""A pipeline run killed after MLflow took steps past its last checkpoint, then resumed: the resume replays those
steps, and MLflow — which cannot delete a value — must still hold every per-step metric exactly once per step, with
the values an uninterrupted run has. The kill is placed deterministically: BALLAST_FAULT=kill-after-logged:5
SIGKILLs `ballast run` once MLflow holds step 5's metrics, two steps past the checkpoint of step 3
(tasks/metrics_sink.py). bench/kill_resume.py repeats this at random moments.
"""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from tests.conftest import REPO, tiny_spec
from trainer.config import TrainerConfig
from trainer.loop import GRPOTrainer

STEPS = 6
SECTIONS = dict(
    optim={"steps": STEPS, "learning_rate": 3e-3}, checkpoint={"every": 3, "keep_last": 10}, probe={"enabled": False}
)
CLI = "import sys; from flows.cli import main; sys.exit(main())"
TIMING = ("time/", "step_time", "tokens_per_second")


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


@pytest.fixture(scope="module")
def killed_and_resumed(tiny_model, tmp_path_factory):
    """(MLflow client, run id, run directory) of a run SIGKILLed once MLflow held step 5, then resumed to the end."""
    project = tmp_path_factory.mktemp("replay") / "project"
    spec = project.parent / "spec.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(tiny_model, name="replayed", project_dir=str(project), **SECTIONS)))
    killed = ballast("run", str(spec), env={"BALLAST_FAULT": "kill-after-logged:5"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    run_id = next((project / "runs").iterdir()).name
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    assert max(m.step for m in client.get_metric_history(run_id, "reward")) >= 5  # MLflow had steps 4-5 at the kill
    resumed = ballast("run", "--resume", run_id, "--project-dir", str(project))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return client, run_id, project / "runs" / run_id


def per_step_keys(client: MlflowClient, run_id: str) -> list[str]:
    """The run's per-step metrics in MLflow (the `_headline/` copies of the headline curves included)."""
    return [k for k in client.get_run(run_id).data.metrics if not local_key(k).startswith(("eval/", "probe/"))]


def local_key(key: str) -> str:
    """The metrics.jsonl name of an MLflow metric: `_headline/<name>` is a copy of a metric (tasks/record.py)."""
    from tasks.record import HEADLINE, HEADLINE_KEYS

    copied = {HEADLINE + name: source for source, name in HEADLINE_KEYS.items()}
    return copied.get(key, key)


def read_local(run_dir) -> dict[int, dict]:
    return {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_after_a_kill_and_a_resume_every_per_step_metric_is_in_mlflow_once_per_step(killed_and_resumed):
    client, run_id, run_dir = killed_and_resumed
    local = read_local(run_dir)
    assert sorted(local) == list(range(1, STEPS + 1))
    keys = per_step_keys(client, run_id)
    assert {"reward", "reward_std", "num_tokens", "loss", "kl", "step_time"} <= set(keys)
    for key in keys:
        steps = Counter(m.step for m in client.get_metric_history(run_id, key))
        name = local_key(key)
        logged = [
            s for s, m in local.items() if isinstance(m.get(name), (int, float)) and m[name] == m[name]
        ]  # not NaN
        assert sorted(steps) == logged, key
        assert set(steps.values()) == {1}, (key, steps)


def test_after_a_kill_and_a_resume_mlflow_holds_the_replayed_values_and_no_mismatch(killed_and_resumed):
    client, run_id, run_dir = killed_and_resumed
    local = read_local(run_dir)
    for key in per_step_keys(client, run_id):
        if key.startswith(TIMING):
            continue
        for m in client.get_metric_history(run_id, key):
            assert m.value == pytest.approx(local[m.step][local_key(key)], rel=1e-6, abs=1e-9), (key, m.step)
    assert "ballast.resume_mismatch" not in client.get_run(run_id).data.tags


def test_after_a_kill_and_a_resume_the_final_adapter_equals_an_uninterrupted_run(
    killed_and_resumed, tiny_model, tmp_path
):
    _, _, run_dir = killed_and_resumed
    spec = tiny_spec(tiny_model, **{k: v for k, v in SECTIONS.items() if k != "probe"})
    trainer = GRPOTrainer(TrainerConfig.model_validate(spec), tmp_path, progress=False)
    trainer.train(STEPS)
    trainer.close()
    final = f"step-{STEPS:06d}/adapter/adapter_model.safetensors"
    a, b = load_file(str(run_dir / "checkpoints" / final)), load_file(str(tmp_path / "checkpoints" / final))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
