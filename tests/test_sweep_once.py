"""A study-wide step (the baseline, the confirmation) done by one of the processes that share a study
(sweeps/once.py): real Optuna RDB storage, SQLite and the local PostgreSQL, real processes started at once.
Of four, exactly one does it and the others wait for it or leave it; a claim whose owner was killed, or
stopped beating, is taken over; a step that failed is done again by the next."""

import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time

import optuna
import pytest

from sweeps.once import CLAIM_ATTR, HOST, _lock, delete_locks, gone_here, in_progress, run_once
from tests.conftest import REPO, postgres_database

FAST = {"beat_s": 0.2, "stale_s": 1.5, "poll_s": 0.1}


@pytest.fixture(params=["sqlite", "postgresql"])
def storage(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'optuna.db'}"
    else:
        yield from postgres_database("ballast_once")


def _worker(url: str, log: str, wait: bool, seconds: float, out) -> None:
    """One process of the study: does the step (append a line to `log`, take `seconds` or, when None, until a file
    `log`.release appears, store a result) or leaves it."""
    study = optuna.load_study(study_name="s", storage=url)
    said = []

    def work() -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        if seconds is None:
            deadline = time.monotonic() + 120
            while not os.path.exists(log + ".release") and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            time.sleep(seconds)
        study.set_user_attr("result", os.getpid())

    started = time.monotonic()
    did = run_once(study, "step", work, lambda: "result" in study.user_attrs, wait=wait, say=said.append, **FAST)
    out.put((os.getpid(), did, study.user_attrs.get("result"), said, time.monotonic() - started))


def _start(url: str, log, n: int, wait: bool = True, seconds: float = 1.0):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(url, str(log), wait, seconds, out)) for _ in range(n)]
    for p in procs:
        p.start()
    return procs, out


def _results(procs, out) -> list[tuple]:
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return got


def test_of_four_processes_started_at_once_exactly_one_does_the_step_and_the_others_wait(storage, tmp_path):
    optuna.create_study(study_name="s", storage=storage)
    log = tmp_path / "did.log"
    got = _results(*_start(storage, log, 4))
    doers = log.read_text().split()
    assert len(doers) == 1  # done once, not four times
    assert [pid for pid, did, *_ in got if did] == [int(doers[0])]
    assert {result for _, _, result, *_ in got} == {int(doers[0])}  # every waiter returned after it was done
    assert optuna.get_all_study_names(storage) == ["s"]  # the round's lock study is gone with the step done
    waited = [said for _, did, _, said, _ in got if not did and said]
    assert all(s[0].startswith("step: the worker ") and s[0].endswith("is doing it; waiting") for s in waited)


def test_of_eight_threads_taking_one_round_at_the_same_instant_exactly_one_gets_it(storage):
    """The election itself: the storage's unique study name, not timing — however the threads interleave."""
    optuna.create_study(study_name="s", storage=storage)
    studies = [optuna.load_study(study_name="s", storage=storage) for _ in range(8)]  # a connection each
    barrier, won = threading.Barrier(8), []

    def take(study) -> None:
        barrier.wait()
        won.append(_lock(study, "step", 0))

    threads = [threading.Thread(target=take, args=(st,)) for st in studies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(won) == [False] * 7 + [True]


def test_a_worker_that_does_not_wait_leaves_the_step_to_the_live_owner(storage, tmp_path):
    optuna.create_study(study_name="s", storage=storage)
    log = tmp_path / "did.log"
    owner = _start(storage, log, 1, seconds=None)  # works until told to finish
    while not log.exists():
        time.sleep(0.05)
    ((_, did, result, said, seconds),) = _results(*_start(storage, log, 1, wait=False))
    assert not did and result is None and seconds < 5.0  # left to the owner, which still works: one beat, not 40 s
    assert said[-1].endswith("is doing it; its result lands on the study and the sweep's MLflow run")
    study = optuna.load_study(study_name="s", storage=storage)
    assert in_progress(study, "step")  # what the worker that left it reads: not done, another's (no summary from it)
    (tmp_path / "did.log.release").touch()
    ((_, did, *_),) = _results(*owner)
    assert did and len(log.read_text().split()) == 1
    assert not in_progress(optuna.load_study(study_name="s", storage=storage), "step")


def test_the_claim_of_a_killed_process_of_this_machine_is_taken_over_at_once(tmp_path):
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="s", storage=url)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    study.set_user_attr(CLAIM_ATTR + "step", {"owner": f"{HOST}:{gone.stdout.strip()}:ab", "beat": 3})
    said, started = [], time.monotonic()
    did = run_once(study, "step", lambda: said.append("worked"), say=said.append, **(FAST | {"stale_s": 60}))
    assert did and "worked" in said and time.monotonic() - started < 5  # not the 60 s a silent claim waits
    assert said[0].endswith("stopped without finishing it; taking it over")
    assert study.user_attrs[CLAIM_ATTR + "step"]["finished"] is True


def test_a_live_worker_in_another_pid_namespace_of_this_host_is_not_taken_for_dead(tmp_path):
    """Containers that share a host name (docker --network host) number their processes each in its own pid
    namespace: a worker's pid there is absent here, and was read as a process of this machine that is gone — its
    claim taken over and its trials failed while it ran. Its id now names its namespace: not one this process can
    look into, so only its heartbeat tells."""
    script = "from sweeps.once import WORKER_ID; print(WORKER_ID, flush=True); import time; time.sleep(60)"
    other = subprocess.Popen(  # the next pid in a new namespace is one this namespace cannot have (> pid_max)
        ["unshare", "--pid", "--fork", "sh", "-c", f"echo 49999 > /proc/sys/kernel/ns_last_pid && "
         f"{sys.executable} -c '{script}'"],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        worker = other.stdout.readline().strip()
        host, pid = worker.rsplit(":", 1)
        assert host.startswith(socket.gethostname() + "/") and host != HOST, worker  # the namespace, named
        assert not os.path.exists(f"/proc/{pid}")  # its pid is none of this namespace's: the old rule said "gone"
        assert not gone_here(worker) and not gone_here(f"{worker}:ab")
    finally:
        other.kill()
        other.wait()


def test_a_claim_whose_beat_stands_still_is_taken_over_after_stale_s(tmp_path):
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="s", storage=url)
    study.set_user_attr(CLAIM_ATTR + "step", {"owner": "another-node:4242:cd", "beat": 7})  # a node that went away
    said, started = [], time.monotonic()
    assert run_once(study, "step", lambda: said.append("worked"), say=said.append, **FAST)
    assert time.monotonic() - started >= FAST["stale_s"]
    assert said == [
        "step: the worker another-node:4242 is doing it; waiting",
        "step: the worker another-node:4242 stopped without finishing it; taking it over",
        "worked",
    ]


def test_a_step_that_failed_clears_its_claim_and_the_next_worker_does_it(tmp_path):
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="s", storage=url)

    def fails() -> None:
        raise RuntimeError("the base model could not load")

    with pytest.raises(RuntimeError, match="could not load"):
        run_once(study, "step", fails, **FAST)
    assert study.user_attrs[CLAIM_ATTR + "step"]["cleared"] is True
    started = time.monotonic()
    assert run_once(study, "step", lambda: None, **FAST) and time.monotonic() - started < 2


def test_a_step_already_done_is_not_done_again(tmp_path):
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    ran = []
    assert run_once(study, "step", lambda: ran.append(1), lambda: bool(ran), **FAST)
    assert not run_once(study, "step", lambda: ran.append(2), lambda: bool(ran), **FAST) and ran == [1]


def test_a_step_finished_for_the_same_version_is_not_done_again_and_a_new_version_is(tmp_path):
    """The confirmation's version is what it confirmed (the trials done, the confirm settings): a second worker
    arriving after the first confirmed the same study leaves it; more trials later are confirmed again."""
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    ran = []
    assert run_once(study, "step", lambda: ran.append("4 trials"), version="4", **FAST)
    assert not run_once(study, "step", lambda: ran.append("again"), version="4", **FAST)
    assert run_once(study, "step", lambda: ran.append("6 trials"), version="6", **FAST)
    assert ran == ["4 trials", "6 trials"]


def test_deleting_a_study_deletes_the_lock_a_killed_worker_left(tmp_path):
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="s", storage=url)
    optuna.create_study(study_name="other", storage=url)
    assert _lock(study, "confirmation", 2)  # held when its worker was killed
    optuna.delete_study(study_name="s", storage=url)
    delete_locks("s", study._storage)
    assert optuna.get_all_study_names(url) == ["other"]


def test_a_lock_study_is_not_named_among_the_sweeps_a_worker_could_join(tmp_path):
    from optuna.storages import RDBStorage

    from sweeps.space import SweepError
    from sweeps.study import join_study

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="s", storage=url)
    assert _lock(study, "baseline", 0)  # a worker is in the step
    with pytest.raises(SweepError) as e:
        join_study("typo", RDBStorage(url))
    assert "(it has ['s'])" in str(e.value)
