"""Trials `sweep.concurrent_trials` at a time in this process: LoRA adapters trained over one base model, their
rollouts sampled in one engine call (tasks/train.py ConcurrentTraining, trainer/multi.py), the trials asked and
told through Optuna's ask-and-tell interface (sweeps/study.py AskTell). A trial that ends — finished, collapsed,
pruned or failed — is recorded and judged at once and the next asked trial takes its slot, until the study has
its total or the budget is spent.

What a trial leaves is a sequential trial's: the same Optuna values, state and user attrs (pruning through the
same TrialPruning and verdict), an MLflow trial run with the same params, tags, metrics and artifacts (the fork,
checkpoint, artifact-probe and eval stages are the pipeline's own, flows/stages.py `open_run` and
`after_training`: the final eval reloads the checkpoint from the store in a fresh model), the same lines on the
terminal. What differs: no `ballast-pipeline` flow run per trial — the trials live in this worker's flow run,
whose log carries their stage lines prefixed `trial N:`, their fork/checkpoint/probe/eval as task runs in it and
their training as a task run `train trial-N` spanning it (flows/stages.py TrainTaskRun: it runs interleaved in one
engine call, on no task engine; a pruned trial's is Completed, named "Pruned"); the MLflow run's Prefect link is
the worker's flow run; progress lines are printed every few steps, never redrawn in place; a trial's metrics equal
a lone run's within trainer/multi.py's tolerance (bit-identical when its loss reads no engine logprobs). A trial
whose base spec trains on a node of its own (infra.compute) is refused: run the workers on nodes instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import optuna
from prefect.logging import get_run_logger

from flows.stages import TrainTaskRun, Watch, finish_training, open_run
from flows.trials.lines import TrialLines, TrialProgress, progress_metric
from flows.view import PipelineView, flow_run_link
from sweeps.pruning import TrialPruning
from sweeps.runner import Budget, RunnerReport
from sweeps.space import SweepError, base_spec, check_concurrent_sweep, largest_lora_rank
from sweeps.study import AskTell, judge_trial, prepare_trial, retried
from tasks.checkpoint import CheckpointUploader
from tasks.metrics_sink import TrackingUnavailable
from tasks.record import RunRecorder
from tasks.remote import node_spec
from tasks.results import PipelineResult, TrainOutcome
from tasks.spec import ExperimentSpec, validate_spec
from tasks.sweep_record import SweepRecorder
from tasks.train import ConcurrentTraining, TrainJob


class ConcurrentRunner:
    """`concurrent_trials` trials at once in this process (see the module); `node` as SequentialRunner's."""

    def __init__(self, label: str = "", node: dict | None = None):
        self.label, self.node = label, node

    def run(self, study, sweep, recorder: SweepRecorder, budget: Budget) -> RunnerReport:
        refuse_own_nodes(study, sweep, self.node)
        training = ConcurrentTraining(sweep.concurrent_trials, max_lora_rank=largest_lora_rank(sweep))
        failures = sweep.max_consecutive_failures
        say = lambda m: print(self.label + m, flush=True)  # noqa: E731
        on_trial = TrialLines(sweep, recorder, self.label)
        loop = AskTell(study, [on_trial], failures, log=say, timeout_s=budget.left_s(), n_trials=budget.trials)
        running: dict[str, OpenTrial] = {}

        def jobs(asked):
            for trial in asked:
                try:
                    t = open_trial(trial, sweep, recorder, self.label, self.node)
                except Exception as e:  # the fork refused, the store down: the trial fails, as its pipeline run would
                    loop.tell(trial, _raising(e))
                    continue
                running[t.job.name] = t
                yield t.job

        def on_end(job: TrainJob, outcome: TrainOutcome | None, error: BaseException | None) -> None:
            t = running.pop(job.name)
            loop.tell(t.trial, lambda trial: judge_trial(trial, sweep, t.spec, end_trial(t, outcome, error)))

        try:
            return loop.run(lambda asked: training.run(jobs(asked), on_end))
        except BaseException as e:  # a second Ctrl-C, an error of the spec: the trials still running end with it
            for t in list(running.values()):
                abandon_trial(t, loop, e)
            raise
        finally:
            training.close()  # the vLLM server the trials shared, if they started one


def refuse_own_nodes(study, sweep, node: dict | None) -> None:
    """Trials at once train in this worker: a base spec whose train stage runs on a node of its own is refused
    (unless this worker is itself on a node the sweep provisioned)."""
    check_concurrent_sweep(sweep, f"study {study.study_name}")  # joined by name: its file was not loaded here
    compute = validate_spec(base_spec(sweep), "sweep base spec").infra.compute
    if node is None and compute != "here":
        raise SweepError(
            f"study {study.study_name}: field 'concurrent_trials': {sweep.concurrent_trials} trials at once train "
            f"in this worker, but infra.compute is {compute!r}; start the workers on nodes (ballast sweep "
            "--workers K) or set concurrent_trials: 1"
        )


@dataclass
class OpenTrial:
    """A trial training among others in this worker: its Optuna trial, spec, MLflow run, and what watches it."""

    trial: optuna.Trial
    spec: ExperimentSpec
    run: RunRecorder
    watch: Watch
    progress: TrialProgress
    job: TrainJob
    task_run: TrainTaskRun
    started: float = field(default_factory=time.perf_counter)


def open_trial(trial, sweep, recorder: SweepRecorder, label: str, node) -> OpenTrial:
    """Ask the trial for its values and open its MLflow run as a pipeline run opens one (the fork verified first);
    its train job with the callbacks a pipeline run's train stage gets, Optuna's pruning among them."""
    spec = prepare_trial(trial, sweep)
    recorder.discard_trial_runs(retried(trial))  # a re-queued configuration: its interrupted attempts' runs
    if node:  # the worker runs on a node the sweep provisioned: the trial's records go to the flow's stores
        spec = node_spec(spec, node["tracking_uri"], node["store_uri"], node["project_dir"])
    view = PipelineView(spec.optim.steps, terminal=False, log=_Prefixed(get_run_logger(), f"trial {trial.number}: "))
    tags = {**recorder.trial_tags(trial.number, dict(trial.params)), **flow_run_link()}
    run = open_run(spec, view, None, recorder.parent_run_id, tags)
    view.say(f"MLflow run {run.name}: {run.url}", terminal=False)
    view.stage_started("train")
    progress = TrialProgress(trial.number, spec.optim.steps, label, metric=progress_metric(sweep))
    progress.tty = False  # N trials' lines at once: each its own line, none redrawn over another's
    uploader = CheckpointUploader(run.store, run.checkpoint_prefix)
    callbacks = [run.metrics, run.headline, uploader, view, TrialPruning(trial, sweep, spec), progress]
    job = TrainJob(f"trial-{trial.number}", spec, run.output_dir, callbacks, run.source)
    return OpenTrial(trial, spec, run, Watch(run, view), progress, job, TrainTaskRun(job.name))


def end_trial(t: OpenTrial, outcome: TrainOutcome | None, error: BaseException | None) -> PipelineResult:
    """The trial's train stage recorded, then checkpoint → artifact-probe → eval and the verdict, as its pipeline
    run's (flows/pipeline.py `run_stages`); its MLflow run failed or interrupted as that run's would be."""
    try:
        return finish_training(t, outcome, error)
    except KeyboardInterrupt:  # SIGTERM, Ctrl-C: stop the sweep (its run is marked interrupted)
        raise
    except TrackingUnavailable as e:
        raise t.run.metrics.lost(e, t.run.spec.project_dir) from e
    except BaseException as e:
        t.run.fail(e)
        raise


def abandon_trial(t: OpenTrial, loop: AskTell, error: BaseException) -> None:
    """A trial still training when the worker stops: its run interrupted (a signal) or failed, the trial failed."""
    t.progress.close()
    t.task_run.end(None, error)
    signal = not isinstance(error, Exception)
    try:
        t.run.interrupted(error) if signal else t.run.fail(error)
    except Exception as e:  # how the worker stopped is what must come through
        print(f"trial {t.trial.number}: its MLflow run was not closed: {e}", flush=True)
    loop.tell(t.trial, _raising(KeyboardInterrupt(str(error)) if signal else error))


def _raising(error: BaseException):
    def objective(trial):
        raise error

    return objective


class _Prefixed:
    """The worker's run logger, each line prefixed with the trial it is about."""

    def __init__(self, log, prefix: str):
        self.log, self.prefix = log, prefix

    def info(self, line: str) -> None:
        self.log.info(self.prefix + line)
