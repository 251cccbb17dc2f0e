"""The pipeline flow: fork → train → checkpoint → artifact-probe → eval, one Prefect task per stage and one
MLflow run per pipeline run with a nested run per stage.

    ballast run examples/quickstart.yaml [--set K=V]...      # the CLI (flows/cli.py) calls this flow
    ballast run --resume RUN_ID
    prefect deploy --all                                     # prefect.yaml deploys the same flow

The stages are plain functions in tasks/ that return typed results; the recorder (tasks/record.py) turns them
into MLflow records. The fork is verified before any MLflow run or output directory exists, so a bad fork
source leaves nothing half-made. A failing stage fails its nested run and the pipeline run with the reason;
checkpoints already saved stay, locally and in the store, for `--resume`. A tracking server or store that is
down fails the run at its start; one that goes away mid-run does not stop training (tasks/metrics_sink.py,
tasks/checkpoint.py), and the run's end names what waits on disk and the command that sends it. SIGTERM or
Ctrl-C stop training at a safe point (a checkpoint after the current step): MLflow records the run KILLED,
Prefect Cancelled ("Interrupted"), and the message says how to resume.
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, Completed, Failed

from flows.view import PipelineView, starting_name
from tasks.checkpoint import CheckpointUploader, reachable_store, sync_checkpoints
from tasks.eval import eval_checkpoint
from tasks.fork import fork
from tasks.metrics_sink import TrackingUnavailable
from tasks.probe import probe_checkpoint
from tasks.record import RunRecorder, StageError, Tracking, store_uri
from tasks.spec import load_spec
from tasks.summary import PipelineResult
from tasks.train import RunInterrupted, run_training

NO_RESULT = dict(cache_policy=NO_CACHE, persist_result=False)
fork_task = task(fork, name="fork", **NO_RESULT)
train_task = task(run_training, name="train", **NO_RESULT)
checkpoint_task = task(sync_checkpoints, name="checkpoint", retries=2, retry_delay_seconds=3, **NO_RESULT)
probe_task = task(probe_checkpoint, name="artifact-probe", **NO_RESULT)
eval_task = task(eval_checkpoint, name="eval", **NO_RESULT)


@flow(
    name="ballast-pipeline",
    flow_run_name=starting_name,
    persist_result=False,
    log_prints=True,
    validate_parameters=False,
)
def ballast_pipeline(
    spec: str | dict,
    overrides: list[str] | None = None,
    resume_run_id: str | None = None,
    parent_run_id: str | None = None,
    tags: dict | None = None,
    callbacks: list | None = None,
    progress: bool = True,
) -> PipelineResult:
    """`spec` is an experiment YAML path (deployments) or the spec as a mapping (the CLI, sweeps)."""
    spec = load_spec(spec, overrides or [])
    view = PipelineView(spec.optim.steps, terminal=progress)  # the terminal and Prefect's run log (flows/view.py)
    run = open_run(spec, view, resume_run_id, parent_run_id, tags)
    try:
        with run.stage("train"):
            uploader = CheckpointUploader(run.store, run.checkpoint_prefix)
            hooks = [run.metrics, uploader, view, *(callbacks or [])]
            outcome = train_task(spec, run.output_dir, hooks, run.source, resume=run.resumed, progress=view.bar)
            run.record(outcome)
            outcome.raise_if_interrupted()
        with run.stage("checkpoint"):
            saved, keep = run.output_dir / "checkpoints", spec.checkpoint.keep_last
            checkpoints = checkpoint_task(run.store, run.checkpoint_prefix, saved, keep, run.run_id)
            run.record(checkpoints)
        if spec.probe.enabled:
            with run.stage("artifact-probe"):
                caches = dict(lora_cfg=spec.lora, baseline_cache=run.cache_dir.parent / "probe-baseline")
                for uri in checkpoints.uris.values() if spec.probe.every_checkpoint else [checkpoints.final_uri]:
                    run.record(probe_task(uri, spec.probe, spec.model, run.cache_dir / "probe", **caches))
        with run.stage("eval"):
            evaluation = eval_task(spec, checkpoints.final_uri, run.cache_dir / "eval")
            run.record(evaluation)
        return final_state(run.finish(outcome, checkpoints, evaluation))
    except (RunInterrupted, KeyboardInterrupt, TerminationSignal) as e:  # SIGTERM, Ctrl-C: KILLED, and Cancelled
        stop = run.interrupted(e)
        return Cancelled(name="Interrupted", message=str(stop), data=stop)
    except TrackingUnavailable as e:  # the server went away: nothing more can be recorded, the metrics wait on disk
        lost = run.metrics.lost(e)
        return Failed(name="TrackingUnavailable", message=str(lost), data=lost)
    except BaseException as e:
        run.fail(e)
        raise


def open_run(spec, view, resume_run_id, parent_run_id, tags) -> RunRecorder:
    """The run recorder of a resumed run, or of a new one after the fork stage (verified before any MLflow run or
    output directory exists, so a bad fork source leaves nothing behind)."""
    tracking = Tracking(spec)
    reachable_store(store_uri(spec))  # a store that is down fails the run here, not after training
    if resume_run_id:
        return RunRecorder.resume(tracking, spec, resume_run_id, view=view)
    try:
        source = fork_task(spec, tracking.checkpoint_prefix)
    except Exception as e:
        raise StageError("fork", e) from e
    run = RunRecorder.start(tracking, spec, source, parent_run_id, tags, view=view)
    with run.stage("fork"):
        run.record(source)
    return run


PREFECT_STATES = {
    "collapsed": (Failed, "Collapsed"),
    "probe_failed": (Failed, "ProbeFailed"),
    "pruned": (Cancelled, "Pruned"),
}


def final_state(result: PipelineResult):
    """How the flow run ends in Prefect: Completed for a finished run; a collapsed or probe-failed run Failed and a
    pruned one Cancelled, named for what happened (the UI shows the name), the result in the state either way."""
    kind, name = PREFECT_STATES.get(result.status, (Completed, "Completed"))
    return kind(name=name, message=result.stopped or result.status, data=result)


def run_pipeline(*args, flow_run_name: str | None = None, **kwargs) -> PipelineResult:
    """Call the pipeline flow and return its PipelineResult, whatever state the run ended in; an error raises."""
    flow_fn = ballast_pipeline.with_options(flow_run_name=flow_run_name) if flow_run_name else ballast_pipeline
    state = flow_fn(*args, return_state=True, **kwargs)
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):
        raise result
    return result
