"""Population files: a sweep file with a `pbt:` section — the same base, overrides, space, objective and held-out split
as `ballast sweep`, searched by one population that trains once (trainer/population.py) instead of trials from scratch.

    base: quickstart.yaml
    overrides: {optim.steps: 40, ...}
    space:                                   # what the members start from and what they schedule
      grpo.beta:                  {type: float, low: 1.0e-3, high: 0.2, log: true}
      optim.learning_rate:        {type: float, low: 3.0e-4, high: 1.0e-2, log: true}
      rollout.repetition_penalty: {type: float, low: 1.0, high: 1.2}
      lora.r:                     {type: categorical, choices: [4, 8, 16]}   # fixed per member
    objectives: [{metric: eval/reward, direction: maximize}]
    pbt: {population: 8, ready: 5, quantile: 0.25, perturb: [0.8, 1.25], resample_probability: 0.25}

The choices, on purpose:

- **The sweep's file, read by the sweep's loader** (sweeps/space.py `load_sweep`): every field is checked as a sweep's
  is, and the held-out split is the sweep's (sweeps/split.py): members are ranked on the selection prompts; the
  confirmation prompts judge the winner only, at the end.
- **What a population can schedule.** The continuous knobs are grpo.beta, optim.learning_rate and
  rollout.repetition_penalty (trainer/config.py SCHEDULED); lora.r is categorical and fixed per member. Any other
  space field is refused, naming it: a population cannot change it mid-run.
- **One objective**, a held-out score (eval/*): members are ranked on it every `ready` steps; optim.steps must be a
  multiple of `ready` so the last step is a ranking.
- The sampler, pruner and trial count of a sweep file do not apply (the population is the search) and are ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.spec import ExperimentSpec, describe_validation_error, read_yaml_mapping, validate_spec
from trainer.config import SCHEDULED, InputError
from trainer.pbt import POPULATION_FILE, Knob, Policy
from trainer.sharing import check_concurrent

from .space import SweepError, SweepSpec, base_spec, load_sweep, sweep_split
from .split import Split

FIXED_KNOBS = ("lora.r",)


class PBTSpec(BaseModel):
    """The `pbt:` section: the population and how it exploits and explores (trainer/pbt.py says each choice)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    population: int = Field(8, ge=2, description="Members trained at once over one base model (P).")
    ready: int = Field(5, ge=1, description="Steps between rankings on the selection score; optim.steps its multiple.")
    quantile: float = Field(0.25, gt=0, le=0.5, description="Bottom share that copies the top share each ranking.")
    perturb: list[Annotated[float, Field(gt=0)]] = Field(
        [0.8, 1.25], min_length=1, description="Factors a copy's knob is multiplied by (each above 0)."
    )
    resample_probability: float = Field(0.25, ge=0, le=1, description="Chance a copy's knob is drawn afresh instead.")
    seed: int | None = Field(None, description="Seed of the draws and decisions; default the file's seed.")


class PopulationSpec:
    """A population file, read: its sweep part (base, overrides, space, objective, split) and its `pbt:` section."""

    def __init__(self, sweep: SweepSpec, pbt: PBTSpec, file: str):
        self.sweep, self.pbt, self.file = sweep, pbt, file

    @property
    def name(self) -> str:
        return self.sweep.study_name

    @property
    def objective(self) -> str:
        return self.sweep.objectives[0].metric

    def policy(self) -> Policy:
        space = self.sweep.space
        knobs = tuple(Knob(k, p.low, p.high, p.log) for k, p in space.items() if k in SCHEDULED)
        fixed = {k: list(p.choices) for k, p in space.items() if k in FIXED_KNOBS}
        p = self.pbt
        seed = self.sweep.seed if p.seed is None else p.seed
        maximize = self.sweep.objectives[0].direction == "maximize"
        return Policy(knobs, fixed, p.quantile, tuple(p.perturb), p.resample_probability, maximize, seed)

    def root(self) -> Path:
        """Where the population's members, saves and pages go."""
        return Path(self.spec().project_dir).resolve() / "populations" / self.name

    def refuse_a_second_start(self, resume: bool) -> None:
        """A population already saved in root() is continued with --resume, never started over it (checked before
        any model or flow run exists)."""
        if not resume and (self.root() / POPULATION_FILE).is_file():
            raise SweepError(
                f"population {self.name} already has a run in {self.root()}; continue it with --resume, or remove "
                "that folder"
            )

    def spec(self) -> ExperimentSpec:
        """The members' base spec: base + overrides, evals on the selection prompts."""
        return validate_spec(base_spec(self.sweep), "population base spec")

    def split(self) -> Split:
        return sweep_split(self.sweep)


def load_population(path: str | Path, sets: list[str] | tuple = ()) -> PopulationSpec:
    """Read and check a population file (one line naming the field and the fix on a mistake: SweepError)."""
    path = Path(path)
    data = read_yaml_mapping(
        path, "population file", "a sweep YAML with a pbt: section (see examples/pbt.yaml)", "a mapping", SweepError
    )
    try:
        pbt = PBTSpec.model_validate(data.pop("pbt", None) or {})
    except ValidationError as e:
        raise SweepError(f"{path}: field 'pbt': {describe_validation_error(e, 'see sweeps/population.py')}") from None
    here = path.resolve().parent
    if isinstance(data.get("base"), str) and not Path(data["base"]).is_absolute():
        data["base"] = str(here / data["base"])
    confirm = data.get("confirm")
    if isinstance(confirm, dict) and isinstance(confirm.get("data"), str) and not Path(confirm["data"]).is_absolute():
        data["confirm"]["data"] = str(here / data["confirm"]["data"])
    data.setdefault("study", path.stem)
    sweep = load_sweep(data, sets, where=str(path))
    _check(sweep, pbt, str(path))
    return PopulationSpec(sweep, pbt, str(path))


def _check(sweep: SweepSpec, pbt: PBTSpec, where: str) -> None:
    for key, p in sweep.space.items():
        if key not in SCHEDULED and key not in FIXED_KNOBS:
            raise SweepError(
                f"{where}: field 'space.{key}': a population schedules {', '.join(SCHEDULED)} and fixes lora.r per "
                f"member; move {key} to 'overrides'"
            )
        if key in SCHEDULED and p.type != "float":
            raise SweepError(f"{where}: field 'space.{key}': a scheduled knob is a float range; give type: float")
        if key in FIXED_KNOBS and p.type != "categorical":
            raise SweepError(f"{where}: field 'space.{key}': lora.r is fixed per member; give type: categorical")
    if len(sweep.objectives) != 1 or not sweep.objectives[0].metric.startswith("eval/"):
        raise SweepError(f"{where}: field 'objectives': a population ranks on one held-out score; give one eval/*")
    spec = validate_spec(base_spec(sweep), "population base spec")
    try:  # the members share one base model as concurrent trials do (trainer/multi.py)
        check_concurrent(spec.trainer_config(), None, "", who="a population's members", fix="")
    except InputError as e:
        raise SweepError(f"{where}: base spec: {' '.join(str(e).split(': ', 1)[-1].split())}") from None
    steps = spec.optim.steps
    if steps % pbt.ready:
        raise SweepError(
            f"{where}: field 'pbt.ready': optim.steps {steps} is not a multiple of {pbt.ready}; the last step must be "
            "a ranking — change pbt.ready or optim.steps"
        )
