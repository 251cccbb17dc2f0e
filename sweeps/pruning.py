"""Pruning: the trainer's callbacks bound to an Optuna trial, and the verdict on a finished pipeline run.

Two ways a trial stops early, both recorded on the trial (`user_attrs`: `prune_reason`, `pruned_by`,
`last_step`) so a sweep's summary says why each configuration was dropped:

- **The pruner** (median, percentile, successive halving, hyperband) compares trials: every step
  `TrialPruning.on_step` reports the objective's intermediate value (`trial.report(value, step)`), and
  `should_stop` asks `trial.should_prune()`; when it says yes the trainer stops with 'pruned: ...' as its
  reason. For a held-out objective (eval/*) whose trials evaluate every `eval.every` steps, the value
  reported is that held-out score itself (on the selection prompts, sweeps/split.py) — multi-fidelity: a
  bad-but-healthy trial is stopped at a rung on the score it is judged by; without in-training eval it is the
  training reward.
- **A rung decision accounts for the interval.** A held-out score comes with its standard error (kept on the trial,
  user attr `reported_stderr`, per step); the pruner's "stop" stands only when some other trial scored better at the
  same step beyond noise (sweeps/statistics.py `behind_beyond_noise`: the gap exceeds the 95 % interval of the
  difference). A trial one prompt behind the leader on 16 prompts goes on; the veto is kept on the trial
  (`prune_vetoed`: the steps) and said in its progress. A reported value without a standard error (the training
  reward) leaves the pruner's decision as it is.
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

from tasks.results import PipelineResult
from trainer.callbacks import Callbacks
from trainer.checkpoint import fault_point

from .baseline import gain_of, load_baseline
from .space import SweepSpec, objective_value
from .split import load_split
from .statistics import Z95, behind_beyond_noise

COLLAPSED = "collapsed:"
PRUNED = "pruned:"
STDERR_ATTR = "reported_stderr"  # trial user attr: {step: standard error of the value reported at that step}


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
        self.direction = sweep.objectives[0].direction
        self.stderrs: dict[str, float] = {}  # step -> the reported value's standard error
        self.vetoed: list[int] = []  # steps where the pruner said stop and the interval said not yet

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        for fault in ("kill-in-trial", "hold-in-trial"):  # BALLAST_FAULT=kill-in-trial-1-step:2: the sweep tests' hooks
            fault_point(f"{fault}-{self.trial.number}-step", step)
        if not self.active:
            return
        value = metrics.get(self.metric)
        if value is None or not math.isfinite(value):
            return
        self.last_value = float(value)
        self.trial.report(self.last_value, step)
        se = metrics.get(f"{self.metric}_stderr")
        if se is not None and math.isfinite(se):
            self.stderrs[str(step)] = float(se)
            self.trial.set_user_attr(STDERR_ATTR, dict(self.stderrs))

    def should_stop(self, step: int, metrics: dict[str, float]) -> str | None:
        if not self.use_pruner or self.last_value is None or step == self.final_step:
            return None  # pruning a trial at its last step would save nothing and discard its finished result
        if not self.trial.should_prune():
            return None
        pruner = next(c.__name__ for c in type(self.trial.study.pruner).__mro__ if c.__module__.startswith("optuna"))
        se = self.stderrs.get(str(step))
        if se is None:  # no interval to account for (the training reward): the pruner's decision stands
            return (
                f"pruned: {self.metric}={self.last_value:.4g} at step {step} is worse than the pruner's threshold "
                f"({pruner} over the trials so far)"
            )
        ahead = better_beyond_noise(self.trial, step, self.last_value, se, self.direction)
        if ahead is None:
            self.vetoed.append(step)
            self.trial.set_user_attr("prune_vetoed", list(self.vetoed))
            return None
        number, value, other_se = ahead
        return (
            f"pruned: {self.metric}={self.last_value:.4g} ± {Z95 * se:.2g} at step {step} is behind trial {number}'s "
            f"{value:.4g} ± {Z95 * other_se:.2g} beyond noise ({pruner} ranked it out; ± is a 95 % interval)"
        )


def better_beyond_noise(trial, step: int, value: float, se: float, direction: str) -> tuple[int, float, float] | None:
    """(number, value, standard error) of the trial that scored best at `step` among those better than `value` beyond
    noise; None when no trial is (then a rung may not stop this one)."""
    sign = 1 if direction == "maximize" else -1
    best = None
    for other in trial.study.get_trials(deepcopy=False):
        if other.number == trial.number or step not in other.intermediate_values:
            continue
        other_se = (other.user_attrs.get(STDERR_ATTR) or {}).get(str(step))
        v = other.intermediate_values[step]
        if other_se is None or not behind_beyond_noise(value, se, v, other_se, direction):
            continue
        if best is None or sign * v > sign * best[1]:
            best = (other.number, v, other_se)
    return best


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
    """The first objective's score and its paired gain over the study's baseline on the selection prompts, and the
    final checkpoint (what a confirmation reloads), as trial user attrs. `beats_baseline`: the gain clears one
    comparison's 95 % interval — what ranked it, not a claim (the claim is sweeps/confirmation.py's)."""
    if result.checkpoints:
        trial.set_user_attr("checkpoint_uri", result.checkpoints[max(result.checkpoints)])
    for key, value in run_tokens(result.history, sweep_completions(trial)).items():  # what the trial cost
        trial.set_user_attr(key, value)
    first = sweep.objectives[0]
    study = trial.study
    gain = gain_of(first.key, result.eval_per_prompt, load_baseline(study), first.direction, load_split(study))
    if gain is None:
        return
    trial.set_user_attr("gain_metric", first.key)
    trial.set_user_attr("score", gain.score)
    trial.set_user_attr("gain", gain.gain)
    trial.set_user_attr("gain_stderr", gain.stderr)
    trial.set_user_attr("gain_n", gain.n)
    trial.set_user_attr("beats_baseline", gain.beats_baseline)


def sweep_completions(trial) -> int | None:
    """Completions one step of the trial samples, from its spec's `planned_completions` (set when the trial starts)."""
    return trial.user_attrs.get("completions_per_step")


def run_tokens(history: list[dict], completions_per_step: int | None) -> dict[str, float]:
    """Tokens a run cost: `tokens_trained`, the prompt and completion tokens its steps trained on (trainer/metrics.py
    `num_tokens`, cumulative), and `tokens_generated`, the completion tokens it sampled (each step's mean completion
    length times its completions)."""
    out: dict[str, float] = {}
    trained = [m["num_tokens"] for m in history if "num_tokens" in m]
    if trained:
        out["tokens_trained"] = float(trained[-1])
    if completions_per_step:
        lengths = [m["completions/mean_length"] for m in history if "completions/mean_length" in m]
        out["tokens_generated"] = float(sum(lengths) * completions_per_step)
    return out


def _prune(trial: optuna.Trial, reason: str, by: str):
    trial.set_user_attr("prune_reason", reason[:2000])
    trial.set_user_attr("pruned_by", by)
    raise optuna.TrialPruned(reason)
