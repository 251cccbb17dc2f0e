"""The statistics a sweep's answer rests on, in one place: what `±` means, when a trial is said to beat the base model,
when a rung of the pruner may stop a trial, and how optimistic a score measured on the prompts that chose it is.

- **`±` is the half-width of a 95 % interval** of the quantity it stands beside, the interval the decision next to it
  reads, stated once on each surface: a gain is paired prompt by prompt (trainer/evaluate.py scores a prompt as the
  mean of its eval.samples_per_prompt completions; the standard error is taken over prompts), and where one claim is
  chosen from among m compared trials the interval is simultaneous over the m (Bonferroni: z for 0.05 / m, two-sided),
  so the best of m has no head start. A ✓ means the interval lies wholly on the better side of zero.
- **Claims are made where nothing was chosen.** Trials are ranked on selection prompts, and those gains are shown as
  what ranked them, never as a claim. The claim is made on confirmation prompts (sweeps/split.py) over the `top_k`
  trials confirmed there (m = top_k); with nothing kept back, on the selection prompts over every completed trial
  (m = their number), beside the optimism of reading the winner on the prompts that chose it (`winners_curse`).
- **Across seeds** (`holds_across_seeds`): a setting beats the base model when its confirmed gain and the gain of every
  retrained seed each clear their interval. Demanding every seed is the intersection of tests, each at the level
  above, so the claim's false-positive rate is no more than one test's, and a setting that won by a lucky seed fails
  on the next one.
- **A rung decision** (`behind_beyond_noise`): the pruner may stop a trial only when some other trial scored better
  at the same step by more than the 95 % interval of the difference (unpaired: the two trials' standard errors added
  in quadrature, since the pruner sees their means alone), so being one prompt behind is never enough.

tests/test_sweep_statistics.py proves the verdict's rule on simulated studies through sweeps/confirmation.py, the code
the real verdict runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

LEVEL = 0.95  # every interval: 95 %
Z95 = 1.96  # ± is Z95 standard errors for one comparison (the 97.5 % normal quantile, as everyone writes it)


def z_simultaneous(m: int, level: float = LEVEL) -> float:
    """z of two-sided intervals that hold together for m comparisons (Bonferroni): 1.96 for one, 2.39 for 3."""
    if m <= 1 and level == LEVEL:
        return Z95
    return NormalDist().inv_cdf(1 - (1 - level) / (2 * max(1, m)))


def plus_minus(z: float, m: int) -> str:
    """What ± means where it is shown, in words."""
    if m <= 1:
        return "± is a 95 % interval"
    return f"± is a 95 % interval simultaneous over the {m} trials compared (Bonferroni, z = {z:.2f})"


@dataclass
class Spread:
    """A gain across training seeds."""

    gains: list[float]

    @property
    def n(self) -> int:
        return len(self.gains)

    @property
    def mean(self) -> float:
        return sum(self.gains) / len(self.gains)

    @property
    def sd(self) -> float:
        if self.n < 2:
            return 0.0
        m = self.mean
        return math.sqrt(sum((g - m) ** 2 for g in self.gains) / (self.n - 1))

    def describe(self) -> str:
        """'+0.27 across 3 seeds (+0.21 to +0.31, sd 0.05)'."""
        if self.n == 1:
            return f"{self.gains[0]:+.2g} on its one seed"
        lo, hi = min(self.gains), max(self.gains)
        return f"{self.mean:+.2g} across {self.n} seeds ({lo:+.2g} to {hi:+.2g}, sd {self.sd:.2g})"


def clears(gain: float, half_width: float, direction: str = "maximize") -> bool:
    """The interval gain ± half_width lies wholly on the better side of zero."""
    better = gain if direction == "maximize" else -gain
    return better > half_width


def holds_across_seeds(seed_gains: list[tuple[float, float]], direction: str = "maximize") -> bool:
    """(gain, half-width) of each training seed — the confirmed trial's first: every one clears its interval."""
    return bool(seed_gains) and all(clears(g, h, direction) for g, h in seed_gains)


def survived(selection_gain: float, kept_gain: float, direction: str = "maximize") -> float | None:
    """The fraction of the winner's selection gain that is left after confirmation and seeds (None when the selection
    gain was no gain)."""
    sel = selection_gain if direction == "maximize" else -selection_gain
    kept = kept_gain if direction == "maximize" else -kept_gain
    return kept / sel if sel > 0 else None


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals]: how far the best of n equal trials lands above their common mean, in
    standard errors (0 for one, 0.85 for 3, 1.27 for 6, 1.63 for 12)."""
    if n <= 1:
        return 0.0
    dist, step, total = NormalDist(), 0.002, 0.0
    x = -8.0
    while x < 8.0:
        total += x * n * dist.pdf(x) * dist.cdf(x) ** (n - 1) * step
        x += step
    return total


def winners_curse(n_trials: int, stderr: float) -> float:
    """The upward bias of the best of n_trials equal trials read on the prompts that chose it: a lower bound of the
    optimism of a selection-only verdict."""
    return expected_max_normal(n_trials) * stderr


def behind_beyond_noise(
    value: float, stderr: float, other: float, other_stderr: float, direction: str = "maximize"
) -> bool:
    """`other` scored better than `value` by more than the 95 % interval of the difference of two independent means."""
    gap = (other - value) if direction == "maximize" else (value - other)
    return gap > Z95 * math.sqrt(stderr**2 + other_stderr**2)
