"""Seed runs trained together: with `concurrent_trials` above 1 the confirmation's seed runs (flows/confirm.py) train
as LoRA adapters over one base model, their rollouts sampled in one engine call (tasks/train.py ConcurrentTraining),
as the sweep's concurrent trials do. Each is a pipeline run as a lone one would be — its MLflow run a child of the
study's parent run, opened after its fork, then checkpoint → artifact-probe → eval (flows/pipeline.py `open_run`,
`after_training`) — and is scored on the judging prompts once every seed run has ended (no model loaded for scoring
beside the shared one while it trains)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger

from flows.stages import TrainTaskRun, Watch, finish_training, open_run
from flows.trials.lines import seed_progress
from flows.view import PipelineView, flow_run_link
from sweeps.confirmation import SeedJob, SeedResult
from sweeps.space import largest_lora_rank
from tasks.checkpoint import CheckpointUploader
from tasks.record import RunRecorder
from tasks.results import TrainOutcome
from tasks.spec import ExperimentSpec
from tasks.train import ConcurrentTraining, TrainJob

SEED_TAG = "seed_of_trial"  # a seed run's MLflow tag (ballast.seed_of_trial): the trial it retrains


def seed_run_name(sweep, job: SeedJob) -> str:
    return f"{sweep.study_name}-trial-{job.number}-seed-{job.seed}"


@dataclass
class OpenSeed:
    job: SeedJob
    spec: ExperimentSpec
    run: RunRecorder
    watch: Watch
    progress: object
    task_run: TrainTaskRun
    started: float = field(default_factory=time.perf_counter)


def retrain_concurrently(judge, jobs: list[SeedJob]) -> list[SeedResult]:
    """Every job trained, `concurrent_trials` at a time in this process; their SeedResults in the jobs' order."""
    training = ConcurrentTraining(judge.sweep.concurrent_trials, max_lora_rank=largest_lora_rank(judge.sweep))
    running: dict[str, OpenSeed] = {}
    ended: dict[int, tuple] = {}  # index of the job -> (PipelineResult or None, seconds, its OpenSeed)

    def train_jobs():
        for i, job in enumerate(jobs):
            s = open_seed(judge, job)
            running[f"seed-{i}"] = s
            yield TrainJob(f"seed-{i}", s.spec, s.run.output_dir, seed_callbacks(s), s.run.source)

    def on_end(job: TrainJob, outcome: TrainOutcome | None, error: BaseException | None) -> None:
        s = running.pop(job.name)
        ended[int(job.name.split("-")[1])] = (end_seed(s, outcome, error), time.perf_counter() - s.started, s)

    try:
        training.run(train_jobs(), on_end)
    except BaseException as e:  # Ctrl-C, SIGTERM: the seed runs still training end with it in Prefect too
        for s in running.values():
            s.task_run.end(None, e)
        raise
    finally:
        training.close()
    out = []
    for i in range(len(jobs)):
        result, seconds, s = ended.get(i, (None, 0.0, None))
        if result is None:
            out.append(SeedResult({}, "failed", s.run.run_id if s else None, seconds=seconds))
        else:
            out.append(judge.seed_result(result, seconds, s.spec))
    return out


def open_seed(judge, job: SeedJob) -> OpenSeed:
    """The seed run's MLflow run, opened as a pipeline run opens one (its fork verified first)."""
    spec = judge.seed_spec(job)
    name = seed_run_name(judge.sweep, job)
    view = PipelineView(spec.optim.steps, terminal=False, log=_Prefixed(_run_logger(), f"{name}: "))
    run = open_run(spec, view, None, judge.recorder.parent_run_id, {**judge.seed_tags(job), **flow_run_link()})
    view.stage_started("train")
    progress = seed_progress(judge.sweep, job.number, job.seed, spec.optim.steps)
    progress.tty = False  # several runs' lines at once: none redrawn over another's
    return OpenSeed(job, spec, run, Watch(run, view), progress, TrainTaskRun(f"trial-{job.number}-seed-{job.seed}"))


def seed_callbacks(s: OpenSeed) -> list:
    uploader = CheckpointUploader(s.run.store, s.run.checkpoint_prefix)
    return [s.run.metrics, s.run.headline, uploader, s.watch.view, s.progress]


def end_seed(s: OpenSeed, outcome: TrainOutcome | None, error: BaseException | None):
    """The seed run's train stage recorded, then checkpoint → artifact-probe → eval: its PipelineResult (None: it
    failed, its MLflow run failed with it). Ctrl-C or SIGTERM stops the confirmation."""
    try:
        return finish_training(s, outcome, error)
    except Exception as e:
        print(f"seed run {s.run.name} failed: {type(e).__name__}: {e}", flush=True)
        try:
            s.run.fail(e)
        except Exception:  # how it failed is what must come through
            pass
        return None


def _run_logger():
    """The flow run's log (the sweep's), or this module's outside a flow."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


class _Prefixed:
    def __init__(self, log, prefix: str):
        self.log, self.prefix = log, prefix

    def info(self, line: str) -> None:
        self.log.info(self.prefix + line)
