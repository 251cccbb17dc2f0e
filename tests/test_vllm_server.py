"""The vLLM server client's failure reports, against a real HTTP server process this test starts (Python's
http.server, standing in for the vLLM process: what is tested is how `VLLMServer` tells a stopped, a killed
and a refusing server apart, with the request's deadline). The same reports against a real vLLM server, inside
a training step, are in tests/test_vllm.py.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from trainer.engines.vllm_server import (
    ServerNotAnswering,
    ServerRefused,
    ServerTooSlow,
    VLLMServer,
    process_group_members,
)


@pytest.fixture
def http_server(tmp_path):
    """A VLLMServer owning `python -m http.server` in its own process group, serving an empty directory."""
    from trainer.engines.vllm_server import _free_port

    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    server = VLLMServer(f"http://127.0.0.1:{port}", process, tmp_path / "server.log", request_timeout_s=30)
    deadline = time.monotonic() + 30
    while True:
        try:
            server.get("/", timeout_s=1)
            break
        except (ServerNotAnswering, ServerTooSlow):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    yield server
    if process_group_members(process.pid):
        os.killpg(process.pid, signal.SIGCONT)
    server.close()


def test_a_stopped_server_is_too_slow_within_the_deadline_and_named_stopped(http_server):
    os.killpg(http_server.pgid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(ServerTooSlow) as caught:
        http_server.get("/", timeout_s=2)
    assert time.monotonic() - started < 10
    assert str(caught.value) == (
        f"the vLLM server at {http_server.url} gave no answer to / within 2.0 s "
        f"(its process {http_server.pgid} is stopped: SIGSTOP or a debugger)"
    )


def test_a_killed_server_is_not_answering_and_named_killed(http_server):
    os.killpg(http_server.pgid, signal.SIGKILL)
    http_server.process.wait(10)
    with pytest.raises(
        ServerNotAnswering,
        match=rf"is not answering / \(ConnectError: .*\) \(its process "
        rf"{http_server.pgid} killed by SIGKILL\)$",
    ):
        http_server.get("/", timeout_s=2)


def test_an_http_error_is_refused_with_its_status(http_server):
    with pytest.raises(ServerRefused, match="answered /no-such-file with HTTP 404") as caught:
        http_server.get("/no-such-file")
    assert caught.value.status_code == 404


def test_close_ends_the_whole_process_group(http_server):
    pgid = http_server.pgid
    http_server.close()
    assert process_group_members(pgid) == []
    assert http_server.process_state() == "killed by SIGTERM"
