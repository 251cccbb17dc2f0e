"""The pipeline flow: fork → train → checkpoint → artifact-probe → eval, one Prefect task per stage and one
MLflow run per pipeline run with a nested run per stage.

    ballast run examples/quickstart.yaml [--set K=V]...      # the CLI (flows/cli.py) calls ballast_pipeline
    ballast run --resume RUN_ID
    prefect deploy --all                                     # prefect.yaml deploys run_experiment

Two flows, one name (`ballast-pipeline`) and one body (`run_stages`): `ballast_pipeline` takes what the CLI and
sweeps pass (a spec mapping, trainer callbacks, tags, no terminal); `run_experiment` is the deployment's entrypoint,
whose signature is the Prefect Run form — a spec path, "key.path=value" overrides and a run to resume, each
described — so nothing internal shows there, and a spec error names `overrides`, not the CLI's `--set`.

Where the GPU stages run is a parameter, `infra.compute`: `here` runs every stage in the flow's process; with
`local` or `skypilot` a provision stage comes first and a teardown stage last (always), and train, artifact-probe
and eval run on the node through the store (tasks/remote.py), each coming back as the result a local stage returns
— the choice sits in `train_stage`, `probe_stage` and `eval_stage`, not in the sequence.

The stages are plain functions in tasks/ that return typed results; the recorder (tasks/record.py) turns them
into MLflow records and the view (flows/view.py) into lines for the terminal and Prefect; the flow tells each.
The flow run is named for the MLflow run once it exists (`<spec>-<run id[:8]>`), and `<spec>-failed` when the run
fails before that; the MLflow run is tagged with the flow run's id and URL.

The fork is verified before any MLflow run or output directory exists, so a bad fork source leaves nothing
half-made. A failing stage fails its nested run and the pipeline run with the reason;
checkpoints already saved stay, locally and in the store, for `--resume`. A tracking server or store that is
down fails the run at its start; one that goes away mid-run does not stop training (tasks/metrics_sink.py,
tasks/checkpoint.py), and the run's end names what waits on disk and the command that sends it. SIGTERM or
Ctrl-C stop training at a safe point (a checkpoint after the current step): MLflow records the run KILLED,
Prefect Cancelled ("Interrupted"), and the message says how to resume.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, Completed, Failed

from flows.view import PipelineView, flow_run_link, name_failed_start, starting_name
from tasks.checkpoint import CheckpointUploader, reachable_store, sync_checkpoints
from tasks.eval import eval_checkpoint
from tasks.fork import fork
from tasks.metrics_sink import TrackingUnavailable
from tasks.probe import probe_checkpoint, run_probe_args
from tasks.record import RunRecorder, StageError
from tasks.remote import (
    Node,
    NodeChoice,
    check_compute,
    eval_on_node,
    open_compute,
    probe_on_node,
    record_usage,
    train_on_node,
)
from tasks.spec import ExperimentSpec, SpecError, load_spec
from tasks.summary import PipelineResult
from tasks.tracking import Tracking, store_uri
from tasks.train import RunInterrupted, run_training

NO_RESULT = dict(cache_policy=NO_CACHE, persist_result=False)
fork_task = task(fork, name="fork", **NO_RESULT)
train_task = task(run_training, name="train", **NO_RESULT)
checkpoint_task = task(sync_checkpoints, name="checkpoint", retries=2, retry_delay_seconds=3, **NO_RESULT)
probe_task = task(probe_checkpoint, name="artifact-probe", **NO_RESULT)
eval_task = task(eval_checkpoint, name="eval", **NO_RESULT)
provision_task = task(lambda compute: compute.provision(), name="provision", **NO_RESULT)
node_train_task = task(train_on_node, name="train", **NO_RESULT)
node_probe_task = task(probe_on_node, name="artifact-probe", **NO_RESULT)
node_eval_task = task(eval_on_node, name="eval", **NO_RESULT)
teardown_task = task(lambda compute: compute.teardown(), name="teardown", **NO_RESULT)
FLOW = dict(name="ballast-pipeline", flow_run_name=starting_name, persist_result=False, log_prints=True)


@flow(**FLOW, validate_parameters=False)
def ballast_pipeline(
    spec: ExperimentSpec | str | dict,
    overrides: list[str] | None = None,
    resume_run_id: str | None = None,
    parent_run_id: str | None = None,
    tags: dict | None = None,
    callbacks: list | None = None,
    progress: bool = True,
) -> PipelineResult:
    """The pipeline as the CLI and sweeps call it: `spec` an experiment YAML path or the spec as a mapping, sweep
    trials' `parent_run_id`, `tags` and trainer `callbacks` (Optuna pruning), `progress` False for no terminal."""
    try:
        spec = load_spec(spec, overrides or []) if not isinstance(spec, ExperimentSpec) else spec
    except BaseException:
        name_failed_start()
        raise
    return run_stages(spec, resume_run_id, parent_run_id, tags, callbacks, progress)


@flow(**FLOW, validate_parameters=True)
def run_experiment(
    spec: str = "examples/quickstart.yaml",
    overrides: list[str] | None = None,
    resume_run_id: str | None = None,
    node: NodeChoice | None = None,
) -> PipelineResult:
    """Fork → train → checkpoint → artifact-probe → eval on one experiment spec (the Run form of the
    `ballast-pipeline` deployment; the CLI's `ballast run` runs the same stages).

    Args:
        spec: Path of the experiment YAML, relative to the checkout the worker runs from, e.g.
            examples/quickstart.yaml.
        overrides: Spec fields to change for this run, one "key.path=value" string each, e.g. grpo.beta=0.1 or
            optim.steps=50 (the value is read as YAML).
        resume_run_id: To continue an interrupted run instead: its MLflow run id or name (the spec and overrides
            are then the run's own).
        node: Where the GPU stages run (infra.*): e.g. compute skypilot, accelerators H100:1, use_spot; the
            spec's infra section when left empty.
    """
    try:
        loaded = load_spec(spec, [*(node.overrides() if node else []), *(overrides or [])])
        check_compute(loaded)  # a placement the node could not use fails here, before anything is provisioned
    except SpecError as e:  # the form has no --set: the message names what the user filled in
        name_failed_start()
        raise SpecError(str(e).replace("--set ", "overrides: ")) from None
    except BaseException:
        name_failed_start()
        raise
    return run_stages(loaded, resume_run_id)


def run_stages(
    spec: ExperimentSpec,
    resume_run_id: str | None = None,
    parent_run_id: str | None = None,
    tags: dict | None = None,
    callbacks: list | None = None,
    progress: bool = True,
) -> PipelineResult:
    """The stages, in order. The recorder (MLflow) and the view (terminal, Prefect's run log) are each told what
    happened by this flow; neither calls the other."""
    view = PipelineView(spec.optim.steps, terminal=progress)  # the terminal and Prefect's run log (flows/view.py)
    try:
        run = open_run(spec, view, resume_run_id, parent_run_id, {**(tags or {}), **flow_run_link()})
    except BaseException:
        name_failed_start()
        raise
    view.opened(run.name, run.url, spec.name)
    watch = Watch(run, view)
    node = None  # infra.compute: here runs every stage in this process; local or skypilot, the GPU stages on a node
    try:
        if spec.infra.compute != "here":
            node = open_compute(spec, run.tracking.uri, run.run_id)
            with watch.stage("provision"):
                provision_task(node.compute)
        with watch.stage("train"):
            outcome = train_stage(spec, run, view, callbacks or [], node)
            watch.record(outcome)
            outcome.raise_if_interrupted()
        return final_state(after_training(spec, run, watch, outcome, node))
    except (RunInterrupted, KeyboardInterrupt, TerminationSignal) as e:  # SIGTERM, Ctrl-C: KILLED, and Cancelled
        stop = run.interrupted(e)
        return Cancelled(name="Interrupted", message=str(stop), data=stop)
    except TrackingUnavailable as e:  # the server went away: nothing more can be recorded, the metrics wait on disk
        lost = run.metrics.lost(e)
        return Failed(name="TrackingUnavailable", message=str(lost), data=lost)
    except BaseException as e:
        run.fail(e)
        raise
    finally:
        if node is not None:  # always: success, failure, cancellation, Ctrl-C (SkyPilot's autodown if we die)
            teardown_task(node.compute)
            view.say(record_usage(run, node.compute.usage()))


def after_training(spec: ExperimentSpec, run: RunRecorder, watch: Watch, outcome, node: Node | None = None):
    """checkpoint → artifact-probe → eval after the train stage, then the run's verdict: its PipelineResult (a
    sweep's concurrent trials, flows/sweep.py, end through here too)."""
    view = watch.view
    with watch.stage("checkpoint"):
        saved, keep = run.output_dir / "checkpoints", spec.checkpoint.keep_last
        checkpoints = checkpoint_task(run.store, run.checkpoint_prefix, saved, keep, run.run_id)
        watch.record(checkpoints)
    if spec.probe.enabled:
        with watch.stage("artifact-probe"):
            for report in probe_stage(spec, run, view, checkpoints, node):
                watch.record(report)
    with watch.stage("eval"):
        evaluation = eval_stage(spec, run, view, checkpoints, node)
        watch.record(evaluation)
    result = run.finish(outcome, checkpoints, evaluation)
    view.finished(result)
    return result


def train_stage(spec: ExperimentSpec, run: RunRecorder, view: PipelineView, callbacks: list, node: Node | None):
    """The train task here (metrics to MLflow, checkpoints to the store as they are saved) or on the node, which
    sends its metrics and checkpoints itself and whose step lines reach `view` and `callbacks`."""
    if node is not None:
        hooks = [view, *callbacks]
        return node_train_task(node.compute, node.command("train"), run, hooks, view.say, spec.infra.max_restarts)
    uploader = CheckpointUploader(run.store, run.checkpoint_prefix)
    hooks = [run.metrics, run.headline, uploader, view, *callbacks]
    return train_task(spec, run.output_dir, hooks, run.source, resume=run.resumed, progress=view.bar)


def probe_stage(spec: ExperimentSpec, run: RunRecorder, view: PipelineView, checkpoints, node: Node | None):
    """The probe reports of the final checkpoint (or of every one, probe.every_checkpoint), one at a time: probed
    here, or on the node from the store, whose reports come back the same."""
    uris = checkpoints.uris if spec.probe.every_checkpoint else {checkpoints.final_step: checkpoints.final_uri}
    if node is not None:
        yield from node_probe_task(node, run.store, list(uris), view.say, spec.infra.max_restarts)
        return
    for uri in uris.values():
        yield probe_task(uri, **run_probe_args(spec, run.cache_dir))


def eval_stage(spec: ExperimentSpec, run: RunRecorder, view: PipelineView, checkpoints, node: Node | None):
    """The final checkpoint's held-out scores: evaluated here, or on the node from the store (the same EvalResult)."""
    if node is not None:
        return node_eval_task(node, run.store, checkpoints.final_step, view.say, spec.infra.max_restarts)
    return eval_task(spec, checkpoints.final_uri, run.cache_dir / "eval")


def open_run(
    spec: ExperimentSpec, view: PipelineView, resume_run_id: str | None, parent_run_id: str | None, tags: dict
) -> RunRecorder:
    """The run recorder of a resumed run, or of a new one after the fork stage (verified before any MLflow run or
    output directory exists, so a bad fork source leaves nothing behind)."""
    tracking = Tracking(spec)
    reachable_store(store_uri(spec))  # a store that is down fails the run here, not after training
    if resume_run_id:
        return RunRecorder.resume(tracking, spec, resume_run_id, tags)
    try:
        source = fork_task(spec, tracking.checkpoint_prefix)
    except Exception as e:
        raise StageError("fork", e) from e
    run = RunRecorder.start(tracking, spec, source, parent_run_id, tags)
    watch = Watch(run, view)
    with watch.stage("fork"):
        watch.record(source)
    return run


class Watch:
    """What the flow tells about a stage, told to both who keep it: the recorder (a nested MLflow run, the result's
    records) and the view (a line when it starts, ends and what it found)."""

    def __init__(self, run: RunRecorder, view: PipelineView):
        self.run, self.view = run, view

    @contextmanager
    def stage(self, name: str, started: float | None = None):
        """The stage's records and lines around the block; `started` (perf_counter): it began earlier, and its start
        was told then (a concurrent trial's train stage)."""
        if started is None:
            self.view.stage_started(name)
            started = time.perf_counter()
        try:
            with self.run.stage(name):
                yield
        except BaseException as e:
            self.view.stage_ended(name, time.perf_counter() - started, e.cause if isinstance(e, StageError) else e)
            raise
        self.view.stage_ended(name, time.perf_counter() - started, None)

    def record(self, result) -> None:
        self.view.recorded(result)
        self.run.record(result)


PREFECT_STATES = {
    "collapsed": (Failed, "Collapsed"),
    "probe_failed": (Failed, "ProbeFailed"),
    "pruned": (Cancelled, "Pruned"),
}


def final_state(result: PipelineResult):
    """How the flow run ends in Prefect: Completed for a finished run; a collapsed or probe-failed run Failed and a
    pruned one Cancelled, named for what happened (the UI shows the name), the result in the state either way."""
    kind, name = PREFECT_STATES.get(result.status, (Completed, "Completed"))
    return kind(name=name, message=str(result.stopped or result.status), data=result)


def run_pipeline(*args, flow_run_name: str | None = None, **kwargs) -> PipelineResult:
    """Call the pipeline flow and return its PipelineResult, whatever state the run ended in; an error raises."""
    flow_fn = ballast_pipeline.with_options(flow_run_name=flow_run_name) if flow_run_name else ballast_pipeline
    state = flow_fn(*args, return_state=True, **kwargs)
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):
        raise result
    return result
