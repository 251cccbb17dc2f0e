"""Prompt datasets, how a prompt becomes the model's input, and the seeded, resumable sampler.

A dataset is a list of `Example(prompt, answer, columns)`. `render_prompt` is the one function that turns an
example's prompt into token ids — rollouts, in-training eval, the final eval and the probe all call it —
through the tokenizer's chat template: an optional system message (`data.system_prompt`), then the user
message, which is `data.prompt_template` with the prompt in place of `{prompt}` (or the prompt alone).
With neither set the rendering is a single user message, exactly what the quickstart was built on. A prompt
may also be a whole conversation (chat messages ending with a user turn), rendered as it is.

Built-in sources (`data.source`), all generated offline from `data.seed`:

    arith          bare sums "23+58", answered "81" — the quickstart's tiny model answers in <output> tags
    sums           "23 + 58" for a chat model, with a template such as "What is {prompt}?"
    word_problems  short everyday word problems with one or two steps ("Sam has 23 stickers and buys 15
                   more. ...") and a whole-number answer, for chat models and numeric_answer

or rows from a file: a `.jsonl` file (one JSON object per line), a `.parquet` file, or a directory a Hugging
Face `datasets` `save_to_disk` wrote (a Dataset, or a DatasetDict whose `data.split` is read). A row holds

    prompt     the user's message (a string), or a conversation: a list of {"role", "content"} messages
    messages   instead of `prompt`: a conversation; a last assistant message is the answer (TRL's chat rows)
    answer     the answer (a string or a number), or a list of accepted answers (any one of them is right)
    any other  columns, passed to reward functions as keyword arguments of the same name, one value per
               completion (as TRL passes a dataset's columns); a function receives the columns it names as
               parameters, or all of them when it takes **kwargs

A relative file path is looked up in the spec's folder, then in the working directory (`locate_data_file`).
A held-out eval set comes from the same generator with another seed, never overlapping the training prompts;
for a file source it is `data.eval_path` (a saved DatasetDict: its `data.eval_split`). `check_data` reads and
checks all of it without touching torch, so a bad file fails the spec in milliseconds with `file:line` and the
fix.

The sampler walks a seeded permutation of the dataset, one epoch after another (a new permutation per
epoch, derived from seed and epoch number); its whole state is `epoch` and `position`, saved in each
checkpoint, so a resumed run sees exactly the prompts an uninterrupted run would.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .config import DataConfig

EVAL_SEED_OFFSET = 1_000_003  # built-in sources draw their held-out set from seed + this


@dataclass(frozen=True)
class Example:
    prompt: str | list  # the user's message, or a conversation: {"role", "content"} messages ending with a user turn
    answer: str | list  # the answer as text, or the accepted answers (a list of texts)
    columns: dict = field(default_factory=dict)  # the row's other columns: reward functions get them by name


# ---------------------------------------------------------------------------------------------
# Built-in sources: (n, seed, max_digits) -> examples


def arith_examples(n: int, seed: int, max_digits: int = 2) -> list[Example]:
    rng = random.Random(seed)
    hi = 10**max_digits - 1
    return [Example(f"{a}+{b}", str(a + b)) for a, b in ((rng.randint(0, hi), rng.randint(0, hi)) for _ in range(n))]


def sum_examples(n: int, seed: int, max_digits: int = 2) -> list[Example]:
    """'a + b' with both operands of max_digits digits (10..99 for 2): a chat model's arithmetic."""
    rng = random.Random(seed)
    lo, hi = 10 ** (max_digits - 1), 10**max_digits - 1
    pairs = ((rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(n))
    return [Example(f"{a} + {b}", str(a + b)) for a, b in pairs]


NAMES = ("Sam", "Mia", "Leo", "Ava", "Noah", "Emma", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Tom", "Nina", "Ben")
THINGS = ("apples", "stickers", "marbles", "books", "pencils", "cookies", "stamps", "shells", "cards", "coins")

# (template, answer) pairs over operands a, b, c; `c` is drawn below a + b so answers stay positive.
WORD_PROBLEMS: tuple[tuple[str, Callable[[int, int, int], int]], ...] = (
    ("{n} has {a} {t}. {n} buys {b} more. How many {t} does {n} have now?", lambda a, b, c: a + b),
    ("{n} had {a} {t} and got {b} more from a friend. How many {t} does {n} have?", lambda a, b, c: a + b),
    ("A box holds {a} {t}. Another box holds {b} {t}. How many {t} are there in both boxes?", lambda a, b, c: a + b),
    (
        "{n} has {a} {t} and buys {b} more, then gives {c} away. How many {t} does {n} have left?",
        lambda a, b, c: a + b - c,
    ),
    (
        "There are {a} {t} on a shelf. {n} puts {b} more on it and takes {c} off. How many {t} are on the shelf now?",
        lambda a, b, c: a + b - c,
    ),
)


def word_problem_examples(n: int, seed: int, max_digits: int = 2) -> list[Example]:
    """One- and two-step addition/subtraction stories with max_digits-digit amounts and whole answers."""
    rng = random.Random(seed)
    lo, hi = 10 ** (max_digits - 1), 10**max_digits - 1
    out = []
    for _ in range(n):
        template, answer = WORD_PROBLEMS[rng.randrange(len(WORD_PROBLEMS))]
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        c = rng.randint(1, min(hi, a + b - 1))
        prompt = template.format(n=rng.choice(NAMES), t=rng.choice(THINGS), a=a, b=b, c=c)
        out.append(Example(prompt, str(answer(a, b, c))))
    return out


SOURCES: dict[str, Callable[[int, int, int], list[Example]]] = {
    "arith": arith_examples,
    "sums": sum_examples,
    "word_problems": word_problem_examples,
}


# ---------------------------------------------------------------------------------------------
# Files


# Names a column cannot have: rewards receive these from Ballast itself. ('completions' in a row is the offline
# engine's trajectory, read by trainer/engines/offline.py, and is not a column.)
RESERVED_COLUMNS = ("answers", "prompts", "group_size")
ROW_EXAMPLE = '{"prompt": "...", "answer": "..."}'
KINDS = "a .jsonl or .parquet file, or a directory written by a datasets save_to_disk"


def locate_data_file(value: str, field: str, spec_dir: str | Path | None) -> str:
    """The path a data field names: absolute as given; a relative one in the spec's folder, else in the working
    directory (as 'module:function' rewards are found). A .jsonl or .parquet name found in neither: FileNotFoundError
    naming both places."""
    path = Path(value).expanduser()
    if path.is_absolute() or spec_dir is None:
        return str(path)
    for folder in (Path(spec_dir), Path.cwd()):
        if (folder / path).exists():
            return str((folder / path).resolve())
    if not value.endswith((".jsonl", ".parquet")):
        return value  # not a file's name either: load_datasets says what data.source may be
    raise FileNotFoundError(
        f"{field}: data file {value!r} is neither in the spec's folder ({Path(spec_dir).resolve()}) nor in the working "
        f"directory ({Path.cwd()}); give {KINDS} (relative to the spec's folder), or a built-in source "
        f"({', '.join(SOURCES)})"
    )


def _conversation(value, where: str, what: str) -> list[dict]:
    """A list of chat messages ({"role": str, "content": str, ...}), checked; refused naming the row otherwise."""
    shape = 'a list of chat messages like [{"role": "user", "content": "..."}]'
    if not isinstance(value, list) or not value:
        kind = "an empty list" if value == [] else f"a {type(value).__name__}"
        raise ValueError(f"{where}: '{what}' is {kind}; give the user's message as a string, or {shape}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(
                f"{where}: '{what}'[{i}] is {json.dumps(m, default=str)[:80]}, not a message with a string 'role' and "
                f"'content'; give {shape}"
            )
    return [dict(m) for m in value]


def _answer(value, where: str) -> str | list[str]:
    if value is None:
        return ""
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{where}: 'answer' is an empty list; give the accepted answers, or leave 'answer' out")
        return [_answer_text(v, f"{where}: 'answer'[{i}]") for i, v in enumerate(value)]
    return _answer_text(value, f"{where}: 'answer'")


def _answer_text(value, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Real)):
        raise ValueError(f"{what} is a {type(value).__name__}; give a string or a number (or a list of them)")
    return str(value)


def example_of(row, where: str) -> Example:
    """One row (a mapping: prompt or messages, answer, other columns) as an Example; refused naming `where`."""
    if not isinstance(row, dict):
        raise ValueError(
            f"{where} is a JSON {type(row).__name__}, not an object; each row must be one object like {ROW_EXAMPLE}"
        )
    if ("prompt" in row) == ("messages" in row):
        has = ", ".join(sorted(row)) or "none"
        raise ValueError(
            f"{where} has both 'prompt' and 'messages'; keep one"
            if "prompt" in row
            else f"{where} has no 'prompt' field (it has {has}); add the user's message as 'prompt' (or the "
            "conversation as 'messages')"
        )
    what = "prompt" if "prompt" in row else "messages"
    prompt, answer = row[what], row.get("answer")
    if isinstance(prompt, list):
        prompt = _conversation(prompt, where, what)
        if prompt[-1]["role"] == "assistant":  # a chat row with its reference answer: the answer, not the prompt
            if answer is not None:
                raise ValueError(
                    f"{where}: '{what}' ends with an assistant message and the row has an 'answer' too; keep one"
                )
            answer, prompt = prompt[-1]["content"], prompt[:-1]
        if not prompt or prompt[-1]["role"] != "user":
            raise ValueError(
                f"{where}: '{what}' must end with a user message (the turn the model answers), or a user message "
                "then the assistant's reference answer"
            )
    elif not isinstance(prompt, str):
        raise ValueError(
            f"{where}: '{what}' is a {type(prompt).__name__}; give the user's message as a string, or a list of "
            'chat messages like [{"role": "user", "content": "..."}]'
        )
    columns = {k: v for k, v in row.items() if k not in ("prompt", "messages", "answer", "completions")}
    reserved = [k for k in columns if k in RESERVED_COLUMNS or not isinstance(k, str)]
    if reserved:
        raise ValueError(
            f"{where}: a column may not be named {reserved[0]!r} (reward functions get '{reserved[0]}' from Ballast); "
            "rename the column"
        )
    return Example(prompt, _answer(answer, where), columns)


def _examples(rows: Iterable[tuple[str, object]], path: Path, field: str) -> list[Example]:
    """Examples of (where, row) pairs; a column some rows lack is None in those rows (as `datasets` reads it)."""
    examples = [example_of(row, where) for where, row in rows]
    if not examples:
        raise ValueError(f"{field}: {path} holds no examples; add rows like {ROW_EXAMPLE}")
    names = list(dict.fromkeys(k for e in examples for k in e.columns))
    if any(len(e.columns) != len(names) for e in examples):
        examples = [Example(e.prompt, e.answer, {k: e.columns.get(k) for k in names}) for e in examples]
    return examples


def jsonl_rows(path: Path, shape: str) -> Iterator[tuple[str, object]]:
    """("file:line", parsed JSON) for each non-blank line of a .jsonl file; a line that is not JSON fails with
    file:line and `shape`, what each line must be."""
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno} is not JSON ({e}); each line must be {shape}") from None
        yield f"{path}:{lineno}", row


def read_jsonl(path: str | Path, field: str = "data.source") -> list[Example]:
    """Examples of a .jsonl file; a line that is not a row (see the module docstring) fails with file:line."""
    path = _existing(path, field)
    return _examples(jsonl_rows(path, f"one object like {ROW_EXAMPLE}"), path, field)


def read_parquet(path: str | Path, field: str = "data.source") -> list[Example]:
    """Examples of a .parquet file (read with pyarrow, as `datasets` reads it); a bad row fails with file row N."""
    import pyarrow.parquet as pq

    path = _existing(path, field)
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's ArrowInvalid and OSError for a file that is not Parquet
        raise ValueError(f"{field}: {path} is not a Parquet file ({type(e).__name__}: {e}); give {KINDS}") from None
    return _examples(((f"{path} row {i}", row) for i, row in enumerate(table.to_pylist())), path, field)


def read_saved_dataset(path: str | Path, field: str = "data.source", split: str = "train") -> list[Example]:
    """Examples of a directory a Hugging Face `datasets` save_to_disk wrote: a Dataset, or a DatasetDict's `split`."""
    path = _existing(path, field)
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{field}: {path} is a directory; reading a saved dataset needs `pip install datasets`"
        ) from None
    try:
        saved = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise ValueError(
            f"{field}: {path} is a directory that datasets' save_to_disk did not write ({e}); give {KINDS}"
        ) from None
    split_field = "data.eval_split" if field == "data.eval_path" else "data.split"
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise ValueError(
                f"{split_field}={split!r}: the DatasetDict at {path} has the splits {', '.join(saved)}; name one"
            )
        saved, path = saved[split], Path(f"{path}[{split}]")
    return _examples(((f"{path} row {i}", row) for i, row in enumerate(saved)), path, field)


def _existing(path: str | Path, field: str) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"{field}: data file {path} does not exist; give {KINDS}, or a built-in source ({', '.join(SOURCES)})"
        )
    return path


def read_examples(path: str | Path, field: str = "data.source", split: str = "train") -> list[Example]:
    """The examples of a data file or saved dataset directory, by its kind."""
    p = Path(path).expanduser()
    if p.is_dir():
        return read_saved_dataset(p, field, split)
    if p.suffix == ".parquet":
        return read_parquet(p, field)
    if p.suffix == ".jsonl" or not p.exists():
        return read_jsonl(p, field)
    raise ValueError(f"{field}={str(path)!r} is neither a built-in source ({', '.join(SOURCES)}) nor {KINDS}")


def is_file_source(source: str) -> bool:
    return source.endswith((".jsonl", ".parquet")) or Path(source).expanduser().is_dir()


def load_datasets(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples. The eval set is data.eval_path when it is given (with a built-in source too: it was
    ignored there); else a built-in source's is drawn with another seed and never overlaps the training prompts, and
    a file source has none."""
    if cfg.source in SOURCES:
        make = SOURCES[cfg.source]
        train = make(cfg.num_prompts, cfg.seed, cfg.max_digits)
        if cfg.eval_path:
            return train, read_examples(cfg.eval_path, "data.eval_path", cfg.eval_split)
        seen = {e.prompt for e in train}
        pool = make(cfg.num_eval_prompts * 4 + 64, cfg.seed + EVAL_SEED_OFFSET, cfg.max_digits)
        held_out = [e for e in pool if e.prompt not in seen][: cfg.num_eval_prompts]
        distinct = len({e.prompt for e in pool if e.prompt not in seen})
        if distinct < cfg.num_eval_prompts:
            raise ValueError(
                f"data.num_eval_prompts={cfg.num_eval_prompts}: source {cfg.source!r} with data.max_digits="
                f"{cfg.max_digits} makes only {distinct} distinct held-out prompts that are not training "
                "prompts; lower data.num_eval_prompts or data.num_prompts, or raise data.max_digits"
            )
        return train, held_out
    if not is_file_source(cfg.source):
        raise ValueError(f"data.source={cfg.source!r} is neither a built-in source ({', '.join(SOURCES)}) nor {KINDS}")
    train = read_examples(cfg.source, "data.source", cfg.split)
    held_out = read_examples(cfg.eval_path, "data.eval_path", cfg.eval_split) if cfg.eval_path else []
    if cfg.system_prompt is not None or cfg.prompt_template is not None:
        _check_conversations_render(train + held_out, cfg)
    return train, held_out


def _check_conversations_render(examples: list[Example], cfg: DataConfig) -> None:
    """A conversation is rendered as it is: data.prompt_template cannot apply to it, and data.system_prompt only
    where it has no system message of its own."""
    conversation = next((e for e in examples if isinstance(e.prompt, list)), None)
    if conversation is None:
        return
    if cfg.prompt_template is not None:
        raise ValueError(
            "data.prompt_template applies to string prompts, and the data holds conversations (chat messages); "
            "write the template into the rows' user messages, or leave data.prompt_template unset"
        )
    if any(m["role"] == "system" for e in examples if isinstance(e.prompt, list) for m in e.prompt):
        raise ValueError(
            "data.system_prompt is set and rows of the data have a system message of their own; leave "
            "data.system_prompt unset, or take the system messages out of the rows"
        )


def check_data(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """Read and check the data section's sources (no torch): (train, eval), or a ValueError / FileNotFoundError
    naming the file and line. The spec validation calls it, so bad data fails before a model loads."""
    return load_datasets(cfg)


def reward_columns(examples: list[Example], repeat: int = 1) -> dict[str, list]:
    """The rows' columns as reward keyword arguments: {column: one value per completion}, each row's value repeated
    `repeat` times (its group of completions)."""
    names = list(dict.fromkeys(k for e in examples for k in e.columns))
    return {k: [e.columns.get(k) for e in examples for _ in range(repeat)] for k in names}


def data_fingerprint(examples: list[Example]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.prompt, e.answer] + ([e.columns] if e.columns else []), default=str).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Rendering


def chat_messages(prompt: str | list, data: DataConfig | None = None) -> list[dict]:
    """The chat messages of one prompt: data.system_prompt (if set), then the user message
    (data.prompt_template with the prompt in place of {prompt}, or the prompt alone). A conversation is taken as
    it is, after data.system_prompt when it has no system message (check_data refuses the other combinations)."""
    system = data.system_prompt if data is not None else None
    if isinstance(prompt, list):
        has_system = any(m.get("role") == "system" for m in prompt)
        return ([{"role": "system", "content": system}] if system is not None and not has_system else []) + [
            dict(m) for m in prompt
        ]
    template = data.prompt_template if data is not None else None
    user = prompt if template is None else template.format(prompt=prompt)
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": user}]


def render_prompt(tokenizer, prompt: str | list, data: DataConfig | None = None) -> list[int]:
    """Token ids of the chat-formatted prompt (a string, or a conversation), ending where the assistant's answer
    starts. `data` is the spec's data section (system prompt and template); None renders the prompt as the only
    message."""
    ids = tokenizer.apply_chat_template(chat_messages(prompt, data), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


# ---------------------------------------------------------------------------------------------
# Sampling


class PromptSampler:
    """Seeded epochs over dataset indices; state = (epoch, position)."""

    def __init__(self, size: int, seed: int):
        if size < 1:
            raise ValueError("the training dataset is empty")
        self.size, self.seed = size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self._order[self.position])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "size": self.size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for a dataset of {state['size']} prompts with seed {state['seed']}, "
                f"this run has {self.size} with seed {self.seed}; resume with the same data section"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
