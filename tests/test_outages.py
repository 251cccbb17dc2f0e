"""Outages of the services a run uses, against real server processes the tests stop and start: an MLflow tracking
server (`mlflow server` on SQLite) and an S3 endpoint (moto's server).

At start, a tracking server or store that is not there fails `ballast run` (and `ballast compare`) with one line
naming it, before anything is created. Mid-run, a tracking outage does not stop training: step metrics wait in
`<run dir>/mlflow-pending.jsonl` and reach MLflow when the server returns, or `ballast sync RUN_ID` sends them; a
store outage keeps the checkpoints locally, uploads them when the store returns, and otherwise the run's end names
every checkpoint not uploaded and the command that uploads it. Every wait in these tests has a bound.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import boto3
import pytest
import yaml
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from infra.mlflow_server import TrackingUnavailable
from infra.store import open_store
from tasks.metrics_sink import PENDING, MetricsSink, append_pending, deliver, pending_count
from tests.conftest import REPO, tiny_spec
from tests.s3_fixtures import TEST_REGION, _free_port
from trainer.loop import Callbacks

STEPS = 6
CLI = "import sys; from flows.cli import main; sys.exit(main())"  # as the `ballast` script calls it
WAIT_S = 600  # the most any wait here lasts (a server start, a model load, a run on a loaded 2-core machine)


@pytest.fixture(scope="module")
def prefect(prefect_api):
    return prefect_api  # the test process's harness (tests/conftest.py); the outages here are MLflow's and S3's


def wait_for(condition, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"gave up waiting for {what} after {timeout:.0f} s"
        time.sleep(0.5)
    return value


class MlflowServer:
    """`mlflow server` on a SQLite store under `root`, in its own process group, stopped and started at will."""

    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, _free_port(), None
        self.uri = f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--backend-store-uri",
                f"sqlite:///{self.root / 'mlflow.db'}",
                "--artifacts-destination",
                str(self.root / "artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
            ],
            stdout=open(self.root / "server.log", "a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )
        wait_for(lambda: self.healthy() or self.proc.poll() is not None, "the MLflow server to answer")
        assert self.proc.poll() is None, (self.root / "server.log").read_text()[-2000:]

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        wait_for(lambda: not self.healthy(), "the MLflow server to stop", timeout=60)

    def client(self) -> MlflowClient:
        return MlflowClient(self.uri)


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(tmp_path)
    server.start()
    yield server
    server.stop()


class S3Endpoint:
    """A moto S3 server of its own (not the session's), stopped and started on the same port; moto keeps its buckets
    in this process, so they are there again after a restart, as a real store's would be."""

    def __init__(self):
        self.port = _free_port()
        self.uri, self.server = f"http://127.0.0.1:{self.port}", None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def s3_endpoint(monkeypatch):
    endpoint = S3Endpoint()
    endpoint.start()
    for name, value in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", TEST_REGION),
        ("AWS_ENDPOINT_URL", endpoint.uri),
    ):
        monkeypatch.setenv(name, value)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    bucket = f"outage-{uuid.uuid4().hex[:8]}"
    boto3.session.Session().client("s3", endpoint_url=endpoint.uri).create_bucket(Bucket=bucket)
    yield endpoint, bucket
    endpoint.stop()


class AtStep(Callbacks):
    """Does things when the trainer reports a step or saves a checkpoint: {step: callable}."""

    def __init__(self, on_step: dict | None = None, on_checkpoint: dict | None = None):
        self.steps, self.checkpoints = dict(on_step or {}), dict(on_checkpoint or {})

    def on_step(self, step: int, metrics: dict) -> None:
        if step in self.steps:
            self.steps.pop(step)()

    def on_checkpoint(self, checkpoint) -> None:
        if checkpoint.step in self.checkpoints:
            self.checkpoints.pop(checkpoint.step)()


def pipeline_spec(tiny_model, project: Path, **sections) -> dict:
    return tiny_spec(
        tiny_model,
        name="outage",
        project_dir=str(project),
        probe={"enabled": False},
        optim={"steps": STEPS, "learning_rate": 1e-3},
        checkpoint={"every": 2, "keep_last": 5},
        **sections,
    )


def run(spec: dict, callbacks: list):
    """The pipeline flow in this process: (Prefect state, what it returned or raised)."""
    from flows.pipeline import ballast_pipeline

    state = ballast_pipeline(spec, callbacks=callbacks, progress=False, return_state=True)
    return state, state.result(raise_on_failure=False)


def run_dir(project: Path) -> Path:
    return next((project / "runs").iterdir())


def ballast(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI with this process's environment (the test's AWS settings too) and its own embedded Prefect."""
    mine = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return subprocess.run(
        [sys.executable, "-c", CLI, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**mine, **(env or {})},
        timeout=WAIT_S,
    )


def spec_file(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


# ── the spool ──────────────────────────────────────────────────────────────────────────────────────


def test_kept_metrics_are_sent_once_each_even_when_a_spool_is_sent_twice(tmp_path):
    """MLflow keeps one copy of a metric sent again (a line whose answer was lost is resent on the next try)."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("spool")).info.run_id
    for step in (1, 2, 3):  # three batches, as the sink keeps them while MLflow is away
        append_pending(tmp_path / PENDING, run_id, [Metric("reward", float(step), 1000 + step, step)])
    copy = (tmp_path / PENDING).read_text()
    assert pending_count(tmp_path / PENDING) == 3
    assert len(deliver(client, run_id, [], tmp_path / PENDING)) == 3
    assert not (tmp_path / PENDING).exists()
    (tmp_path / PENDING).write_text(copy)
    assert len(deliver(client, run_id, [], tmp_path / PENDING)) == 3
    history = client.get_metric_history(run_id, "reward")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_closing_the_sink_while_mlflow_hangs_says_so_within_its_limit_instead_of_returning_as_if_sent(
    mlflow_server, tmp_path
):
    """A server that takes the last batch and never answers (stopped, not gone): close() waits close_seconds, then
    says the metrics were not all taken — not a quiet return with the batch in a thread about to die."""
    client = mlflow_server.client()
    run_id = client.create_run(client.create_experiment("hang")).info.run_id
    sink = MetricsSink(client, run_id, spool=tmp_path / PENDING)
    sink.close_seconds = 2.0
    os.killpg(mlflow_server.proc.pid, signal.SIGSTOP)
    try:
        sink.on_step(1, {"reward": 0.5})
        started = time.monotonic()
        with pytest.raises(TrackingUnavailable, match="still taking step metrics of run .* after 2 s"):
            sink.close()
        assert time.monotonic() - started < 30
    finally:
        os.killpg(mlflow_server.proc.pid, signal.SIGCONT)
    sink.thread.join(timeout=WAIT_S)  # the server answers again: the batch it held lands
    assert [m.step for m in client.get_metric_history(run_id, "reward")] == [1]


# ── at start ───────────────────────────────────────────────────────────────────────────────────────


@contextmanager
def closed_port() -> Iterator[int]:
    """A loopback port nothing can answer on while it is held: bound, never listening (a port merely found free
    can be taken meanwhile by another test's server, which then answers)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def test_ballast_run_with_no_tracking_server_fails_at_start_with_one_line_and_creates_nothing(tiny_model, tmp_path):
    with closed_port() as port:
        uri = f"http://127.0.0.1:{port}"
        proc = ballast(
            "run", str(spec_file(tmp_path, pipeline_spec(tiny_model, tmp_path / "p", tracking={"uri": uri})))
        )
    assert proc.returncode == 1
    assert one_line(proc.stderr).startswith(
        f"error: tracking.uri {uri}: no MLflow server answered {uri}/health within 10 s"
    )
    assert not (tmp_path / "p" / "runs").exists()


def test_ballast_compare_with_no_tracking_server_fails_with_one_line(tmp_path):
    with closed_port() as port:
        uri = f"http://127.0.0.1:{port}"
        proc = ballast("compare", uuid.uuid4().hex, uuid.uuid4().hex, "--tracking-uri", uri)
    assert proc.returncode == 1
    assert f"tracking.uri {uri}: no MLflow server answered" in one_line(proc.stderr)


def test_ballast_run_with_an_unreachable_store_fails_at_start_with_one_line_and_creates_nothing(tiny_model, tmp_path):
    spec = pipeline_spec(tiny_model, tmp_path / "p", storage={"uri": "s3://ballast-outage/runs"})
    with closed_port() as port:
        endpoint = f"http://127.0.0.1:{port}"
        aws = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": TEST_REGION,
        }
        proc = ballast("run", str(spec_file(tmp_path, spec)), env=aws)
    assert proc.returncode == 1
    assert one_line(proc.stderr).startswith(
        f"error: storage.uri s3://ballast-outage/runs: cannot reach the S3 endpoint {endpoint}"
    )
    assert not (tmp_path / "p" / "runs").exists()


# ── the tracking server goes away mid-run ──────────────────────────────────────────────────────────


def test_tracking_outage_mid_run_keeps_training_and_the_kept_metrics_arrive_when_the_server_returns(
    tiny_model, tmp_path, prefect, mlflow_server
):
    project, seen = tmp_path / "p", {}

    def back_after_metrics_were_kept():
        seen["kept"] = wait_for(lambda: pending_count(run_dir(project) / PENDING), "metrics kept on disk")
        mlflow_server.start()

    def drained():
        seen["drained"] = wait_for(lambda: not (run_dir(project) / PENDING).exists(), "the kept metrics to be sent")

    spec = pipeline_spec(tiny_model, project, tracking={"uri": mlflow_server.uri})
    state, result = run(spec, [AtStep({1: mlflow_server.stop, 3: back_after_metrics_were_kept, 5: drained})])
    assert state.is_completed(), result
    assert seen["kept"] > 0 and seen["drained"]
    history = mlflow_server.client().get_metric_history(result.run_id, "reward")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    assert mlflow_server.client().get_run(result.run_id).info.status == "FINISHED"


def test_tracking_server_that_stays_away_ends_the_run_naming_the_kept_metrics_and_ballast_sync_sends_them(
    tiny_model, tmp_path, prefect, mlflow_server
):
    project = tmp_path / "p"
    state, error = run(
        pipeline_spec(tiny_model, project, tracking={"uri": mlflow_server.uri}), [AtStep({1: mlflow_server.stop})]
    )
    run_id = run_dir(project).name
    spool = run_dir(project) / PENDING
    assert state.is_failed() and state.name == "TrackingUnavailable"
    where = f"--project-dir {project}"  # not .ballast: without it neither command would find the run
    assert f"`ballast sync {run_id} {where}` sends them" in str(error) and str(spool) in str(error)
    assert f"`ballast run --resume {run_id} {where}` finishes the run" in str(error)
    kept = {step for line in spool.read_text().splitlines() for _, _, _, step in json.loads(line)["metrics"]}
    assert set(range(2, STEPS + 1)) <= kept

    waiting = pending_count(spool)
    mlflow_server.start()
    synced = ballast("sync", run_id, "--project-dir", str(project))
    assert synced.returncode == 0, synced.stderr[-3000:]
    assert f"metrics: {waiting} sent to {mlflow_server.uri}" in synced.stdout
    assert f"`ballast run --resume {run_id} {where}` finishes it" in synced.stdout  # the run is still to finish
    history = mlflow_server.client().get_metric_history(run_id, "reward")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    assert not spool.exists()


def test_a_live_run_is_not_synced_or_resumed_by_another_process_and_is_once_it_ended(tiny_model, tmp_path, prefect):
    """Two processes recording one run each send the steps MLflow lacks (twice in MLflow) and one deletes the spool
    the other writes: while the run trains, `ballast sync` and `ballast run --resume` of it are refused in one line
    naming who records it; once it ended they go on."""
    project, seen = tmp_path / "p", {}

    def try_the_others():
        run_id = run_dir(project).name
        seen["sync"] = ballast("sync", run_id, "--project-dir", str(project))
        seen["resume"] = ballast("run", "--resume", run_id, "--project-dir", str(project))

    state, result = run(pipeline_spec(tiny_model, project), [AtStep({2: try_the_others})])
    assert state.is_completed(), result
    for name in ("sync", "resume"):
        done = seen[name]
        assert done.returncode == 2, done.stderr[-3000:]
        line = one_line(done.stderr)
        assert f"is in use by the pipeline run {result.run_id} (pid {os.getpid()} on " in line, line
    history = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").get_metric_history(result.run_id, "reward")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))  # each step once
    synced = ballast("sync", result.run_id, "--project-dir", str(project))
    assert synced.returncode == 0 and "metrics: none missing" in synced.stdout, synced.stderr[-3000:]


# ── the store goes away mid-run ────────────────────────────────────────────────────────────────────


def test_store_outage_mid_run_keeps_training_and_uploads_the_waiting_checkpoint_when_the_store_returns(
    tiny_model, tmp_path, prefect, s3_endpoint
):
    endpoint, bucket = s3_endpoint
    project, store, stored_at_4 = tmp_path / "p", open_store(f"s3://{bucket}/b"), []

    def look_in_the_store():
        stored_at_4.extend(store.list_dirs(f"runs/{run_dir(project).name}/checkpoints"))

    state, result = run(
        pipeline_spec(tiny_model, project, storage={"uri": f"s3://{bucket}/b"}),
        [AtStep({1: endpoint.stop, 3: endpoint.start}, {4: look_in_the_store})],
    )
    assert state.is_completed(), result
    assert stored_at_4 == ["step-000002", "step-000004"]  # step 2's upload failed; it went up with step 4's
    assert store.list_dirs(f"runs/{result.run_id}/checkpoints") == ["step-000002", "step-000004", "step-000006"]


def test_store_that_stays_away_ends_the_run_naming_each_checkpoint_not_uploaded_and_ballast_sync_uploads_them(
    tiny_model, tmp_path, prefect, s3_endpoint, monkeypatch
):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # what stays away stays away: 1 retry, not botocore's backoff of 4
    endpoint, bucket = s3_endpoint
    project = tmp_path / "p"
    state, error = run(
        pipeline_spec(tiny_model, project, storage={"uri": f"s3://{bucket}/b"}), [AtStep({1: endpoint.stop})]
    )
    rid, local = run_dir(project).name, run_dir(project) / "checkpoints"
    assert state.is_failed()
    assert (
        f"3 checkpoint(s) not uploaded to s3://{bucket}/b/runs/{rid}/checkpoints: step-000002, step-000004, "
        f"step-000006 (kept in {local})"
    ) in str(error)
    assert f"`ballast sync {rid} --project-dir {project}` uploads them" in str(error)
    assert sorted(p.name for p in local.iterdir()) == ["step-000002", "step-000004", "step-000006"]

    endpoint.start()
    synced = ballast("sync", rid, "--project-dir", str(project), env={"AWS_ENDPOINT_URL": endpoint.uri})
    assert synced.returncode == 0, synced.stderr[-3000:]
    assert open_store(f"s3://{bucket}/b").list_dirs(f"runs/{rid}/checkpoints") == [
        "step-000002",
        "step-000004",
        "step-000006",
    ]


def test_the_embedded_prefect_server_writes_to_its_log_not_the_terminal_and_a_failed_start_quotes_it(tmp_path):
    """The server Ballast starts writes under PREFECT_HOME (server.log), so nothing it prints at exit — its database
    pool's CancelledError traceback when stopped mid-request — lands after a Ctrl-C's one line; a start that fails
    names the log and quotes its end. Here the server command is one that prints and exits 3."""
    script = (
        "import sys\n"
        "from flows import runtime\n"
        "runtime.uvicorn_argv = lambda port: [sys.executable, '-c', "
        "'import sys; print(\"Traceback: the database is locked\", file=sys.stderr); sys.exit(3)']\n"
        "runtime.prestart(sys.argv[1])\n"
        "try:\n"
        "    runtime.wait_until_started(timeout=60)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    log = tmp_path / "prefect" / "server.log"
    assert done.stderr == ""  # nothing of the server's reached the terminal
    assert log.read_text().strip() == "Traceback: the database is locked"
    assert done.stdout.strip() == (
        f"the embedded Prefect API server exited with status 3 before answering (its log, {log}, ends: Traceback: "
        f"the database is locked); set PREFECT_API_URL to a running Prefect server instead"
    )
