"""The sweep flows: an Optuna study whose trials are pipeline runs, one MLflow parent run with a child run per trial.

    ballast sweep examples/sweep.yaml                         # create or resume the study, run it here
    ballast sweep examples/sweep.yaml --trials 20 --workers 2 # 2 worker processes on this machine
    ballast sweep FILE --storage postgresql://user@host/db --workers 0    # create only; print the join command
    ballast sweep-worker --study NAME --storage URL           # join a study from any machine

`ballast-sweep` opens the study (sweeps/study.py) and the MLflow parent run, runs the worker loop here (or starts
K `ballast sweep-worker` processes sharing the storage) and writes the summary. `ballast-sweep-worker` is one
process's worker loop; on other machines it grows a sweep past one node through Optuna's RDB storage. Each trial
is the pipeline flow (flows/pipeline.py) as a subflow, with the trial's pruning callbacks. Storage: SQLite under
the project folder by default (a couple of local workers), PostgreSQL for many; keep the password out of the URL
(PGPASSWORD or ~/.pgpass) — it is a flow parameter and is printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import optuna
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client

from flows.pipeline import run_pipeline
from sweeps.report import SweepSummary, format_values, plot_study, summarize
from sweeps.space import base_spec, load_sweep
from sweeps.study import (
    TRIALS_ATTR,
    SweepWorkerError,
    default_storage,
    join_study,
    make_storage,
    n_done,
    open_study,
    optimize,
    redact_url,
    run_trial,
    target,
)
from tasks.record import SweepRecorder
from tasks.spec import validate_spec
from tasks.train import RunInterrupted

CLI = "import sys; from flows.cli import main; sys.exit(main())"


def run_worker(study, sweep, recorder: SweepRecorder, label: str = "") -> list[int]:
    """This process's share of the study: trials until the study has its total."""

    def run_fn(spec, callbacks, trial):
        try:
            return run_pipeline(
                spec.model_dump(mode="json"),
                callbacks=[callbacks],
                parent_run_id=recorder.parent_run_id,
                tags=recorder.trial_tags(trial.number, dict(trial.params)),
                progress=False,
                flow_run_name=f"{recorder.study_name}-trial-{trial.number}",
            )
        except RunInterrupted as stop:  # SIGTERM / Ctrl-C stop the sweep, not only this trial
            raise KeyboardInterrupt(str(stop)) from stop

    def on_trial(st, frozen) -> None:
        recorder.record_trial(st, frozen)
        print(label + trial_line(frozen), flush=True)

    report = optimize(
        study,
        lambda trial: run_trial(trial, sweep, run_fn),
        callbacks=[on_trial],
        max_consecutive_failures=sweep.max_consecutive_failures,
        log=lambda m: print(label + m, flush=True),
    )
    return report.ran


def trial_line(frozen) -> str:
    steps = frozen.user_attrs.get("last_step", "?")
    if frozen.state.name == "COMPLETE":
        what = ", ".join(
            f"{k.removeprefix('objective/')}={v:.4g}"
            for k, v in frozen.user_attrs.items()
            if k.startswith("objective/")
        )
    elif frozen.state.name == "PRUNED":
        what = frozen.user_attrs.get("prune_reason", "")
    else:
        what = frozen.user_attrs.get("error") or frozen.user_attrs.get("not_counted") or ""
    return f"trial {frozen.number} {frozen.state.name} after {steps} steps: {what}  ({format_values(frozen.params)})"


def open_sweep(sweep, storage_url: str, n_trials: int | None, worker: int):
    """Storage (heartbeats + interrupted-trial bookkeeping), study, recorder and its parent run."""
    recorder = SweepRecorder(validate_spec(base_spec(sweep), "sweep base spec"), sweep.study_name)
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


def spawn_workers(study_name: str, storage_url: str, k: int) -> list[int]:
    """K `ballast sweep-worker` processes on this machine, sharing the storage (and this Prefect API); exit codes."""
    with get_client(sync_client=True) as client:  # the API this process uses (the ephemeral server's, too)
        env = dict(os.environ, PREFECT_API_URL=str(client.api_url))
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


def write_summary(study, sweep, recorder: SweepRecorder, storage_url: str) -> SweepSummary:
    """Best trial / Pareto set, importances, plots, summary.html/json; logged to the parent run."""
    out_dir = Path(recorder.tracking.spec.project_dir).resolve() / "sweeps" / study.study_name
    summary = summarize(study, sweep)
    summary.plots, summary.plots_skipped = plot_study(study, sweep, out_dir / "plots")
    summary.storage, summary.n_trials = redact_url(storage_url), target(study)
    summary.done, summary.parent_run_id = n_done(study) >= target(study), recorder.parent_run_id
    summary.dashboard = f"optuna-dashboard {redact_url(storage_url)}   (pip install optuna-dashboard)"
    summary.run_url_template = recorder.tracking.run_url("{run_id}")  # each trial's MLflow run, linked on the page
    summary.write(out_dir)
    recorder.record_summary(summary, out_dir)
    return summary


summary_task = task(write_summary, name="sweep-summary", cache_policy=NO_CACHE, persist_result=False)


@flow(name="ballast-sweep", persist_result=False)
def ballast_sweep(
    sweep_path: str = "examples/sweep.yaml", trials: int | None = None, workers: int = 1, storage: str | None = None
) -> SweepSummary | None:
    sweep = load_sweep(sweep_path)
    url = storage or sweep.storage or default_storage(base_spec(sweep).get("project_dir", ".ballast"))
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
        if workers == 1:
            run_worker(study, sweep, recorder)
        elif any(codes := spawn_workers(study.study_name, url, workers)):
            print(f"worker exit codes: {codes}")
    except SweepWorkerError:
        summary_task(study, sweep, recorder, url)  # what the trials so far found, then the error
        raise
    except BaseException:
        recorder.interrupted()
        raise
    return summary_task(study, sweep, recorder, url)


@flow(name="ballast-sweep-worker", persist_result=False)
def ballast_sweep_worker(
    study: str, storage: str, trials: int | None = None, worker: int = 0, summary: bool = True
) -> SweepSummary | None:
    _, sweep = join_study(study, make_storage(storage), worker=worker)  # the definition, then the real storage
    recorder = SweepRecorder(validate_spec(base_spec(sweep), "sweep base spec"), sweep.study_name)
    st, sweep = join_study(
        study, make_storage(storage, sweep.heartbeat, on_interrupted=recorder.record_interrupted), worker=worker
    )
    recorder.join(st)
    if trials is not None:
        st.set_user_attr(TRIALS_ATTR, int(trials))
    run_worker(st, sweep, recorder, label=f"[worker {worker}] ")
    if summary and n_done(st) >= target(st):
        return summary_task(st, sweep, recorder, storage)
    return None
