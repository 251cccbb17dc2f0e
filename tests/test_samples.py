"""Samples you can read (trainer/samples.py): every step writes k of its completions — the truncated ones first, then
the best- and worst-paid — with each reward component, to samples.jsonl; evals write theirs to eval_samples.jsonl; a
resumed run drops the rows of steps after its checkpoint; the recorder logs them to MLflow as tables."""

import json
import shutil
from pathlib import Path

import pytest

from tasks.fork import ForkSource
from tasks.metrics_sink import RECORD
from tasks.record import EVAL_SAMPLES_TABLE, SAMPLES_TABLE, RunRecorder, Tracking
from tasks.results import TrainOutcome
from tasks.spec import load_spec
from tests.conftest import tiny_spec
from trainer.checkpoint import list_checkpoints
from trainer.records import append_rows, read_rows
from trainer.samples import EVAL_SAMPLES_FILE, SAMPLES_FILE, pick, sample_rows

ROW_KEYS = {"step", "prompt", "answer", "completion", "reward", "finish_reason", "truncated", "tokens"}


# ── which k ────────────────────────────────────────────────────────────────────────────────────────


def test_truncated_completions_come_first_then_the_best_and_the_worst_paid():
    rewards = [0.1, 0.9, 0.5, 0.3, 0.7]
    truncated = [False, False, True, False, True]
    assert pick(rewards, truncated, 4) == [0, 1, 2, 4]  # 2 and 4 truncated; 1 best-paid, 0 worst-paid of the rest


def test_at_most_k_minus_one_truncated_so_the_best_paid_is_always_shown():
    rewards = [0.0, 0.0, 0.0, 1.0]
    assert pick(rewards, [True] * 4, 3) == [0, 1, 3]


def test_one_sample_per_step_is_the_first_truncated_one():
    assert pick([1.0, 0.0, 0.0], [False, True, True], 1) == [1]


def test_k_of_zero_picks_nothing_and_k_beyond_the_batch_picks_all():
    assert pick([1.0, 0.5], [False, False], 0) == []
    assert pick([1.0, 0.5], [False, True], 10) == [0, 1]


def test_a_row_holds_the_total_and_every_reward_component():
    rows = sample_rows(
        7,
        ["1+1", "2+2"],
        ["2", "4"],
        ["<output>2</output>", "<output>5"],
        ["stop", "length"],
        [5, 24],
        [1.2, 0.0],
        {"exact_answer": [1.0, 0.0], "format": [1.0, 0.0]},
        k=2,
    )
    assert rows == [
        {
            "step": 7,
            "prompt": "1+1",
            "answer": "2",
            "completion": "<output>2</output>",
            "reward": 1.2,
            "rewards/exact_answer": 1.0,
            "rewards/format": 1.0,
            "finish_reason": "stop",
            "truncated": False,
            "tokens": 5,
        },
        {
            "step": 7,
            "prompt": "2+2",
            "answer": "4",
            "completion": "<output>5",
            "reward": 0.0,
            "rewards/exact_answer": 0.0,
            "rewards/format": 0.0,
            "finish_reason": "length",
            "truncated": True,
            "tokens": 24,
        },
    ]


def test_rows_round_trip_through_the_file(tmp_path):
    rows = [{"step": 1, "completion": "ünïcode ✓"}, {"step": 2, "completion": "b"}]
    append_rows(tmp_path / SAMPLES_FILE, rows[:1])
    append_rows(tmp_path / SAMPLES_FILE, rows[1:])
    assert read_rows(tmp_path / SAMPLES_FILE) == rows
    assert read_rows(tmp_path / "none.jsonl") == []


# ── the trainer writes them ────────────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """The tiny model trained 3 steps, 3 samples per step, an eval before training and after step 2."""
    from trainer.loop import GRPOTrainer

    root = tmp_path_factory.mktemp("samples")
    spec = load_spec(
        tiny_spec(
            tiny_model,
            optim={"steps": 3},
            rollout={"max_tokens": 24, "log_samples": 3},
            eval={"every": 2, "on_start": True, "max_tokens": 24, "log_samples": 2},
        )
    )
    trainer = GRPOTrainer(spec.trainer_config(), root / "run", progress=False)
    trainer.train()
    trainer.close()
    return spec, root / "run"


def test_every_step_writes_k_rows_with_its_reward_components(trained):
    spec, out = trained
    rows = read_rows(out / SAMPLES_FILE)
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(set(r) == ROW_KEYS | {"rewards/exact_answer", "rewards/length_bonus"} for r in rows)
    for r in rows:
        assert r["reward"] == pytest.approx(r["rewards/exact_answer"] + 0.1 * r["rewards/length_bonus"])
        assert r["truncated"] == (r["finish_reason"] == "length")
        assert not r["truncated"] or r["tokens"] == spec.rollout.max_tokens
        assert r["rewards/length_bonus"] == len(r["completion"])


def test_truncated_completions_of_a_step_are_always_among_its_rows(trained):
    """Per step: if any of the 8 completions was truncated, the first row shown is one (rows keep batch order, and
    truncated ones are picked first)."""
    _, out = trained
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = read_rows(out / SAMPLES_FILE)
    for m in (m for m in metrics if m["step"] > 0):
        shown = [r for r in rows if r["step"] == m["step"]]
        assert (sum(r["truncated"] for r in shown) > 0) == (m["completions/clipped_ratio"] > 0)


def test_every_eval_writes_its_rows_marked_with_the_step(trained):
    _, out = trained
    rows = read_rows(out / EVAL_SAMPLES_FILE)
    assert [r["step"] for r in rows] == [0, 0, 2, 2]
    assert all(set(r) == ROW_KEYS | {"rewards/exact_answer", "rewards/length_bonus"} for r in rows)


def test_a_resumed_run_drops_the_rows_of_steps_after_its_checkpoint(trained, tmp_path):
    """A run that died after step 3, before its step-3 checkpoint was complete, resumes from step 2."""
    from trainer.loop import GRPOTrainer

    spec, out = trained
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    shutil.rmtree(dict(list_checkpoints(copy / "checkpoints"))[3])
    trainer = GRPOTrainer(spec.trainer_config(), copy, progress=False)
    try:
        assert trainer.resume().name == "step-000002"
    finally:
        trainer.close()
    assert [r["step"] for r in read_rows(copy / SAMPLES_FILE)] == [1, 1, 1, 2, 2, 2]
    assert [r["step"] for r in read_rows(copy / EVAL_SAMPLES_FILE)] == [0, 0, 2, 2]


# ── the recorder logs them to MLflow as tables ─────────────────────────────────────────────────────


def test_the_train_stage_logs_samples_and_eval_samples_as_mlflow_tables(tiny_model, tmp_path):
    spec = load_spec(tiny_spec(tiny_model, project_dir=str(tmp_path)))
    tracking = Tracking(spec)
    run = RunRecorder.start(tracking, spec, ForkSource())
    rows = sample_rows(
        1,
        ["1+1", "2+2"],
        ["2", "4"],
        ["<output>2</output>", "<output>5"],
        ["stop", "length"],
        [5, 24],
        [1.0, 0.0],
        {"exact_answer": [1.0, 0.0]},
        k=2,
    )
    append_rows(run.output_dir / SAMPLES_FILE, rows)
    append_rows(run.output_dir / EVAL_SAMPLES_FILE, [{**rows[0], "step": 0}])
    with run.stage("train"):
        run.record(TrainOutcome(run.output_dir, 1, None, None))
    for run_id in (run.run_id, *stage_runs(tracking, run.run_id)):
        assert logged_rows(tracking, run_id, SAMPLES_TABLE) == rows
        assert logged_rows(tracking, run_id, EVAL_SAMPLES_TABLE) == [{**rows[0], "step": 0}]
    experiment = tracking.client.get_run(run.run_id).info.experiment_id  # and MLflow reads it as a table
    assert len(tracking.client.load_table(experiment, SAMPLES_TABLE, run_ids=[run.run_id])) == 2


def stage_runs(tracking, run_id) -> list[str]:
    experiment = tracking.client.get_run(run_id).info.experiment_id
    return [r.info.run_id for r in tracking.client.search_runs([experiment], f"tags.mlflow.parentRunId = '{run_id}'")]


def logged_rows(tracking, run_id, table) -> list[dict]:
    """The rows of an MLflow table artifact as logged (MLflow's load_table re-infers the types of its columns)."""
    logged = json.loads(Path(tracking.client.download_artifacts(run_id, table)).read_text())
    return [dict(zip(logged["columns"], values)) for values in logged["data"]]


def test_the_final_eval_stage_writes_its_rows_to_the_run_directory_too(tiny_model, tmp_path):
    """The final eval's samples reach the run directory's eval_samples.jsonl (issue 23 §10: they reached MLflow
    alone), after the rows in-training evals wrote, and the pipeline run's eval_samples.json mirrors that file: each
    row once, also when a resume records the final eval again."""
    from tasks.results import EvalResult

    spec = load_spec(tiny_spec(tiny_model, project_dir=str(tmp_path)))
    tracking = Tracking(spec)
    run = RunRecorder.start(tracking, spec, ForkSource())
    in_training = {"step": 2, "prompt": "1+1", "answer": "2", "completion": "<output>2</output>", "reward": 1.0}
    append_rows(run.output_dir / EVAL_SAMPLES_FILE, [in_training])
    final = [{**in_training, "step": 4, "completion": "<output>3</output>", "reward": 0.0}]
    with run.stage("eval"):
        run.record(EvalResult("file:///checkpoint", 4, {"eval/reward": 0.0}, final))
    assert read_rows(run.output_dir / EVAL_SAMPLES_FILE) == [in_training, *final]
    assert logged_rows(tracking, run.run_id, EVAL_SAMPLES_TABLE) == [in_training, *final]
    with run.stage("eval"):  # a resume that runs the final eval again (killed before the run was marked ended)
        run.record(EvalResult("file:///checkpoint", 4, {"eval/reward": 0.0}, final))
    assert read_rows(run.output_dir / EVAL_SAMPLES_FILE) == [in_training, *final]
    assert logged_rows(tracking, run.run_id, EVAL_SAMPLES_TABLE) == [in_training, *final]
    redrawn = [{**final[0], "completion": "<output>2</output>", "reward": 1.0}]  # a sampled eval on a GPU, again
    with run.stage("eval"):
        run.record(EvalResult("file:///checkpoint", 4, {"eval/reward": 1.0}, redrawn))
    assert read_rows(run.output_dir / EVAL_SAMPLES_FILE) == [in_training, *final]  # the rows of the scores held:
    history = tracking.client.get_metric_history(run.run_id, "eval/reward")
    assert [(m.step, m.value) for m in history] == [(4, 0.0)]
    assert logged_rows(tracking, run.run_id, EVAL_SAMPLES_TABLE) == [in_training, *final]


def test_a_final_eval_at_an_in_training_eval_step_leaves_that_evals_rows(tiny_model, tmp_path):
    """An in-training eval at the last step put its scores on the pipeline run: the run directory's rows at that
    step stay its own, whatever the final eval (on the reloaded checkpoint) drew; the eval stage's run holds the
    final eval's."""
    from tasks.results import EvalResult

    spec = load_spec(tiny_spec(tiny_model, project_dir=str(tmp_path)))
    tracking = Tracking(spec)
    run = RunRecorder.start(tracking, spec, ForkSource())
    in_training = {"step": 4, "prompt": "1+1", "answer": "2", "completion": "<output>2</output>", "reward": 1.0}
    append_rows(run.output_dir / EVAL_SAMPLES_FILE, [in_training])
    append_rows(run.output_dir / RECORD, [{"step": 4, "eval/reward": 1.0}])
    final = [{**in_training, "completion": "<output>3</output>", "reward": 0.0}]
    with run.stage("eval"):
        run.record(EvalResult("file:///checkpoint", 4, {"eval/reward": 0.0}, final))
        eval_run = run.stage_run
    assert read_rows(run.output_dir / EVAL_SAMPLES_FILE) == [in_training]
    assert logged_rows(tracking, run.run_id, EVAL_SAMPLES_TABLE) == [in_training]
    assert logged_rows(tracking, eval_run, EVAL_SAMPLES_TABLE) == final
