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
— the choice sits in `train_stage`, `probe_stage` and `eval_stage` (flows/stages.py, the stages' public home, which
a sweep's trial runners share), not in the sequence.

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

from prefect import flow
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, Completed, Failed

from flows.stages import Watch, after_training, open_run, provision_task, teardown_task, train_stage
from flows.view import PipelineView, flow_run_link, name_failed_start, starting_name
from tasks.metrics_sink import TrackingUnavailable
from tasks.remote import NodeChoice, check_compute, open_compute, record_usage
from tasks.results import PipelineResult, RunInterrupted
from tasks.spec import ExperimentSpec, SpecError, load_spec

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
        lost = run.metrics.lost(e, spec.project_dir)
        return Failed(name="TrackingUnavailable", message=str(lost), data=lost)
    except BaseException as e:
        run.fail(e)
        raise
    finally:
        if node is not None:  # always: success, failure, cancellation, Ctrl-C (SkyPilot's autodown if we die)
            teardown_task(node.compute)
            view.say(record_usage(run, node.compute.usage()))
        run.release()


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
