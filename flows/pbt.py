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

from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from sweeps.population import load_population
from tasks.population import (
    POPULATION_FILE,
    Confirmed,
    PopulationRecorder,
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
    print(
        f"population {pop.name}: {pop.pbt.population} members, ranked every {pop.pbt.ready} steps; MLflow run {parent}"
    )
    result = train_task(pop, root, resume, recorder)
    if result.interrupted:
        recorder.record_end(result, None, [root / POPULATION_FILE])
        return PopulationSummary(pop.name, str(root), result.step, None, interrupted=result.interrupted)
    confirmed = confirm_task(pop, result, root / "cache")
    replay = write_replay(pop, result, root) if result.winner is not None else None  # every member collapsed: none
    page = write_population_page(pop, result, confirmed, root / "pbt.html")
    recorder.record_end(result, confirmed, [f for f in (root / POPULATION_FILE, replay, page) if f is not None])
    summary = PopulationSummary(
        pop.name,
        str(root),
        result.step,
        member_name(result.winner) if result.winner is not None else None,
        confirmed.__dict__ | {"gain": confirmed.gain} if confirmed else None,
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
        out.append(
            f"  confirmed on {confirmed.n_prompts} {confirmed.part} prompts: winner {confirmed.winner:.3f} vs base "
            f"model {confirmed.baseline:.3f} (gain {confirmed.gain:+.3f})"
        )
    if s.replay:
        out.append(f"  replay the winner's schedule: ballast run {s.replay}")
    else:
        out.append("  no winner: every member's health gate tripped (collapsed); no schedule to replay")
    out.append(f"  summary page: {s.page}")
    return out


def population_files(root: str | Path) -> list[Path]:
    return [Path(root) / name for name in (POPULATION_FILE, "winner.yaml", "pbt.html")]
