"""Pruning: the trainer's callbacks bound to an Optuna trial, and the verdict on a finished pipeline run.

Two ways a trial stops early, both recorded on the trial (`user_attrs`: `prune_reason`, `pruned_by`,
`last_step`) so a sweep's summary says why each configuration was dropped:

- **The pruner** (median, percentile, successive halving, hyperband) compares trials: every step
  `TrialPruning.on_step` reports the objective's intermediate value (`trial.report(value, step)`), and
  `should_stop` asks `trial.should_prune()`; when it says yes the trainer stops with 'pruned: ...' as its
  reason. For a held-out objective (eval/*) whose trials evaluate every `eval.every` steps, the value
  reported is that held-out score itself — multi-fidelity: a bad-but-healthy trial is stopped at a rung
  on the score it is judged by; without in-training eval it is the training reward.
- **The health gate** judges a trial on its own: when the pipeline's run stopped with
  'collapsed: ...' (the trainer's gate, trainer/health.py) the trial is pruned at once with that
  reason — a collapsed configuration gets no more steps, whatever the pruner thinks. It applies to
  two-objective studies too, where Optuna has no pruner.

`verdict()` turns a pipeline result into the objective value(s) or raises `optuna.TrialPruned`; before either
it records the trial's gain over the sweep's baseline (sweeps/baseline.py) on the trial, pruned trials too (their
final eval ran on the checkpoint where they stopped).
"""

from __future__ import annotations

import math

import optuna

from tasks.summary import PipelineResult
from trainer.loop import Callbacks

from .baseline import gain_of, load_baseline
from .space import SweepSpec, objective_value

COLLAPSED = "collapsed:"
PRUNED = "pruned:"


class TrialPruning(Callbacks):
    """Reports one value per step to the trial and stops the run when the pruner says so."""

    def __init__(self, trial: optuna.Trial, sweep: SweepSpec, spec=None):
        self.trial = trial
        self.metric = report_metric(sweep, spec)
        # Optuna has no intermediate values (hence no pruner) for multi-objective studies
        self.active = len(sweep.objectives) == 1 and self.metric is not None
        self.use_pruner = self.active and sweep.pruner.type != "none"
        self.last_value: float | None = None
        self.final_step = spec.optim.steps if spec is not None else None  # a trial that got there has finished

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        value = metrics.get(self.metric)
        if value is None or not math.isfinite(value):
            return
        self.last_value = float(value)
        self.trial.report(self.last_value, step)

    def should_stop(self, step: int, metrics: dict[str, float]) -> str | None:
        if not self.use_pruner or self.last_value is None or step == self.final_step:
            return None  # pruning a trial at its last step would save nothing and discard its finished result
        if not self.trial.should_prune():
            return None
        return (
            f"pruned: {self.metric}={self.last_value:.4g} at step {step} is worse than the pruner's threshold "
            f"({type(self.trial.study.pruner).__name__} over the trials so far)"
        )


def report_metric(sweep: SweepSpec, spec=None) -> str | None:
    """What the pruner sees each time a trial reports: the objective's `report`, else for a held-out objective the
    held-out score itself when the trials evaluate in training (`eval.every`), else the training reward."""
    first = sweep.objectives[0]
    if first.report is None and first.metric.startswith("eval/") and spec is not None and spec.eval.every:
        return first.metric
    return first.report_metric


def verdict(trial: optuna.Trial, result: PipelineResult, sweep: SweepSpec, health) -> float | list[float]:
    """The trial's objective value(s) from its pipeline result, or `optuna.TrialPruned` when the run was
    stopped by the health gate (with collapse pruning on) or by the pruner."""
    stopped = str(result.stopped) if result.stopped else ""  # 'collapsed: ...', 'pruned: ...'
    trial.set_user_attr("last_step", int(result.last_step or 0))
    trial.set_user_attr("run_status", result.status)
    record_gain(trial, result, sweep)
    if stopped.startswith(COLLAPSED) and sweep.prune_collapsed:
        _prune(trial, stopped, "health_gate")
    if stopped.startswith(PRUNED):
        _prune(trial, stopped, "pruner")
    values = [objective_value(o, result, health) for o in sweep.objectives]
    for o, v in zip(sweep.objectives, values):
        trial.set_user_attr(f"objective/{o.key}", v)
    return values[0] if len(values) == 1 else values


def record_gain(trial: optuna.Trial, result: PipelineResult, sweep: SweepSpec) -> None:
    """The first objective's score and its paired gain over the study's baseline, as trial user attrs."""
    first = sweep.objectives[0]
    gain = gain_of(first.key, result.eval_per_prompt, load_baseline(trial.study), first.direction)
    if gain is None:
        return
    trial.set_user_attr("gain_metric", first.key)
    trial.set_user_attr("score", gain.score)
    trial.set_user_attr("gain", gain.gain)
    trial.set_user_attr("gain_stderr", gain.stderr)
    trial.set_user_attr("beats_baseline", gain.beats_baseline)


def _prune(trial: optuna.Trial, reason: str, by: str):
    trial.set_user_attr("prune_reason", reason[:2000])
    trial.set_user_attr("pruned_by", by)
    raise optuna.TrialPruned(reason)
