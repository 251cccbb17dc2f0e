"""What the terminal shows of a sweep's trials, whichever runner runs them: one progress line per trial while it
trains (`TrialProgress`), and after each trial its outcome (`trial_line`) and the sweep's (`sweep_line`), written by
`TrialLines`, the study callback every runner in this process gives its trials (it also puts the trial's verdict on
its MLflow run).
"""

from __future__ import annotations

import sys
import time

from sweeps.report import describe_gain, format_values, trial_row
from sweeps.study import n_done, target
from tasks.sweep_record import SweepRecorder
from tasks.train import Callbacks


class TrialLines:
    """Study callback after each trial: its verdict onto its MLflow run, then its line and the sweep's."""

    def __init__(self, sweep, recorder: SweepRecorder, label: str = ""):
        self.sweep, self.recorder, self.label = sweep, recorder, label
        self.started = time.perf_counter()

    def __call__(self, study, frozen) -> None:
        self.recorder.record_trial(study, frozen)
        print(self.label + trial_line(frozen), flush=True)
        print(self.label + sweep_line(study, self.sweep, time.perf_counter() - self.started), flush=True)


class TrialProgress(Callbacks):
    """One line per trial while it trains: step, reward, the last held-out score, ETA. Rewritten in place on a
    terminal; in a log (Prefect, a pipe) a line every `every` steps and at each eval point."""

    def __init__(self, number: int, steps: int, label: str = "", every: int = 4, metric: str = "eval/reward"):
        self.number, self.steps, self.label, self.every, self.metric = number, steps, label, every, metric
        self.started, self.eval_score = time.perf_counter(), None
        self.tty = sys.stdout.isatty()

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if step == 0:
            return
        evaluated = self.metric in metrics
        if evaluated:
            self.eval_score = metrics[self.metric]
        rate = (time.perf_counter() - self.started) / step
        eta = rate * (self.steps - step)
        parts = [f"{self.label}  trial {self.number}: step {step}/{self.steps}"]
        if "reward" in metrics:
            parts.append(f"reward {metrics['reward']:.3f}")
        if self.eval_score is not None:
            parts.append(f"{self.metric} {self.eval_score:.3f}")
        parts.append(f"ETA {eta:.0f} s")
        line = ", ".join(parts)
        if self.tty:
            _say("\r" + line.ljust(100))
        elif evaluated or step % self.every == 0 or step == self.steps:
            _say(line + "\n")

    def close(self) -> None:
        if self.tty:
            _say("\r" + " " * 100 + "\r")


def _say(text: str) -> None:
    """To the terminal as it is: inside the pipeline flow `print` goes to Prefect's run log (log_prints)."""
    sys.stdout.write(text)
    sys.stdout.flush()


def progress_metric(sweep) -> str:
    """The held-out score a trial's progress line shows: the objective's, when it is one."""
    return sweep.objectives[0].key if sweep.objectives[0].key.startswith("eval/") else "eval/reward"


def seed_progress(sweep, number: int, seed: int, steps: int) -> TrialProgress:
    """The progress line of a trial trained again with another seed: the score the trials' lines show."""
    return TrialProgress(f"{number} (seed +{seed})", steps, metric=progress_metric(sweep))


def sweep_line(study, sweep, elapsed: float) -> str:
    """'sweep: 4 of 10 trials done (1 pruned) in 3.2 min; best so far: trial 2, eval/reward 0.71 vs 0.61 ...'."""
    done = n_done(study)
    pruned = sum(1 for t in study.get_trials(deepcopy=False) if t.state.name == "PRUNED")
    head = f"sweep: {done} of {target(study)} trials done ({pruned} pruned) in {elapsed / 60:.1f} min"
    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if not complete or len(sweep.objectives) > 1:
        return head
    key, sign = sweep.objectives[0].key, 1 if sweep.objectives[0].direction == "maximize" else -1
    top = trial_row(max(complete, key=lambda t: sign * t.value), sweep)
    if top.get("gain") is None:
        return f"{head}; best so far: trial {top['number']} {format_values(top['values'])}"
    if top.get("beats_baseline"):
        return f"{head}; best so far: trial {top['number']}, {describe_gain(top, key)}"
    closest = f"trial {top['number']}, {describe_gain(top, key)}"
    return f"{head}; none beats the base model beyond noise yet (closest: {closest})"


def trial_line(frozen) -> str:
    steps = frozen.user_attrs.get("last_step", "?")
    if frozen.state.name == "COMPLETE":
        what = ", ".join(
            f"{k.removeprefix('objective/')}={v:.4g}"
            for k, v in frozen.user_attrs.items()
            if k.startswith("objective/")
        )
        if frozen.user_attrs.get("gain") is not None:
            a = frozen.user_attrs
            what += f" ({a['gain']:+.2g} ± {1.96 * a['gain_stderr']:.2g} over the base model)"
    elif frozen.state.name == "PRUNED":
        what = frozen.user_attrs.get("prune_reason", "")
    else:
        what = frozen.user_attrs.get("error") or frozen.user_attrs.get("not_counted") or ""
    return f"trial {frozen.number} {frozen.state.name} after {steps} steps: {what}  ({format_values(frozen.params)})"
