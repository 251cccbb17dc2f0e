"""The sweep flows: an Optuna study whose trials are pipeline runs, one MLflow parent run with a child run per trial.

    ballast sweep examples/sweep.yaml                         # create or resume the study, run it here
    ballast sweep examples/sweep.yaml --trials 20 --workers 2 # 2 worker processes on this machine
    ballast sweep examples/sweep.yaml --timeout 600 --set optim.steps=12   # a wall-time budget; base spec override
    ballast sweep FILE --storage postgresql://user@host/db --workers 0    # create only; print the join command
    ballast sweep-worker --study NAME --storage URL           # join a study from any machine

A sweep reads as its sequence: open the study (sweeps/study.py) and the MLflow parent run → measure the baseline
once — the base model (or fork source) on the trials' held-out set with their eval settings (sweeps/baseline.py),
stored on the study and the parent run → run the trials through a trial runner (sweeps/runner.py's interface;
flows/trials/ `choose_runner`: one at a time here, `concurrent_trials` at once here, or K workers — processes here
or one per node when the base spec's `infra.compute` is local or skypilot) → write the summary.
`ballast-sweep-worker` is one worker's share: this process's runner on a study it joins by name; on other machines
it grows a sweep past one node through Optuna's RDB storage. Storage: SQLite under the project folder by default
(a couple of local workers), PostgreSQL for many; keep the password out of the URL (PGPASSWORD or ~/.pgpass) — it
is a flow parameter and is printed.

The terminal shows one progress line per trial and, after each trial, its outcome and the sweep's: trials done,
best so far against the baseline (flows/trials/lines.py).
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import optuna
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.confirm import confirm_sweep, ensure_split
from flows.machine import load_warning
from flows.trials import choose_runner, in_process_runner
from flows.trials.workers import worker_budget
from sweeps.baseline import BASELINE_ATTR, Baseline, load_baseline
from sweeps.once import delete_locks, in_progress, run_once
from sweeps.report import SweepSummary, plot_study, summarize
from sweeps.runner import Budget
from sweeps.space import base_spec, baseline_spec, load_sweep
from sweeps.study import (
    TRIALS_ATTR,
    SweepWorkerError,
    check_worker_placement,
    join_study,
    make_storage,
    n_done,
    open_study,
    redact_url,
    study_storage,
    target,
)
from tasks.eval import eval_baseline
from tasks.fork import fork
from tasks.remote import NodeChoice
from tasks.spec import validate_spec
from tasks.sweep_record import SweepRecorder

# ------------------------------------------------------------------------------------------ the baseline


def measure_baseline(sweep, recorder: SweepRecorder) -> Baseline:
    """The base model's (or fork source's) held-out scores with the trials' eval settings."""
    spec = validate_spec(baseline_spec(sweep), "sweep base spec")  # every held-out prompt: read part by part
    started = time.perf_counter()
    source = fork(spec, recorder.tracking.checkpoint_prefix)
    cache = Path(spec.project_dir).resolve() / "cache" / "sweeps" / sweep.study_name
    result = eval_baseline(spec, source, cache)
    return Baseline(result.checkpoint_uri, result.metrics, result.per_prompt, time.perf_counter() - started)


baseline_task = task(measure_baseline, name="baseline", cache_policy=NO_CACHE, persist_result=False)


def ensure_baseline(study, sweep, recorder: SweepRecorder, label: str = "") -> Baseline:
    """The study's baseline, measured once (before its first trial, by one of the workers that share the study:
    sweeps/once.py; the others wait for it) and stored on the study and the parent run."""
    ensure_split(study, sweep)  # the held-out prompts dealt into selection and confirmation, once

    def say(line: str) -> None:
        print(f"{label}{line}", flush=True)

    def measure() -> None:
        say(f"baseline: scoring {_source_name(sweep)} on the trials' held-out set ...")
        baseline = baseline_task(sweep, recorder)
        study.set_user_attr(BASELINE_ATTR, baseline.to_json())
        recorder.record_baseline(baseline)
        took = f"{baseline.seconds:.1f}" if baseline.seconds < 10 else f"{baseline.seconds:.0f}"  # not '(0 s)'
        say(f"{baseline_line(baseline, sweep)} ({took} s)")

    beats = {"beat_s": sweep.heartbeat.interval, "stale_s": sweep.heartbeat.grace_period}
    run_once(study, "baseline", measure, done=lambda: load_baseline(study) is not None, say=say, **beats)
    return load_baseline(study)


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


# ------------------------------------------------------------------------------------------ the study, the summary


def make_recorder(sweep) -> SweepRecorder:
    recorder = SweepRecorder(validate_spec(base_spec(sweep), "sweep base spec"), sweep.study_name)
    key = sweep.objectives[0].key
    recorder.objective = key if key.startswith("eval/") else None  # held-out: its trial runs carry Gain/<key>
    recorder.log_scaled = [name for name, p in sweep.space.items() if p.log]
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
    summary.mlflow_url, summary.compare_url = recorder.tracking.experiment_url(), recorder.compare_url()
    summary.write(out_dir)
    record_compute(recorder, summary)
    recorder.record_summary(summary, out_dir)
    return summary


def record_compute(recorder: SweepRecorder, summary: SweepSummary) -> None:
    """What the sweep's compute cost, on its parent run: metrics `compute/*` and the line as tag `compute`."""
    for key, value in summary.compute.metrics().items():
        recorder.client.log_metric(recorder.parent_run_id, key, value)
    recorder.tracking.set_tags(recorder.parent_run_id, {"compute": summary.compute.line()})


def delete_sweep(study_name: str, storage_url: str) -> str:
    """The study deleted from its storage, and its MLflow parent run with every trial run (and their stage runs)
    under it: nothing of the sweep is left behind. What was deleted, as a line."""
    study, sweep = join_study(study_name, make_storage(storage_url))
    recorder, n_trials = make_recorder(sweep), len(study.trials)
    try:
        recorder.join(study)
        runs = f"its MLflow parent run {recorder.parent_run_id} and {recorder.delete() - 1} run(s) under it"
    except Exception as e:  # a study with no parent run, or whose tracking store forgot it: the study still goes
        runs = f"no MLflow runs ({e})"
    optuna.delete_study(study_name=study_name, storage=study._storage)
    delete_locks(study_name, study._storage)  # a round a killed worker held: its lock study goes too
    return f"deleted study {study_name} ({n_trials} trials) from {redact_url(storage_url)} and {runs}"


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
    if workers >= 1 and spec.infra.compute != "here":  # a storage the nodes could not use: refused before they start
        check_worker_placement(spec, url)
    study, recorder = open_sweep(sweep, url, trials, worker=0)
    if busy := load_warning(spec, sweep.concurrent_trials):
        print(busy, flush=True)
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
        runner = choose_runner(sweep, spec, url, workers)
        timed_out = runner.run(study, sweep, recorder, Budget.of(target(study), timeout_s)).timed_out
        if timed_out or n_done(study) >= target(study):  # the search has ended: its verdict, on prompts it never saw
            confirm_sweep(study, sweep, recorder)
    except SweepWorkerError:
        summary_task(study, sweep, recorder, url)  # what the trials so far found, then the error
        raise
    except BaseException:
        recorder.interrupted()
        raise
    return summary_task(study, sweep, recorder, url, timed_out)


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
    label = f"[worker {worker}] "
    ensure_baseline(st, sweep, recorder, label=label)  # one of the workers measures it, the others wait
    in_process_runner(sweep, label).run(st, sweep, recorder, worker_budget(target(st)))
    if summary and n_done(st) >= target(st):
        confirm_sweep(st, sweep, recorder, label=label, wait=False)  # another worker confirming: left to it
        if in_progress(st, "confirmation"):  # its worker writes the summary and the parent run's verdict when done
            return None
        return summary_task(st, sweep, recorder, storage)
    return None
