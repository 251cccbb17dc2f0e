"""Two `ballast sweep-worker` processes share one study on the local PostgreSQL (a fresh database per
test) and complete it together: exactly the requested number of finished trials, no trial run twice
or lost, each with exactly one MLflow child run under the sweep's parent run.
"""

import os
import subprocess
import sys

import mlflow
import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import REPO, postgres_database, tiny_spec

N_TRIALS = 4


@pytest.fixture
def database():
    """A fresh PostgreSQL database for the study, dropped after."""
    yield from postgres_database("ballast_sweep")


def test_two_workers_on_postgres_complete_a_study_without_duplicated_or_lost_trials(
    tiny_model, tmp_path, database, prefect_api
):
    from flows.cli import main

    project = tmp_path / "project"
    base = tiny_spec(
        tiny_model,
        name="pg-sweep",
        project_dir=str(project),
        probe={"enabled": False},
        optim={"steps": 6, "learning_rate": 1e-3},
        checkpoint={"every": 100, "keep_last": 1},
    )
    sweep = {
        "study": "pg-sweep",
        "base": base,
        "trials": N_TRIALS,
        "sampler": {"type": "random"},
        "pruner": {"type": "none"},
        "space": {
            "optim.learning_rate": {"type": "float", "low": 1e-4, "high": 3e-3, "log": True},
            "lora.r": {"type": "categorical", "choices": [4, 8]},
        },
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    assert main(["sweep", str(path), "--storage", database, "--workers", "0"]) == 0  # create the study only

    env = dict(os.environ, PREFECT_API_URL=prefect_api)
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from flows.cli import main; sys.exit(main())",
                "sweep-worker",
                "--study",
                "pg-sweep",
                "--storage",
                database,
                "--worker",
                str(i),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    scored = [o for o in outputs if "baseline: scoring the base model" in o]
    # the confirming worker's own line (8 held-out prompts: not split); the verdict itself is its summary's, and a
    # worker that finds it stored prints that summary too
    confirmed = [o for o in outputs if "] confirmation: not split: the held-out set has 8 prompts" in o]
    assert all(o.count("best on the selection prompts: trial") == 1 for o in outputs if o in confirmed)
    assert len(scored) == 1 and len(confirmed) == 1, "\n=====\n".join(outputs)  # each done by one worker alone

    study = optuna.load_study(study_name="pg-sweep", storage=database)
    finished = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(finished) == N_TRIALS and len(study.trials) == N_TRIALS  # none lost, none extra, none failed
    assert len({t.number for t in finished}) == N_TRIALS
    assert {t.user_attrs["worker"].rsplit(":", 1)[1] for t in finished} == {
        str(w.pid) for w in workers
    }  # both took part

    uri = f"sqlite:///{project / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    parent = client.get_run(study.user_attrs["ballast.mlflow_parent_run_id"])
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    numbers = sorted(int(r.data.tags["ballast.trial_number"]) for r in children)
    assert numbers == sorted(t.number for t in finished)  # one child run per trial, exactly once
    assert {t.user_attrs["mlflow_run_id"] for t in finished} == {r.info.run_id for r in children}
    for key in ("baseline/eval/reward", "confirm/baseline", "confirm/winner"):  # logged once, not once per worker
        assert len(client.get_metric_history(parent.info.run_id, key)) == 1, key
