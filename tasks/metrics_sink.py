"""Step metrics from the run directory to MLflow, each (metric, step) exactly once whatever is killed when; and the
MLflow connection of a run, made to survive outages.

The record is the run directory: the trainer writes a step's metrics to `metrics.jsonl` before any callback sees
them (trainer/loop.py), and a resume cuts the file back to the checkpoint it starts from. MLflow mirrors it.
MLflow has no way to delete a metric value, and keeps a value sent again as a second point unless its timestamp
is the same too; so the hand-off keeps one rule — **a (metric, step) is sent only if MLflow does not hold it** —
and one process records a run at a time.

* A new run's sink (`MetricsSink`) sends each step as the trainer gives it, from a background thread in batches
  (every `flush_seconds`): MLflow holds nothing of a new run, and the trainer gives each step once.
* A resumed run's sink (`record=` its run directory) reads what MLflow holds of the run (`Held`: each metric's
  history, once) and, before the replay, sends the record's steps MLflow lacks up to the checkpoint the resume
  starts from (the step before the first one replayed; with none replayed, the newest checkpoint): the steps that
  were written and checkpointed but not yet delivered when the run was killed — the window between a checkpoint's
  write and its metrics' delivery. Step 0's eval-on-start and the eval/* of eval points are rows of the record
  like any step. Then the replay, minus what MLflow holds: steps past the checkpoint that MLflow took before the
  kill keep the values recorded first. A resume is exact (tests/test_signals.py), so they are the replay's values;
  where a deterministic one is not (a nondeterministic kernel, a changed environment), `mismatches` names it and
  the recorder tags the run `ballast.resume_mismatch`. The record past the checkpoint the trainer drops; MLflow's
  stays, and the replay makes the two one record again.
* `ballast sync RUN_ID` (`sync_record`) does the same for a run that is not running: the spool, then the record's
  steps MLflow lacks up to the run's newest checkpoint (the steps after it a resume replays).
* The spool: what cannot be sent (MLflow away) is appended to `<run dir>/mlflow-pending.jsonl` and training goes
  on; every flush sends the spool first (a resumed run's through the same rule), so the metrics kept during an
  outage reach MLflow when the server returns; what is still there at the end is named with `ballast sync`. A
  spool line sent again (its answer lost) has the same timestamp: MLflow keeps it once.
* A tracking server that stops answering: the client is tasks/tracking.py's `guarded` one (one line, not a
  page of urllib3 text); the check at start and the bounded HTTP waits are there too (`check_tracking`).

Fault points (trainer/checkpoint.py, BALLAST_FAULT=NAME:STEP) for the tests and bench/kill_resume.py:
`kill-after-logged:N` SIGKILLs the run once MLflow holds step N (the trainer waits at step N: none trains past it);
`kill-before-logged:N` once the checkpoint of step N (or a later one) is written, before step N's metrics are sent.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mlflow.entities import Metric

from infra.mlflow_server import TrackingUnavailable, short_reason
from tasks.checkpoint import resume_command, run_command
from trainer.callbacks import Callbacks
from trainer.checkpoint import HOLD_TIMEOUT_S, fault_armed, fault_point, list_checkpoints
from trainer.records import RunBusy as RunBusy  # for flows/: the run directory held by the process recording it
from trainer.records import append_rows, read_rows, write_rows
from trainer.records import hold as hold

PENDING = "mlflow-pending.jsonl"
RECORD = "metrics.jsonl"  # the trainer's step metrics in the run directory: the record
BATCH = 1000  # metrics per log_batch call (MLflow's limit)
NONDETERMINISTIC = ("time/", "step_time", "tokens_per_second", "judge/")  # measured, or served from a cache on replay
Copies = Callable[[dict], dict]  # the metrics logged beside a step's own (the recorder's headline copies)


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


def step_metrics(step: int, metrics: dict, timestamp: int) -> list[Metric]:
    """A step's metrics as MLflow takes them: numbers only, NaN left out."""
    return [
        Metric(k, float(v), timestamp, step)
        for k, v in metrics.items()
        if k != "step" and isinstance(v, (int, float)) and v == v
    ]


def now_ms() -> int:
    return int(time.time() * 1000)


# ── what MLflow holds ──────────────────────────────────────────────────────────────────────────────


class Held:
    """What MLflow holds of one run's metrics, metric -> step -> value: each metric's history read once, then kept
    up to date with what is sent. `lacks` is this module's rule."""

    def __init__(self, client, run_id: str):
        self.client, self.run_id = client, run_id
        self.values: dict[str, dict[int, float]] = {}
        self.mismatches: dict[tuple[str, int], str] = {}  # (metric, step) -> the value held and the one offered

    def steps(self, key: str) -> dict[int, float]:
        if key not in self.values:
            self.values[key] = {m.step: m.value for m in self.client.get_metric_history(self.run_id, key)}
        return self.values[key]

    def lacks(self, metrics: list[Metric]) -> list[Metric]:
        """The metrics whose (metric, step) MLflow does not hold, the first of each; a deterministic value offered
        for a (metric, step) held with another value is noted in `mismatches`."""
        kept: dict[tuple[str, int], Metric] = {}
        for m in metrics:
            first = self.steps(m.key).get(m.step)
            if first is None and (m.key, m.step) in kept:
                first = kept[(m.key, m.step)].value
            elif first is None:
                kept[(m.key, m.step)] = m
                continue
            if not _same(first, m.value) and not m.key.startswith(NONDETERMINISTIC):
                self.mismatches.setdefault(
                    (m.key, m.step), f"{m.key} at step {m.step}: {first:.6g} recorded, {m.value:.6g} replayed"
                )
        return list(kept.values())

    def add(self, metrics: list[Metric]) -> None:
        for m in metrics:
            self.steps(m.key)[m.step] = m.value


def deliver(client, run_id: str, metrics: list[Metric], spool: Path | None, held: Held | None = None) -> list[Metric]:
    """Send what the spool holds, then `metrics` — with `held` (a resumed run), only the (metric, step) pairs MLflow
    lacks — in batches of BATCH; returns what was sent. The spool is gone once its metrics are in MLflow; on a
    failure it holds what was not sent (rewritten atomically) and the error is raised."""
    todo = read_spool(spool) + metrics if spool else list(metrics)
    sent = 0
    try:
        if held is not None:
            todo = held.lacks(todo)
        for start in range(0, len(todo), BATCH):
            client.log_batch(run_id, metrics=todo[start : start + BATCH])
            sent = min(len(todo), start + BATCH)
            if held is not None:
                held.add(todo[start:sent])
    except BaseException:
        if spool is not None:
            write_spool(spool, run_id, todo[sent:])
        raise
    if spool is not None:
        spool.unlink(missing_ok=True)
    return todo


# ── the record ─────────────────────────────────────────────────────────────────────────────────────


def takes(step: int, metrics: dict, every: int) -> bool:
    """Whether a step's metrics go to MLflow: every `every`-th step (tracking.log_every), and every eval point."""
    return step % every == 0 or any(k.startswith("eval/") for k in metrics)


def record_metrics(run_dir: Path, last_step: int | None, every: int = 1, copies: Copies | None = None) -> list[Metric]:
    """The record's metrics of the steps up to `last_step` (None: none), as the sink sends them live."""
    if last_step is None:
        return []
    ts, out = now_ms(), []
    for row in read_rows(run_dir / RECORD):
        if row["step"] <= last_step and takes(row["step"], row, every):
            out += step_metrics(row["step"], {**row, **(copies(row) if copies else {})}, ts)
    return out


def newest_checkpoint(run_dir: Path) -> int | None:
    """The step of the newest checkpoint in the run directory (None: none): where a resume starts."""
    found = list_checkpoints(run_dir / "checkpoints")
    return found[-1][0] if found else None


def sync_record(client, run_id: str, run_dir: Path, every: int = 1, copies: Copies | None = None) -> int:
    """`ballast sync`: the spool, then the record's steps MLflow lacks up to the newest checkpoint; how many sent."""
    metrics = record_metrics(run_dir, newest_checkpoint(run_dir), every, copies)
    return len(deliver(client, run_id, metrics, run_dir / PENDING, Held(client, run_id)))


# ── during a run ───────────────────────────────────────────────────────────────────────────────────


class MetricsSink(Callbacks):
    """Step metrics to MLflow from a background thread, in batches at most every `flush_seconds` (and at close),
    kept in `spool` when they cannot be sent. One log_batch per step cost ~17 ms of CPU on SQLite, taken from the
    training thread through the GIL; batched, MLflow sees the curves ~2 s late and training loses nothing.
    `every` (tracking.log_every) sends only every N-th step's metrics (eval steps always). `record`: a resumed run's
    directory, whose steps MLflow lacks are sent first, with `copies` of each row (see the module docstring)."""

    flush_seconds = 2.0
    retry_max_seconds = 60.0  # while MLflow is away, batches go straight to the spool; asked again after 4, 8 ... s
    close_seconds = 120.0  # the most `close()` waits for the last flush (each request is bounded: check_tracking)

    def __init__(
        self,
        client,
        run_id: str,
        every: int = 1,
        spool: Path | None = None,
        record: Path | None = None,
        copies: Copies | None = None,
    ):
        self.client, self.run_id, self.every = client, run_id, every
        self.spool = Path(spool) if spool else None
        self.record, self.copies = record, copies
        self.held = Held(client, run_id) if record is not None else None  # a new run's MLflow holds nothing
        self.first_step: int | None = None  # the first step given: the replay starts there
        self.caught_up = record is None  # the record's steps MLflow lacked are sent (or in the spool)
        self.error: Exception | None = None  # the last failure to send
        self.pending = pending_count(self.spool) if self.spool else 0  # metrics in the spool (a resumed run's too)
        self.checkpointed = -1  # the newest checkpoint's step (the kill-before-logged fault waits for it)
        self._saved = threading.Condition()
        self._failures, self._retry_at = 0, 0.0
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="mlflow-metrics", daemon=True)
        self.thread.start()

    @property
    def mismatches(self) -> list[str]:
        """Replayed values that differ from the ones MLflow holds (recorded first, and kept)."""
        return list(self.held.mismatches.values()) if self.held else []

    def takes(self, step: int, metrics: dict) -> bool:
        return takes(step, metrics, self.every)

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if self.takes(step, metrics):
            self.put(step, metrics)
        if fault_armed("kill-after-logged", step):  # BALLAST_FAULT: train no further; the delivery of this step kills
            time.sleep(HOLD_TIMEOUT_S)

    def put(self, step: int, metrics: dict[str, float]) -> None:
        """Queue a step's metrics (already chosen by `takes`) for the next batch."""
        if self.first_step is None:
            self.first_step = step
        self.q.put(step_metrics(step, metrics, now_ms()))

    def on_checkpoint(self, checkpoint) -> None:
        with self._saved:
            self.checkpointed = checkpoint.step
            self._saved.notify_all()

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
            closing = item is None
            owed = not self.caught_up and (closing or self.first_step is not None)
            if (closing or time.monotonic() - last_flush >= self.flush_seconds) and (batch or self.pending or owed):
                self._flush(batch, last_try=closing)
                batch, last_flush = [], time.monotonic()
            if closing:
                return

    def _flush(self, batch: list[Metric], last_try: bool = False) -> None:
        """The spool, a resumed run's missing record, then `batch`; what cannot be sent goes to the spool."""
        if not last_try and time.monotonic() < self._retry_at:  # MLflow was away a moment ago: keep, do not ask
            self._keep(batch)
            return
        self._fault_before_logged(batch)
        try:
            owed = self._catch_up(last_try)
        except Exception as e:  # the record could not be read (a damaged line): keep the batch, ask again next time
            self.error = e
            self._keep(batch)
            return
        try:
            sent = deliver(self.client, self.run_id, owed + batch, self.spool, self.held)
            self.pending, self.error, self._failures = 0, None, 0
            for step in sorted({m.step for m in sent}):
                fault_point("kill-after-logged", step)  # BALLAST_FAULT: MLflow holds this step, then the process dies
        except Exception as e:  # an outage: keep training, keep the metrics (deliver left them in the spool)
            self.error, self._failures = e, self._failures + 1
            self._retry_at = time.monotonic() + min(self.retry_max_seconds, self.flush_seconds * 2**self._failures)
            if self.spool is not None:
                self.pending = pending_count(self.spool)

    def _catch_up(self, last_try: bool) -> list[Metric]:
        """Once, on a resumed run: the record's metrics up to the checkpoint the resume starts from — the step before
        the first one given, or with none given (at close) the newest checkpoint's."""
        if self.caught_up or (self.first_step is None and not last_try):
            return []
        last = self.first_step - 1 if self.first_step is not None else newest_checkpoint(self.record)
        owed = record_metrics(self.record, last, self.every, self.copies)
        self.caught_up = True  # from here they are sent, or kept in the spool with the batch
        return owed

    def _fault_before_logged(self, batch: list[Metric]) -> None:
        """BALLAST_FAULT=kill-before-logged:N: SIGKILL once the checkpoint of step N is written, N not yet sent."""
        for step in sorted({m.step for m in batch}):
            if fault_armed("kill-before-logged", step):
                with self._saved:
                    self._saved.wait_for(lambda step=step: self.checkpointed >= step, timeout=HOLD_TIMEOUT_S)
                fault_point("kill-before-logged", step)

    def _keep(self, metrics: list[Metric]) -> None:
        if self.spool is not None and metrics:
            append_pending(self.spool, self.run_id, metrics)
            self.pending += len(metrics)

    def close(self) -> None:
        """Send what is left; TrackingUnavailable if some of it could not be sent (it stays in the spool)."""
        if self.thread.is_alive():
            self.q.put(None)
            self.thread.join(timeout=self.close_seconds)
        if self.thread.is_alive():  # the last flush outlived close_seconds: what it holds is in the run's record
            raise TrackingUnavailable(
                f"MLflow was still taking step metrics of run {self.run_id} after {self.close_seconds:.0f} s"
            )
        if self.pending:
            raise TrackingUnavailable(
                f"MLflow did not take step metrics of run {self.run_id} "
                f"({short_reason(self.error) if self.error else 'still sending'})"
            )
        if self.error and self.spool is None:
            raise RuntimeError(f"could not log metrics to MLflow run {self.run_id}: {self.error}")

    def lost(self, error: TrackingUnavailable, project_dir: str | Path) -> TrackingUnavailable:
        """The tracking server went away mid-run: `error`, what waits in the spool and the commands for later (for a
        run of the project at `project_dir`)."""
        try:
            self.close()
        except Exception:
            pass
        kept = f"; {self.pending} step metrics wait in {self.spool}" if self.pending else ""
        sync = f"`{run_command('sync', self.run_id, project_dir)}` sends them, " if self.pending else ""
        return TrackingUnavailable(
            f"{error}{kept}; when the server is back, {sync}`{resume_command(self.run_id, project_dir)}` finishes "
            "the run"
        )


# ── the spool ──────────────────────────────────────────────────────────────────────────────────────


def _spool_rows(run_id: str, metrics: list[Metric]) -> list[dict]:
    """`metrics` of `run_id` as spool rows, one per batch of at most BATCH."""
    return [
        {"run_id": run_id, "metrics": [[m.key, m.value, m.timestamp, m.step] for m in metrics[i : i + BATCH]]}
        for i in range(0, len(metrics), BATCH)
    ]


def append_pending(spool: Path, run_id: str, metrics: list[Metric]) -> None:
    """Keep `metrics` of `run_id` in the spool, written through to disk."""
    spool.parent.mkdir(parents=True, exist_ok=True)
    append_rows(spool, _spool_rows(run_id, metrics), sync=True)


def write_spool(spool: Path, run_id: str, metrics: list[Metric]) -> None:
    """The spool as exactly `metrics` (none: no spool), replaced atomically."""
    if not metrics:
        spool.unlink(missing_ok=True)
        return
    write_rows(spool, _spool_rows(run_id, metrics))


def read_spool(spool: Path) -> list[Metric]:
    return [Metric(k, v, ts, step) for entry in read_rows(spool) for k, v, ts, step in entry["metrics"]]


def pending_count(spool: Path) -> int:
    return len(read_spool(spool))
