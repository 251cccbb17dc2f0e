"""The run directory's JSON-lines records — metrics.jsonl, prompts.jsonl, the samples files, the MLflow spool — one
row a line, appended, read back and cut back, so that a kill at any moment loses no row that was whole.

A process killed in the middle of an append (a SIGKILL, the OOM killer, a node going away) can leave the file's last
line without its newline: a torn row, whose step was never acknowledged (the trainer writes a step's rows before
the checkpoint that covers it, so a resume redoes that step). Reading leaves a torn last line out; appending first
cuts it off, so a new row never joins a torn one; cutting the records back (a resume, `keep_rows`) writes a new
file and renames it over the old, so a kill then leaves the old rows or the new ones, never an empty file. A
malformed line before the last is not a kill's doing: `RecordError` names the file and the line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from .config import InputError

_TAIL = 1 << 16  # bytes read back from the end at a time, looking for the last newline


class RecordError(InputError):
    """A run-directory record with a malformed line that is not a torn last one: bad input (the CLI's one line,
    exit 2), as a corrupt checkpoint is."""


def read_rows(path: Path | str) -> list[dict]:
    """The file's rows, a torn last line left out; [] when there is no file."""
    path = Path(path)
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    if lines and lines[-1].strip():  # no newline after it: the append that wrote it was cut short
        lines.pop()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise RecordError(
                f"{path}: line {number} is not a JSON row ({e.msg}); the file was edited or damaged — restore it "
                "from the run's MLflow copy or delete the line"
            ) from None
    return rows


def append_rows(path: Path | str, rows: list[dict], *, sync: bool = False) -> None:
    """The rows appended in one write, after cutting off a torn last line; `sync`: on the disk before returning."""
    if not rows:
        return
    path = Path(path)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    with open(path, "ab") as f:
        _cut_torn_tail(f)
        f.write(text.encode("utf-8"))
        if sync:
            f.flush()
            os.fsync(f.fileno())


def keep_rows(path: Path | str, keep: Callable[[dict], bool]) -> None:
    """The file cut back to the rows `keep` accepts (a torn last line goes too), replaced atomically."""
    path = Path(path)
    if not path.is_file():
        return
    rows = [row for row in read_rows(path) if keep(row)]
    write_rows(path, rows)


def write_rows(path: Path | str, rows: list[dict]) -> None:
    """The file as exactly `rows`, replaced atomically (a kill leaves the old file or the new one)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _cut_torn_tail(f) -> None:
    """An append-mode file truncated after its last newline when its last byte is not one."""
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return
    with open(f.name, "rb") as r:
        r.seek(end - 1)
        if r.read(1) == b"\n":
            return
        pos = end
        while pos > 0:
            start = max(0, pos - _TAIL)
            r.seek(start)
            chunk = r.read(pos - start)
            at = chunk.rfind(b"\n")
            if at >= 0:
                f.truncate(start + at + 1)
                return
            pos = start
    f.truncate(0)  # one torn line and nothing before it


# ── one recorder a run ──────────────────────────────────────────────────────────────────────────────

LOCK_FILE = ".ballast-recording"  # in the run directory: who records the run now (`ballast run`, `ballast sync`)
_held: dict[Path, object] = {}  # run directory -> the open lock file this process holds


class RunBusy(ValueError):
    """Another live process records this run (its training, its resume, a `ballast sync`)."""


def hold(run_dir: Path | str, what: str) -> None:
    """This process alone records the run in `run_dir` until `release` or its end (a kill included: the lock is the
    kernel's, on an open file, gone with the process). Two recorders of one run — a resume while the run still
    trains, two syncs — each send the steps MLflow lacks, so MLflow gets them twice, and one deletes the spool the
    other is writing. RunBusy names the holder; holding again in this process is a no-op."""
    import fcntl
    import socket

    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RunBusy(
            f"run directory {run_dir} is in use by {holder}; wait for it to end (or stop it: Ctrl-C, or kill the "
            "process), then try again — two processes recording one run would each send its metrics"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{what} (pid {os.getpid()} on {socket.gethostname()})\n")
    f.flush()
    _held[run_dir] = f


def release(run_dir: Path | str) -> None:
    f = _held.pop(Path(run_dir).resolve(), None)
    if f is not None:
        f.close()  # the lock goes with the file
