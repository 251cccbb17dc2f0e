"""What a sweep found: the best trial (or the Pareto set), parameter importances, where the steps
went, and the plots — computed from the study alone, so any worker (or a later `ballast sweep`) can
write it. `SweepSummary` is the typed result flows/sweep.py returns; tasks/record.py logs it to the sweep's
MLflow parent run; its page is tasks/templates/sweep_summary.html.

- Importances are fANOVA's (Optuna's default) over COMPLETE trials; with fewer than two, or when
  every completed trial had the same values, there is nothing to apportion and `importances` holds
  the reason instead of numbers.
- Plots (optuna.visualization.matplotlib, PNG): optimisation history, parallel coordinates,
  objective vs each parameter (slice), importances, and the Pareto front for two objectives, each
  only once it means something (two completed trials to compare; intermediate values only when a
  trial reported two or more, its y axis named for the metric reported). A plot not drawn is listed
  under `plots_skipped` with the reason.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402
from optuna.visualization import matplotlib as vis  # noqa: E402

from tasks.pages import render_page  # noqa: E402

from .space import SweepSpec  # noqa: E402


@dataclass
class SweepSummary:
    study: str
    objectives: list[dict]
    objective_keys: list[str]  # names of the objective values ('eval/accuracy', 'stability', ...)
    states: dict[str, int]  # trial state -> count
    trial_steps: int  # training steps spent over all trials
    pruned_by_health_gate: int
    pruned_by_pruner: int
    trials: list[dict]  # trial_row() of every trial
    importances: dict
    best: dict | None = None  # single objective: the best COMPLETE trial's row
    pareto: list[dict] = field(default_factory=list)  # two objectives: the Pareto set
    storage: str = ""
    n_trials: int = 0
    done: bool = False
    parent_run_id: str | None = None
    dashboard: str = ""
    plots: list[Path] = field(default_factory=list)
    plots_skipped: dict[str, str] = field(default_factory=dict)
    html: str = ""
    run_url_template: str = ""  # a trial's MLflow run page, with '{run_id}' to fill in

    @property
    def n_complete(self) -> int:
        return self.states.get("COMPLETE", 0)

    def best_rows(self) -> list[dict]:
        return [self.best] if self.best else list(self.pareto)

    def to_dict(self) -> dict:
        return {**asdict(self), "plots": [str(p) for p in self.plots]}

    def write(self, out_dir: Path) -> None:
        """summary.json and summary.html under out_dir."""
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "summary.json").write_text(json.dumps(self.to_dict(), indent=1, default=str))
        self.html = str(render_page("sweep_summary.html", out_dir / "summary.html", s=self, fmt=format_value))

    def lines(self) -> list[str]:
        states = ", ".join(f"{n} {k.lower()}" for k, n in sorted(self.states.items())) or "no trials"
        out = [
            f"sweep {self.study}: {states}; {self.trial_steps} trial-steps; {self.pruned_by_health_gate} pruned "
            f"by the health gate, {self.pruned_by_pruner} by the pruner"
        ]
        if self.best:
            out.append(
                f"best: trial {self.best['number']} {format_values(self.best['values'])} with "
                f"{format_values(self.best['params'])} (MLflow run {self.best['mlflow_run_id']})"
            )
        for row in self.pareto:
            out.append(
                f"Pareto: trial {row['number']} {format_values(row['values'])} with {format_values(row['params'])}"
            )
        if not self.n_complete:
            out.append("no trial completed: every trial was pruned or failed — read the prune reasons in the summary")
        out += [f"summary:     {self.html}", f"dashboard:   {self.dashboard}"]
        return out


def trial_row(t: optuna.trial.FrozenTrial, sweep: SweepSpec) -> dict:
    values = t.values if t.values is not None else None
    return {
        "number": t.number,
        "state": t.state.name,
        "params": t.params,
        "values": dict(zip([o.key for o in sweep.objectives], values)) if values else None,
        "steps": t.user_attrs.get("last_step"),
        "prune_reason": t.user_attrs.get("prune_reason"),
        "pruned_by": t.user_attrs.get("pruned_by"),
        "error": t.user_attrs.get("error"),
        "not_counted": t.user_attrs.get("not_counted"),
        "mlflow_run_id": t.user_attrs.get("mlflow_run_id"),
        "worker": t.user_attrs.get("worker"),
        "seconds": (t.datetime_complete - t.datetime_start).total_seconds()
        if t.datetime_complete and t.datetime_start
        else None,
    }


def summarize(study: optuna.Study, sweep: SweepSpec) -> SweepSummary:
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    by_state: dict[str, int] = {}
    for t in trials:
        by_state[t.state.name] = by_state.get(t.state.name, 0) + 1
    out = SweepSummary(
        study=study.study_name,
        objectives=[o.model_dump() for o in sweep.objectives],
        objective_keys=[o.key for o in sweep.objectives],
        states=by_state,
        trial_steps=sum(int(t.user_attrs.get("last_step") or 0) for t in trials),
        pruned_by_health_gate=sum(1 for t in trials if t.user_attrs.get("pruned_by") == "health_gate"),
        pruned_by_pruner=sum(1 for t in trials if t.user_attrs.get("pruned_by") == "pruner"),
        trials=[trial_row(t, sweep) for t in trials],
        importances=importances(study, sweep),
    )
    if len(sweep.objectives) == 1:
        out.best = trial_row(study.best_trial, sweep) if complete else None
    else:
        out.pareto = [trial_row(t, sweep) for t in study.best_trials] if complete else []
    return out


def importances(study: optuna.Study, sweep: SweepSpec) -> dict:
    """{objective key: {param: importance}}, or {'skipped': reason}."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) < 2:
        return {"skipped": f"{len(complete)} completed trial(s); importances need at least 2"}
    out = {}
    for i, o in enumerate(sweep.objectives):
        values = {t.values[i] for t in complete}
        if len(values) < 2:
            out[o.key] = {"skipped": "every completed trial has the same value"}
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                imp = optuna.importance.get_param_importances(study, target=lambda t, i=i: t.values[i])
            out[o.key] = {k: round(float(v), 4) for k, v in imp.items()}
        except Exception as e:  # e.g. a parameter that never varied among completed trials
            out[o.key] = {"skipped": f"{type(e).__name__}: {e}"}
    return out


def plot_study(study: optuna.Study, sweep: SweepSpec, out_dir: Path) -> tuple[list[Path], dict[str, str]]:
    """PNG plots of the study; returns (paths, {plot: why skipped})."""
    out_dir.mkdir(parents=True, exist_ok=True)
    first = sweep.objectives[0]
    target = (lambda t: t.values[0]) if len(sweep.objectives) > 1 else None
    name = first.key
    jobs = {
        "optimization_history": lambda: vis.plot_optimization_history(study, target=target, target_name=name),
        "parallel_coordinate": lambda: vis.plot_parallel_coordinate(study, target=target, target_name=name),
        "slice": lambda: vis.plot_slice(study, target=target, target_name=name),
        "intermediate_values": lambda: vis.plot_intermediate_values(study),
    }
    if "skipped" not in importances(study, sweep) and "skipped" not in importances(study, sweep).get(name, {}):
        jobs["param_importances"] = lambda: vis.plot_param_importances(study, target=target, target_name=name)
    if len(sweep.objectives) == 2:
        jobs["pareto_front"] = lambda: vis.plot_pareto_front(study, target_names=[o.key for o in sweep.objectives])
    paths, skipped = [], {}
    n_complete = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    reported = sum(1 for t in study.get_trials(deepcopy=False) if len(t.intermediate_values) >= 2)
    for plot, make in jobs.items():
        if plot == "intermediate_values" and not reported:
            skipped[plot] = "no trial reported two or more intermediate values"
            continue
        if plot != "intermediate_values" and n_complete < MIN_COMPLETE:
            skipped[plot] = f"{n_complete} completed trial{'s' * (n_complete != 1)}: nothing to compare yet"
            continue
        try:
            with warnings.catch_warnings(), plt.rc_context():  # Optuna's plots switch matplotlib to its style
                warnings.simplefilter("ignore")
                fig = _figure_of(make())
                if plot == "intermediate_values":  # Optuna labels it 'Intermediate Value'; say which metric
                    fig.axes[0].set_ylabel(f"{first.report_metric} (reported each step)")
                wide = 3.2 * len(sweep.space) + 1.5 if plot == "slice" else 7.0  # one panel per parameter
                fig.set_size_inches(max(wide, fig.get_size_inches()[0]), 4.0)
                path = out_dir / f"{plot}.png"
                fig.savefig(path, dpi=90, bbox_inches="tight")
            plt.close(fig)
            paths.append(path)
        except Exception as e:
            skipped[plot] = f"{type(e).__name__}: {str(e)[:200]}"
            plt.close("all")
    return paths, skipped


MIN_COMPLETE = 2  # completed trials a comparison plot (history, slice, parallel coordinates, ...) needs


def _figure_of(ax):
    if isinstance(ax, np.ndarray):
        ax = ax.flat[0]
    return ax.get_figure() if hasattr(ax, "get_figure") else ax.figure


def format_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


def format_values(values: dict | None) -> str:
    """'grpo.beta=0.01235, lora.r=8': a trial's params or values as a person reads them (no dict repr)."""
    return ", ".join(f"{k}={format_value(v)}" for k, v in (values or {}).items())
