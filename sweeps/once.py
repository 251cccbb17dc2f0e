"""A study-wide step — the baseline, the confirmation — done by one of the workers that share a study.

Workers joined to one study (`ballast sweep --workers 0`, then `ballast sweep-worker` on each machine) all reach
the same steps: each measures the base model before its first trial, and each that finds the study done
confirms its winner. Done by every worker, the baseline is scored K times and logged K times on the parent run,
and two confirmations at once delete each other's seed runs (a re-run confirmation discards the runs it finds
of its seeds). So one worker does such a step and the others wait for it (the baseline: their trials need it)
or leave it to that worker (the confirmation: it can take hours).

The election is the storage's own: a study name is unique in every Optuna storage, and creating one that exists
fails (DuplicatedStudyError, the database's unique constraint on SQLite and PostgreSQL alike), so "round r of
step S is mine" is creating the study `<study>.ballast-claim.<S>.<r>` — of any number of workers trying at once,
exactly one succeeds, however slow the others are. What the round's owner is doing is a study user attribute,
`ballast.claim.<S>` = {"owner", "round", "beat", "finished" | "cleared", "version"}:

1. A worker that finds the step done (the caller's test, or a finished claim of the same `version`) leaves it. One
   that finds no live claim tries the next round (0, or the attribute's round + 1); the winner writes the
   attribute and works, the others watch it.
2. The owner increments `beat` every `beat_s` while it works; on success it marks the claim finished, on an error
   it clears it (the next round is open to all). The lock studies of its round and the one before are deleted.
3. A claim is dead when its beat has not moved for `stale_s` of the watcher's own clock (no clock is compared
   across machines), or at once when its owner was a process of this machine that is gone (a SIGKILL). Its next
   round is tried as in 1.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable

import optuna
from optuna.exceptions import DuplicatedStudyError
from optuna.study import StudyDirection

CLAIM_ATTR = "ballast.claim."
LOCK_INFIX = ".ballast-claim."  # a lock study's name: <study><LOCK_INFIX><step>.<round>
INITIAL_PID_NAMESPACE = "4026531836"  # the kernel's own (PROC_PID_INIT_INO): a process not in a container


def _host() -> str:
    """This process's machine as a worker id names it: the host name, and the process-id namespace where that is not
    the kernel's own. Containers that share a host name (docker --network host) number their processes each in its
    own namespace, and a pid is looked up only in one's own: without it, a worker in one such container took a live
    worker in another for dead (its pid absent here) and failed its trials."""
    try:
        namespace = os.readlink("/proc/self/ns/pid").partition("[")[2].rstrip("]")
    except OSError:  # not Linux: pids are the machine's
        namespace = INITIAL_PID_NAMESPACE
    host = socket.gethostname()
    return host if namespace in ("", INITIAL_PID_NAMESPACE) else f"{host}/{namespace}"


HOST = _host()
WORKER_ID = f"{HOST}:{os.getpid()}"  # trial user attr `worker`: who ran it


def run_once(
    study: optuna.Study,
    step: str,
    work: Callable[[], object],
    done: Callable[[], bool] = lambda: False,
    *,
    wait: bool = True,
    version: str | None = None,
    say: Callable[[str], None] = print,
    beat_s: float = 10.0,
    stale_s: float = 40.0,
    poll_s: float = 1.0,
) -> bool:
    """work() in one of the processes sharing `study`; True in that one. False when the step is done — done() holds,
    or a finished claim has this `version` (what the step was done for, e.g. the trials it confirmed) — at the start
    or once the owner finished (wait=True), or when another live worker holds the step (wait=False: it is proven
    live by one beat, then left to it). A work() that raises clears the claim and raises; a process that dies in it
    leaves its round to be taken over."""
    key, me = CLAIM_ATTR + step, f"{WORKER_ID}:{uuid.uuid4().hex[:8]}"
    watch = _Watch(stale_s)
    while not done():
        held = study.user_attrs.get(key) or None
        if version is not None and held and held.get("finished") and held.get("version") == version:
            return False
        if held and not (held.get("finished") or held.get("cleared")):
            state = watch.see(held)
            if state == "live" and not wait:
                say(f"{step}: {_who(held)} is doing it; its result lands on the study and the sweep's MLflow run")
                return False
            if state != "dead":
                if watch.first and wait:
                    say(f"{step}: {_who(held)} is doing it; waiting")
                time.sleep(poll_s)
                continue
            say(f"{step}: {_who(held)} stopped without finishing it; taking it over")
        elif held and watch.seen and held.get("finished"):
            return False  # the owner we watched finished; what it did is on the study
        r = held.get("round", -1) + 1 if held else 0
        if not _lock(study, step, r):  # another worker won round r: its claim shows on the next look
            time.sleep(poll_s)
            continue
        now = study.user_attrs.get(key) or None
        if (now and now.get("round", -1) >= r) or done():  # a round already past ours: a leftover lock
            _unlock(study, step, r)
            continue
        study.set_user_attr(key, {"owner": me, "round": r, "beat": 0})
        _unlock(study, step, r - 1)
        try:
            _own(study, key, me, r, work, beat_s, version)
        finally:
            _unlock(study, step, r)
        return True
    return False


def in_progress(study: optuna.Study, step: str) -> bool:
    """Whether a worker holds the step now (a claim neither finished nor cleared): after run_once(wait=False)
    returned False, the step is another live worker's, not done."""
    held = study.user_attrs.get(CLAIM_ATTR + step) or {}
    return bool(held) and not (held.get("finished") or held.get("cleared"))


def _lock_name(study: optuna.Study, step: str, r: int) -> str:
    return f"{study.study_name}{LOCK_INFIX}{step}.{r}"


def _lock(study: optuna.Study, step: str, r: int) -> bool:
    """Round r of the step taken by this process: True for exactly one of the processes that try."""
    quiet = logging.getLogger("optuna.storages._rdb.storage")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # not "A new study created" for a lock
    try:
        study._storage.create_new_study([StudyDirection.MINIMIZE], _lock_name(study, step, r))
        return True
    except DuplicatedStudyError:
        return False
    finally:
        quiet.setLevel(level)


def delete_locks(study_name: str, storage) -> None:
    """Every lock study of a study's steps (left by a worker killed in one), for `ballast sweep --delete`."""
    for summary in storage.get_all_studies():
        if summary.study_name.startswith(study_name + LOCK_INFIX):
            storage.delete_study(summary._study_id)


def _unlock(study: optuna.Study, step: str, r: int) -> None:
    if r < 0:
        return
    storage = study._storage
    try:
        storage.delete_study(storage.get_study_id_from_name(_lock_name(study, step, r)))
    except KeyError:  # deleted already, or never made
        pass


def _own(study: optuna.Study, key: str, me: str, r: int, work: Callable[[], object], beat_s: float, version) -> None:
    stop = threading.Event()

    def beat() -> None:
        n = 0
        while not stop.wait(beat_s):
            n += 1
            try:
                study.set_user_attr(key, {"owner": me, "round": r, "beat": n})
            except Exception as e:  # a missed beat is late, not lost
                warnings.warn(f"could not write the claim {key}'s beat: {e}", stacklevel=1)

    thread = threading.Thread(target=beat, name=f"claim-{key}", daemon=True)
    thread.start()
    finished = False
    try:
        work()
        finished = True
    finally:  # the beats stop first, so that none lands after the claim is marked finished or cleared
        stop.set()
        thread.join()
        end = {"finished": True, "version": version} if finished else {"cleared": True}
        study.set_user_attr(key, {"owner": me, "round": r, "beat": -1, **end})


class _Watch:
    """Another worker's claim as this one has seen it: live once its beat moves, dead when it stands still for
    stale_s (or its owner is a gone process of this machine)."""

    def __init__(self, stale_s: float):
        self.stale_s, self.claim, self.since, self.first, self.seen = stale_s, None, 0.0, False, False

    def see(self, claim: dict) -> str:
        now = time.monotonic()
        self.first = self.claim is None
        self.seen = True
        if self.claim is None or claim["owner"] != self.claim["owner"]:
            self.claim, self.since = claim, now
            return "dead" if gone_here(claim["owner"]) else "unknown"
        if claim["beat"] != self.claim["beat"]:
            self.claim, self.since = claim, now
            return "live"
        return "dead" if now - self.since >= self.stale_s or gone_here(claim["owner"]) else "unknown"


def gone_here(worker: str) -> bool:
    """Whether a worker id ("host:pid", a claim's "host:pid:nonce"; host with "/<pid namespace>" in a container) is
    of a process of this machine and pid namespace that is gone (SIGKILL, a crash); False for this process, another
    machine's or namespace's, or one that cannot be told."""
    host, _, rest = worker.partition(":")
    pid = rest.split(":")[0]
    if host != HOST or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's process: alive
        return False
    return False


def _who(claim: dict) -> str:
    host, pid = claim["owner"].split(":")[:2]
    return f"the worker {host}:{pid}"
