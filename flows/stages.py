"""The pipeline's stages as the flows that run them share them: one Prefect task per stage, the run opened (fork
verified first), the train / artifact-probe / eval stages here or on a node, what follows training, and `Watch`, which
tells each stage to the recorder and the view.

flows/pipeline.py runs them in order as the `ballast-pipeline` flow; a sweep's trial runners (flows/trials/) run
them too — a concurrent trial opens its run with `open_run` and ends through `after_training`, a worker node is
provisioned and torn down with `provision_task` / `teardown_task` — so these are the public names both read, and
neither reaches into the other's.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, Completed, Failed, Running, State

from flows.view import PipelineView
from tasks.checkpoint import CheckpointUploader, reachable_store, sync_checkpoints
from tasks.eval import eval_checkpoint
from tasks.fork import fork
from tasks.probe import probe_checkpoint, run_probe_args
from tasks.record import RunRecorder, StageError
from tasks.remote import Node, eval_on_node, probe_on_node, train_on_node
from tasks.results import RunInterrupted
from tasks.spec import ExperimentSpec, store_uri
from tasks.tracking import Tracking
from tasks.train import run_training

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


def after_training(spec: ExperimentSpec, run: RunRecorder, watch: Watch, outcome, node: Node | None = None):
    """checkpoint → artifact-probe → eval after the train stage, then the run's verdict: its PipelineResult (a
    sweep's concurrent trials, flows/trials/concurrent.py, end through here too)."""
    view = watch.view
    with watch.stage("checkpoint"):
        saved, keep = run.output_dir / "checkpoints", spec.checkpoint.keep_last
        checkpoints = checkpoint_task(run.store, run.checkpoint_prefix, saved, keep, run.run_id, spec.project_dir)
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
        was told then (a concurrent trial's train stage). Its start is told once its record exists: a signal after
        the line that says it started stops the stage the line names."""
        told, started = started is not None, started or time.perf_counter()
        try:
            with self.run.stage(name):
                if not told:
                    self.view.stage_started(name)
                    started = time.perf_counter()
                yield
        except BaseException as e:
            self.view.stage_ended(name, time.perf_counter() - started, e.cause if isinstance(e, StageError) else e)
            raise
        self.view.stage_ended(name, time.perf_counter() - started, None)

    def record(self, result) -> None:
        self.view.recorded(result)
        self.run.record(result)


def finish_training(o, outcome, error: BaseException | None):
    """The end of a run trained among others in one process (a sweep trial, a confirmation seed run; `o` has its
    spec, run, watch, progress, train task run and start time): its train task run ended, its train stage recorded,
    then checkpoint → artifact-probe → eval, as its pipeline run's. Ctrl-C or SIGTERM: a KeyboardInterrupt naming
    the interrupted run."""
    o.progress.close()
    o.task_run.end(outcome, error)
    try:
        with o.watch.stage("train", started=o.started):
            if error is not None:
                raise error
            o.watch.record(outcome)
            outcome.raise_if_interrupted()
        return after_training(o.spec, o.run, o.watch, outcome)
    except (RunInterrupted, KeyboardInterrupt, TerminationSignal) as e:
        raise KeyboardInterrupt(str(o.run.interrupted(e))) from e


class TrainTaskRun:
    """The train stage of a run trained among others in this process (a sweep's concurrent trial, a confirmation
    seed run) as a Prefect task run of the flow run it trains in, named `train <run>` (`train trial-7`), so the
    flow run shows each run's training where it would otherwise show an idle gap. No task engine runs it — the
    runs' steps are interleaved in one engine call (tasks/train.py ConcurrentTraining) — so it is created Running
    when the run starts training (the pipeline's `train` task, so the same task key) and set to its end state when
    its training ends (`train_state`). Outside a flow run it is nothing; Prefect's API failing never fails the run
    (a line says what was not recorded)."""

    def __init__(self, name: str):
        self.name, self.id = name, None
        context = FlowRunContext.get()
        if context is None or context.flow_run is None:
            return
        try:
            with get_client(sync_client=True) as client:
                run = client.create_task_run(
                    train_task, context.flow_run.id, name, name=f"train {name}", state=Running()
                )
            self.id = run.id
        except Exception as e:
            print(f"{name}: its train stage is not a Prefect task run: {type(e).__name__}: {e}", flush=True)

    def end(self, outcome, error: BaseException | None) -> None:
        """Its end state (once; later calls do nothing)."""
        if self.id is None:
            return
        task_run_id, self.id = self.id, None
        try:
            with get_client(sync_client=True) as client:
                client.set_task_run_state(task_run_id, train_state(outcome, error), force=True)
        except Exception as e:
            print(f"{self.name}: its train task run's end was not recorded: {type(e).__name__}: {e}", flush=True)


def train_state(outcome, error: BaseException | None) -> State:
    """A concurrently trained run's train task run state, from how its training ended: an error → Failed; a signal
    (SIGTERM, Ctrl-C) → Cancelled; trained to its last step → Completed; stopped early at a safe point by the
    pruner or the health gate → Completed named "Pruned" or "Collapsed", the stop reason as its message — Completed,
    because the stage did its job (its checkpoint is saved where it stopped, and checkpoint → artifact-probe → eval
    read it, as a pruned sequential trial's pipeline run does); the name marks it in the flow run's graph."""
    if error is not None:
        signal = isinstance(error, (RunInterrupted, TerminationSignal)) or not isinstance(error, Exception)
        if signal:
            return Cancelled(message=f"interrupted: {type(error).__name__}: {error}")
        return Failed(message=f"{type(error).__name__}: {error}")
    if outcome is None:
        return Failed(message="training ended with no outcome")
    if outcome.interrupted:
        return Cancelled(message=f"interrupted by {outcome.interrupted} after step {outcome.last_step}")
    if outcome.stopped:
        reason = str(outcome.stopped)
        name = {"pruned": "Pruned", "collapsed": "Collapsed"}.get(reason.split(":")[0], "Stopped")
        return Completed(name=name, message=f"stopped after step {outcome.last_step}: {reason}")
    return Completed(message=f"trained {outcome.last_step} steps")
