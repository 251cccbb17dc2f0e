"""MLflow mirrors the run directory (tasks/metrics_sink.py, tasks/record.py): a resumed run's sink sends the steps its
record holds and MLflow lacks up to the checkpoint it resumes from, then its replay, and never a (metric, step) MLflow
already holds — whatever an earlier attempt delivered, kept in its spool or lost when it was killed. Tables are put
whole from the run directory's files, so recording them again leaves each row once; `ballast sync` sends what a
stopped run's MLflow lacks; a stage result goes to the recorder registered for its type.

Real MLflow (SQLite) and run directories written as the trainer writes them (metrics.jsonl rows, step-N checkpoint
directories); no model: tests/test_resume_records.py kills and resumes real pipeline runs.
"""

import json
from collections import Counter
from pathlib import Path

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from tasks.fork import ForkSource
from tasks.metrics_sink import PENDING, RECORD, MetricsSink, append_pending
from tasks.record import (
    EVAL_SAMPLES_TABLE,
    RECORDERS,
    SAMPLES_TABLE,
    Headline,
    RunRecorder,
    headline,
    put_table,
    sync_run,
)
from tasks.spec import load_spec
from tasks.tracking import Tracking
from trainer.checkpoint import step_dir_name
from trainer.records import append_rows
from trainer.samples import EVAL_SAMPLES_FILE, SAMPLES_FILE

EVAL_EVERY = 3


def row(step: int, reward: float | None = None) -> dict:
    """A step's metrics as the trainer writes them: eval/* at step 0 (eval-on-start) and every EVAL_EVERY steps."""
    m = {"step": step}
    if step:
        m |= {"reward": reward if reward is not None else step / 10, "kl": step / 100, "step_time": 1.0 + step}
    if step % EVAL_EVERY == 0:
        m |= {"eval/reward": step / 20, "eval/accuracy": step / 40}
    return m


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """One project folder and MLflow store for the module (making an SQLite store takes seconds); a run per test."""
    return tmp_path_factory.mktemp("mirror") / "project"


@pytest.fixture(scope="module")
def spec(project):
    return load_spec({"name": "mirrored", "model": {"name_or_path": "-"}, "project_dir": str(project)})


@pytest.fixture(scope="module")
def client(spec) -> MlflowClient:
    return Tracking(spec).client  # sets MLflow's tracking URI too: its load_table searches runs through it


@pytest.fixture
def run_id(client, spec) -> str:
    return client.create_run(Tracking(spec).experiment_id).info.run_id


def run_dir(out: Path, steps: range, checkpoints: tuple[int, ...]) -> Path:
    """A run directory `out` whose record holds `steps` and whose checkpoints are at `checkpoints`."""
    for step in checkpoints:
        (out / "checkpoints" / step_dir_name(step)).mkdir(parents=True)
    out.mkdir(exist_ok=True)
    append_rows(out / RECORD, [row(s) for s in steps])
    return out


def delivered(client, run_id, steps) -> None:
    """What an earlier attempt got into MLflow before it was killed: those steps' metrics and headline copies."""
    for s in steps:
        client.log_batch(
            run_id,
            metrics=[
                Metric(k, float(v), 1000 + s, s) for k, v in {**row(s), **headline(row(s))}.items() if k != "step"
            ],
        )


def resume(client, run_id, out: Path, replay: list[dict]) -> MetricsSink:
    """A resumed run's sink and headline callback, given the replayed steps, then closed."""
    sink = MetricsSink(client, run_id, spool=out / PENDING, record=out, copies=headline)
    copies = Headline(sink)
    for m in replay:
        sink.on_step(m["step"], m)
        copies.on_step(m["step"], m)
    sink.close()
    return sink


def steps_held(client, run_id) -> dict[str, Counter]:
    """{metric: Counter of the steps MLflow holds a value at}."""
    keys = client.get_run(run_id).data.metrics
    return {k: Counter(m.step for m in client.get_metric_history(run_id, k)) for k in keys}


def expected(steps: range) -> dict[str, Counter]:
    """Each metric (and headline copy) of `steps`, once per step it has a value at."""
    out: dict[str, Counter] = {}
    for s in steps:
        for k in {**row(s), **headline(row(s))}:
            if k != "step":
                out.setdefault(k, Counter())[s] += 1
    return out


# ── a resumed run's sink ───────────────────────────────────────────────────────────────────────────


def test_a_resume_sends_the_checkpointed_steps_mlflow_lacks_then_the_replay_each_once(client, run_id, tmp_path):
    """Killed after the step-6 checkpoint was written, before steps 5 and 6 (an eval point) reached MLflow."""
    out = run_dir(tmp_path / "run", range(0, 7), checkpoints=(3, 6))
    delivered(client, run_id, range(0, 5))
    resume(client, run_id, out, [row(s) for s in range(7, 10)])
    assert steps_held(client, run_id) == expected(range(0, 10))


def test_a_resume_sends_no_step_mlflow_took_past_the_checkpoint_and_keeps_its_first_value(client, run_id, tmp_path):
    """Killed after MLflow took steps 4 and 5, past the step-3 checkpoint: the replay's steps 4 and 5 are not sent."""
    out = run_dir(tmp_path / "run", range(0, 4), checkpoints=(3,))
    delivered(client, run_id, range(1, 6))
    sink = resume(client, run_id, out, [row(s) for s in range(4, 7)])
    assert steps_held(client, run_id) == expected(range(0, 7))
    assert sink.mismatches == []


def test_a_replayed_value_that_differs_is_named_and_the_first_one_kept(client, run_id, tmp_path):
    out = run_dir(tmp_path / "run", range(0, 4), checkpoints=(3,))
    delivered(client, run_id, range(1, 6))
    sink = resume(client, run_id, out, [row(4), row(5, reward=0.9), row(6)])
    assert sink.mismatches == [
        "reward at step 5: 0.5 recorded, 0.9 replayed",
        "_headline/reward at step 5: 0.5 recorded, 0.9 replayed",
    ]
    assert [m.value for m in client.get_metric_history(run_id, "reward") if m.step == 5] == [0.5]


def test_a_measured_metric_that_differs_on_replay_is_not_a_mismatch(client, run_id, tmp_path):
    out = run_dir(tmp_path / "run", range(0, 4), checkpoints=(3,))
    delivered(client, run_id, range(1, 5))
    sink = resume(client, run_id, out, [{**row(4), "step_time": 99.0}])
    assert sink.mismatches == []


def test_a_resume_that_replays_no_step_sends_the_record_up_to_the_newest_checkpoint(client, run_id, tmp_path):
    """Killed after training, in a later stage; the record still holds step 4, after the last checkpoint (the trainer
    did not run to cut it back): steps past the checkpoint are the next replay's, not sent."""
    out = run_dir(tmp_path / "run", range(1, 5), checkpoints=(3,))
    delivered(client, run_id, range(1, 2))
    resume(client, run_id, out, [])
    assert steps_held(client, run_id) == expected(range(1, 4))


def test_a_resume_with_no_checkpoint_sends_nothing_of_the_record_before_its_replay(client, run_id, tmp_path):
    """Killed before the first checkpoint: the run starts again at step 0 (eval-on-start), and its record with it."""
    out = run_dir(tmp_path / "run", range(0, 3), checkpoints=())
    delivered(client, run_id, range(0, 2))
    resume(client, run_id, out, [row(s) for s in range(0, 4)])
    assert steps_held(client, run_id) == expected(range(0, 4))


def test_an_earlier_attempts_spool_is_sent_through_the_same_rule(client, run_id, tmp_path):
    """The spool holds steps 4-5 of the replay of an attempt that ran while MLflow was away; MLflow took steps 4-5
    from the attempt before it (other timestamps): each (metric, step) once, and the spool gone."""
    out = run_dir(tmp_path / "run", range(0, 4), checkpoints=(3,))
    delivered(client, run_id, range(0, 6))
    append_pending(out / PENDING, run_id, [Metric("reward", row(s)["reward"], 5000 + s, s) for s in (4, 5)])
    resume(client, run_id, out, [row(s) for s in range(6, 8)])
    assert steps_held(client, run_id) == expected(range(0, 8))
    assert not (out / PENDING).exists()


def test_a_new_runs_sink_sends_every_step_it_is_given_and_reads_no_record(client, run_id, tmp_path):
    out = run_dir(tmp_path / "run", range(0, 4), checkpoints=(3,))  # a record it must not send: the run is new
    sink = MetricsSink(client, run_id, spool=out / PENDING)
    for s in range(4, 6):
        sink.on_step(s, row(s))
    sink.close()
    assert steps_held(client, run_id) == {k: c for k, c in expected(range(4, 6)).items() if not k.startswith("_")}


def test_log_every_holds_for_the_record_as_for_the_live_steps_and_eval_points_always_go(client, run_id, tmp_path):
    out = run_dir(tmp_path / "run", range(1, 5), checkpoints=(4,))
    sink = MetricsSink(client, run_id, every=2, record=out, copies=headline)
    for s in range(5, 8):
        sink.on_step(s, row(s))
        Headline(sink).on_step(s, row(s))
    sink.close()
    held = steps_held(client, run_id)
    assert sorted(held["reward"]) == [2, 3, 4, 6]  # every 2nd step, and step 3 and 6, eval points
    assert sorted(held["_headline/reward"]) == [2, 3, 4, 6]


# ── tables ─────────────────────────────────────────────────────────────────────────────────────────


def logged_rows(client, run_id, table) -> list[dict]:
    """The rows of an MLflow table artifact as logged (MLflow's load_table re-infers the types of its columns)."""
    logged = json.loads(Path(client.download_artifacts(run_id, table)).read_text())
    return [dict(zip(logged["columns"], values)) for values in logged["data"]]


def test_a_table_put_twice_holds_its_rows_once_and_reads_as_an_mlflow_table(client, run_id):
    rows = [{"step": 1, "completion": "4", "reward": 1.0}, {"step": 1, "completion": "5", "reward": 0.0}]
    put_table(client, run_id, rows, SAMPLES_TABLE)
    put_table(client, run_id, rows, SAMPLES_TABLE)
    assert logged_rows(client, run_id, SAMPLES_TABLE) == rows
    experiment = client.get_run(run_id).info.experiment_id
    assert len(client.load_table(experiment, SAMPLES_TABLE, run_ids=[run_id])) == 2
    marks = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
    assert marks == [{"path": SAMPLES_TABLE, "type": "table"}]


# ── ballast sync ───────────────────────────────────────────────────────────────────────────────────


@pytest.fixture
def stopped_run(project, client, run_id) -> tuple[str, Path]:
    """A run whose MLflow holds steps 0-2 and whose run directory holds steps 0-7, checkpoints at 3 and 6, samples,
    and steps 4-5 of metric `reward` in its spool: (run id, run directory)."""
    out = run_dir(project / "runs" / run_id, range(0, 8), checkpoints=(3, 6))
    delivered(client, run_id, range(0, 3))
    append_pending(out / PENDING, run_id, [Metric("reward", row(s)["reward"], 5000 + s, s) for s in (4, 5)])
    append_rows(out / SAMPLES_FILE, [{"step": 1, "completion": "4", "reward": 1.0}])
    append_rows(out / EVAL_SAMPLES_FILE, [{"step": 0, "completion": "2", "reward": 0.0}])
    return run_id, out


def test_sync_sends_the_spool_and_the_records_steps_mlflow_lacks_up_to_the_newest_checkpoint(stopped_run, spec, client):
    """`ballast sync RUN_ID` (flows/commands.py) calls sync_run; its checkpoint upload is tests/test_outages.py's."""
    run_id, out = stopped_run
    sent = sync_run(Tracking(spec), spec, run_id, out)
    held = steps_held(client, run_id)
    assert held == expected(range(0, 7))  # step 7 is past the newest checkpoint: a resume replays it
    assert sent == sum(expected(range(3, 7)).values(), Counter()).total()
    assert not (out / PENDING).exists()
    assert sync_run(Tracking(spec), spec, run_id, out) == 0
    assert steps_held(client, run_id) == held


def test_sync_puts_the_samples_tables_of_the_run_directory(stopped_run, spec, client):
    run_id, out = stopped_run
    sync_run(Tracking(spec), spec, run_id, out)
    sync_run(Tracking(spec), spec, run_id, out)
    assert logged_rows(client, run_id, SAMPLES_TABLE) == [{"step": 1, "completion": "4", "reward": 1.0}]
    assert logged_rows(client, run_id, EVAL_SAMPLES_TABLE) == [{"step": 0, "completion": "2", "reward": 0.0}]


# ── the recorder's registry ────────────────────────────────────────────────────────────────────────


@pytest.fixture
def recorder(spec):
    run = RunRecorder.start(Tracking(spec), spec, ForkSource())
    yield run
    run.metrics.close()


def test_a_result_with_no_recorder_is_refused_naming_its_type(recorder):
    with pytest.raises(TypeError, match="no recorder for a dict: register one with @records in tasks/record.py"):
        recorder.record({"not": "a stage result"})


def test_a_result_goes_to_the_recorder_registered_for_its_type_or_a_base_of_it(recorder, monkeypatch):
    class Finding:
        pass

    class CloseFinding(Finding):
        pass

    seen = []
    monkeypatch.setitem(RECORDERS, Finding, lambda run, result: seen.append((run, type(result))))
    recorder.record(Finding())
    recorder.record(CloseFinding())
    assert seen == [(recorder, Finding), (recorder, CloseFinding)]
