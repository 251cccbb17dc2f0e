"""The sweep's end: its verdict made on prompts no trial decision read, across training seeds (sweeps/confirmation.py
says the rule; this is it run for real).

    search ends ─► top_k trials and the base model scored on the confirmation prompts (each trial's final
                   checkpoint verified and reloaded) ─► winner and runner-up trained confirm.seeds - 1 more times
                   (pipeline runs, child runs of the study's parent run) ─► the verdict on the terminal, the study,
                   the parent run and the summary page

`ensure_split` records the sweep's split of its held-out prompts on the study before the first trial (every trial,
worker and resume reads the same one). `confirm_sweep` runs the confirmation once the search has ended, in one of the
workers that find it ended (sweeps/once.py: the others wait for it or leave it to that one); what it scored is kept
on the study as it comes, so an interrupted confirmation resumes without scoring anything twice.

A seed run is the trial's spec with `optim.seed` and `rollout.seed` moved by the seed's offset (the prompts and their
order stay), trained as a pipeline run without pruning (the health gate still stops a collapse) and scored like the
trials on the judging prompts; with `concurrent_trials` above 1 the seed runs train together as LoRA adapters over
one base model (flows/seeds.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from flows.seeds import SEED_TAG, retrain_concurrently, seed_run_name
from flows.trials.lines import seed_progress
from sweeps.baseline import load_baseline
from sweeps.confirmation import Confirmation, SeedJob, SeedResult, confirm, load_confirmation, verdict_lines
from sweeps.once import run_once
from sweeps.pruning import run_tokens
from sweeps.space import SweepSpec, baseline_spec, sweep_split, trial_spec
from sweeps.split import SPLIT_ATTR, Split, load_split
from sweeps.study import n_done
from tasks.eval import judging_examples, score_on
from tasks.fork import fork
from tasks.spec import ExperimentSpec, validate_spec
from tasks.sweep_record import SweepRecorder
from tasks.tracking import SWEPT_TAG


def ensure_split(study, sweep: SweepSpec) -> Split:
    """The study's split of its held-out prompts (sweeps/split.py), recorded once, before the first trial."""
    split = load_split(study)
    if split is None:
        split = sweep_split(sweep)
        study.set_user_attr(SPLIT_ATTR, split.to_json())
    return split


def confirm_sweep(
    study, sweep: SweepSpec, recorder: SweepRecorder, label: str = "", wait: bool = True
) -> Confirmation | None:
    """The verdict of a finished search, printed, kept on the study (sweeps/confirmation.py) and on the parent run;
    None when the study has nothing to confirm (two objectives, no held-out objective, no completed trial). One
    worker of the study confirms at a time: one that finds another confirming waits for it (wait) or leaves it to
    it, and returns what that one stored."""

    def say(line: str) -> None:
        print(f"{label}{line}", flush=True)

    found: list[Confirmation | None] = []
    beats = {"beat_s": sweep.heartbeat.interval, "stale_s": sweep.heartbeat.grace_period}
    # confirmed already for these trials and these confirm settings (another worker, a re-run): the stored verdict
    version = json.dumps([n_done(study), sweep.confirm.model_dump(mode="json")], sort_keys=True)
    confirmed_here = run_once(
        study,
        "confirmation",
        lambda: found.append(_confirm(study, sweep, recorder, say)),
        wait=wait,
        version=version,
        say=say,
        **beats,
    )
    return found[0] if confirmed_here else load_confirmation(study)


def _confirm(study, sweep: SweepSpec, recorder: SweepRecorder, say) -> Confirmation | None:
    split = ensure_split(study, sweep)
    judge = Judge(study, sweep, recorder, split, say)
    if split.kind == "none":
        say(f"confirmation: {split.describe()}")
    result = confirm(study, sweep, load_baseline(study), split, judge.score, judge.retrain, log=say)
    if result is None:
        return None
    record_confirmation(recorder, result)  # the verdict's lines: the sweep's summary, printed next (once)
    return result


class Judge:
    """What the confirmation cannot read from the study: a checkpoint scored on the judging prompts, a trial's
    settings trained again with another seed."""

    def __init__(self, study, sweep: SweepSpec, recorder: SweepRecorder, split: Split, say):
        self.study, self.sweep, self.recorder, self.split, self.say = study, sweep, recorder, split, say
        self.base = validate_spec(baseline_spec(sweep), "sweep base spec")
        self.cache = Path(self.base.project_dir).resolve() / "cache" / "sweeps" / sweep.study_name

    def score(self, trial) -> dict[str, list[float]]:
        """Per-prompt scores on the judging prompts of the trial's final checkpoint (None: of what the trials start
        from, the base model or the fork source)."""
        if trial is None:
            return self.score_checkpoint(None)
        uri = trial.user_attrs.get("checkpoint_uri")
        if not uri:
            raise RuntimeError(f"trial {trial.number} kept no checkpoint to confirm (user attr checkpoint_uri)")
        return self.score_checkpoint(uri, trial.params)

    def score_checkpoint(self, uri: str | None, params: dict | None = None) -> dict[str, list[float]]:
        spec = self.base
        if uri is not None:
            data = trial_spec(self.sweep, params or {}, base=baseline_spec(self.sweep)).model_dump(mode="json")
            data["fork"] = {"checkpoint": uri}
            spec = validate_spec(data, "confirmation eval")
        source = fork(spec, self.recorder.tracking.checkpoint_prefix)  # fetched and verified
        return score_on(spec, source, judging_examples(spec, self.split), self.cache)

    def retrain(self, jobs: list[SeedJob]) -> list[SeedResult]:
        """Each job's settings trained with other seeds: together as LoRA adapters when concurrent_trials allows,
        else one pipeline run after another. The runs an interrupted confirmation left of the same jobs are deleted
        first, as a re-run trial's are: the study keeps one run per (trial, seed)."""
        for job in jobs:
            self.recorder.discard_seed_runs(job.number, job.seed)
        if self.sweep.concurrent_trials > 1 and len(jobs) > 1:
            return retrain_concurrently(self, jobs)
        return [self.seed_run(job) for job in jobs]

    def seed_spec(self, job: SeedJob) -> ExperimentSpec:
        data = trial_spec(self.sweep, job.params, name=seed_run_name(self.sweep, job)).model_dump(mode="json")
        data["optim"]["seed"] = int(data["optim"].get("seed", 0)) + job.seed
        data["rollout"]["seed"] = int(data["rollout"].get("seed", 0)) + job.seed
        return validate_spec(data, seed_run_name(self.sweep, job))

    def seed_tags(self, job: SeedJob) -> dict:
        return {
            SEED_TAG: job.number,
            "seed_offset": job.seed,
            "sweep": self.sweep.study_name,
            SWEPT_TAG: ",".join(job.params),
        }

    def seed_run(self, job: SeedJob) -> SeedResult:
        from flows.pipeline import run_pipeline

        spec = self.seed_spec(job)
        progress = seed_progress(self.sweep, job.number, job.seed, spec.optim.steps)
        started = time.perf_counter()
        try:
            result = run_pipeline(
                spec.model_dump(mode="json"),
                callbacks=[progress],
                parent_run_id=self.recorder.parent_run_id,
                tags=self.seed_tags(job),
                progress=False,
                flow_run_name=seed_run_name(self.sweep, job),
            )
        finally:
            progress.close()
        return self.seed_result(result, time.perf_counter() - started, spec)

    def seed_result(self, result, seconds: float, spec: ExperimentSpec) -> SeedResult:
        """A seed run's outcome as the confirmation reads it: scored on the judging prompts when it finished."""
        status = result.status if result.status in ("finished", "collapsed") else "failed"
        per_prompt = {}
        if status == "finished" and result.checkpoints:
            per_prompt = self.score_checkpoint(result.checkpoints[max(result.checkpoints)])
        completions = spec.grpo.prompts_per_step * spec.grpo.num_generations
        tokens = run_tokens(result.history, completions)
        return SeedResult(per_prompt, status, result.run_id, int(result.last_step or 0), seconds, tokens)


# ------------------------------------------------------------------------------------------ MLflow


def record_confirmation(recorder: SweepRecorder, c: Confirmation) -> None:
    """The verdict on the study's parent run — metrics `confirm/*` and the lines as tag `confirmation` — and each
    confirmed trial's score on the judging prompts on its own run (`Confirm/<metric>`). The metrics say what the
    verdict's lines say: the winner (best on the judging prompts), its scores and seeds, and `confirm/claimed`, the
    trial that beats the base model (the winner, or the runner-up when the winner did not hold), when one does (NaN,
    and tag `claimed_trial` none, when none does)."""
    rid, win = recorder.parent_run_id, c.candidate(c.winner)
    metrics = {"confirm/baseline": c.baseline, "confirm/prompts": float(c.n_prompts), "confirm/trials": float(c.m)}
    metrics |= {"confirm/winner": float(win.number), "confirm/beats": float(c.beats), "confirm/seconds": c.seconds}
    # NaN without a claim: a metric's latest value is what the run shows, and an earlier confirmation's claim
    # (before --trials was raised) must not stand beside this verdict
    metrics["confirm/claimed"] = float("nan") if c.claimed is None else float(c.claimed)
    metrics |= {f"confirm/{k}": float(win.judged[k]) for k in ("score", "gain", "ci95")}
    metrics["confirm/selection_gain"] = float(win.selection["gain"])
    if (spread := win.spread()) is not None and spread.n > 1:
        metrics |= {"confirm/seed_gain_mean": spread.mean, "confirm/seed_gain_sd": spread.sd, "confirm/seeds": spread.n}
    for key, value in metrics.items():
        if value is not None:
            recorder.client.log_metric(rid, key, float(value))
    tags = {"confirmation": "\n".join(verdict_lines(c))[:5000], "confirmed_on": c.judged_on}
    tags["claimed_trial"] = "none" if c.claimed is None else str(c.claimed)
    recorder.tracking.set_tags(rid, tags)
    for cand in c.candidates:
        if cand.mlflow_run_id and cand.judged:
            recorder.client.log_metric(cand.mlflow_run_id, f"Confirm/{c.metric}", float(cand.judged["score"]))
            recorder.client.log_metric(cand.mlflow_run_id, f"Confirm/gain_{c.metric}", float(cand.judged["gain"]))


def confirmation_json(c: Confirmation | None) -> dict | None:
    return json.loads(c.to_json()) if c is not None else None
