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
- **Seeds.** Each new configuration is sampled by a sampler seeded by its place in the study's sequence
  (`sampler_seed`: worker k's first `seed + k`, each after it from (seed, worker, place)), so a resumed
  study samples what the uninterrupted one would have, and never replays the proposals of an earlier run.
- **Interrupted trials run again, never replaced** (sweeps/runner.py's contract). A trial stopped by
  Ctrl-C or SIGTERM is failed (not counted) and its configuration queued again at once (`requeue`); one
  whose worker died is failed and queued by the next worker that looks — at once when the worker was a
  process of this machine that is gone (`fail_dead_workers`), after the heartbeat's grace period
  otherwise (`RDBStorage(heartbeat_interval, grace_period)`, `heartbeat.retries` times). The queued
  configuration runs before any new one is sampled; its attempts' MLflow runs are deleted when it starts
  (tasks/sweep_record.py `discard_trial_runs`), and pruners leave the interrupted attempts' rungs out
  (`WithoutInterrupted`): the finished study holds each configuration once.
- **The trial.** `run_trial` asks the trial for values (define-by-run), builds the trial's experiment
  spec, and calls *the function that runs a pipeline*, given by the caller: sweeps/ never imports
  flows/ (DESIGN.md) — flows/sweep.py passes a Prefect subflow around the pipeline.
"""

from __future__ import annotations

import hashlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RDBStorage
from optuna.study import MaxTrialsCallback
from optuna.trial import FrozenTrial, TrialState

from tasks.results import PipelineResult

from .once import LOCK_INFIX, WORKER_ID, gone_here
from .pruning import TrialPruning, verdict
from .runner import RunnerReport
from .space import SweepError, SweepSpec, suggest, trial_spec
from .stored import SWEEP_ATTR, check_definition

DONE = (TrialState.COMPLETE, TrialState.PRUNED)
TRIALS_ATTR = "ballast.n_trials"  # study user attr: the total the study should end with
SQLITE_TIMEOUT_S = 60  # how long a SQLite writer waits for another process's lock
NODE_ATTR = "ballast.node."  # study user attrs `ballast.node.<when>.<worker>`: a worker node's usage (JSON)
COMPUTE_ATTR = "compute"  # trial user attr: what the trial's own train-stage node used (its MLflow compute/*)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
INTERRUPTED_ATTR = "ballast.interrupted."  # study user attrs `ballast.interrupted.<trial>`: why it was interrupted
STOPPED = "stopped by Ctrl-C or SIGTERM mid-trial; failed, not counted, its configuration queued to run again"
RETRY_ATTR = "ballast.retry_of"  # trial user attr: the numbers of the interrupted attempts it runs again
POLL_S = 5.0  # how often a worker waiting for trials running elsewhere looks again (at most; a shorter heartbeat: that)


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
    """A trial whose worker stopped mid-trial (heartbeat-stale, or a dead process of this machine): noted on the
    study, told to the caller, its configuration queued again (`requeue`) up to `heartbeat.retries` times — a
    configuration that gets its worker killed each time (the OOM killer) would otherwise run first on every resume
    and the sweep never get past it. A Ctrl-C or SIGTERM is not this: a stopped trial always runs again."""

    def __init__(self, retries: int, notify=None):
        self.retries, self.notify = retries, notify

    def __call__(self, study: optuna.Study, trial: FrozenTrial, dead: bool = False) -> None:
        why = "its worker process died mid-trial" if dead else "its worker stopped sending heartbeats mid-trial"
        if self.notify is not None:
            try:
                self.notify(study, trial)
            except Exception as e:  # never let bookkeeping stop a worker
                warnings.warn(f"could not record interrupted trial {trial.number}: {e}", stacklevel=2)
        if not requeue(study, trial, f"{why}; failed, not counted", limit=self.retries) and trial.params:
            attempts = len(retried(trial)) + 1
            print(
                f"trial {trial.number}: {why}; its configuration was interrupted {attempts} times "
                f"(heartbeat.retries: {self.retries}) and is not queued again — raise heartbeat.retries to run it",
                flush=True,
            )


def requeue(study: optuna.Study, trial: FrozenTrial, why: str, limit: int | None = None) -> bool:
    """An interrupted trial's configuration back in the study's queue (WAITING), to run again before any new one is
    sampled; the trial is noted on the study as interrupted (INTERRUPTED_ATTR: pruners leave its rungs out, the
    sampler does not count it). Its retry carries the numbers of the attempts before it (RETRY_ATTR), whose MLflow
    runs the runner deletes when it starts it. Nothing queued for a trial killed before its values were
    suggested, or past `limit` attempts."""
    study.set_user_attr(f"{INTERRUPTED_ATTR}{trial.number}", why)
    history = [*trial.user_attrs.get(RETRY_ATTR, []), trial.number]
    if not trial.params or (limit is not None and len(history) > limit):
        return False
    study.enqueue_trial(dict(trial.params), user_attrs={RETRY_ATTR: history}, skip_if_exists=False)
    return True


def interrupted_numbers(study: optuna.Study) -> set[int]:
    """The trials the study noted as interrupted (`requeue`)."""
    return {int(k.removeprefix(INTERRUPTED_ATTR)) for k in study.user_attrs if k.startswith(INTERRUPTED_ATTR)}


def retried(trial) -> list[int]:
    """The earlier attempts this trial runs again (their numbers), none for a new configuration."""
    return list(trial.user_attrs.get(RETRY_ATTR, []))


def fail_dead_workers(study: optuna.Study) -> None:
    """RUNNING trials whose worker was a process of this machine that is gone (SIGKILL, a crash): failed and
    re-queued now, as a stale heartbeat would have them after its grace period — a sweep resumed at once runs the
    killed configuration first, as the uninterrupted sweep ran it."""
    storage = study._storage
    callback = getattr(storage, "get_heartbeat_stale_trial_callback", lambda: None)()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not (gone_here(str(t.user_attrs.get("worker", ""))) or _never_claimed(storage, t)):
            continue
        try:
            storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another worker failed it first
        if isinstance(callback, _Interrupted):
            callback(study, storage.get_trial(t._trial_id), dead=True)


def _rdb(storage):
    """The RDBStorage under Optuna's cache wrapper (`_CachedStorage`, which exposes none of its settings)."""
    return getattr(storage, "_backend", storage)


def _never_claimed(storage, t: FrozenTrial) -> bool:
    """A trial whose worker was killed between Optuna's ask() and naming itself: it has no worker to look up and
    never had a heartbeat, which Optuna's stale check needs, so it stayed RUNNING for good — and a sweep whose
    total counts it waited for it ("running elsewhere") forever. Failed once it is older than the heartbeat's grace
    period (a live worker names itself within milliseconds of ask()); never with heartbeats off."""
    rdb = _rdb(storage)
    interval = getattr(rdb, "heartbeat_interval", None)
    if interval is None or "worker" in t.user_attrs or t.datetime_start is None:
        return False
    grace = getattr(rdb, "grace_period", None) or 2 * interval
    return (datetime.now() - t.datetime_start).total_seconds() > grace


def sampler_seed(sweep: SweepSpec, worker: int = 0, k: int = 0) -> int:
    """The seed of worker `worker`'s `k`-th new configuration in the study (0, 1, ...; a re-queued trial is not a new
    one): `seed + worker` for the first — workers with one seed would propose the same configurations — and one
    drawn from (seed, worker, k) for each after it. A configuration's seed is its place in the sequence, not the
    process that samples it: a sweep killed or interrupted and resumed samples what the uninterrupted sweep
    sampled (the killed configuration first, re-queued, then the same sequence), and a resumed study never
    replays its first proposals (trial 3 of a resumed study once came out exactly trial 0's configuration). The
    grid sampler is the exception: it numbers the grid's points in a seeded shuffle and skips the numbers the
    study has run, so every worker and every resume must shuffle alike — `seed` itself."""
    if sweep.sampler.type == "grid":
        return sweep.seed
    if k == 0:
        return sweep.seed + worker
    digest = hashlib.sha256(f"{sweep.seed}/{worker}/{k}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def make_sampler(sweep: SweepSpec, worker: int = 0) -> optuna.samplers.BaseSampler:
    """The sweep's sampler: the grid's, or one seeded per new configuration (`SeededPerTrial`)."""
    if sweep.sampler.type == "grid":
        values = {k: p.grid_values() for k, p in sweep.space.items()}
        return optuna.samplers.GridSampler(values, seed=sampler_seed(sweep))
    return SeededPerTrial(lambda k: _sampler(sweep, sampler_seed(sweep, worker, k)))


def _sampler(sweep: SweepSpec, seed: int) -> optuna.samplers.BaseSampler:
    s = sweep.sampler
    if s.type == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    with _experimental_ok():
        return optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=s.n_startup_trials, multivariate=s.multivariate, constant_liar=True
        )


class SeededPerTrial(optuna.samplers.BaseSampler):
    """A sampler made afresh for each trial, seeded by the trial's place among the study's new configurations (`k`:
    trials before it that sampled their values — neither re-queued nor killed before suggesting). What it proposes
    depends on the study's history and `k` alone, not on how many processes sampled before it."""

    def __init__(self, make: Callable[[int], optuna.samplers.BaseSampler]):
        self.make, self.samplers = make, {}

    def of(self, study: optuna.Study, trial: FrozenTrial) -> optuna.samplers.BaseSampler:
        if trial.number not in self.samplers:
            earlier = study.get_trials(deepcopy=False)
            k = sum(1 for t in earlier if t.number < trial.number and t.params and "fixed_params" not in t.system_attrs)
            self.samplers[trial.number] = self.make(k)
        return self.samplers[trial.number]

    def infer_relative_search_space(self, study, trial):
        return self.of(study, trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self.of(study, trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self.of(study, trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial) -> None:
        self.of(study, trial).before_trial(study, trial)

    def after_trial(self, study, trial, state, values) -> None:
        self.samplers.pop(trial.number, self.make(0)).after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:  # each trial's sampler is seeded by its place already
        pass


def make_pruner(sweep: SweepSpec) -> optuna.pruners.BasePruner:
    """The sweep's pruner; successive halving's blind to interrupted trials (`WithoutInterrupted`). The median and
    percentile pruners read COMPLETE trials alone; Hyperband is left as Optuna makes it (its samplers find it by
    type, to read each bracket apart)."""
    p = sweep.pruner
    if p.type == "successive_halving":
        return WithoutInterrupted(
            min_resource=p.min_resource, reduction_factor=p.reduction_factor, bootstrap_count=p.bootstrap_count
        )
    return _pruner(sweep)


def _pruner(sweep: SweepSpec) -> optuna.pruners.BasePruner:
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


class WithoutInterrupted(optuna.pruners.SuccessiveHalvingPruner):
    """Successive halving that compares a trial with the study's trials less the interrupted ones: a killed attempt's
    rung values (kept on the trial, whatever its state) would count its configuration twice once its re-queued run
    reaches the rung, and prune others where the uninterrupted sweep did not."""

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        return super().prune(_StudyWithout(study, interrupted_numbers(study)), trial)


class _StudyWithout:
    """The study as a pruner reads it, its trials less those numbered in `left_out`."""

    def __init__(self, study: optuna.Study, left_out: set[int]):
        self._study, self._left_out = study, left_out

    def __getattr__(self, name: str):
        return getattr(self._study, name)

    def get_trials(self, deepcopy: bool = True, states=None) -> list[FrozenTrial]:
        return [t for t in self._study.get_trials(deepcopy=deepcopy, states=states) if t.number not in self._left_out]

    def _get_trials(self, deepcopy: bool = True, states=None, use_cache: bool = False) -> list[FrozenTrial]:
        trials = self._study._get_trials(deepcopy=deepcopy, states=states, use_cache=use_cache)
        return [t for t in trials if t.number not in self._left_out]


# ------------------------------------------------------------------------------------------ the study


def open_study(sweep: SweepSpec, storage: RDBStorage, n_trials: int | None = None, worker: int = 0) -> optuna.Study:
    """Create the sweep's study, or resume it. Stores the definition and the total on the study — `n_trials`
    (--trials), else the file's when the study is new or the file's changed, else the total it had — workers that
    join read both from there."""
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
    total = n_trials or sweep.n_trials
    if stored is None:
        study.set_user_attr(SWEEP_ATTR, json.dumps(sweep.model_dump(mode="json")))
    else:
        check_definition(sweep, stored)
        kept = json.loads(stored)
        if n_trials is None and kept.get("trials") == sweep.trials and TRIALS_ATTR in study.user_attrs:
            total = int(study.user_attrs[TRIALS_ATTR])  # a resume keeps the total it had (an earlier --trials)
        changed = {  # how trials run and how many, not what: workers read them
            k: v
            for k, v in (("concurrent_trials", sweep.concurrent_trials), ("trials", sweep.trials))
            if kept.get(k, 1 if k == "concurrent_trials" else None) != v
        }
        if changed:
            study.set_user_attr(SWEEP_ATTR, json.dumps({**kept, **changed}))
    if [d.name.lower() for d in study.directions] != sweep.directions:
        have = [d.name.lower() for d in study.directions]
        raise SweepError(
            f"study {sweep.study_name!r} exists with directions {have}, "
            f"the sweep file asks for {sweep.directions}; name a new study"
        )
    study.set_user_attr(TRIALS_ATTR, int(total))
    study.sampler = make_sampler(sweep, worker)
    return study


def join_study(name: str, storage: RDBStorage, worker: int = 0) -> tuple[optuna.Study, SweepSpec]:
    """Open an existing sweep's study from its name alone (what `ballast sweep-worker` does)."""
    import json

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        summaries = {s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    except Exception as e:
        raise SweepError(f"cannot read studies from the storage: {e}") from None
    summaries = {s for s in summaries if LOCK_INFIX not in s}  # a step's election (sweeps/once.py), not a sweep
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
    study.sampler = make_sampler(sweep, worker)
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
    spec = prepare_trial(trial, sweep)
    result = run_fn(spec, TrialPruning(trial, sweep, spec), trial)
    return judge_trial(trial, sweep, spec, result)


def prepare_trial(trial: optuna.Trial, sweep: SweepSpec):
    """Ask the trial for its values (define-by-run); its experiment spec."""
    params = suggest(trial, sweep.space)
    spec = trial_spec(sweep, params, name=f"{sweep.study_name}-trial-{trial.number}")
    trial.set_user_attr("planned_steps", int(spec.optim.steps))  # what pruning saved is measured against this
    trial.set_user_attr("completions_per_step", int(spec.grpo.prompts_per_step * spec.grpo.num_generations))
    return spec


def judge_trial(trial: optuna.Trial, sweep: SweepSpec, spec, result: PipelineResult) -> float | list[float]:
    """The trial's value(s) from its pipeline result, or optuna.TrialPruned (sweeps/pruning.py `verdict`)."""
    trial.set_user_attr("mlflow_run_id", result.run_id)
    return verdict(trial, result, sweep, spec.health)


# ------------------------------------------------------------------------------------------ the worker loop


class Surplus(Exception):
    """This trial started after the study already had its total done or in flight."""


class SweepWorkerError(RuntimeError):
    pass


def optimize(
    study: optuna.Study,
    objective: Callable[[optuna.Trial], float | Sequence[float]],
    n_trials: int | None = None,
    callbacks: Sequence[Callable] = (),
    max_consecutive_failures: int = 3,
    poll_s: float | None = None,
    log: Callable[[str], None] = print,
    timeout_s: float | None = None,
) -> RunnerReport:
    """Run trials until the study holds `n_trials` (default: its stored total) COMPLETE + PRUNED trials,
    counting every worker's. Returns what this worker ran.

    Optuna's `MaxTrialsCallback`, counting the study's done *and running* trials, ends this worker's
    `study.optimize` as soon as no room is left for another trial; the loop around it then returns (the total
    is done) or waits for the trials running elsewhere, which may still fail and leave room again.

    `timeout_s` is a budget of wall time: no trial starts after it is spent (a trial running then finishes), and
    `report.timed_out` says the loop ended for it."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    total = n_trials if n_trials is not None else target(study)
    report = RunnerReport()
    tally = _Tally(report, max_consecutive_failures)
    no_room = MaxTrialsCallback(total, states=(*DONE, TrialState.RUNNING))

    def claimed(trial: optuna.Trial):
        trial.set_user_attr("worker", WORKER_ID)
        _check_surplus(study, trial, total)
        try:
            return objective(trial)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM: Optuna fails the trial; its configuration runs again first
            requeue(study, trial, STOPPED)
            raise
        except optuna.TrialPruned:
            raise
        except Exception as e:
            trial.set_user_attr("error", f"{type(e).__name__}: {e}"[:2000])
            raise

    def run_some() -> None:
        with _experimental_ok():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            study.optimize(claimed, catch=(Exception,), callbacks=[tally, *callbacks, no_room], timeout=left)
        if tally.error:
            raise SweepWorkerError(tally.error)

    return _until_done(study, total, deadline, poll_s, log, report, run_some)


def poll_interval(study: optuna.Study) -> float:
    """Seconds between a waiting worker's looks at the study: POLL_S, or the heartbeat's interval where that is
    shorter (a dead worker shows within a heartbeat)."""
    interval = getattr(_rdb(study._storage), "heartbeat_interval", None)
    return float(min(interval or POLL_S, POLL_S))


def _until_done(study, total: int, deadline, poll_s, log, report: RunnerReport, run_some) -> RunnerReport:
    """Call `run_some()` while the study lacks its total and the budget lasts; while the rest of the total is running
    elsewhere, wait for it (it may still fail and leave room). Trials whose worker went silent are failed first."""
    poll = poll_s or poll_interval(study)
    waiting_said = False
    while True:
        fail_dead_workers(study)
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
        run_some()


def _check_surplus(study: optuna.Study, trial: optuna.Trial, total: int) -> None:
    """Surplus when the study had its total done or running before this trial: two workers found room for one
    trial at the same moment, and the later one stands down."""
    busy = study.get_trials(deepcopy=False, states=(*DONE, TrialState.RUNNING))
    ahead = sum(1 for t in busy if t.number < trial.number)
    if ahead >= total:
        trial.set_user_attr(
            "not_counted", f"surplus: {ahead} trials were already done or running for a total of {total}"
        )
        raise Surplus()


class _Tally:
    """Study callback: what this worker ran, and a stop after `limit` failed trials in a row (surplus trials,
    which never ran, are not counted)."""

    def __init__(self, report: RunnerReport, limit: int):
        self.report, self.limit, self.failures, self.error = report, limit, 0, None

    def __call__(self, study: optuna.Study, frozen: FrozenTrial) -> None:
        if self.count(frozen):
            study.stop()

    def count(self, frozen: FrozenTrial) -> bool:
        """Note the trial; whether the failures in a row reached the limit (then `error` says so)."""
        if "not_counted" in frozen.user_attrs:
            return False
        self.report.ran.append(frozen.number)
        self.report.states[frozen.number] = frozen.state.name
        if frozen.state != TrialState.FAIL:
            self.failures = 0
            return False
        self.failures += 1
        if self.failures >= self.limit and self.error is None:  # trials running beside it may fail after it
            self.error = (
                f"{self.failures} trials in a row failed; the last (trial {frozen.number}): "
                f"{frozen.user_attrs.get('error', 'see its MLflow run')}"
            )
            return True
        return False


# ------------------------------------------------------------------------------------------ N trials at a time


class AskTell:
    """`optimize`'s worker loop for trials that run several at a time in this process (`concurrent_trials`), on
    Optuna's ask-and-tell interface: the caller pulls a trial from `asked()` when a slot is free and hands it back
    through `tell()` when it ends. What `optimize` does is kept, so a trial ends in the study as it would there: the
    study's total of COMPLETE + PRUNED trials (counting every worker's, and running ones, so a trial is asked only
    when there is room for it), the surplus check, the time budget (no trial is asked after it), the stop after
    `max_consecutive_failures` failed trials in a row (the running ones finish first), the study callbacks after each
    trial, and heartbeats — one thread writes them for all of this worker's running trials, as `study.optimize`
    writes one trial's, so a worker that dies leaves trials the next worker fails and re-queues."""

    def __init__(
        self,
        study: optuna.Study,
        callbacks: Sequence[Callable] = (),
        max_consecutive_failures: int = 3,
        log: Callable[[str], None] = print,
        timeout_s: float | None = None,
        n_trials: int | None = None,
        poll_s: float | None = None,
    ):
        self.study, self.callbacks, self.log, self.poll_s = study, list(callbacks), log, poll_s
        self.total = n_trials if n_trials is not None else target(study)
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.report = RunnerReport()
        self.tally = _Tally(self.report, max_consecutive_failures)
        self.interrupted: str | None = None  # a trial was stopped by a signal: no new trial, the loop ends after
        self.heartbeats = _Heartbeats(study)

    def run(self, batch: Callable[[Iterator[optuna.Trial]], None]) -> RunnerReport:
        """`batch(self.asked())` — which runs the trials it pulls and tells each — until the study has its total or
        the budget is spent; SweepWorkerError after too many failures in a row, KeyboardInterrupt after a trial was
        interrupted by a signal."""

        def run_some() -> None:
            batch(self.asked())
            if self.interrupted:
                raise KeyboardInterrupt(self.interrupted)
            if self.tally.error:
                raise SweepWorkerError(self.tally.error)

        with self.heartbeats:
            return _until_done(self.study, self.total, self.deadline, self.poll_s, self.log, self.report, run_some)

    def asked(self) -> Iterator[optuna.Trial]:
        """New trials, one per pull, while the study has room for another and neither the budget, a failure streak
        nor a signal says stop."""
        while not (self.tally.error or self.interrupted):
            if self.deadline is not None and time.monotonic() >= self.deadline:
                self.report.timed_out = True
                return
            c = counts(self.study)
            if c["COMPLETE"] + c["PRUNED"] + c["RUNNING"] >= self.total:
                return
            with warnings.catch_warnings():  # "Heartbeat ... supposed to be used with Study.optimize": written here
                warnings.filterwarnings("ignore", message="Heartbeat of storage")
                trial = self.study.ask()
            self.heartbeats.add(trial)  # first: killed before naming its worker, the trial is still found stale
            trial.set_user_attr("worker", WORKER_ID)
            try:
                _check_surplus(self.study, trial, self.total)
            except Surplus:
                self.tell(trial, None)
                continue
            yield trial

    def tell(self, trial: optuna.Trial, objective: Callable[[optuna.Trial], Any] | None) -> FrozenTrial:
        """Judge the ended trial with `objective(trial)` — its value(s), optuna.TrialPruned or an error, as an
        objective of `optimize` would — and tell the study (None: a surplus trial, failed uncounted); then the
        callbacks. A KeyboardInterrupt fails the trial, as Optuna does, and stops the loop once the running trials
        end; nothing raised by `objective` leaves here."""
        values, state, interrupted = None, None, None
        try:
            if objective is None:
                state = TrialState.FAIL
            else:
                values = objective(trial)
        except optuna.TrialPruned:
            state = TrialState.PRUNED
        except KeyboardInterrupt as e:
            state, interrupted = TrialState.FAIL, str(e) or "interrupted"
            requeue(self.study, trial, STOPPED)
        except Exception as e:
            trial.set_user_attr("error", f"{type(e).__name__}: {e}"[:2000])
            state = TrialState.FAIL
        finally:
            self.heartbeats.remove(trial)
        frozen = _tell(self.study, trial, values, state)
        if interrupted:
            self.interrupted = interrupted
            return frozen
        self.tally.count(frozen)
        for callback in self.callbacks:
            callback(self.study, frozen)
        return frozen


def _tell(study: optuna.Study, trial: optuna.Trial, values, state: TrialState | None) -> FrozenTrial:
    """`study.tell`, the trial stored whatever its sampler says after it: the grid sampler, its grid used up, calls
    `Study.stop`, which outside `optimize` raises (after the trial's state is stored). The loop ends at the study's
    total anyway, which the grid's size bounds (sweeps/space.py)."""
    try:
        return study.tell(trial, values, state=state)
    except RuntimeError as e:
        if "Study.stop" not in str(e):
            raise
        return study._storage.get_trial(trial._trial_id)


class _Heartbeats:
    """One thread writing a heartbeat for each of this worker's running trials every heartbeat interval; nothing
    when the storage has heartbeats off."""

    def __init__(self, study: optuna.Study):
        self.storage = study._storage
        with _experimental_ok():
            on = optuna.storages._heartbeat.is_heartbeat_enabled(self.storage)
        self.interval = self.storage.get_heartbeat_interval() if on else None
        self.trial_ids: set[int] = set()
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> _Heartbeats:
        if self.interval is not None:
            self.stop.clear()
            self.thread = threading.Thread(target=self._beat, name="sweep-heartbeats", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()

    def add(self, trial: optuna.Trial) -> None:
        if self.interval is not None:
            self.storage.record_heartbeat(trial._trial_id)
            with self.lock:
                self.trial_ids.add(trial._trial_id)

    def remove(self, trial: optuna.Trial) -> None:
        with self.lock:
            self.trial_ids.discard(trial._trial_id)

    def _beat(self) -> None:
        while not self.stop.wait(self.interval):
            with self.lock:
                ids = sorted(self.trial_ids)
            for trial_id in ids:
                try:
                    self.storage.record_heartbeat(trial_id)
                except Exception as e:  # a missed beat is late, not lost; the next one may get through
                    warnings.warn(f"could not write trial {trial_id}'s heartbeat: {e}", stacklevel=1)
