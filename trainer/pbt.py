"""Population-based training's decisions (Jaderberg et al., 2017), as pure functions of the scores: who copies whom,
and with which hyperparameters it goes on. No model, no I/O; the population runner (trainer/population.py) acts on
them. The choices, on purpose:

- **Rank on one score.** Every `ready` steps the members are ranked on their held-out *selection* score (the sweep's
  objective, best first; ties broken by member index, so a rank never depends on dict order).
- **Truncation selection, as Ray Tune's PBT.** The bottom `quantile` of the ranking (ceil(P × quantile), at most half
  the population) each copy a member drawn from the top `quantile`: adapter, optimizer, scheduler, RNG, sampler and
  health-gate state — the whole training state, so the copy goes on exactly as its source would.
- **Explore by perturbing or resampling.** Each continuous knob of the copy is, with probability
  `resample_probability`, drawn afresh from the space; otherwise its source's value is multiplied by one of `perturb`
  (x0.8 or x1.25), then clipped into the space's [low, high] (a schedule never leaves the range the sweep declared).
- **A categorical knob travels with its adapter.** lora.r cannot change inside an adapter: a member's rank is drawn at
  the start and a copy takes its source's rank with its weights; it is never perturbed.
- **A collapsed member is replaced at once.** A member whose health gate trips is replaced at the end of that step by a
  copy of a top member (ranked on the last scores; before the first ranking, a healthy member drawn at random), with
  perturbed hyperparameters, whether or not it is a ranking step.
- **Seeded per step.** Each decision draws from `random.Random(f"{seed}:{step}")`: the same scores give the same
  decisions, and a resumed population needs no random state of its own.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

POPULATION_FILE = "population.json"  # a population's save (trainer/population.py): what --resume reads


@dataclass(frozen=True)
class Knob:
    """One continuous hyperparameter the population schedules (a dotted spec field), and its range."""

    name: str
    low: float
    high: float
    log: bool = False

    def draw(self, rng: random.Random) -> float:
        if self.log:
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return rng.uniform(self.low, self.high)

    def clip(self, value: float) -> float:
        return min(self.high, max(self.low, value))


@dataclass(frozen=True)
class Policy:
    """How the population exploits and explores (see the module's choices)."""

    knobs: tuple[Knob, ...]
    fixed: dict[str, list] = field(default_factory=dict)  # categorical knobs: drawn once, travel with the adapter
    quantile: float = 0.25
    perturb: tuple[float, ...] = (0.8, 1.25)
    resample_probability: float = 0.25
    maximize: bool = True
    seed: int = 0

    def rng(self, step: int) -> random.Random:
        return random.Random(f"{self.seed}:{step}")


@dataclass(frozen=True)
class Replacement:
    """Member `member` copies `source`'s whole training state at the end of `step` and goes on with `hparams`."""

    member: int
    source: int
    step: int
    reason: str  # "exploit" (bottom of the ranking) or "collapsed" (its health gate tripped)
    hparams: dict  # the copy's hyperparameters from step + 1 on (its fixed knobs are its source's)
    explored: dict  # knob -> how it was chosen: "x0.8", "x1.25" or "resample"


def initial_hparams(policy: Policy, population: int) -> list[dict]:
    """Each member's starting hyperparameters, drawn from the space (seeded by the policy's seed and step 0)."""
    rng = policy.rng(0)
    members = []
    for _ in range(population):
        hp = {k.name: k.draw(rng) for k in policy.knobs}
        hp.update({name: rng.choice(choices) for name, choices in policy.fixed.items()})
        members.append(hp)
    return members


def rank(policy: Policy, scores: dict[int, float]) -> list[int]:
    """Members best first on their scores (NaN last); ties by member index."""
    sign = -1.0 if policy.maximize else 1.0
    return sorted(
        scores, key=lambda m: (math.isnan(scores[m]), sign * scores[m] if not math.isnan(scores[m]) else 0, m)
    )


def quantile_size(policy: Policy, population: int) -> int:
    """How many members the bottom (and the top) of a ranking holds: ceil(P × quantile), at most P // 2."""
    return min(population // 2, math.ceil(population * policy.quantile))


def explore(policy: Policy, source_hparams: dict, rng: random.Random) -> tuple[dict, dict]:
    """A copy's hyperparameters: each knob resampled or its source's perturbed (clipped); fixed knobs kept."""
    hp, how = dict(source_hparams), {}
    for knob in policy.knobs:
        if rng.random() < policy.resample_probability:
            hp[knob.name], how[knob.name] = knob.draw(rng), "resample"
        else:
            factor = rng.choice(policy.perturb)
            hp[knob.name], how[knob.name] = knob.clip(source_hparams[knob.name] * factor), f"x{factor:g}"
    return hp, how


def decide(
    policy: Policy,
    step: int,
    hparams: dict[int, dict],
    scores: dict[int, float] | None,
    collapsed: set[int] = frozenset(),
    ready: bool = True,
) -> list[Replacement]:
    """The replacements at the end of `step`. `scores`: the members' selection scores of the last ranking (None before
    the first). On a ranking step (`ready`) the bottom of the ranking copies its top; on any step a collapsed member
    copies a top member (a healthy member drawn at random before the first ranking)."""
    rng = policy.rng(step)
    healthy = [m for m in sorted(hparams) if m not in collapsed]
    if not healthy:
        return []
    ranked = [m for m in rank(policy, scores) if m in healthy] if scores is not None else []
    q = quantile_size(policy, len(hparams))
    top = ranked[: max(1, q)] or healthy
    losers = sorted(collapsed)
    if ready and ranked and q:
        losers += [m for m in ranked[len(ranked) - q :] if m not in top]
    out = []
    for member in losers:
        source = rng.choice(top)
        hp, how = explore(policy, hparams[source], rng)
        out.append(Replacement(member, source, step, "collapsed" if member in collapsed else "exploit", hp, how))
    return out
