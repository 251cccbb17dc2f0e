"""The MLflow tracking store of a spec, and what Ballast reads back from it: the one client every recorder writes
through (tasks/record.py: a pipeline run; tasks/sweep_record.py: a sweep) and that comparisons read from
(tasks/compare.py).

* `tracking_uri(spec)` — SQLite under the project folder by default, `tracking.uri` for a team server (an http(s)
  server must answer at start: infra/mlflow_server.py); `store_uri(spec)` the artifact store beside it (both defined
  in tasks/spec.py, where the CLI reaches them without importing MLflow).
* `Tracking` — the store and the spec's experiment, marked a model-training one (`mlflow.experimentKind`), every
  link it makes opening the UI in that mode; a run's facts read back: its checkpoint location, its fork source,
  its output directory, the chain of forks. Its client raises `TrackingUnavailable` (one line) when a server stops
  answering (`guarded`, below).
* `probe_report_of_run` — a finished run's newest probe report and curves, for `ballast compare`.

Run facts with long values (paths, URIs, the full commit) are params under `ballast.`; tags under `ballast.` hold
the short ones (TAG).
"""

from __future__ import annotations

import getpass
import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import mlflow
import requests  # MLflow's own HTTP client
from mlflow.entities import Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from infra.mlflow_server import TrackingUnavailable, check_tracking, is_http
from tasks.spec import TrackingConfig, tracking_uri

if TYPE_CHECKING:  # tasks.fork loads torch and peft: a run id is looked up without them
    from tasks.fork import ForkSource

TAG = "ballast."
EXPERIMENT_KIND = "custom_model_development"  # mlflow.experimentKind: a model-training experiment, not GenAI
# MLflow 3's UI opens in its GenAI mode unless a link asks for this: 3.17's UI reads the mode from the link or the
# browser's last choice (its GenAI / Model training switch), never from the experiment's kind
UI_MODE = "workflowType=machine_learning"
DEFAULT_UI_URL = "http://127.0.0.1:5000"  # where `ballast ui` serves the embedded store
SWEPT_TAG = "swept"  # a sweep trial's run: the comma-joined swept spec fields, its only params
GAIN_TAG = "gain_metric"  # a sweep trial's run: its gain over the baseline, Gain/<objective> (NaN until it ends)


# ── the tracking store, and lineage read back ──────────────────────────────────────────────────────


class Tracking:
    """The MLflow tracking store and experiment of a spec."""

    def __init__(self, spec):
        self.spec, self.uri = spec, tracking_uri(spec)
        check_tracking(self.uri, spec.tracking)  # a server that is not there fails here, in seconds, with one line
        mlflow.set_tracking_uri(self.uri)
        self.client = guarded(MlflowClient(self.uri), self.uri)
        experiment = self.client.get_experiment_by_name(spec.tracking.experiment)
        if experiment is None:
            # a database store (SQLite, PostgreSQL) keeps artifacts in the project folder, not in ./mlruns of
            # whatever directory the command ran in; a tracking server decides for itself
            server = self.uri.startswith(("http://", "https://", "databricks"))
            location = None if server else (Path(spec.project_dir).resolve() / "mlruns").as_uri()
            self.experiment_id = self.client.create_experiment(
                spec.tracking.experiment, artifact_location=location, tags={"mlflow.experimentKind": EXPERIMENT_KIND}
            )
        else:
            self.experiment_id = experiment.experiment_id
            if "mlflow.experimentKind" not in experiment.tags:  # made before Ballast marked its experiments
                self.client.set_experiment_tag(self.experiment_id, "mlflow.experimentKind", EXPERIMENT_KIND)

    def ui_url(self) -> str:
        """The MLflow UI that links point at: tracking.ui_url, else the tracking server, else `ballast ui`'s address."""
        if self.spec.tracking.ui_url:
            return self.spec.tracking.ui_url.rstrip("/")
        return self.uri.rstrip("/") if self.uri.startswith(("http://", "https://")) else DEFAULT_UI_URL

    def run_url(self, run_id: str) -> str:
        """The run's page in the MLflow UI, in its model-training mode."""
        return f"{self.ui_url()}/#/experiments/{self.experiment_id}/runs/{run_id}?{UI_MODE}"

    def experiment_url(self) -> str:
        return f"{self.ui_url()}/#/experiments/{self.experiment_id}/runs?{UI_MODE}"

    def compare_url(self, run_ids: list[str]) -> str:
        """MLflow's Compare page of these runs (its parallel coordinates, scatter and contour plots), in one click."""
        runs, experiments = json.dumps(list(run_ids)), json.dumps([self.experiment_id])
        return f"{self.ui_url()}/#/compare-runs?runs={quote(runs)}&experiments={quote(experiments)}&{UI_MODE}"

    def find_run(self, run_id: str):
        try:
            return self.client.get_run(run_id)
        except Exception:
            raise ValueError(
                f"MLflow run {run_id!r} was not found in {self.uri}; check the run id (ballast ui lists "
                "runs) and tracking.uri"
            ) from None

    def resolve_run_id(self, given: str) -> str:
        """The full run id of `given`: a run id, a run's name (`quickstart-7967ed74`) or the 8-character id in it."""
        try:
            return self.client.get_run(given).info.run_id
        except Exception:
            pass
        quoted = given.replace("'", "")
        found = {
            r.info.run_id: r.info.run_name
            for name_filter in (f"attributes.run_name = '{quoted}'", f"attributes.run_name LIKE '%-{quoted}'")
            for r in self.client.search_runs([self.experiment_id], name_filter, max_results=10)
            if " · " not in (r.info.run_name or "")  # a stage's run ("train · quickstart-7967ed74") is not the run
        }
        if len(found) == 1:
            return next(iter(found))
        if found:
            raise ValueError(f"{given!r} names {len(found)} runs ({', '.join(sorted(found.values()))}); give a run id")
        raise ValueError(
            f"MLflow run {given!r} was not found in {self.uri}; give the run id or run name `ballast run` printed "
            "(ballast ui lists runs) and check tracking.uri"
        )

    def tags(self, run_id: str) -> dict[str, str]:
        """The run's facts: its params and tags (a run's long-valued facts are params, LONG_FACTS)."""
        data = self.find_run(run_id).data
        return {**data.params, **data.tags}

    def checkpoint_prefix(self, run_id: str) -> str:
        prefix = self.tags(run_id).get(TAG + "checkpoint_prefix")
        if not prefix:
            raise ValueError(
                f"fork.run_id={run_id}: that MLflow run has no checkpoints recorded (param "
                f"{TAG}checkpoint_prefix); fork a Ballast pipeline run, or give fork.checkpoint"
            )
        return prefix

    def fork_source_of(self, run_id: str) -> ForkSource:
        """The fork source a run started from, as recorded (for a resume; it was verified when the run began)."""
        from tasks.fork import ForkSource

        tags = self.tags(run_id)
        step = tags.get(TAG + "parent_step")
        return ForkSource(
            checkpoint_uri=tags.get(TAG + "fork_checkpoint"),
            parent_run_id=tags.get(TAG + "parent_run_id"),
            parent_step=int(step) if step and step != "None" else None,
        )

    def output_dir_of(self, run_id: str) -> Path | None:
        out = self.tags(run_id).get(TAG + "output_dir")
        return Path(out) if out else None

    def chain(self, run_id: str) -> list[dict]:
        """[this run, its parent, its parent's parent, ...] as {run_id, parent_step, fork_checkpoint}."""
        out, seen = [], set()
        while run_id and run_id not in seen:
            seen.add(run_id)
            tags = self.tags(run_id)
            out.append(
                {
                    "run_id": run_id,
                    "parent_step": tags.get(TAG + "parent_step"),
                    "fork_checkpoint": tags.get(TAG + "fork_checkpoint"),
                }
            )
            run_id = tags.get(TAG + "parent_run_id")
        return out

    def set_tags(self, run_id: str, tags: dict) -> None:
        """Tags onto a run, `ballast.` before keys of no namespace. Safe when several processes tag one run (a
        sweep's workers tag its parent run): MLflow reads the tag and then inserts it, so a second writer between
        the two fails on the store's unique key; by then the row exists, and writing again updates it."""
        for k, v in tags.items():
            if v is None:
                continue
            key = k if k.startswith((TAG, "mlflow.", "prefect.")) else TAG + k
            try:
                self.client.set_tag(run_id, key, str(v))
            except MlflowException as e:
                if not written_concurrently(e):
                    raise
                self.client.set_tag(run_id, key, str(v))

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i : i + 100])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int) -> None:
        """Metrics of one step, in batches (a population member's step: tasks/population.py)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 500):
            self.client.log_batch(run_id, metrics=items[i : i + 500])

    def kill_running_children(self, run_id: str) -> int:
        """Runs nested under `run_id` still RUNNING marked KILLED (a signal stopped their parent); how many."""
        running = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{run_id}' and attributes.status = 'RUNNING'",
            max_results=1000,
        )
        for child in running:
            self.client.set_terminated(child.info.run_id, "KILLED")
        return len(running)

    def delete_run_tree(self, run_id: str) -> int:
        """Delete run `run_id` and every run nested under it, at any depth (MLflow's delete: they leave the UI and
        every search); how many were deleted."""
        children = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'", max_results=10_000
        )
        deleted = sum(self.delete_run_tree(child.info.run_id) for child in children)
        self.client.delete_run(run_id)
        return deleted + 1

    def create_run(self, name: str, parent_run_id: str | None = None, tags: dict | None = None) -> str:
        run_tags = {"mlflow.runName": name, **(tags or {})}
        if parent_run_id:
            run_tags["mlflow.parentRunId"] = parent_run_id
        return self.client.create_run(self.experiment_id, tags=run_tags).info.run_id


def run_name(spec_name: str, run_id: str) -> str:
    """A pipeline run's name in MLflow and Prefect: the spec's name and the run id's first 8 characters."""
    return f"{spec_name}-{run_id[:8]}"


def user_name() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in this environment (some containers)
        return "unknown"


# ── reading a run back ─────────────────────────────────────────────────────────────────────────────


def probe_report_of_run(uri: str, run_id: str, curves: list[str]) -> tuple[dict, list[dict] | None]:
    """(the run's newest probe report, its history of the `curves` metrics) from the tracking store at `uri`."""
    check_tracking(uri, TrackingConfig())
    client = MlflowClient(uri)
    try:
        run = client.get_run(run_id)
    except Exception:
        raise ValueError(
            f"MLflow run {run_id} was not found in {uri}; check the run id or pass --tracking-uri"
        ) from None
    steps = sorted(a.path for a in client.list_artifacts(run_id, "probe") if a.is_dir)
    if not steps:
        raise ValueError(
            f"MLflow run {run_id} has no probe report (artifacts probe/step-*/probe_report.json); "
            "it did not reach the probe stage — compare its checkpoint instead"
        )
    with tempfile.TemporaryDirectory() as tmp:
        local = mlflow.artifacts.download_artifacts(
            run_id=run_id, artifact_path=f"{steps[-1]}/probe_report.json", dst_path=tmp, tracking_uri=uri
        )
        report = json.loads(Path(local).read_text())
    by_step: dict[int, dict] = {}
    for key in curves:
        if key in run.data.metrics:
            for m in client.get_metric_history(run_id, key):
                by_step.setdefault(m.step, {"step": m.step})[key] = m.value
    return report, [by_step[s] for s in sorted(by_step)] or None


# ── a client that says when the server went away ─────────────────────────────────────────────────────────


def _causes(error: BaseException | None, depth: int = 6):
    """The error and the ones behind it (__cause__, else __context__), `depth` at most."""
    while error is not None and depth > 0:
        yield error
        error, depth = error.__cause__ or error.__context__, depth - 1


def connection_failure(error: BaseException) -> BaseException | None:
    """The network error behind an MlflowException (refused, timed out, retries exhausted), or None."""
    network = (requests.exceptions.ConnectionError, requests.exceptions.Timeout, requests.exceptions.RetryError)
    return next((e for e in _causes(error) if isinstance(e, network)), None)


# what SQLite, PostgreSQL and MySQL say when an insert breaks a unique key (a tracking server returns it as text)
UNIQUE_KEY_REFUSALS = ("UNIQUE constraint failed", "duplicate key value violates unique constraint", "Duplicate entry")


def written_concurrently(error: BaseException) -> bool:
    """An insert that lost a race to another writer of the same row: the store's unique key refused it (SQLite,
    PostgreSQL, MySQL through SQLAlchemy; a tracking server passes the database's message on)."""
    from sqlalchemy.exc import IntegrityError  # MLflow's own dependency

    return any(m in str(error) for m in UNIQUE_KEY_REFUSALS) or any(
        isinstance(e, IntegrityError) for e in _causes(error)
    )


class _Guarded:
    """An MlflowClient whose calls raise TrackingUnavailable when the server cannot be reached."""

    def __init__(self, client, uri: str):
        self._client, self._uri = client, uri

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except MlflowException as e:
                cause = connection_failure(e)
                if cause is None:
                    raise
                raise TrackingUnavailable(
                    f"the MLflow server at {self._uri} stopped answering "
                    f"({type(cause).__name__}); start it again or fix tracking.uri"
                ) from None

        return call


def guarded(client, uri: str):
    """An MlflowClient whose connection failures raise `TrackingUnavailable` (one line) instead of an
    MlflowException carrying a page of urllib3 text (a database URI's client as it is)."""
    return _Guarded(client, uri) if is_http(uri) else client
