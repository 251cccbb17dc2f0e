"""Ctrl-C typed in a real terminal: the commands run under a pseudo-terminal (their controlling terminal, their
process group in the foreground), and ^C is written to it, so the kernel's line discipline sends SIGINT to the
whole foreground process group — what a user's terminal does, unlike a signal sent to one process id
(tests/test_signals.py). Servers Ballast starts (the embedded Prefect API, the UIs) live in sessions of their own,
so the keystroke reaches the `ballast` process alone: a run stops at a safe point with one line and its resume
command, and nothing is left running.
"""

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, tiny_spec

CLI = "import sys; from flows.cli import main; sys.exit(main())"
WAIT_S = 600
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")
ANSI_ONLY = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # carriage returns kept: what a line ends up showing


class Terminal:
    """A command running under a pseudo-terminal; `text` is everything it wrote, ANSI codes removed."""

    def __init__(self, *args: str, env: dict | None = None, cwd: Path = REPO):
        environment = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        environment.update(env or {}, TERM="xterm", COLUMNS="120")
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: a session leader whose controlling terminal is the pty
            # started as a shell starts a command: no signal blocked, SIGINT/SIGTERM/SIGQUIT at their defaults
            # (whatever an earlier test left in this worker process does not reach it)
            signal.pthread_sigmask(signal.SIG_SETMASK, [])
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
                signal.signal(sig, signal.SIG_DFL)
            os.chdir(cwd)
            os.execve(sys.executable, [sys.executable, "-c", CLI, *args], environment)
        self.raw, self.status = b"", None

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode(errors="replace"))

    def read_until(self, predicate, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self):
            assert time.monotonic() < deadline, f"timed out; output so far:\n{self.text[-3000:]}"
            if not self._read(0.2):
                assert self.status is None, f"exited early ({self.status}):\n{self.text[-3000:]}"

    def ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")  # the line discipline turns it into SIGINT for the foreground process group

    def wait(self, timeout: float = WAIT_S) -> int:
        deadline = time.monotonic() + timeout
        while self.status is None:
            assert time.monotonic() < deadline, f"still running after {timeout} s:\n{self.text[-3000:]}{self.state()}"
            self._read(0.2)
        return self.status

    def state(self) -> str:
        """What the command and its children are doing (for a failure's message): each one's state, wait channel
        and signal masks."""
        ps = subprocess.run(
            ["ps", "-eo", "pid,ppid,pgid,sid,stat,wchan:24,etimes,args", "--forest"], capture_output=True, text=True
        ).stdout
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError as e:
            status = str(e)
        mine = [x for x in status.splitlines() if x.startswith(("State", "Sig", "Shd"))]
        return "\n--- the command's /proc status:\n" + "\n".join(mine) + "\n--- ps:\n" + ps[-6000:]

    def _read(self, seconds: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], seconds)
        if ready:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                chunk = b""
            self.raw += chunk
            if chunk:
                return True
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid:
            self.status = os.waitstatus_to_exitcode(status)
        return False


def processes_with(needle: str) -> list[int]:
    """Process ids whose command line or environment mentions `needle` (a server of this test's project)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if any(needle.encode() in (entry / part).read_bytes() for part in ("cmdline", "environ")):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def ctrl_c_run(tiny_model, tmp_path_factory):
    """`ballast run` in a terminal, ^C typed once its first step is written (step 2 is held until the signal
    arrives: BALLAST_FAULT=hold-in-step): (exit status, output, project folder, seconds from ^C to exit)."""
    project = tmp_path_factory.mktemp("terminal") / "project"
    spec = project.parent / "spec.yaml"
    sections = dict(optim={"steps": 6}, checkpoint={"every": 3, "keep_last": 5}, probe={"enabled": False})
    spec.write_text(yaml.safe_dump(tiny_spec(tiny_model, name="typed", project_dir=str(project), **sections)))
    term = Terminal("run", str(spec), env={"BALLAST_FAULT": "hold-in-step:2"})
    metrics = project / "runs"
    term.read_until(lambda t: any(p.read_text().strip() for p in metrics.glob("*/metrics.jsonl")))
    pressed = time.monotonic()
    term.ctrl_c()
    code = term.wait()
    return code, term.text, project, time.monotonic() - pressed


def test_ctrl_c_in_a_terminal_stops_ballast_run_at_a_safe_point_with_its_resume_command(ctrl_c_run):
    code, text, project, _ = ctrl_c_run
    run_id = next((project / "runs").iterdir()).name
    assert code == 130, text[-3000:]
    assert re.fullmatch(
        rf"run {run_id} stopped by SIGINT after step 2, checkpoint saved \(.*step-000002\); "
        rf"continue with: ballast run --resume {run_id} --project-dir {project}",
        lines(text)[-1],
    ), text[-3000:]


def test_ctrl_c_in_a_terminal_prints_no_traceback_and_no_connection_error(ctrl_c_run):
    _, text, _, seconds = ctrl_c_run
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert "Unable to connect" not in text and "ConnectError" not in text
    after = text[text.index("SIGINT: finishing this step") :]
    assert len(lines(after)) <= 6, after  # the notice, the bar's last line, the train stage's end, the resume line
    assert seconds < 120  # one step and a checkpoint, not a hang on a dead server


def test_ctrl_c_in_a_terminal_leaves_no_server_of_the_run_behind(ctrl_c_run):
    _, _, project, _ = ctrl_c_run
    deadline = time.monotonic() + 15  # the embedded server is stopped at exit (SIGTERM, then SIGKILL after 10 s)
    while processes_with(str(project / "prefect")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with(str(project / "prefect")) == []


def test_ctrl_c_in_a_terminal_stops_both_uis_with_no_traceback(tmp_path):
    import sqlite3

    from flows.runtime import free_port

    project = tmp_path / "project"
    project.mkdir()
    sqlite3.connect(project / "mlflow.db").close()
    ports = [str(free_port()), str(free_port())]
    term = Terminal("ui", "--project-dir", str(project), "--mlflow-port", ports[0], "--prefect-port", ports[1])
    term.read_until(lambda t: "Ctrl-C stops both." in t.text, timeout=400)
    assert "click 'Model training' at its top left once" in term.text  # MLflow would open on GenAI's Overview
    term.ctrl_c()
    code = term.wait(timeout=60)
    assert code == 0, term.text[-3000:]
    assert "Traceback" not in term.text and "Aborted!" not in term.text
    assert processes_with(str(project)) == []


@pytest.mark.parametrize("flag", ["--mlflow-port", "--prefect-port"])
def test_ballast_ui_refuses_a_port_in_use_with_one_line_naming_the_flag(tmp_path, flag):
    """Another server on a UI's port (another project's `ballast ui`): refused before anything starts, exit 2 —
    never 'ready' with a URL that shows the other server's runs."""
    import socket
    import sqlite3
    import subprocess

    from flows.runtime import free_port

    sqlite3.connect(tmp_path / "mlflow.db").close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--mlflow-port": str(free_port()), "--prefect-port": str(free_port()), flag: str(port)}
        args = ["ui", "--project-dir", str(tmp_path), *[x for item in ports.items() for x in item]]
        done = subprocess.run([sys.executable, "-c", CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert lines(done.stderr) == [
        f"error: {flag} {port}: the port is in use on 127.0.0.1 (Address already in use; another `ballast ui` or "
        f"server?); stop it, or choose a free port with {flag} N"
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mlflow-port", "99999"], "error: ballast ui: argument --mlflow-port: '99999' is not a port; give a number"),
        (["--prefect-port", "0"], "error: ballast ui: argument --prefect-port: '0' is not a port; give a number"),
        (["--host", "nowhere.invalid"], "error: --host nowhere.invalid: not a name or address of this machine ("),
        (["--host", "192.0.2.1"], "error: --host 192.0.2.1: not a name or address of this machine ("),  # TEST-NET-1
    ],
)
def test_ballast_ui_refuses_a_port_or_host_it_cannot_serve_on_with_one_line(tmp_path, args, message):
    """Not a traceback from socket.bind (OverflowError for 99999), nor 'the port is in use' for a host that is not
    this machine's; port 0 would serve on a port nobody is told."""
    import sqlite3

    sqlite3.connect(tmp_path / "mlflow.db").close()
    argv = [sys.executable, "-c", CLI, "ui", "--project-dir", str(tmp_path), *args]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert len(lines(done.stderr)) == 1 and lines(done.stderr)[0].startswith(message), done.stderr


@pytest.mark.parametrize("concurrent", [1, 2])
def test_ctrl_c_in_a_terminal_stops_ballast_sweep_with_one_line_and_no_traceback(tiny_model, tmp_path, concurrent):
    """`ballast sweep` (trials one at a time, or two at once over one base model): ^C while a trial trains stops it
    at a safe point; the terminal shows no traceback — neither Optuna's 'Trial N failed' report of the interrupt
    nor Prefect's 'Crash detected' — and ends with the line that says how to continue."""
    from tests.test_sweep import sweep_file

    project = tmp_path / "project"
    path = sweep_file(tmp_path / "sweep.yaml", tiny_model, project, trials=3, concurrent_trials=concurrent)
    term = Terminal("sweep", str(path), env={"BALLAST_FAULT": "hold-in-step:2"})
    term.read_until(lambda t: any(p.read_text().strip() for p in (project / "runs").glob("*/metrics.jsonl")))
    term.ctrl_c()
    code = term.wait()
    text = term.text
    assert code == 130, text[-3000:]
    for noise in ("Traceback", "KeyboardInterrupt", "failed with parameters", "Crash detected", "ERROR"):
        assert noise not in text, (noise, text[-3000:])
    raw = ANSI_ONLY.sub("", term.raw.decode()).split("\n")  # the pty ends each line with \r\n
    screen = [line.rstrip("\r").split("\r")[-1].strip() for line in raw]
    assert [line for line in screen if line][-1] == (  # a progress line rewritten in place (\r) is gone
        f"sweep interrupted; its finished trials are kept — continue it with: ballast sweep {path}"
    ), text[-3000:]
