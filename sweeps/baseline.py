"""A sweep's answer is relative: the baseline every trial is read against, and a trial's gain over it.

Before its first trial a sweep scores what its trials start from — the base model, or the fork source — on the
trials' held-out set with the trials' eval settings (tasks/eval.py `eval_baseline`), and stores the result on the
study (user attr `ballast.baseline`: the eval metrics, their standard errors and the per-prompt scores), so every
worker and every resume reads the same baseline and it is measured once.

The baseline is scored on every held-out prompt, selection and confirmation ones alike (sweeps/split.py), and read
part by part: a trial, which scored the selection prompts alone, is paired with the baseline's selection prompts.

A trial's gain is paired, prompt by prompt: the trial and the baseline answered the same held-out prompts, so the
gain is the mean of the per-prompt differences and its uncertainty the standard error of that mean (for accuracy,
the paired form of the binomial standard error). `±` is the half-width of a 95 % interval, `z` standard errors: 1.96
for one comparison, more where one claim is chosen from several (sweeps/statistics.py says when). A gain "clears"
its interval when it is above `±` in the objective's direction. Objectives that are not held-out scores
(`stability`, step metrics) have no baseline: their trials are ranked as before, and the summary says there is no
baseline to beat.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from trainer.evaluate import mean, stderr

from .statistics import Z95, clears

BASELINE_ATTR = "ballast.baseline"  # study user attr: Baseline as JSON
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
    z: float = Z95  # ± is z standard errors: 1.96, or simultaneous over several compared trials
    n: int = 0  # prompts paired

    @property
    def ci95(self) -> float:
        """The half-width `±`: of a 95 % interval (simultaneous over the trials compared, when z says so)."""
        return self.z * self.stderr

    @property
    def beats_baseline(self) -> bool:
        """Better than the baseline by more than the half-width, in the objective's direction."""
        return clears(self.gain, self.ci95, self.direction)

    def describe(self) -> str:
        """'eval/accuracy 0.61 vs 0.29 for the base model (+0.32 ± 0.06)'."""
        return (
            f"{self.metric} {self.score:.3g} vs {self.baseline:.3g} for the base model "
            f"({self.gain:+.2g} ± {self.ci95:.2g})"
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "ci95": self.ci95, "beats_baseline": self.beats_baseline}


def paired_gain(
    metric: str, trial: list[float], base: list[float], direction: str = "maximize", z: float = Z95
) -> Gain:
    """The gain of `trial` over `base`, per-prompt scores of the same prompts in the same order."""
    if len(trial) != len(base) or not base:
        raise ValueError(
            f"{metric}: the trial scored {len(trial)} held-out prompts and the baseline {len(base)}; a paired "
            "comparison needs the same prompts (keep data.* and eval.* out of the sweep's space)"
        )
    diffs = [t - b for t, b in zip(trial, base)]
    return Gain(metric, mean(trial), mean(base), mean(diffs), stderr(diffs), direction, z, len(base))


def gain_of(
    metric: str, per_prompt: dict[str, list[float]], baseline: Baseline | None, direction: str, split=None
) -> Gain | None:
    """The trial's Gain on `metric` (an eval/* objective) over the baseline's selection prompts (`split`, a
    sweeps/split.py Split; None: the baseline's every prompt), or None when there is no baseline to compare with."""
    name = PER_PROMPT.get(metric)
    if baseline is None or name is None or name not in per_prompt or name not in baseline.per_prompt:
        return None
    base = baseline.per_prompt[name]
    return paired_gain(metric, per_prompt[name], split.selection(base) if split else base, direction)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
