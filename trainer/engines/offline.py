"""Rollouts that were generated elsewhere: trajectories read from a file, behind the same engine interface.

    rollout: {engine: offline}
    data:    {source: trajectories.jsonl}      # one line per prompt: prompt, answer, completions

Agent loops and inference services produce rollouts outside the trainer; GRPO on them needs each
completion's tokens and the logprobs the sampler gave them (the old policy of the importance ratio).
The field bug this module exists for: logprobs stored as a list of plain dicts were read as NaN,
and importance sampling silently became REINFORCE. Here every logprob is read by `read_logprobs`,
which knows the shapes that tools write and refuses anything else with the line and the shape:

    [-0.1, -2.3, ...]                                   plain floats
    [{"token": "4", "logprob": -0.1, ...}, ...]         OpenAI chat `choice.logprobs.content`, or any per-token dicts
    {"content": [{"logprob": -0.1, ...}, ...]}          OpenAI chat `choice.logprobs`
    {"token_logprobs": [-0.1, ...], "tokens": [...]}    OpenAI completions `choice.logprobs`
    [{"52": {"logprob": -0.1, "rank": 1}}, ...]         vLLM `SamplingParams(logprobs=k)` output, keyed by token id
                                                        (the sampled token's entry is taken; `token_ids` required)

A NaN, a None or a missing entry is an error naming the line, the completion and the token, never a
silent ratio of 1. A completion with no `logprobs` field gives the trainer None for it, and the trainer
then fails the step (grpo.rollout_correction tis | mis need them), or, with grpo.rollout_correction.mode: off,
trains on them uncorrected (pi_old is the trainer's own either way).

A line: {"prompt": "23+58", "answer": "81", "completions": [{"token_ids": [...], "logprobs": ...,
"finish_reason": "stop" | "length", "text": "..."}, ...]}. `token_ids` are the completion's tokens
under the run's tokenizer; without them `text` is tokenised (and logprobs, if given, must then be one
per token of that tokenisation). `finish_reason` defaults to "stop" when the last token is an end
token, else "length". Every line needs exactly grpo.num_generations completions: GRPO normalises
advantages within the group. The prompt is rendered with the model's chat template, as for any source.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import InputError
from .base import Completion, SamplingParams


class TrajectoryError(InputError):
    """A trajectory file that cannot be trained on as it is; the message names the line and the fix."""


SHAPES = (
    "a list of floats, a list of {'logprob': x} dicts (OpenAI chat content), {'content': [...]}, "
    "{'token_logprobs': [...]} (OpenAI completions), or a list of {token_id: {'logprob': x}} dicts (vLLM)"
)


def read_logprobs(value: Any, token_ids: Sequence[int] | None = None, where: str = "logprobs") -> list[float]:
    """One float per token from any supported shape; raises TrajectoryError naming `where` otherwise."""
    if isinstance(value, dict):
        if "content" in value:
            return read_logprobs(value["content"], token_ids, f"{where}.content")
        if "token_logprobs" in value:
            return read_logprobs(value["token_logprobs"], token_ids, f"{where}.token_logprobs")
        raise TrajectoryError(f"{where} is a dict with keys {sorted(value)[:6]}; expected {SHAPES}")
    if not isinstance(value, list):
        raise TrajectoryError(f"{where} is a {type(value).__name__}; expected {SHAPES}")
    out = []
    for i, item in enumerate(value):
        out.append(_one(item, None if token_ids is None or i >= len(token_ids) else token_ids[i], f"{where}[{i}]"))
    return out


def _one(item: Any, token_id: int | None, where: str) -> float:
    if not isinstance(item, dict):
        return _finite(item, where)
    if "logprob" in item:
        return _finite(item["logprob"], where + ".logprob")
    if not all(isinstance(k, int) or (isinstance(k, str) and k.isdigit()) for k in item):
        raise TrajectoryError(f"{where} is a dict with keys {list(item)[:6]} and no 'logprob'; expected {SHAPES}")
    # vLLM: {token_id: {"logprob": x, "rank": r, ...}} at this position; take the sampled token's entry
    if token_id is not None:
        key = str(token_id) if str(token_id) in item else token_id
        if key not in item:
            raise TrajectoryError(
                f"{where} has no entry for the sampled token {token_id} (keys {list(item)[:5]}); "
                "the logprobs do not belong to these token_ids"
            )
    elif len(item) == 1:
        key = next(iter(item))
    else:
        raise TrajectoryError(
            f"{where} holds {len(item)} candidate tokens (vLLM) and the completion has no token_ids "
            "to say which was sampled; store the token_ids with the logprobs"
        )
    entry = item[key]
    return _one(entry if isinstance(entry, dict) else {"logprob": entry}, None, f"{where}[{key!r}]")


def _finite(x: Any, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TrajectoryError(
            f"{where} is {x!r}, not a number; a missing logprob must not become ratio 1 (REINFORCE) — "
            "drop the completion, or drop the logprobs field and set "
            "grpo.rollout_correction.mode: off"
        )
    if not math.isfinite(x) or x > 1e-6:
        raise TrajectoryError(f"{where} is {x}: a logprob must be finite and <= 0")
    return float(x)


class OfflineEngine:
    """Serves the completions stored for each prompt. Read once; `generate` looks prompts up by token ids."""

    name = "offline"
    overlaps_training = True  # it only reads the file: batches can be read ahead while the trainer updates

    def __init__(self, path: str | Path, tokenizer, render):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"trajectory file {self.path} does not exist; set data.source to the .jsonl "
                "of prompts and their completions (rollout.engine: offline)"
            )
        self.tokenizer = tokenizer
        self.groups: dict[tuple[int, ...], tuple[int, list[Completion]]] = {}
        eos = {tokenizer.eos_token_id}
        for lineno, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            where = f"{self.path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TrajectoryError(f"{where} is not JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise TrajectoryError(
                    f"{where} is not an object with a string 'prompt'; each line is one prompt: "
                    '{"prompt": "...", "answer": "...", "completions": [...]}'
                )
            if not isinstance(row.get("completions"), list) or not row["completions"]:
                raise TrajectoryError(
                    f"{where} has no 'completions' list; rollout.engine: offline needs each line's "
                    "completions (or use rollout.engine: hf to sample them)"
                )
            prompt_ids = tuple(render(tokenizer, str(row["prompt"])))
            self.groups[prompt_ids] = (
                lineno,
                [
                    self._completion(c, list(prompt_ids), eos, f"{where} completions[{i}]")
                    for i, c in enumerate(row["completions"])
                ],
            )

    def _completion(self, c: dict, prompt_ids: list[int], eos: set, where: str) -> Completion:
        if not isinstance(c, dict):
            raise TrajectoryError(f"{where} is a {type(c).__name__}; expected an object with token_ids or text")
        if "token_ids" in c:
            ids = c["token_ids"]
            vocab = len(self.tokenizer)
            if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise TrajectoryError(
                    f"{where}.token_ids must be a list of whole numbers (token ids of the run's "
                    f"tokenizer); got {str(ids)[:80]}"
                )
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise TrajectoryError(
                    f"{where}.token_ids holds {bad}, outside the vocabulary of the run's tokenizer "
                    f"(ids 0..{vocab - 1}); the completions were tokenised for another model — store "
                    "the text instead, or set model.name_or_path to the model that wrote them"
                )
        elif "text" in c:
            ids = self.tokenizer.encode(str(c["text"]), add_special_tokens=False)
        else:
            raise TrajectoryError(f"{where} has neither token_ids nor text")
        if not ids:
            raise TrajectoryError(
                f"{where} is empty (no tokens): a completion needs at least one token to be trained "
                "on; drop the line's empty completions or regenerate them"
            )
        logprobs = None
        if c.get("logprobs") is not None:
            logprobs = read_logprobs(c["logprobs"], ids, f"{where}.logprobs")
            if len(logprobs) != len(ids):
                raise TrajectoryError(
                    f"{where} has {len(ids)} tokens but {len(logprobs)} logprobs"
                    + (
                        ""
                        if "token_ids" in c
                        else " (its text was tokenised with the run's tokenizer; "
                        "store the sampled token_ids with the logprobs)"
                    )
                )
        finish = c.get("finish_reason") or ("stop" if ids and ids[-1] in eos else "length")
        if finish not in ("stop", "length"):
            raise TrajectoryError(f"{where}.finish_reason is {finish!r}; expected 'stop' or 'length'")
        text = c["text"] if "text" in c else self.tokenizer.decode(ids, skip_special_tokens=True)
        return Completion(prompt_ids=prompt_ids, token_ids=ids, logprobs=logprobs, finish_reason=finish, text=str(text))

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Completion]]:
        out = []
        for p in prompts:
            found = self.groups.get(tuple(p))
            if found is None:
                raise TrajectoryError(
                    f"{self.path} has no completions for the prompt {self.tokenizer.decode(p)!r}; "
                    "data.source must be the trajectory file itself"
                )
            lineno, group = found
            if len(group) != params.n:
                raise TrajectoryError(
                    f"{self.path}:{lineno} has {len(group)} completions but grpo.num_generations is "
                    f"{params.n}; set grpo.num_generations to the group size of the file"
                )
            out.append(group)
        return out

    def sync_weights(self, model, step: int) -> None:
        pass

    def close(self) -> None:
        pass
