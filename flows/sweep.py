"""The sweep flows: an Optuna study whose trials are pipeline runs, one MLflow parent run with a child run per trial.

    ballast sweep examples/sweep.yaml                         # create or resume the study, run it here
    ballast sweep examples/sweep.yaml --trials 20 --workers 2 # 2 worker processes on this machine
    ballast sweep examples/sweep.yaml --timeout 600 --set optim.steps=12   # a wall-time budget; base spec override
    ballast sweep FILE --storage postgresql://user@host/db --workers 0    # create only; print the join command
    ballast sweep-worker --study NAME --storage URL           # join a study from any machine

`ballast-sweep` opens the study (sweeps/study.py) and the MLflow parent run, measures the baseline once — the base
model (or fork source) on the trials' held-out set with their eval settings (sweeps/baseline.py), stored on the
study and the parent run — then runs the worker loop here (or starts
K `ballast sweep-worker` processes sharing the storage) and writes the summary. `ballast-sweep-worker` is one
process's worker loop; on other machines it grows a sweep past one node through Optuna's RDB storage. Each trial
is the pipeline flow (flows/pipeline.py) as a subflow, with the trial's pruning callbacks. Storage: SQLite under
the project folder by default (a couple of local workers), PostgreSQL for many; keep the password out of the URL
(PGPASSWORD or ~/.pgpass) — it is a flow parameter and is printed.

**Workers on nodes.** With the base spec's `infra.compute` local or skypilot, `--workers K` starts each worker
through the compute interface (infra/compute.py), as the pipeline runs its train stage: a node per worker (a
SkyPilot cluster or managed job each; a scratch directory and a process of its own for `local`), `ballast
sweep-worker` run there with its lines relayed here, prefixed, and the node torn down whatever happens (success,
failure, Ctrl-C) — the tasks `provision worker-i` / `teardown worker-i` in Prefect. On the node a trial's spec is
placed as `node_spec` places a pipeline's (tasks/remote.py): `infra.compute: here`, the flow's tracking and artifact
store, the node's project folder; so trials never provision again. What each node used is kept on the study and
summed in the summary. The storage must be one the nodes reach (sweeps/study.py `check_worker_placement`).

The terminal shows one progress line per trial (step, reward, held-out score at eval points, ETA; rewritten in
place on a terminal, every few steps in a log) and, after each trial, its outcome and the sweep's: trials done,
best so far against the baseline.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import optuna
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.exceptions import TerminationSignal
from prefect.logging import get_run_logger

from flows.pipeline import Watch, after_training, open_run, provision_task, run_pipeline, teardown_task
from flows.view import PipelineView, flow_run_link
from infra.compute import Compute, LocalCompute, SkyPilotCompute, StageExit, Usage, sky_plan, sky_task, urlhost
from sweeps.baseline import BASELINE_ATTR, Baseline, load_baseline
from sweeps.pruning import TrialPruning
from sweeps.report import SweepSummary, describe_gain, format_values, plot_study, summarize, trial_row
from sweeps.space import SweepError, base_spec, check_concurrent_sweep, largest_lora_rank, load_sweep
from sweeps.study import (
    COMPUTE_ATTR,
    LOOPBACK,
    NODE_ATTR,
    TRIALS_ATTR,
    AskTell,
    SweepWorkerError,
    check_worker_placement,
    join_study,
    judge_trial,
    make_storage,
    n_done,
    open_study,
    optimize,
    prepare_trial,
    redact_url,
    run_trial,
    study_storage,
    target,
)
from tasks.checkpoint import CheckpointUploader
from tasks.eval import eval_baseline
from tasks.fork import fork
from tasks.metrics_sink import TrackingUnavailable
from tasks.record import RunRecorder, store_uri
from tasks.remote import LineRelay, NodeChoice, node_name, node_spec, write_node_spec
from tasks.spec import ExperimentSpec, validate_spec
from tasks.summary import PipelineResult
from tasks.sweep_record import SweepRecorder
from tasks.train import Callbacks, ConcurrentTraining, RunInterrupted, TrainJob, TrainOutcome

CLI = "import sys; from flows.cli import main; sys.exit(main())"
NODE_ENV = "BALLAST_SWEEP_NODE"  # on a worker node: where its trials keep their files (JSON, `worker_node`)
DEADLINE_ENV = "BALLAST_SWEEP_DEADLINE"  # --timeout's end (epoch seconds) for the workers `ballast sweep` starts


# ------------------------------------------------------------------------------------------ the baseline


def measure_baseline(sweep, recorder: SweepRecorder) -> Baseline:
    """The base model's (or fork source's) held-out scores with the trials' eval settings."""
    spec = validate_spec(base_spec(sweep), "sweep base spec")
    started = time.perf_counter()
    source = fork(spec, recorder.tracking.checkpoint_prefix)
    cache = Path(spec.project_dir).resolve() / "cache" / "sweeps" / sweep.study_name
    result = eval_baseline(spec, source, cache)
    return Baseline(result.checkpoint_uri, result.metrics, result.per_prompt, time.perf_counter() - started)


baseline_task = task(measure_baseline, name="baseline", cache_policy=NO_CACHE, persist_result=False)


def ensure_baseline(study, sweep, recorder: SweepRecorder, label: str = "") -> Baseline:
    """The study's baseline, measured once (before its first trial) and stored on the study and the parent run."""
    baseline = load_baseline(study)
    if baseline is None:
        print(f"{label}baseline: scoring {_source_name(sweep)} on the trials' held-out set ...", flush=True)
        baseline = baseline_task(sweep, recorder)
        study.set_user_attr(BASELINE_ATTR, baseline.to_json())
        recorder.record_baseline(baseline)
        print(f"{label}{baseline_line(baseline, sweep)} ({baseline.seconds:.0f} s)", flush=True)
    return baseline


def _source_name(sweep) -> str:
    spec = base_spec(sweep)
    f = spec.get("fork") or {}
    if f.get("run_id") or f.get("checkpoint"):
        return f"the fork source {f.get('run_id') or f.get('checkpoint')}"
    return f"the base model {spec['model']['name_or_path']}"


def baseline_line(baseline: Baseline, sweep) -> str:
    key = sweep.objectives[0].key
    n = len(next(iter(baseline.per_prompt.values()), []))
    if baseline.score(key) is None:
        return f"baseline: {baseline.source} (objective {key} is not a held-out score: no baseline to beat)"
    return (
        f"baseline: {key} {baseline.score(key):.3g} ± {1.96 * (baseline.stderr_of(key) or 0):.2g} for "
        f"{baseline.source} ({n} held-out prompts)"
    )


# ------------------------------------------------------------------------------------------ progress


class TrialProgress(Callbacks):
    """One line per trial while it trains: step, reward, the last held-out score, ETA. Rewritten in place on a
    terminal; in a log (Prefect, a pipe) a line every `every` steps and at each eval point."""

    def __init__(self, number: int, steps: int, label: str = "", every: int = 4, metric: str = "eval/reward"):
        self.number, self.steps, self.label, self.every, self.metric = number, steps, label, every, metric
        self.started, self.eval_score = time.perf_counter(), None
        self.tty = sys.stdout.isatty()

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if step == 0:
            return
        evaluated = self.metric in metrics
        if evaluated:
            self.eval_score = metrics[self.metric]
        rate = (time.perf_counter() - self.started) / step
        eta = rate * (self.steps - step)
        parts = [f"{self.label}  trial {self.number}: step {step}/{self.steps}"]
        if "reward" in metrics:
            parts.append(f"reward {metrics['reward']:.3f}")
        if self.eval_score is not None:
            parts.append(f"{self.metric} {self.eval_score:.3f}")
        parts.append(f"ETA {eta:.0f} s")
        line = ", ".join(parts)
        if self.tty:
            _say("\r" + line.ljust(100))
        elif evaluated or step % self.every == 0 or step == self.steps:
            _say(line + "\n")

    def close(self) -> None:
        if self.tty:
            _say("\r" + " " * 100 + "\r")


def _say(text: str) -> None:
    """To the terminal as it is: inside the pipeline flow `print` goes to Prefect's run log (log_prints)."""
    sys.stdout.write(text)
    sys.stdout.flush()


# ------------------------------------------------------------------------------------------ trials


def run_worker(study, sweep, recorder: SweepRecorder, label: str = "", timeout_s: float | None = None):
    """This process's share of the study: trials until the study has its total (or the time budget is spent)."""
    started = time.perf_counter()
    node = json.loads(os.environ.get(NODE_ENV) or "null")  # this worker runs on a node the sweep provisioned

    def on_trial(st, frozen) -> None:
        recorder.record_trial(st, frozen)
        print(label + trial_line(frozen), flush=True)
        print(label + sweep_line(st, sweep, time.perf_counter() - started), flush=True)

    if sweep.concurrent_trials > 1:
        return run_concurrent(study, sweep, recorder, on_trial, label, timeout_s, node)

    def run_fn(spec, callbacks, trial):
        progress = TrialProgress(trial.number, spec.optim.steps, label, metric=progress_metric(sweep))
        if node:  # the trial trains here, on this node: it never provisions another
            spec = node_spec(spec, node["tracking_uri"], node["store_uri"], node["project_dir"])
        try:
            return run_pipeline(
                spec.model_dump(mode="json"),
                callbacks=[callbacks, progress],
                parent_run_id=recorder.parent_run_id,
                tags=recorder.trial_tags(trial.number, dict(trial.params)),
                progress=False,
                flow_run_name=f"{recorder.study_name}-trial-{trial.number}",
            )
        except RunInterrupted as stop:  # SIGTERM / Ctrl-C stop the sweep, not only this trial
            raise KeyboardInterrupt(str(stop)) from stop
        finally:
            progress.close()
            if spec.infra.compute != "here":  # the trial's train stage had a node of its own: what it used
                keep_trial_usage(trial, recorder)

    return optimize(
        study,
        lambda trial: run_trial(trial, sweep, run_fn),
        callbacks=[on_trial],
        max_consecutive_failures=sweep.max_consecutive_failures,
        log=lambda m: print(label + m, flush=True),
        timeout_s=timeout_s,
    )


def progress_metric(sweep) -> str:
    """The held-out score a trial's progress line shows: the objective's, when it is one."""
    return sweep.objectives[0].key if sweep.objectives[0].key.startswith("eval/") else "eval/reward"


# ------------------------------------------------------------------------------------------ Ctrl-C


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped the sweep; what to run to continue it."""


class _NoInterruptReports(logging.Filter):
    """Drops what Optuna and Prefect log about a KeyboardInterrupt (the sweep says it in one line): Optuna's 'Trial N
    failed with parameters … because of the following error' with its traceback and the 'failed with value None' after
    it, and Prefect's 'Crash detected! Execution was aborted by an interrupt signal.'"""

    def __init__(self):
        super().__init__()
        self.interrupted: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt):
            self.interrupted.add(message.split(" failed with parameters")[0])  # 'Trial 3'
            return False
        if message.endswith("failed with value None.") and message.split(" failed with value")[0] in self.interrupted:
            return False
        return not (message.startswith("Crash detected!") and "interrupt" in message)


@contextmanager
def interrupts_said_once(command: str):
    """Around a sweep command: a Ctrl-C (or SIGTERM) leaves the terminal with the interrupted trial's stop line and
    one SweepInterrupted naming `command` to continue the study — no tracebacks from the libraries under it."""
    quiet = _NoInterruptReports()
    loggers = [logging.getLogger(name) for name in ("optuna.study._optimize", "prefect.flow_runs", "prefect.task_runs")]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    except KeyboardInterrupt as e:
        raise SweepInterrupted(f"sweep interrupted; its finished trials are kept — continue it with: {command}") from e
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


# ------------------------------------------------------------------------------------------ trials at once


def run_concurrent(study, sweep, recorder: SweepRecorder, on_trial, label: str, timeout_s, node):
    """`sweep.concurrent_trials` trials at a time in this process: LoRA adapters trained over one base model, their
    rollouts sampled in one engine call (tasks/train.py ConcurrentTraining, trainer/multi.py), the trials asked and
    told through Optuna's ask-and-tell interface (sweeps/study.py AskTell). A trial that ends — finished, collapsed,
    pruned or failed — is recorded and judged at once and the next asked trial takes its slot, until the study has
    its total or the budget is spent.

    What a trial leaves is a sequential trial's: the same Optuna values, state and user attrs (pruning through the
    same TrialPruning and verdict), an MLflow trial run with the same params, tags, metrics and artifacts (the fork,
    checkpoint, artifact-probe and eval stages are the pipeline's own, flows/pipeline.py `open_run` and
    `after_training`: the final eval reloads the checkpoint from the store in a fresh model), the same lines on the
    terminal. What differs: no `ballast-pipeline` flow run per trial — the trials live in this worker's flow run,
    whose log carries their stage lines prefixed `trial N:`, their fork/checkpoint/probe/eval as task runs in it and
    their training as none (it runs interleaved, outside any task); the MLflow run's Prefect link is the worker's
    flow run; progress lines are printed every few steps, never redrawn in place; a trial's metrics equal a lone
    run's within trainer/multi.py's tolerance (bit-identical when its loss reads no engine logprobs). A trial whose
    base spec trains on a node of its own (infra.compute) is refused: run the workers on nodes instead."""
    check_concurrent_sweep(sweep, f"study {study.study_name}")  # joined by name: its file was not loaded here
    compute = validate_spec(base_spec(sweep), "sweep base spec").infra.compute
    if node is None and compute != "here":
        raise SweepError(
            f"study {study.study_name}: field 'concurrent_trials': {sweep.concurrent_trials} trials at once train "
            f"in this worker, but infra.compute is {compute!r}; start the workers on nodes (ballast sweep --workers "
            "K) or set concurrent_trials: 1"
        )
    training = ConcurrentTraining(sweep.concurrent_trials, max_lora_rank=largest_lora_rank(sweep))
    failures = sweep.max_consecutive_failures
    loop = AskTell(study, [on_trial], failures, log=lambda m: print(label + m, flush=True), timeout_s=timeout_s)
    running: dict[str, OpenTrial] = {}

    def jobs(asked):
        for trial in asked:
            try:
                t = open_trial(trial, sweep, recorder, label, node)
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


@dataclass
class OpenTrial:
    """A trial training among others in this worker: its Optuna trial, spec, MLflow run, and what watches it."""

    trial: optuna.Trial
    spec: ExperimentSpec
    run: RunRecorder
    watch: Watch
    progress: TrialProgress
    job: TrainJob
    started: float = field(default_factory=time.perf_counter)


def open_trial(trial, sweep, recorder: SweepRecorder, label: str, node) -> OpenTrial:
    """Ask the trial for its values and open its MLflow run as a pipeline run opens one (the fork verified first);
    its train job with the callbacks a pipeline run's train stage gets, Optuna's pruning among them."""
    spec = prepare_trial(trial, sweep)
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
    return OpenTrial(trial, spec, run, Watch(run, view), progress, job)


def end_trial(t: OpenTrial, outcome: TrainOutcome | None, error: BaseException | None) -> PipelineResult:
    """The trial's train stage recorded, then checkpoint → artifact-probe → eval and the verdict, as its pipeline
    run's (flows/pipeline.py `run_stages`); its MLflow run failed or interrupted as that run's would be."""
    t.progress.close()
    try:
        with t.watch.stage("train", started=t.started):
            if error is not None:
                raise error
            t.watch.record(outcome)
            outcome.raise_if_interrupted()
        return after_training(t.spec, t.run, t.watch, outcome)
    except (RunInterrupted, KeyboardInterrupt, TerminationSignal) as e:  # SIGTERM, Ctrl-C: stop the sweep
        raise KeyboardInterrupt(str(t.run.interrupted(e))) from e
    except TrackingUnavailable as e:
        raise t.run.metrics.lost(e) from e
    except BaseException as e:
        t.run.fail(e)
        raise


def abandon_trial(t: OpenTrial, loop: AskTell, error: BaseException) -> None:
    """A trial still training when the worker stops: its run interrupted (a signal) or failed, the trial failed."""
    t.progress.close()
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


def keep_trial_usage(trial, recorder: SweepRecorder) -> None:
    """The trial's train-stage node usage (record_usage put it on its MLflow run) as the trial's user attr
    `compute`, for the summary to sum; nothing when the run has none."""
    try:
        run = recorder.child_run(trial.number)
        used = Usage.recorded(run.data.tags, run.data.metrics) if run is not None else None
        if used:
            trial.set_user_attr(COMPUTE_ATTR, used)
    except Exception as e:  # bookkeeping never fails a trial
        print(f"trial {trial.number}: its node's usage was not kept on the study: {e}", flush=True)


def sweep_line(study, sweep, elapsed: float) -> str:
    """'sweep: 4 of 10 trials done (1 pruned) in 3.2 min; best so far: trial 2, eval/reward 0.71 vs 0.61 ...'."""
    done = n_done(study)
    pruned = sum(1 for t in study.get_trials(deepcopy=False) if t.state.name == "PRUNED")
    head = f"sweep: {done} of {target(study)} trials done ({pruned} pruned) in {elapsed / 60:.1f} min"
    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if not complete or len(sweep.objectives) > 1:
        return head
    key, sign = sweep.objectives[0].key, 1 if sweep.objectives[0].direction == "maximize" else -1
    top = trial_row(max(complete, key=lambda t: sign * t.value), sweep)
    if top.get("gain") is None:
        return f"{head}; best so far: trial {top['number']} {format_values(top['values'])}"
    if top.get("beats_baseline"):
        return f"{head}; best so far: trial {top['number']}, {describe_gain(top, key)}"
    closest = f"trial {top['number']}, {describe_gain(top, key)}"
    return f"{head}; none beats the base model beyond noise yet (closest: {closest})"


def trial_line(frozen) -> str:
    steps = frozen.user_attrs.get("last_step", "?")
    if frozen.state.name == "COMPLETE":
        what = ", ".join(
            f"{k.removeprefix('objective/')}={v:.4g}"
            for k, v in frozen.user_attrs.items()
            if k.startswith("objective/")
        )
        if frozen.user_attrs.get("gain") is not None:
            a = frozen.user_attrs
            what += f" ({a['gain']:+.2g} ± {1.96 * a['gain_stderr']:.2g} over the base model)"
    elif frozen.state.name == "PRUNED":
        what = frozen.user_attrs.get("prune_reason", "")
    else:
        what = frozen.user_attrs.get("error") or frozen.user_attrs.get("not_counted") or ""
    return f"trial {frozen.number} {frozen.state.name} after {steps} steps: {what}  ({format_values(frozen.params)})"


def make_recorder(sweep) -> SweepRecorder:
    recorder = SweepRecorder(validate_spec(base_spec(sweep), "sweep base spec"), sweep.study_name)
    key = sweep.objectives[0].key
    recorder.objective = key if key.startswith("eval/") else None  # held-out: its trial runs carry Gain/<key>
    return recorder


def open_sweep(sweep, storage_url: str, n_trials: int | None, worker: int):
    """Storage (heartbeats + interrupted-trial bookkeeping), study, recorder and its parent run."""
    recorder = make_recorder(sweep)
    storage = make_storage(storage_url, sweep.heartbeat, on_interrupted=recorder.record_interrupted)
    study = open_study(sweep, storage, n_trials, worker=worker)
    with warnings.catch_warnings():  # experimental in Optuna 5; optuna-dashboard shows these, not "Objective 0"
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([o.key for o in sweep.objectives])
    params = {
        "sweep.study": study.study_name,
        "sweep.sampler": sweep.sampler.type,
        "sweep.pruner": sweep.pruner.type,
        "sweep.prune_collapsed": str(sweep.prune_collapsed),
        "sweep.seed": str(sweep.seed),
        "sweep.objectives": json.dumps([o.model_dump() for o in sweep.objectives]),
    }
    params.update({f"space.{k}": json.dumps(p.model_dump(exclude_none=True))[:500] for k, p in sweep.space.items()})
    params.update({f"overrides.{k}": json.dumps(v)[:500] for k, v in sweep.overrides.items()})
    recorder.open_parent(study, params, {"storage": redact_url(storage_url), "n_trials": target(study)})
    return study, recorder


def spawn_workers(study_name: str, storage_url: str, k: int, extra_env: dict[str, str]) -> list[int]:
    """K `ballast sweep-worker` processes on this machine, sharing the storage (and this Prefect API); exit codes."""
    env = dict(os.environ, PREFECT_API_URL=prefect_api(), **extra_env)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                CLI,
                "sweep-worker",
                "--study",
                study_name,
                "--storage",
                storage_url,
                "--worker",
                str(i),
                "--no-summary",
            ],
            env=env,
        )
        for i in range(k)
    ]
    try:
        return [p.wait() for p in procs]
    except BaseException:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        raise


# ------------------------------------------------------------------------------------------ workers on nodes


@dataclass
class WorkerNode:
    """One sweep worker on a node of its own: the compute, the `ballast sweep-worker` command it runs there and its
    environment. Torn down once, by its thread or by the flow on Ctrl-C, whichever comes first."""

    index: int
    compute: Compute
    command: list[str]
    env: dict[str, str]
    ended: StageExit | None = None
    tail: list[str] = field(default_factory=list)  # its last lines, quoted when it fails
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def label(self) -> str:
        return f"worker-{self.index}"

    def teardown(self) -> None:
        with self.lock:
            if not self.compute.usage().torn_down:
                teardown_task.with_options(task_run_name=f"teardown {self.label}")(self.compute)

    def record(self) -> dict:
        """Its usage as the study keeps it (sweeps/report.py sums these)."""
        usage: Usage = self.compute.usage()
        return {"name": f"{self.label} ({self.compute.name})", **asdict(usage), "cost_usd": usage.cost_usd}


def worker_node(spec, study_name: str, storage_url: str, index: int, tracking_uri: str, api_url: str) -> WorkerNode:
    """Worker `index`'s node — a LocalCompute or a SkyPilot cluster / managed job, as tasks/remote.py's
    `open_compute` builds a run's — and what runs there; nothing is provisioned yet. The node's trials keep their
    files in the node's own project folder and record to the flow's tracking and artifact store (NODE_ENV)."""
    name = node_name(study_name, f"w{index}")
    argv = ["sweep-worker", "--study", study_name, "--storage", storage_url, "--worker", str(index), "--no-summary"]
    project = Path(spec.project_dir).resolve()
    placement = {"tracking_uri": tracking_uri, "store_uri": store_uri(spec)}
    env = {}
    if spec.infra.compute == "local" or urlhost(api_url) not in LOOPBACK:  # its flows in this Prefect, if it can
        env["PREFECT_API_URL"] = api_url
    if spec.infra.compute == "local":
        workdir = project / "compute" / name
        env[NODE_ENV] = json.dumps({**placement, "project_dir": str(workdir / "project")})
        return WorkerNode(index, LocalCompute(name, workdir), [sys.executable, "-m", "flows.cli", *argv], env)
    env[NODE_ENV] = json.dumps({**placement, "project_dir": ".ballast-node"})
    command = shlex.join(["python3", "-m", "flows.cli", *argv])
    node = node_spec(spec, tracking_uri, placement["store_uri"], ".ballast-node")  # the base spec, for the record
    spec_file = write_node_spec(node, project / "launch" / f"{name}.spec.yaml")
    vllm = spec.rollout.engine == "vllm" and not spec.rollout.vllm_url
    plan = sky_plan(spec.infra, name, spec_file, command, vllm=vllm)
    sky_task({**plan.task_config(), "envs": {**plan.task_config()["envs"], **env}})  # SkyPilot's schema, now
    return WorkerNode(index, SkyPilotCompute(plan), [command], env)


def run_worker_node(node: WorkerNode) -> StageExit:
    """Provision the worker's node, run the worker there (its lines here, prefixed), tear the node down."""
    prefix = f"[worker {node.index}] "

    def say(line: str) -> None:
        print(line if line.startswith(prefix) else prefix + line, flush=True)

    try:
        provision_task.with_options(task_run_name=f"provision {node.label}")(node.compute)
        with node.lock:
            if node.compute.usage().torn_down:  # the flow was stopped while this node was being provisioned
                return StageExit(130, detail="stopped before it started")
        relay = LineRelay([], say)
        node.ended = node.compute.run(node.command, node.env, relay)
        node.tail = relay.tail
        return node.ended
    finally:
        node.teardown()


worker_node_task = task(run_worker_node, name="sweep-worker", cache_policy=NO_CACHE, persist_result=False)


def run_on_nodes(
    study, spec, recorder: SweepRecorder, storage_url: str, k: int, extra_env: dict[str, str]
) -> list[WorkerNode]:
    """K workers, each on its own node, at once (Prefect's thread pool); every node torn down before this returns,
    a Ctrl-C too. What each used goes onto the study and the sweep's parent run."""
    api = prefect_api()
    nodes = [worker_node(spec, study.study_name, storage_url, i, recorder.tracking.uri, api) for i in range(k)]
    for n in nodes:
        n.env.update(extra_env)
    futures = []
    try:
        futures = [worker_node_task.with_options(task_run_name=n.label).submit(n) for n in nodes]
        for f in futures:
            f.wait()
    finally:
        for n in nodes:  # after a Ctrl-C: stops the workers (SIGTERM: a trial stops at a safe point), downs the nodes
            n.teardown()
        for f in futures:
            f.wait()
        keep_node_usage(study, recorder, nodes)
    for n, f in zip(nodes, futures):
        ended = f.result(raise_on_failure=False)
        if isinstance(ended, BaseException):
            print(f"[worker {n.index}] its node {n.compute.name} failed: {type(ended).__name__}: {ended}", flush=True)
        elif ended.code != 0:
            last = "\n".join(n.tail[-8:])
            print(f"[worker {n.index}] ended on {n.compute.name} with {ended.detail}; its last lines:\n{last}")
    return nodes


def keep_node_usage(study, recorder: SweepRecorder, nodes: list[WorkerNode]) -> None:
    """Each node's usage: a study user attr (the summary sums them), a tag and a line."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for n in nodes:
        usage = n.compute.usage()
        print(f"[worker {n.index}] {usage.line()}{'' if usage.torn_down else ' — NOT torn down'}", flush=True)
        try:
            study.set_user_attr(f"{NODE_ATTR}{stamp}.{n.index}", json.dumps(n.record()))
            recorder.tracking.set_tags(recorder.parent_run_id, {f"compute.{n.label}": usage.line()})
        except Exception as e:  # how the nodes were used never hides how the sweep ended
            print(f"[worker {n.index}] its usage was not recorded: {e}", flush=True)


def prefect_api() -> str:
    """The Prefect API this process uses (the embedded server's too), for the workers' flow runs."""
    with get_client(sync_client=True) as client:
        return str(client.api_url)


def write_summary(study, sweep, recorder: SweepRecorder, storage_url: str, timed_out: bool = False) -> SweepSummary:
    """Best trial / Pareto set, importances, plots, summary.html/json; logged to the parent run."""
    out_dir = Path(recorder.tracking.spec.project_dir).resolve() / "sweeps" / study.study_name
    summary = summarize(study, sweep)
    summary.plots, summary.plots_skipped = plot_study(study, sweep, out_dir / "plots")
    summary.storage, summary.n_trials = redact_url(storage_url), target(study)
    summary.done, summary.parent_run_id = n_done(study) >= target(study) or timed_out, recorder.parent_run_id
    summary.timed_out = timed_out
    summary.dashboard = f"optuna-dashboard {redact_url(storage_url)}   (pip install optuna-dashboard)"
    summary.run_url_template = recorder.tracking.run_url("{run_id}")  # each trial's MLflow run, linked on the page
    summary.write(out_dir)
    record_compute(recorder, summary)
    recorder.record_summary(summary, out_dir)
    return summary


def record_compute(recorder: SweepRecorder, summary: SweepSummary) -> None:
    """What the sweep's compute cost, on its parent run: metrics `compute/*` and the line as tag `compute`."""
    for key, value in summary.compute.metrics().items():
        recorder.client.log_metric(recorder.parent_run_id, key, value)
    recorder.tracking.set_tags(recorder.parent_run_id, {"compute": summary.compute.line()})


summary_task = task(write_summary, name="sweep-summary", cache_policy=NO_CACHE, persist_result=False)


@flow(name="ballast-sweep", persist_result=False)
def ballast_sweep(
    sweep_path: str = "examples/sweep.yaml",
    trials: int | None = None,
    workers: int = 1,
    storage: str | None = None,
    overrides: list[str] | None = None,
    timeout_s: float | None = None,
    node: NodeChoice | None = None,
) -> SweepSummary | None:
    """An Optuna sweep of pipeline runs against the base model's score (the Run form of the `ballast-sweep`
    deployment; the CLI's `ballast sweep` runs the same flow).

    Args:
        sweep_path: Path of the sweep YAML, relative to the checkout the worker runs from, e.g. examples/sweep.yaml.
        trials: The study's total of finished trials (the sweep file's `trials` when left empty); a study that has
            them already ends at once.
        workers: Workers running trials at once: 1 runs them in this flow; K > 1 starts K workers, each on a node
            of its own when the base spec's infra.compute is local or skypilot; 0 only creates the study.
        storage: Optuna storage URL shared by the workers, e.g. postgresql://user@db.internal/sweeps (the password
            in PGPASSWORD, never in the URL); the project folder's SQLite file when left empty.
        overrides: Base-spec fields to change for a new study, one "key.path=value" string each, e.g.
            optim.steps=24 (the CLI's --set).
        timeout_s: Seconds after which no trial starts; the trials running then finish.
        node: Where the trials' GPU stages run (infra.*): e.g. compute skypilot, accelerators H100:1, use_spot; the
            base spec's infra section when left empty.
    """
    overrides = [*(node.overrides() if node else []), *(overrides or [])]
    sweep = load_sweep(sweep_path, overrides)
    url = study_storage(sweep, storage)
    spec = validate_spec(base_spec(sweep), "sweep base spec")
    on_nodes = workers >= 1 and spec.infra.compute != "here"
    if on_nodes:  # a storage or placement the nodes could not use: refused before anything is provisioned
        check_worker_placement(spec, url)
    study, recorder = open_sweep(sweep, url, trials, worker=0)
    print(
        f"sweep {study.study_name}: {n_done(study)} of {target(study)} trials done (storage {redact_url(url)}, "
        f"MLflow parent run {recorder.parent_run_id})",
        flush=True,
    )
    if workers == 0:
        print(f"study created; join it with:  ballast sweep-worker --study {study.study_name} --storage {url}")
        return None
    try:
        ensure_baseline(study, sweep, recorder)
        timed_out = run_trials(study, sweep, spec, recorder, url, workers, timeout_s, on_nodes)
    except SweepWorkerError:
        summary_task(study, sweep, recorder, url)  # what the trials so far found, then the error
        raise
    except BaseException:
        recorder.interrupted()
        raise
    return summary_task(study, sweep, recorder, url, timed_out)


def run_trials(study, sweep, spec, recorder: SweepRecorder, url: str, workers: int, timeout_s, on_nodes: bool) -> bool:
    """The trials, here (one worker), in K worker processes here, or on K nodes; whether --timeout ended them."""
    deadline = {DEADLINE_ENV: str(time.time() + timeout_s)} if timeout_s else {}  # for workers elsewhere
    if on_nodes:
        run_on_nodes(study, spec, recorder, url, workers, deadline)
    elif workers == 1:
        return run_worker(study, sweep, recorder, timeout_s=timeout_s).timed_out
    elif any(codes := spawn_workers(study.study_name, url, workers, deadline)):
        print(f"worker exit codes: {codes}")
    return bool(timeout_s) and n_done(study) < target(study)


@flow(name="ballast-sweep-worker", persist_result=False)
def ballast_sweep_worker(
    study: str, storage: str, trials: int | None = None, worker: int = 0, summary: bool = True
) -> SweepSummary | None:
    _, sweep = join_study(study, make_storage(storage), worker=worker)  # the definition, then the real storage
    recorder = make_recorder(sweep)
    st, sweep = join_study(
        study, make_storage(storage, sweep.heartbeat, on_interrupted=recorder.record_interrupted), worker=worker
    )
    recorder.join(st)
    if trials is not None:
        st.set_user_attr(TRIALS_ATTR, int(trials))
    ensure_baseline(st, sweep, recorder, label=f"[worker {worker}] ")  # created with --workers 0: not measured yet
    deadline = os.environ.get(DEADLINE_ENV)  # the `ballast sweep --timeout` that started this worker
    left = None if deadline is None else max(0.0, float(deadline) - time.time())
    run_worker(st, sweep, recorder, label=f"[worker {worker}] ", timeout_s=left)
    if summary and n_done(st) >= target(st):
        return summary_task(st, sweep, recorder, storage)
    return None
