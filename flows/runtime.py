"""Where Prefect runs: an embedded API server under the project folder, unless the user points at a server.

With nothing configured Prefect's state lives in `<project_dir>/prefect` (PREFECT_HOME), served by an API server
that Ballast starts itself — the same uvicorn app Prefect's own ephemeral server runs — rather than letting Prefect
start one as a plain child. The choices, on purpose:

- **Its own session.** A terminal's Ctrl-C goes to the whole foreground process group. Prefect's ephemeral server
  is in that group, so it died with the first Ctrl-C while the run was stopping at a safe point, and the run then
  hung on connection errors. The server Ballast starts is in a session of its own (`start_new_session`): Ctrl-C
  reaches the `ballast` process alone, which stops at a safe point, tells the server, and stops the server when it
  exits (atexit). It dies with its parent too (Linux `PR_SET_PDEATHSIG`), so a killed or closed terminal leaves no
  server behind.
- **Started early, in the background.** The start takes 10-30 s on a 2-core machine; `prestart()` launches it and
  sets PREFECT_API_URL before Prefect is imported, and `wait_until_started()` waits for its health check only when a
  flow is about to run, so the start overlaps the imports of torch, transformers and MLflow and the model build.
- **A new project's database from a template.** A new PREFECT_HOME's database is created by ~100 migrations plus
  the block-type registry: 10-12 s of a 2-core machine's CPU, beside the run's own imports, on every first run in
  a project folder (and every test's). The first server that creates one leaves a copy of it, migrated and empty,
  in the user's cache (`~/.cache/ballast/prefect-<version>.db`, SQLite's backup: one consistent file); a later new
  project starts from a copy of that (4 s). Nothing of a run is in it (it is taken when the server first answers,
  before any flow); a database URL set by the user (PREFECT_API_DATABASE_CONNECTION_URL) is left alone.
- **Quiet.** The server's background services have nothing to do for one process with no deployments or schedules,
  and only take CPU from training (a quickstart step ran 5-10 % slower with them on), so they are off. Its output
  goes to `<PREFECT_HOME>/server.log`, not the terminal: stopped at exit while a request is in flight, the server's
  database pool logs a CancelledError traceback that said nothing to the user and followed a Ctrl-C's one line (a
  start that fails quotes the log's end).

`embedded()` says whether the API is this embedded one (the CLI then prints how to open the UIs on the project's
stores); with PREFECT_API_URL set by the user nothing is started.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

IDLE_EPHEMERAL_SERVICES = (
    "CANCELLATION_CLEANUP",
    "DB_VACUUM",
    "FOREMAN",
    "LATE_RUNS",
    "SCHEDULER",
    "PAUSE_EXPIRATIONS",
    "REPOSSESSOR",
    "CLEANUP_RECONCILER",
    "TRIGGERS",
)
STARTUP_TIMEOUT_S = 180  # 2-core machines start the server slowly
EMBEDDED = "BALLAST_EMBEDDED_PREFECT_API"  # set to PREFECT_API_URL's value when that is the server started here
# A child that dies with its parent: PR_SET_PDEATHSIG (1) with SIGTERM (15), then exec the command. Not a preexec_fn
# (unsafe with threads); where prctl does not exist (macOS) the child simply outlives a killed parent.
DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, 15)\n"
    "except (AttributeError, OSError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(0)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)

_server: subprocess.Popen | None = None
_answered = False  # the embedded server answered its health check: it may hold a flow's state to finish writing
_new_database: Path | None = None  # the embedded server's database when this process's server creates it


def server_log() -> Path:
    """Where the embedded server writes its output: PREFECT_HOME/server.log."""
    return Path(os.environ["PREFECT_HOME"]).expanduser() / "server.log"


def configure(project_dir: str) -> None:
    """Embedded Prefect state under the project folder, unless PREFECT_API_URL points at a server."""
    if "PREFECT_API_URL" not in os.environ:
        home = Path(project_dir).resolve() / "prefect"
        home.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("PREFECT_HOME", str(home))
        for service in IDLE_EPHEMERAL_SERVICES:
            os.environ.setdefault(f"PREFECT_SERVER_SERVICES_{service}_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(STARTUP_TIMEOUT_S))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # a flow run's own lines (flows/view.py) reach Prefect's API, so its UI shows them; the terminal shows only
    # warnings and errors from Prefect, as before (our lines are printed by the view itself)
    for logger in ("FLOW_RUNS", "TASK_RUNS"):
        os.environ.setdefault(f"PREFECT_LOGGING_LOGGERS_PREFECT_{logger}_LEVEL", "INFO")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def prestart(project_dir: str) -> None:
    """Configure, then start the embedded API server in the background (nothing to start with a server URL). Call it
    before anything imports Prefect: PREFECT_API_URL is read when Prefect loads its settings."""
    global _server
    configure(project_dir)
    if os.environ.get("PREFECT_API_URL") or _server is not None:
        return
    _seed_database()
    port = free_port()
    server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    server_log().parent.mkdir(parents=True, exist_ok=True)
    with open(server_log(), "ab") as log:  # the child holds its own copy of the file
        _server = spawn_in_own_session(
            uvicorn_argv(port), env={**os.environ, **server_env}, stdout=log, stderr=subprocess.STDOUT
        )
    atexit.register(stop_server)
    os.environ["PREFECT_API_URL"] = os.environ[EMBEDDED] = f"http://127.0.0.1:{port}/api"


def machine_cache() -> Path:
    """What Ballast keeps per machine rather than per project: ~/.cache/ballast (under XDG_CACHE_HOME when set)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ballast"


def template_database() -> Path:
    """This machine's migrated, empty Prefect database for the installed Prefect (its migrations are per version)."""
    from importlib.metadata import version  # not Prefect itself: it reads its settings when imported

    return machine_cache() / f"prefect-{version('prefect')}.db"


def _seed_database() -> None:
    """A new project's database: a copy of the template when there is one, else the server creates it and
    `wait_until_started` keeps a copy as the template."""
    global _new_database
    if any(os.environ.get(f"PREFECT_{part}_DATABASE_CONNECTION_URL") for part in ("API", "SERVER")):
        return  # the user's database
    database = Path(os.environ["PREFECT_HOME"]) / "prefect.db"
    if database.exists():
        return
    if not copy_database(template_database(), database):
        _new_database = database


def copy_database(source: Path, target: Path) -> bool:
    """Copy a SQLite database through SQLite's backup (consistent while a server writes to it), into a temporary
    file renamed into place; False, copying nothing, when it cannot (no source, a read-only cache, a bad file)."""
    import sqlite3
    from contextlib import closing

    if not source.is_file():
        return False
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with (
            closing(sqlite3.connect(f"file:{source}?mode=ro", uri=True)) as src,
            closing(sqlite3.connect(partial)) as dst,
        ):
            src.backup(dst)
            dst.execute("PRAGMA journal_mode=DELETE")  # one file (Prefect turns WAL on again when it connects)
        os.replace(partial, target)
        return True
    except (OSError, sqlite3.Error):
        partial.unlink(missing_ok=True)
        return False


def uvicorn_argv(port: int) -> list[str]:
    """The command Prefect's own ephemeral server runs (prefect.server.api.server.SubprocessASGIServer)."""
    import importlib.util

    prefect_dir = Path(importlib.util.find_spec("prefect").origin).parent
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        str(prefect_dir.parent),
        "--factory",
        "prefect.server.api.server:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]


def spawn_in_own_session(argv: list[str], **popen) -> subprocess.Popen:
    """A server child that a terminal's Ctrl-C does not reach (its own session) and that dies with this process."""
    wrapped = [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), *argv]
    return subprocess.Popen(wrapped, start_new_session=True, **popen)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def embedded() -> bool:
    """True when Prefect's API is the embedded server under the project folder (none given by the user)."""
    if not os.environ.get(EMBEDDED):
        return False
    api_url = os.environ.get("PREFECT_API_URL")
    if "prefect.settings" in sys.modules:  # the active setting: a test harness or temporary_settings can override env
        api_url = sys.modules["prefect.settings"].PREFECT_API_URL.value()
    return api_url == os.environ[EMBEDDED]


def wait_until_started(timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Wait until the embedded server answers its health check (nothing to wait for with a user's server)."""
    global _answered
    if _server is None:
        return
    url, deadline = os.environ[EMBEDDED] + "/health", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _server.poll() is not None:
            log = server_log()
            said = " ".join(log.read_text(errors="replace").split()[-60:]) if log.exists() else ""
            raise RuntimeError(
                f"the embedded Prefect API server exited with status {_server.returncode} before answering "
                f"(its log, {log}, ends: {said[-600:] or 'empty'}); set PREFECT_API_URL to a running Prefect server "
                f"instead"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    _answered = True
                    _keep_template()
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the embedded Prefect API server did not answer {url} within {timeout:.0f} s")


def _keep_template() -> None:
    """The database this process's server just created — migrated, block types registered, no run yet — kept as the
    machine's template for new projects."""
    global _new_database
    database, _new_database = _new_database, None
    if database is not None:  # no template, or one that could not be copied (it is replaced)
        copy_database(database, template_database())


def stop_server() -> None:
    """Stop the embedded server (at exit): SIGTERM to its session, SIGKILL after 10 s. A server that never answered
    (the command was refused, or stopped, while it started) is killed at once: it has served nothing, and uvicorn
    holds a SIGTERM until its start-up is over — 4 s of an idle 2-core machine, the whole 10 s on a busy one, that
    every refused `ballast run` spent waiting at exit. Its database is the template's copy, or migrations SQLite
    rolls back."""
    global _server
    server, _server = _server, None
    if server is None or server.poll() is not None:
        return
    if _answered:
        stop_sessions([server])
    else:
        _signal_session(server, signal.SIGKILL)
        server.wait()


def stop_sessions(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """Stop servers started by `spawn_in_own_session`: SIGTERM to each one's whole session at once, then SIGKILL to
    whatever still runs after `grace_s` (a server has nothing to save that its SIGTERM would keep)."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal_session(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_session(p, signal.SIGKILL)
            p.wait()


def _signal_session(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)  # its own session: the server and any workers it started
    except ProcessLookupError:
        pass
