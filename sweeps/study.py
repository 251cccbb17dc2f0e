"""The Optuna study of a sweep: storage, sampler and pruner, the trial glue and the worker loop.

How a sweep grows past one process, with nothing home-made but the loop's stopping rule:

- **Storage** is Optuna's RDB storage: SQLite under the project folder by default
  (`sqlite:///<project_dir>/optuna.db`, fine for one or two local workers), PostgreSQL for a team or
  many nodes. Every worker opens the same study by name; the sweep definition (base spec, space,
  objectives, ...) is stored in the study's user attributes, so a worker needs only the storage URL
  and the study name. Re-running a sweep file against an existing study resumes it; a changed
  definition (space, objectives, base spec) is refused — start a new study instead. Workers on
  provisioned nodes (flows/sweep.py) need a storage those nodes reach: for SkyPilot nodes a database
  server on the network, never SQLite or a loopback address (`check_worker_placement`, before anything
  is provisioned).
- **How many trials.** `n_trials` is the study's total of COMPLETE + PRUNED trials, not a per-worker
  quota. A worker runs `study.optimize` until Optuna's `MaxTrialsCallback`, counting done + running
  trials, finds no room for another; then done → stop; else wait for the running ones (another worker
  is finishing them, or they are stale, see below) and go on if one failed. A trial that still finds
  itself past the total once started (two workers found room at the same moment) is failed as
  surplus without running, so workers together never overshoot.
- **Seeds.** A new study's worker k samples with `seed + k`; a process that resumes a study gets a
  seed from (seed, worker, trials so far), so it never replays the proposals of an earlier run.
- **Interrupted trials.** Workers write a heartbeat (`RDBStorage(heartbeat_interval, grace_period)`).
  A RUNNING trial whose worker went silent longer than the grace period (killed, node lost) is failed
  by the next worker that looks — failed trials are never counted as results — and its configuration
  is queued again (`RetryHeartbeatStaleTrialCallback`, `heartbeat.retries` times).
  A trial stopped by Ctrl-C is failed by Optuna itself.
- **The trial.** `run_trial` asks the trial for values (define-by-run), builds the trial's experiment
  spec, and calls *the function that runs a pipeline*, given by the caller: sweeps/ never imports
  flows/ (DESIGN.md) — flows/sweep.py passes a Prefect subflow around the pipeline.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.study import MaxTrialsCallback
from optuna.trial import FrozenTrial, TrialState

from tasks.summary import PipelineResult

from .pruning import TrialPruning, verdict
from .space import SweepError, SweepSpec, suggest, trial_spec

DONE = (TrialState.COMPLETE, TrialState.PRUNED)
SWEEP_ATTR = "ballast.sweep"  # study user attr: the sweep definition (JSON)
TRIALS_ATTR = "ballast.n_trials"  # study user attr: the total the study should end with
SQLITE_TIMEOUT_S = 60  # how long a SQLite writer waits for another process's lock
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"  # trial user attr `worker`: who ran it
NODE_ATTR = "ballast.node."  # study user attrs `ballast.node.<when>.<worker>`: a worker node's usage (JSON)
COMPUTE_ATTR = "compute"  # trial user attr: what the trial's own train-stage node used (its MLflow compute/*)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@contextmanager
def _experimental_ok():
    """Heartbeats and their retry callback are marked experimental in Optuna; we rely on them on purpose."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def default_storage(project_dir: str | Path) -> str:
    db = Path(project_dir).resolve() / "optuna.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"


def study_storage(sweep: SweepSpec, storage: str | None) -> str:
    """The study's storage URL: --storage, else the sweep file's, else SQLite under the base spec's project folder."""
    from .space import base_spec

    return storage or sweep.storage or default_storage(base_spec(sweep).get("project_dir", ".ballast"))


def check_worker_placement(spec, storage_url: str | None) -> None:
    """What sweep workers on provisioned nodes (`spec.infra.compute` local or skypilot) could not use, refused before
    anything is provisioned: ComputeError, one line. The base spec's own placement as `ballast run` checks it, and a
    study storage the nodes reach (None: the default SQLite file) — any for `local` (this machine), a database
    server on the network for `skypilot`."""
    from infra.compute import ComputeError, urlhost
    from tasks.remote import check_compute

    check_compute(spec)
    if spec.infra.compute != "skypilot":
        return
    storage_url = storage_url or "sqlite:///(the project folder's optuna.db)"
    shown = redact_url(storage_url)
    if storage_url.startswith("sqlite"):
        raise ComputeError(
            f"infra.compute: skypilot with study storage {shown}: a worker node cannot reach a SQLite file on this "
            "machine; give --storage postgresql://user@host/db, a database server the nodes reach"
        )
    if urlhost(storage_url) in LOOPBACK:
        raise ComputeError(
            f"study storage {shown} names this machine's loopback address, which a worker node cannot reach; give "
            "the database server's address on the network"
        )


def redact_url(url: str) -> str:
    """postgresql://user:secret@host/db -> postgresql://user:***@host/db (for logs and MLflow)."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


# ------------------------------------------------------------------------------------------ storage, sampler, pruner


def make_storage(
    url: str, heartbeat=None, on_interrupted: Callable[[optuna.Study, FrozenTrial], None] | None = None
) -> RDBStorage:
    """RDB storage with heartbeats; `on_interrupted(study, trial)` runs for each trial failed as stale."""
    from .space import HeartbeatSpec

    hb = heartbeat or HeartbeatSpec()
    sqlite = url.startswith("sqlite")
    engine_kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if sqlite else {"pool_pre_ping": True}
    try:
        with _experimental_ok():
            return RDBStorage(
                url,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=hb.interval,
                grace_period=hb.grace_period,
                heartbeat_stale_trial_callback=_Interrupted(hb.retries, on_interrupted),
            )
    except Exception as e:
        raise SweepError(
            f"cannot open the Optuna storage {redact_url(url)}: {type(e).__name__}: "
            f"{str(e).splitlines()[0]}; check the URL (sqlite:///path or postgresql://user@host/db) and "
            "that the database exists"
        ) from None


class _Interrupted:
    """Heartbeat-stale trial: note it on the study, tell the caller, re-queue its configuration."""

    def __init__(self, retries: int, notify=None):
        with _experimental_ok():
            self.retry = RetryHeartbeatStaleTrialCallback(max_retry=retries) if retries else None
        self.notify = notify

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        study.set_user_attr(
            f"ballast.interrupted.{trial.number}",
            "its worker stopped sending heartbeats mid-trial; failed, not counted",
        )
        if self.notify is not None:
            try:
                self.notify(study, trial)
            except Exception as e:  # never let bookkeeping stop a worker
                warnings.warn(f"could not record interrupted trial {trial.number}: {e}", stacklevel=2)
        if self.retry is not None:
            with _experimental_ok():
                self.retry(study, trial)


def sampler_seed(sweep: SweepSpec, worker: int = 0, n_existing: int = 0) -> int:
    """Worker k of a new study is seeded `seed + k` (workers with one seed would propose the same configurations).
    A process that opens a study already holding trials gets a seed of its own from (seed, worker, number of
    trials): re-seeded as at the start, its sampler would replay the first proposals — trial 3 of a resumed
    study came out exactly trial 0's configuration, collapse and all. The grid sampler is the exception: it
    numbers the grid's points in a seeded shuffle and skips the numbers the study has run, so every worker and
    every resume must shuffle alike — `seed` itself."""
    if n_existing == 0 or sweep.sampler.type == "grid":
        return sweep.seed + (0 if sweep.sampler.type == "grid" else worker)
    digest = hashlib.sha256(f"{sweep.seed}/{worker}/{n_existing}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def make_sampler(sweep: SweepSpec, worker: int = 0, n_existing: int = 0) -> optuna.samplers.BaseSampler:
    """The sweep's sampler, seeded by `sampler_seed`."""
    s, seed = sweep.sampler, sampler_seed(sweep, worker, n_existing)
    if s.type == "grid":
        return optuna.samplers.GridSampler({k: p.grid_values() for k, p in sweep.space.items()}, seed=seed)
    if s.type == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=s.n_startup_trials, multivariate=s.multivariate, constant_liar=True
    )


def make_pruner(sweep: SweepSpec) -> optuna.pruners.BasePruner:
    p = sweep.pruner
    if p.type == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=p.n_startup_trials, n_warmup_steps=p.n_warmup_steps)
    if p.type == "percentile":
        return optuna.pruners.PercentilePruner(
            p.percentile, n_startup_trials=p.n_startup_trials, n_warmup_steps=p.n_warmup_steps
        )
    if p.type == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=p.min_resource, reduction_factor=p.reduction_factor, bootstrap_count=p.bootstrap_count
        )
    if p.type == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=p.min_resource, max_resource=p.max_resource or "auto", reduction_factor=p.reduction_factor
        )
    return optuna.pruners.NopPruner()


# ------------------------------------------------------------------------------------------ the study


def open_study(sweep: SweepSpec, storage: RDBStorage, n_trials: int | None = None, worker: int = 0) -> optuna.Study:
    """Create the sweep's study, or resume it. Stores the definition and the total (`n_trials`, else the
    file's) on the study; workers that join read both from there."""
    import json

    if n_trials is not None and sweep.sampler.type == "grid" and n_trials > sweep.grid_size():
        raise SweepError(
            f"--trials {n_trials} is more than the {sweep.grid_size()} points of the grid sweep {sweep.study_name!r}"
        )
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        storage=storage,
        study_name=sweep.study_name,
        directions=sweep.directions,
        sampler=make_sampler(sweep, worker),
        pruner=make_pruner(sweep),
        load_if_exists=True,
    )
    stored = study.user_attrs.get(SWEEP_ATTR)
    if stored is None:
        study.set_user_attr(SWEEP_ATTR, json.dumps(sweep.model_dump(mode="json")))
    else:
        before = SweepSpec.model_validate(json.loads(stored)).definition()
        now = sweep.definition()
        changed = next((k for k in now if before.get(k) != now.get(k)), None)
        if changed:
            raise SweepError(
                f"study {sweep.study_name!r} already exists in this storage with a different "
                f"'{changed}'; resume it with the sweep file it started with (only trials may change), "
                "or name a new study"
            )
    if [d.name.lower() for d in study.directions] != sweep.directions:
        have = [d.name.lower() for d in study.directions]
        raise SweepError(
            f"study {sweep.study_name!r} exists with directions {have}, "
            f"the sweep file asks for {sweep.directions}; name a new study"
        )
    study.set_user_attr(TRIALS_ATTR, int(n_trials or sweep.n_trials))
    study.sampler = make_sampler(sweep, worker, len(study.trials))
    return study


def join_study(name: str, storage: RDBStorage, worker: int = 0) -> tuple[optuna.Study, SweepSpec]:
    """Open an existing sweep's study from its name alone (what `ballast sweep-worker` does)."""
    import json

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        summaries = {s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    except Exception as e:
        raise SweepError(f"cannot read studies from the storage: {e}") from None
    if name not in summaries:
        raise SweepError(
            f"study {name!r} does not exist in this storage (it has {sorted(summaries) or 'none'}); "
            "create it with `ballast sweep FILE --storage URL` first"
        )
    attrs = optuna.load_study(study_name=name, storage=storage).user_attrs
    if SWEEP_ATTR not in attrs:
        raise SweepError(f"study {name!r} was not created by `ballast sweep` (it has no sweep definition)")
    sweep = SweepSpec.model_validate(json.loads(attrs[SWEEP_ATTR]))
    study = optuna.load_study(study_name=name, storage=storage, pruner=make_pruner(sweep))
    study.sampler = make_sampler(sweep, worker, len(study.trials))
    return study, sweep


def target(study: optuna.Study) -> int:
    return int(study.user_attrs[TRIALS_ATTR])


def counts(study: optuna.Study) -> dict[str, int]:
    out = {s.name: 0 for s in TrialState}
    for t in study.get_trials(deepcopy=False):
        out[t.state.name] += 1
    return out


def n_done(study: optuna.Study) -> int:
    c = counts(study)
    return c["COMPLETE"] + c["PRUNED"]


# ------------------------------------------------------------------------------------------ one trial

RunFn = Callable[..., "PipelineResult"]
"""run_fn(spec, callbacks, trial) -> the trial's pipeline result (flows/sweep.py runs the pipeline flow)."""


def run_trial(trial: optuna.Trial, sweep: SweepSpec, run_fn: RunFn) -> float | list[float]:
    """Suggest, build the trial's spec, run the pipeline through `run_fn`, judge the outcome."""
    params = suggest(trial, sweep.space)
    spec = trial_spec(sweep, params, name=f"{sweep.study_name}-trial-{trial.number}")
    trial.set_user_attr("planned_steps", int(spec.optim.steps))  # what pruning saved is measured against this
    result = run_fn(spec, TrialPruning(trial, sweep, spec), trial)
    trial.set_user_attr("mlflow_run_id", result.run_id)
    return verdict(trial, result, sweep, spec.health)


# ------------------------------------------------------------------------------------------ the worker loop


class Surplus(Exception):
    """This trial started after the study already had its total done or in flight."""


class SweepWorkerError(RuntimeError):
    pass


@dataclass
class WorkerReport:
    ran: list[int] = field(default_factory=list)
    states: dict[int, str] = field(default_factory=dict)
    timed_out: bool = False


def optimize(
    study: optuna.Study,
    objective: Callable[[optuna.Trial], float | Sequence[float]],
    n_trials: int | None = None,
    callbacks: Sequence[Callable] = (),
    max_consecutive_failures: int = 3,
    poll_s: float | None = None,
    log: Callable[[str], None] = print,
    timeout_s: float | None = None,
) -> WorkerReport:
    """Run trials until the study holds `n_trials` (default: its stored total) COMPLETE + PRUNED trials,
    counting every worker's. Returns what this worker ran.

    Optuna's `MaxTrialsCallback`, counting the study's done *and running* trials, ends this worker's
    `study.optimize` as soon as no room is left for another trial; the loop around it then returns (the total
    is done) or waits for the trials running elsewhere, which may still fail and leave room again.

    `timeout_s` is a budget of wall time: no trial starts after it is spent (a trial running then finishes), and
    `report.timed_out` says the loop ended for it."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    total = n_trials if n_trials is not None else target(study)
    poll = poll_s or float(getattr(study._storage, "heartbeat_interval", None) or 5)
    report, waiting_said = WorkerReport(), False
    tally = _Tally(report, max_consecutive_failures)
    no_room = MaxTrialsCallback(total, states=(*DONE, TrialState.RUNNING))

    def claimed(trial: optuna.Trial):
        trial.set_user_attr("worker", WORKER_ID)
        busy = study.get_trials(deepcopy=False, states=(*DONE, TrialState.RUNNING))
        ahead = sum(1 for t in busy if t.number < trial.number)
        if ahead >= total:  # two workers found room for one trial at the same moment: the later one stands down
            trial.set_user_attr(
                "not_counted", f"surplus: {ahead} trials were already done or running for a total of {total}"
            )
            raise Surplus()
        try:
            return objective(trial)
        except (optuna.TrialPruned, KeyboardInterrupt):
            raise
        except Exception as e:
            trial.set_user_attr("error", f"{type(e).__name__}: {e}"[:2000])
            raise

    while True:
        with _experimental_ok():
            optuna.storages.fail_stale_trials(study)
        c = counts(study)
        done = c["COMPLETE"] + c["PRUNED"]
        if done >= total:
            return report
        if deadline is not None and time.monotonic() >= deadline:
            report.timed_out = True
            return report
        if done + c["RUNNING"] >= total:
            if not waiting_said:
                log(f"{done} of {total} trials done, {c['RUNNING']} running elsewhere; waiting for them")
                waiting_said = True
            time.sleep(poll)
            continue
        waiting_said = False
        with _experimental_ok():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            study.optimize(claimed, catch=(Exception,), callbacks=[tally, *callbacks, no_room], timeout=left)
        if tally.error:
            raise SweepWorkerError(tally.error)


class _Tally:
    """Study callback: what this worker ran, and a stop after `limit` failed trials in a row (surplus trials,
    which never ran, are not counted)."""

    def __init__(self, report: WorkerReport, limit: int):
        self.report, self.limit, self.failures, self.error = report, limit, 0, None

    def __call__(self, study: optuna.Study, frozen: FrozenTrial) -> None:
        if "not_counted" in frozen.user_attrs:
            return
        self.report.ran.append(frozen.number)
        self.report.states[frozen.number] = frozen.state.name
        if frozen.state != TrialState.FAIL:
            self.failures = 0
            return
        self.failures += 1
        if self.failures >= self.limit:
            self.error = (
                f"{self.failures} trials in a row failed; the last (trial {frozen.number}): "
                f"{frozen.user_attrs.get('error', 'see its MLflow run')}"
            )
            study.stop()
