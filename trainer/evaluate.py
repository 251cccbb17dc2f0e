"""Held-out evaluation, decoded exactly as a standalone user decodes.

`generate` is what a user writes by hand — chat template, left padding, `model.generate` —
and nothing else: no rollout engine, no logprob bookkeeping, no trainer-side patches. In-training
eval (every `eval.every` steps) and the pipeline's final eval both decode through it, and
tests/test_trainer.py checks it against a hand-written `model.generate` call, so eval cannot quietly
decode differently from what users will see. `evaluate_with_samples` also returns `eval.log_samples` of the
completions as sample rows (trainer/samples.py), which the trainer and the eval stage write and log.

The held-out set is finite, so every score carries its standard error: `eval/reward_stderr` (the sample standard
deviation of the per-prompt rewards over sqrt(n)) and `eval/accuracy_stderr` (the binomial sqrt(p(1-p)/n)).
With data.environment each held-out row is one episode of the environment (trainer/episodes.py run_held_out:
model.generate turn by turn, the tools run between turns), scored on its last turn; `eval/episodes/*` count its
turns, tool calls, errors and cuts.
`score_held_out` also keeps the per-prompt scores, in the held-out set's order, so two models scored on the same
prompts can be compared pair by pair (sweeps/baseline.py: a trial against its base model).

Two choices serve a sweep's statistics (sweeps/statistics.py):
- `eval.samples_per_prompt: k` samples k completions of each prompt; a prompt's score is the mean of its k, and every
  standard error is taken over prompts (the sample deviation of the per-prompt means over sqrt(n)), so k samples
  narrow the interval by what they add about each prompt, never as if they were k·n independent prompts.
- `eval.split` scores one part of the held-out set: `split_indices` deals the rows, by a seeded shuffle, into
  selection and confirmation rows (trainer/config.py; sweeps/split.py records the rule on the study); the part's rows
  keep their order.
"""

from __future__ import annotations

import math

import torch

from .config import DataConfig, EvalConfig, HeldOutSplit, split_indices
from .data import Example, render_prompt, reward_columns
from .samples import sample_rows


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: list[str],
    max_tokens: int,
    temperature: float = 0.0,
    batch_size: int = 32,
    seed: int = 0,
    data: DataConfig | None = None,
) -> tuple[list[str], list[int], list[str]]:
    """(texts, generated token counts, finish reasons). A count is the ids the model generated, up to and including
    its end-of-sequence token — never the decoded text re-encoded (an invalid byte would count three), never above
    max_tokens; a finish reason is 'stop' (it generated an end-of-sequence token) or 'length' (it ran to
    max_tokens)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    texts: list[str] = []
    lengths: list[int] = []
    endings: list[str] = []
    stop = _eos_ids(model, tokenizer)
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = [render_prompt(tokenizer, p, data) for p in prompts[start : start + batch_size]]
            batch = tokenizer.pad({"input_ids": chunk}, padding=True, return_tensors="pt").to(device)
            kwargs = dict(max_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id)
            if temperature > 0:
                kwargs.update(do_sample=True, temperature=temperature)
            else:
                kwargs.update(do_sample=False)
            # sampling is seeded per batch, in a forked RNG: eval never moves the training run's random state
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed + start)
                out = model.generate(**batch, **kwargs)
            new = out[:, batch["input_ids"].shape[1] :]
            texts += tokenizer.batch_decode(new, skip_special_tokens=True)
            lengths += [_generated_length(row.tolist(), stop) for row in new]
            endings += ["stop" if stop & set(row.tolist()) else "length" for row in new]
    finally:
        model.train(was_training)
    return texts, lengths, endings


def _eos_ids(model, tokenizer) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos
    return set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


def _generated_length(ids: list[int], stop: set[int]) -> int:
    """Tokens generated: up to the first end-of-sequence token, inclusive (what follows it is padding)."""
    return next((i + 1 for i, t in enumerate(ids) if t in stop), len(ids))


def evaluate(
    model, tokenizer, examples: list[Example], cfg: EvalConfig, rewards, data: DataConfig | None = None
) -> dict[str, float]:
    """eval/reward, eval/accuracy (the share scoring 1 on rewards.accuracy_name(cfg.reward): absent when the
    rewards hold no correctness reward) and eval/mean_length (generated tokens, see `generate`). `data` renders the
    prompts (system, template)."""
    return evaluate_with_samples(model, tokenizer, examples, cfg, rewards, data)[0]


def evaluate_with_samples(
    model, tokenizer, examples: list[Example], cfg: EvalConfig, rewards, data: DataConfig | None = None, step: int = 0
) -> tuple[dict[str, float], list[dict]]:
    """(`evaluate`'s metrics, cfg.log_samples sample rows of its completions, marked with `step`)."""
    metrics, _, rows = score_held_out(model, tokenizer, examples, cfg, rewards, data, step)
    return metrics, rows


def score_held_out(
    model, tokenizer, examples: list[Example], cfg: EvalConfig, rewards, data: DataConfig | None = None, step: int = 0
) -> tuple[dict[str, float], dict[str, list[float]], list[dict]]:
    """(metrics with their standard errors, per-prompt scores {'reward', 'accuracy', 'length'} in the order of the
    rows scored — `examples`, or its `eval.split` part — each the mean of the prompt's eval.samples_per_prompt
    completions, sample rows)."""
    examples = held_out_part(examples, cfg.split)
    if not examples:
        return {}, {}, []
    k = cfg.samples_per_prompt
    drawn = [e for e in examples for _ in range(k)]  # each prompt's k samples side by side
    episodes = None
    if data is not None and data.environment is not None:  # the environment's episodes, decoded the same way
        from .episodes import add_environment_reward, conversation_text, episode_metrics, run_held_out

        episodes = run_held_out(model, tokenizer, drawn, data, cfg.max_tokens, cfg.temperature, cfg.batch_size)
        texts = [c.text for c in episodes]
        lengths = [sum(c.loss_mask) for c in episodes]  # the tokens the model generated, over all its turns
        endings = [c.finish_reason for c in episodes]
    else:
        texts, lengths, endings = generate(
            model, tokenizer, [e.prompt for e in drawn], cfg.max_tokens, cfg.temperature, cfg.batch_size, data=data
        )
    total, parts = rewards(texts, [e.answer for e in drawn], [e.prompt for e in drawn], **reward_columns(drawn))
    if episodes is not None:
        total, parts = add_environment_reward(total, parts, episodes)
    accuracy_name = rewards.accuracy_name(cfg.reward)
    per_sample = {"reward": [float(r) for r in total], "length": [float(n) for n in lengths]}
    if accuracy_name is not None:
        per_sample["accuracy"] = [1.0 if a >= 1.0 else 0.0 for a in parts[accuracy_name]]
    per_prompt = {name: prompt_means(values, k) for name, values in per_sample.items()}
    out = held_out_metrics(per_prompt, k)
    rows = sample_rows(
        step,
        [e.prompt for e in drawn],
        [e.answer for e in drawn],
        texts,
        endings,
        lengths,
        total,
        parts,
        cfg.log_samples,
        None if episodes is None else [conversation_text(c) for c in episodes],
    )
    if episodes is not None:
        out.update(episode_metrics(episodes, prefix="eval/episodes/"))
    return out, per_prompt, rows


def held_out_metrics(per_prompt: dict[str, list[float]], samples_per_prompt: int = 1) -> dict[str, float]:
    """eval/reward, eval/mean_length and eval/accuracy with their standard errors, over prompts. With one sample a
    prompt, accuracy's is the binomial sqrt(p(1-p)/n); with k, the per-prompt means' (sweeps/statistics.py)."""
    out = {
        "eval/reward": mean(per_prompt["reward"]),
        "eval/reward_stderr": stderr(per_prompt["reward"]),
        "eval/mean_length": mean(per_prompt["length"]),
    }
    if "accuracy" in per_prompt:
        p = mean(per_prompt["accuracy"])
        out["eval/accuracy"] = p
        n = len(per_prompt["accuracy"])
        out["eval/accuracy_stderr"] = (
            math.sqrt(p * (1 - p) / n) if samples_per_prompt == 1 else stderr(per_prompt["accuracy"])
        )
    return out


def prompt_means(values: list[float], k: int) -> list[float]:
    """The mean of each prompt's k consecutive samples."""
    return values if k == 1 else [sum(values[i : i + k]) / k for i in range(0, len(values), k)]


def held_out_part(examples: list, split: HeldOutSplit | None) -> list:
    """The rows of `examples` that `split` scores (all of them without one)."""
    if split is None:
        return examples
    selection, confirmation = split_indices(len(examples), split.seed, split.confirm_share)
    return [examples[i] for i in (selection if split.part == "selection" else confirmation)]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def stderr(values: list[float]) -> float:
    """The standard error of the mean: sample standard deviation (n - 1) over sqrt(n); 0 for a single value."""
    n = len(values)
    if n < 2:
        return 0.0
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1) / n)
