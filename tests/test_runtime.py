"""The embedded Prefect server's database (flows/runtime.py): a new project folder starts from the machine's
template — a migrated, empty database the first new project's server left in the cache — and a run in it is its
own. Each test starts real Prefect API servers in a process of its own, with the cache in the test's folder."""

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

# in a process of its own: start the embedded server for a project, wait for it, run a flow through it, stop it
START_AND_RUN = """
import sys
from pathlib import Path
from flows import runtime
project = sys.argv[1]
runtime.prestart(project)
print("database before the server:", (Path(project) / "prefect" / "prefect.db").exists())
runtime.wait_until_started()
from prefect import flow

@flow(name="template-check")
def check() -> int:
    return 1

check()
runtime.stop_server()
"""


def start_and_run(project: Path, cache: Path, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}  # no test harness's API
    done = subprocess.run(
        [sys.executable, "-c", START_AND_RUN, str(project)],
        cwd=REPO,
        env={**clean, "XDG_CACHE_HOME": str(cache), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


def in_own_process(script: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`script` run with the project tmp_path/project (and args), no test harness's API, the cache in tmp_path."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "project"), *args],
        cwd=REPO,
        env={**clean, "XDG_CACHE_HOME": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def rows(database: Path, table: str) -> int:
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
        return db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def revision(database: Path) -> str:
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
        return db.execute("SELECT version_num FROM alembic_version").fetchone()[0]


def test_a_new_project_starts_from_the_template_the_first_one_left_and_its_runs_are_its_own(tmp_path):
    cache = tmp_path / "cache"
    first, second = tmp_path / "first", tmp_path / "second"
    assert start_and_run(first, cache) == ["database before the server: False"]  # created by its server
    (template,) = (cache / "ballast").glob("prefect-*.db")
    # the template: migrated and the block types registered, as the server left it before any flow ran
    assert revision(template) == revision(first / "prefect" / "prefect.db")
    assert rows(template, "block_type") > 0
    assert rows(template, "flow_run") == 0
    assert rows(first / "prefect" / "prefect.db", "flow_run") == 1

    assert start_and_run(second, cache) == ["database before the server: True"]  # copied before the server started
    assert rows(second / "prefect" / "prefect.db", "flow_run") == 1  # its own run, served from the copy
    assert rows(template, "flow_run") == 0  # the template is never served
    assert sorted(p.name for p in (cache / "ballast").iterdir()) == [template.name]  # no partial copies left


def test_a_template_that_is_not_a_database_is_replaced_by_the_next_new_project(tmp_path):
    cache = tmp_path / "cache"
    (cache / "ballast").mkdir(parents=True)
    from importlib.metadata import version

    template = cache / "ballast" / f"prefect-{version('prefect')}.db"
    template.write_bytes(b"not a database, say a disk that filled up")
    assert start_and_run(tmp_path / "second", cache) == ["database before the server: False"]
    assert rows(tmp_path / "second" / "prefect" / "prefect.db", "flow_run") == 1
    assert rows(template, "block_type") > 0  # a good template again


def test_a_database_the_user_names_is_left_alone(tmp_path):
    cache = tmp_path / "cache"
    url = f"sqlite+aiosqlite:///{tmp_path / 'mine.db'}"
    start_and_run(tmp_path / "project", cache, PREFECT_SERVER_DATABASE_CONNECTION_URL=url)
    assert rows(tmp_path / "mine.db", "flow_run") == 1
    assert not (tmp_path / "project" / "prefect" / "prefect.db").exists()
    assert not (cache / "ballast").exists()  # no template taken from a user's database


# in a process of its own: start the embedded server, stop it before it answered (a refused command, a Ctrl-C during
# the start); start it in that project again and run a flow; print how the first server ended and the flow's result
STOPPED_EARLY = """
import sys
from flows import runtime
project = sys.argv[1]
runtime.prestart(project)
first = runtime._server
runtime.stop_server()
print("first server:", first.wait(timeout=5))
runtime._server = None
del __import__("os").environ["PREFECT_API_URL"]
runtime.prestart(project)
runtime.wait_until_started()
from prefect import flow

@flow(name="after-an-early-stop")
def check() -> int:
    return 7

print("flow:", check())
second = runtime._server
runtime.stop_server()
print("second server:", second.wait(timeout=30))
"""


def test_a_server_stopped_before_it_answered_is_killed_at_once_and_its_project_starts_again(tmp_path):
    """uvicorn holds a SIGTERM until its start-up ends, so a command refused while its server started waited up to
    10 s at exit; a server that never answered is killed (SIGKILL, status -9), one that served is stopped with
    SIGTERM (its own exit), and a project whose server was killed during its start runs flows the next time (no
    template in the cache: the second server creates the project's database itself)."""
    out = in_own_process(STOPPED_EARLY, tmp_path).stdout
    lines = out.splitlines()
    assert lines[0] == "first server: -9", out
    assert lines[1] == "flow: 7"
    assert lines[2] == "second server: -15", out  # SIGTERM: uvicorn stops, then ends by the signal


# a command's end, in a process of its own: the embedded server, events still queued for it, the command's last line
EVENTS_LEFT_AT_EXIT = """
import sys
from flows import runtime
from flows.cli import quiet_libraries
if sys.argv[2] == "quiet":
    quiet_libraries()  # as `ballast` sets up every command
runtime.prestart(sys.argv[1])
runtime.wait_until_started()
from prefect.events import emit_event
for i in range(500):
    emit_event(event="ballast.check", resource={"prefect.resource.id": f"ballast.check.{i}"})
print("the command's last line", file=sys.stderr)
"""


def test_prefect_events_sent_at_exit_print_nothing_after_the_commands_last_line(tmp_path):
    """A run stopped by a signal ends with the line that says how to continue it; Prefect's events worker, sending
    what is still queued at interpreter exit, logged 'Still processing items: N items remaining...' after it (CI saw
    it under a stopped run's line). With Ballast's logging it says nothing; without, it does (the case is real)."""
    ends = {}
    for logging in ("quiet", "prefect's own"):
        done = in_own_process(EVENTS_LEFT_AT_EXIT, tmp_path, logging.split()[0])
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        ends[logging] = lines[lines.index("the command's last line") :]
    assert ends["quiet"] == ["the command's last line"]
    assert any("Still processing items" in line for line in ends["prefect's own"][1:]), ends["prefect's own"]
