"""Sweep files: what to vary, what to optimise, and how — declared in data, read define-by-run.

A sweep file is YAML (see examples/sweep.yaml):

    study: quickstart-sweep              # Optuna study name (default: the file's stem)
    base: quickstart.yaml                # experiment spec: a path (relative to this file) or inline mapping
    overrides:                           # dotted spec fields set on every trial (short trials, probe off, ...)
      optim.steps: 8
    space:                               # dotted spec field -> distribution
      optim.learning_rate: {type: float, low: 1.0e-4, high: 0.5, log: true}
      lora.r: {type: categorical, choices: [4, 8, 16]}
      grpo.num_generations: {type: int, low: 4, high: 8, step: 4}
    objectives:                          # one, or two for a Pareto front
      - {metric: eval/reward, direction: maximize}
      - {metric: stability, direction: minimize}
    sampler: {type: tpe}                 # tpe (default) | random | grid
    pruner: {type: median}               # median | percentile | successive_halving | hyperband | none
    prune_collapsed: true                # a trial whose health gate trips is pruned at once
    concurrent_trials: 1                 # N > 1: a worker trains N LoRA trials at once over one base model
    trials: 12                           # COMPLETE + PRUNED trials the study should end with
    storage: null                        # default sqlite:///<project_dir>/optuna.db; postgresql://... for a team
    seed: 0

The choices, on purpose:

- Every field of the sweep file and every dotted field of the space is checked when the file is
  loaded, before any trial runs: unknown keys, a space field that is not a field of the experiment
  spec, and a `low`/`high`/choice that the spec itself would refuse (lora.r: 0) all fail with one
  line naming the field (`SweepError`, a `SpecError`, so the CLI exits with status 2).
- Objective metrics come from the pipeline's summary. `eval/<name>` is the final held-out eval;
  a step metric (`kl`, `health/ngram_repetition`, ...) is reduced over the run's steps (`reduce`:
  last | mean | max | min); `stability` is the run's worst closeness to collapse: the largest
  value / threshold, over every step and every level signal the health gate watches, with the trial's own
  thresholds (0 = nothing moved, 1 = a signal reached its threshold; lower is steadier).
- The pruner sees one intermediate value per step: the objective's `report` metric (a step
  metric), by default `reward` for an eval objective — the training signal eval/reward is a
  held-out view of. Optuna cannot prune multi-objective studies, so with two objectives the
  pruner is `none` (collapse pruning still applies: it does not compare trials).
- `prune_collapsed: false` switches the health gate off in the trials, so a collapsing configuration
  runs to its last step and is judged by its objective alone (bench/collapse_pruning.py's
  baseline arm).
- `concurrent_trials: N` makes each worker run N trials at a time in its one process, as LoRA adapters over one
  shared frozen base model whose rollouts are sampled in one engine call (trainer/multi.py;
  flows/trials/concurrent.py says what else differs from one trial at a time). A sweep that cannot run so — the
  vllm engine, `rollout.max_off_policy_steps` > 0, a `data.environment`, full fine-tuning (`lora.enabled:
  false`) in the base spec or anywhere in the space — is refused when the file is loaded
  (`check_concurrent_sweep`), before any study or model exists. It is not part of the study's definition: a
  resume may change it.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks.spec import (
    ExperimentSpec,
    SpecError,
    describe_validation_error,
    parse_set,
    read_yaml_mapping,
    set_path,
    uri_has_password,
    validate_spec,
)
from trainer.config import HealthConfig
from trainer.health import GATE_SIGNALS, counts_in
from trainer.metrics import METRICS

from .split import Split, plan_split

BASELINE_SECTIONS = ("model", "data", "eval", "rewards")  # what the baseline shares with every trial


class SweepError(SpecError):
    """A sweep file that cannot be run; the message names the field and the fix."""


STORAGE_PASSWORD = (
    "the Optuna storage URL holds a password (user:***@host), which would be logged and shown in "
    "process lists; give it through PGPASSWORD or ~/.pgpass and the URL without it"
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ParamSpec(_Strict):
    """One dimension of the search space."""

    type: Literal["float", "int", "categorical"]
    low: float | None = Field(None, description="float/int: smallest value.")
    high: float | None = Field(None, description="float/int: largest value (inclusive).")
    log: bool = Field(False, description="float/int: sample on a log scale (low > 0).")
    step: float | None = Field(None, gt=0, description="float/int: discretisation step (not with log).")
    choices: list[bool | int | float | str | None] | None = Field(None, description="categorical: the values.")
    grid: list[bool | int | float | str | None] | None = Field(
        None, description="float/int: the values the grid sampler tries (categorical uses its choices, int its range)."
    )

    @model_validator(mode="after")
    def _consistent(self):
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("a categorical parameter needs a non-empty 'choices' list")
            if self.low is not None or self.high is not None or self.log or self.step is not None:
                raise ValueError("a categorical parameter takes 'choices' only, not low/high/log/step")
            return self
        if self.choices is not None:
            raise ValueError(f"'choices' is for type categorical; a {self.type} parameter takes low and high")
        if self.low is None or self.high is None:
            raise ValueError(f"a {self.type} parameter needs 'low' and 'high'")
        if self.low > self.high:
            raise ValueError(f"low={self.low:g} is above high={self.high:g}")
        if self.log and self.low <= 0:
            raise ValueError(f"log: true needs low > 0 (got low={self.low:g})")
        if self.log and self.step is not None:
            raise ValueError("'step' and 'log: true' cannot be combined (Optuna samples a log scale continuously)")
        if self.type == "int":
            for name in ("low", "high", "step"):
                v = getattr(self, name)
                if v is not None and v != int(v):
                    raise ValueError(f"an int parameter needs whole numbers; {name}={v:g}")
        return self

    def bounds(self) -> list:
        """The values this dimension can take at its edges (all of them for a categorical)."""
        if self.type == "categorical":
            return list(self.choices)
        cast = int if self.type == "int" else float
        return [cast(self.low), cast(self.high)]

    def grid_values(self) -> list | None:
        if self.type == "categorical":
            return list(self.choices)
        if self.grid is not None:
            return list(self.grid)
        if self.type == "int":
            return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))
        if self.step is not None:
            n = int(round((self.high - self.low) / self.step))
            return [self.low + i * self.step for i in range(n + 1)]
        return None


STEP_REDUCTIONS = ("last", "mean", "max", "min")


class ObjectiveSpec(_Strict):
    metric: str = Field("eval/reward", description="eval/<name> (final eval), 'stability', or a step metric.")
    direction: Literal["maximize", "minimize"] = "maximize"
    reduce: Literal["last", "mean", "max", "min"] = Field(
        "last", description="How a step metric is reduced over the run's steps."
    )
    report: str | None = Field(
        None,
        description="Step metric reported to the pruner each step; default the training-step counterpart of an "
        "eval objective ('reward' for eval/reward and eval/accuracy, 'completions/mean_length' for eval/mean_length), "
        "the metric itself for a step metric.",
    )

    @model_validator(mode="after")
    def _known_metric(self):
        if not (self.metric == "stability" or is_step_metric(self.metric)):
            raise ValueError(
                f"unknown metric {self.metric!r}; use eval/reward, eval/accuracy, eval/mean_length, "
                "stability, or a step metric (ballast metrics lists them)"
            )
        if self.report is not None and not is_step_metric(self.report):
            raise ValueError(f"report: {self.report!r} is not a step metric (ballast metrics lists them)")
        return self

    @property
    def report_metric(self) -> str | None:
        if self.report:
            return self.report
        if self.metric == "eval/mean_length":  # reported in the objective's direction: a length, not a reward
            return "completions/mean_length"
        if self.metric.startswith("eval/"):
            return "reward"
        return self.metric if is_step_metric(self.metric) else None

    @property
    def key(self) -> str:
        """The objective's name in summaries and MLflow (eval/reward, max/kl, stability)."""
        if self.metric == "stability" or self.metric.startswith("eval/"):
            return self.metric
        return f"{self.reduce}/{self.metric}"


class SamplerSpec(_Strict):
    type: Literal["tpe", "random", "grid"] = "tpe"
    n_startup_trials: int = Field(4, ge=0, description="tpe: random trials before TPE models the space.")
    multivariate: bool = Field(True, description="tpe: model parameters jointly (they interact: lr × beta × rank).")


class PrunerSpec(_Strict):
    type: Literal["median", "percentile", "successive_halving", "hyperband", "none"] = "median"
    n_startup_trials: int = Field(2, ge=0, description="median/percentile: trials that finish before pruning starts.")
    n_warmup_steps: int = Field(2, ge=0, description="median/percentile: steps of a trial before it can be pruned.")
    percentile: float = Field(25.0, gt=0, lt=100, description="percentile: keep trials above this percentile.")
    min_resource: int = Field(
        1, ge=1, description="successive_halving/hyperband: step of the first rung (match eval.every)."
    )
    reduction_factor: int = Field(
        3, ge=2, description="successive_halving/hyperband: a rung keeps the best 1/reduction_factor of the trials."
    )
    bootstrap_count: int = Field(
        0, ge=0, description="successive_halving: trials that must reach a rung before it prunes any."
    )
    max_resource: int | None = Field(None, ge=1, description="hyperband: steps of a full trial (default: observed).")


class ConfirmSpec(_Strict):
    """What happens after the search (sweeps/split.py, sweeps/confirmation.py): the held-out split, the trials scored
    on the confirmation prompts, and the training seeds the winner must hold across."""

    top_k: int = Field(
        3, ge=1, description="Completed trials, best on the selection prompts first, scored on the confirmation set."
    )
    seeds: int = Field(
        3,
        ge=1,
        description="Training seeds the verdict must hold across: the confirmed winner and runner-up are trained "
        "seeds - 1 more times with other optim.seed and rollout.seed (the prompts and their order stay).",
    )
    share: float = Field(0.5, gt=0, lt=1, description="Share of the held-out prompts kept back for confirmation.")
    min_prompts: int = Field(
        32, ge=1, description="Prompts each part of the split needs at least; a smaller held-out set is not split."
    )
    data: str | None = Field(
        None,
        description="A file of confirmation rows of your own (the forms data.source takes; relative to the sweep "
        "file); every held-out prompt then selects.",
    )


CONFIRM_RUN_FIELDS = ("top_k", "seeds")  # what happens after the search: a resume may change them


class HeartbeatSpec(_Strict):
    """How a trial whose worker died is noticed: the worker writes a heartbeat every `interval` s; a
    RUNNING trial silent for `grace_period` s is failed (not counted) and its configuration retried."""

    interval: int = Field(10, ge=1)
    grace_period: int = Field(40, ge=2)
    retries: int = Field(1, ge=0, description="Times an interrupted configuration is re-queued.")


RUN_FIELDS = {"trials", "storage", "heartbeat", "max_consecutive_failures", "concurrent_trials"}  # not the study's


class SweepSpec(_Strict):
    study: str | None = Field(None, description="Optuna study name; default the sweep file's stem.")
    base: str | dict = Field(
        description="Experiment spec: a YAML path (relative to the sweep file) or an inline mapping."
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Dotted spec field -> value, applied to every trial."
    )
    space: dict[str, ParamSpec] = Field(description="Dotted spec field -> distribution.")
    objectives: list[ObjectiveSpec] = Field(default_factory=lambda: [ObjectiveSpec()], min_length=1, max_length=2)
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    pruner: PrunerSpec | None = Field(None, description="Default: median for one objective, none for two.")
    prune_collapsed: bool = Field(True, description="Prune a trial as soon as its health gate trips.")
    trials: int | None = Field(
        None, ge=1, description="COMPLETE + PRUNED trials to end with; default the grid's size, or 10."
    )
    storage: str | None = Field(None, description="Optuna storage URL; default sqlite:///<project_dir>/optuna.db.")
    seed: int = 0
    heartbeat: HeartbeatSpec = Field(default_factory=HeartbeatSpec)
    max_consecutive_failures: int = Field(3, ge=1, description="A worker stops after this many failed trials in a row.")
    concurrent_trials: int = Field(
        1, ge=1, description="Trials a worker trains at once as LoRA adapters over one base model (1: one at a time)."
    )
    confirm: ConfirmSpec = Field(
        default_factory=ConfirmSpec, description="The confirmation split, the trials confirmed, the seeds."
    )

    @field_validator("storage")
    @classmethod
    def _no_password(cls, url: str | None) -> str | None:
        if url and uri_has_password(url):
            raise ValueError(STORAGE_PASSWORD)
        return url

    @model_validator(mode="after")
    def _default_pruner(self):
        if self.pruner is None:
            self.pruner = PrunerSpec(type="median" if len(self.objectives) == 1 else "none")
        return self

    def grid_size(self) -> int:
        return math.prod(len(p.grid_values() or []) for p in self.space.values())

    @property
    def n_trials(self) -> int:
        if self.trials is not None:
            return self.trials
        return self.grid_size() if self.sampler.type == "grid" else 10

    @property
    def study_name(self) -> str:
        return self.study or "ballast-sweep"

    @property
    def directions(self) -> list[str]:
        return [o.direction for o in self.objectives]

    def definition(self) -> dict:
        """What a study is bound to: a rerun may change the trial count, storage and heartbeat, and what happens after
        the search (confirm.top_k, confirm.seeds), not this."""
        excluded = {**dict.fromkeys(RUN_FIELDS, True), "confirm": set(CONFIRM_RUN_FIELDS)}
        return self.model_dump(mode="json", exclude=excluded)


# ------------------------------------------------------------------------------------------ loading


def load_sweep(
    source: str | Path | dict, sets: list[str] | tuple = (), searching: bool = True, where: str = "sweep"
) -> SweepSpec:
    """Read and check a sweep file; the base spec is resolved and inlined (`sweep.base` is a dict after), with the
    command line's `--set key=value` items applied to it (the study stores the result: a resume takes the same). A
    `--set` of a field the file's overrides also set wins over them; of a field the space searches, it is refused
    (`searching`: a search runs on this sweep; `--promote` sets what its one run takes, after the trial's values).
    `where`: the name errors give a mapping `source` (a file's own path otherwise)."""
    if isinstance(source, dict):
        data, here, stem = json.loads(json.dumps(source)), Path.cwd(), None
    else:
        path = Path(source)
        data = read_yaml_mapping(
            path,
            "sweep file",
            "a sweep YAML (see examples/sweep.yaml)",
            "a mapping (base:, space:, objectives:, ...)",
            error=SweepError,
        )
        where, here, stem = str(path), path.resolve().parent, path.stem
    try:
        sweep = SweepSpec.model_validate(data)
    except ValidationError as e:
        hint = "see the sweep file reference in sweeps/space.py"
        raise SweepError(f"{where}: {describe_validation_error(e, hint)}") from None
    if sweep.study is None and stem:
        sweep.study = stem
    sweep.base = _base_mapping(sweep.base, here, where)
    if sweep.confirm.data is not None:
        sweep.confirm.data = _confirmation_file(sweep.confirm.data, here, where)
    for item in sets:
        key = item.split("=", 1)[0].strip()
        head = key.split(".")[0]
        if head in {*SweepSpec.model_fields, "pbt"} - set(ExperimentSpec.model_fields):
            raise SweepError(  # concurrent_trials, trials, pbt.ready, ...: the file's, which --set does not edit
                f"--set {key}: '{head}' is a field of the {'population' if head == 'pbt' else 'sweep'} file, and "
                f"--set edits its base experiment spec; set {key} in {where}"
            )
        if "=" in item:
            _check_field(key, f"--set {key}")
        if searching and key in sweep.space:  # every trial's suggestion would replace it: it did nothing, silently
            raise SweepError(
                f"--set {key}: {where} searches {key} (field 'space'); drop the --set, or take {key} out of the space "
                "and set it in 'overrides'"
            )
        set_path(sweep.base, item)
        if key in sweep.overrides:  # the file's override would win over the base: the command line's value wins
            sweep.overrides[key] = parse_set(item)[1]
    if sets:
        try:
            validate_spec(sweep.base, "sweep base spec with --set")
        except SpecError as e:
            raise SweepError(str(e)) from None
    check_space(sweep, where)
    return sweep


def _base_mapping(base: str | dict, here: Path, where: str) -> dict:
    if isinstance(base, dict):
        return json.loads(json.dumps(base))
    path = Path(base)
    if not path.is_absolute():
        path = here / path
    return read_yaml_mapping(
        path,
        f"{where}: field 'base': spec file",
        "an experiment YAML (relative to the sweep file)",
        "a mapping of spec sections",
        error=SweepError,
    )


def _confirmation_file(value: str, here: Path, where: str) -> str:
    """confirm.data, absolute (relative to the sweep file, then the working directory), its rows read and checked."""
    from trainer.data import locate_data_file, read_examples

    try:
        path = locate_data_file(value, "confirm.data", here)
        if not read_examples(path, "confirm.data", "test"):
            raise ValueError(f"confirm.data: {path} holds no rows; give a file of confirmation rows, or leave it out")
    except (ValueError, FileNotFoundError) as e:
        raise SweepError(f"{where}: {e}") from None
    return path


def check_space(sweep: SweepSpec, where: str = "sweep") -> None:
    """Every override and space field names a spec field, every edge value of the space is one the spec
    accepts, and sampler, pruner and trial count fit the space — so a typo or an impossible range fails
    now, not in trial 7."""
    if not sweep.space:
        raise SweepError(
            f"{where}: field 'space' is empty; add at least one dotted spec field, e.g. optim.learning_rate"
        )
    if (sweep.base.get("eval") or {}).get("split") is not None or any(
        k == "eval.split" or k.startswith("eval.split.") for k in sweep.overrides
    ):
        raise SweepError(
            f"{where}: field 'eval.split' is the sweep's to set (its selection prompts, sweeps/split.py); leave it out "
            "and say how to split with confirm.share, confirm.min_prompts or confirm.data"
        )
    for key in sweep.overrides:
        _check_field(key, f"{where}: field 'overrides.{key}'")
    for key in sweep.space:
        _check_field(key, f"{where}: field 'space.{key}'")
        if key.split(".")[0] in BASELINE_SECTIONS:
            raise SweepError(
                f"{where}: field 'space.{key}': a sweep reads every trial against one baseline scored on the same "
                f"held-out set with the same eval settings, so {', '.join(BASELINE_SECTIONS)} fields cannot vary; "
                "set it in 'overrides' (or the base spec) and sweep once per value"
            )
    base = base_spec(sweep)  # overrides alone must give a valid spec
    for key, param in sweep.space.items():
        for value in param.bounds():
            try:
                trial_spec(sweep, {key: value}, base=base)
            except SpecError as e:
                raise SweepError(
                    f"{where}: field 'space.{key}': value {value!r} is not accepted by the spec "
                    f"({str(e).split(': ', 1)[-1]})"
                ) from None
    _check_corners(sweep, base, where)
    if len(sweep.objectives) == 2 and sweep.pruner.type != "none":
        raise SweepError(
            f"{where}: field 'pruner': Optuna cannot prune a two-objective study; "
            "set pruner: {type: none} "
            "(collapse pruning still applies)"
        )
    if sweep.sampler.type == "grid":
        missing = [k for k, p in sweep.space.items() if p.grid_values() is None]
        if missing:
            raise SweepError(
                f"{where}: field 'sampler': the grid sampler needs a finite set of values for "
                f"'space.{missing[0]}': "
                "give it 'grid: [...]' or 'step', or make it categorical"
            )
        if sweep.trials is not None and sweep.trials > sweep.grid_size():
            raise SweepError(
                f"{where}: field 'trials': {sweep.trials} is more than the {sweep.grid_size()} points of the grid"
            )
    check_concurrent_sweep(sweep, where, base)


MAX_CORNERS = 4096  # combinations of the dimensions' edge values checked together (each a pydantic validation, ~0.1 ms)


def _check_corners(sweep: SweepSpec, base: dict, where: str) -> None:
    """Every combination of the dimensions' edge values is a spec the fields' cross-checks accept (min_tokens at its
    high edge beside max_tokens at its low one): each value alone passed, so without this the first trial to draw
    such a pair failed, hours in. The spec's own checks only (pydantic): the data and
    the rewards were checked once with the base."""
    edges = [param.bounds() for param in sweep.space.values()]
    if len(edges) < 2 or math.prod(map(len, edges)) > MAX_CORNERS:
        return
    for values in itertools.product(*edges):
        data = json.loads(json.dumps(base))
        for key, value in zip(sweep.space, values):
            set_path(data, f"{key}={json.dumps(value)}")
        try:
            ExperimentSpec.model_validate(data)
        except ValidationError as e:
            together = ", ".join(f"{key}={value!r}" for key, value in zip(sweep.space, values))
            raise SweepError(
                f"{where}: field 'space': the trial {together} is not accepted by the spec "
                f"({describe_validation_error(e, '')}); each value alone is: narrow the ranges so that every "
                "combination is valid"
            ) from None


def check_concurrent_sweep(sweep: SweepSpec, where: str = "sweep", base: dict | None = None) -> None:
    """With `concurrent_trials` > 1, the base spec and every edge value of the space must be a trial that can share one
    base model with the others (trainer/multi.py `check_concurrent`): a SweepError naming the field otherwise —
    before any study, run or model exists."""
    if sweep.concurrent_trials == 1:
        return
    from trainer.config import InputError
    from trainer.sharing import check_concurrent

    base = base if base is not None else base_spec(sweep)
    first = trial_spec(sweep, {}, base=base)
    first_cfg = first.trainer_config()
    candidates = [("the base spec", first)] + [
        (f"space.{key}={value!r}", trial_spec(sweep, {key: value}, base=base))
        for key, param in sweep.space.items()
        for value in param.bounds()
    ]
    for label, spec in candidates:
        try:
            check_concurrent(spec.trainer_config(), first_cfg, label)
        except InputError as e:
            reason = " ".join(str(e).split(": ", 1)[-1].split())  # check_concurrent's 'trial <label>: ' is said here
            raise SweepError(
                f"{where}: field 'concurrent_trials': {sweep.concurrent_trials} trials at once cannot run {label}: "
                f"{reason}"
            ) from None


def largest_lora_rank(sweep: SweepSpec, base: dict | None = None) -> int:
    """The largest lora.r a trial of this sweep can take: the size of the vLLM server its concurrent trials share."""
    base = base if base is not None else base_spec(sweep)
    ranks = [trial_spec(sweep, {}, base=base).lora.r]
    if "lora.r" in sweep.space:
        ranks += [int(v) for v in sweep.space["lora.r"].bounds()]
    return max(ranks)


def _check_field(dotted: str, label: str) -> None:
    model: Any = ExperimentSpec
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            known = ", ".join(sorted(fields)) if fields else "(none: it is not a section)"
            raise SweepError(
                f"{label}: '{'.'.join(parts[: i + 1])}' is not a field of the experiment spec; fields here: {known}"
            )
        model = fields[part].annotation
    if isinstance(model, type) and issubclass(model, BaseModel):
        example = f"{dotted}.{next(iter(model.model_fields))}"
        raise SweepError(f"{label}: '{dotted}' is a whole section; name one of its fields, e.g. '{example}'")


def base_spec(sweep: SweepSpec) -> dict:
    """The base spec with the sweep's overrides applied, as a plain mapping (validated), and its evals on the selection
    prompts of the sweep's split (`eval.split`, sweeps/split.py) — what every trial starts from."""
    data = baseline_spec(sweep)
    selection = sweep_split(sweep, data).selection_eval()
    if selection is not None:
        data.setdefault("eval", {})["split"] = selection
    return data


def baseline_spec(sweep: SweepSpec) -> dict:
    """The base spec with the sweep's overrides applied, as a plain mapping (validated): its evals score every
    held-out prompt, selection and confirmation ones (the baseline's, read part by part). Its MLflow experiment is
    the study's name unless the base spec or the overrides name one (tracking.experiment)."""
    data = json.loads(json.dumps(sweep.base))
    for key, value in sweep.overrides.items():
        set_path(data, f"{key}={json.dumps(value)}")
    if not (data.get("tracking") or {}).get("experiment"):  # the sweep's runs in an MLflow experiment of its own
        data.setdefault("tracking", {})["experiment"] = sweep.study_name
    validate_spec(data, "sweep base spec with overrides")
    return data


def sweep_split(sweep: SweepSpec, base: dict | None = None) -> Split:
    """How the sweep's held-out prompts split into selection and confirmation ones (sweeps/split.py): nothing is kept
    back for an objective that is not a held-out score, or for two objectives (a Pareto set has no one winner)."""
    spec = validate_spec(base if base is not None else baseline_spec(sweep), "sweep base spec")
    c, first = sweep.confirm, sweep.objectives[0]
    n = _held_out_size(json.dumps(spec.data.model_dump(mode="json"), sort_keys=True))
    if len(sweep.objectives) > 1 or not first.metric.startswith("eval/"):
        why = "two objectives: a Pareto set has no one winner" if len(sweep.objectives) > 1 else None
        why = why or f"the objective {first.key} is not a held-out score"
        return Split("none", n, sweep.seed, c.share, list(range(n)), reason=f"{why}; nothing to confirm")
    n_file = _confirmation_size(c.data) if c.data else 0
    return plan_split(n, sweep.seed, c.share, c.min_prompts, c.data, n_file)


@functools.lru_cache(maxsize=16)
def _held_out_size(data_json: str) -> int:
    from trainer.config import DataConfig
    from trainer.data import load_datasets

    return len(load_datasets(DataConfig.model_validate(json.loads(data_json)))[1])


@functools.lru_cache(maxsize=4)
def _confirmation_size(path: str) -> int:
    from trainer.data import read_examples

    return len(read_examples(path, "confirm.data", "test"))


def trial_spec(
    sweep: SweepSpec, params: dict[str, Any], name: str | None = None, base: dict | None = None
) -> ExperimentSpec:
    """The experiment one trial runs: base + overrides + the trial's values (+ the health gate off when
    collapse pruning is off)."""
    data = json.loads(json.dumps(base if base is not None else base_spec(sweep)))
    for key, value in params.items():
        set_path(data, f"{key}={json.dumps(value)}")
    if name:
        data["name"] = name
    if not sweep.prune_collapsed:
        data.setdefault("health", {})["enabled"] = False
    return validate_spec(data, f"trial {name or ''}".strip())


# ------------------------------------------------------------------------------------------ suggesting


def suggest(trial, space: dict[str, ParamSpec]) -> dict[str, Any]:
    """Ask the trial for one value per dimension (define-by-run); returns {dotted field: value}."""
    out: dict[str, Any] = {}
    for name, p in space.items():
        if p.type == "categorical":
            out[name] = trial.suggest_categorical(name, p.choices)
        elif p.type == "int":
            out[name] = trial.suggest_int(name, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
        else:
            out[name] = trial.suggest_float(name, p.low, p.high, step=p.step, log=p.log)
    return out


# ------------------------------------------------------------------------------------------ objectives


def is_step_metric(name: str) -> bool:
    """A metric a step reports (eval/* ones too, at eval.every steps); eval/* objectives read the final eval."""
    return name in METRICS or (name.startswith("rewards/") and name.endswith("/mean"))


def stability(history: list[dict], health: HealthConfig) -> float:
    """How close the run came to collapsing: the max over steps and the gate's level signals of value / threshold
    (1 at the threshold). A signal that trips *below* its threshold (group diversity) counts 2 - value / threshold:
    1 at the threshold, 2 at zero. Reward-hacking alarms, which need a second signal in the same step, are not
    levels and are left out."""
    worst = 0.0
    for m in history:
        for name, alarm in GATE_SIGNALS.items():
            if getattr(alarm, "also", None) or not counts_in(alarm, m):
                continue
            value, threshold = m.get(name), getattr(health, alarm[0])
            if value is None or value != value or threshold <= 0:
                continue
            worst = max(worst, max(0.0, 2 - value / threshold) if getattr(alarm, "below", False) else value / threshold)
    return worst


def objective_value(obj: ObjectiveSpec, result, health: HealthConfig) -> float:
    """One objective's value from a pipeline result (tasks.results.PipelineResult); raises ValueError when the run
    did not produce it."""
    history = result.history
    if obj.metric == "stability":
        return stability(history, health)
    if obj.metric.startswith("eval/"):
        value = result.eval.get(obj.metric)
        if value is None:
            raise ValueError(
                f"objective {obj.metric}: the run's final eval has no such metric (it has {sorted(result.eval)})"
            )
        return float(value)
    values = [m[obj.metric] for m in history if obj.metric in m and m[obj.metric] == m[obj.metric]]
    if not values:
        raise ValueError(f"objective {obj.metric}: no step of the run reported it")
    return {"last": values[-1], "mean": sum(values) / len(values), "max": max(values), "min": min(values)}[obj.reduce]
