"""Reaching an MLflow tracking server over HTTP without waiting minutes on one that is not there.

MLflow's REST client retries a failed request 7 times with a backoff factor of 2 and a 120 s timeout by default:
a server that is down costs over four minutes of urllib3 warnings before any error. `bound_http_waits` sets
MLflow's own variables (MLFLOW_HTTP_REQUEST_TIMEOUT, _MAX_RETRIES, _BACKOFF_FACTOR, read on every request) from
the spec's `tracking.*` fields, and `check_tracking` asks the server's `/health` before a run or a comparison
starts, failing within `tracking.start_timeout_s` with one `TrackingUnavailable` line that names the URI and the
fix. Database URIs (sqlite, postgresql) are opened by SQLAlchemy directly and are not checked here. Standard
library only, so the CLI can check before torch, transformers or MLflow are imported.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request

POLL_S = 1.0  # between /health attempts while the start timeout runs


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking server does not answer; the message says which, and what to do."""


def is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def bound_http_waits(cfg) -> None:
    """MLflow's REST client reads these on every request: a dead server costs seconds, not minutes."""
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(int(cfg.request_timeout_s))  # MLflow reads whole seconds
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(int(cfg.request_retries))
    os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] = str(int(cfg.request_backoff_s))


def check_tracking(uri: str, cfg) -> None:
    """Bound MLflow's HTTP waits and require an http(s) tracking server to answer /health within
    `cfg.start_timeout_s`; TrackingUnavailable otherwise. Other URIs pass unchecked."""
    if not is_http(uri):
        return
    bound_http_waits(cfg)
    url = uri.rstrip("/") + "/health"
    deadline = time.monotonic() + cfg.start_timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=max(0.5, min(cfg.request_timeout_s, deadline - time.monotonic()))):
                return
        except urllib.error.HTTPError as e:
            if e.code < 500:  # something that speaks HTTP answers (e.g. asks for credentials): MLflow decides
                return
            reason = f"HTTP {e.code}"
        except (OSError, ValueError) as e:  # refused, unreachable, timed out, a bad host name
            reason = short_reason(getattr(e, "reason", None) or e)
        if time.monotonic() + POLL_S >= deadline:
            raise TrackingUnavailable(
                f"tracking.uri {uri}: no MLflow server answered {url} within {cfg.start_timeout_s:g} s ({reason}); "
                "start the server (mlflow server --port N ...), or fix tracking.uri"
            )
        time.sleep(POLL_S)


def short_reason(error) -> str:
    """The last line of an error's text (urllib3's are pages long), at most 200 characters."""
    text = str(error).strip()
    return (text.splitlines()[-1] if text else type(error).__name__)[:200]
