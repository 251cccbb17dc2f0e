"""What a sweep found, read against its baseline: the best trial that beats the base model beyond noise (or the
Pareto set), what pruning saved, parameter importances and the plots — computed from the study alone, so any worker
(or a later `ballast sweep`) can write it. `SweepSummary` is the typed result flows/sweep.py returns;
tasks/record.py logs it to the sweep's MLflow parent run; its page is tasks/templates/sweep_summary.html.

- **Relative.** The study holds the baseline (sweeps/baseline.py); every trial row holds its score, gain and the
  gain's uncertainty. "best" is only said of a COMPLETE trial whose gain is beyond noise; otherwise the summary
  says "no trial beat the base model beyond noise" and names the closest.
- **Pruning's saving** is counted in trial-steps (one GRPO step of one trial): each pruned trial's planned steps
  minus the steps it ran, against the steps every trial would have run to its end.
- **One importance ranking**: fANOVA's (Optuna's default) over COMPLETE trials, only from MIN_IMPORTANCE_TRIALS
  completed trials on (fewer points than that apportion noise), and labelled with the count it came from.
- **Plots** (matplotlib PNG, drawn here so that they show what a sweep is for): score per trial, parallel
  coordinates and score against each parameter with every trial — collapsed and pruned ones in their own colours,
  log axes for log-scaled parameters, the baseline (and its 95 % band) on every score axis — the intermediate
  values each trial reported, and Optuna's Pareto front for two objectives. A plot not drawn is listed under
  `plots_skipped` with the reason.
- **What the compute cost** (`ComputeTotal`): the trials' wall time, always; and the provisioned nodes — a sweep's
  worker nodes (`ballast sweep --workers K` with `infra.compute` local or skypilot, kept on the study) or each
  trial's own train-stage node (its MLflow `compute/*`, kept on the trial) — summed: provision and run seconds,
  restarts and the estimated cost of the nodes SkyPilot's catalog priced ("price unknown" for the others).
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

from .baseline import Z95, load_baseline  # noqa: E402
from .confirmation import Confirmation, load_confirmation, verdict_lines  # noqa: E402
from .space import SweepSpec  # noqa: E402
from .study import COMPUTE_ATTR, NODE_ATTR  # noqa: E402

MIN_COMPLETE = 2  # completed trials a comparison plot needs
MIN_IMPORTANCE_TRIALS = 8  # completed trials before importances are computed (fANOVA over fewer apportions noise)
COLOURS = {"COMPLETE": "#0969da", "collapsed": "#cf222e", "pruned": "#8250df", "FAIL": "#6e7781"}


NODE_FIELDS = dict.fromkeys(("name", "compute", "node", "accelerators", "cloud", "region", "hourly_usd", "cost_usd"))
NODE_FIELDS |= {"spot": False, "provision_s": 0.0, "run_s": 0.0, "restarts": 0, "torn_down": True}


@dataclass
class ComputeTotal:
    """What the sweep's compute cost, summed over its trials and the nodes provisioned for it."""

    trial_s: float = 0.0  # wall time of every trial that ended, summed
    span_s: float = 0.0  # from the first trial's start to the last one's end: less than trial_s when trials overlap
    nodes: list[dict] = field(default_factory=list)  # each node's usage: name, compute, provision_s, run_s, ...
    provision_s: float = 0.0
    run_s: float = 0.0
    restarts: int = 0
    cost_usd: float | None = None  # the sum of the nodes' estimated costs that are known
    unpriced: int = 0  # nodes with no hourly price (this machine, or SkyPilot's catalog not here)
    not_torn_down: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, nodes: list[dict], trial_s: float, span_s: float = 0.0) -> ComputeTotal:
        nodes = [{**NODE_FIELDS, **n} for n in nodes]
        costs = [float(n["cost_usd"]) for n in nodes if n["cost_usd"] is not None]
        return cls(
            trial_s=trial_s,
            span_s=span_s,
            nodes=nodes,
            provision_s=sum(float(n["provision_s"]) for n in nodes),
            run_s=sum(float(n["run_s"]) for n in nodes),
            restarts=sum(int(n["restarts"]) for n in nodes),
            cost_usd=sum(costs) if costs else None,
            unpriced=len(nodes) - len(costs),
            not_torn_down=[str(n["name"]) for n in nodes if not n["torn_down"]],
        )

    def cost_text(self) -> str:
        if self.cost_usd is None:
            return "price unknown"
        if self.unpriced:
            return f"~${self.cost_usd:.2f} for the priced nodes, price unknown for {self.unpriced}"
        return f"~${self.cost_usd:.2f}"

    @property
    def overlapped(self) -> bool:
        """Trials ran at once (concurrent trials, or several workers): their minutes add up to more than the wall's."""
        return 0 < self.span_s < 0.9 * self.trial_s

    def line(self) -> str:
        """'compute: trials ran 5.2 min in all; 2 nodes provisioned in 3 s, ran 301 s, 0 restarts, ~$1.20'."""
        head = f"compute: trials ran {self.trial_s / 60:.1f} min in all"
        if self.overlapped:
            head += f", {self.span_s / 60:.1f} min from the first start to the last end (they overlapped)"
        if not self.nodes:
            return head
        n = len(self.nodes)
        line = (
            f"{head}; {n} node{'s' * (n != 1)} provisioned in {self.provision_s:.0f} s, ran {self.run_s:.0f} s, "
            f"{self.restarts} restart{'s' * (self.restarts != 1)}, {self.cost_text()}"
        )
        if self.not_torn_down:
            line += f"; NOT torn down: {', '.join(self.not_torn_down)} (tear it down by hand)"
        return line

    def metrics(self) -> dict[str, float]:
        """The sweep parent run's `compute/*` metrics (a pipeline run's are its node's: infra/compute.py Usage)."""
        out = {"compute/trial_s": self.trial_s, "compute/nodes": float(len(self.nodes))}
        if self.nodes:
            out.update({"compute/provision_s": self.provision_s, "compute/run_s": self.run_s})
            out["compute/restarts"] = float(self.restarts)
        if self.cost_usd is not None:
            out["compute/cost_usd"] = self.cost_usd
        return out


def compute_total(study: optuna.Study, trials: list) -> ComputeTotal:
    """The worker nodes kept on the study and the trials' own nodes, with the trials' wall time."""
    nodes = [json.loads(v) for k, v in sorted(study.user_attrs.items()) if k.startswith(NODE_ATTR)]
    for t in trials:
        if isinstance(t.user_attrs.get(COMPUTE_ATTR), dict):
            nodes.append({"name": f"trial {t.number}", **t.user_attrs[COMPUTE_ATTR]})
    ended = [t for t in trials if t.datetime_complete and t.datetime_start]
    span = (max(t.datetime_complete for t in ended) - min(t.datetime_start for t in ended)) if ended else None
    return ComputeTotal.of(
        nodes,
        sum((t.datetime_complete - t.datetime_start).total_seconds() for t in ended),
        span.total_seconds() if span else 0.0,
    )


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
    mlflow_url: str = ""  # the sweep's experiment in the MLflow UI, opened on its training runs
    compare_url: str = ""  # MLflow's Compare page of every trial run
    baseline: dict | None = None  # {source, metrics}: what the trials are read against (sweeps/baseline.py)
    closest: dict | None = None  # no trial beat the baseline beyond noise: the best-scoring COMPLETE trial
    planned_steps: int = 0  # trial-steps had every trial run to its end
    steps_saved: int = 0  # planned_steps - trial_steps: what pruning saved
    min_importance_trials: int = MIN_IMPORTANCE_TRIALS
    timed_out: bool = False  # the --timeout budget ended the sweep
    compute: ComputeTotal = field(default_factory=ComputeTotal)  # trial wall time; provisioned nodes summed
    confirmation: dict | None = None  # sweeps/confirmation.py Confirmation: the verdict, made after the search
    confirmation_note: str | None = None  # why the stored confirmation is not the verdict (unfinished, out of date)
    cost: dict = field(default_factory=dict)  # what the answer cost (`cost_of`)

    def confirmed(self) -> Confirmation | None:
        return Confirmation.from_json(json.dumps(self.confirmation)) if self.confirmation else None

    def confirmation_lines(self) -> list[str]:
        """The verdict in full (sweeps/confirmation.py `verdict_lines`), or nothing when there was no confirmation."""
        c = self.confirmed()
        return verdict_lines(c) if c else []

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

    @property
    def objective_key(self) -> str:
        return self.objective_keys[0]

    def baseline_score(self) -> float | None:
        """The base model's score on the prompts the trials' scores and gains are on (the selection part of a split
        held-out set): the one a trial's gain is its score minus."""
        b = self.baseline or {}
        if b.get("selection"):
            return b["selection"][0]
        return b.get("metrics", {}).get(self.objective_key)

    def baseline_line(self) -> str | None:
        b = self.baseline
        if not b:
            return None
        score, se = b["metrics"].get(self.objective_key), b["metrics"].get(f"{self.objective_key}_stderr")
        if score is None:
            return None
        ci = f" ± {Z95 * se:.2g}" if se is not None else ""
        line = f"baseline: {self.objective_key} {score:.3g}{ci} for {b['source']}"
        part = b.get("selection")
        if part and part[1] < b.get("n_prompts", part[1]):  # the trials were scored on a part of the held-out set
            line += (
                f" on all {b['n_prompts']} held-out prompts; {part[0]:.3g} on the {part[1]} selection prompts the "
                "trials' gains are paired with"
            )
        return line

    def split_line(self) -> str:
        """How the held-out prompts were dealt into selection and confirmation (sweeps/split.py), in words."""
        from .split import Split

        split = (self.confirmation or {}).get("split")
        return Split(**split).describe() if split else ""

    def verdict_line(self) -> str | None:
        """'best: trial 7, eval/accuracy 0.61 vs 0.29 for the base model (+0.32 ± 0.06)', or why there is none; after
        a confirmation its claim and the score it rests on ('trial 7 beats the base model on all 3 seeds; best on
        confirmation: ...')."""
        if lines := self.confirmation_lines():
            claim = next(line for line in lines if " beat" in line and line.startswith(("trial ", "no trial")))
            return f"{claim}; {lines[0]}"
        if self.best and self.best.get("gain") is not None and self.confirmation_note:  # a ranking, not a claim
            return (
                f"not confirmed; best on the selection prompts: trial {self.best['number']}, "
                f"{describe_gain(self.best, self.objective_key)}"
            )
        if self.best and self.best.get("gain") is not None:
            return f"best: trial {self.best['number']}, {describe_gain(self.best, self.objective_key)}"
        if self.best:
            return f"best: trial {self.best['number']} {format_values(self.best['values'])}"
        if self.closest:
            return (
                f"no trial beat the base model beyond noise; closest: trial {self.closest['number']}, "
                f"{describe_gain(self.closest, self.objective_key)}"
            )
        return None

    def cost_line(self) -> str:
        """'cost: 96 trial-steps run (+16 for seeds), 32 saved by pruning; 1.2M tokens generated, 3.4M trained; wall
        12 min (baseline 0.4, trials 9.8, confirmation 1.8); 15 trials/hour'."""
        c = self.cost
        if not c:
            return ""
        seeds = f" (+{c['seed_steps']} for the seed runs)" if c.get("seed_steps") else ""
        out = f"cost: {c['trial_steps']} trial-steps run{seeds}, {c['steps_saved']} saved by pruning"
        if c.get("tokens_generated") or c.get("tokens_trained"):
            out += (
                f"; {_tokens(c.get('tokens_generated'))} tokens generated, {_tokens(c.get('tokens_trained'))} trained"
            )
        parts = [f"{k} {c[k + '_s'] / 60:.1f}" for k in ("baseline", "trials", "confirmation") if c.get(k + "_s")]
        out += f"; wall {c['wall_s'] / 60:.1f} min ({', '.join(parts)})" if parts else ""
        if c.get("trials_per_hour"):
            out += f"; {c['trials_per_hour']:.1f} trials/hour"
        if c.get("node_hours"):
            out += f"; {c['node_hours']:.2f} node-hours, {self.compute.cost_text()}"
        return out

    def cost_metrics(self) -> dict[str, float]:
        """The parent run's `cost/*` metrics."""
        return {f"cost/{k}": float(v) for k, v in self.cost.items() if isinstance(v, (int, float)) and v is not None}

    def compute_line(self) -> str:
        """The compute line, or "" when the cost line's 'trials' minutes already say it (no nodes, one trial at a
        time)."""
        c = self.compute
        return c.line() if c.nodes or c.overlapped or not self.cost else ""

    def pruning_line(self) -> str:
        pct = f" ({self.steps_saved / self.planned_steps:.0%})" if self.planned_steps else ""
        return (
            f"pruning: {_count(self.pruned_by_health_gate, 'trial')} collapsed and "
            f"{'was' if self.pruned_by_health_gate == 1 else 'were'} pruned, {self.pruned_by_pruner} stopped "
            f"by the pruner; saved {self.steps_saved} of {self.planned_steps} trial-steps{pct} against running "
            "every trial to its end"
        )

    def lines(self) -> list[str]:
        states = ", ".join(f"{n} {k.lower()}" for k, n in sorted(self.states.items())) or "no trials"
        ended = " (ended by its --timeout)" if self.timed_out else ""
        out = [f"sweep {self.study}: {states}; {self.trial_steps} trial-steps{ended}"]
        if line := self.baseline_line():
            out.append(line)
        if self.confirmation_note:
            out.append(f"no confirmed verdict: {self.confirmation_note}")
        if confirmed := self.confirmation_lines():
            out += confirmed
        elif line := self.verdict_line():
            out.append(line)
        if self.best:  # after the verdict's footnote (a confirmation's last line): named, not '  with ...'
            b = self.best
            settings = format_values(b["params"])
            out.append(f"trial {b['number']}'s settings: {settings} (MLflow run {b['mlflow_run_id']})")
        for row in self.pareto:
            out.append(
                f"Pareto: trial {row['number']} {format_values(row['values'])} with {format_values(row['params'])}"
            )
        if not self.n_complete:
            out.append("no trial completed: every trial was pruned or failed — read the prune reasons in the summary")
        out.append(self.pruning_line())
        if line := self.compute_line():
            out.append(line)
        if line := self.cost_line():
            out.append(line)
        out += [f"summary:     {self.html}", f"dashboard:   {self.dashboard}"]
        out += [f"mlflow:      {self.mlflow_url}"] if self.mlflow_url else []
        out += [f"compare:     {self.compare_url}"] if self.compare_url else []
        return out


def _tokens(n: float | None) -> str:
    if not n:
        return "0"
    return f"{n / 1e6:.2f}M" if n >= 1e6 else (f"{n / 1e3:.1f}k" if n >= 1e3 else f"{n:.0f}")


def cost_of(study, trials: list, summary: SweepSummary, confirmed: Confirmation | None) -> dict:
    """What the answer cost: trial-steps run and saved by pruning, tokens generated and trained (trials and seed
    runs), wall time by phase, trials/hour, node-hours when nodes were provisioned."""
    baseline = load_baseline(study)
    tokens = {k: sum(float(t.user_attrs.get(k) or 0) for t in trials) for k in ("tokens_generated", "tokens_trained")}
    seeds = confirmed.seed_tokens if confirmed else {}
    span = summary.compute.span_s
    done = sum(summary.states.get(k, 0) for k in ("COMPLETE", "PRUNED"))
    out = {
        "trial_steps": summary.trial_steps,
        "steps_saved": summary.steps_saved,
        "seed_steps": confirmed.seed_steps if confirmed else 0,
        "tokens_generated": tokens["tokens_generated"] + float(seeds.get("tokens_generated", 0)),
        "tokens_trained": tokens["tokens_trained"] + float(seeds.get("tokens_trained", 0)),
        "baseline_s": baseline.seconds if baseline else 0.0,
        "trials_s": span,
        "confirmation_s": confirmed.seconds if confirmed else 0.0,
        "trials_per_hour": done / (span / 3600) if span > 0 else 0.0,
    }
    out["wall_s"] = out["baseline_s"] + out["trials_s"] + out["confirmation_s"]
    if summary.compute.nodes:
        out["node_hours"] = summary.compute.run_s / 3600
    return out


def describe_gain(row: dict, key: str) -> str:
    """'eval/reward 0.71 vs 0.61 for the base model (+0.10 ± 0.05)' from a trial row with a gain."""
    return (
        f"{key} {row['score']:.3g} vs {row['score'] - row['gain']:.3g} for the base model "
        f"({row['gain']:+.2g} ± {Z95 * row['gain_stderr']:.2g})"
    )


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
        "score": t.user_attrs.get("score"),
        "gain": t.user_attrs.get("gain"),
        "gain_stderr": t.user_attrs.get("gain_stderr"),
        "beats_baseline": t.user_attrs.get("beats_baseline"),
        "planned_steps": t.user_attrs.get("planned_steps"),
        "seconds": (t.datetime_complete - t.datetime_start).total_seconds()
        if t.datetime_complete and t.datetime_start
        else None,
    }


def _baseline_row(study: optuna.Study, baseline, key: str) -> dict:
    """The baseline as the summary shows it: its scores on every held-out prompt and, as (score, prompts), on the
    prompts the trials were scored on."""
    from .baseline import PER_PROMPT

    n = len(baseline.per_prompt.get(PER_PROMPT.get(key, ""), []))
    return {
        "source": baseline.source,
        "metrics": baseline.metrics,
        "n_prompts": n,
        "selection": selection_baseline(study, baseline, key),
    }


def summarize(study: optuna.Study, sweep: SweepSpec) -> SweepSummary:
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    by_state: dict[str, int] = {}
    for t in trials:
        by_state[t.state.name] = by_state.get(t.state.name, 0) + 1
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    spent = sum(int(t.user_attrs.get("last_step") or 0) for t in trials)
    planned = sum(int(t.user_attrs.get("planned_steps") or t.user_attrs.get("last_step") or 0) for t in done)
    ran = sum(int(t.user_attrs.get("last_step") or 0) for t in done)
    baseline = load_baseline(study)
    out = SweepSummary(
        study=study.study_name,
        objectives=[o.model_dump() for o in sweep.objectives],
        objective_keys=[o.key for o in sweep.objectives],
        states=by_state,
        trial_steps=spent,
        pruned_by_health_gate=sum(1 for t in trials if t.user_attrs.get("pruned_by") == "health_gate"),
        pruned_by_pruner=sum(1 for t in trials if t.user_attrs.get("pruned_by") == "pruner"),
        trials=[trial_row(t, sweep) for t in trials],
        importances=importances(study, sweep),
        baseline=_baseline_row(study, baseline, sweep.objectives[0].key) if baseline else None,
        planned_steps=planned,
        steps_saved=planned - ran,
        compute=compute_total(study, trials),
    )
    confirmed = load_confirmation(study)
    out.cost = cost_of(study, trials, out, confirmed)
    if confirmed is not None and (why := confirmed.stale_reason(study)):  # no verdict: the trials' ranking alone
        out.confirmation_note, confirmed = why, None
    if confirmed is not None:  # the verdict was made after the search: its claim is the best, else its winner closest
        out.confirmation = json.loads(confirmed.to_json())
        rows = {t.number: t for t in trials}
        if confirmed.claimed is not None:
            out.best = trial_row(rows[confirmed.claimed], sweep)
        else:
            out.closest = trial_row(rows[confirmed.winner], sweep)
    elif len(sweep.objectives) == 1:
        if complete and "gain" in study.best_trial.user_attrs:  # relative: only a trial beyond noise is "best"
            sign = 1 if sweep.objectives[0].direction == "maximize" else -1
            winners = [t for t in complete if t.user_attrs.get("beats_baseline")]
            if winners:
                out.best = trial_row(max(winners, key=lambda t: sign * t.value), sweep)
            else:
                out.closest = trial_row(study.best_trial, sweep)
        elif complete:
            out.best = trial_row(study.best_trial, sweep)
    else:
        out.pareto = [trial_row(t, sweep) for t in study.best_trials] if complete else []
    return out


def importances(study: optuna.Study, sweep: SweepSpec) -> dict:
    """{objective key: {param: importance}}, or {'skipped': reason}."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) < MIN_IMPORTANCE_TRIALS:
        return {
            "skipped": f"{len(complete)} completed trial{'s' * (len(complete) != 1)}; importances are computed from "
            f"{MIN_IMPORTANCE_TRIALS} on (fewer points apportion noise)",
            "n_complete": len(complete),
        }
    out: dict = {"n_complete": len(complete)}
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
    trials = [t for t in study.get_trials(deepcopy=False) if t.state != TrialState.RUNNING]
    key = sweep.objectives[0].key
    rows = [_plot_row(t, sweep) for t in trials if t.state.name != "FAIL"]
    scored = [r for r in rows if r["score"] is not None]
    n_complete = sum(1 for r in rows if r["kind"] == "COMPLETE")
    base = _plot_baseline(study, key)
    jobs = {
        "optimization_history": lambda: _history(scored, key, base, sweep.objectives[0].direction),
        "parallel_coordinate": lambda: _parallel(scored, sweep, key, base),
        "slice": lambda: _slice(scored, sweep, key, base),
        "intermediate_values": lambda: _intermediate(trials, sweep, study, base),
    }
    if len(sweep.objectives) == 2:
        jobs["pareto_front"] = lambda: _figure_of(
            vis.plot_pareto_front(study, target_names=[o.key for o in sweep.objectives])
        )
    paths, skipped = [], {}
    reported = sum(1 for t in trials if len(t.intermediate_values) >= 2)
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
                fig = make()
                path = out_dir / f"{plot}.png"
                fig.savefig(path, dpi=90, bbox_inches="tight")
            plt.close(fig)
            paths.append(path)
        except Exception as e:
            skipped[plot] = f"{type(e).__name__}: {str(e)[:200]}"
            plt.close("all")
    return paths, skipped


def _plot_baseline(study: optuna.Study, key: str) -> tuple[float, float] | None:
    """(the base model's score on the prompts the trials were scored on, 0): the line a trial's own paired interval
    (its error bar) is read against — a bar wholly above it is the ✓ of the tables, computed as the verdict is. No
    band: the base model's own interval is not what a trial must clear."""
    baseline = load_baseline(study)
    if baseline is None:
        return None
    if (part := selection_baseline(study, baseline, key)) is not None:
        return part[0], 0.0
    return (baseline.score(key), 0.0) if baseline.score(key) is not None else None


def selection_baseline(study: optuna.Study, baseline, key: str) -> tuple[float, int] | None:
    """(the base model's mean score, the prompts) on the prompts the trials were scored on — the selection part of
    a split held-out set, else all of it —, the score each trial's gain is paired with; None without per-prompt
    scores of `key`."""
    from .baseline import PER_PROMPT
    from .split import load_split

    per = baseline.per_prompt.get(PER_PROMPT.get(key, ""), [])
    split = load_split(study) if per else None
    part = split.selection(per) if split is not None else per
    return (sum(part) / len(part), len(part)) if part else None


def _kind(t: optuna.trial.FrozenTrial) -> str:
    """COMPLETE, collapsed (pruned by the health gate), pruned (by the pruner), FAIL."""
    if t.state == TrialState.PRUNED:
        return "collapsed" if t.user_attrs.get("pruned_by") == "health_gate" else "pruned"
    return t.state.name


def _plot_row(t: optuna.trial.FrozenTrial, sweep: SweepSpec) -> dict:
    """A trial as the plots read it: its kind, params, and score (its final held-out eval, pruned trials too)."""
    score = t.user_attrs.get("score")
    if score is None and t.values is not None:
        score = t.values[0]
    if score is None:
        score = t.user_attrs.get(f"objective/{sweep.objectives[0].key}")
    ci = Z95 * t.user_attrs["gain_stderr"] if t.user_attrs.get("gain_stderr") is not None else None
    return {"number": t.number, "kind": _kind(t), "params": t.params, "score": score, "ci95": ci}


LABELS = {"COMPLETE": "complete", "collapsed": "collapsed (health gate)", "pruned": "pruned (pruner)"}


def _baseline_band(ax, base, horizontal: bool = True, bars: bool = True) -> None:
    if base is None:
        return
    value, half = base
    if horizontal:
        ax.axhline(value, color="#1f2328", linestyle="--", linewidth=1.2, label=f"base model {value:.3g}")
        if half:
            ax.axhspan(value - half, value + half, color="#1f2328", alpha=0.08, label="base model ± 95 %")
        if bars:
            ax.plot([], [], " ", label="bars: each trial's paired 95 % interval")


def _scatter_by_kind(ax, rows: list[dict], x_of) -> None:
    """Each trial's final score, coloured by how it ended, with its paired 95 % interval as an error bar."""
    for kind, colour in COLOURS.items():
        pts = [(x_of(r), r["score"], r.get("ci95")) for r in rows if r["kind"] == kind]
        if pts:
            marker = "x" if kind != "COMPLETE" else "o"
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], c=colour, marker=marker, s=36, label=LABELS[kind])
            bars = [p for p in pts if p[2] is not None]
            if bars:
                ax.errorbar(
                    [p[0] for p in bars], [p[1] for p in bars], yerr=[p[2] for p in bars], fmt="none",
                    ecolor=colour, alpha=0.45, elinewidth=1, capsize=2,
                )  # fmt: skip


def _legend_kinds(rows_or_kinds) -> list:
    """Legend handles for the kinds of trial that happened (no 'collapsed' when nothing collapsed)."""
    kinds = {r["kind"] if isinstance(r, dict) else r for r in rows_or_kinds}
    return [plt.Line2D([], [], color=c, label=LABELS[k]) for k, c in COLOURS.items() if k != "FAIL" and k in kinds]


def _history(rows: list[dict], key: str, base, direction: str = "maximize") -> plt.Figure:
    fig, ax = plt.subplots(figsize=(7, 4))
    _scatter_by_kind(ax, rows, lambda r: r["number"])
    complete = sorted((r["number"], r["score"]) for r in rows if r["kind"] == "COMPLETE")
    if complete:
        better = max if direction == "maximize" else min
        best, xs, ys = complete[0][1], [], []
        for n, v in complete:
            best = better(best, v)
            xs.append(n)
            ys.append(best)
        ax.step(xs, ys, where="post", color=COLOURS["COMPLETE"], alpha=0.5, label="best so far")
    _baseline_band(ax, base)
    ax.set_xlabel("trial")
    ax.set_ylabel(f"{key} (final held-out eval)")
    ax.set_title("Score per trial, against the base model")
    ax.legend(fontsize=7, loc="best")
    ax.xaxis.get_major_locator().set_params(integer=True)
    return fig


def _axis_transform(spec, values: list):
    """(value -> position in [0, 1], tick positions, tick labels) of one parameter: log for log-scaled ones,
    evenly spaced choices for a categorical one."""
    if spec.type == "categorical":
        choices = list(spec.choices)
        n = max(1, len(choices) - 1)
        return (lambda v: choices.index(v) / n if v in choices else 0.5), [i / n for i in range(len(choices))], choices
    lo, hi = float(spec.low), float(spec.high)
    if spec.log:
        f = lambda v: (math.log(v) - math.log(lo)) / ((math.log(hi) - math.log(lo)) or 1)  # noqa: E731
    else:
        f = lambda v: (v - lo) / ((hi - lo) or 1)  # noqa: E731
    ticks = [lo, hi]
    if spec.log:
        ticks = [lo, math.sqrt(lo * hi), hi]
    return f, [f(t) for t in ticks], [format_value(t) for t in ticks]


def _parallel(rows: list[dict], sweep: SweepSpec, key: str, base) -> plt.Figure:
    names = list(sweep.space)
    scores = [r["score"] for r in rows] + ([base[0] - base[1], base[0] + base[1]] if base else [])
    lo, hi = min(scores), max(scores)
    span = (hi - lo) or 1.0
    axes = [_axis_transform(sweep.space[n], [r["params"].get(n) for r in rows]) for n in names]
    fig, ax = plt.subplots(figsize=(max(7.0, 2.0 * (len(names) + 1)), 4.5))
    x = list(range(len(names) + 1))
    for kind in ("COMPLETE", "pruned", "collapsed"):  # collapsed drawn last: on top
        for r in rows:
            if r["kind"] != kind:
                continue
            ys = [f(r["params"][n]) if n in r["params"] else math.nan for n, (f, _, _) in zip(names, axes)]
            ys.append((r["score"] - lo) / span)
            ax.plot(x, ys, color=COLOURS[kind], alpha=0.85, linewidth=1.6 if kind != "COMPLETE" else 1.2)
    for i, (_, ticks, labels) in enumerate(axes):
        ax.axvline(i, color="#8c959f", linewidth=0.8)
        for t, label in zip(ticks, labels):
            ax.annotate(format_value(label), (i, t), xytext=(4, 0), textcoords="offset points", fontsize=7, va="center")
    ax.axvline(len(names), color="#8c959f", linewidth=0.8)
    for v in (lo, hi):
        ax.annotate(f"{v:.3g}", (len(names), (v - lo) / span), xytext=(4, 0), textcoords="offset points", fontsize=7)
    if base is not None:
        y = (base[0] - lo) / span
        ax.plot([len(names) - 0.15, len(names) + 0.15], [y, y], color="#1f2328", linestyle="--", linewidth=2)
        ax.annotate(f"base model {base[0]:.3g}", (len(names), y), xytext=(6, 6), textcoords="offset points", fontsize=7)
    scale = {n: " (log)" if sweep.space[n].log else "" for n in names}
    ax.set_xticks(x, [f"{n}{scale[n]}" for n in names] + [key], fontsize=8)
    ax.set_yticks([])
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlim(-0.2, len(names) + 0.6)
    for spine in ("left", "right", "top"):
        ax.spines[spine].set_visible(False)
    ax.legend(handles=_legend_kinds(rows), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3,
              frameon=False)  # fmt: skip
    ax.set_title("Parallel coordinates: every trial, collapsed and pruned ones included")
    return fig


def _slice(rows: list[dict], sweep: SweepSpec, key: str, base) -> plt.Figure:
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullFormatter

    names = list(sweep.space)
    fig, axs = plt.subplots(1, len(names), figsize=(3.2 * len(names) + 1.0, 3.8), sharey=True, squeeze=False)
    for ax, name in zip(axs[0], names):
        spec = sweep.space[name]
        with_p = [r for r in rows if name in r["params"]]
        if spec.type == "categorical":
            choices = [str(c) for c in spec.choices]
            _scatter_by_kind(ax, with_p, lambda r, c=spec.choices, n=name: _choice_index(c, r["params"][n]))
            ax.set_xticks(range(len(choices)), choices)
            ax.set_xlim(-0.5, len(choices) - 0.5)  # every choice on the axis, those no trial sampled too
        else:
            _scatter_by_kind(ax, with_p, lambda r, n=name: r["params"][n])
            if spec.log:  # labelled ticks at the range's ends and its geometric middle (a decade may not fit in)
                lo, hi = float(spec.low), float(spec.high)
                ticks = [lo, math.sqrt(lo * hi), hi]
                ax.set_xscale("log")
                pad = (hi / lo) ** 0.05  # the whole range shown, so its labelled ends are on the axis, not off it
                ax.set_xlim(lo / pad, hi * pad)
                ax.xaxis.set_major_locator(FixedLocator(ticks))
                ax.xaxis.set_major_formatter(FixedFormatter([format_value(t) for t in ticks]))
                ax.xaxis.set_minor_formatter(NullFormatter())
        _baseline_band(ax, base)
        ax.set_xlabel(name + (" (log)" if spec.log else ""), fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    axs[0][0].set_ylabel(key)
    axs[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(f"{key} against each parameter (the base model dashed)", fontsize=10)
    fig.tight_layout()
    return fig


def _intermediate(trials, sweep: SweepSpec, study, base) -> plt.Figure:
    from .pruning import report_metric
    from .space import trial_spec

    metric = report_metric(sweep, trial_spec(sweep, {}))  # eval/* when the trials evaluate every eval.every steps
    fig, ax = plt.subplots(figsize=(7, 4))
    for t in trials:
        if not t.intermediate_values:
            continue
        steps = sorted(t.intermediate_values)
        kind = _kind(t)
        ax.plot(
            steps,
            [t.intermediate_values[s] for s in steps],
            color=COLOURS.get(kind, "#6e7781"),
            marker=".",
            alpha=0.8,
            linewidth=1,
        )
    if base is not None and metric == sweep.objectives[0].key:
        _baseline_band(ax, base, bars=False)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"{metric} (reported to the pruner)")
    ax.set_title("What each trial reported, by how it ended")
    ax.legend(handles=_legend_kinds([_kind(t) for t in trials if t.intermediate_values]), fontsize=7, loc="best")
    return fig


def _figure_of(ax):
    if isinstance(ax, np.ndarray):
        ax = ax.flat[0]
    return ax.get_figure() if hasattr(ax, "get_figure") else ax.figure


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def format_value(v) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.3g}" if v == 0 or abs(v) >= 1e-2 else f"{v:.2e}"  # 5.25e-04, not 0.0005253
    return str(v)


def format_values(values: dict | None) -> str:
    """'grpo.beta=0.0123, lora.r=8': a trial's params or values as a person reads them (no dict repr)."""
    return ", ".join(f"{k}={format_value(v)}" for k, v in (values or {}).items())


def _choice_index(choices: list, value) -> int:
    """Where a trial's categorical value sits on the axis: its choice (by value, or as written), else past the end (a
    value the study's older definition allowed)."""
    return next((i for i, c in enumerate(choices) if c == value or str(c) == str(value)), len(choices))
