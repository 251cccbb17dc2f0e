"""The MLflow connection of a run, made to survive outages: step metrics kept on disk while the tracking server
is away, and connection failures as one line.

* The check at start and the bounded HTTP waits are infra/mlflow_server.py's (`check_tracking`).
* `guarded(client, uri)` — an MlflowClient whose connection failures raise `TrackingUnavailable` (one line) instead
  of an MlflowException carrying a page of urllib3 text.
* `MetricsSink` — step metrics to MLflow from a background thread in batches (every `flush_seconds`). A batch that
  cannot be sent is appended to the run's spool, `<run dir>/mlflow-pending.jsonl`, and training goes on; every
  flush first sends what the spool holds, so the metrics kept during an outage reach MLflow when the server
  returns. What is still there at the end is named with the command that sends it later (`ballast sync RUN_ID`,
  which calls `send_pending`). MLflow drops a metric it already has, so sending a line twice is harmless.
* Exactly once across a resume. A run killed after MLflow took steps past its last checkpoint replays those steps
  when resumed; MLflow cannot delete a value, and the replay's timestamps differ, so it would hold them twice. A
  resumed run's sink (`replayed=True`) therefore skips every (metric, step) MLflow already holds — looked up once per
  metric, after the spool is sent — and keeps the values recorded first. A resume is exact (tests/test_signals.py),
  so they are the replay's values; where one is not (a deterministic metric differs beyond rounding: a
  nondeterministic kernel, a changed environment), `mismatches` says which, and the recorder tags the run with it.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path

import requests
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException

from infra.mlflow_server import TrackingUnavailable, is_http, short_reason
from trainer.checkpoint import fault_point
from trainer.loop import Callbacks

PENDING = "mlflow-pending.jsonl"
BATCH = 1000  # metrics per log_batch call (MLflow's limit)
NONDETERMINISTIC = ("time/", "step_time", "tokens_per_second", "judge/")  # measured, or served from a cache on replay


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


# ── during a run ───────────────────────────────────────────────────────────────────────────────────


def connection_failure(error: BaseException) -> BaseException | None:
    """The network error behind an MlflowException (refused, timed out, retries exhausted), or None."""
    seen = 0
    while error is not None and seen < 6:
        if isinstance(
            error, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, requests.exceptions.RetryError)
        ):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


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
    return _Guarded(client, uri) if is_http(uri) else client


class MetricsSink(Callbacks):
    """Step metrics to MLflow from a background thread, in batches at most every `flush_seconds` (and at close),
    kept in `spool` when they cannot be sent. One log_batch per step cost ~17 ms of CPU on SQLite, taken from the
    training thread through the GIL; batched, MLflow sees the curves ~2 s late and training loses nothing.
    `every` (tracking.log_every) sends only every N-th step's metrics (eval steps always)."""

    flush_seconds = 2.0
    retry_max_seconds = 60.0  # while MLflow is away, batches go straight to the spool; asked again after 4, 8 ... s
    close_seconds = 120.0  # the most `close()` waits for the last flush (each request is bounded: check_tracking)

    def __init__(self, client, run_id: str, every: int = 1, spool: Path | None = None, replayed: bool = False):
        self.client, self.run_id, self.every = client, run_id, every
        self.spool = Path(spool) if spool else None
        self.recorded: dict[str, dict[int, float]] | None = {} if replayed else None  # metric -> step -> value
        self.mismatches: list[str] = []  # replayed values that differ from the ones recorded first
        self.error: Exception | None = None  # the last failure to send
        self.pending = pending_count(self.spool) if self.spool else 0  # metrics in the spool (a resumed run's too)
        self._failures, self._retry_at = 0, 0.0
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="mlflow-metrics", daemon=True)
        self.thread.start()

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if step % self.every and not any(k.startswith("eval/") for k in metrics):
            return
        ts = int(time.time() * 1000)
        self.q.put(
            [
                Metric(k, float(v), ts, step)
                for k, v in metrics.items()
                if k != "step" and isinstance(v, (int, float)) and v == v
            ]
        )

    def _work(self) -> None:
        batch: list[Metric] = []
        last_flush = time.monotonic()
        while True:
            try:
                item = self.q.get(timeout=self.flush_seconds)
            except queue.Empty:
                item = []
            if item:
                batch += item
            if (item is None or time.monotonic() - last_flush >= self.flush_seconds) and (batch or self.pending):
                self._flush(batch, last_try=item is None)
                batch, last_flush = [], time.monotonic()
            if item is None:
                return

    def _flush(self, batch: list[Metric], last_try: bool = False) -> None:
        """What the spool holds first, then `batch`; what cannot be sent goes to the spool (kept for later)."""
        if not last_try and time.monotonic() < self._retry_at:  # MLflow was away a moment ago: keep, do not ask
            self._keep(batch)
            return
        sent = 0
        try:
            if self.pending:
                send_pending(self.client, self.spool)
                self.pending = 0
            batch = self._not_recorded(batch)
            for start in range(0, len(batch), BATCH):
                self.client.log_batch(self.run_id, metrics=batch[start : start + BATCH])
                sent = min(len(batch), start + BATCH)
            self.error, self._failures = None, 0
            for step in sorted({m.step for m in batch}):
                fault_point("kill-after-logged", step)  # BALLAST_FAULT: MLflow holds this step, then the process dies
        except Exception as e:  # an outage: keep training, keep the metrics
            self.error, self._failures = e, self._failures + 1
            self._retry_at = time.monotonic() + min(self.retry_max_seconds, self.flush_seconds * 2**self._failures)
            self.pending = pending_count(self.spool) if self.spool else 0  # the spool may have been sent in part
            self._keep(batch[sent:])

    def _not_recorded(self, batch: list[Metric]) -> list[Metric]:
        """A resumed run's metrics minus those MLflow already holds for that step (see the module docstring)."""
        if self.recorded is None:
            return batch
        kept = []
        for m in batch:
            if m.key not in self.recorded:
                history = self.client.get_metric_history(self.run_id, m.key)
                self.recorded[m.key] = {h.step: h.value for h in history}
            first = self.recorded[m.key].get(m.step)
            if first is None:
                kept.append(m)
                self.recorded[m.key][m.step] = m.value
            elif not _same(first, m.value) and not m.key.startswith(NONDETERMINISTIC):
                self.mismatches.append(f"{m.key} at step {m.step}: {first:.6g} recorded, {m.value:.6g} replayed")
        return kept

    def _keep(self, metrics: list[Metric]) -> None:
        if self.spool is not None and metrics:
            append_pending(self.spool, self.run_id, metrics)
            self.pending += len(metrics)

    def close(self) -> None:
        """Send what is left; TrackingUnavailable if some of it could not be sent (it stays in the spool)."""
        if self.thread.is_alive():
            self.q.put(None)
            self.thread.join(timeout=self.close_seconds)
        if self.pending:
            raise TrackingUnavailable(
                f"MLflow did not take step metrics of run {self.run_id} "
                f"({short_reason(self.error) if self.error else 'still sending'})"
            )
        if self.error and self.spool is None:
            raise RuntimeError(f"could not log metrics to MLflow run {self.run_id}: {self.error}")

    def lost(self, error: TrackingUnavailable) -> TrackingUnavailable:
        """The tracking server went away mid-run: `error`, what waits in the spool and the commands for later."""
        try:
            self.close()
        except Exception:
            pass
        kept = f"; {self.pending} step metrics wait in {self.spool}" if self.pending else ""
        sync = f"`ballast sync {self.run_id}` sends them, " if self.pending else ""
        return TrackingUnavailable(
            f"{error}{kept}; when the server is back, {sync}`ballast run --resume {self.run_id}` finishes the run"
        )


# ── the spool ──────────────────────────────────────────────────────────────────────────────────────


def append_pending(spool: Path, run_id: str, metrics: list[Metric]) -> None:
    """Keep `metrics` of `run_id` in the spool, a line per batch of at most BATCH, written through to disk."""
    spool.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(
            {"run_id": run_id, "metrics": [[m.key, m.value, m.timestamp, m.step] for m in metrics[i : i + BATCH]]}
        )
        for i in range(0, len(metrics), BATCH)
    ]
    with open(spool, "a") as f:
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())


def _lines(spool: Path) -> list[str]:
    if not spool.is_file():
        return []
    return [line for line in spool.read_text().splitlines() if line.strip()]


def pending_count(spool: Path) -> int:
    return sum(len(json.loads(line)["metrics"]) for line in _lines(spool))


def send_pending(client, spool: Path) -> int:
    """Send every metric in `spool` to MLflow, oldest first; returns how many were sent. The sent lines leave the
    spool when it stops; on a failure the unsent ones stay (rewritten atomically) and the error is raised."""
    lines, sent, done = _lines(spool), 0, 0
    try:
        for line in lines:
            entry = json.loads(line)
            client.log_batch(entry["run_id"], metrics=[Metric(k, v, ts, step) for k, v, ts, step in entry["metrics"]])
            sent, done = sent + len(entry["metrics"]), done + 1
    finally:
        rest = lines[done:]
        if not rest:
            spool.unlink(missing_ok=True)
        elif done:
            tmp = spool.with_name(spool.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in rest))
            os.replace(tmp, spool)
    return sent
