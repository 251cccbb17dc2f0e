"""The offline tiny model: a real Llama checkpoint with a byte-level tokenizer, built and warmed up here.

The quickstart and the tests need a model without a model hub; `build_tiny_arith` makes one, loaded
like any Hugging Face model (`trainer/model.py`). It is built once and shipped as files (SHIPPED,
trainer/assets/tiny-arith/, ~2 MB; `python scripts/build_tiny_model.py` rebuilds it when the recipe changes),
because the warm-up's weights depend on the CPU's float kernels: the tests and the quickstart (`ensure_tiny_arith`
copies it) then run on the same bits on every machine. Choices:

- Tokenizer: byte level. 5 special tokens (`<pad>` `<s>` `</s>` `<|user|>` `<|assistant|>`, ids 0-4)
  then the 256 bytes (id = 5 + byte value), a BPE model with no merges behind a ByteLevel pre-tokenizer
  and decoder, so any text encodes and ASCII decodes back exactly. The chat template adds bos:
  `<s><|user|>23+58<|assistant|>`; an assistant turn ends with `</s>`. Padding is on the left.
- Model: Llama, hidden 128, 2 heads of head_dim 64 (vLLM's CPU attention needs 64), 2 layers, MLP 384,
  256 positions, untied embeddings — about 0.5M parameters, a GRPO step well under a second on CPU.
- Warm-up (see `_warm_up`): the model knows the sums (greedy ~90 % right) but samples wrong digits
  (~35 % right at T=1), so GRPO has something to sharpen. What it reached is written to `ballast_build.json`.
- Deterministic for a seed (same bytes) on the same torch build, thread count and CPU kernels — hence shipped;
  atomic (a temporary sibling directory renamed into place), so a killed build never leaves a half model.

Build it alone: `python -m trainer.tiny /tmp/tiny-arith`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from .data import arith_examples, render_prompt

# ── the tiny model's recipe: every constant of the build, in one place ─────────────────────────────


@dataclass(frozen=True)
class TinyArithRecipe:
    hidden_size: int = 128
    num_attention_heads: int = 2  # head_dim = 128 / 2 = 64
    num_layers: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 256
    # warm-up: the stop below is usually reached after ~550-800 steps (~2 min on 2 idle cores)
    warmup_steps: int = 1500  # the most steps; usually stops earlier, see target_argmax_accuracy
    batch_size: int = 128
    learning_rate: float = 1e-3
    lr_warmup_steps: int = 20  # linear ramp of the learning rate, then constant
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    digit_smoothing: float = 0.3  # share of each answer digit's target spread over the ten digits
    # the stop (see _warm_up): the share of training answers whose every token is the argmax
    # (teacher-forced), averaged over the last `stop_window` steps, reaches target_argmax_accuracy
    target_argmax_accuracy: float = 0.9
    stop_window: int = 5
    data_seed: int = 12345  # warm-up additions; distinct from the data seeds 0 / 1_000_003
    eval_seed: int = 424242  # held-out additions (never in the warm-up) for ballast_build.json
    eval_prompts: int = 64
    eval_samples: int = 4  # T=1 completions per held-out prompt (one draw per prompt is too noisy)
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
BUILD_RECORD = "ballast_build.json"
SHIPPED = Path(__file__).resolve().parent / "assets" / "tiny-arith"  # scripts/build_tiny_model.py writes it


def ensure_tiny_arith(path: str | Path, progress: bool = True) -> None:
    """Put the tiny model at `path` unless one is there: a copy of the shipped one (SHIPPED, the same bits on every
    machine), or a build here when the shipped one is missing or was built by another recipe. A tiny model at `path`
    built by an earlier recipe is used as it is, with a warning that says how to rebuild it."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        if _built_recipe(SHIPPED) == asdict(RECIPE):
            copy_shipped(path)
        else:
            build_tiny_arith(path, progress=progress)
    elif _built_recipe(path) not in (None, asdict(RECIPE)):
        warnings.warn(
            f"the tiny model at {path} was built by an earlier recipe (see its {BUILD_RECORD}); it may not "
            "learn as the quickstart expects — delete the directory and run again to rebuild it",
            stacklevel=3,
        )


def copy_shipped(path: Path) -> Path:
    """Copy the shipped tiny model's files to `path` (atomically, as a build writes it). Returns the path."""
    path = Path(path).expanduser().absolute()
    with atomic_directory(path) as tmp:
        for file in SHIPPED.iterdir():
            shutil.copyfile(file, tmp / file.name)
    return path


def _built_recipe(path: Path) -> dict | None:
    try:
        return json.loads((path / BUILD_RECORD).read_text()).get("recipe")
    except (OSError, ValueError):
        return None


# ── the tokenizer and the model ───────────────────────────────────────────────────────────────────


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (the ByteLevel pre-tokenizer's alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


def _build_tokenizer(max_length: int):
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({char: len(SPECIAL_TOKENS) + byte for byte, char in _bytes_to_unicode().items()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=max_length,
    )


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
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_attention_heads,
        head_dim=recipe.hidden_size // recipe.num_attention_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=False,
        **ids,
    )
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


def _warm_up_stream(recipe: TinyArithRecipe, steps: int, held_out: list) -> list:
    """The warm-up's additions, drawn from recipe.data_seed, none of them a held-out prompt."""
    excluded = {e.prompt for e in held_out}
    drawn = int(steps * recipe.batch_size * 1.1) + recipe.batch_size  # room for the few held-out draws left out
    return [
        e
        for e in arith_examples(drawn, seed=recipe.data_seed, max_digits=recipe.max_digits)
        if e.prompt not in excluded
    ]


def _warm_up_bar(recipe: TinyArithRecipe, progress: bool) -> Progress:
    return Progress(
        TextColumn("[bold]warm-up"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TextColumn(
            f"loss {{task.fields[loss]:.3f}}  argmax right {{task.fields[acc]:.2f}}/{recipe.target_argmax_accuracy:.2f}"
        ),
        TimeElapsedColumn(),
        disable=not progress,
    )


def _warm_up(model, tokenizer, recipe: TinyArithRecipe, steps: int, seed: int, progress: bool, held_out: list) -> dict:
    """Supervised warm-up of all weights, for `steps` or until the teacher-forced argmax answer is right often enough.

    Random weights would never write `<output>..</output>`, and a model that always answers right gives GRPO
    nothing to learn. What RL fine-tuning usually meets in a real base model is in between: the model *knows*
    the answer (greedy decoding gets it) but spreads probability over wrong ones. So: AdamW on all weights,
    seeded, on additions of `recipe.data_seed` (distinct from the training and eval data seeds), loss on the
    answer `<output>{sum}</output></s>` only, with label smoothing on the digits (each digit's target keeps
    1 - digit_smoothing on the right digit and spreads the rest over the ten digits). It stops when, teacher-
    forced, every answer token is the argmax for target_argmax_accuracy of a batch (averaged over stop_window
    steps): learning the carry is a sudden transition whose step depends on the seed, so a fixed step count
    would not do (usually ~550-800 steps, ~2 min on 2 idle cores)."""
    stream = _warm_up_stream(recipe, steps, held_out)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=recipe.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, recipe.lr_warmup_steps))
    )
    digit_ids = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))
    recent: list[float] = []
    result = {"steps": 0, "final_loss": float("nan"), "argmax_accuracy": 0.0}
    bar = _warm_up_bar(recipe, progress)
    model.train()
    with bar:
        task = bar.add_task("warm-up", total=steps, loss=float("nan"), acc=0.0)
        for step in range(1, steps + 1):
            input_ids, attention_mask, labels = _answer_batch(
                tokenizer, stream[(step - 1) * recipe.batch_size : step * recipe.batch_size]
            )
            logprobs, targets, mask = _answer_logits(model, input_ids, attention_mask, labels)
            loss = _warmup_loss(logprobs, targets, mask, digit_ids, recipe.digit_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
            optimizer.step()
            scheduler.step()
            with torch.no_grad():  # every answer token is the argmax, given the right prefix
                right = ((logprobs.argmax(-1) == targets) | ~mask).all(-1).float().mean().item()
            recent = (recent + [right])[-recipe.stop_window :]
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
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=32,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )[:, width:]
    model.train(was_training)
    correct = formatted = 0
    for e, row in zip(examples, out.tolist()):
        stopped = tokenizer.eos_token_id in row
        text = tokenizer.decode(row[: row.index(tokenizer.eos_token_id)] if stopped else row, skip_special_tokens=True)
        match = ANSWER_RE.match(text)
        formatted += bool(match and stopped)
        correct += bool(match and stopped and match.group(1) == e.answer)
    return {"accuracy": correct / len(examples), "format_rate": formatted / len(examples)}


def _held_out(recipe: TinyArithRecipe) -> list:
    """The first `eval_prompts` distinct additions of eval_seed; the warm-up never trains on these."""
    unique = {}
    for e in arith_examples(recipe.eval_prompts * 4, seed=recipe.eval_seed, max_digits=recipe.max_digits):
        unique.setdefault(e.prompt, e)
    return list(unique.values())[: recipe.eval_prompts]


@contextmanager
def hf_progress_bars(enabled: bool):
    """Turn transformers' own progress bars (e.g. "Writing model shards") off inside the block when not enabled."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextmanager
def atomic_directory(path: Path):
    """Yield a temporary sibling of `path`; on success rename it to `path` (unless another process got there
    first with a complete model: then ours is dropped). The temporary directory never outlives the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        try:
            if path.is_dir():
                path.rmdir()  # an empty directory is replaced; rmdir refuses a non-empty one
            os.rename(tmp, path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_tiny_arith(
    path: str | Path, seed: int = 0, warmup_steps: int = RECIPE.warmup_steps, progress: bool = True
) -> Path:
    """Build the tiny Llama + byte tokenizer offline, warm it up on additions, and save it as a Hugging Face
    model directory at `path` (written to a temporary sibling, then renamed into place). Returns the path."""
    recipe = RECIPE
    path = Path(path).expanduser().absolute()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(
            f"cannot build the tiny model at {str(path)!r}: it exists and is not an empty directory; "
            "choose a new path or remove it"
        )
    started = time.perf_counter()
    torch.manual_seed(seed)
    tokenizer = _build_tokenizer(recipe.max_position_embeddings)
    model = _build_model(tokenizer, recipe)
    held_out = _held_out(recipe)
    warm_up = _warm_up(model, tokenizer, recipe, warmup_steps, seed, progress, held_out)
    greedy = _measure(model, tokenizer, held_out, do_sample=False, seed=seed)
    sampled = _measure(model, tokenizer, held_out * recipe.eval_samples, do_sample=True, seed=seed)
    sampled["expected_accuracy"] = round(_expected_accuracy(model, tokenizer, held_out), 4)
    with atomic_directory(path) as tmp:  # another process that built the same model meanwhile keeps its directory
        with hf_progress_bars(progress):
            model.save_pretrained(tmp)
        _save_tokenizer(tokenizer, tmp)
        record = {
            "builder": "ballast tiny-arith",
            "seed": seed,
            "max_warmup_steps": warmup_steps,
            "warmup_steps_done": warm_up["steps"],
            "final_loss": round(warm_up["final_loss"], 4),
            "argmax_accuracy_at_stop": round(warm_up["argmax_accuracy"], 4),
            "recipe": asdict(recipe),
            "parameters": sum(p.numel() for p in model.parameters()),
            "held_out_prompts": len(held_out),
            "greedy": greedy,
            "sampled_t1": {"samples_per_prompt": recipe.eval_samples, **sampled},
            "build_seconds": round(time.perf_counter() - started, 1),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        }
        (tmp / BUILD_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return path


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m trainer.tiny PATH")
    built = build_tiny_arith(sys.argv[1])
    print(json.dumps(json.loads((built / BUILD_RECORD).read_text()), indent=2))
