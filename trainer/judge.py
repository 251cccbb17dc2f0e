"""The LLM-judge reward: an OpenAI-compatible chat model scores each group of completions relative to itself.

    rewards: [{name: judge, kwargs: {base_url: http://127.0.0.1:8000/v1, model: M, api_key_env: JUDGE_KEY}}]

The choices (kwargs and defaults: JudgeConfig in trainer/config.py):
- One request per group (ART's RULER idea): a group is a run of consecutive completions with the same prompt,
  at most `group_size` (grpo.num_generations) long, so eval batches are judged one completion at a time.
- The answer is JSON {"1": s1, ..., "G": sG}, integers 0-10, asked for with a json_schema response_format
  (vLLM enforces it by guided decoding); the reward is s / 10. Anything else is a malformed answer.
- Only text leaves the process: the prompt's and each completion's (a string, an object's `.text`, a chat
  message's `content`), never logprobs, token ids or other fields.
- Timeouts (`timeout_s`, wall clock, also against a trickling server), connection errors, HTTP 408/429/5xx and
  malformed answers are retried with exponential backoff; then `on_failure`: 'fail' fails the step, 'zero'
  scores the group 0 and counts it. Other 4xx (bad key, unknown model, prompt too long) always fail.
  `step_timeout_s` bounds a whole call; `concurrency` bounds the requests in flight.
- Answers are cached by content hash in <output_dir>/judge-cache.jsonl, so a resumed run does not pay twice.
  The key is read from the variable `api_key_env` names at each request and kept nowhere (not here, the
  cache, errors or metrics).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from .config import JudgeConfig

SYSTEM_PROMPT = (
    "You judge responses to a task. Score each numbered response from 0 (worst) to 10 (best) by the "
    "rubric, comparing the responses with each other. Reply with only a JSON object that maps each "
    'response number to its score, e.g. {"1": 7, "2": 3}.'
)
PROMPT_VERSION = 1  # part of the cache key: a change to how groups are shown invalidates cached answers
SCALE = 10  # the judge answers integers 0..SCALE; the reward is score / SCALE
CACHE_FILE = "judge-cache.jsonl"
RETRYABLE_STATUS = {408, 409, 425, 429}  # and every 5xx
ERROR_BODY_CHARS = 300
SECRET_KWARGS = ("api_key", "apikey", "key", "token", "secret", "password", "authorization")


class JudgeError(RuntimeError):
    """The judge could not score a group and the step cannot go on; the message says why and what to change."""


class _Retryable(Exception):
    """A failed attempt worth another: timeout, connection error, 408/429/5xx, malformed answer."""

    retry_after: float = 0.0  # seconds the server asked for (Retry-After)


@dataclass
class _Group:
    index: int
    start: int
    prompt: str
    completions: list[str]
    reference: str | None


@dataclass
class _CallStats:
    """What one scoring call did; the workers add to it under `lock`."""

    groups: int = 0
    requests: int = 0
    retries: int = 0
    failures: int = 0
    groups_zeroed: int = 0
    cache_hits: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    latencies: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **counts) -> None:
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)


class JudgeReward:
    """The `judge` reward: `JudgeReward(**kwargs)` validates the kwargs (JudgeConfig) and, when `api_key_env` is
    set, that the variable exists; calling it scores a batch. `metrics()` gives the judge/* values of the last call."""

    def __init__(self, *, group_size: int = 1, output_dir: str | Path | None = None, **kwargs: Any):
        self.cfg = _validated(kwargs)
        if self.cfg.api_key_env and not os.environ.get(self.cfg.api_key_env):
            name = self.cfg.api_key_env
            raise ValueError(
                f"judge: api_key_env={name!r}: the environment variable {name} is not set; export it "
                "before the run (the key is read from the environment, never the spec)"
            )
        self.group_size = max(1, int(group_size))
        self.system_prompt = self.cfg.system_prompt or SYSTEM_PROMPT
        self.url = f"{self.cfg.base_url}/chat/completions"
        path = Path(output_dir) / CACHE_FILE if (output_dir is not None and self.cfg.cache) else None
        self.cache = _Cache(path, enabled=self.cfg.cache)
        self.http = httpx.Client(limits=httpx.Limits(max_connections=self.cfg.concurrency))
        self._last: dict[str, float] = {}

    # ---------------------------------------------------------------- scoring a batch
    def __call__(self, completions: Sequence, answers: Sequence, prompts: Sequence) -> list[float]:
        texts = [_text_of(c, f"completion {i}") for i, c in enumerate(completions)]
        prompt_texts = [_prompt_text(p, i) for i, p in enumerate(prompts)]
        groups = _split_groups(
            prompt_texts, texts, list(answers) if self.cfg.include_reference else None, self.group_size
        )
        stats = _CallStats(groups=len(groups))
        scores: list[float] = [0.0] * len(texts)
        if groups:
            for group, result in zip(groups, self._judge_all(groups, stats)):
                scores[group.start : group.start + len(group.completions)] = result
        self._last = self._metrics(stats)
        return scores

    def metrics(self) -> dict[str, float]:
        """judge/* of the last call (ballast metrics documents each name)."""
        return dict(self._last)

    def _judge_all(self, groups: list[_Group], stats: _CallStats) -> list[list[float]]:
        """Scores of every group, `concurrency` at a time, within `step_timeout_s`."""
        cfg = self.cfg
        deadline = time.monotonic() + cfg.step_timeout_s
        stop = threading.Event()
        pool = ThreadPoolExecutor(max_workers=min(cfg.concurrency, len(groups)), thread_name_prefix="judge")
        futures = [pool.submit(self._judge_group, g, deadline, stats, stop) for g in groups]
        results: list[list[float] | None] = [None] * len(groups)
        try:
            pending = set(futures)
            while pending:
                left = max(0.0, deadline - time.monotonic())
                done, pending = wait(pending, timeout=left, return_when=FIRST_EXCEPTION)
                if not done:  # the step's deadline: whatever is unfinished has failed
                    for f in pending:
                        g = groups[futures.index(f)]
                        why = f"no answer within step_timeout_s={cfg.step_timeout_s}"
                        results[g.index] = self._failed(g, stats, why)
                    break
                for f in done:
                    g = groups[futures.index(f)]
                    error = f.exception()
                    if error is None:
                        results[g.index] = f.result()
                    elif isinstance(error, _Retryable):
                        results[g.index] = self._failed(g, stats, str(error))
                    else:
                        raise error
        finally:
            stop.set()
            pool.shutdown(wait=False, cancel_futures=True)
        return [r if r is not None else [0.0] * len(g.completions) for r, g in zip(results, groups)]

    def _failed(self, group: _Group, stats: _CallStats, why: str) -> list[float]:
        if self.cfg.on_failure == "fail":
            raise JudgeError(
                f"judge: no valid scores for group {group.index} (prompt {group.prompt[:60]!r}) from "
                f"{self.url}: {why}; raise timeout_s / max_retries / step_timeout_s, or set "
                "on_failure: zero to score such a group 0 and go on"
            )
        stats.add(groups_zeroed=1)
        return [0.0] * len(group.completions)

    # ---------------------------------------------------------------- one group
    def _judge_group(self, group: _Group, deadline: float, stats: _CallStats, stop: threading.Event) -> list[float]:
        """The group's scores: from the cache, or from the endpoint with retries; raises _Retryable when out of
        attempts or time, JudgeError on an answer that retrying cannot fix."""
        key = self._cache_key(group)
        cached = self.cache.get(key, len(group.completions))
        if cached is not None:
            stats.add(cache_hits=1)
            return cached
        body = self._request_body(group)
        last, wait_s = "", 0.0
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                if time.monotonic() + wait_s >= deadline:
                    break
                if stop.wait(wait_s):
                    raise _Retryable(f"{last}; the call was abandoned")
                stats.add(retries=1)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or stop.is_set():
                break
            try:
                scores = self._ask(body, len(group.completions), min(self.cfg.timeout_s, remaining), stats)
            except _Retryable as e:
                stats.add(failures=1)
                last = str(e)
                wait_s = min(self.cfg.max_backoff_s, max(self.cfg.backoff_s * 2**attempt, e.retry_after))
                continue
            self.cache.put(key, scores)
            return scores
        else:
            raise _Retryable(
                f"every attempt failed, the last with: {last} (max_retries={self.cfg.max_retries}, "
                f"timeout_s={self.cfg.timeout_s})"
            )
        raise _Retryable(
            f"no answer within step_timeout_s={self.cfg.step_timeout_s}"
            + (f" (the last attempt: {last})" if last else "")
        )

    def _ask(self, body: dict, n: int, timeout: float, stats: _CallStats) -> list[float]:
        """One request; its scores, or _Retryable / JudgeError."""
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.cfg.api_key_env) if self.cfg.api_key_env else None
        if self.cfg.api_key_env and not key:
            raise JudgeError(
                f"judge: the environment variable {self.cfg.api_key_env} (api_key_env) is no longer set; "
                "export it for the whole run"
            )
        if key:
            headers["Authorization"] = f"Bearer {key}"
        started = time.monotonic()
        try:
            status, retry_after, raw = self._post(body, headers, timeout)
        finally:
            with stats.lock:
                stats.requests += 1
                stats.latencies.append(time.monotonic() - started)
        text = _redact(raw.decode("utf-8", errors="replace"), key)
        if status >= 500 or status in RETRYABLE_STATUS:
            error = _Retryable(f"HTTP {status}: {text[:ERROR_BODY_CHARS]}")
            error.retry_after = retry_after
            raise error
        if status != 200:
            raise JudgeError(
                f"judge: {self.url} refused the request with HTTP {status}: {text[:ERROR_BODY_CHARS]}; "
                f"{_hint(status, self.cfg.api_key_env)}"
            )
        try:
            answer = json.loads(text)
            usage = answer.get("usage") or {}
            stats.add(
                tokens_in=int(usage.get("prompt_tokens") or 0), tokens_out=int(usage.get("completion_tokens") or 0)
            )
            choice = answer["choices"][0]
            content = choice["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise _Retryable(f"the endpoint's reply is not a chat completion: {text[:ERROR_BODY_CHARS]}") from None
        try:
            return parse_scores(content, n)
        except _Retryable as e:
            if choice.get("finish_reason") == "length":  # the answer hit max_tokens, or the judge's context
                raise _Retryable(f"{e} (cut off at max_tokens={self.cfg.max_tokens} or the judge's context)") from None
            raise

    def _post(self, body: dict, headers: dict, timeout: float) -> tuple[int, float, bytes]:
        """(status, Retry-After seconds, body) within `timeout` seconds of wall clock: httpx's timeouts bound each
        wait for bytes, the loop bounds a body that keeps trickling."""
        started = time.monotonic()
        try:
            with self.http.stream("POST", self.url, json=body, headers=headers, timeout=httpx.Timeout(timeout)) as r:
                chunks = []
                for chunk in r.iter_bytes():
                    chunks.append(chunk)
                    if time.monotonic() - started > timeout:
                        raise _Retryable(f"the answer did not finish within timeout_s={self.cfg.timeout_s}")
                return r.status_code, _retry_after(r.headers.get("retry-after")), b"".join(chunks)
        except httpx.TimeoutException:
            raise _Retryable(f"no answer within timeout_s={self.cfg.timeout_s}") from None
        except httpx.TransportError as e:
            raise _Retryable(f"connection error ({type(e).__name__}) reaching {self.url}") from None

    # ---------------------------------------------------------------- what is sent
    def _request_body(self, group: _Group) -> dict:
        n = len(group.completions)
        lines = [f"Rubric: {self.cfg.rubric}", f"Task: {group.prompt}"]
        if group.reference is not None:
            lines.append(f"Reference answer: {group.reference}")
        lines += [f"[{i}] {text}" for i, text in enumerate(group.completions, 1)]
        body = {
            "model": self.cfg.model,
            "temperature": self.cfg.temperature,
            "max_tokens": self.cfg.max_tokens,
            "messages": [
                {"role": "system", "content": self.system_prompt},
                {"role": "user", "content": "\n".join(lines)},
            ],
        }
        if self.cfg.response_format == "json_schema":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "scores", "strict": True, "schema": score_schema(n)},
            }
        elif self.cfg.response_format == "json_object":
            body["response_format"] = {"type": "json_object"}
        return body

    def _cache_key(self, group: _Group) -> str:
        content = {
            "version": PROMPT_VERSION,
            "model": self.cfg.model,
            "rubric": self.cfg.rubric,
            "system_prompt": self.system_prompt,
            "prompt": group.prompt,
            "reference": group.reference,
            "completions": group.completions,
        }
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()

    def _metrics(self, stats: _CallStats) -> dict[str, float]:
        lat = stats.latencies
        m = {
            "judge/groups": float(stats.groups),
            "judge/requests": float(stats.requests),
            "judge/retries": float(stats.retries),
            "judge/failures": float(stats.failures),
            "judge/groups_zeroed": float(stats.groups_zeroed),
            "judge/cache_hits": float(stats.cache_hits),
            "judge/latency_mean": sum(lat) / len(lat) if lat else 0.0,
            "judge/latency_max": max(lat, default=0.0),
            "judge/tokens_in": float(stats.tokens_in),
            "judge/tokens_out": float(stats.tokens_out),
        }
        if self.cfg.price_in_per_1k is not None or self.cfg.price_out_per_1k is not None:
            m["judge/cost"] = (
                stats.tokens_in * (self.cfg.price_in_per_1k or 0.0)
                + stats.tokens_out * (self.cfg.price_out_per_1k or 0.0)
            ) / 1000
        return m


# ---------------------------------------------------------------------------------------------
# The answer


def score_schema(n: int) -> dict:
    """JSON schema of the answer for n responses: {"1": 0..10, ..., "n": 0..10}, nothing else."""
    props = {str(i): {"type": "integer", "enum": list(range(SCALE + 1))} for i in range(1, n + 1)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def parse_scores(content: Any, n: int) -> list[float]:
    """The n rewards in [0, 1] from the judge's answer; _Retryable when it is malformed."""
    if not isinstance(content, str):
        raise _Retryable(f"malformed answer: no text content ({type(content).__name__})")
    text = content.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.S)
    text = fenced.group(1) if fenced else text
    try:
        obj = json.loads(text)
    except ValueError:
        raise _Retryable(f"malformed answer, not JSON: {content[:ERROR_BODY_CHARS]!r}") from None
    if not isinstance(obj, dict):
        raise _Retryable(f"malformed answer, not a JSON object: {content[:ERROR_BODY_CHARS]!r}")
    out = []
    for i in range(1, n + 1):
        v = obj.get(str(i))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= SCALE:
            raise _Retryable(f"malformed answer, response {i} has no score 0-{SCALE}: {content[:ERROR_BODY_CHARS]!r}")
        out.append(float(v) / SCALE)
    return out


# ---------------------------------------------------------------------------------------------
# The cache


class _Cache:
    """Scores by content hash: a dict, and with a path an append-only JSONL file (a torn last line is skipped)."""

    def __init__(self, path: Path | None, enabled: bool = True):
        self.path, self.enabled = path, enabled
        self.entries: dict[str, list[float]] = {}
        self.lock = threading.Lock()
        self.torn = False  # the file ends mid-line (a run killed while writing): start a new line
        if path is not None and path.exists():
            raw = path.read_text()
            self.torn = bool(raw) and not raw.endswith("\n")
            for line in raw.splitlines():
                try:
                    row = json.loads(line)
                    self.entries[row["key"]] = [float(s) for s in row["scores"]]
                except (ValueError, KeyError, TypeError):
                    continue

    def get(self, key: str, n: int) -> list[float] | None:
        scores = self.entries.get(key) if self.enabled else None
        return list(scores) if scores is not None and len(scores) == n else None

    def put(self, key: str, scores: list[float]) -> None:
        if not self.enabled:
            return
        with self.lock:
            self.entries[key] = list(scores)
            if self.path is None:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(("\n" if self.torn else "") + json.dumps({"key": key, "scores": scores}) + "\n")
            self.torn = False


# ---------------------------------------------------------------------------------------------
# Helpers


def _validated(kwargs: dict) -> JudgeConfig:
    """JudgeConfig from the kwargs, or a one-line ValueError that never echoes a value (one may be a key)."""
    for name in kwargs:
        if name.lower() in SECRET_KWARGS or name.lower().endswith(("_key", "_token", "_secret", "_password")):
            raise ValueError(
                f"judge: kwarg {name!r} would put a secret in the spec (which is logged); put the key in "
                "an environment variable and give its NAME as api_key_env"
            )
    try:
        return JudgeConfig.model_validate(kwargs)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "kwargs"
        if err["type"] == "extra_forbidden":
            msg = f"unknown kwarg {where!r}; the judge takes {', '.join(JudgeConfig.model_fields)}"
        elif err["type"] == "missing":
            msg = f"kwarg {where!r} is required (e.g. base_url: http://127.0.0.1:8000/v1, model: NAME)"
        else:
            msg = f"kwarg {where!r}: {err['msg'].removeprefix('Value error, ')}"
        raise ValueError(f"judge: {msg}") from None


def _text_of(c: Any, what: str) -> str:
    """The text of a completion: a string, an object's .text, or a message's 'content' — and nothing else."""
    if isinstance(c, str):
        return c
    if isinstance(getattr(c, "text", None), str):
        return c.text
    if isinstance(c, dict):
        for key in ("content", "text"):
            if isinstance(c.get(key), str):
                return c[key]
        if isinstance(c.get("message"), dict) and isinstance(c["message"].get("content"), str):
            return c["message"]["content"]
    if isinstance(c, list) and all(isinstance(m, dict) for m in c):  # a conversation: the assistant's turns
        return "\n".join(m["content"] for m in c if m.get("role") == "assistant" and isinstance(m.get("content"), str))
    raise ValueError(
        f"judge: {what} is a {type(c).__name__} with no text; pass its text (a string, an object with "
        ".text, or a chat message with 'content')"
    )


def _prompt_text(p: Any, i: int) -> str:
    """A prompt string as it is; a list of chat messages as 'role: content' lines (roles and contents only)."""
    if isinstance(p, list) and all(isinstance(m, dict) for m in p):
        return "\n".join(f"{m.get('role', 'user')}: {_text_of(m, f'prompt {i}')}" for m in p)
    return _text_of(p, f"prompt {i}")


def _split_groups(prompts: list[str], texts: list[str], references: list | None, size: int) -> list[_Group]:
    groups: list[_Group] = []
    start = 0
    while start < len(texts):
        end = start + 1
        while end < len(texts) and end - start < size and prompts[end] == prompts[start]:
            end += 1
        ref = None if references is None else str(references[start])
        groups.append(_Group(len(groups), start, prompts[start], texts[start:end], ref))
        start = end
    return groups


def _redact(text: str, key: str | None) -> str:
    return text.replace(key, "***") if key else text


def _retry_after(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0


def _hint(status: int, api_key_env: str | None) -> str:
    if status in (401, 403):
        return (
            f"check that ${api_key_env} holds a valid key"
            if api_key_env
            else "the endpoint wants a key: set api_key_env to the name of the variable that holds it"
        )
    if status == 404:
        return "check base_url (it ends before /chat/completions) and model"
    return (
        "check the request fits the judge: max_tokens and the prompt within its context, and a response_format "
        "it supports (json_schema, json_object or none)"
    )
