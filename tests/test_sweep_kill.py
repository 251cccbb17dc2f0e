"""A sweep killed or interrupted anywhere resumes to one answer (sweeps/runner.py's contract, item 3): `ballast sweep`
SIGKILLed or Ctrl-C'd mid-trial, then run again, ends with the uninterrupted sweep's trials — the same
configurations, each once, ended the same way with the same values, the same best — and one MLflow run per trial
under the sweep's parent run. `ballast sweep --delete STUDY` leaves neither the study nor any of its MLflow runs.

The kills are placed deterministically (BALLAST_FAULT, sweeps/pruning.py): `kill-in-trial-1-step:2` SIGKILLs the
sweep once trial 1 has trained step 2; `hold-in-trial-1-step:2` holds trial 1 there until the test's SIGINT has
arrived. The sampler is random over a continuous range, so a replaced configuration could never come out equal.
"""

import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
import yaml

from tests.conftest import REPO, tiny_spec
from tests.test_sweep import ballast, mlflow_client

STUDY, TRIALS = "kill-sweep", 3
CLI = "import sys; from flows.cli import main; sys.exit(main())"


def kill_sweep_file(tiny_model, project):
    """Three 4-step trials of the tiny model, their learning rate drawn at random (seeded)."""
    base = tiny_spec(
        tiny_model,
        name="kill-sweep",
        project_dir=str(project),
        probe={"enabled": False},
        optim={"steps": 4},
        checkpoint={"every": 100, "keep_last": 1},
    )
    data = {
        "study": STUDY,
        "base": base,
        "space": {"optim.learning_rate": {"type": "float", "low": 1e-4, "high": 3e-3, "log": True}},
        "sampler": {"type": "random"},
        "pruner": {"type": "none"},
        "trials": TRIALS,
        "seed": 3,
    }
    project.mkdir(parents=True, exist_ok=True)
    path = project / "sweep.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def study_of(project) -> optuna.Study:
    return optuna.load_study(study_name=STUDY, storage=f"sqlite:///{project / 'optuna.db'}")


def trials_so_far(project) -> list:
    """The study's trials while a sweep is starting (none before its study exists)."""
    try:
        return study_of(project).trials
    except KeyError:  # the storage exists, the study not yet
        return []


def outcome(project) -> dict:
    """The finished study as an answer: {learning rate: (state, value)} of its counted trials, and the best."""
    study = study_of(project)
    done = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    ended = {t.params["optim.learning_rate"]: (t.state.name, t.value) for t in done}
    assert len(ended) == len(done) == TRIALS  # each configuration once
    return {"trials": ended, "best": (study.best_trial.params, study.best_value)}


def trial_runs(project) -> list:
    """The MLflow runs under the sweep's parent run (deleted ones are not found)."""
    client = mlflow_client(project)
    parent = study_of(project).user_attrs["ballast.mlflow_parent_run_id"]
    exp = client.get_run(parent).info.experiment_id
    return client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent}'")


def sweep_process(path, prefect_api, fault: str) -> subprocess.Popen:
    env = dict(os.environ, PREFECT_API_URL=prefect_api, BALLAST_FAULT=fault)
    command = [sys.executable, "-c", CLI, "sweep", str(path)]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model, tmp_path_factory, prefect_api):
    project = tmp_path_factory.mktemp("uninterrupted") / "project"
    assert ballast("sweep", kill_sweep_file(tiny_model, project)) == 0
    return outcome(project)


def assert_resumed_to_the_same_answer(project, path, uninterrupted) -> None:
    assert ballast("sweep", path) == 0
    assert outcome(project) == uninterrupted
    study = study_of(project)
    counted = {t.number for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")}
    runs = trial_runs(project)
    assert sorted(int(r.data.tags["ballast.trial_number"]) for r in runs) == sorted(counted)  # one run per trial
    interrupted = [t for t in study.trials if t.state.name == "FAIL"]
    assert [t.number for t in interrupted] == [1] and f"ballast.interrupted.{1}" in study.user_attrs
    retry = next(t for t in study.trials if t.user_attrs.get("ballast.retry_of") == [1])
    assert retry.params == interrupted[0].params and retry.state.name == "COMPLETE"  # run again, not replaced


def test_a_sweep_sigkilled_mid_trial_resumes_to_the_uninterrupted_answer(
    tiny_model, tmp_path, prefect_api, uninterrupted
):
    project = tmp_path / "project"
    path = kill_sweep_file(tiny_model, project)
    killed = sweep_process(path, prefect_api, "kill-in-trial-1-step:2")
    _, err = killed.communicate(timeout=600)
    assert killed.returncode == -signal.SIGKILL, err[-3000:]
    assert [t.state.name for t in study_of(project).trials] == ["COMPLETE", "RUNNING"]
    assert_resumed_to_the_same_answer(project, path, uninterrupted)


def test_a_sweep_interrupted_by_ctrl_c_mid_trial_reruns_that_configuration(
    tiny_model, tmp_path, prefect_api, uninterrupted
):
    project = tmp_path / "project"
    path = kill_sweep_file(tiny_model, project)
    sweep = sweep_process(path, prefect_api, "hold-in-trial-1-step:2")
    deadline = time.monotonic() + 600
    while len(trials_so_far(project)) < 2:
        assert sweep.poll() is None and time.monotonic() < deadline, sweep.stderr.read()[-3000:]
        time.sleep(0.5)
    while 1 not in trials_so_far(project)[1].intermediate_values:  # trial 1 trains; it holds at step 2
        assert sweep.poll() is None and time.monotonic() < deadline, sweep.stderr.read()[-3000:]
        time.sleep(0.2)
    sweep.send_signal(signal.SIGINT)
    _, err = sweep.communicate(timeout=300)
    assert sweep.returncode == 130, err[-3000:]
    assert "continue it with: ballast sweep" in err and "Traceback" not in err, err[-3000:]
    states = [t.state.name for t in study_of(project).trials]
    assert states == ["COMPLETE", "FAIL", "WAITING"]  # its configuration queued, to run before any new one
    assert_resumed_to_the_same_answer(project, path, uninterrupted)


def test_deleting_a_sweep_deletes_its_study_and_every_mlflow_run_of_it(tiny_model, tmp_path, prefect_api, capsys):
    project = tmp_path / "project"
    path = kill_sweep_file(tiny_model, project)
    assert ballast("sweep", path, "--trials", 1) == 0
    client, parent = mlflow_client(project), study_of(project).user_attrs["ballast.mlflow_parent_run_id"]
    exp = client.get_run(parent).info.experiment_id
    assert len(client.search_runs([exp])) >= 2  # the parent and the trial's run (and any nested under it)
    capsys.readouterr()
    assert ballast("sweep", "--delete", STUDY, "--storage", f"sqlite:///{project / 'optuna.db'}") == 0
    said = capsys.readouterr().out
    assert said.startswith(f"deleted study {STUDY} (1 trials)") and parent in said, said
    assert client.search_runs([exp]) == []  # no orphan: parent, trial runs and their stage runs all gone
    assert STUDY not in [s.study_name for s in optuna.get_all_study_summaries(f"sqlite:///{project / 'optuna.db'}")]
    assert ballast("sweep", "--delete", STUDY, "--storage", f"sqlite:///{project / 'optuna.db'}") == 2


def test_a_confirmation_seed_run_trained_again_replaces_the_run_its_killed_attempt_left(
    tiny_model, tmp_path, prefect_api
):
    """A sweep killed while the confirmation retrains a trial at another seed (bench/sweep_kill.py hit it: 8 seed runs
    for 4 after the resume) trains that seed run again on resume: the killed attempt's run is deleted first, the other
    seed runs are left alone, and the study keeps one MLflow run per (trial, seed)."""
    from flows.confirm import Judge
    from sweeps.confirmation import SeedJob
    from sweeps.space import base_spec, load_sweep, sweep_split
    from tasks.spec import validate_spec
    from tasks.sweep_record import SweepRecorder

    project = tmp_path / "project"
    sweep = load_sweep(kill_sweep_file(tiny_model, project))
    recorder = SweepRecorder(validate_spec(base_spec(sweep), "sweep base spec"), sweep.study_name)
    study = optuna.create_study(study_name=STUDY, storage=f"sqlite:///{project / 'optuna.db'}")
    recorder.open_parent(study, {}, {})
    judge = Judge(study, sweep, recorder, sweep_split(sweep), print)
    job, other = SeedJob(0, {"optim.learning_rate": 1e-3}, 1), SeedJob(1, {"optim.learning_rate": 2e-3}, 1)
    left = {}
    for j in (job, other):  # what a SIGKILL mid-confirmation leaves: RUNNING seed runs under the parent
        left[j.number] = recorder.tracking.create_run(f"killed seed run of trial {j.number}", recorder.parent_run_id)
        recorder.tracking.set_tags(left[j.number], judge.seed_tags(j))

    (result,) = judge.retrain([job])

    assert result.status == "finished" and result.run_id != left[0]
    runs = trial_runs(project)
    seeds = sorted((r.data.tags["ballast.seed_of_trial"], r.data.tags["ballast.seed_offset"]) for r in runs)
    assert seeds == [("0", "1"), ("1", "1")]  # one run per (trial, seed): the new one, and the job not retrained
    assert {r.info.run_id for r in runs} == {result.run_id, left[1]}
