"""Load the base model, its tokenizer and the LoRA adapter by name or path, building a missing model first.

Loading goes through `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` only, so the tiny model, a model
converted from GGUF and any Hugging Face model take the same path. Choices:

- Nothing is downloaded on purpose: a name that is neither a local directory nor in the local Hugging Face
  cache fails with one line that says how to fix it. `ensure_model` builds a missing directory from the source
  the spec names (`model.build_if_missing`: the offline tiny model, trainer/tiny.py, or a GGUF shipped in a pip
  package; `model.gguf_file`: any GGUF, trainer/gguf.py), after checking the device, so a wrong device costs
  nothing.
- Special tokens are checked at every load (trainer/special_tokens.py): an assistant turn that would never stop
  is an error, inconsistent bos/eos a warning.
- `model.dtype: auto` is bfloat16 on a CUDA GPU that supports it, float32 elsewhere (CPU bf16 matmuls are slow
  and GRPO's ratios want the precision); attention is `model.attn_implementation` (sdpa by default).
- LoRA targets: `all-linear` is resolved here to the short names of the model's linear layers, output layer
  excluded (peft's rule; for Llama q/k/v/o/gate/up/down_proj), so adapter_config.json lists names that vLLM
  and every peft version read; a listed module the model lacks is refused naming `lora.target_modules`.
- A LoRA adapter over a bf16/fp16 base stays float32 (weights, gradients, Adam state) but its matmuls run in the
  base dtype, under autocast, on the layer inputs the base layers keep anyway (`adapter_in_base_dtype`).
- Gradient checkpointing (non-reentrant) recomputes each decoder layer in the backward pass instead of keeping
  its activations; it only applies to a trainable policy.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.pytorch_utils import Conv1D

from .config import InputError, LoraConfig, ModelConfig
from .data import render_prompt
from .gguf import PACKAGED, convert_gguf, packaged_gguf
from .special_tokens import check_special_tokens
from .tiny import ensure_tiny_arith

HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # 'name' or 'org/name'; anything else is a path


# ── devices and dtypes ─────────────────────────────────────────────────────────────────────────────


def resolve_device(name: str, field: str = "model.device") -> torch.device:
    """'auto' -> cuda if available, else cpu; anything else is handed to torch.device and must exist here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise InputError(f"{field}={name!r} is not a device ('auto', 'cpu', 'cuda', 'cuda:0', ...): {e}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InputError(
                f"{field}={name!r} but this machine has no CUDA GPU that torch {torch.__version__} can "
                f"use; set {field}: auto (or cpu)"
            )
        if device.index is not None and device.index >= count:
            raise InputError(
                f"{field}={name!r} but this machine has {count} CUDA GPU(s) (cuda:0..cuda:{count - 1}); "
                f"set {field} to one of those"
            )
    return device


def resolve_dtype(cfg: ModelConfig) -> str:
    """The torch dtype name model.dtype stands for: 'auto' is bfloat16 on a bf16-capable CUDA device, else float32."""
    if cfg.dtype != "auto":
        return cfg.dtype
    device = resolve_device(cfg.device)
    return "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"


# ── finding the model ──────────────────────────────────────────────────────────────────────────────


def ensure_model(cfg: ModelConfig, progress: bool = True) -> str:
    """cfg.name_or_path, after building it when the directory is missing and the spec says how (see the module
    docstring). The device is checked first, so a wrong one fails before minutes of building."""
    resolve_device(cfg.device)
    path = Path(cfg.name_or_path).expanduser()
    if cfg.build_if_missing == "tiny-arith":
        ensure_tiny_arith(path, progress=progress)
    elif not (path / "config.json").is_file():
        if cfg.build_if_missing in PACKAGED:
            source = PACKAGED[cfg.build_if_missing]
            convert_gguf(
                packaged_gguf(cfg.build_if_missing),
                path,
                progress=progress,
                source={"package": source.package, "version": source.version, "path": source.file},
            )
        elif cfg.gguf_file:
            convert_gguf(cfg.gguf_file, path, progress=progress)
    return cfg.name_or_path


def _not_found(name_or_path: str, cause: Exception | None = None) -> InputError:
    first = str(cause).strip().splitlines()[0][:200] if cause and str(cause).strip() else ""
    why = f" ({type(cause).__name__}: {first})" if first else ""
    return InputError(
        f"model.name_or_path={name_or_path!r} is neither a local directory nor a model in the local Hugging Face "
        "cache (offline: nothing can be downloaded); build the tiny model with model.build_if_missing: tiny-arith "
        f"or point to a downloaded model directory{why}"
    )


def _check_source(name_or_path: str) -> None:
    """Fail fast, with the fix, on a path that cannot be loaded, before from_pretrained tries the hub.
    A hub id is 'name' or 'org/name'; anything else (absolute, ./, ~, deeper) can only be a local path."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError(
                f"model.name_or_path={name_or_path!r} is a directory without config.json; point it to a "
                "Hugging Face model directory, or to a new path with model.build_if_missing: tiny-arith"
            )
        return
    if path.exists() or not HUB_ID_RE.fullmatch(name_or_path):
        raise _not_found(name_or_path)


def _from_pretrained(auto_class, name_or_path: str, **kwargs):
    """auto_class.from_pretrained, with a failure to find or fetch the model turned into the one-line ValueError.
    (Offline, a hub id that is not cached fails inside huggingface_hub with an OSError or a RuntimeError.)"""
    _check_source(name_or_path)
    try:
        return auto_class.from_pretrained(name_or_path, **kwargs)
    except (OSError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and (Path(name_or_path).expanduser().is_dir() or _in_hf_cache(name_or_path)):
            raise  # the model is here; this is a real loading error, not a missing model
        raise _not_found(name_or_path, None if Path(name_or_path).expanduser().is_dir() else e) from None


def _in_hf_cache(repo_id: str) -> bool:
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


# ── tokenizer and policy ───────────────────────────────────────────────────────────────────────────


def load_tokenizer(name_or_path: str | Path):
    """AutoTokenizer, padded on the left, with a pad token (eos when the model has none)."""
    name_or_path = str(name_or_path)
    tokenizer = _from_pretrained(AutoTokenizer, name_or_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"the tokenizer of {name_or_path!r} has neither a pad nor an eos token; "
                "add one to its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base_model(model_cfg: ModelConfig, name_or_path: str | None = None):
    """The model at name_or_path (default model_cfg's), in model.dtype with model.attn_implementation, on CPU."""
    name_or_path = name_or_path or model_cfg.name_or_path
    try:
        return _from_pretrained(
            AutoModelForCausalLM,
            name_or_path,
            dtype=getattr(torch, resolve_dtype(model_cfg)),
            attn_implementation=model_cfg.attn_implementation,
            trust_remote_code=model_cfg.trust_remote_code,
        )
    except (ImportError, ValueError) as e:
        if "attn_implementation" not in str(e) and "Attention" not in str(e):
            raise
        first = str(e).strip().splitlines()[0][:200]
        raise InputError(
            f"model.attn_implementation={model_cfg.attn_implementation!r} cannot be used here ({first}); "
            "use sdpa (the default) or eager"
        ) from None


def load_policy(
    model_cfg: ModelConfig, lora_cfg: LoraConfig, adapter_path: str | None = None, trainable: bool = True
) -> tuple:
    """(model, tokenizer): the base model on its device, wrapped with a new LoRA adapter, or with the one saved
    at `adapter_path`. With lora disabled the whole model is the policy (full fine-tuning).
    `trainable=False` gives a frozen model in eval mode (reference, probe, eval)."""
    device = resolve_device(model_cfg.device)
    if adapter_path is not None and not lora_cfg.enabled:
        raise ValueError(
            f"adapter_path={str(adapter_path)!r} was given but lora.enabled is false; enable lora to load an adapter"
        )
    if adapter_path is not None and not (Path(adapter_path) / "adapter_config.json").is_file():
        raise ValueError(
            f"adapter_path={str(adapter_path)!r} holds no adapter_config.json; point it to a directory "
            "written by a peft save_pretrained (a checkpoint's adapter/ folder)"
        )
    if model_cfg.torch_threads:
        torch.set_num_threads(model_cfg.torch_threads)
    name_or_path = ensure_model(model_cfg)
    tokenizer = load_tokenizer(name_or_path)
    model = load_base_model(model_cfg, name_or_path)
    check_special_tokens(tokenizer, model.get_input_embeddings().weight.shape[0], model.generation_config, name_or_path)
    model.to(device)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if trainable and model_cfg.gradient_checkpointing is True:  # "auto": settled by the trainer (trainer/perf.py)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, str(adapter_path), is_trainable=trainable)
    elif lora_cfg.enabled:
        model = get_peft_model(model, peft_lora_config(lora_cfg, lora_target_modules(model, lora_cfg.target_modules)))
    adapter_in_base_dtype(model, device)
    if not trainable:
        model.requires_grad_(False)
    model.train(trainable)
    return model, tokenizer


def peft_lora_config(lora_cfg: LoraConfig, target_modules: list[str]) -> PeftLoraConfig:
    """The peft LoraConfig of a `lora` section, its target modules resolved (lora_target_modules)."""
    return PeftLoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=target_modules,
        task_type="CAUSAL_LM",
    )


def adapter_parameters(model, adapter: str) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of the LoRA adapter named `adapter`, in the model's order: what a lone run with that adapter
    trains (its requires_grad parameters), whatever other adapters the model holds."""
    return [(n, p) for n, p in model.named_parameters() if ".lora_" in n and f".{adapter}." in n]


def adapter_in_base_dtype(model, device: torch.device) -> bool:
    """Run a float32 LoRA adapter's matmuls in its bf16/fp16 base model's dtype; True when it applies.

    peft keeps an adapter over a half-precision base in float32 (its weights, gradients and Adam state keep full
    precision, which small learning rates need), and then casts every adapted layer's input to float32, a copy
    the backward keeps: a 0.5B Llama's GRPO step on an H100 peaked at 44.9 GiB against TRL's 28.6 and its update
    took 0.62 s against 0.34 (bench/README.md). Here the decoder's forward runs under
    autocast to the base dtype instead: the adapter's weights stay float32, its matmuls and the activations
    they keep are in the base dtype, as vLLM computes them too; peft's input cast is turned off in the decoder, so
    an adapted layer's input is the very tensor its base layer keeps, not a copy per adapter. The base model's own
    layers are already in that dtype; RMSNorm and rotary embeddings upcast themselves as before. An adapter outside
    the decoder (on lm_head) keeps peft's casts."""
    base = model.get_input_embeddings().weight.dtype
    adapter = [p for name, p in model.named_parameters() if "lora_" in name]
    if base not in (torch.bfloat16, torch.float16) or not any(p.dtype == torch.float32 for p in adapter):
        return False
    decoder = model.get_decoder()
    for module in decoder.modules():  # the layer input stays in the base dtype, shared with the base layer's
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False
    decoder.forward = torch.autocast(device.type, dtype=base)(decoder.forward)
    return True


def lora_target_modules(model, target_modules: str | list[str]) -> list[str]:
    """The module names LoRA wraps: 'all-linear' -> the short names of every linear layer but the output layer;
    a list is checked against the model's modules (peft matches a name or a dotted suffix of one)."""
    head = model.get_output_embeddings()
    linear = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not head
        }
    )
    if target_modules == "all-linear":
        return linear
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise InputError(
            f"lora.target_modules: {', '.join(map(repr, missing))} not in this "
            f"{type(model).__name__}; its linear layers are {', '.join(linear)} — list some of those, "
            "or use all-linear"
        )
    return list(target_modules)


# ── identity and fingerprint: telling a wrong base model or a changed adapter ──────────────────────


def _sha16(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def model_identity(model_cfg: ModelConfig) -> dict:
    """name_or_path and, for a local directory, the sha256 (first 16 hex) of config.json and of each weights file."""
    identity = {"name_or_path": model_cfg.name_or_path}
    path = Path(model_cfg.name_or_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            identity["config_sha256"] = _sha16(path / "config.json")
        weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
        identity["weights_sha256"] = {p.name: _sha16(p) for p in weights}
    return identity


def _fingerprint_ids(tokenizer, length: int) -> list[int]:
    """render_prompt("12+34") + "<output>46</output>" + eos, repeated to fill `length` tokens."""
    base = render_prompt(tokenizer, "12+34") + tokenizer.encode("<output>46</output>", add_special_tokens=False)
    if tokenizer.eos_token_id is not None:
        base.append(tokenizer.eos_token_id)
    return (base * (length // len(base) + 1))[:length]


@torch.no_grad()
def _teacher_forced_logprobs(model, token_ids: list[int], device) -> torch.Tensor:
    """logprob of token t+1 given tokens ..t, for every position after the first (eval mode, no grad)."""
    was_training = model.training
    model.eval()
    try:
        input_ids = torch.tensor([token_ids], device=device)
        logprobs = torch.log_softmax(model(input_ids=input_ids).logits.float(), dim=-1)
        return logprobs[0, :-1].gather(-1, input_ids[0, 1:, None]).squeeze(-1).cpu()
    finally:
        model.train(was_training)


def logprob_fingerprint(model, tokenizer, device, length: int = 32) -> dict:
    """A fixed token sequence teacher-forced through the model: {"token_ids", "logprobs" (length - 1, 6 decimals)}."""
    if length < 2:
        raise ValueError(f"length={length} is too short for a fingerprint; use 2 or more tokens")
    token_ids = _fingerprint_ids(tokenizer, length)
    logprobs = _teacher_forced_logprobs(model, token_ids, device)
    return {"token_ids": token_ids, "logprobs": [round(float(x), 6) for x in logprobs]}


def compare_fingerprint(model, tokenizer, device, fingerprint: dict) -> float:
    """Max |logprob difference| between this model and a stored fingerprint, on the stored token_ids."""
    logprobs = _teacher_forced_logprobs(model, list(fingerprint["token_ids"]), device)
    stored = torch.tensor(fingerprint["logprobs"], dtype=torch.float32)
    if stored.shape != logprobs.shape:
        raise ValueError(
            f"fingerprint has {stored.numel()} logprobs for {len(fingerprint['token_ids'])} tokens; "
            "expected one per token after the first"
        )
    return float((logprobs - stored).abs().max())
