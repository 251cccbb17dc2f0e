"""What a sweep shows in optuna-dashboard and MLflow before any trial runs: the study's objectives by name (not
"Objective 0"), and a parent run that says what it is."""

import yaml
from mlflow.tracking import MlflowClient

from flows.sweep import open_sweep
from sweeps.space import load_sweep
from tests.conftest import tiny_spec


def test_the_study_names_its_objectives_and_the_parent_run_describes_the_sweep(tmp_path):
    base = tiny_spec("/models/not-loaded-here", name="named", project_dir=str(tmp_path), probe={"enabled": False})
    path = tmp_path / "sweep.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "study": "named-sweep",
                "base": base,
                "space": {"grpo.beta": {"type": "float", "low": 0.01, "high": 0.1}},
                "objectives": [{"metric": "eval/reward"}, {"metric": "stability", "direction": "minimize"}],
                "pruner": {"type": "none"},
                "trials": 2,
            }
        )
    )
    study, recorder = open_sweep(load_sweep(path), f"sqlite:///{tmp_path / 'optuna.db'}", None, worker=0)
    assert study.metric_names == ["eval/reward", "stability"]
    parent = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(recorder.parent_run_id)
    assert parent.data.tags["mlflow.note.content"].startswith(
        "**Optuna sweep `named-sweep`**: each child run is one trial"
    )
