"""Where the model comes from and where it runs, checked without torch: the spec validation's last look before a
command loads anything (`ballast validate`, `run`, `train`), so a model that is not there, or a GPU that is not
there, costs a second and one line instead of a model load, or a Prefect flow's traceback.

Choices:
- Nothing is downloaded on purpose (the CLI sets HF_HUB_OFFLINE=1 unless it is set): a hub name that is not in the
  local Hugging Face cache is refused with the commands that fetch it. With HF_HUB_OFFLINE=0 the load may
  download it, and this check lets it through.
- A directory the spec says how to build (`model.build_if_missing`, `model.gguf_file`) may be missing.
- `model.device: cuda` needs an NVIDIA driver (nvidia-smi or /proc/driver/nvidia) and a torch build that is not
  CPU-only (its version's `+cpu` tag, read from the installed metadata); a ROCm build is trusted.
"""

from __future__ import annotations

import os
import re
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .config import InputError, ModelConfig

HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # 'name' or 'org/name'; anything else is a path


def hf_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def in_hf_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def check_model_source(cfg: ModelConfig) -> None:
    """InputError naming model.name_or_path and the fix when the model can neither be found nor built here."""
    name = cfg.name_or_path
    path = Path(name).expanduser()
    if cfg.build_if_missing is not None or (cfg.gguf_file and not (path / "config.json").is_file()):
        if cfg.gguf_file and cfg.build_if_missing is None and not Path(cfg.gguf_file).expanduser().is_file():
            raise InputError(
                f"model.gguf_file={cfg.gguf_file!r} does not exist, and model.name_or_path={name!r} is not built yet; "
                "point model.gguf_file to a .gguf file"
            )
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError(
                f"model.name_or_path={name!r} is a directory without config.json; point it to a Hugging Face model "
                "directory, or to a new path with model.build_if_missing: tiny-arith"
            )
        return
    if path.exists() or not HUB_ID_RE.fullmatch(name):
        raise InputError(
            f"model.name_or_path={name!r} is not a model directory here (no such directory); point it to a "
            "downloaded model directory, or build the tiny model with model.build_if_missing: tiny-arith"
        )
    if hf_offline() and not in_hf_cache(name):
        raise InputError(
            f"model.name_or_path={name!r} is neither a local directory nor in the local Hugging Face cache, and "
            f"downloads are off (HF_HUB_OFFLINE=1); fetch it once with `hf download {name}` (or run with "
            "HF_HUB_OFFLINE=0 to let the run download it), or point model.name_or_path to a model directory"
        )


def check_device(name: str, field: str = "model.device") -> None:
    """InputError when `name` asks for CUDA on a machine without an NVIDIA driver or with a CPU-only torch."""
    if not name.startswith("cuda"):
        return
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = ""
    if "+rocm" in torch_version:
        return
    if "+cpu" in torch_version:
        raise InputError(
            f"{field}={name!r} but torch {torch_version} is a CPU-only build; set {field}: auto (or cpu), or "
            "install a CUDA build of torch"
        )
    if shutil.which("nvidia-smi") is None and not Path("/proc/driver/nvidia").exists():
        raise InputError(
            f"{field}={name!r} but this machine has no NVIDIA GPU driver (no nvidia-smi, no /proc/driver/nvidia); "
            f"set {field}: auto (or cpu)"
        )


def vllm_python(configured: str | None) -> Path:
    """The python of the separate environment the vLLM server runs from: `rollout.vllm_python`, else the one `ballast
    vllm-env` creates by default (.ballast/vllm-venv here, or in the repository). InputError naming the field and
    `ballast vllm-env` when there is none (checked before a model loads, and again where the server starts)."""
    if configured:
        python = Path(configured).expanduser().absolute()  # not resolve(): a venv's python is a symlink
        if not python.exists():
            raise InputError(
                f"rollout.vllm_python={configured!r} does not exist; create the environment with "
                "`ballast vllm-env` and set rollout.vllm_python to the python it prints"
            )
        return python
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        python = root / ".ballast" / "vllm-venv" / "bin" / "python"
        if python.exists():
            return python.absolute()
    raise InputError(
        "rollout.engine: vllm needs a separate vLLM environment and none was found at .ballast/vllm-venv; create "
        "it with `ballast vllm-env` (or scripts/vllm_env.sh) and/or set rollout.vllm_python, or connect to a running "
        "server with rollout.vllm_url"
    )
