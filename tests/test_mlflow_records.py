"""What a pipeline run looks like in MLflow, read back from a real tracking store (SQLite): the experiment is a
model-training one, runs have names that tell them apart, MLflow's own source/commit/user fields and a description
that says what the run was and how it ended; tags are short enough to read on the run page (long facts are params);
links open the UI in its model-training mode. The recorder is driven with stage results directly (no model), the
same calls the pipeline flow makes."""

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.checkpoint import CheckpointSet
from tasks.fork import ForkSource
from tasks.record import RunRecorder
from tasks.results import EvalResult, TrainOutcome
from tasks.spec import load_spec
from tasks.tracking import DEFAULT_UI_URL, EXPERIMENT_KIND, Tracking
from tests.conftest import tiny_spec
from trainer.checkpoint import code_ref

MAX_CHIP = 44  # characters of "key: value" that fit a tag chip on MLflow's run page without truncating the key


def spec_in(project: Path, **sections):
    return load_spec(tiny_spec("/models/not-loaded-here", name="records", project_dir=str(project), **sections))


def outcome(run: RunRecorder, steps: int = 6, stopped: str | None = None) -> TrainOutcome:
    history = [
        {
            "step": s,
            "reward": 0.1 * s,
            "kl": 0.01 * s,
            "kl/k1": 0.01 * s,
            "kl/k2": 0.01,
            "kl/k3": 0.01 * s,
            "completions/mean_length": 10.0 + s,
            "entropy": 1.0 / s,
        }
        for s in range(1, steps + 1)
    ]
    return TrainOutcome(run.output_dir, steps, stopped, None, history, 12.5, None)


def finished(run: RunRecorder, stopped: str | None = None):
    with run.stage("train"):
        train = outcome(run, stopped=stopped)
        run.record(train)
    checkpoints = CheckpointSet({6: str(run.output_dir / "checkpoints" / "step-000006")})
    return run.finish(train, checkpoints, EvalResult(checkpoints.final_uri, 6, {"eval/reward": 0.75}))


@pytest.fixture(scope="module")
def tracking(tmp_path_factory):
    """One tracking store for the module (creating MLflow's tables takes seconds); every test makes its own runs."""
    return Tracking(spec_in(tmp_path_factory.mktemp("records")))


def test_the_experiment_is_marked_model_training_not_genai(tracking):
    experiment = tracking.client.get_experiment(tracking.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == EXPERIMENT_KIND == "custom_model_development"


def test_an_experiment_made_before_the_mark_gets_it(tmp_path):
    spec = spec_in(tmp_path)
    client = MlflowClient(f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}")
    old = client.create_experiment(spec.tracking.experiment)
    assert Tracking(spec).experiment_id == old
    assert client.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"


def test_runs_of_one_spec_have_distinct_names_made_of_the_spec_and_the_run_id(tracking):
    a = RunRecorder.start(tracking, tracking.spec, ForkSource())
    b = RunRecorder.start(tracking, tracking.spec, ForkSource())
    assert a.name == f"records-{a.run_id[:8]}" and b.name == f"records-{b.run_id[:8]}" and a.name != b.name
    assert tracking.client.get_run(a.run_id).info.run_name == a.name


def test_a_stage_run_is_named_for_its_stage_and_its_pipeline_run(tracking):
    run = RunRecorder.start(tracking, tracking.spec, ForkSource())
    with run.stage("checkpoint"):
        stage_id = run.stage_run
    assert tracking.client.get_run(stage_id).info.run_name == f"checkpoint · {run.name}"


def test_mlflow_source_commit_and_user_are_set(tracking):
    run = RunRecorder.start(tracking, tracking.spec, ForkSource())
    tags = tracking.client.get_run(run.run_id).data.tags
    assert tags["mlflow.source.git.commit"] == code_ref()["commit"]
    assert tags["mlflow.source.name"] == "flows/pipeline.py:ballast_pipeline"
    assert tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.user"]


def test_the_description_says_what_the_run_is_while_it_runs(tracking):
    run = RunRecorder.start(tracking, tracking.spec, ForkSource())
    note = tracking.client.get_run(run.run_id).data.tags["mlflow.note.content"]
    assert note.startswith(
        "**Running.**\n\nGRPO fine-tuning of `/models/not-loaded-here` (LoRA r=8) on `arith` for "
        "4 steps, from the base model"
    )


def test_the_description_says_how_a_finished_run_ended(tracking):
    run = RunRecorder.start(tracking, tracking.spec, ForkSource())
    finished(run)
    note = tracking.client.get_run(run.run_id).data.tags["mlflow.note.content"]
    assert note.startswith("**Ended: finished.**")
    assert "- reward (training batches): first 3 steps 0.200 → last 3 steps 0.500" in note
    assert "- eval/reward (held out): 0.750" in note


def test_the_description_of_a_collapsed_run_gives_the_reason(tracking):
    run = RunRecorder.start(tracking, tracking.spec, ForkSource())
    finished(run, stopped="collapsed: kl=2 > 1 for 2 consecutive steps")
    note = tracking.client.get_run(run.run_id).data.tags["mlflow.note.content"]
    assert "**Ended: collapsed** — collapsed: kl=2 > 1 for 2 consecutive steps." in note


def test_the_description_of_a_failed_run_names_the_error_and_the_resume_command(tracking):
    run = RunRecorder.start(tracking, tracking.spec, ForkSource())
    run.fail(RuntimeError("stage 'checkpoint' failed: the store is down"))
    note = tracking.client.get_run(run.run_id).data.tags["mlflow.note.content"]
    assert "**Ended: failed.** stage 'checkpoint' failed: the store is down" in note
    assert f"`ballast run --resume {run.run_id} --project-dir {tracking.spec.project_dir}`" in note  # not .ballast


def test_every_ballast_tag_fits_a_chip_on_the_run_page(tracking):
    source = ForkSource(
        checkpoint_uri="s3://bucket/a/long/prefix/runs/0123456789abcdef/checkpoints/step-000002",
        parent_run_id="0123456789abcdef0123456789abcdef",
        parent_step=2,
        max_logprob_diff=9.5367431640625e-07,
    )
    run = RunRecorder.start(tracking, tracking.spec, source)
    finished(run)
    tags = {k: v for k, v in tracking.client.get_run(run.run_id).data.tags.items() if k.startswith("ballast.")}
    assert {"ballast.status", "ballast.spec_hash", "ballast.parent_step", "ballast.fork_logprob_diff"} <= set(tags)
    # the one exception: the fork's parent run id is a tag so that MLflow's search can filter a run's forks
    # (`tags."ballast.parent_run_id" = '…'`); a 32-character id does not fit a chip, and the run page shows it cut
    too_long = {k: v for k, v in tags.items() if len(f"{k}: {v}") > MAX_CHIP and k != "ballast.parent_run_id"}
    assert not too_long
    assert tags["ballast.parent_run_id"] == source.parent_run_id


def test_long_facts_are_params_and_read_back_as_lineage(tracking):
    source = ForkSource(checkpoint_uri="/somewhere/checkpoints/step-000002", parent_run_id="f" * 32, parent_step=2)
    run = RunRecorder.start(tracking, tracking.spec, source)
    params = tracking.client.get_run(run.run_id).data.params
    assert params["ballast.output_dir"] == str(run.output_dir)
    assert params["ballast.code_commit"] == code_ref()["commit"]
    assert tracking.client.get_run(run.run_id).data.tags["ballast.parent_run_id"] == "f" * 32  # a tag: searchable
    assert tracking.output_dir_of(run.run_id) == run.output_dir
    again = tracking.fork_source_of(run.run_id)
    assert (again.checkpoint_uri, again.parent_run_id, again.parent_step) == (source.checkpoint_uri, "f" * 32, 2)


def test_run_links_open_the_embedded_store_in_model_training_mode(tracking):
    run = RunRecorder.start(tracking, tracking.spec, ForkSource())
    assert run.url == (
        f"{DEFAULT_UI_URL}/#/experiments/{tracking.experiment_id}/runs/{run.run_id}?workflowType=machine_learning"
    )


def test_tracking_ui_url_overrides_where_links_point(tmp_path):
    tracking = Tracking(spec_in(tmp_path, tracking={"ui_url": "https://mlflow.example.org/"}))
    assert tracking.run_url("abc").startswith("https://mlflow.example.org/#/experiments/")


def test_the_run_report_links_the_spec_the_mlflow_run_and_the_commit(tracking):
    run = RunRecorder.start(tracking, tracking.spec, ForkSource())
    result = finished(run)
    html = Path(result.reports["run"]).read_text()
    assert 'href="spec.yaml"' in html and f'href="{run.url}"' in html
    assert f"<code>{code_ref()['commit'][:12]}</code>" in html
    assert result.mlflow_url == run.url and result.run_name == run.name


@pytest.mark.parametrize("flat", [False, True], ids=["stage-run", "sweep-trial"])
def test_ctrl_c_under_a_library_error_stops_the_stage_as_killed_not_failed(tracking, flat):
    """Ctrl-C landing in Prefect's task engine before its task run exists makes the engine's crash handler raise
    ValueError('Task run is not set') while it handles the KeyboardInterrupt (seen in CI: the run said 'stage
    artifact-probe failed', exit 1). The stage reads it as the signal it is: the KeyboardInterrupt goes on, the stage
    is KILLED (a sweep trial's run tagged with the stage), and the run knows which stage the signal stopped."""
    run = RunRecorder.start(tracking, tracking.spec, ForkSource())
    run.flat_stages = flat
    with pytest.raises(KeyboardInterrupt):
        with run.stage("artifact-probe"):
            stage_id = run.stage_run
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise ValueError("Task run is not set")  # noqa: B904 (as Prefect raises it)
    assert run.signalled_stage == "artifact-probe"
    recorded = tracking.client.get_run(stage_id)
    if flat:
        assert recorded.data.tags["ballast.failed_stage"] == "artifact-probe"
    else:
        assert recorded.info.status == "KILLED"
        assert recorded.data.tags["ballast.error"] == "ValueError: Task run is not set"


def test_a_signal_while_the_stage_run_is_created_stops_that_stage(tracking, monkeypatch):
    """The stage's line is printed once its MLflow run exists; a SIGTERM that lands while MLflow creates it (seen in
    CI: the line said 'stopped during a step' for a signal sent as the artifact probe started) still stops the stage
    it was for, and the run's stop line names it."""
    run = RunRecorder.start(tracking, tracking.spec, ForkSource())
    create_run = tracking.create_run
    created = []

    def signalled_as_mlflow_answers(*args, **kwargs):
        created.append(create_run(*args, **kwargs))
        raise KeyboardInterrupt  # the signal, as the handler raises it, between MLflow's answer and the stage's block

    monkeypatch.setattr(tracking, "create_run", signalled_as_mlflow_answers)
    with pytest.raises(KeyboardInterrupt):
        with run.stage("artifact-probe"):
            raise AssertionError("the stage's block does not run")
    assert run.signalled_stage == "artifact-probe"
    assert run.stage_run is None
    assert tracking.client.get_run(created[0]).info.status == "RUNNING"  # the stage never got its run's id
    assert "during its artifact-probe stage" in str(run.interrupted(KeyboardInterrupt()))
    assert tracking.client.get_run(created[0]).info.status == "KILLED"  # the run's stop closes what it left open
    assert tracking.client.get_run(run.run_id).info.status == "KILLED"


def test_a_library_error_with_no_signal_behind_it_fails_the_stage(tracking):
    """The other side: the same ValueError with no signal under it is the stage's failure (StageError, FAILED)."""
    from tasks.record import StageError

    run = RunRecorder.start(tracking, tracking.spec, ForkSource())
    with pytest.raises(StageError, match="stage 'artifact-probe' failed: ValueError: Task run is not set"):
        with run.stage("artifact-probe"):
            stage_id = run.stage_run
            raise ValueError("Task run is not set")
    assert run.signalled_stage == "train"  # as it was: no signal stopped this stage
    assert tracking.client.get_run(stage_id).info.status == "FAILED"


def test_writers_tagging_one_run_at_once_all_succeed_and_the_tag_holds_one_of_their_values(tracking):
    """A sweep's workers tag its parent run (the baseline, the summary) at the same moments; MLflow's set_tag reads
    the tag and then inserts it, so the second writer used to fail on the store's unique key (CI, 2026-12-06: a
    Postgres sweep's second worker exited 1 recording the baseline both had measured)."""
    import threading

    run_id = tracking.create_run("tagged-by-many")
    keys, writers = [f"k{j}" for j in range(20)], 4
    barrier, errors = threading.Barrier(writers), []

    def write(i: int) -> None:
        for key in keys:
            barrier.wait()  # every writer sets the same new tag at once
            try:
                tracking.set_tags(run_id, {key: f"writer {i}"})
            except Exception as e:  # noqa: BLE001 - collected, asserted below
                errors.append(f"{type(e).__name__}: {str(e)[:120]}")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    tags = tracking.tags(run_id)
    assert all(tags["ballast." + key] in {f"writer {i}" for i in range(writers)} for key in keys)
