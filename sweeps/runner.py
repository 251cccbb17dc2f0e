"""One way to run trials: the interface every trial runner implements — what it is given, what it keeps, what it
returns.

A sweep reads as its sequence (flows/sweep.py): open the study → measure the baseline → `runner.run(study, sweep,
recorder, budget)` → write the summary. How the trials run is the runner's; the flow chooses one
(flows/trials/__init__.py `choose_runner`):

    runner              file                          trials
    SequentialRunner    flows/trials/sequential.py    one at a time in this process, each the pipeline flow
    ConcurrentRunner    flows/trials/concurrent.py    `concurrent_trials` at once in this process: LoRA adapters
                                                      over one base model (trainer/multi.py)
    WorkerRunner        flows/trials/workers.py       K `ballast sweep-worker` processes here, or K worker nodes
                                                      (infra/compute.py); each runs one of the two above
    (a population)      flows/pbt.py                  not a runner yet: `ballast pbt` trains P members once, the
                                                      worst replaced by forks of the best (trainer/population.py),
                                                      as its own flow with its own lineage, not an Optuna study

Where it lives, on purpose: this interface is in sweeps/ — it names only the study, the sweep, the recorder and
the budget, so a runner can be read and written against it without the flows — while the implementations live
under flows/trials/, because they run the pipeline's stages (flows/stages.py, its public surface) and Prefect
tasks; sweeps/ never imports flows/.

What a runner is given:

- `study` — the opened Optuna study (sweeps/study.py `open_study` / `join_study`), baseline measured, its sweep
  definition and total stored on it;
- `sweep` — the SweepSpec (space, objectives, sampler, pruner, `concurrent_trials`, heartbeat, ...);
- `recorder` — the sweep's MLflow side (tasks/record.py SweepRecorder): its parent run is open; each trial is a child
  run under it, and `recorder.record_trial` puts a trial's verdict there;
- `budget` — `Budget`: the study's total of COMPLETE + PRUNED trials to reach (every worker's count) and the wall
  clock after which no trial starts (`--timeout`).

What every runner keeps (the contract; sweeps/study.py `optimize` and `AskTell` do most of it for a runner that
asks its trials through them):

1. A trial is an Optuna trial of `study`, asked when the study has room for it (done + running < total) and
   before the deadline, its values suggested define-by-run from `sweep.space` (sweeps/study.py `prepare_trial`).
2. It ends told: COMPLETE with its objective value(s), PRUNED (sweeps/pruning.py `verdict`), or FAIL with an
   `error` user attr — and then `recorder.record_trial(study, frozen)`, so its MLflow run carries the verdict.
3. **An interrupted trial is run again, never replaced.** Ctrl-C, SIGTERM or the death of its worker (SIGKILL, a
   lost node) puts the trial back in the study's queue (WAITING) with its values; the next worker to ask — this
   one resumed, or another — runs that same trial again from step 1, before any new configuration is sampled, and
   its interrupted attempt's MLflow run is deleted first (`recorder.discard_trial_runs`): the finished study holds
   each configuration once, with one MLflow run per trial. After Ctrl-C or SIGTERM the runner raises
   KeyboardInterrupt once its running trials are released.
4. One MLflow child run per trial under `recorder.parent_run_id`, tagged `recorder.trial_tags(...)`.

What it returns: a `RunnerReport` — the trials this runner ran and how each ended, and whether the deadline ended
it. Errors: sweeps/study.py `SweepWorkerError` after `max_consecutive_failures` failed trials in a row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import optuna

    from sweeps.space import SweepSpec
    from tasks.record import SweepRecorder


@dataclass(frozen=True)
class Budget:
    """How far a runner goes: the study's total of COMPLETE + PRUNED trials (all workers together), and the wall-clock
    end (epoch seconds) after which no trial starts — one running then finishes."""

    trials: int
    deadline: float | None = None

    @classmethod
    def of(cls, trials: int, timeout_s: float | None = None) -> Budget:
        return cls(trials, None if timeout_s is None else time.time() + timeout_s)

    def left_s(self) -> float | None:
        """Seconds until the deadline (0 when spent); None without one."""
        return None if self.deadline is None else max(0.0, self.deadline - time.time())

    def spent(self) -> bool:
        return self.deadline is not None and time.time() >= self.deadline


@dataclass
class RunnerReport:
    """What a runner ran: trial numbers in the order they ended, each one's final state, and whether the deadline
    (not the total) ended the run."""

    ran: list[int] = field(default_factory=list)
    states: dict[int, str] = field(default_factory=dict)
    timed_out: bool = False


class TrialRunner(Protocol):
    """Runs a study's trials until the budget is met (see the module's contract)."""

    def run(self, study: optuna.Study, sweep: SweepSpec, recorder: SweepRecorder, budget: Budget) -> RunnerReport:
        """Trials until the study holds `budget.trials` COMPLETE + PRUNED trials or `budget.deadline` passes."""
        ...
