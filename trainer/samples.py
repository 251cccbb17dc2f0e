"""Samples you can read: what the model wrote, k completions per training step and per eval, as JSON lines.

Metrics summarise a collapse; the completions show it. Every step appends `rollout.log_samples` rows to
`samples.jsonl` in the run directory, every eval `eval.log_samples` rows to `eval_samples.jsonl`, one row per
completion:

    {"step", "prompt", "answer", "completion", "reward", "rewards/<component>"..., "finish_reason", "truncated",
     "tokens"}

`reward` is the weighted total, `rewards/<component>` each reward's raw value under its metric name, `tokens` the
completion's token count. A multi-turn episode's row adds `conversation`: every message, the model's turns marked
`| loss` (the only tokens trained on), tool calls as it wrote them and the tools' results as they were sent.
Which k: the first truncated completions (batch order; k - 1 of them at most when k > 1),
because a completion that ran into max_tokens is where a collapse starts; then the rest alternating best- and
worst-paid, so the step's extremes are there. Rows keep batch order. The trainer only writes the files (no MLflow
here; trainer/records.py appends them, safe under a kill); tasks/record.py logs them to MLflow as tables. A resumed
run drops rows of steps after its checkpoint, as it does with metrics.jsonl.
"""

from __future__ import annotations

from collections.abc import Sequence

SAMPLES_FILE = "samples.jsonl"
EVAL_SAMPLES_FILE = "eval_samples.jsonl"


def pick(rewards: Sequence[float], truncated: Sequence[bool], k: int) -> list[int]:
    """Indices of the k completions to show, in batch order: truncated ones first (k - 1 at most when k > 1),
    then the others alternating best- and worst-paid."""
    if k <= 0:
        return []
    chosen = [i for i, cut in enumerate(truncated) if cut][: max(1, k - 1)]
    taken = set(chosen)
    rest = sorted((i for i in range(len(rewards)) if i not in taken), key=lambda i: (-rewards[i], i))
    take_best = True
    while len(chosen) < k and rest:
        chosen.append(rest.pop(0) if take_best else rest.pop())
        take_best = not take_best
    return sorted(chosen)


def sample_rows(
    step: int,
    prompts: Sequence[str],
    answers: Sequence[str],
    texts: Sequence[str],
    finish_reasons: Sequence[str],
    tokens: Sequence[int],
    total: Sequence[float],
    parts: dict[str, Sequence[float]],
    k: int,
    conversations: Sequence[str | None] | None = None,
) -> list[dict]:
    """The k rows (see the module docstring) of one batch of completions, given as parallel lists; `conversations`:
    each multi-turn episode's whole conversation (trainer/episodes.py conversation_text; None for a completion)."""
    truncated = [reason == "length" for reason in finish_reasons]
    rows = []
    for i in pick(total, truncated, k):
        rows.append(
            {
                "step": step,
                "prompt": prompts[i],
                "answer": answers[i],
                "completion": texts[i],
                "reward": float(total[i]),
                **{f"rewards/{name}": float(v[i]) for name, v in parts.items()},
                "finish_reason": finish_reasons[i],
                "truncated": truncated[i],
                "tokens": int(tokens[i]),
            }
        )
        if conversations is not None and conversations[i] is not None:
            rows[-1]["conversation"] = conversations[i]
    return rows
