"""Signals, sent for real to a `ballast` subprocess once its metrics.jsonl has a step: SIGTERM (what spot
preemption, Kubernetes and SkyPilot send) and SIGINT (Ctrl-C) let the step in progress finish, save a checkpoint
there, and end the command with exit status 128 + signal and one line naming the run and the command that resumes
it. A pipeline run ends KILLED in MLflow and Cancelled ("Interrupted") in Prefect, and the resumed run continues
from the saved step: a resumed `ballast train` equals a run that was never interrupted.
"""

import glob
import json
import os
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from tests.conftest import REPO, tiny_spec
from tests.test_trainer import deterministic
from trainer.checkpoint import list_checkpoints

STEPS = 6
SECTIONS = dict(optim={"steps": STEPS, "learning_rate": 3e-3}, checkpoint={"every": 3, "keep_last": 10})
# as the `ballast` script calls it, with Ctrl-C's handler as a terminal's process has it: a pytest started as a
# background job of a script (`bash .ci/run &`) has SIGINT ignored, and what it starts would inherit that
CLI = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from flows.cli import main; sys.exit(main())"
)
WAIT_S = 900  # the most any wait here lasts: a model load and a few steps on a loaded 2-core machine
SIGNALLED_STEP = 2  # the subprocess holds step 2 until the signal has arrived (BALLAST_FAULT=hold-in-step): the signal,
# sent once step 1 is written, lands in step 2 however fast or slow the machine is
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},  # the CLI's own embedded Prefect
    "BALLAST_FAULT": f"hold-in-step:{SIGNALLED_STEP}",
}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def ballast(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CLI, *args], cwd=REPO, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def signal_after_first_step(proc: subprocess.Popen, metrics_glob: str, signum: int) -> tuple[int, str, str]:
    """Wait (bounded) until a metrics.jsonl matching the glob has a training step, send `signum`, wait for the exit."""
    deadline = time.monotonic() + WAIT_S
    while not any(m["step"] >= 1 for path in glob.glob(metrics_glob) for m in read_jsonl(Path(path))):
        assert proc.poll() is None, f"ballast exited {proc.returncode} before its first step: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "no training step within the wait"
        time.sleep(0.2)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=WAIT_S)
    return proc.returncode, out, err


def last_line(err: str) -> str:
    return [line for line in err.splitlines() if line.strip()][-1]


# ── ballast train ──────────────────────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def sigterm_train(tiny_model, tmp_path_factory):
    """`ballast train` sent SIGTERM after its first step: (exit status, stderr, run directory)."""
    tmp = tmp_path_factory.mktemp("sigterm-train")
    spec = tmp / "spec.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(tiny_model, **SECTIONS)))
    run = tmp / "run"
    code, _, err = signal_after_first_step(
        ballast("train", str(spec), "--output", str(run), "--quiet"), f"{run}/metrics.jsonl", signal.SIGTERM
    )
    return code, err, run


@pytest.fixture(scope="module")
def straight(tiny_model, tmp_path_factory):
    """The same spec trained without interruption by `ballast train` in a fresh process, as the signalled run was:
    what a resumed run must reproduce. (Trained inside pytest instead, it follows whatever thread settings earlier
    tests left, and its float sums can differ in the last bits.)"""
    tmp = tmp_path_factory.mktemp("straight")
    spec = tmp / "spec.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(tiny_model, **SECTIONS)))
    env = {k: v for k, v in ENV.items() if k != "BALLAST_FAULT"}
    done = subprocess.run(
        [sys.executable, "-c", CLI, "train", str(spec), "--output", str(tmp / "run"), "--quiet"],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=WAIT_S,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return tmp / "run"


def test_sigterm_to_ballast_train_saves_a_checkpoint_after_the_step_and_exits_143_with_one_line(sigterm_train):
    code, err, run = sigterm_train
    done = [m["step"] for m in read_jsonl(run / "metrics.jsonl")]
    step = done[-1]
    assert code == 143
    assert done == list(range(1, SIGNALLED_STEP + 1))
    assert list_checkpoints(run / "checkpoints")[-1][0] == step
    assert last_line(err) == (
        f"run {run} stopped by SIGTERM after step {step}, checkpoint saved "
        f"({run / 'checkpoints' / f'step-{step:06d}'}); continue with: "
        f"ballast train {run / 'spec.yaml'} --output {run} --resume"
    )
    assert "Traceback" not in err


def test_ballast_train_resumed_after_sigterm_continues_from_the_saved_step_as_if_never_stopped(sigterm_train, straight):
    _, err, run = sigterm_train
    saved = list_checkpoints(run / "checkpoints")[-1][0]
    resume = last_line(err).split("continue with: ")[1].split()
    out, resumed_err = ballast(*resume[1:], "--quiet").communicate(timeout=WAIT_S)
    assert f"resumed from {run / 'checkpoints' / f'step-{saved:06d}'}" in out, resumed_err[-2000:]
    got, want = read_jsonl(run / "metrics.jsonl"), read_jsonl(straight / "metrics.jsonl")
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert [deterministic(m) for m in got] == [deterministic(m) for m in want]
    final = f"step-{STEPS:06d}/adapter/adapter_model.safetensors"
    a, b = load_file(str(run / "checkpoints" / final)), load_file(str(straight / "checkpoints" / final))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ── ballast run ────────────────────────────────────────────────────────────────────────────────────


def pipeline_spec(tiny_model, project: Path) -> Path:
    path = project.parent / f"{project.name}.yaml"
    path.write_text(
        yaml.safe_dump(
            tiny_spec(tiny_model, name="signalled", project_dir=str(project), probe={"enabled": False}, **SECTIONS)
        )
    )
    return path


@pytest.fixture(scope="module", params=[signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def signalled_run(request, tiny_model, tmp_path_factory):
    """`ballast run` sent the signal after its first step: (signal, exit status, stderr, project, run id)."""
    project = tmp_path_factory.mktemp("signalled") / "project"
    code, _, err = signal_after_first_step(
        ballast("run", str(pipeline_spec(tiny_model, project))), f"{project}/runs/*/metrics.jsonl", request.param
    )
    run_id = next((project / "runs").iterdir()).name
    return request.param, code, err, project, run_id


def test_signalled_ballast_run_exits_128_plus_signal_with_one_line_naming_the_run_and_its_resume(signalled_run):
    signum, code, err, project, run_id = signalled_run
    step = read_jsonl(project / "runs" / run_id / "metrics.jsonl")[-1]["step"]
    assert step == SIGNALLED_STEP
    name = signal.Signals(signum).name
    assert code == 128 + signum
    assert re.fullmatch(
        rf"run {run_id} stopped by {name} after step {step}, checkpoint saved \(.*step-{step:06d}\); "
        rf"continue with: ballast run --resume {run_id} --project-dir {project}",
        last_line(err),
    ), err
    assert "Traceback" not in err and "StageError" not in err
    others = [line for line in err.splitlines()[:-1] if line.strip()]
    assert others == [f"{name}: finishing this step, then saving a checkpoint (again to stop at once)"]


def test_signalled_ballast_run_is_killed_in_mlflow_and_cancelled_in_prefect(signalled_run):
    _, _, _, project, run_id = signalled_run
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    run = client.get_run(run_id)
    stages = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    assert run.info.status == "KILLED" and run.data.tags["ballast.status"] == "interrupted"
    assert {r.data.tags["ballast.stage"]: r.info.status for r in stages} == {"fork": "FINISHED", "train": "KILLED"}
    with sqlite3.connect(project / "prefect" / "prefect.db") as prefect_db:  # the CLI's embedded Prefect server
        states = prefect_db.execute("select state_type, state_name from flow_run").fetchall()
    assert states == [("CANCELLED", "Interrupted")]


def test_ballast_run_resumed_after_a_signal_continues_from_the_saved_step(signalled_run):
    _, _, _, project, run_id = signalled_run
    run_dir = project / "runs" / run_id
    saved = list_checkpoints(run_dir / "checkpoints")[-1]
    saved_bytes = {p.name: p.read_bytes() for p in saved[1].rglob("*") if p.is_file()}
    proc = ballast("run", "--resume", run_id[:8], "--project-dir", str(project))  # the id shown in the run's name
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err[-3000:]
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_run(run_id).data.tags["ballast.status"] == "finished"
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert {p.name: p.read_bytes() for p in saved[1].rglob("*") if p.is_file()} == saved_bytes
    history = client.get_metric_history(run_id, "reward")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))  # steps up to the signal: logged once
    assert "ballast.stop_reason" not in client.get_run(run_id).data.tags  # not the old "stopped by SIGINT ... resume"


def test_resuming_a_run_that_finished_says_so_and_runs_nothing(signalled_run):
    """After the test above finished the run (tests run in file order)."""
    _, _, _, project, run_id = signalled_run
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    name = client.get_run(run_id).info.run_name
    stages_before = len(client.search_runs([client.get_run(run_id).info.experiment_id]))
    proc = ballast("run", "--resume", name, "--project-dir", str(project))
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err[-3000:]
    assert out.strip().startswith(f"run {run_id} already ended (finished); nothing to resume.")
    assert len(client.search_runs([client.get_run(run_id).info.experiment_id])) == stages_before


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_the_artifact_probe_names_that_stage_and_its_command_finishes_the_run(
    tiny_model, tmp_path, signum
):
    """SIGTERM (a preempted node, `timeout`) or SIGINT while the artifact probe runs (held there until the signal:
    BALLAST_FAULT=hold-in-probe): the last line says the run stopped during its artifact-probe stage, from the final
    checkpoint — not 'during a step' — with the command that continues it, which names the run's --project-dir (not
    .ballast) and finishes the run; Prefect's crash errors about the signal are not printed."""
    project = tmp_path / "project"
    spec = tmp_path / "spec.yaml"
    sections = dict(optim={"steps": 2}, checkpoint={"every": 2, "keep_last": 5})
    spec.write_text(yaml.safe_dump(tiny_spec(tiny_model, name="probed", project_dir=str(project), **sections)))
    log = tmp_path / "output.log"  # stdout (the stage lines) and stderr (the stop line) as a terminal shows them
    with log.open("w") as output:
        proc = subprocess.Popen(
            [sys.executable, "-c", CLI, "run", str(spec)],
            cwd=REPO,
            env={**ENV, "BALLAST_FAULT": "hold-in-probe:2"},
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + WAIT_S
        while "artifact-probe" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signum)
        code = proc.wait(timeout=WAIT_S)
    err = log.read_text()
    run_id = next((project / "runs").iterdir()).name
    assert code == 128 + signum, err[-3000:]
    assert re.fullmatch(
        rf"run {run_id} stopped by {signal.Signals(signum).name} during its artifact-probe stage; it continues from "
        rf"its newest checkpoint, step 2 \(.*step-000002\); continue with: ballast run --resume {run_id} "
        rf"--project-dir {project}",
        last_line(err),
    ), err[-3000:]
    for noise in ("Traceback", "Crash detected", "Crashed", "ERROR", "during a step"):
        assert noise not in err, err[-3000:]
    if signum == signal.SIGTERM:  # the command it names, run where the run was started, finishes the run
        command = shlex.split(last_line(err).split("continue with: ")[1])
        assert command[:2] == ["ballast", "run"]
        out, resumed_err = ballast(*command[1:]).communicate(timeout=WAIT_S)
        client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
        assert client.get_run(run_id).data.tags["ballast.status"] == "finished", resumed_err[-3000:]


@pytest.mark.parametrize("logger", ["prefect.flow_runs", "prefect.task_runs", "prefect.engine"])
def test_prefects_crash_errors_about_a_signal_are_dropped_from_every_logger_that_says_them(logger):
    """A flow or task engine logs on 'prefect.engine' until its run's logger is set; a SIGTERM that landed then had
    'Crash detected! Execution was aborted by a termination signal.' printed above the run's stop line (a CI run of
    test_a_signal_during_the_artifact_probe...). Other errors on those loggers still get through."""
    import logging

    from flows.trials.interrupts import interrupts_said_once, signal_crashes_unsaid

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    target, keep = logging.getLogger(logger), Keep()
    target.addHandler(keep)
    try:
        for around in (signal_crashes_unsaid(), interrupts_said_once("ballast sweep s.yaml")):
            with around:
                target.error("Crash detected! Execution was aborted by a termination signal.")
                target.error("Finished in state Crashed('Execution was aborted by an interrupt signal.')")
                target.error("a real error")
    finally:
        target.removeHandler(keep)
    assert seen == ["a real error", "a real error"]
