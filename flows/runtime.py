"""Where Prefect runs: an embedded, ephemeral API under the project folder, unless the user points at a server.

With nothing configured Prefect's state lives in `<project_dir>/prefect` (PREFECT_HOME) and its local API server
starts with the first flow. That start takes 10-30 s on a 2-core machine, so `prestart()` asks for a client in
a background thread (Prefect's public `get_client`, which starts the ephemeral server when no PREFECT_API_URL is
set): the start then overlaps the imports of torch, transformers and MLflow and the model build. The server's
background services have nothing to do for one process with no deployments or schedules, and only take CPU
from training (a quickstart step ran 5-10 % slower with them on), so they are off in embedded mode.
"""

from __future__ import annotations

import os
import threading
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
STARTUP_TIMEOUT_S = "180"  # 2-core machines start the ephemeral server slowly

_started: threading.Thread | None = None


def configure(project_dir: str) -> None:
    """Embedded Prefect state under the project folder, unless PREFECT_API_URL points at a server."""
    if "PREFECT_API_URL" not in os.environ:
        home = Path(project_dir).resolve() / "prefect"
        home.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("PREFECT_HOME", str(home))
        for service in IDLE_EPHEMERAL_SERVICES:
            os.environ.setdefault(f"PREFECT_SERVER_SERVICES_{service}_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", STARTUP_TIMEOUT_S)
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # a flow run's own lines (flows/view.py) reach Prefect's API, so its UI shows them; the terminal shows only
    # warnings and errors from Prefect, as before (our lines are printed by the view itself)
    for logger in ("FLOW_RUNS", "TASK_RUNS"):
        os.environ.setdefault(f"PREFECT_LOGGING_LOGGERS_PREFECT_{logger}_LEVEL", "INFO")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def prestart(project_dir: str) -> None:
    """Configure, then start the ephemeral API server in the background (nothing to start with a server URL)."""
    global _started
    configure(project_dir)
    if os.environ.get("PREFECT_API_URL") or _started is not None:
        return

    def start() -> None:
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                client.api_healthcheck()
        except Exception:
            pass  # the flow call starts it again and reports what went wrong

    _started = threading.Thread(target=start, name="prefect-ephemeral-start", daemon=True)
    _started.start()


def wait_until_started() -> None:
    if _started is not None:
        _started.join()
