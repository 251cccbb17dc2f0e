"""A sweep's MLflow side: one parent run per Optuna study, a child run per trial (the trial's pipeline run, recorded
by tasks/record.py), the trial's verdict on its child run, the baseline and the summary on the parent.

A sweep's trial run is read side by side with its siblings (MLflow's Compare), so it is recorded for that: its
params are the swept parameters alone (`trial_tags` names them, SWEPT_TAG; the whole spec is its `spec.yaml`
artifact), its gain over the baseline is its first metric (GAIN_TAG), and its name says how it ended
(`trial_outcome`).
"""

from __future__ import annotations

import math
from pathlib import Path

from tasks.tracking import GAIN_TAG, SWEPT_TAG, Tracking, user_name


class SweepRecorder:
    """A sweep's MLflow side: one parent run per study (its id kept on the study as PARENT_ATTR), a child run per
    trial (the trial's pipeline run), the trial's verdict on that child run, the summary on the parent."""

    PARENT_ATTR = "ballast.mlflow_parent_run_id"

    def __init__(self, base_spec, study_name: str):
        self.tracking, self.study_name = Tracking(base_spec), study_name
        self.client = self.tracking.client
        self.parent_run_id: str | None = None
        self.objective: str | None = None  # a held-out objective (eval/*): trial runs carry Gain/<it>
        self.log_scaled: list[str] = []  # swept on a log scale: trial runs carry log10/<param> for Compare's axes

    def open_parent(self, study, params: dict[str, str], tags: dict) -> str:
        """The study's parent run: created with the study, found again on resume."""
        run_id = study.user_attrs.get(self.PARENT_ATTR)
        if run_id:
            try:
                self.client.get_run(run_id)
                self.client.update_run(run_id, status="RUNNING")
            except Exception:
                run_id = None  # the study outlived its tracking store: start a new parent run
        if not run_id:
            run_id = self.tracking.create_run(f"sweep {study.study_name}")
            study.set_user_attr(self.PARENT_ATTR, run_id)
            self.tracking.log_params(run_id, params)
        note = (
            f"**Optuna sweep `{study.study_name}`**: each child run is one trial, a pipeline run of the base spec "
            f"with the trial's values; the summary (best trial, importances, plots) lands here when the study has "
            f"its trials.\n\n**Running.**"
        )
        self.tracking.set_tags(
            run_id,
            {
                "kind": "sweep",
                "study": study.study_name,
                "status": "running",
                "mlflow.note.content": note,
                "mlflow.user": user_name(),
                **tags,
            },
        )
        self.parent_run_id = run_id
        return run_id

    def join(self, study) -> str:
        run_id = study.user_attrs.get(self.PARENT_ATTR)
        if not run_id:
            raise ValueError(
                f"study {study.study_name!r} has no MLflow parent run recorded; create the sweep with "
                "`ballast sweep FILE` first"
            )
        self.parent_run_id = run_id
        return run_id

    def interrupted(self) -> None:
        """The sweep process was stopped (Ctrl-C): its parent run says so until a resume."""
        if self.parent_run_id:
            self.tracking.set_tags(self.parent_run_id, {"status": "interrupted"})
            self.client.set_terminated(self.parent_run_id, "KILLED")

    def trial_tags(self, number: int, params: dict) -> dict:
        """Tags a trial's pipeline run carries, so its verdict can find it; `swept` makes the swept fields its only
        params (RunRecorder.start)."""
        return {
            "study": self.study_name,
            "trial_number": number,
            SWEPT_TAG: ",".join(params),
            GAIN_TAG: f"Gain/{self.objective}" if self.objective else None,
        }

    def record_baseline(self, baseline) -> None:
        """The base model's held-out scores (sweeps/baseline.py) on the parent run: metrics `baseline/<metric>`,
        and a tag that reads as a sentence."""
        rid = self.parent_run_id
        for k, v in baseline.metrics.items():
            self.client.log_metric(rid, f"baseline/{k}", float(v))
        shown = ", ".join(
            f"{k} {v:.3g} ± {1.96 * baseline.metrics.get(k + '_stderr', 0.0):.2g}"
            for k, v in baseline.metrics.items()
            if not k.endswith("_stderr") and k != "eval/mean_length"
        )
        self.tracking.set_tags(rid, {"baseline": f"{baseline.source}: {shown}"})

    def child_run(self, number: int):
        runs = self._children(self._trial(number), max_results=5, order_by=["attributes.start_time DESC"])
        return runs[0] if runs else None

    def record_trial(self, study, frozen) -> None:
        """Optuna study callback: the trial's verdict onto its child run."""
        run = self.child_run(frozen.number)
        if run is None:
            return
        rid, attrs = run.info.run_id, frozen.user_attrs
        outcome = trial_outcome(frozen)
        tags = {
            "trial_state": frozen.state.name,
            "outcome": outcome,
            "mlflow.runName": f"trial {frozen.number} · {outcome}",
        }
        for key in ("prune_reason", "pruned_by", "error"):
            if attrs.get(key):
                tags[key] = str(attrs[key])[:4000]
        self.tracking.set_tags(rid, tags)
        for key, value in attrs.items():
            if key.startswith("objective/"):
                self.client.log_metric(rid, key, float(value))
        for name in self.log_scaled:  # MLflow's parallel coordinates have linear axes: a log-scaled one as its log
            if isinstance(frozen.params.get(name), (int, float)) and frozen.params[name] > 0:
                self.client.log_metric(rid, f"log10/{name}", math.log10(frozen.params[name]))
        if attrs.get("gain") is not None:  # capitalised: Compare's plots open on the first metric, sorted
            key, step = attrs.get("gain_metric", "score"), int(attrs.get("last_step") or 0)
            head = "Gain" if frozen.state.name == "COMPLETE" else "Gain at stop"  # final and pruned gains apart
            self.client.log_metric(rid, f"{head}/{key}", float(attrs["gain"]), step=step)
            self.client.log_metric(rid, f"{head}/{key}_ci95", 1.96 * float(attrs["gain_stderr"]), step=step)
        if frozen.state.name == "PRUNED":  # stopped on purpose, not a crash: FINISHED, the outcome says how
            self.client.set_terminated(rid, "FINISHED")

    def record_interrupted(self, study, frozen) -> None:
        """Heartbeat-stale trial (its worker died): mark its child run KILLED."""
        run = self.child_run(frozen.number)
        if run is None:
            return
        self.tracking.set_tags(run.info.run_id, {"trial_state": "INTERRUPTED", "status": "interrupted"})
        if run.info.status == "RUNNING":
            self.client.set_terminated(run.info.run_id, "KILLED")

    def trial_runs(self, number: int) -> list:
        """Every MLflow run trial `number` left under the parent run (one, unless it was interrupted and run again)."""
        return self._children(self._trial(number))

    def compare_url(self) -> str:
        """MLflow's Compare page of every trial run of the study (trial order): one click from the terminal, the page
        and the parent run's note, where the runs table takes six."""
        runs = self._children(
            f"tags.`ballast.study` = '{self.study_name}' and tags.`ballast.trial_number` != ''", max_results=1000
        )
        runs.sort(key=lambda r: int(r.data.tags.get("ballast.trial_number", 0)))
        return self.tracking.compare_url([r.info.run_id for r in runs]) if runs else ""

    def discard_trial_runs(self, numbers) -> None:
        """The MLflow runs of interrupted attempts at a configuration that now runs again (sweeps/study.py
        `requeue`), deleted with their stage runs: the study keeps one run per trial."""
        for number in numbers:
            for run in self.trial_runs(number):
                self.tracking.delete_run_tree(run.info.run_id)

    def discard_seed_runs(self, number: int, seed: int) -> None:
        """The MLflow runs an interrupted confirmation left of trial `number` trained at seed offset `seed`, deleted
        with their stage runs before it trains again (flows/confirm.py)."""
        where = f"tags.`ballast.seed_of_trial` = '{number}' and tags.`ballast.seed_offset` = '{seed}'"
        for run in self._children(where):
            self.tracking.delete_run_tree(run.info.run_id)

    def _children(self, where: str, **kwargs) -> list:
        """The runs under the study's parent run that match `where`, an MLflow filter on their tags."""
        where = f"tags.mlflow.parentRunId = '{self.parent_run_id}' and {where}"
        return self.client.search_runs([self.tracking.experiment_id], filter_string=where, **kwargs)

    def _trial(self, number: int) -> str:
        return f"tags.`ballast.study` = '{self.study_name}' and tags.`ballast.trial_number` = '{number}'"

    def delete(self) -> int:
        """The sweep's parent run and every run under it deleted (`ballast sweep --delete`); how many."""
        return self.tracking.delete_run_tree(self.parent_run_id) if self.parent_run_id else 0

    def record_summary(self, summary, out_dir: Path) -> None:
        """summary.json, summary.html and the plots onto the parent run, the best values as metrics."""
        rid = self.parent_run_id
        self.client.log_artifact(rid, str(out_dir / "summary.json"), "summary")
        self.client.log_artifact(rid, str(out_dir / "summary.html"), "summary")
        for p in summary.plots:
            self.client.log_artifact(rid, str(p), "summary/plots")
        best = summary.best_rows()
        for k, v in ((best[0].get("values") or {}) if best else {}).items():
            self.client.log_metric(rid, f"best/{k}", float(v))
        if summary.best and summary.best.get("gain") is not None:  # its gain where it was selected, not the verdict's
            self.client.log_metric(rid, "best/selection_gain", float(summary.best["gain"]))  # (confirm/gain: judged)
            self.client.log_metric(rid, "best/selection_gain_ci95", 1.96 * float(summary.best["gain_stderr"]))
        self.client.log_metric(rid, "trial_steps_saved", float(summary.steps_saved))
        for key, value in summary.cost_metrics().items():  # what the answer cost
            self.client.log_metric(rid, key, value)
        # a sweep whose trials were all pruned or failed found nothing: FAILED, not FINISHED
        status = ("finished" if summary.n_complete else "no_completed_trial") if summary.done else "incomplete"
        self.tracking.set_tags(
            rid,
            {
                "status": status,
                "trial_steps": summary.trial_steps,
                "best_trial": best[0]["number"] if best else None,
                "verdict": summary.verdict_line(),
                "cost": summary.cost_line() or None,
                "mlflow.note.content": _sweep_note(summary, status),
            },
        )
        self.client.set_terminated(rid, {"finished": "FINISHED", "no_completed_trial": "FAILED"}.get(status, "KILLED"))


def trial_outcome(frozen) -> str:
    """How a trial ended, in a few words (its MLflow run's name and `ballast.outcome`): '+0.10 ± 0.05 over the
    base model', 'pruned: collapsed at step 4', 'pruned at step 8 by the pruner', 'failed: …'."""
    attrs, step = frozen.user_attrs, frozen.user_attrs.get("last_step", "?")
    if frozen.state.name == "PRUNED":
        if attrs.get("pruned_by") == "health_gate":
            return f"pruned: collapsed at step {step}"
        return f"pruned at step {step} by the pruner"
    if frozen.state.name == "FAIL":
        return f"failed: {attrs.get('error') or attrs.get('not_counted') or 'see the run'}"[:200]
    if attrs.get("gain") is not None:
        gain = f"{attrs['gain']:+.2g} ± {1.96 * attrs['gain_stderr']:.2g} over the base model"
        return gain + ("" if attrs.get("beats_baseline") else " (within noise)")
    return frozen.state.name.lower()


def _sweep_note(summary, status: str) -> str:
    """The sweep parent run's MLflow description at the end: how the sweep went, in the summary's own lines."""
    lines = [line for line in summary.lines() if not line.startswith(("summary:", "dashboard:", "mlflow:", "compare:"))]
    compare = [  # Compare draws linear axes: a log-scaled parameter's log10 is a metric to pick instead
        f"[Compare the trials]({summary.compare_url}) — in its parallel coordinates, a log-scaled parameter's "
        "`log10/<name>` metric gives it a log axis.",
        "",
    ]
    return "\n".join(
        [
            f"**Optuna sweep `{summary.study}`**: each child run is one trial (a seed run: `ballast.seed_of_trial`).",
            "",
            "± is the half-width of a 95 % interval (simultaneous over the trials compared where the verdict says so); "
            "`Gain/*` is a completed trial's final gain over the base model, `Gain at stop/*` a pruned one's where it "
            "stopped.",
            "",
            f"**Ended: {status.replace('_', ' ')}.**",
            "",
            *[f"- {line}" for line in lines],
            "",
            *(compare if summary.compare_url else []),
            "Page: artifact `summary/summary.html`.",
        ]
    )
