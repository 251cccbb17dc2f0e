"""The rollout interface: what any engine — HF generate in-process, or vLLM in its own process —
returns for a batch of prompts.

An engine is given prompt token ids and sampling settings and returns, for each prompt, G
completions with their token ids, the per-token logprobs of the distribution it sampled from, and
why each stopped ('stop': an end token or stop string; 'length': hit max_tokens).

Which logprobs: those of the *policy at the sampling temperature* — log_softmax(logits / T) — before
top-k/top-p/min-p truncation and repetition/frequency/presence penalties. That is the distribution the
trainer computes, so engine and trainer logprobs of the same tokens must agree (the
`sampling/sampling_logp_difference/*` metrics check it every step, and catch stale or double-applied adapters), and
the importance ratio compares like with like whatever sampling penalties a sweep turns on. The tokens
themselves are drawn from the penalised, truncated distribution; like TRL, Ballast does not correct
for that distortion in the ratio. (vLLM reports this distribution exactly only without penalties and
truncation; engines/vllm.py says how it handles the rest.)
An engine that cannot give logprobs returns None for them; the trainer then fails or recomputes,
it never silently treats the ratio as 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol


@dataclass
class SamplingParams:
    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    seed: int = 0
    min_tokens: int = 0
    # One seed per prompt: prompt i's n completions are drawn from a generator of their own seeded seeds[i], so what a
    # prompt gets does not depend on the other prompts of the batch (a rank's shard of the global batch, another
    # trial's rows). None: one stream for the whole batch, seeded `seed` (what model.generate draws with that seed).
    seeds: list[int] | None = None

    @classmethod
    def from_rollout(cls, rollout, n: int, seed: int, seeds: list[int] | None = None) -> SamplingParams:
        return cls(
            n=n,
            max_tokens=rollout.max_tokens,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            min_p=rollout.min_p,
            repetition_penalty=rollout.repetition_penalty,
            frequency_penalty=rollout.frequency_penalty,
            presence_penalty=rollout.presence_penalty,
            stop=list(rollout.stop),
            seed=seed,
            min_tokens=rollout.min_tokens,
            seeds=seeds,
        )


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: Literal["stop", "length"]
    text: str
    # Which of token_ids carry loss (1) and which were inserted between the model's turns (0: a tool result, a user
    # message, chat-template glue), for a multi-turn episode (engines/offline.py). None: every token was sampled.
    # Inserted tokens are attended to but get no loss, and their logprobs (NaN) are never read.
    loss_mask: list[int] | None = None
    # A live multi-turn episode's conversation and counts (trainer/episodes.py): messages, which are the model's
    # turns, turns, tool calls, tool errors, the budget that cut it, drift, the environment's reward. None otherwise.
    episode: dict | None = None

    def __post_init__(self):
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"completion has {len(self.token_ids)} tokens but {len(self.logprobs)} logprobs; "
                "the engine must return one logprob per sampled token"
            )
        if self.loss_mask is not None and len(self.loss_mask) != len(self.token_ids):
            raise ValueError(
                f"completion has {len(self.token_ids)} tokens but a loss_mask of {len(self.loss_mask)}; "
                "the engine must mark each token as sampled (1) or inserted (0)"
            )


class RolloutEngine(Protocol):
    name: str
    # True: generate() may run on another thread while the trainer updates its weights (rollouts overlap training,
    # trainer/rollouts.py); False (or absent): it samples the trainer's own model and runs in the trainer's thread
    overlaps_training: bool

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt, params.n completions (same order as prompts)."""

    def sync_weights(self, model, step: int) -> object:
        """Make the engine sample from the trainer's current weights (no-op for an in-process engine). An engine in
        another process also proves it serves them, or raises (vLLM: returns what it proved, a ServedPolicy)."""

    def close(self) -> None:
        """Release the engine (stop a server process)."""
