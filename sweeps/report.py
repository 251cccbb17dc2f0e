"""What a sweep found: the best trial (or the Pareto set), parameter importances, where the steps
went, and the plots — computed from the study alone, so any worker (or a later `ballast sweep`) can
write it. flows/sweep.py logs it to the sweep's MLflow parent run.

- Importances are fANOVA's (Optuna's default) over COMPLETE trials; with fewer than two, or when
  every completed trial had the same values, there is nothing to apportion and `importances` holds
  the reason instead of numbers.
- Plots (optuna.visualization.matplotlib, PNG): optimisation history, parallel coordinates,
  objective vs each parameter (slice), importances, and the Pareto front for two objectives. A plot
  that cannot be drawn (e.g. one completed trial) is listed under `plots_skipped` with the reason.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import optuna
from optuna.trial import TrialState

from .space import SweepSpec


def trial_row(t: optuna.trial.FrozenTrial, sweep: SweepSpec) -> dict:
    values = t.values if t.values is not None else None
    return {
        "number": t.number, "state": t.state.name, "params": t.params,
        "values": dict(zip([o.key for o in sweep.objectives], values)) if values else None,
        "steps": t.user_attrs.get("last_step"), "prune_reason": t.user_attrs.get("prune_reason"),
        "pruned_by": t.user_attrs.get("pruned_by"), "error": t.user_attrs.get("error"),
        "not_counted": t.user_attrs.get("not_counted"), "mlflow_run_id": t.user_attrs.get("mlflow_run_id"),
        "worker": t.user_attrs.get("worker"),
        "seconds": (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_complete and t.datetime_start else None,
    }


def summarize(study: optuna.Study, sweep: SweepSpec) -> dict:
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    by_state: dict[str, int] = {}
    for t in trials:
        by_state[t.state.name] = by_state.get(t.state.name, 0) + 1
    out: dict = {
        "study": study.study_name, "objectives": [o.model_dump() for o in sweep.objectives],
        "states": by_state, "trial_steps": sum(int(t.user_attrs.get("last_step") or 0) for t in trials),
        "pruned_by_health_gate": sum(1 for t in trials if t.user_attrs.get("pruned_by") == "health_gate"),
        "pruned_by_pruner": sum(1 for t in trials if t.user_attrs.get("pruned_by") == "pruner"),
        "trials": [trial_row(t, sweep) for t in trials],
    }
    if len(sweep.objectives) == 1:
        out["best"] = trial_row(study.best_trial, sweep) if complete else None
    else:
        out["pareto"] = [trial_row(t, sweep) for t in study.best_trials] if complete else []
    out["importances"] = importances(study, sweep)
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as vis

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
    for plot, make in jobs.items():
        if n_complete == 0 and plot != "intermediate_values":
            skipped[plot] = "no completed trial"
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fig = _figure_of(make())
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


def _figure_of(ax):
    import numpy as np
    if isinstance(ax, np.ndarray):
        ax = ax.flat[0]
    return ax.get_figure() if hasattr(ax, "get_figure") else ax.figure


def format_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)
