"""The population flow: population-based GRPO as one Prefect flow, recorded in MLflow with its whole lineage.

    ballast pbt examples/pbt.yaml               # P members over one base model; ranked, copied and perturbed as they go
    ballast pbt examples/pbt.yaml --resume      # after Ctrl-C, SIGTERM or a kill: on from the last population save
    ballast run .ballast/populations/<name>/winner.yaml   # the winner's schedule, replayed as a plain run

`ballast-pbt` reads as its stages: open the MLflow runs → train the population (trainer/population.py; members
ranked on the selection prompts every `pbt.ready` steps) → confirm the winner on the confirmation prompts no
ranking read → write the winner's replay spec → the summary page (lineage tree, the winner's schedule) → record.
Its files live in <project_dir>/populations/<name>/: a folder per member slot (its metrics and checkpoints),
population.json (the lineage), mlflow.json (its runs), winner.yaml and pbt.html.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from sweeps.population import load_population
from tasks.population import (
    POPULATION_FILE,
    Confirmed,
    PopulationRecorder,
    Round,
    confirm_winner,
    member_name,
    population_root,
    train_population,
    write_replay,
)
from tasks.population_page import write_population_page


@dataclass
class PopulationSummary:
    name: str
    root: str
    step: int
    winner: str | None
    confirmed: dict | None = None
    replay: str | None = None
    page: str | None = None
    interrupted: str | None = None
    replacements: int = 0
    lines_: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return self.lines_


class PopulationProgress:
    """What a person watching `ballast pbt` sees while the members train (the run said nothing until its end: a
    minute on the tiny model, hours on a real one). On a terminal one line rewritten in place each step — the step,
    the members' mean reward, the leader of the last ranking, the replacements so far, the ETA; piped (a log, CI), a
    line at each ranking step and each collapse. A ranking step also says who copied whom and how each knob moved.
    Every line but the redrawn one also goes to the flow run's log (Prefect's UI)."""

    def __init__(self, log=None):
        self.log = log
        self.tty = sys.stdout.isatty()
        self.started, self.first, self.replacements, self.drawn = time.perf_counter(), None, 0, False
        self.leader: int | None = None

    def say(self, line: str) -> None:
        self.clear()
        sys.stdout.write(line + "\n")  # the terminal as it is: inside the flow `print` goes to Prefect's log only
        sys.stdout.flush()
        if self.log is not None:
            self.log.info(line)

    def __call__(self, r: Round) -> None:
        self.first = r.step if self.first is None else self.first  # a resumed population starts later
        self.replacements += len(r.replaced)
        rewards = [v for v in r.rewards.values() if v is not None and math.isfinite(v)]
        done = r.step - self.first + 1
        eta = (time.perf_counter() - self.started) / done * (r.total - r.step)
        parts = [f"  step {r.step}/{r.total}"]
        if rewards:
            parts.append(f"reward {sum(rewards) / len(rewards):.3f} mean, {max(rewards):.3f} best")
        self.leader = r.ranking[0] if r.ranking else self.leader  # the last ranking's first
        if self.leader is not None and r.ranking is None:  # a ranking step's line gives the whole ranking instead
            parts.append(f"leader {member_name(self.leader)} {r.scores[self.leader]:.3f}")
        parts += [f"{self.replacements} replaced", f"ETA {eta:.0f} s"]
        line = ", ".join(parts)
        for member, why in r.collapsed.items():
            self.say(f"  step {r.step}: {member_name(member)} collapsed ({why.removeprefix('collapsed: ')})")
        if r.ranking is not None:
            order = ", ".join(f"{member_name(i)} {r.scores[i]:.3f}" for i in r.ranking)
            self.say(f"{line}; ranked: {order}")
        for e in r.replaced:
            how = ", ".join(f"{k} {v}" for k, v in e["explored"].items())
            why = "bottom of the ranking" if e["reason"] == "exploit" else e["reason"]
            self.say(f"    {member_name(e['member'])} <- copy of {member_name(e['source'])} ({why}); {how}")
        if self.tty and r.ranking is None and r.step < r.total:
            sys.stdout.write("\r" + line.ljust(100))
            sys.stdout.flush()
            self.drawn = True

    def clear(self) -> None:
        if self.drawn:
            sys.stdout.write("\r" + " " * 100 + "\r")
            self.drawn = False


train_task = task(train_population, name="train population", cache_policy=NO_CACHE, persist_result=False)
confirm_task = task(confirm_winner, name="confirm winner", cache_policy=NO_CACHE, persist_result=False)


@flow(name="ballast-pbt", log_prints=True)
def ballast_pbt(file: str, overrides: list[str] | None = None, resume: bool = False) -> PopulationSummary:
    """Population-based GRPO of a population file (sweeps/population.py); `resume`: on from its last save."""
    pop = load_population(file, overrides or [])
    pop.refuse_a_second_start(resume)
    root = population_root(pop)
    recorder = PopulationRecorder(pop, root)
    if not resume:  # refuse_a_second_start: no save there, at most an attempt that stopped before its first
        recorder.discard_unsaved_attempt()
    parent = recorder.open()
    progress = PopulationProgress(get_run_logger())
    progress.say(
        f"population {pop.name}: {pop.pbt.population} members, {pop.spec().optim.steps} steps, ranked every "
        f"{pop.pbt.ready} on {pop.objective} (selection prompts); MLflow run {parent}"
    )
    try:
        result = train_task(pop, root, resume, recorder, progress)
    finally:
        progress.clear()
    if result.interrupted:
        recorder.record_end(result, None, [root / POPULATION_FILE])
        return PopulationSummary(pop.name, str(root), result.step, None, interrupted=result.interrupted)
    if result.winner is not None:
        progress.say(f"confirming the winner {member_name(result.winner)} against the base model ...")
    confirmed = confirm_task(pop, result, root / "cache")
    replay = write_replay(pop, result, root) if result.winner is not None else None  # every member collapsed: none
    page = write_population_page(pop, result, confirmed, root / "pbt.html")
    recorder.record_end(result, confirmed, [f for f in (root / POPULATION_FILE, replay, page) if f is not None])
    summary = PopulationSummary(
        pop.name,
        str(root),
        result.step,
        member_name(result.winner) if result.winner is not None else None,
        confirmed.__dict__ | {"gain": confirmed.gain, "beats": confirmed.beats} if confirmed else None,
        str(replay) if replay else None,
        str(page),
        replacements=len(result.events),
    )
    summary.lines_ = _lines(summary, confirmed, result)
    return summary


def _lines(s: PopulationSummary, confirmed: Confirmed | None, result) -> list[str]:
    out = [f"population {s.name}: {s.step} steps, {s.replacements} replacements; winner {s.winner or 'none'}"]
    scores = ", ".join(f"{member_name(i)} {v:.3f}" for i, v in sorted(result.scores.items()))
    out.append(f"  selection scores at step {s.step}: {scores}")
    if confirmed is not None:
        out.append(f"  {confirmed.line()}")
    if s.replay:
        out.append(f"  replay the winner's schedule: ballast run {s.replay}")
    else:
        out.append("  no winner: every member's health gate tripped (collapsed); no schedule to replay")
    out.append(f"  summary page: {s.page}")
    return out


def population_files(root: str | Path) -> list[Path]:
    return [Path(root) / name for name in (POPULATION_FILE, "winner.yaml", "pbt.html")]
