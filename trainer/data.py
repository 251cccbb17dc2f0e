"""Prompt datasets and the seeded, resumable sampler.

A dataset is a list of `Example(prompt, answer)`; the prompt is the user's message, rendered through
the tokenizer's chat template at rollout time. The built-in `arith` source makes additions of small
numbers ("23+58"), answered as "<output>81</output>" — verifiable, and learnable by a tiny model in
CPU minutes.

The sampler walks a seeded permutation of the dataset, one epoch after another (a new permutation per
epoch, derived from seed and epoch number), and its whole state is two integers: `epoch` and
`position`. Saving those in a checkpoint and restoring them is what makes a resumed run see exactly
the prompts an uninterrupted run would — no replay from the start, no skipped batch.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from .config import DataConfig


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def arith_examples(n: int, seed: int, max_digits: int = 2) -> list[Example]:
    rng = random.Random(seed)
    hi = 10 ** max_digits - 1
    return [Example(f"{a}+{b}", str(a + b)) for a, b in ((rng.randint(0, hi), rng.randint(0, hi)) for _ in range(n))]


def read_jsonl(path: str | Path) -> list[Example]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist; set data.source to an existing .jsonl file or to 'arith'")
    examples = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            examples.append(Example(str(row["prompt"]), str(row.get("answer", ""))))
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{path}:{lineno}: each line must be a JSON object with a 'prompt' field ({e})") from None
    if not examples:
        raise ValueError(f"{path} holds no examples")
    return examples


def load_datasets(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples. For `arith` the eval set is drawn with a different seed and never
    overlaps the training prompts."""
    if cfg.source == "arith":
        train = arith_examples(cfg.num_prompts, cfg.seed, cfg.max_digits)
        seen = {e.prompt for e in train}
        pool = arith_examples(cfg.num_eval_prompts * 4 + 64, cfg.seed + 1_000_003, cfg.max_digits)
        held_out = [e for e in pool if e.prompt not in seen][: cfg.num_eval_prompts]
        return train, held_out
    train = read_jsonl(cfg.source)
    return train, (read_jsonl(cfg.eval_path) if cfg.eval_path else [])


def data_fingerprint(examples: list[Example]) -> str:
    import hashlib

    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.prompt, e.answer]).encode())
    return h.hexdigest()[:16]


def render_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of the chat-formatted prompt, ending where the assistant's answer starts."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


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
            raise ValueError(f"sampler state is for a dataset of {state['size']} prompts with seed {state['seed']}, "
                             f"this run has {self.size} with seed {self.seed}; resume with the same data section")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
