"""The pipeline flow: fork → train → checkpoint → artifact-probe → eval, one Prefect task per stage,
one MLflow run per pipeline run with a nested run per stage.

    ballast run examples/quickstart.yaml [--set K=V]...
    ballast run --resume RUN_ID
    ballast quickstart

The stages are plain functions in tasks/; the Prefect tasks are declared here, one line each, so
tasks/ stays usable (and tested) without an orchestrator. Fork verification runs before any MLflow
run or output directory exists, so a bad fork source leaves nothing half-made. A stage that fails
marks its nested run and the pipeline run FAILED, with a `ballast.stop_reason` tag naming the stage
and the cause; checkpoints already saved stay, locally and in the store, for `--resume`.

With nothing configured everything lives under the project folder (`.ballast/`): Prefect's local
ephemeral API (PREFECT_HOME=.ballast/prefect), MLflow on SQLite (.ballast/mlflow.db, artifacts in
.ballast/mlruns), the artifact store (.ballast/artifacts) and run outputs (.ballast/runs/<run id>).
"""
from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from flows.cli import UserError, command


# Background services of a Prefect server that have nothing to do for the embedded, one-process ephemeral
# server (no deployments, schedules, workers or automations live there) and only take CPU from training:
# with them on, a quickstart step ran 5-10 % slower inside the flow than alone (bench/orchestration.py).
IDLE_EPHEMERAL_SERVICES = ("CANCELLATION_CLEANUP", "DB_VACUUM", "FOREMAN", "LATE_RUNS", "SCHEDULER", "PAUSE_EXPIRATIONS",
                           "REPOSSESSOR", "CLEANUP_RECONCILER", "TRIGGERS")


def configure_prefect(project_dir: str) -> None:
    """Embedded Prefect state under the project folder, unless the user points at a server."""
    if "PREFECT_API_URL" not in os.environ:
        home = Path(project_dir).resolve() / "prefect"
        home.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("PREFECT_HOME", str(home))
        for service in IDLE_EPHEMERAL_SERVICES:
            os.environ.setdefault(f"PREFECT_SERVER_SERVICES_{service}_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # 2-core machines start it slowly
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


_prefect_start: "threading.Thread | None" = None


def prestart_prefect(project_dir: str) -> None:
    """Start Prefect's local ephemeral API server in the background, now. Its start-up (10-30 s on a 2-core
    machine: a subprocess that imports Prefect's server and opens its database) then overlaps the
    importing of torch, transformers and MLflow and the model build instead of following them; the
    flow call finds the server up, or waits for it. With PREFECT_API_URL set there is nothing to start."""
    global _prefect_start
    configure_prefect(project_dir)
    if os.environ.get("PREFECT_API_URL") or _prefect_start is not None:
        return

    def start() -> None:
        try:
            from prefect.server.api.server import SubprocessASGIServer
            SubprocessASGIServer().start()
        except Exception:
            pass  # the flow call starts it again and reports what went wrong

    _prefect_start = threading.Thread(target=start, name="prefect-ephemeral-start", daemon=True)
    _prefect_start.start()


def await_prefect() -> None:
    if _prefect_start is not None:
        _prefect_start.join()


def store_uri(spec) -> str:
    return spec.storage.uri or str(Path(spec.project_dir).resolve() / "artifacts")


class StageError(RuntimeError):
    def __init__(self, stage: str, cause: BaseException):
        super().__init__(f"stage '{stage}' failed: {type(cause).__name__}: {cause}")
        self.stage, self.cause = stage, cause


@contextmanager
def stage(client, experiment_id: str, parent_run_id: str, name: str):
    from mlflow.entities import RunStatus
    run = client.create_run(experiment_id, tags={"mlflow.parentRunId": parent_run_id, "mlflow.runName": name, "ballast.stage": name})
    try:
        yield run.info.run_id
    except BaseException as e:
        client.set_tag(run.info.run_id, "ballast.error", str(e)[:4000])
        client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.FAILED))
        raise StageError(name, e) from e
    client.set_terminated(run.info.run_id, "FINISHED")


def _tasks():
    """The stages as Prefect tasks (built lazily so importing this module does not import Prefect)."""
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    from tasks.checkpoint import sync_checkpoints
    from tasks.eval import eval_checkpoint
    from tasks.fork import fork
    from tasks.probe import probe_checkpoint
    from tasks.train import run_training

    opts = dict(cache_policy=NO_CACHE, persist_result=False)
    return {
        "fork": task(fork, name="fork", **opts),
        "train": task(run_training, name="train", **opts),
        "checkpoint": task(sync_checkpoints, name="checkpoint", retries=2, retry_delay_seconds=3, **opts),
        "probe": task(probe_checkpoint, name="artifact-probe", **opts),
        "eval": task(eval_checkpoint, name="eval", **opts),
    }


def run_pipeline(spec, resume_run_id: str | None = None, extra_callbacks=(), progress: bool = True,
                 parent_run_id: str | None = None, tags: dict | None = None) -> dict:
    """The pipeline body (called inside the Prefect flow). Returns a summary dict."""
    from tasks import lineage
    from tasks.probe import write_probe_html
    from tasks.spec import dump_spec, flat_params, spec_hash
    from tasks.store import open_store
    from tasks.train import LineageCallbacks
    from trainer.checkpoint import code_ref
    from trainer.data import data_fingerprint, load_datasets
    from trainer.model import ensure_model

    t_start = time.perf_counter()
    T = _tasks()
    client = lineage.setup(spec)
    experiment_id = client.get_experiment_by_name(spec.tracking.experiment).experiment_id
    store = open_store(store_uri(spec))
    ensure_model(spec.model)

    # ------------------------------------------------------------------ fork (before any run exists)
    try:
        source = T["fork"](spec, client) if not resume_run_id else _resume_source(client, resume_run_id)
    except Exception as e:
        raise StageError("fork", e) from e

    # ------------------------------------------------------------------ the pipeline run
    if resume_run_id:
        run_id = resume_run_id
        client.update_run(run_id, status="RUNNING")
    else:
        run_tags = {"mlflow.runName": spec.name}
        if parent_run_id:
            run_tags["mlflow.parentRunId"] = parent_run_id
        run_id = client.create_run(experiment_id, tags=run_tags).info.run_id
    output_dir = Path(spec.project_dir).resolve() / "runs" / run_id
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "spec.yaml").write_text(dump_spec(spec))
    prefix = f"runs/{run_id}/checkpoints"
    ref = code_ref()
    train_set, _ = load_datasets(spec.data)
    if not resume_run_id:
        lineage.log_params(client, run_id, flat_params(spec))
        client.log_artifact(run_id, str(output_dir / "spec.yaml"))
    lineage.set_tags(client, run_id, {
        "parent_run_id": source.parent_run_id, "parent_step": source.parent_step, "fork_checkpoint": source.checkpoint_uri,
        "fork_logprob_diff": source.max_logprob_diff, "code_commit": ref["commit"], "code_dirty": ref["dirty"],
        "spec_hash": spec_hash(spec), "base_model": spec.model.name_or_path, "data_fingerprint": data_fingerprint(train_set),
        "output_dir": str(output_dir), "checkpoint_prefix": store.child_uri(prefix), "status": "running", **(tags or {})})

    if not resume_run_id:
        with stage(client, experiment_id, run_id, "fork") as sid:
            lineage.set_tags(client, sid, {"source": source.checkpoint_uri or f"base model {spec.model.name_or_path}",
                                           "parent_run_id": source.parent_run_id, "parent_step": source.parent_step})
            if source.max_logprob_diff is not None:
                client.log_metric(sid, "fork/max_logprob_diff", source.max_logprob_diff)

    summary: dict = {"run_id": run_id, "output_dir": str(output_dir), "status": "failed"}
    sink = lineage.MetricsSink(client, run_id, spec.tracking.log_every)
    try:
        # -------------------------------------------------------------- train (+ checkpoints uploaded as saved)
        with stage(client, experiment_id, run_id, "train") as sid:
            callbacks = LineageCallbacks(sink, store, prefix, extra=list(extra_callbacks))
            outcome = T["train"](spec, output_dir, callbacks, fork_source=source, resume=bool(resume_run_id), progress=progress)
            client.log_metric(sid, "trainer_seconds", outcome.trainer_seconds)
            client.log_metric(sid, "last_step", outcome.last_step)
        sink.close()
        rewards = [m["reward"] for m in outcome.history]
        summary.update(last_step=outcome.last_step, stopped=outcome.stopped, history=outcome.history,
                       trainer_seconds=outcome.trainer_seconds,
                       reward_first5=_mean(rewards[:5]), reward_last5=_mean(rewards[-5:]),
                       eval_start={k: v for k, v in (outcome.eval_start or {}).items() if k != "step"})
        if outcome.stopped:
            lineage.set_tags(client, run_id, {"stop_reason": outcome.stopped})

        # -------------------------------------------------------------- checkpoint
        with stage(client, experiment_id, run_id, "checkpoint") as sid:
            uris = T["checkpoint"](store, prefix, output_dir / "checkpoints", spec.checkpoint.keep_last)
            (output_dir / "checkpoints.json").write_text(json.dumps({str(k): v for k, v in uris.items()}, indent=1))
            client.log_artifact(sid, str(output_dir / "checkpoints.json"))
            client.log_artifact(run_id, str(output_dir / "checkpoints.json"))
        if not uris:
            raise StageError("checkpoint", RuntimeError("the run saved no checkpoint"))
        final_uri = uris[max(uris)]
        summary["checkpoints"] = uris
        summary["final_checkpoint"] = final_uri
        cache = Path(spec.project_dir).resolve() / "cache" / run_id

        # -------------------------------------------------------------- artifact probe (reloaded from the store)
        report = None
        if spec.probe.enabled:
            with stage(client, experiment_id, run_id, "artifact-probe") as sid:
                targets = uris if spec.probe.every_checkpoint else {max(uris): final_uri}
                for step, uri in sorted(targets.items()):
                    report = T["probe"](uri, spec.probe, spec.model, cache / "probe", lora_cfg=spec.lora)
                    rdir = output_dir / "probe" / f"step-{step:06d}"
                    rdir.mkdir(parents=True, exist_ok=True)
                    (rdir / "probe_report.json").write_text(json.dumps(report, indent=1))
                    write_probe_html(report, rdir / "probe_report.html")
                    client.log_artifacts(sid, str(rdir), f"probe/step-{step:06d}")
                    client.log_artifacts(run_id, str(rdir), f"probe/step-{step:06d}")
                    client.log_metric(sid, "probe/malformed_rate", report["malformed_rate"], step=step)
                    client.log_metric(run_id, "probe/malformed_rate", report["malformed_rate"], step=step)
                client.set_tag(sid, "ballast.probe_passed", str(report["passed"]))
            summary["probe"] = {k: report[k] for k in ("n_samples", "n_malformed", "malformed_rate", "malformed_ci", "parity_ok", "passed")}
            summary["probe_report"] = str(rdir / "probe_report.html")
            lineage.set_tags(client, run_id, {"probe_passed": report["passed"], "probe_malformed_rate": f"{report['malformed_rate']:.4f}"})

        # -------------------------------------------------------------- eval (final checkpoint, standalone decoding)
        with stage(client, experiment_id, run_id, "eval") as sid:
            eval_metrics = T["eval"](spec, final_uri, cache / "eval")
            for k, v in eval_metrics.items():
                client.log_metric(sid, k, v, step=outcome.last_step)
                client.log_metric(run_id, "final_" + k.replace("/", "_"), v)
        summary["eval"] = eval_metrics

        # -------------------------------------------------------------- plots and report
        status = "collapsed" if outcome.stopped else ("probe_failed" if report is not None and not report["passed"] else "finished")
        summary["status"] = status
        summary["seconds"] = time.perf_counter() - t_start
        plots = lineage.plot_history(([outcome.eval_start] if outcome.eval_start else []) + outcome.history, output_dir / "plots")
        client.log_artifacts(run_id, str(output_dir / "plots"), "plots")
        before = summary["eval_start"]
        table = {"run id": run_id, "status": status, "steps": outcome.last_step, "stop reason": outcome.stopped or "",
                 "reward, first 5 steps": f"{summary['reward_first5'] or 0:.3f}",
                 "reward, last 5 steps": f"{summary['reward_last5'] or 0:.3f}",
                 **{k + (", before → after" if k in before else ""): (f"{before[k]:.3f} → " if k in before else "") + f"{v:.3f}"
                    for k, v in eval_metrics.items()},
                 "final checkpoint": final_uri,
                 "forked from": f"{source.parent_run_id or source.checkpoint_uri} step {source.parent_step}" if source.checkpoint_uri else "base model"}
        (output_dir / "report.html").write_text(lineage.html_report(f"Ballast run {spec.name}", table, plots, report))
        client.log_artifact(run_id, str(output_dir / "report.html"))
        summary["report"] = str(output_dir / "report.html")
        lineage.set_tags(client, run_id, {"status": status})
        client.set_terminated(run_id, "FINISHED")
        return summary
    except BaseException as e:
        try:
            sink.close()
        except Exception:
            pass
        lineage.set_tags(client, run_id, {"status": "failed", "stop_reason": str(e)[:4000]})
        client.set_terminated(run_id, "FAILED")
        if isinstance(e, StageError):
            raise
        raise StageError("pipeline", e) from e


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _resume_source(client, run_id: str):
    from tasks.fork import ForkSource
    from tasks.lineage import TAG, find_run
    tags = find_run(client, run_id).data.tags
    step = tags.get(TAG + "parent_step")
    return ForkSource(checkpoint_uri=tags.get(TAG + "fork_checkpoint"), parent_run_id=tags.get(TAG + "parent_run_id"),
                      parent_step=int(step) if step and step != "None" else None)


def pipeline_flow():
    from prefect import flow

    @flow(name="ballast-pipeline", persist_result=False, log_prints=True)
    def ballast_pipeline(spec: dict, resume_run_id: str | None = None) -> dict:
        from tasks.spec import validate_spec
        summary = run_pipeline(validate_spec(spec), resume_run_id=resume_run_id, progress=True)
        summary.pop("history", None)
        return summary
    return ballast_pipeline


def run_flow(spec, resume_run_id: str | None = None) -> dict:
    prestart_prefect(spec.project_dir)
    flow_fn = pipeline_flow()
    import tasks.lineage, tasks.probe, trainer.loop  # noqa: E401,F401  (torch, transformers, MLflow: while the server starts)
    await_prefect()
    return flow_fn(spec.model_dump(mode="json"), resume_run_id)


# ------------------------------------------------------------------------------------------ CLI

def cmd_run(args) -> int:
    from tasks.spec import load_spec
    if args.resume:
        spec = _spec_of_run(args.resume, args.spec, args.project_dir)
    elif args.spec:
        spec = load_spec(args.spec, args.set)
    else:
        raise UserError("give an experiment SPEC, or --resume RUN_ID", 2)
    summary = run_flow(spec, resume_run_id=args.resume)
    _print_summary(spec, summary)
    return 0 if summary.get("status") == "finished" else 3


def cmd_quickstart(args) -> int:
    from tasks.spec import load_spec
    here = Path(__file__).resolve().parent.parent
    spec = load_spec(here / "examples" / "quickstart.yaml", args.set)
    prestart_prefect(spec.project_dir)
    from trainer.model import ensure_model
    ensure_model(spec.model)  # the first run builds the tiny model (~2 min) while Prefect's server starts
    summary = run_flow(spec)
    _print_summary(spec, summary)
    return 0 if summary.get("status") == "finished" else 3


def _spec_of_run(run_id: str, spec_path: str | None, project_dir: str):
    from tasks import lineage
    from tasks.spec import load_spec
    probe = load_spec(spec_path) if spec_path else load_spec({"model": {"name_or_path": "-"}, "project_dir": project_dir})
    client = lineage.setup(probe)
    out = lineage.find_run(client, run_id).data.tags.get(lineage.TAG + "output_dir")
    if not out or not (Path(out) / "spec.yaml").exists():
        raise UserError(f"run {run_id} has no output directory with a spec.yaml on this machine; cannot resume it here")
    return load_spec(Path(out) / "spec.yaml")


def _print_summary(spec, s: dict) -> None:
    from tasks.lineage import tracking_uri
    from rich.console import Console
    c = Console(soft_wrap=True, highlight=False)  # paths and commands stay whole, for copying
    c.rule(f"[bold]Ballast run {s['run_id']}: {s['status']}")
    if s.get("reward_first5") is not None:
        c.print(f"reward (training batches): first 5 steps {s['reward_first5']:.3f} → last 5 steps {s['reward_last5']:.3f}")
    if s.get("stopped"):
        c.print(f"[red]stopped: {s['stopped']}")
    before = s.get("eval_start") or {}
    for k, v in (s.get("eval") or {}).items():
        c.print(f"{k} (held out): " + (f"{before[k]:.3f} before training → " if k in before else "") + f"{v:.3f}")
    if s.get("probe"):
        p = s["probe"]
        c.print(f"probe: {p['n_malformed']}/{p['n_samples']} malformed, parity {'ok' if p['parity_ok'] else 'FAILED'} → "
                f"{'passed' if p['passed'] else 'FAILED'}")
    c.print(f"wall time: {s.get('seconds', 0):.0f} s (trainer {s.get('trainer_seconds', 0):.0f} s)")
    c.print(f"report:      {s.get('report')}")
    c.print(f"probe report: {s.get('probe_report')}")
    c.print(f"checkpoint:  {s.get('final_checkpoint')}")
    c.print(f"MLflow UI:   mlflow ui --backend-store-uri {tracking_uri(spec)}")
    c.print(f"Prefect UI:  PREFECT_HOME={os.environ.get('PREFECT_HOME', '~/.prefect')} prefect server start")
    c.print(f"or both:     ballast ui --project-dir {spec.project_dir}")


@command("run", "run the pipeline: fork → train → checkpoint → probe → eval")
def _p_run(p):
    p.add_argument("spec", nargs="?", help="experiment YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--resume", metavar="RUN_ID", help="continue an interrupted pipeline run from its newest valid checkpoint")
    p.add_argument("--project-dir", default=".ballast", help="where the embedded stores are (for --resume without SPEC)")
    return cmd_run


@command("quickstart", "run the pipeline on examples/quickstart.yaml with nothing configured")
def _p_quickstart(p):
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    return cmd_quickstart


def cmd_ui(args) -> int:
    import subprocess
    import sys
    project = Path(args.project_dir).resolve()
    env = dict(os.environ, PREFECT_HOME=str(project / "prefect"))
    mlflow_cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{project / 'mlflow.db'}",
                  "--port", str(args.mlflow_port)]
    prefect_cmd = [sys.executable, "-m", "prefect", "server", "start", "--port", str(args.prefect_port)]
    print(f"MLflow UI:  http://127.0.0.1:{args.mlflow_port}   ({' '.join(mlflow_cmd[1:])})")
    print(f"Prefect UI: http://127.0.0.1:{args.prefect_port}   (PREFECT_HOME={project / 'prefect'} prefect server start)")
    procs = [subprocess.Popen(mlflow_cmd), subprocess.Popen(prefect_cmd, env=env)]
    try:
        for proc in procs:
            proc.wait()
    except KeyboardInterrupt:
        for proc in procs:
            proc.terminate()
    return 0


@command("ui", "open the MLflow and Prefect UIs on the embedded stores")
def _p_ui(p):
    p.add_argument("--project-dir", default=".ballast")
    p.add_argument("--mlflow-port", type=int, default=5000)
    p.add_argument("--prefect-port", type=int, default=4200)
    return cmd_ui
