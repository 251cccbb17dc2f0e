"""The sweep flow: an Optuna study whose trials are pipeline runs, tracked as one MLflow parent run
with a child run per trial.

    ballast sweep examples/sweep.yaml                         # create or resume the study, run it here
    ballast sweep examples/sweep.yaml --trials 20 --workers 2 # 2 worker processes on this machine
    ballast sweep FILE --storage postgresql://user@host/db --workers 0    # create only; print the join command
    ballast sweep-worker --study NAME --storage URL           # join a study from any machine

What runs where:

- `ballast-sweep` (Prefect flow): opens the study (sweeps/study.py) and the MLflow parent run, then
  runs the worker loop in-process (`--workers 1`), or starts K `ballast sweep-worker` processes on
  this machine that share the storage (`--workers K`), and at the end writes the summary.
- `ballast-sweep-worker` (Prefect flow): the worker loop of one process; with `ballast sweep-worker`
  on other machines a sweep grows past one node through Optuna's RDB storage (PostgreSQL).
- `ballast-trial` (Prefect subflow, one per trial): `run_pipeline` with the trial's spec, the trial's
  pruning callbacks, the sweep's parent run and tags `ballast.study` / `ballast.trial_number`.

Storage: SQLite under the project folder by default (`<project_dir>/optuna.db`); it takes a couple
of local workers (writers wait up to 60 s for a lock), PostgreSQL takes many. For a team, keep the
password out of the URL (`postgresql://user@host/db` with PGPASSWORD or ~/.pgpass): the URL is a
flow parameter and is printed.

Each trial's child run gets, besides the pipeline's own lineage, `ballast.trial_state`
(COMPLETE | PRUNED | FAIL | INTERRUPTED), `ballast.prune_reason`, `ballast.trial_params` and one
`objective/<name>` metric per objective. The summary (best trial or Pareto set, parameter
importances, per-trial table, plots as PNG, summary.html and summary.json) goes under
`<project_dir>/sweeps/<study>/` and into the parent run's `summary/` artifacts. Look at the study
live with optuna-dashboard (`pip install optuna-dashboard`, then `optuna-dashboard <storage URL>`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from flows.cli import UserError, command

PARENT_ATTR = "ballast.mlflow_parent_run_id"
# `python -m flows.cli` would run the CLI as __main__, where the commands of flows/*.py do not register
CLI = "import sys; from flows.cli import main; sys.exit(main())"


# ── MLflow: the parent run, the child runs ─────────────────────────────────────────────────────────

class Tracker:
    """The sweep's MLflow side: one parent run per study, a child run per trial (made by run_pipeline)."""

    def __init__(self, base_spec, study_name: str):
        from tasks import lineage
        self.spec, self.study_name = base_spec, study_name
        self.client = lineage.setup(base_spec)
        self.experiment_id = self.client.get_experiment_by_name(base_spec.tracking.experiment).experiment_id
        self.parent_run_id: str | None = None

    def open_parent(self, study, sweep, storage_url: str) -> str:
        """The study's parent run: created with the study, found again on resume (its id is on the study)."""
        from tasks import lineage
        from sweeps.study import redact_url, target
        run_id = study.user_attrs.get(PARENT_ATTR)
        if run_id:
            try:
                self.client.get_run(run_id)
            except Exception:
                run_id = None  # the study outlived its tracking store: start a new parent run
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
        else:
            run_id = self.client.create_run(self.experiment_id, tags={"mlflow.runName": f"sweep {study.study_name}"}).info.run_id
            study.set_user_attr(PARENT_ATTR, run_id)
            params = {"sweep.study": study.study_name, "sweep.sampler": sweep.sampler.type, "sweep.pruner": sweep.pruner.type,
                      "sweep.prune_collapsed": str(sweep.prune_collapsed), "sweep.seed": str(sweep.seed),
                      "sweep.objectives": json.dumps([o.model_dump() for o in sweep.objectives])}
            params.update({f"space.{k}": json.dumps(p.model_dump(exclude_none=True))[:500] for k, p in sweep.space.items()})
            params.update({f"overrides.{k}": json.dumps(v)[:500] for k, v in sweep.overrides.items()})
            lineage.log_params(self.client, run_id, params)
        lineage.set_tags(self.client, run_id, {"kind": "sweep", "study": study.study_name, "storage": redact_url(storage_url),
                                               "n_trials": target(study), "status": "running"})
        self.parent_run_id = run_id
        return run_id

    def interrupted(self) -> None:
        """The sweep process was stopped (Ctrl-C): its parent run says so until a resume."""
        from tasks import lineage
        if self.parent_run_id:
            lineage.set_tags(self.client, self.parent_run_id, {"status": "interrupted"})
            self.client.set_terminated(self.parent_run_id, "KILLED")

    def child_run(self, number: int):
        runs = self.client.search_runs(
            [self.experiment_id], max_results=5, order_by=["attributes.start_time DESC"],
            filter_string=f"tags.mlflow.parentRunId = '{self.parent_run_id}' and tags.`ballast.study` = '{self.study_name}' "
                          f"and tags.`ballast.trial_number` = '{number}'")
        return runs[0] if runs else None

    def record_trial(self, study, frozen) -> None:
        """Optuna study callback: the trial's verdict onto its child run."""
        run = self.child_run(frozen.number)
        if run is None:
            return
        rid = run.info.run_id
        tags = {"ballast.trial_state": frozen.state.name, "ballast.trial_params": json.dumps(frozen.params)}
        for key in ("prune_reason", "pruned_by", "error"):
            if frozen.user_attrs.get(key):
                tags[f"ballast.{key}"] = str(frozen.user_attrs[key])[:4000]
        for k, v in tags.items():
            self.client.set_tag(rid, k, v)
        for key, value in frozen.user_attrs.items():
            if key.startswith("objective/"):
                self.client.log_metric(rid, key, float(value))

    def record_interrupted(self, study, frozen) -> None:
        """Heartbeat-stale trial (its worker died): mark its child run KILLED."""
        run = self.child_run(frozen.number)
        if run is None:
            return
        self.client.set_tag(run.info.run_id, "ballast.trial_state", "INTERRUPTED")
        self.client.set_tag(run.info.run_id, "ballast.status", "interrupted")
        if run.info.status == "RUNNING":
            self.client.set_terminated(run.info.run_id, "KILLED")


# ── Prefect: the trial subflow, the worker loop, the sweep ─────────────────────────────────────────

def trial_runner(tracker: Tracker):
    """run_fn for sweeps.study.run_trial: each trial is a `ballast-trial` Prefect subflow."""
    from prefect import flow

    from flows.pipeline import run_pipeline

    def run(spec, callbacks, trial) -> dict:
        @flow(name="ballast-trial", flow_run_name=f"{tracker.study_name}-trial-{trial.number}", persist_result=False,
              validate_parameters=False)
        def ballast_trial(spec: dict, study: str, trial_number: int, params: dict) -> dict:
            from tasks.spec import validate_spec
            return run_pipeline(validate_spec(spec), extra_callbacks=[callbacks], progress=False,
                                parent_run_id=tracker.parent_run_id,
                                tags={"study": study, "trial_number": trial_number, "trial_params": json.dumps(params)})
        return ballast_trial(spec.model_dump(mode="json"), tracker.study_name, trial.number, dict(trial.params))
    return run


def run_worker(study, sweep, tracker: Tracker, n_trials: int | None = None, label: str = "") -> list[int]:
    """This process's share of the study: trials until the study has its total."""
    from sweeps.study import optimize, run_trial
    run_fn = trial_runner(tracker)

    def say(frozen) -> None:
        steps = frozen.user_attrs.get("last_step", "?")
        if frozen.state.name == "COMPLETE":
            what = ", ".join(f"{k.removeprefix('objective/')}={v:.4g}" for k, v in frozen.user_attrs.items() if k.startswith("objective/"))
        elif frozen.state.name == "PRUNED":
            what = frozen.user_attrs.get("prune_reason", "")
        else:
            what = frozen.user_attrs.get("error") or frozen.user_attrs.get("not_counted") or ""
        print(f"{label}trial {frozen.number} {frozen.state.name} after {steps} steps: {what}  {frozen.params}", flush=True)

    def on_trial(st, frozen) -> None:
        tracker.record_trial(st, frozen)
        say(frozen)

    report = optimize(study, lambda trial: run_trial(trial, sweep, run_fn), n_trials, callbacks=[on_trial],
                      max_consecutive_failures=sweep.max_consecutive_failures, log=lambda m: print(label + m, flush=True))
    return report.ran


def _open(sweep, storage_url: str, n_trials: int | None, worker: int):
    """Storage (heartbeats + interrupted-trial bookkeeping), study, tracker and parent run."""
    from sweeps.space import base_spec
    from sweeps.study import make_storage, open_study
    from tasks.spec import validate_spec

    tracker = Tracker(validate_spec(base_spec(sweep), "sweep base spec"), sweep.study_name)
    storage = make_storage(storage_url, sweep.heartbeat, on_interrupted=tracker.record_interrupted)
    study = open_study(sweep, storage, n_trials, worker=worker)
    tracker.open_parent(study, sweep, storage_url)
    return study, tracker


def _join(study_name: str, storage_url: str, worker: int):
    from sweeps.space import base_spec
    from sweeps.study import join_study, make_storage
    from tasks.spec import validate_spec

    _, sweep = join_study(study_name, make_storage(storage_url), worker=worker)  # the definition, then the real storage
    tracker = Tracker(validate_spec(base_spec(sweep), "sweep base spec"), sweep.study_name)
    storage = make_storage(storage_url, sweep.heartbeat, on_interrupted=tracker.record_interrupted)
    study, sweep = join_study(study_name, storage, worker=worker)
    parent = study.user_attrs.get(PARENT_ATTR)
    if not parent:
        raise UserError(f"study {study_name!r} has no MLflow parent run recorded; create the sweep with `ballast sweep FILE` first")
    tracker.parent_run_id = parent
    return study, sweep, tracker


def _prefect_api_url() -> str | None:
    """The Prefect API this process talks to, for worker processes to share (no second ephemeral server)."""
    try:
        from prefect.settings import PREFECT_API_URL
        if PREFECT_API_URL.value():
            return PREFECT_API_URL.value()
        from prefect.server.api.server import SubprocessASGIServer
        server = SubprocessASGIServer()
        return server.api_url if server.running else None
    except Exception:
        return None


def spawn_workers(study_name: str, storage_url: str, k: int, cwd: str | None = None) -> list[int]:
    """K `ballast sweep-worker` processes on this machine, sharing the storage; returns their exit codes."""
    env = dict(os.environ)
    api = _prefect_api_url()
    if api:
        env["PREFECT_API_URL"] = api
    procs = [subprocess.Popen([sys.executable, "-c", CLI, "sweep-worker", "--study", study_name, "--storage", storage_url,
                               "--worker", str(i), "--no-summary"], env=env, cwd=cwd or os.getcwd())
             for i in range(k)]
    try:
        return [p.wait() for p in procs]
    except BaseException:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        raise


def sweep_flow():
    """The `ballast-sweep` Prefect flow (built on call, so importing this module does not import Prefect)."""
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    summary_task = task(write_summary, name="sweep-summary", cache_policy=NO_CACHE, persist_result=False)

    @flow(name="ballast-sweep", persist_result=False)
    def ballast_sweep(sweep_path: str = "examples/sweep.yaml", trials: int | None = None, workers: int = 1,
                      storage: str | None = None) -> dict:
        from sweeps.space import load_sweep
        from sweeps.study import SweepWorkerError, default_storage
        sweep = load_sweep(sweep_path)
        url = storage or sweep.storage or default_storage(_project_dir(sweep))
        study, tracker = _open(sweep, url, trials, worker=0)
        _print_header(study, sweep, url, tracker)
        if workers == 0:
            print(f"study created; join it with:  ballast sweep-worker --study {study.study_name} --storage {url}")
            return {"study": study.study_name, "storage": url, "parent_run_id": tracker.parent_run_id, "done": False}
        try:
            if workers == 1:
                run_worker(study, sweep, tracker)
            else:
                codes = spawn_workers(study.study_name, url, workers)
                if any(codes):
                    print(f"worker exit codes: {codes}")
        except SweepWorkerError:
            summary_task(study, sweep, tracker, url)  # what the trials so far found, then the error
            raise
        except BaseException:
            tracker.interrupted()
            raise
        return summary_task(study, sweep, tracker, url)
    return ballast_sweep


def sweep_worker_flow():
    """The `ballast-sweep-worker` Prefect flow: one worker joining an existing study."""
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    summary_task = task(write_summary, name="sweep-summary", cache_policy=NO_CACHE, persist_result=False)

    @flow(name="ballast-sweep-worker", persist_result=False)
    def ballast_sweep_worker(study: str, storage: str, trials: int | None = None, worker: int = 0, summary: bool = True) -> dict:
        from sweeps.study import n_done, target
        st, sweep, tracker = _join(study, storage, worker)
        if trials is not None:
            st.set_user_attr("ballast.n_trials", int(trials))
        ran = run_worker(st, sweep, tracker, label=f"[worker {worker}] ")
        out = {"study": study, "ran": ran, "done": n_done(st) >= target(st)}
        if summary and out["done"]:
            out.update(summary_task(st, sweep, tracker, storage))
        return out
    return ballast_sweep_worker


def _project_dir(sweep) -> str:
    from sweeps.space import base_spec
    return base_spec(sweep).get("project_dir", ".ballast")


# ── the summary ────────────────────────────────────────────────────────────────────────────────────

def write_summary(study, sweep, tracker: Tracker, storage_url: str) -> dict:
    """Best trial / Pareto set, importances, plots, summary.html/json; logged to the parent run."""
    from sweeps.report import format_value, plot_study, summarize
    from sweeps.study import n_done, redact_url, target
    from tasks import lineage

    out_dir = Path(tracker.spec.project_dir).resolve() / "sweeps" / study.study_name
    summary = summarize(study, sweep)
    plots, skipped = plot_study(study, sweep, out_dir / "plots")
    done = n_done(study) >= target(study)
    summary.update(storage=redact_url(storage_url), n_trials=target(study), done=done, parent_run_id=tracker.parent_run_id,
                   plots=[str(p) for p in plots], plots_skipped=skipped, dashboard=dashboard_command(storage_url))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))

    table: dict = {"study": study.study_name, "storage": summary["storage"], "trials (state: count)": summary["states"],
                   "trial-steps spent": summary["trial_steps"], "pruned by the health gate": summary["pruned_by_health_gate"],
                   "pruned by the pruner": summary["pruned_by_pruner"]}
    best = [summary["best"]] if summary.get("best") else summary.get("pareto") or []
    for row in best:
        table[f"{'best' if 'best' in summary else 'Pareto'}: trial {row['number']}"] = (
            f"{ {k: format_value(v) for k, v in (row['values'] or {}).items()} } params {row['params']} (MLflow run {row['mlflow_run_id']})")
    table["importances"] = summary["importances"]
    for row in summary["trials"]:
        table[f"trial {row['number']}"] = (f"{row['state']}, {row['steps']} steps, {row['params']}"
                                           + (f", values {row['values']}" if row["values"] else "")
                                           + (f" — {row['prune_reason']}" if row["prune_reason"] else "")
                                           + (f" — {row['error']}" if row["error"] else ""))
    table["optuna-dashboard"] = summary["dashboard"]
    (out_dir / "summary.html").write_text(lineage.html_report(f"Ballast sweep {study.study_name}", table, plots, None))

    client, rid = tracker.client, tracker.parent_run_id
    client.log_artifact(rid, str(out_dir / "summary.json"), "summary")
    client.log_artifact(rid, str(out_dir / "summary.html"), "summary")
    for p in plots:
        client.log_artifact(rid, str(p), "summary/plots")
    for row in best[:1]:
        for k, v in (row["values"] or {}).items():
            client.log_metric(rid, f"best/{k}", float(v))
    lineage.set_tags(client, rid, {"status": "finished" if done else "incomplete", "trial_steps": summary["trial_steps"],
                                   "best_trial": best[0]["number"] if best else None})
    client.set_terminated(rid, "FINISHED" if done else "KILLED")
    summary["html"] = str(out_dir / "summary.html")
    return summary


def dashboard_command(storage_url: str) -> str:
    from sweeps.study import redact_url
    return f"optuna-dashboard {redact_url(storage_url)}   (pip install optuna-dashboard)"


def _print_header(study, sweep, url: str, tracker: Tracker) -> None:
    from sweeps.study import counts, redact_url, target
    c = counts(study)
    print(f"sweep {study.study_name}: {c['COMPLETE'] + c['PRUNED']} of {target(study)} trials done "
          f"(storage {redact_url(url)}, MLflow parent run {tracker.parent_run_id})", flush=True)


def _print_summary(s: dict, spec) -> None:
    from tasks.lineage import tracking_uri
    print(f"\nsweep {s['study']}: {s['states']}; {s['trial_steps']} trial-steps; "
          f"{s['pruned_by_health_gate']} pruned by the health gate, {s['pruned_by_pruner']} by the pruner")
    if s.get("best"):
        b = s["best"]
        print(f"best: trial {b['number']} {b['values']} {b['params']} (MLflow run {b['mlflow_run_id']})")
    for row in s.get("pareto") or []:
        print(f"Pareto: trial {row['number']} {row['values']} {row['params']}")
    print(f"importances: {s['importances']}")
    print(f"summary:     {s['html']}")
    print(f"MLflow UI:   mlflow ui --backend-store-uri {tracking_uri(spec)}   (parent run {s['parent_run_id']})")
    print(f"dashboard:   {s['dashboard']}")


# ── CLI ────────────────────────────────────────────────────────────────────────────────────────────

def cmd_sweep(args) -> int:
    from flows.pipeline import configure_prefect
    from sweeps.space import load_sweep

    if args.trials is not None and args.trials < 1:
        raise UserError(f"--trials {args.trials}: give 1 or more (the study's total of finished trials)", 2)
    if args.workers < 0:
        raise UserError(f"--workers {args.workers}: give 0 (create the study only), 1, or more", 2)
    sweep = load_sweep(args.file)  # a bad sweep file fails here (exit 2), before any study or run exists
    configure_prefect(_project_dir(sweep))
    result = sweep_flow()(str(Path(args.file).resolve()), trials=args.trials, workers=args.workers, storage=args.storage)
    if "states" not in result:
        return 0
    from sweeps.space import base_spec
    from tasks.spec import validate_spec
    _print_summary(result, validate_spec(base_spec(sweep)))
    return 0 if result["done"] else 1


def cmd_sweep_worker(args) -> int:
    from flows.pipeline import configure_prefect
    from sweeps.space import base_spec
    from sweeps.study import join_study, make_storage

    _, sweep = join_study(args.study, make_storage(args.storage), worker=args.worker)  # fails early on a bad study name
    configure_prefect(base_spec(sweep).get("project_dir", ".ballast"))
    result = sweep_worker_flow()(args.study, args.storage, trials=args.trials, worker=args.worker, summary=not args.no_summary)
    if "states" in result:
        from tasks.spec import validate_spec
        _print_summary(result, validate_spec(base_spec(sweep)))
    return 0


@command("sweep", "an Optuna sweep of pipeline runs: create or resume the study, run trials, write the summary")
def _p_sweep(p):
    p.add_argument("file", help="sweep YAML (see examples/sweep.yaml)")
    p.add_argument("--trials", type=int, help="the study's total of finished (COMPLETE + PRUNED) trials; overrides the file")
    p.add_argument("--workers", type=int, default=1,
                   help="trials at once on this machine, as worker processes sharing the storage (0: create the study only)")
    p.add_argument("--storage", help="Optuna storage URL (default sqlite:///<project_dir>/optuna.db; postgresql://... for a team)")
    return cmd_sweep


@command("sweep-worker", "join an existing sweep's study and run its trials (from any machine that reaches the storage)")
def _p_sweep_worker(p):
    p.add_argument("--study", required=True, help="study name (printed by `ballast sweep`)")
    p.add_argument("--storage", required=True, help="Optuna storage URL the sweep was created in")
    p.add_argument("--trials", type=int, help="change the study's total of finished trials")
    p.add_argument("--worker", type=int, default=os.getpid() % 10_000,
                   help="worker index: the sampler is seeded seed + index (default: from the process id)")
    p.add_argument("--no-summary", action="store_true", help="do not write the summary when the study completes")
    return cmd_sweep_worker
