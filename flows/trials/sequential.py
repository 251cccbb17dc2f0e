"""Trials one at a time in this process, each the pipeline flow (flows/pipeline.py) as a Prefect subflow with the
trial's pruning callbacks — the runner `ballast sweep` uses unless the sweep asks for trials at once or workers.

Optuna's `study.optimize` drives the loop (sweeps/study.py `optimize`: the study's total counted over every
worker, the time budget, a stop after `max_consecutive_failures`). A trial's values are suggested by `run_trial`,
its pipeline run is a child of the sweep's MLflow parent run, and its verdict (`judge_trial`) is what Optuna is
told. Ctrl-C or SIGTERM stop the running trial at a safe point and the sweep with it: KeyboardInterrupt, which
`optimize` answers by queueing the trial's configuration again (sweeps/runner.py's contract, item 3); when it runs
again, its interrupted attempt's MLflow run is deleted first.
"""

from __future__ import annotations

from flows.pipeline import run_pipeline
from flows.trials.lines import TrialLines, TrialProgress, progress_metric
from infra.compute import Usage
from sweeps.runner import Budget, RunnerReport
from sweeps.study import COMPUTE_ATTR, optimize, retried, run_trial
from tasks.remote import node_spec
from tasks.results import RunInterrupted
from tasks.sweep_record import SweepRecorder


class SequentialRunner:
    """One trial at a time, here; `node` is the placement of a worker on a node the sweep provisioned (its trials
    record to the flow's tracking and store and never provision another)."""

    def __init__(self, label: str = "", node: dict | None = None):
        self.label, self.node = label, node

    def run(self, study, sweep, recorder: SweepRecorder, budget: Budget) -> RunnerReport:
        return optimize(
            study,
            lambda trial: run_trial(trial, sweep, self.pipeline_fn(sweep, recorder)),
            n_trials=budget.trials,
            callbacks=[TrialLines(sweep, recorder, self.label)],
            max_consecutive_failures=sweep.max_consecutive_failures,
            log=lambda m: print(self.label + m, flush=True),
            timeout_s=budget.left_s(),
        )

    def pipeline_fn(self, sweep, recorder: SweepRecorder):
        """run_fn(spec, callbacks, trial): the trial's pipeline flow run, its progress line on the terminal."""
        label, node = self.label, self.node

        def run_fn(spec, callbacks, trial):
            recorder.discard_trial_runs(retried(trial))  # a re-queued configuration: its interrupted attempts' runs
            progress = TrialProgress(trial.number, spec.optim.steps, label, metric=progress_metric(sweep))
            if node:  # the trial trains here, on this node: it never provisions another
                spec = node_spec(spec, node["tracking_uri"], node["store_uri"], node["project_dir"])
            try:
                return run_pipeline(
                    spec.model_dump(mode="json"),
                    callbacks=[callbacks, progress],
                    parent_run_id=recorder.parent_run_id,
                    tags=recorder.trial_tags(trial.number, dict(trial.params)),
                    progress=False,
                    flow_run_name=f"{recorder.study_name}-trial-{trial.number}",
                )
            except RunInterrupted as stop:  # SIGTERM / Ctrl-C stop the sweep, not only this trial
                raise KeyboardInterrupt(str(stop)) from stop
            finally:
                progress.close()
                if spec.infra.compute != "here":  # the trial's train stage had a node of its own: what it used
                    keep_trial_usage(trial, recorder)

        return run_fn


def keep_trial_usage(trial, recorder: SweepRecorder) -> None:
    """The trial's train-stage node usage (record_usage put it on its MLflow run) as the trial's user attr
    `compute`, for the summary to sum; nothing when the run has none."""
    try:
        run = recorder.child_run(trial.number)
        used = Usage.recorded(run.data.tags, run.data.metrics) if run is not None else None
        if used:
            trial.set_user_attr(COMPUTE_ATTR, used)
    except Exception as e:  # bookkeeping never fails a trial
        print(f"trial {trial.number}: its node's usage was not kept on the study: {e}", flush=True)
