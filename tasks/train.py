"""Train stage: the embedded GRPO trainer on the spec, starting from the fork source or resuming the run.

The trainer reports through callbacks only (trainer/loop.py): the caller passes the ones that send metrics to
MLflow (tasks/record.py), upload checkpoints as they are saved (tasks/checkpoint.py) and, in a sweep, report to
Optuna (sweeps/pruning.py). On a resume the outcome's history joins the steps already in metrics.jsonl.

`ConcurrentTraining` is the train stage of several sweep trials at once: each a LoRA adapter over one shared base
model (trainer/multi.py), each ending with the TrainOutcome `run_training` would have returned for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from tasks.fork import ForkSource, fork
from tasks.results import TrainOutcome
from tasks.spec import ExperimentSpec, check_trainable_alone
from trainer.distributed import stop_when_others_are_lost
from trainer.loop import Callbacks, GRPOTrainer, RunResult
from trainer.model import ensure_model
from trainer.multi import ConcurrentTrials, TrialJob, TrialOutcome
from trainer.records import read_rows


def run_training(
    spec: ExperimentSpec,
    output_dir: Path,
    callbacks: Sequence[Callbacks],
    fork_source: ForkSource | None = None,
    resume: bool = False,
    progress: bool = True,
) -> TrainOutcome:
    """Train `spec` into `output_dir` (metrics.jsonl, checkpoints/); on `resume`, from its newest checkpoint."""
    source = fork_source or ForkSource()
    trainer = GRPOTrainer(
        spec.trainer_config(),
        output_dir,
        callbacks=list(callbacks),
        init_adapter=source.adapter_dir,
        lineage=_lineage(source),
        progress=progress,
    )
    try:
        if resume:
            trainer.resume()
        earlier = read_rows(Path(output_dir) / "metrics.jsonl") if resume else []
        result = trainer.train(spec.optim.steps)
    finally:
        trainer.close()
    eval_start = result.eval_start or next((m for m in earlier if m["step"] == 0), None)
    history = [m for m in earlier if m["step"] > 0] + result.history
    return TrainOutcome(
        Path(output_dir),
        result.last_step,
        result.stopped,
        result.last_checkpoint,
        history,
        sum(m.get("step_time", 0.0) for m in result.history),
        eval_start,
        result.interrupted,
    )


def _lineage(source: ForkSource) -> dict:
    return (
        {
            "parent_run_id": source.parent_run_id,
            "parent_step": source.parent_step,
            "fork_checkpoint": source.checkpoint_uri,
        }
        if source.checkpoint
        else {}
    )


def fork_alone(spec: ExperimentSpec) -> ForkSource:
    """Where `ballast train` starts: the base model, or `fork.checkpoint` fetched and verified as for a pipeline
    run. `fork.run_id` names a run in the tracking store, which the trainer alone does not open."""
    check_trainable_alone(spec)
    return fork(spec, checkpoint_prefix_of=None)


def train_alone(
    spec: ExperimentSpec, output_dir: Path, resume: bool, progress: bool, source: ForkSource | None = None
) -> tuple[RunResult, Path | None]:
    """`ballast train`: the trainer with no orchestration, from `source` (fork_alone) when given; (result, the
    checkpoint resumed from). As one of several ranks (torchrun's WORLD_SIZE), a collective that fails because
    another rank died ends this one with LOST_EXIT, whenever it comes (a step, or the checkpoint a SIGTERM from
    torchrun's teardown asks for), so the launcher blames the rank that died (tasks/ranks.py), not this one."""
    source = source or ForkSource()
    ranks = int(os.environ.get("WORLD_SIZE", "1")) > 1
    with stop_when_others_are_lost() if ranks else nullcontext():
        trainer = GRPOTrainer(
            spec.trainer_config(),
            output_dir,
            init_adapter=source.adapter_dir,
            lineage=_lineage(source),
            progress=progress,
        )
        try:
            resumed_from = trainer.resume() if resume else None
            return trainer.train(spec.optim.steps), resumed_from
        finally:
            trainer.close()


def ensure_base_model(spec: ExperimentSpec) -> str:
    """The spec's base model, built or converted on first use when its model section says how."""
    return ensure_model(spec.model)


# ------------------------------------------------------------------------------------------ several trials at once


@dataclass
class TrainJob:
    """One trial's train stage: what `run_training` takes (never a resume: a concurrent trial starts fresh)."""

    name: str  # unique among the jobs: the outcome is handed back with its job
    spec: ExperimentSpec
    output_dir: Path
    callbacks: Sequence[Callbacks] = ()
    fork_source: ForkSource | None = None


class ConcurrentTraining:
    """`run_training` for up to `slots` trials at once over one base model, loaded on the first job and kept across
    `run` calls. A job is pulled from the iterable when a slot is free; `on_end(job, outcome, error)` is called as
    each trial ends — its adapter still active — with the TrainOutcome `run_training` would have returned (None
    when the trial failed before its first step) and the error that ended a failed one (the others go on)."""

    def __init__(self, slots: int, max_lora_rank: int | None = None):
        self.runner = ConcurrentTrials(slots, max_lora_rank)

    def close(self) -> None:
        """Stop the vLLM server the trials shared, if they started one (rollout.engine: vllm)."""
        self.runner.close()

    def run(
        self,
        jobs: Iterable[TrainJob],
        on_end: Callable[[TrainJob, TrainOutcome | None, BaseException | None], None],
    ) -> None:
        started: dict[str, TrainJob] = {}

        def trials() -> Iterator[TrialJob]:
            for job in jobs:
                started[job.name] = job
                source = job.fork_source or ForkSource()
                yield TrialJob(
                    job.name,
                    job.spec.trainer_config(),
                    Path(job.output_dir),
                    list(job.callbacks),
                    init_adapter=source.adapter_dir,
                    lineage=_lineage(source),
                )

        def ended(outcome: TrialOutcome, trainer) -> None:
            job, result = started.pop(outcome.job.name), outcome.result
            train = None
            if result is not None and trainer is not None:
                train = TrainOutcome(
                    Path(job.output_dir),
                    result.last_step,
                    result.stopped,
                    result.last_checkpoint,
                    result.history,
                    sum(m.get("step_time", 0.0) for m in result.history),
                    result.eval_start,
                    result.interrupted,
                )
            on_end(job, train, outcome.error)

        self.runner.run(trials(), on_end=ended)
