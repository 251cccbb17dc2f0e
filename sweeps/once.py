"""A study-wide step — the baseline, the confirmation — done by one of the workers that share a study.

Workers joined to one study (`ballast sweep --workers 0`, then `ballast sweep-worker` on each machine) all reach
the same steps: each measures the base model before its first trial, and each that finds the study done
confirms its winner. Done by every worker, the baseline is scored K times and logged K times on the parent run,
and two confirmations at once delete each other's seed runs (a re-run confirmation discards the runs it finds
of its seeds). So one worker does such a step and the others wait for it (the baseline: their trials need it)
or leave it to that worker (the confirmation: it can take hours).

Optuna's storage has no lock; the claim is a study user attribute, `ballast.claim.<step>` =
{"owner", "beat", "finished", "version"}, written the same way by every process (SQLite or PostgreSQL):

1. A worker that finds the step done (the caller's test, or a finished claim of the same `version`) leaves it. One
   that finds no live claim writes its own, waits `settle_s`, and reads it back: of two that wrote at
   once the later write stands, so both read the same owner and one goes on.
2. The owner increments `beat` every `beat_s` while it works; on success it marks the claim finished, on an error
   it clears it (another worker takes the step over).
3. A claim is dead when its beat has not moved for `stale_s` of the watcher's own clock (no clock is compared
   across machines), or at once when its owner was a process of this machine that is gone (a SIGKILL). A dead
   claim is taken over as in 1.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable

import optuna

CLAIM_ATTR = "ballast.claim."
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"  # trial user attr `worker`: who ran it


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
    settle_s: float = 1.0,
    poll_s: float = 1.0,
) -> bool:
    """work() in one of the processes sharing `study`; True in that one. False when the step is done — done()
    holds, or a finished claim has this `version` (what the step was done for, e.g. the trials it confirmed) — at
    the start or once the owner finished (wait=True), or when another live worker holds the step (wait=False: it is
    proven live by one beat, then left to it). A work() that raises clears the claim and raises."""
    key, me = CLAIM_ATTR + step, f"{WORKER_ID}:{uuid.uuid4().hex[:8]}"
    watch = _Watch(stale_s)
    while not done():
        held = study.user_attrs.get(key) or None
        if version is not None and held and held.get("finished") and held.get("version") == version:
            return False
        if held and held["owner"] != me and not held.get("finished"):
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
        study.set_user_attr(key, {"owner": me, "beat": 0})
        time.sleep(settle_s)
        if (study.user_attrs.get(key) or {}).get("owner") == me:
            _own(study, key, me, work, beat_s, version)
            return True
    return False


def _own(study: optuna.Study, key: str, me: str, work: Callable[[], object], beat_s: float, version) -> None:
    stop = threading.Event()

    def beat() -> None:
        n = 0
        while not stop.wait(beat_s):
            n += 1
            try:
                study.set_user_attr(key, {"owner": me, "beat": n})
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
        study.set_user_attr(key, {"owner": me, "beat": -1, "finished": True, "version": version} if finished else None)


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
    """Whether a worker id ("host:pid", a claim's "host:pid:nonce") is of a process of this machine that is gone
    (SIGKILL, a crash); False for this process, another machine's or one that cannot be told."""
    host, _, rest = worker.partition(":")
    pid = rest.split(":")[0]
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
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
