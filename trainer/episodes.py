"""Live multi-turn episodes, token-exact: the model, an environment's tools (trainer/environment.py), any engine.

`EpisodeRunner.run` drives a rollout engine through its `generate(prompts, params)` interface turn by turn: the
active episodes' token-exact prefixes are the prompts, one completion each; the tool calls of each turn are parsed
and run, their results appended as tool messages; an episode ends when the model answers without a call (and the
environment's optional `step(text)` has nothing to say), when a tool fails, or when a budget ends it (data.max_turns,
rollout.max_tokens per turn, data.max_episode_tokens in all). It returns one `Completion` per episode whose
token_ids span all turns: the tokens the model sampled, and between them the tokens of the inserted messages as the
chat template renders them (`inserted_by_template`, shared with the offline engine's episodes) — never a re-rendering
of the conversation. `loss_mask` is 1 on sampled tokens only, which alone carry the engine's logprobs (NaN
elsewhere); `text`, which rewards score, is the last turn's; `episode` holds the conversation and its counts.

The choices, on purpose:

- Seeded per episode and turn: the first turns of a prompt's G episodes are its G samples of one request, seeded by
  the prompt's seed (`SamplingParams.seeds`: rollout.seed, step, position) exactly as a single-turn batch is; turn t
  of generation g is then sampled alone with a seed of (the prompt's seed, g, t). On the HF engine (a generator per
  prompt) an episode's tokens do not depend on which others share its batches; vLLM takes one seed per request, so
  there a turn's draws depend on its batch, as its single-turn batches do. Either way a step's batch is a function of
  the step, so a resumed run regenerates it identically, and batches in flight at a checkpoint are saved with their
  episodes (trainer/rollouts.py).
- One engine call per turn for all active episodes (max_tokens: the largest budget left among them; each episode's
  turn is then cut to its own — a token drawn does not depend on how many follow it).
- An episode cut by a budget ends with finish_reason 'length', as a truncated completion does (grpo.
  mask_truncated_completions applies to it); one that ends with a tool's error, or an answer, with 'stop'.
- The drift check: once an episode ends, the whole conversation is re-rendered by the chat template and compared with
  the token-exact sequence. A difference anywhere is drift (`episodes/drift`: what a server that re-renders the
  history would show the model differs from what it was trained on — often only the tokenisation of sampled text);
  a template that rewrites the *text* of one of the model's turns once more turns follow is refused: the model would
  be served a history it never wrote.
- Eval and the probe run the same episodes through `GenerateEngine`: `model.generate`, greedy at temperature 0, as a
  standalone user decodes (trainer/evaluate.py).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .config import DataConfig
from .engines.base import Completion, SamplingParams
from .engines.offline import TemplateMismatch, inserted_by_template
from .environment import (
    Environment,
    EnvironmentInputError,
    first_messages,
    load_environment,
    parse_tool_calls,
    row_of,
    run_tool,
    template_renders_tools,
    with_tools_in_system,
)

ENVIRONMENT_REWARD = "environment"  # the reward component read from the environment's final state


def episode_seed(prompt_seed: int, generation: int, turn: int) -> int:
    """The sampling seed of one turn of one episode: a function of its prompt's seed, generation and turn alone."""
    return int.from_bytes(hashlib.sha256(f"{prompt_seed}/{generation}/{turn}".encode()).digest()[:8], "little") >> 1


@dataclass
class _Episode:
    instance: Any
    where: str  # the row, for error messages
    seed: int
    messages: list[dict]  # the conversation as the template reads it
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # indices in `messages` of the model's turns
    turn_ids: list[list[int]] = field(default_factory=list)  # the tokens of each of the model's turns
    tool_calls: int = 0
    invalid_calls: int = 0
    tool_errors: int = 0
    cut: str | None = None  # the budget that ended it
    done: bool = False
    has_logprobs: bool = True


class EpisodeRunner:
    """Runs an environment's episodes through any engine; `run(engine, examples, params)` -> G completions each."""

    def __init__(self, env: Environment, tokenizer, data: DataConfig, max_tokens: int):
        self.env, self.tokenizer, self.data, self.max_tokens = env, tokenizer, data, max_tokens
        try:
            self.template_tools = bool(env.tools) and template_renders_tools(tokenizer, env.schemas)
        except Exception as e:  # the template raised on the tools' schemas
            raise EnvironmentInputError(
                f"data.environment={env.name!r}: the model's chat template cannot render the tools' schemas "
                f"({type(e).__name__}: {e}); give the tools plainer parameter types, or another template"
            ) from None

    @classmethod
    def from_config(cls, data: DataConfig, tokenizer, max_tokens: int) -> EpisodeRunner:
        return cls(load_environment(data.environment), tokenizer, data, max_tokens)

    # ---------------------------------------------------------------- rendering
    def render(self, messages: list[dict], generation_prompt: bool, where: str) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=self.env.schemas if self.template_tools else None,
                add_generation_prompt=generation_prompt,
                tokenize=False,
            )
        except Exception as e:  # jinja's TemplateError, or the template's raise_exception
            raise EnvironmentInputError(
                f"{where}: data.environment={self.env.name!r}: the model's chat template cannot render the episode "
                f"({type(e).__name__}: {e}); give the tools plainer types, or messages the template knows"
            ) from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def start(self, example, seed: int, where: str) -> _Episode:
        instance = self.env.new(where)
        messages = first_messages(self.env, instance, row_of(example), self.data, where)
        if self.env.tools and not self.template_tools:
            messages = with_tools_in_system(messages, self.env.schemas)
        return _Episode(instance, where, seed, messages, self.encode(self.render(messages, True, where)))

    # ---------------------------------------------------------------- the episodes of a batch
    def run(
        self, engine, examples: Sequence, params: SamplingParams, where: Sequence[str] | None = None
    ) -> list[list[Completion]]:
        """For each example, params.n episodes (same order), sampled by `engine` turn by turn; `where` names each
        example's row in error messages."""
        where = list(where) if where is not None else [f"row {i}" for i in range(len(examples))]
        prompt_seeds = params.seeds or [params.seed + i for i in range(len(examples))]
        groups = [
            [self.start(example, prompt_seeds[i], where[i]) for _ in range(params.n)]
            for i, example in enumerate(examples)
        ]
        episodes = [(g, e) for group in groups for g, e in enumerate(group)]
        limit = self.data.max_episode_tokens
        for turn in range(self.data.max_turns):
            active = [(g, e) for g, e in episodes if not e.done]
            if not active:
                break
            budgets = [
                self.max_tokens if limit is None else min(self.max_tokens, limit - len(e.token_ids)) for _, e in active
            ]
            if turn == 0:  # the first turns: each prompt's G samples in one request, as for a single-turn batch
                first = replace(params, max_tokens=max(budgets), seeds=prompt_seeds)
                out = [[c] for group in engine.generate([g[0].prompt_ids for g in groups], first) for c in group]
            else:  # then one request per episode, seeded by (its prompt's seed, its generation, the turn)
                later = replace(
                    params,
                    n=1,
                    max_tokens=max(budgets),
                    seed=episode_seed(params.seed, 0, turn),
                    seeds=[episode_seed(e.seed, g, turn) for g, e in active],
                )
                out = engine.generate([e.prompt_ids + e.token_ids for _, e in active], later)
            for (_, e), [c], budget in zip(active, out, budgets):
                self._turn(e, c, budget, turn)
        return [[self._completion(e) for e in group] for group in groups]

    def _turn(self, e: _Episode, c: Completion, budget: int, turn: int) -> None:
        """Append one sampled turn, then what answers it (tool results, the environment's step), or end."""
        ids, finish = c.token_ids[:budget], c.finish_reason
        if len(ids) < len(c.token_ids):
            finish = "length"
        lps = c.logprobs[: len(ids)] if c.logprobs is not None else None
        e.has_logprobs &= lps is not None
        e.token_ids += ids
        e.loss_mask += [1] * len(ids)
        e.logprobs += lps if lps is not None else [math.nan] * len(ids)
        e.turn_ids.append(ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        e.messages.append({"role": "assistant", "content": text})
        e.sampled.append(len(e.messages) - 1)
        if finish == "length":
            e.done = True
            e.cut = "max_episode_tokens" if budget < self.max_tokens else "max_tokens"
            return
        calls = parse_tool_calls(text, self.env) if self.env.tools else []
        if calls:
            e.tool_calls += len(calls)
            for k, call in enumerate(calls):
                e.invalid_calls += call.error is not None
                result = run_tool(e.instance, call, self.data.tool_timeout_s)
                e.messages.append(
                    {"role": "tool", "name": call.name, "content": result.content, "tool_call_id": f"call_{turn}_{k}"}
                )
                if result.failed:  # the error is the last observation; the episode ends, the step goes on
                    e.tool_errors += 1
                    e.done = True
                    return
        elif self.env.has_step:
            try:
                reply = e.instance.step(text)
            except (Exception, SystemExit) as error:
                e.messages.append({"role": "user", "content": f"error: step raised {type(error).__name__}: {error}"})
                e.tool_errors += 1
                e.done = True
                return
            if reply is None:
                e.done = True
                return
            e.messages += [{"role": "user", "content": reply}] if isinstance(reply, str) else _as_messages(reply)
        else:
            e.done = True  # answered without a call
            return
        if turn == self.data.max_turns - 1:
            e.done, e.cut = True, "max_turns"
            return
        inserted = self._inserted(e)
        limit = self.data.max_episode_tokens
        if limit is not None and len(e.token_ids) + len(inserted) >= limit:
            e.done, e.cut = True, "max_episode_tokens"
            return
        e.token_ids += inserted
        e.loss_mask += [0] * len(inserted)
        e.logprobs += [math.nan] * len(inserted)

    def _inserted(self, e: _Episode) -> list[int]:
        try:
            return inserted_by_template(
                self.tokenizer,
                lambda m, g: self.render(m, g, e.where),
                e.messages,
                e.sampled[-1],
                len(e.messages),
                e.turn_ids[-1],
            )
        except TemplateMismatch as m:
            how = (
                "re-renders the conversation before it once the turn follows"
                if m.turn_text is None
                else f"writes it as {m.turn_text[:60]!r}, not as the text it sampled ({m.sampled_text[:60]!r})"
            )
            raise EnvironmentInputError(
                f"{e.where}: data.environment={self.env.name!r}: at the model's turn {len(e.sampled)} the chat "
                f"template {how}, so the messages that follow cannot be appended token-exact; use a template that "
                "writes the conversation so far as it was sent"
            ) from None

    def _completion(self, e: _Episode) -> Completion:
        reward = None
        if self.env.has_reward:
            try:
                reward = float(e.instance.reward())
            except (Exception, SystemExit) as error:
                raise EnvironmentInputError(
                    f"{e.where}: data.environment={self.env.name!r}: reward() raised {type(error).__name__}: {error}"
                ) from None
            if not math.isfinite(reward):
                raise EnvironmentInputError(
                    f"{e.where}: data.environment={self.env.name!r}: reward() returned {reward}; return a finite number"
                )
        close = getattr(e.instance, "close", None)
        if callable(close):
            close()
        drift = self._drift(e)
        last = e.turn_ids[-1]
        return Completion(
            prompt_ids=e.prompt_ids,
            token_ids=e.token_ids,
            logprobs=e.logprobs if e.has_logprobs else None,
            finish_reason="length" if e.cut else "stop",
            text=self.tokenizer.decode(last, skip_special_tokens=True),
            loss_mask=e.loss_mask,
            episode={
                "messages": e.messages,
                "sampled": e.sampled,
                "turns": len(e.sampled),
                "tool_calls": e.tool_calls,
                "invalid_tool_calls": e.invalid_calls,
                "tool_errors": e.tool_errors,
                "cut": e.cut,
                "drift": drift,
                "environment_reward": reward,
            },
        )

    def _drift(self, e: _Episode) -> bool:
        """Whether re-rendering the conversation (through the model's last turn) gives other tokens than the episode's;
        EnvironmentInputError when it rewrites the text of one of the model's turns."""
        rendered = self.render(e.messages[: e.sampled[-1] + 1], False, e.where)
        at = 0
        for k, ids in enumerate(e.turn_ids):
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            found = rendered.find(text, at)
            if found < 0:
                raise EnvironmentInputError(
                    f"{e.where}: data.environment={self.env.name!r}: re-rendered, the conversation no longer holds "
                    f"the model's turn {k + 1} as it sampled it ({text[:60]!r}): the chat template rewrites the "
                    "history, so a server re-rendering it would show the model turns it never wrote; use a template "
                    "that writes earlier assistant turns as they are"
                )
            at = found + len(text)
        exact = e.prompt_ids + e.token_ids
        return self.encode(rendered)[: len(exact)] != exact


def _as_messages(reply) -> list[dict]:
    if isinstance(reply, dict) and "role" in reply:
        return [dict(reply)]
    if isinstance(reply, list) and all(isinstance(m, dict) and "role" in m for m in reply):
        return [dict(m) for m in reply]
    raise EnvironmentInputError(
        f"step() returned {str(reply)[:60]!r}; return the next user message as a string, a message or a list of "
        "them, or None to end the episode"
    )


# ------------------------------------------------------------------------ what the trainer reads from episodes


def add_environment_reward(
    total: list[float], parts: dict[str, list[float]], completions: Sequence[Completion]
) -> tuple[list[float], dict[str, list[float]]]:
    """The spec's rewards plus the environment's own (its reward() after the episode), when it has one."""
    values = [(c.episode or {}).get("environment_reward") for c in completions]
    if all(v is None for v in values):
        return total, parts
    values = [0.0 if v is None else float(v) for v in values]
    return [t + v for t, v in zip(total, values)], {**parts, ENVIRONMENT_REWARD: values}


def episode_metrics(completions: Sequence[Completion], prefix: str = "episodes/") -> dict[str, float]:
    """Per batch: turns and tool calls per episode, the share of episodes that ended on a tool's error, that a budget
    cut, and whose re-rendering drifts from the trained tokens. {} when the batch holds no live episodes."""
    episodes = [c.episode for c in completions if c.episode is not None]
    if not episodes:
        return {}
    n = len(episodes)
    return {
        f"{prefix}turns_mean": sum(e["turns"] for e in episodes) / n,
        f"{prefix}tool_calls_mean": sum(e["tool_calls"] for e in episodes) / n,
        f"{prefix}invalid_tool_calls_mean": sum(e["invalid_tool_calls"] for e in episodes) / n,
        f"{prefix}tool_errors": sum(e["tool_errors"] > 0 for e in episodes) / n,
        f"{prefix}cut_by_budget": sum(e["cut"] is not None for e in episodes) / n,
        f"{prefix}drift": sum(bool(e["drift"]) for e in episodes) / n,
    }


def conversation_text(completion: Completion) -> str | None:
    """An episode as a samples table shows it: each message on its own, the model's turns marked [loss] (the only
    tokens trained on), tool results and other inserted messages as they were sent. None for a plain completion."""
    episode = completion.episode
    if episode is None:
        return None
    sampled = set(episode["sampled"])
    lines = []
    for i, m in enumerate(episode["messages"]):
        role = m["role"] + (f" {m['name']}" if m.get("name") else "")
        lines.append(f"[{role}{' | loss' if i in sampled else ''}] {m['content']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------ eval and probe: model.generate


class GenerateEngine:
    """The engine eval and the probe run episodes with: `model.generate` on left-padded prompts, greedy at
    temperature 0, else sampled from `seed` (as trainer/evaluate.py decodes); no logprobs."""

    name = "generate"
    overlaps_training = False

    def __init__(self, model, tokenizer, batch_size: int = 32):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Completion]]:
        import torch

        from .engines.hf import _eos_ids

        tok, model = self.tokenizer, self.model
        device = next(model.parameters()).device
        stop = set(_eos_ids(model, tok))
        was_training = model.training
        model.eval()
        out: list[list[Completion]] = []
        try:
            for start in range(0, len(prompts), self.batch_size):
                chunk = [list(p) for p in prompts[start : start + self.batch_size] for _ in range(params.n)]
                batch = tok.pad({"input_ids": chunk}, padding=True, return_tensors="pt").to(device)
                kwargs = dict(max_new_tokens=params.max_tokens, pad_token_id=tok.pad_token_id)
                if params.temperature > 0:
                    kwargs.update(do_sample=True, temperature=params.temperature)
                else:
                    kwargs.update(do_sample=False)
                with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                    torch.manual_seed((params.seeds[start] if params.seeds else params.seed + start) % 2**63)
                    new = model.generate(**batch, **kwargs)[:, batch["input_ids"].shape[1] :]
                for k, row in enumerate(new.tolist()):
                    ids = row[: next((i + 1 for i, t in enumerate(row) if t in stop), len(row))]  # through its eos
                    if k % params.n == 0:
                        out.append([])
                    out[-1].append(
                        Completion(
                            prompt_ids=chunk[k],
                            token_ids=ids,
                            logprobs=None,
                            finish_reason="stop" if stop & set(ids) else "length",
                            text=tok.decode(ids, skip_special_tokens=True),
                        )
                    )
        finally:
            model.train(was_training)
        return out


def run_held_out(
    model,
    tokenizer,
    examples: Sequence,
    data: DataConfig,
    max_tokens: int,
    temperature: float,
    batch_size: int,
    seed: int = 0,
) -> list[Completion]:
    """One episode per held-out example, through model.generate (GenerateEngine): eval and the probe."""
    runner = EpisodeRunner.from_config(data, tokenizer, max_tokens)
    params = SamplingParams(n=1, max_tokens=max_tokens, temperature=temperature, seed=seed)
    groups = runner.run(
        GenerateEngine(model, tokenizer, batch_size),
        examples,
        params,
        [f"held-out row {i}" for i in range(len(examples))],
    )
    return [group[0] for group in groups]
