"""After the search: the verdict a user can bet on, made on prompts no trial decision read and across training seeds.

    ranked on selection ─► top_k scored on confirmation ─► winner (and runner-up) retrained with seeds - 1 more seeds
                                                             ─► "beats the base model" only if it holds on every seed

`confirm` reads the finished study and asks two functions for what it cannot compute from the study alone, so the real
sweep (flows/sweep.py: a checkpoint reloaded and evaluated, a pipeline run per seed) and a simulated one
(tests/test_sweep_statistics.py) go through the same code:

- `score(trial)` → per-prompt scores of the trial's final checkpoint on the confirmation prompts (`trial` None: the
  base model's on a confirmation file of the user's own; on a split the baseline's are read from the study);
- `retrain(jobs)` → a `SeedResult` per `SeedJob`: the trial's settings trained again with another seed and scored on
  the prompts the claim is made on. The caller may run the jobs at once (`concurrent_trials`).

The rule (sweeps/statistics.py says why):
1. The COMPLETE trials are ranked by their objective, on the selection prompts.
2. With a confirmation set (sweeps/split.py) the first `confirm.top_k` are scored on it, each paired with the
   baseline, `±` simultaneous over those k; the best there is the winner, the next the runner-up. With nothing kept
   back the claim falls to the selection prompts, `±` simultaneous over every completed trial, and the verdict says
   so beside the optimism it carries.
3. A candidate that clears its interval is trained `confirm.seeds - 1` more times (other optim.seed and rollout.seed);
   a candidate "beats the base model" when every seed clears its interval, the same `±`. The verdict names the first
   candidate, winner then runner-up, that does; else "no trial beat the base model".
4. What survived: the claimed (else best) candidate's mean gain over its seeds on the judging prompts, as a fraction
   of the gain that selected it.

Every score is kept on the study as it comes (user attr `ballast.confirmation.scores`), so an interrupted
confirmation resumes where it stopped, and the result lands as `ballast.confirmation` (Confirmation as JSON).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import optuna
from optuna.trial import FrozenTrial, TrialState

from .baseline import PER_PROMPT, Baseline, Gain, paired_gain
from .space import SweepSpec
from .split import Split
from .statistics import Spread, plus_minus, survived, winners_curse, z_simultaneous
from .study import n_done

CONFIRMATION_ATTR = "ballast.confirmation"  # study user attr: Confirmation as JSON
SCORES_ATTR = "ballast.confirmation.scores"  # study user attr: every confirmation score so far, for a resume


@dataclass
class SeedJob:
    number: int  # the trial retrained
    params: dict
    seed: int  # 1 .. seeds - 1: added to the trial's optim.seed and rollout.seed


@dataclass
class SeedResult:
    per_prompt: dict[str, list[float]]  # on the judging prompts; empty when the run failed
    status: str = "finished"  # finished | collapsed | failed
    run_id: str | None = None
    steps: int = 0
    seconds: float = 0.0
    tokens: dict[str, float] = field(default_factory=dict)  # generated / trained, for the cost


ScoreFn = Callable[[FrozenTrial | None], dict[str, list[float]]]
RetrainFn = Callable[[list[SeedJob]], list[SeedResult]]


@dataclass
class Candidate:
    """A trial as the verdict reads it: its gain where it was selected, where it was judged, and on each seed."""

    number: int
    params: dict
    selection: dict  # Gain.to_dict on the selection prompts (the ± of one comparison: it ranked, it claims nothing)
    judged: dict | None = None  # Gain.to_dict on the judging prompts, ± simultaneous over the m compared
    seeds: list[dict] = field(default_factory=list)  # per retrained seed: seed, status, run_id, steps, gain dict
    mlflow_run_id: str | None = None

    def seed_gains(self) -> list[dict]:
        """The judged gain first, then each retrained seed's (a failed or collapsed seed has none)."""
        return [self.judged] + [s["gain"] for s in self.seeds] if self.judged else []

    def holds(self) -> bool:
        gains = self.seed_gains()
        return bool(gains) and all(g is not None and g["beats_baseline"] for g in gains)

    def spread(self) -> Spread | None:
        gains = [g["gain"] for g in self.seed_gains() if g is not None]
        return Spread(gains) if gains else None


@dataclass
class Confirmation:
    """The verdict and what it rests on (sweeps/report.py shows it; tasks/record.py logs it)."""

    metric: str
    direction: str
    judged_on: str  # 'confirmation' | 'selection': where the claim is made
    n_prompts: int  # prompts of the judging set
    n_selection: int
    m: int  # trials compared for the claim
    z: float
    seeds: int  # training seeds asked for (confirm.seeds)
    split: dict
    candidates: list[Candidate]  # the trials judged, in their selection order
    winner: int | None = None  # best on the judging prompts
    runner_up: int | None = None
    claimed: int | None = None  # the trial that beats the base model on every seed, if any
    baseline: float | None = None  # the base model's score on the judging prompts
    seconds: float = 0.0
    eval_seconds: float = 0.0
    seed_steps: int = 0
    seed_seconds: float = 0.0
    seed_tokens: dict[str, float] = field(default_factory=dict)
    complete: bool = True  # False while it is being made (stored as it goes): no verdict yet
    trials_done: int | None = None  # COMPLETE + PRUNED trials when it was made: more since, and it is out of date

    def candidate(self, number: int | None) -> Candidate | None:
        return next((c for c in self.candidates if c.number == number), None)

    @property
    def beats(self) -> bool:
        return self.claimed is not None

    def plus_minus(self) -> str:
        return plus_minus(self.z, self.m)

    def stale_reason(self, study) -> str | None:
        """Why this is not the study's verdict now — it is not finished, or trials ended after it was made — or None
        when it stands."""
        if not self.complete:
            return "the confirmation has not finished (a worker is making it, or was stopped in it)"
        done = n_done(study)
        if self.trials_done is not None and done > self.trials_done:
            return (
                f"the confirmation was made on the first {self.trials_done} trials and {done} are done now; it is "
                "made again when the search ends"
            )
        return None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Confirmation:
        data = json.loads(text)
        data["candidates"] = [Candidate(**c) for c in data["candidates"]]
        return cls(**data)


def load_confirmation(study) -> Confirmation | None:
    text = study.user_attrs.get(CONFIRMATION_ATTR)
    return Confirmation.from_json(text) if text else None


# ------------------------------------------------------------------------------------------ the procedure


def confirm(
    study: optuna.Study,
    sweep: SweepSpec,
    baseline: Baseline | None,
    split: Split,
    score: ScoreFn,
    retrain: RetrainFn,
    log: Callable[[str], None] = print,
) -> Confirmation | None:
    """The verdict of a finished single-objective study with a held-out objective and a baseline (None otherwise:
    the summary then ranks trials as before). Stored on the study as it goes."""
    first = sweep.objectives[0]
    name = PER_PROMPT.get(first.key)
    ranked = ranked_trials(study, first.direction)
    if len(sweep.objectives) > 1 or baseline is None or name not in baseline.per_prompt or not ranked:
        return None
    started, cache = time.perf_counter(), _Scores(study)
    judged_on = "confirmation" if split.confirms else "selection"
    top = ranked[: sweep.confirm.top_k] if split.confirms else ranked
    z = z_simultaneous(len(top))
    base = _judging_baseline(baseline, split, name, score, cache)
    out = Confirmation(
        first.key, first.direction, judged_on, len(base), split.n_selection, len(top), z, sweep.confirm.seeds,
        asdict(split), [_candidate(t, first.direction) for t in top], baseline=sum(base) / len(base),
        complete=False, trials_done=n_done(study),
    )  # fmt: skip
    for c, t in zip(out.candidates, top):
        c.judged = _judged_gain(c, t, name, base, split, score, cache, out, log).to_dict()
    _pick(out)
    _stored(study, out)
    _run_seeds(out, sweep, name, base, retrain, cache, log)
    out.claimed = next((c.number for c in _finalists(out) if c.holds()), None)
    out.seconds = time.perf_counter() - started
    out.complete = True
    _stored(study, out)
    return out


def ranked_trials(study: optuna.Study, direction: str) -> list[FrozenTrial]:
    """COMPLETE trials, best objective (on the selection prompts) first; ties by trial number."""
    sign = -1 if direction == "maximize" else 1
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values]
    return sorted(done, key=lambda t: (sign * t.values[0], t.number))


def _candidate(t: FrozenTrial, direction: str) -> Candidate:
    a = t.user_attrs
    sel = Gain(a.get("gain_metric", ""), a.get("score", t.values[0]), a.get("score", 0) - a.get("gain", 0),
               a.get("gain", 0.0), a.get("gain_stderr", 0.0), direction, n=int(a.get("gain_n", 0)))  # fmt: skip
    return Candidate(t.number, dict(t.params), sel.to_dict(), mlflow_run_id=a.get("mlflow_run_id"))


def _judging_baseline(baseline: Baseline, split: Split, name: str, score: ScoreFn, cache: _Scores) -> list[float]:
    """The base model's per-prompt scores on the prompts the claim is made on."""
    whole = baseline.per_prompt[name]
    if split.kind == "split":
        return split.confirmation(whole)
    if split.kind == "none":
        return split.selection(whole)
    return cache.get("base", lambda: score(None))[name]  # a confirmation file: the base model scored on it once


def _judged_gain(c: Candidate, t, name, base, split: Split, score, cache, out: Confirmation, log) -> Gain:
    """The candidate's gain on the judging prompts, ± simultaneous over the m compared."""
    sel = c.selection
    if not split.confirms:  # the claim falls to the selection prompts it was chosen on
        return Gain(
            out.metric, sel["score"], sel["baseline"], sel["gain"], sel["stderr"], out.direction, out.z, sel["n"]
        )
    began = time.perf_counter()
    per = cache.get(f"trial/{c.number}", lambda: score(t))
    out.eval_seconds += time.perf_counter() - began
    gain = paired_gain(out.metric, per[name], base, out.direction, out.z)
    log(f"confirmation: trial {c.number} {gain.describe()} on {len(base)} prompts the search never saw")
    return gain


def _pick(out: Confirmation) -> None:
    sign = 1 if out.direction == "maximize" else -1
    order = sorted(out.candidates, key=lambda c: (-sign * c.judged["gain"], c.number))
    out.winner = order[0].number
    out.runner_up = order[1].number if len(order) > 1 else None


def _finalists(out: Confirmation) -> list[Candidate]:
    """Winner then runner-up, those that cleared their interval on the judging prompts: the ones seeds are spent on."""
    picks = [out.candidate(out.winner), out.candidate(out.runner_up)]
    return [c for c in picks if c is not None and c.judged and c.judged["beats_baseline"]]


def _run_seeds(out: Confirmation, sweep: SweepSpec, name, base, retrain: RetrainFn, cache: _Scores, log) -> None:
    """Each finalist trained seeds - 1 more times, all jobs handed to `retrain` at once; each seed's gain on the
    judging prompts with the same ±."""
    finalists = _finalists(out)
    jobs = [SeedJob(c.number, c.params, s) for c in finalists for s in range(1, sweep.confirm.seeds)]
    todo = [j for j in jobs if not cache.has(f"seed/{j.number}/{j.seed}")]
    if todo:
        log(f"seeds: training {_listed(todo)} again with other seeds, to see whether the gain holds")
        began = time.perf_counter()
        for job, result in zip(todo, retrain(todo)):
            cache.put(f"seed/{job.number}/{job.seed}", asdict(result))
        out.seed_seconds += time.perf_counter() - began
    for job in jobs:
        result = SeedResult(**cache.get(f"seed/{job.number}/{job.seed}", None))
        ok = result.status == "finished" and name in result.per_prompt
        gain = paired_gain(out.metric, result.per_prompt[name], base, out.direction, out.z).to_dict() if ok else None
        row = {"seed": job.seed, "status": result.status, "run_id": result.run_id, "steps": result.steps, "gain": gain}
        out.candidate(job.number).seeds.append(row)
        out.seed_steps += result.steps
        for k, v in result.tokens.items():
            out.seed_tokens[k] = out.seed_tokens.get(k, 0.0) + v
        said = f"{gain['gain']:+.2g} ± {gain['ci95']:.2g}" if ok else result.status
        log(f"seeds: trial {job.number} seed +{job.seed}: {said}")


def _listed(jobs: list[SeedJob]) -> str:
    numbers = sorted({j.number for j in jobs})
    return " and ".join(f"trial {n}" for n in numbers) + f" ({len(jobs)} run{'s' * (len(jobs) != 1)})"


def _stored(study, out: Confirmation) -> None:
    study.set_user_attr(CONFIRMATION_ATTR, out.to_json())


class _Scores:
    """Confirmation scores kept on the study as they come: a resumed confirmation scores nothing twice."""

    def __init__(self, study):
        self.study = study
        self.kept: dict = json.loads(study.user_attrs.get(SCORES_ATTR) or "{}")

    def has(self, key: str) -> bool:
        return key in self.kept

    def get(self, key: str, make):
        if key not in self.kept:
            self.put(key, make())
        return self.kept[key]

    def put(self, key: str, value) -> None:
        self.kept[key] = value
        self.study.set_user_attr(SCORES_ATTR, json.dumps(self.kept))


# ------------------------------------------------------------------------------------------ in words


def verdict_lines(c: Confirmation) -> list[str]:
    """The verdict as the terminal, the page's banner and MLflow say it."""
    win = c.candidate(c.winner)
    where = (
        f"on {c.n_prompts} prompts the search never saw"
        if c.judged_on == "confirmation"
        else f"on the {c.n_prompts} selection prompts that chose it (nothing was kept back to confirm on)"
    )
    j, s = win.judged, win.selection
    head = "best on confirmation" if c.judged_on == "confirmation" else "best on the selection prompts"
    first = (
        f"{head}: trial {win.number}, {c.metric} {j['score']:.3g} vs {j['baseline']:.3g} for the base model, "
        f"{j['gain']:+.2g} ± {j['ci95']:.2g} {where}"
    )
    if c.judged_on == "confirmation":
        first += f"; on the selection prompts it scored {s['score']:.3g}"
    out = [first, *_seeds_lines(c), _claim_line(c)]
    if line := _kept_line(c):
        out.append(line)
    out.append(f"{c.plus_minus()}; 'beats the base model' = the interval lies above zero on every training seed")
    return [line for line in out if line]


def _seeds_lines(c: Confirmation) -> list[str]:
    """The seed spread of each finalist (the winner, the runner-up) that was trained again."""
    if c.seeds <= 1:
        return [
            "seeds: one training seed (confirm.seeds: 3 trains the winner twice more, to see whether its gain holds)"
        ]
    ran = [cand for cand in (c.candidate(c.winner), c.candidate(c.runner_up)) if cand is not None and cand.seeds]
    if not ran:
        who = "the winner" if c.runner_up is None else "neither the winner nor the runner-up"
        verb = "did not clear its interval" if c.runner_up is None else "cleared its interval"
        return [f"seeds: not run — {who} {verb}, so there is nothing to hold across seeds"]
    out = []
    if c.winner not in {cand.number for cand in ran}:
        out.append(f"seeds: not run for the winner, trial {c.winner}, which did not clear its interval")
    for cand in ran:
        failed = [s for s in cand.seeds if s["gain"] is None]
        note = f"; {len(failed)} seed run{'s' * (len(failed) != 1)} did not finish" if failed else ""
        widest = max(g["ci95"] for g in cand.seed_gains() if g is not None)  # each seed's own interval, not the claim's
        out.append(f"seeds: trial {cand.number} {cand.spread().describe()}, each seed ± up to {widest:.2g}{note}")
    return out


def _why_not(cand: Candidate) -> str:
    return "did not clear its interval" if not cand.judged["beats_baseline"] else "did not hold on every seed"


def _claim_line(c: Confirmation) -> str:
    claimed, win, runner = c.candidate(c.claimed), c.candidate(c.winner), c.candidate(c.runner_up)
    if claimed is None:
        line = f"no trial beat the base model: the best, trial {win.number}, {_why_not(win)}"
        if runner is not None and runner.judged and runner.judged["beats_baseline"]:  # seeds were spent on it too
            line += f"; the runner-up, trial {runner.number}, {_why_not(runner)}"
        return line
    seeds = f" on all {1 + len(claimed.seeds)} seeds" if claimed.seeds else ""
    behind = f" (the runner-up: the winner, trial {win.number}, {_why_not(win)})" if claimed.number != c.winner else ""
    return f"trial {claimed.number} beats the base model{seeds}{behind}"


def _kept_line(c: Confirmation) -> str | None:
    """What share of the gain that selected the trial survived confirmation and seeds, or the optimism it carries."""
    cand = c.candidate(c.claimed) or c.candidate(c.winner)
    spread, sel = cand.spread(), cand.selection
    if c.judged_on == "selection":
        bias = winners_curse(c.m, sel["stderr"])
        line = (
            f"optimism: measured on the prompts that chose it, the best of {c.m} trials overstates its gain by about "
            f"{bias:.2g} even when the trials are equal"
        )
        if spread and spread.n > 1 and (kept := survived(sel["gain"], spread.mean, c.direction)) is not None:
            line += f"; {kept:.0%} of its gain survived {spread.n} seeds"
        return line
    kept = survived(sel["gain"], spread.mean, c.direction) if spread else None
    if kept is None:
        return None
    across = f" and {spread.n} seeds" if spread.n > 1 else ""
    return (
        f"kept: {kept:.0%} of trial {cand.number}'s selection gain survived confirmation{across} "
        f"({sel['gain']:+.2g} on the selection prompts, {spread.mean:+.2g} on confirmation)"
    )
