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
silent ratio of 1. A completion with no `logprobs` field is refused before the model loads, naming the file and
line, while grpo.rollout_correction (tis | mis) needs them (`check_trajectories`, from the spec's validation);
with grpo.rollout_correction.mode: off it trains uncorrected (pi_old is the trainer's own either way).

A line: {"prompt": "23+58" (or chat messages), "answer": "81", "completions": [{"token_ids": [...], "logprobs": ...,
"finish_reason": "stop" | "length", "text": "..."}, ...]}. `token_ids` are the completion's tokens
under the run's tokenizer; without them `text` is tokenised (and logprobs, if given, must then be one
per token of that tokenisation). `finish_reason` defaults to "stop" when the last token is an end
token, else "length". Every line needs exactly grpo.num_generations completions: GRPO normalises
advantages within the group. The prompt is rendered with the model's chat template, as for any source.

**Multi-turn episodes.** A completion may instead be a whole episode of an agent with tools, trained token-exact:
the tokens the model sampled in each of its turns, and between them the tokens of the messages inserted (tool
results, user turns), never a re-rendering of the conversation. Only sampled tokens carry loss and logprobs
(`Completion.loss_mask`). Two shapes:

    {"messages_and_choices": [msg, msg, choice, msg, choice, ...], "tools": [...]}   ART's Trajectory
    {"messages": [msg, msg, assistant+logprobs, tool msg, assistant+logprobs], "tools": [...]}   an OpenAI chat log

A *sampled turn* is an OpenAI `Choice` (an object with `message`, `logprobs`, `finish_reason`; ART's) or an
assistant message carrying `logprobs` or `token_ids` (a chat-completions response's choice.message with the
choice's logprobs merged in). Plain messages before the first sampled turn are the episode's prompt (few-shot
assistant messages included); after it, an assistant message that is not a sampled turn is refused (it would
silently get no loss). The line's `prompt` names the group (what the sampler draws and the rewards read); each
episode trains on its own messages and `tools`. `text`, which rewards score, is the last sampled turn's.

The sampled tokens of a turn are, in this order: its `token_ids` (vLLM's return_token_ids, which ART stores on
each Choice); the ids in its logprob tokens when they read "token_id:N" (vLLM's --return-tokens-as-token-ids);
else each logprob token string mapped to the one vocabulary id whose own decoding is that string (`bytes`, when
given, decoded as UTF-8 first). A string no id decodes to, or several do, is refused with the line, the turn and
the position: store the token ids. A turn with neither token ids nor logprobs is refused: its tokens are unknown.

The inserted tokens are, for a turn whose Choice carries vLLM's `prompt_token_ids`, exactly the part of that
prompt after the tokens so far (refused if it does not extend them: the server re-rendered the conversation).
Otherwise the chat template renders them: the text the template adds after the previous sampled turn's text
(e.g. a newline after the end token) and the inserted messages up to the next generation prompt, tokenised on
their own — what the server tokenised, when turns are delimited by special tokens as chat templates do. A
template that renders a sampled turn differently from the sampled text (it drops reasoning, reformats tool
calls) cannot say where the inserted text starts, and is refused naming the turn: store prompt_token_ids.
Logprobs are all turns' or none (mixed is refused naming the turn).
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


class TemplateMismatch(Exception):
    """The chat template writes a sampled turn as other text than the model sampled (`inserted_by_template`)."""

    def __init__(self, turn_text: str | None, sampled_text: str):
        super().__init__(f"the template writes {turn_text!r} for the sampled {sampled_text!r}")
        self.turn_text, self.sampled_text = turn_text, sampled_text


def inserted_by_template(tokenizer, render, messages: list[dict], prev: int, j: int, previous_turn: list[int]):
    """The token ids the chat template puts between the sampled turn at messages[prev] (whose sampled tokens are
    `previous_turn`) and the next turn of the model at messages[j]: what it writes after the sampled text of turn
    `prev` (its end-of-turn glue), then the messages in between and the generation prompt, tokenised on their own.
    `render(messages, generation_prompt) -> str` applies the template. Raises TemplateMismatch when the template
    writes turn `prev` as other text than was sampled, or re-renders it once messages follow: where the inserted
    text starts is then unknown. Offline episodes (here) and live ones (trainer/episodes.py) both use it."""
    before = render(messages[:prev], True)  # the prompt the previous turn was sampled from
    through = render(messages[: prev + 1], False)  # ... and that turn, as the template writes it
    upto = render(messages[:j], True)  # ... and the inserted messages, up to this turn's prompt
    sampled_text = tokenizer.decode(previous_turn, skip_special_tokens=False)
    turn_text = through[len(before) :] if through.startswith(before) else None
    if turn_text is None or not turn_text.startswith(sampled_text) or not upto.startswith(through):
        raise TemplateMismatch(turn_text, sampled_text)
    return tokenizer.encode(turn_text[len(sampled_text) :] + upto[len(through) :], add_special_tokens=False)


def _template_message(message: dict) -> dict:
    """A message as a chat template reads it: role, content ('' for None) and tool fields, without the logprobs
    and token ids a log stores beside them."""
    out = {k: v for k, v in message.items() if k in ("role", "content", "name", "tool_calls", "tool_call_id")}
    out["content"] = out.get("content") or ""
    if not out.get("tool_calls"):
        out.pop("tool_calls", None)
    return out


def is_sampled_turn(item: dict) -> bool:
    """A turn the model sampled: an OpenAI `Choice` (it has a `message`), or an assistant message that carries the
    sampler's `logprobs` or `token_ids`."""
    message = item.get("message", item)
    return "message" in item or (
        isinstance(message, dict) and message.get("role") == "assistant" and ("logprobs" in item or "token_ids" in item)
    )


def _conversation(items: list, where: str) -> tuple[list[dict], list[int]]:
    """An episode's messages as the chat template reads them, and the indices of the model's sampled turns; refuses
    an item that is no message, an unsampled assistant message after the first sampled turn, and no sampled turn."""
    messages, sampled = [], []
    for j, item in enumerate(items):
        at = f"{where}[{j}]"
        if not isinstance(item, dict):
            raise TrajectoryError(f"{at} is a {type(item).__name__}; expected a message or a Choice object")
        message = item.get("message") if "message" in item else item
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TrajectoryError(f"{at} has no 'role'; expected a chat message or a Choice with a 'message'")
        if is_sampled_turn(item):
            sampled.append(j)
        elif message["role"] == "assistant" and sampled:
            raise TrajectoryError(
                f"{at} is an assistant message without logprobs or token_ids after the model's first turn: it "
                "would get no loss; store the turn as a Choice (or with its logprobs), or drop it"
            )
        messages.append(_template_message(message))
    if not sampled:
        raise TrajectoryError(
            f"{where} has no turn of the model: no Choice object and no assistant message with logprobs or "
            "token_ids; nothing in it could be trained on"
        )
    return messages, sampled


def check_trajectories(path: str | Path, mode: str, group_size: int | None = None) -> None:
    """Before the model loads (no tokenizer, no torch): each line's stored completions as far as the JSON alone says —
    `group_size` of them a prompt (`check_group`); token_ids whole numbers >= 0, some tokens, logprobs of a known
    shape, finite, <= 0 and one per token id, a known finish_reason (`check_completion`) — and, with
    `grpo.rollout_correction.mode` tis or mis (`mode`), which weight each token by the sampler's probability,
    logprobs stored with every completion (for an episode: its first sampled turn). A TrajectoryError naming the
    file, the line and the completion. Lines it cannot read as JSON objects, and what needs the tokenizer (the
    vocabulary's bounds, an episode's turns), are left to the engine."""
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue
        completions = row.get("completions") if isinstance(row, dict) else None
        if group_size is not None and isinstance(completions, list) and completions:
            check_group(completions, group_size, f"{path}:{lineno}")
        for i, c in enumerate(completions if isinstance(completions, list) else []):
            where = f"{path}:{lineno} completions[{i}]"
            if isinstance(c, dict) and "messages_and_choices" not in c and "messages" not in c:
                check_completion(c, where)
            if mode != "off" and _without_logprobs(c):
                raise TrajectoryError(
                    f"{where} has no logprobs, and grpo.rollout_correction.mode: {mode} "
                    "weights each token by the sampler's probability of it; store the logprobs the sampler returned "
                    "with each completion, or set grpo.rollout_correction.mode: off to train on the trainer's own "
                    "logprobs alone"
                )


def check_group(group: list, group_size: int, where: str) -> None:
    """A prompt's stored completions are one GRPO group: grpo.num_generations of them."""
    if len(group) != group_size:
        raise TrajectoryError(
            f"{where} has {len(group)} completions but grpo.num_generations is {group_size}; set "
            "grpo.num_generations to the group size of the file"
        )


def check_completion(c: dict, where: str) -> list[float] | None:
    """One single-turn completion's fields as the JSON gives them; its logprobs (None when it stores none). What
    needs the tokenizer — the token ids' range, the text's tokens — is the engine's."""
    ids = c.get("token_ids")
    if "token_ids" in c:
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise TrajectoryError(
                f"{where}.token_ids must be a list of whole numbers >= 0 (token ids of the run's "
                f"tokenizer); got {str(ids)[:80]}"
            )
    elif "text" not in c:
        raise TrajectoryError(f"{where} has neither token_ids nor text")
    if ids == [] or ("token_ids" not in c and str(c["text"]) == ""):
        raise _empty(where)
    finish = c.get("finish_reason")
    if finish not in (None, "", "stop", "length"):
        raise TrajectoryError(f"{where}.finish_reason is {finish!r}; expected 'stop' or 'length'")
    if c.get("logprobs") is None:
        return None
    logprobs = read_logprobs(c["logprobs"], ids, f"{where}.logprobs")
    if ids is not None and len(logprobs) != len(ids):
        raise TrajectoryError(f"{where} has {len(ids)} tokens but {len(logprobs)} logprobs")
    return logprobs


def _empty(where: str) -> TrajectoryError:
    return TrajectoryError(
        f"{where} is empty (no tokens): a completion needs at least one token to be trained on; drop the line's "
        "empty completions or regenerate them"
    )


def _without_logprobs(c: Any) -> bool:
    """A completion stored without the sampler's logprobs (an episode: its first sampled turn); False for what is
    not a completion at all (the engine refuses that)."""
    if not isinstance(c, dict):
        return False
    turns = c.get("messages_and_choices", c.get("messages"))
    if turns is not None:
        sampled = (t for t in turns if isinstance(t, dict) and is_sampled_turn(t)) if isinstance(turns, list) else ()
        c = next(iter(sampled), None)
    return c is not None and c.get("logprobs") is None


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
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), (str, list)):
                raise TrajectoryError(
                    f"{where} is not an object with a 'prompt' (a string, or chat messages); each line is one prompt: "
                    '{"prompt": "...", "answer": "...", "completions": [...]}'
                )
            if not isinstance(row.get("completions"), list) or not row["completions"]:
                raise TrajectoryError(
                    f"{where} has no 'completions' list; rollout.engine: offline needs each line's "
                    "completions (or use rollout.engine: hf to sample them)"
                )
            prompt_ids = tuple(render(tokenizer, row["prompt"]))
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
        if "messages_and_choices" in c or "messages" in c:
            return self._episode(c, eos, where)
        logprobs = check_completion(c, where)
        if "token_ids" in c:
            ids = c["token_ids"]
            vocab = len(self.tokenizer)
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise TrajectoryError(
                    f"{where}.token_ids holds {bad}, outside the vocabulary of the run's tokenizer "
                    f"(ids 0..{vocab - 1}); the completions were tokenised for another model — store "
                    "the text instead, or set model.name_or_path to the model that wrote them"
                )
        else:
            ids = self.tokenizer.encode(str(c["text"]), add_special_tokens=False)
            if not ids:
                raise _empty(where)
            if logprobs is not None and len(logprobs) != len(ids):
                raise TrajectoryError(
                    f"{where} has {len(ids)} tokens but {len(logprobs)} logprobs (its text was tokenised with the "
                    "run's tokenizer; store the sampled token_ids with the logprobs)"
                )
        finish = c.get("finish_reason") or ("stop" if ids and ids[-1] in eos else "length")
        if finish not in ("stop", "length"):
            raise TrajectoryError(f"{where}.finish_reason is {finish!r}; expected 'stop' or 'length'")
        text = c["text"] if "text" in c else self.tokenizer.decode(ids, skip_special_tokens=True)
        return Completion(prompt_ids=prompt_ids, token_ids=ids, logprobs=logprobs, finish_reason=finish, text=str(text))

    # ---- multi-turn episodes (module docstring) ------------------------------------------------------
    def _episode(self, c: dict, eos: set, where: str) -> Completion:
        key = "messages_and_choices" if "messages_and_choices" in c else "messages"
        items, tools = c[key], c.get("tools")
        if not isinstance(items, list) or not items:
            raise TrajectoryError(f"{where}.{key} must be a non-empty list of messages and the model's turns")
        if tools is not None and not isinstance(tools, list):
            raise TrajectoryError(f"{where}.tools must be a list of tool definitions; got a {type(tools).__name__}")
        where = f"{where}.{key}"
        messages, sampled = _conversation(items, where)
        token_ids: list[int] = []  # after the prompt: the sampled turns and the tokens inserted between them
        loss_mask: list[int] = []
        logprobs: list[float] = []
        prompt_ids: list[int] = []
        with_logprobs = []
        for k, j in enumerate(sampled):
            item, at = items[j], f"{where}[{j}]"
            inserted = self._tokens_before(item, k, sampled, messages, tools, prompt_ids, token_ids, loss_mask, at)
            if k == 0:
                prompt_ids = inserted
            else:
                token_ids += inserted
                loss_mask += [0] * len(inserted)
                logprobs += [math.nan] * len(inserted)
            ids, lps = self._turn(item, at)
            with_logprobs.append(lps is not None)
            if with_logprobs[-1] != with_logprobs[0]:
                raise TrajectoryError(
                    f"{at} has {'logprobs' if with_logprobs[-1] else 'no logprobs'} but {key}[{sampled[0]}], the "
                    f"model's first turn, has {'them' if with_logprobs[0] else 'none'}: an episode's turns all have "
                    "logprobs or none do (then set grpo.rollout_correction.mode: off)"
                )
            token_ids += ids
            loss_mask += [1] * len(ids)
            logprobs += lps if lps is not None else [math.nan] * len(ids)
        finish = items[sampled[-1]].get("finish_reason") or ("stop" if token_ids[-1] in eos else "length")
        return Completion(
            prompt_ids=prompt_ids,
            token_ids=token_ids,
            logprobs=logprobs if with_logprobs[0] else None,
            finish_reason="length" if finish == "length" else "stop",  # stop, tool_calls, ...: the turn ended
            text=self.tokenizer.decode(token_ids[len(token_ids) - len(ids) :], skip_special_tokens=True),
            loss_mask=loss_mask,
        )

    def _tokens_before(self, item, k: int, sampled, messages, tools, prompt_ids, token_ids, loss_mask, at: str):
        """The tokens before the episode's k-th sampled turn (`item`): the prompt (k = 0) or those inserted since the
        previous turn — the server's own (`prompt_token_ids`), else as the chat template renders them."""
        server_prompt = item.get("prompt_token_ids")
        if server_prompt is not None:
            server_prompt = self._ids(server_prompt, f"{at}.prompt_token_ids")
            so_far = prompt_ids + token_ids
            if server_prompt[: len(so_far)] != so_far:
                raise TrajectoryError(
                    f"{at}.prompt_token_ids do not begin with the episode's tokens so far (turn {sampled[k]} is not an "
                    "append-only continuation: the server re-rendered the conversation); such an episode is "
                    "several sequences, store each as its own completion"
                )
            return server_prompt[len(so_far) :]
        if k == 0:
            return self._render_ids(messages[: sampled[0]], tools, at)
        return self._inserted(messages, tools, sampled[k - 1], sampled[k], token_ids, loss_mask, at)

    def _turn(self, item: dict, at: str) -> tuple[list[int], list[float] | None]:
        """A sampled turn's token ids and logprobs (None: none stored)."""
        raw = item.get("logprobs")
        content = raw.get("content") if isinstance(raw, dict) else raw
        if "token_ids" in item:
            ids = self._ids(item["token_ids"], f"{at}.token_ids")
        elif isinstance(content, list) and content:
            ids = [self._token_id(entry, f"{at}.logprobs.content[{i}]") for i, entry in enumerate(content)]
        else:
            raise TrajectoryError(
                f"{at} has neither token_ids nor per-token logprobs: the tokens the model sampled are unknown, and "
                "re-tokenising its text would not be them; store the turn with its logprobs or token_ids"
            )
        if not ids:
            raise TrajectoryError(f"{at} has no tokens: a turn of the model needs at least one")
        if raw is None:
            return ids, None
        lps = read_logprobs(raw, ids, f"{at}.logprobs")
        if len(lps) != len(ids):
            raise TrajectoryError(f"{at} has {len(ids)} token_ids but {len(lps)} logprobs")
        return ids, lps

    def _token_id(self, entry: Any, at: str) -> int:
        """The vocabulary id of one OpenAI logprob entry: 'token_id:N' as it says, else by its string."""
        token = entry.get("token") if isinstance(entry, dict) else None
        if not isinstance(token, str):
            raise TrajectoryError(f"{at} has no 'token' string to say which token was sampled; store token_ids")
        if token.startswith("token_id:") and token[9:].isdigit():
            return self._ids([int(token[9:])], at)[0]
        if isinstance(entry.get("bytes"), list):
            try:
                token = bytes(entry["bytes"]).decode("utf-8")
            except (UnicodeDecodeError, ValueError):
                pass  # a token that is part of a UTF-8 character: its string is all there is
        found = self._by_string().get(token)
        if found is None or found < 0:
            raise TrajectoryError(
                f"{at}.token is {token!r}, which "
                + ("no token of the run's tokenizer" if found is None else "several tokens of the run's tokenizer")
                + " decodes to, so the sampled id is unknown; store the turn's token_ids (vLLM: return_token_ids, "
                "or --return-tokens-as-token-ids)"
            )
        return found

    def _by_string(self) -> dict[str, int]:
        """Each string that exactly one vocabulary id decodes to, mapped to it (-1: several do)."""
        if getattr(self, "_strings", None) is None:
            table: dict[str, int] = {}
            for i in range(len(self.tokenizer)):
                s = self.tokenizer.decode([i])
                table[s] = -1 if s in table else i
            self._strings = table
        return self._strings

    def _ids(self, ids: Any, at: str) -> list[int]:
        vocab = len(self.tokenizer)
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise TrajectoryError(f"{at} must be a list of token ids (whole numbers); got {str(ids)[:80]}")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise TrajectoryError(
                f"{at} holds {bad}, outside the vocabulary of the run's tokenizer (ids 0..{vocab - 1}); the episode "
                "was tokenised for another model — set model.name_or_path to the model that wrote it"
            )
        return ids

    def _render(self, messages: list[dict], tools, generation_prompt: bool, at: str) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
            )
        except Exception as e:  # jinja's TemplateError, or the template's raise_exception
            raise TrajectoryError(
                f"{at}: the model's chat template cannot render the episode up to here ({e})"
            ) from None

    def _render_ids(self, messages: list[dict], tools, at: str) -> list[int]:
        return self.tokenizer.encode(self._render(messages, tools, True, at), add_special_tokens=False)

    def _inserted(self, messages, tools, prev: int, j: int, token_ids, loss_mask, at: str) -> list[int]:
        """The tokens between the sampled turn at messages[prev] and the one at messages[j] (`inserted_by_template`)."""
        n_prev = len(loss_mask) - loss_mask[::-1].index(0) if 0 in loss_mask else 0
        try:
            return inserted_by_template(
                self.tokenizer, lambda m, g: self._render(m, tools, g, at), messages, prev, j, token_ids[n_prev:]
            )
        except TemplateMismatch as e:
            raise TrajectoryError(
                f"{at}: the chat template writes the model's previous turn as {str(e.turn_text)[:60]!r}, not as the "
                f"text it sampled ({e.sampled_text[:60]!r}), so where the inserted messages start is unknown; store "
                "each Choice's prompt_token_ids (vLLM: return_token_ids) so the server's own tokens are used"
            ) from None

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
            check_group(group, params.n, f"{self.path}:{lineno}")
            out.append(group)
        return out

    def sync_weights(self, model, step: int) -> None:
        pass

    def close(self) -> None:
        pass
