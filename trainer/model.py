"""Load the base model, its tokenizer and the LoRA adapter by name or path; build the offline tiny model.

Loading goes through `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` only, so the tiny model
and a real Hugging Face model take the same path. Nothing is ever downloaded on purpose: a name that is
neither a local directory nor in the local Hugging Face cache fails with one line that says how to fix it.

The tiny model (`build_tiny_arith`, for the quickstart and the tests) is a real Llama-architecture
checkpoint, built here without a model hub. Choices:

- Tokenizer: byte level. 5 special tokens (`<pad>` `<s>` `</s>` `<|user|>` `<|assistant|>`, ids 0-4)
  then the 256 bytes (id = 5 + byte value), a `tokenizers` BPE model with no merges behind a ByteLevel
  pre-tokenizer and decoder, so any text encodes and ASCII decodes back exactly. No bos is added by
  `encode`; the chat template adds it: `<s><|user|>23+58<|assistant|>`, and an assistant turn ends with
  `</s>`. Padding is on the left (what batched generation needs).
  `tokenizer_config.json` names `PreTrainedTokenizerFast` and carries the chat template, so a
  transformers 4.x environment (the separate vLLM one) loads it too.
- Model: Llama, hidden 128, 2 heads of head_dim 64 (vLLM's CPU attention needs 64), 2 layers, MLP 384,
  256 positions, untied embeddings — about 0.5M parameters, so a GRPO step takes well under a second on CPU.
- Warm-up: random weights would never produce `<output>..</output>`, and a model that always answers
  right gives GRPO nothing to learn. What RL fine-tuning usually meets in a real base model is in
  between: the model *knows* the answer (greedy decoding gets it) but spreads probability over wrong
  ones, so sampled answers are often wrong; GRPO's first, fast effect is to sharpen that. The build
  makes such a model: it fine-tunes all weights (AdamW, CPU, seeded) on additions from
  `arith_examples(seed=12345)` — a seed distinct from the training (0) and eval (1_000_003) data seeds —
  with the loss on the answer `<output>{sum}</output></s>` only, and with label smoothing on the digits:
  each digit's target keeps 70 % on the right digit and spreads 30 % (`digit_smoothing`) over the ten
  digits. It stops when, teacher-forced, every answer token is the argmax for 90 % of a training batch
  (averaged over 5 steps) — learning the carry is a sudden transition whose step depends on the seed, so
  a fixed step count would not do — usually after ~550-800 steps, ~2 min on 2 idle cores.
  The result answers ~90 % of held-out sums right greedily, ~35 % when sampled at T=1 (digits drawn
  from the smoothed distribution), and keeps the format in ~98 % of samples: GRPO on the quickstart
  raises the sampled reward visibly within a few dozen steps. The result, measured on 64 additions the
  warm-up never saw (greedy; 4 samples each at T=1; and the expected T=1 accuracy), is written to
  `ballast_build.json`.
- Deterministic for a seed (same weights, same bytes), on the same torch build and thread count.
- Atomic: the build writes a temporary sibling directory and renames it into place, so a killed build
  never leaves a half model at the path.

Build it alone: `python -m trainer.model /tmp/tiny-arith`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .config import LoraConfig, ModelConfig
from .data import arith_examples, render_prompt


# ── the tiny model's recipe: every constant of the build, in one place ─────────────────────────────

@dataclass(frozen=True)
class TinyArithRecipe:
    hidden_size: int = 128
    num_attention_heads: int = 2            # head_dim = 128 / 2 = 64
    num_layers: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 256
    # warm-up: the stop below is usually reached after ~550-800 steps (~2 min on 2 idle cores)
    warmup_steps: int = 1500                # the most steps; the warm-up usually stops earlier, see target_argmax_accuracy
    batch_size: int = 128
    learning_rate: float = 1e-3
    lr_warmup_steps: int = 20               # linear ramp of the learning rate, then constant
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    digit_smoothing: float = 0.3            # share of each answer digit's target spread over the ten digits
    # the stop (see the module docstring): the share of training answers whose every token is the argmax
    # (teacher-forced), averaged over the last `stop_window` steps, reaches target_argmax_accuracy
    target_argmax_accuracy: float = 0.9
    stop_window: int = 5
    data_seed: int = 12345                  # warm-up additions; distinct from the data seeds 0 / 1_000_003
    eval_seed: int = 424242                 # held-out additions (never in the warm-up) for ballast_build.json
    eval_prompts: int = 64
    eval_samples: int = 4                   # T=1 completions per held-out prompt (one draw per prompt is too noisy)
    max_digits: int = 2


RECIPE = TinyArithRecipe()
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ANSWER_RE = re.compile(r"^<output>(\d+)</output>$")
HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # 'name' or 'org/name'; anything else is a path
BUILD_RECORD = "ballast_build.json"


# ── devices, tokenizer, policy ─────────────────────────────────────────────────────────────────────

def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda if available, else cpu; anything else is handed to torch.device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"model.device={name!r} is not a device ('auto', 'cpu', 'cuda', 'cuda:0', ...): {e}") from None


def _not_found(name_or_path: str, cause: Exception | None = None) -> ValueError:
    why = f" ({type(cause).__name__}: {str(cause).strip().splitlines()[0][:200]})" if cause and str(cause).strip() else ""
    return ValueError(
        f"model.name_or_path={name_or_path!r} is neither a local directory nor a model in the local Hugging Face "
        "cache (offline: nothing can be downloaded); build the tiny model with model.build_if_missing: tiny-arith "
        f"or point to a downloaded model directory{why}")


def _check_source(name_or_path: str) -> None:
    """Fail fast, with the fix, on a path that cannot be loaded, before from_pretrained tries the hub.
    A hub id is 'name' or 'org/name'; anything else (absolute, ./, ~, deeper) can only be a local path."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model.name_or_path={name_or_path!r} is a directory without config.json; point it to a "
                             "Hugging Face model directory, or to a new path with model.build_if_missing: tiny-arith")
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
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def load_tokenizer(name_or_path: str | Path):
    """AutoTokenizer, padded on the left, with a pad token (eos when the model has none)."""
    from transformers import AutoTokenizer

    name_or_path = str(name_or_path)
    tokenizer = _from_pretrained(AutoTokenizer, name_or_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer of {name_or_path!r} has neither a pad nor an eos token; add one to its tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(model_cfg: ModelConfig, lora_cfg: LoraConfig, adapter_path: str | None = None,
                trainable: bool = True) -> tuple:
    """(model, tokenizer): the base model on its device, wrapped with a new LoRA adapter, or with the one saved
    at `adapter_path`. With lora disabled the whole model is the policy (full fine-tuning).
    `trainable=False` gives a frozen model in eval mode (reference, probe, eval)."""
    from transformers import AutoModelForCausalLM

    name_or_path = ensure_model(model_cfg)
    device = resolve_device(model_cfg.device)
    tokenizer = load_tokenizer(name_or_path)
    model = _from_pretrained(AutoModelForCausalLM, name_or_path, dtype=getattr(torch, model_cfg.dtype),
                             trust_remote_code=model_cfg.trust_remote_code)
    model.to(device)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id

    if adapter_path is not None:
        if not lora_cfg.enabled:
            raise ValueError(f"adapter_path={str(adapter_path)!r} was given but lora.enabled is false; "
                             "enable lora to load an adapter")
        if not (Path(adapter_path) / "adapter_config.json").is_file():
            raise ValueError(f"adapter_path={str(adapter_path)!r} holds no adapter_config.json; point it to a directory "
                             "written by a peft save_pretrained (a checkpoint's adapter/ folder)")
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_path), is_trainable=trainable)
    elif lora_cfg.enabled:
        from peft import LoraConfig as PeftLoraConfig, get_peft_model

        model = get_peft_model(model, PeftLoraConfig(
            r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
            target_modules=list(lora_cfg.target_modules), task_type="CAUSAL_LM"))
    if not trainable:
        model.requires_grad_(False)
    model.train(trainable)
    return model, tokenizer


def ensure_model(cfg: ModelConfig) -> str:
    """cfg.name_or_path, after building the tiny model there when it is missing and build_if_missing asks.
    A tiny model built by an earlier recipe is used as it is, with a warning that says how to rebuild it."""
    path = Path(cfg.name_or_path).expanduser()
    if cfg.build_if_missing == "tiny-arith":
        if not (path / "config.json").is_file():
            build_tiny_arith(path)
        elif _built_recipe(path) not in (None, asdict(RECIPE)):
            import warnings
            warnings.warn(f"the tiny model at {path} was built by an earlier recipe (see its {BUILD_RECORD}); it may not learn "
                          f"as the quickstart expects — delete the directory and run again to rebuild it", stacklevel=2)
    return cfg.name_or_path


def _built_recipe(path: Path) -> dict | None:
    try:
        return json.loads((path / BUILD_RECORD).read_text()).get("recipe")
    except (OSError, ValueError):
        return None


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
        raise ValueError(f"fingerprint has {stored.numel()} logprobs for {len(fingerprint['token_ids'])} tokens; "
                         "expected one per token after the first")
    return float((logprobs - stored).abs().max())


# ── the offline tiny model ─────────────────────────────────────────────────────────────────────────

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (the ByteLevel pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


def _build_tokenizer(max_length: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({char: len(SPECIAL_TOKENS) + byte for byte, char in _bytes_to_unicode().items()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   padding_side="left", chat_template=CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False, model_max_length=max_length)


def _save_tokenizer(tokenizer, directory: Path) -> None:
    """save_pretrained, then a tokenizer_config.json that transformers 4.x reads as well as 5.x."""
    tokenizer.save_pretrained(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("backend", None)
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _build_model(tokenizer, recipe: TinyArithRecipe):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers, num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_attention_heads, head_dim=recipe.hidden_size // recipe.num_attention_heads,
        max_position_embeddings=recipe.max_position_embeddings, tie_word_embeddings=False, **ids)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(**ids)
    return model


def _answer_batch(tokenizer, examples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels) with labels only on the answer and eos."""
    rows = []
    for e in examples:
        prompt = render_prompt(tokenizer, e.prompt)
        target = tokenizer.encode(f"<output>{e.answer}</output>", add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append((prompt + target, [-100] * len(prompt) + target))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    return input_ids, attention_mask, labels


def _answer_logits(model, input_ids, attention_mask, labels):
    """(fp32 log-softmax over the vocabulary at each answer position, targets, answer mask)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    targets, mask = labels[:, 1:].clamp(min=0), labels[:, 1:] != -100
    return torch.log_softmax(logits, -1), targets, mask


def _warmup_loss(logprobs, targets, mask, digit_ids, smoothing: float) -> torch.Tensor:
    """Cross-entropy on the answer tokens; at a digit, the target keeps 1 - smoothing on the right digit
    and spreads `smoothing` evenly over the ten digits."""
    nll = -logprobs.gather(-1, targets[..., None]).squeeze(-1)
    spread = -logprobs[..., digit_ids].mean(-1)
    per_token = torch.where(torch.isin(targets, digit_ids), (1 - smoothing) * nll + smoothing * spread, nll)
    return (per_token * mask).sum() / mask.sum()


@torch.no_grad()
def _expected_accuracy(model, tokenizer, examples) -> float:
    """Mean probability of the whole right answer: the exact accuracy of T=1 sampling, in expectation."""
    logprobs, targets, mask = _answer_logits(model, *_answer_batch(tokenizer, examples))
    token_logprobs = logprobs.gather(-1, targets[..., None]).squeeze(-1) * mask
    return token_logprobs.sum(-1).exp().mean().item()


def _warm_up(model, tokenizer, recipe: TinyArithRecipe, steps: int, seed: int, progress: bool,
             held_out: list) -> dict:
    """Supervised warm-up of all weights, for `steps` or until the teacher-forced argmax answer is right
    often enough (see the module docstring)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    excluded = {e.prompt for e in held_out}
    drawn = int(steps * recipe.batch_size * 1.1) + recipe.batch_size  # room for the few held-out draws left out
    stream = [e for e in arith_examples(drawn, seed=recipe.data_seed, max_digits=recipe.max_digits) if e.prompt not in excluded]
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=recipe.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, recipe.lr_warmup_steps)))
    digit_ids = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))
    recent: list[float] = []
    result = {"steps": 0, "final_loss": float("nan"), "argmax_accuracy": 0.0}
    bar = Progress(TextColumn("[bold]warm-up"), BarColumn(bar_width=20), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]:.3f}  argmax right {task.fields[acc]:.2f}"
                              f"/{recipe.target_argmax_accuracy:.2f}"), TimeElapsedColumn(), disable=not progress)
    model.train()
    with bar:
        task = bar.add_task("warm-up", total=steps, loss=float("nan"), acc=0.0)
        for step in range(1, steps + 1):
            input_ids, attention_mask, labels = _answer_batch(
                tokenizer, stream[(step - 1) * recipe.batch_size:step * recipe.batch_size])
            logprobs, targets, mask = _answer_logits(model, input_ids, attention_mask, labels)
            loss = _warmup_loss(logprobs, targets, mask, digit_ids, recipe.digit_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
            optimizer.step()
            scheduler.step()
            with torch.no_grad():  # every answer token is the argmax, given the right prefix
                right = ((logprobs.argmax(-1) == targets) | ~mask).all(-1).float().mean().item()
            recent = (recent + [right])[-recipe.stop_window:]
            result.update(steps=step, final_loss=loss.item(), argmax_accuracy=sum(recent) / len(recent))
            bar.update(task, advance=1, loss=result["final_loss"], acc=result["argmax_accuracy"])
            if len(recent) == recipe.stop_window and result["argmax_accuracy"] >= recipe.target_argmax_accuracy:
                bar.update(task, total=step)  # reached the target: the bar ends full
                break
    model.eval()
    return result


@torch.no_grad()
def _measure(model, tokenizer, examples, do_sample: bool, seed: int) -> dict:
    """Exact-answer accuracy and format rate (`<output>N</output>` then eos) of generate on `examples`.
    Sampling is pure T=1 (no top-k/top-p) from its own seed, leaving the global RNG as it was."""
    prompts = [render_prompt(tokenizer, e.prompt) for e in examples]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=32,
                             pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, **sampling)[:, width:]
    model.train(was_training)
    correct = formatted = 0
    for e, row in zip(examples, out.tolist()):
        stopped = tokenizer.eos_token_id in row
        text = tokenizer.decode(row[:row.index(tokenizer.eos_token_id)] if stopped else row, skip_special_tokens=True)
        match = ANSWER_RE.match(text)
        formatted += bool(match and stopped)
        correct += bool(match and stopped and match.group(1) == e.answer)
    return {"accuracy": correct / len(examples), "format_rate": formatted / len(examples)}


def _held_out(recipe: TinyArithRecipe) -> list:
    """The first `eval_prompts` distinct additions of eval_seed; the warm-up never trains on these."""
    unique = {}
    for e in arith_examples(recipe.eval_prompts * 4, seed=recipe.eval_seed, max_digits=recipe.max_digits):
        unique.setdefault(e.prompt, e)
    return list(unique.values())[:recipe.eval_prompts]


@contextmanager
def _hf_progress_bars(enabled: bool):
    """Turn transformers' own progress bars (e.g. "Writing model shards") off inside the block when not enabled."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def build_tiny_arith(path: str | Path, seed: int = 0, warmup_steps: int = RECIPE.warmup_steps,
                     progress: bool = True) -> Path:
    """Build the tiny Llama + byte tokenizer offline, warm it up on additions, and save it as a Hugging Face
    model directory at `path` (written to a temporary sibling, then renamed into place). Returns the path."""
    recipe = RECIPE
    path = Path(path).expanduser().absolute()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"cannot build the tiny model at {str(path)!r}: it exists and is not an empty directory; "
                              "choose a new path or remove it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    started = time.perf_counter()
    try:
        torch.manual_seed(seed)
        tokenizer = _build_tokenizer(recipe.max_position_embeddings)
        model = _build_model(tokenizer, recipe)
        held_out = _held_out(recipe)
        warm_up = _warm_up(model, tokenizer, recipe, warmup_steps, seed, progress, held_out)
        greedy = _measure(model, tokenizer, held_out, do_sample=False, seed=seed)
        sampled = _measure(model, tokenizer, held_out * recipe.eval_samples, do_sample=True, seed=seed)
        sampled["expected_accuracy"] = round(_expected_accuracy(model, tokenizer, held_out), 4)

        tmp.mkdir()
        with _hf_progress_bars(progress):
            model.save_pretrained(tmp)
        _save_tokenizer(tokenizer, tmp)
        import transformers

        record = {
            "builder": "ballast tiny-arith", "seed": seed, "max_warmup_steps": warmup_steps, "warmup_steps_done": warm_up["steps"],
            "final_loss": round(warm_up["final_loss"], 4),
            "argmax_accuracy_at_stop": round(warm_up["argmax_accuracy"], 4),
            "recipe": asdict(recipe), "parameters": sum(p.numel() for p in model.parameters()),
            "held_out_prompts": len(held_out), "greedy": greedy,
            "sampled_t1": {"samples_per_prompt": recipe.eval_samples, **sampled},
            "build_seconds": round(time.perf_counter() - started, 1),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        }
        (tmp / BUILD_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        try:
            if path.is_dir():
                path.rmdir()  # an empty directory is replaced; rmdir refuses a non-empty one
            os.rename(tmp, path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
            # another process built the same model meanwhile: keep its directory, drop ours
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m trainer.model PATH")
    built = build_tiny_arith(sys.argv[1])
    print(json.dumps(json.loads((built / BUILD_RECORD).read_text()), indent=2))
