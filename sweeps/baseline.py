"""A sweep's answer is relative: the baseline every trial is read against, and a trial's gain over it.

Before its first trial a sweep scores what its trials start from — the base model, or the fork source — on the
trials' held-out set with the trials' eval settings (tasks/eval.py `eval_baseline`), and stores the result on the
study (user attr `ballast.baseline`: the eval metrics, their standard errors and the per-prompt scores), so every
worker and every resume reads the same baseline and it is measured once.

A trial's gain is paired, prompt by prompt: the trial and the baseline answered the same held-out prompts, so the
gain is the mean of the per-prompt differences and its uncertainty the standard error of that mean (for accuracy,
the paired form of the binomial standard error). `±` everywhere is the half-width of a 95 % interval, Z95 standard
errors. A trial "beats the base model beyond noise" when its gain in the objective's direction exceeds that
half-width; "best" is said only of such a trial. Objectives that are not held-out scores (`stability`, step
metrics) have no baseline: their trials are ranked as before, and the summary says there is no baseline to beat.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from trainer.evaluate import mean, stderr

BASELINE_ATTR = "ballast.baseline"  # study user attr: Baseline as JSON
Z95 = 1.96  # ± is a 95 % interval: Z95 standard errors
PER_PROMPT = {"eval/reward": "reward", "eval/accuracy": "accuracy", "eval/mean_length": "length"}


@dataclass
class Baseline:
    source: str  # "base model <name>" or the fork checkpoint's URI
    metrics: dict[str, float]  # eval/* with their *_stderr
    per_prompt: dict[str, list[float]] = field(default_factory=dict, repr=False)
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Baseline:
        return cls(**json.loads(text))

    def score(self, key: str) -> float | None:
        return self.metrics.get(key)

    def stderr_of(self, key: str) -> float | None:
        return self.metrics.get(f"{key}_stderr")


def load_baseline(study) -> Baseline | None:
    text = study.user_attrs.get(BASELINE_ATTR)
    return Baseline.from_json(text) if text else None


@dataclass
class Gain:
    """A trial's score on one held-out metric against the baseline's, paired over the same prompts."""

    metric: str
    score: float
    baseline: float
    gain: float  # score - baseline
    stderr: float  # of the gain (paired)
    direction: str = "maximize"

    @property
    def ci95(self) -> float:
        return Z95 * self.stderr

    @property
    def beats_baseline(self) -> bool:
        """Better than the baseline by more than the 95 % half-width, in the objective's direction."""
        better = self.gain if self.direction == "maximize" else -self.gain
        return better > self.ci95

    def describe(self) -> str:
        """'eval/accuracy 0.61 vs 0.29 for the base model (+0.32 ± 0.06)'."""
        return (
            f"{self.metric} {self.score:.3g} vs {self.baseline:.3g} for the base model "
            f"({self.gain:+.2g} ± {self.ci95:.2g})"
        )


def paired_gain(metric: str, trial: list[float], base: list[float], direction: str = "maximize") -> Gain:
    """The gain of `trial` over `base`, per-prompt scores of the same prompts in the same order."""
    if len(trial) != len(base) or not base:
        raise ValueError(
            f"{metric}: the trial scored {len(trial)} held-out prompts and the baseline {len(base)}; a paired "
            "comparison needs the same prompts (keep data.* and eval.* out of the sweep's space)"
        )
    diffs = [t - b for t, b in zip(trial, base)]
    return Gain(metric, mean(trial), mean(base), mean(diffs), stderr(diffs), direction)


def gain_of(metric: str, per_prompt: dict[str, list[float]], baseline: Baseline | None, direction: str):
    """The trial's Gain on `metric` (an eval/* objective), or None when there is no baseline to compare with."""
    name = PER_PROMPT.get(metric)
    if baseline is None or name is None or name not in per_prompt or name not in baseline.per_prompt:
        return None
    return paired_gain(metric, per_prompt[name], baseline.per_prompt[name], direction)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
