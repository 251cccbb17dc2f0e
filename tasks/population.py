"""The population's stages as plain functions with typed results, and its MLflow side.

- `train_population`: the population trained (or resumed) in <project_dir>/populations/<name>/ (trainer/population.py)
- `confirm_winner`: the winner's final checkpoint and the base model scored on the confirmation prompts, which no
  ranking read (sweeps/split.py); the verdict is the winner's confirmed gain over the base model
- `replay_spec`: the winner as a plain run spec — its root ancestor's settings (rank, seed) and its whole schedule in
  `grpo.schedule` — which `ballast run` trains to the winner's weights (tests/test_population.py proves the equality)
- `PopulationRecorder`: one MLflow parent run for the population, a child run per member slot. A member's run gets
  every step's metrics, its hyperparameters among them (`pbt/beta`, `pbt/learning_rate`, `pbt/repetition_penalty`:
  MLflow's charts show the schedules), a tag per replacement (`ballast.pbt.replaced.<step>`: from whom, why, how each
  knob moved) and the metric `pbt/copied_from` at that step. The parent gets the settings, the winner, the confirmed
  verdict, the lineage (population.json), the replay spec and the summary page. Run ids live in mlflow.json beside
  population.json, so a resumed population logs into the same runs and skips the steps MLflow already holds.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from sweeps.baseline import PER_PROMPT, paired_gain
from sweeps.population import PopulationSpec
from sweeps.statistics import clears
from tasks.eval import eval_baseline, eval_checkpoint, judging_examples
from tasks.fork import ForkSource
from tasks.spec import validate_spec
from tasks.tracking import Tracking, user_name
from trainer.callbacks import Callbacks
from trainer.population import (  # noqa: F401  (POPULATION_FILE, read_state: the flow's, through tasks/)
    POPULATION_FILE,
    Population,
    PopulationResult,
    Round,
    member_configs,
    member_name,
    read_state,
)

RUNS_FILE = "mlflow.json"


def population_root(pop: PopulationSpec) -> Path:
    return pop.root()


@dataclass
class Confirmed:
    """The winner and the base model on the confirmation prompts (or the selection ones when nothing was kept back),
    paired prompt by prompt as a sweep's verdict is (sweeps/statistics.py): `ci95` the 95 % interval's half-width of
    the gain, None when the objective has no per-prompt scores. One winner is compared, so z is 1.96."""

    winner: float
    baseline: float
    n_prompts: int
    part: str  # "confirmation", "confirm.data" (the user's file) or "selection" (too few to split: optimistic)
    metric: str = "eval/reward"
    ci95: float | None = None
    direction: str = "maximize"

    @property
    def gain(self) -> float:
        return self.winner - self.baseline

    @property
    def beats(self) -> bool:
        """The winner beats the base model: the gain's 95 % interval lies wholly on the better side of zero."""
        return self.ci95 is not None and clears(self.gain, self.ci95, self.direction)

    def line(self, who: str = "winner") -> str:
        """'confirmed on 64 confirmation prompts: winner eval/reward 0.931 vs 0.606 for the base model, +0.33 ± 0.12:
        beats the base model (± is a 95 % interval, paired over the prompts)'."""
        where = {
            "confirmation": f"{self.n_prompts} confirmation prompts",
            "confirm.data": f"{self.n_prompts} confirm.data prompts",
        }.get(self.part, f"{self.n_prompts} selection prompts (nothing was kept back: the prompts that ranked it)")
        head = f"confirmed on {where}: {who} {self.metric} {self.winner:.3g} vs {self.baseline:.3g} for the base model"
        if self.ci95 is None:
            return f"{head}, {self.gain:+.2g} ({self.metric} has no per-prompt scores: no interval, no claim)"
        said = "beats the base model" if self.beats else "does not beat the base model beyond noise"
        return f"{head}, {self.gain:+.2g} ± {self.ci95:.2g}: {said} (± is a 95 % interval, paired over the prompts)"


def train_population(
    pop: PopulationSpec,
    root: Path,
    resume: bool,
    recorder: PopulationRecorder | None = None,
    on_round: Callable[[Round], None] | None = None,
) -> PopulationResult:
    """Train the population (or resume it from its last save) to optim.steps; its lineage recorded as it goes, each
    step's end told to `on_round` (the progress a person watches: flows/pbt.py)."""
    spec, policy = pop.spec(), pop.policy()
    population = Population(
        root,
        policy,
        ready=pop.pbt.ready,
        objective=pop.objective,
        total=spec.optim.steps,
        callbacks_for=recorder.member_callbacks if recorder else (lambda index: ()),
        on_replace=recorder.record_replacement if recorder else None,
        verify_tolerance=spec.fork.verify_tolerance,
        on_round=on_round,
    )
    try:
        if resume:
            population.resume()
        else:
            population.start(member_configs(spec.trainer_config(), policy, pop.pbt.population, pop.pbt.ready))
        return population.run()
    finally:
        population.close()


def confirm_winner(pop: PopulationSpec, result: PopulationResult, cache: Path) -> Confirmed | None:
    """The winner's final checkpoint and the base model on the prompts that judge (sweeps/split.py)."""
    if result.winner is None:
        return None
    split = pop.split()
    data = pop.spec().model_dump(mode="json")
    data["eval"]["split"] = split.confirmation_eval()
    part = {"split": "confirmation", "file": "confirm.data"}.get(split.kind, "selection")
    spec = validate_spec(data, "confirmation spec")
    examples = judging_examples(spec, split) if split.kind == "file" else None  # the user's rows, whatever data.source
    winner = result.members[result.winner]
    spec_w = validate_spec({**data, "lora": winner["cfg"]["lora"]}, "confirmation spec")
    won = eval_checkpoint(spec_w, winner["checkpoint"], cache, examples)
    base = eval_baseline(spec, ForkSource(), cache, examples)
    key, direction = pop.objective, pop.sweep.objectives[0].direction
    n = len(next(iter(won.per_prompt.values()), []))
    name = PER_PROMPT.get(key)
    ci95 = None
    if name in won.per_prompt and name in base.per_prompt:
        ci95 = paired_gain(key, won.per_prompt[name], base.per_prompt[name], direction).ci95
    return Confirmed(won.metrics[key], base.metrics[key], n, part, key, ci95, direction)


def replay_spec(pop: PopulationSpec, result: PopulationResult) -> dict:
    """The winner as a plain run: the members' base spec with its root ancestor's rank and seed, its whole schedule
    and the population's eval cadence (the evals draw from the RNG: the replay makes them at the same steps)."""
    winner = result.members[result.winner]
    data = pop.spec().model_dump(mode="json", exclude_none=True)
    cfg = winner["cfg"]
    data["name"] = f"{pop.name}-winner-replay"
    data["lora"], data["optim"]["seed"] = cfg["lora"], cfg["optim"]["seed"]
    data["grpo"]["schedule"] = winner["schedule"]
    data["eval"].update(every=cfg["eval"]["every"], on_start=False)
    return json.loads(json.dumps(validate_spec(data, "winner replay spec").model_dump(mode="json", exclude_none=True)))


def write_replay(pop: PopulationSpec, result: PopulationResult, root: Path) -> Path:
    path = root / "winner.yaml"
    header = (
        f"# The winner of population {pop.name} ({member_name(result.winner)}), replayed as a plain run:\n"
        f"#   ballast run {path}\n# its schedule (grpo.schedule) is the one its lineage trained with.\n"
    )
    path.write_text(header + yaml.safe_dump(replay_spec(pop, result), sort_keys=False))
    return path


# ------------------------------------------------------------------------------------------ MLflow


class MemberRun(Callbacks):
    """A member slot's step metrics to its MLflow child run (steps MLflow already holds are skipped on resume)."""

    def __init__(self, tracking: Tracking, run_id: str, logged_to: int):
        self.tracking, self.run_id, self.logged_to = tracking, run_id, logged_to

    def on_step(self, step: int, metrics: dict) -> None:
        if step <= self.logged_to:
            return
        numbers = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v)
        }
        self.tracking.log_metrics(self.run_id, numbers, step)
        self.logged_to = step


class PopulationRecorder:
    """The population's MLflow runs: a parent, and a child per member slot (see the module's docstring)."""

    def __init__(self, pop: PopulationSpec, root: Path):
        self.pop, self.root = pop, root
        self.tracking = Tracking(pop.spec())
        self.runs = json.loads((root / RUNS_FILE).read_text()) if (root / RUNS_FILE).is_file() else {}

    def discard_unsaved_attempt(self) -> None:
        """A fresh start over an attempt that stopped before its first save (a kill, a crash: nothing to resume):
        that attempt's runs end FAILED and its members' folders go, so the new attempt's runs and records start
        empty instead of taking over the old runs (their params, their steps) and appending to the old records."""
        for run_id in self.runs.values():
            try:
                self.tracking.set_tags(run_id, {"status": "failed", "stop_reason": "stopped before its first save"})
                self.tracking.client.set_terminated(run_id, "FAILED")
            except Exception as e:  # the old runs are a record to close, not a reason to stop the new start
                print(f"population {self.pop.name}: an earlier attempt's run {run_id} was not closed: {e}", flush=True)
        self.runs = {}
        (self.root / RUNS_FILE).unlink(missing_ok=True)
        for d in self.root.glob("member-*"):
            if d.is_dir():
                shutil.rmtree(d)

    def open(self) -> str:
        """The parent run and the members' child runs: created on a first start, found again on a resume."""
        t, pop = self.tracking, self.pop
        if not self.runs:
            parent = t.create_run(f"pbt {pop.name}", tags={"mlflow.user": user_name()})
            t.log_params(parent, _params(pop))
            self.runs = {"parent": parent}
            for i in range(pop.pbt.population):
                self.runs[member_name(i)] = t.create_run(member_name(i), parent_run_id=parent)
                t.set_tags(self.runs[member_name(i)], {"kind": "population-member", "population": pop.name})
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / RUNS_FILE).write_text(json.dumps(self.runs, indent=1))
        t.set_tags(self.runs["parent"], {"kind": "population", "population": pop.name, "status": "running"})
        return self.runs["parent"]

    def member_callbacks(self, index: int) -> list[Callbacks]:
        run_id = self.runs[member_name(index)]
        history = self.tracking.client.get_metric_history(run_id, "pbt/beta")
        return [MemberRun(self.tracking, run_id, max((m.step for m in history), default=0))]

    def record_replacement(self, event: dict) -> None:
        run_id, step = self.runs[member_name(event["member"])], event["step"]
        how = ", ".join(f"{k} {v}" for k, v in event["explored"].items())
        said = f"from {member_name(event['source'])} ({event['reason']}); {how}"
        self.tracking.set_tags(run_id, {f"pbt.replaced.{step:06d}": said})
        self.tracking.log_metrics(run_id, {"pbt/copied_from": float(event["source"])}, step)

    def record_end(self, result: PopulationResult, confirmed: Confirmed | None, files: list[Path]) -> None:
        t, parent = self.tracking, self.runs["parent"]
        metrics = {f"selection/{member_name(i)}": s for i, s in result.scores.items() if math.isfinite(s)}
        if confirmed is not None:
            metrics.update(
                {
                    "confirmed/winner": confirmed.winner,
                    "confirmed/baseline": confirmed.baseline,
                    "confirmed/gain": confirmed.gain,
                }
            )
            if confirmed.ci95 is not None:
                metrics["confirmed/ci95"] = confirmed.ci95
            t.set_tags(parent, {"pbt.verdict": confirmed.line()})
        for k, v in metrics.items():
            t.client.log_metric(parent, k, v, step=result.step)
        winner = member_name(result.winner) if result.winner is not None else None
        t.set_tags(parent, {"status": "interrupted" if result.interrupted else "finished", "pbt.winner": winner})
        for f in files:
            t.client.log_artifact(parent, str(f))
        if winner:
            t.set_tags(self.runs[winner], {"pbt.winner": "true"})
        for run_id in self.runs.values():
            t.client.set_terminated(run_id, "KILLED" if result.interrupted else "FINISHED")


def _params(pop: PopulationSpec) -> dict[str, str]:
    p = pop.pbt
    out = {f"pbt.{k}": str(v) for k, v in p.model_dump().items()}
    out.update({f"space.{k}": json.dumps(v.model_dump(exclude_none=True)) for k, v in pop.sweep.space.items()})
    out["objective"] = pop.objective
    return out
