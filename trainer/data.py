"""Prompt datasets, how a prompt becomes the model's input, and the seeded, resumable sampler.

A dataset is a list of `Example(prompt, answer)`. `render_prompt` is the one function that turns an
example's prompt into token ids — rollouts, in-training eval, the final eval and the probe all call it —
through the tokenizer's chat template: an optional system message (`data.system_prompt`), then the user
message, which is `data.prompt_template` with the prompt in place of `{prompt}` (or the prompt alone).
With neither set the rendering is a single user message, exactly what the quickstart was built on.

Built-in sources (`data.source`), all generated offline from `data.seed`:

    arith          bare sums "23+58", answered "81" — the quickstart's tiny model answers in <output> tags
    sums           "23 + 58" for a chat model, with a template such as "What is {prompt}?"
    word_problems  short everyday word problems with one or two steps ("Sam has 23 stickers and buys 15
                   more. ...") and a whole-number answer, for chat models and numeric_answer

or a `.jsonl` file, one JSON object per line with a string `prompt` and an `answer` (string or number).
A held-out eval set comes from the same generator with another seed, never overlapping the training
prompts; for a file source it is `data.eval_path`. `check_data` reads and checks all of it without
touching torch, so a bad file fails the spec in milliseconds with `file:line` and the fix.

The sampler walks a seeded permutation of the dataset, one epoch after another (a new permutation per
epoch, derived from seed and epoch number); its whole state is `epoch` and `position`, saved in each
checkpoint, so a resumed run sees exactly the prompts an uninterrupted run would.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config import DataConfig

EVAL_SEED_OFFSET = 1_000_003  # built-in sources draw their held-out set from seed + this


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


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


def read_jsonl(path: str | Path, field: str = "data.source") -> list[Example]:
    """Examples of a .jsonl file; a line that is not an object with a string 'prompt' fails with file:line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{field}: data file {path} does not exist; give an existing .jsonl file "
            f"or a built-in source ({', '.join(SOURCES)})"
        )
    examples = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f'{where} is not JSON ({e}); each line must be one object like {{"prompt": "...", "answer": "..."}}'
            ) from None
        if not isinstance(row, dict):
            raise ValueError(
                f"{where} is a JSON {type(row).__name__}, not an object; each line must be one object "
                'like {"prompt": "...", "answer": "..."}'
            )
        if "prompt" not in row:
            raise ValueError(
                f"{where} has no 'prompt' field (it has {', '.join(sorted(row)) or 'none'}); "
                "add the user's message as 'prompt'"
            )
        if not isinstance(row["prompt"], str):
            raise ValueError(
                f"{where}: 'prompt' is a {type(row['prompt']).__name__}; give the user's message as a string"
            )
        answer = row.get("answer", "")
        if isinstance(answer, bool) or not isinstance(answer, (str, numbers.Real)):
            raise ValueError(f"{where}: 'answer' is a {type(answer).__name__}; give a string or a number")
        examples.append(Example(row["prompt"], str(answer)))
    if not examples:
        raise ValueError(f'{field}: {path} holds no examples; add lines like {{"prompt": "...", "answer": "..."}}')
    return examples


def load_datasets(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples. A built-in source's eval set is drawn with another seed and never
    overlaps the training prompts; a file source's is data.eval_path (empty without one)."""
    if cfg.source in SOURCES:
        make = SOURCES[cfg.source]
        train = make(cfg.num_prompts, cfg.seed, cfg.max_digits)
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
    if not cfg.source.endswith(".jsonl"):
        raise ValueError(
            f"data.source={cfg.source!r} is neither a built-in source ({', '.join(SOURCES)}) "
            "nor a .jsonl file; give one of those"
        )
    train = read_jsonl(cfg.source)
    return train, (read_jsonl(cfg.eval_path, "data.eval_path") if cfg.eval_path else [])


def check_data(cfg: DataConfig) -> None:
    """Read and check the data section's sources (no torch): raises ValueError / FileNotFoundError naming
    the file and line. The spec validation calls it, so bad data fails before a model loads."""
    load_datasets(cfg)


def data_fingerprint(examples: list[Example]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.prompt, e.answer]).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Rendering


def chat_messages(prompt: str, data: DataConfig | None = None) -> list[dict]:
    """The chat messages of one prompt: data.system_prompt (if set), then the user message
    (data.prompt_template with the prompt in place of {prompt}, or the prompt alone)."""
    system = data.system_prompt if data is not None else None
    template = data.prompt_template if data is not None else None
    user = prompt if template is None else template.format(prompt=prompt)
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": user}]


def render_prompt(tokenizer, prompt: str, data: DataConfig | None = None) -> list[int]:
    """Token ids of the chat-formatted prompt, ending where the assistant's answer starts. `data` is the
    spec's data section (system prompt and template); None renders the prompt as the only message."""
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
