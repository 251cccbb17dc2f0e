"""What one pipeline run came to: `PipelineResult`, built from the stage results by the recorder, returned by
the pipeline flow, read by sweeps (objective values), the CLI and the run report. One definition, so the terminal,
the report page and a sweep all read the same numbers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal, get_args

from tasks.eval import EvalResult
from tasks.probe_report import ProbeReport
from tasks.train import TrainOutcome

FIRST_LAST = 5  # steps averaged for "reward, first 5 → last 5" (halves of shorter runs)
STDERR = "_stderr"  # eval/accuracy_stderr: the standard error of eval/accuracy over the held-out prompts

# How a pipeline run stands: running, then one of the endings (the MLflow tag ballast.status holds it too).
RunStatus = Literal["running", "finished", "collapsed", "pruned", "probe_failed", "failed", "interrupted"]
# Why training stopped before its last step: the health gate ('collapsed: ...', trainer/health.py) or a sweep's
# pruner ('pruned: ...', sweeps/pruning.py).
StopKind = Literal["collapsed", "pruned"]
STOP_KINDS: tuple[str, ...] = get_args(StopKind)


@dataclass(frozen=True)
class StopReason:
    """Why training stopped early: what stopped it (`kind`) and what it said (`message`, without the kind)."""

    kind: StopKind
    message: str

    @classmethod
    def parse(cls, reason: str | StopReason | None) -> StopReason | None:
        """The trainer's stop reason ('collapsed: kl=2 > 1 for 2 steps'), read once at the trainer's edge. A reason
        of no known kind is the health gate's (the trainer stops early for nothing else)."""
        if reason is None or isinstance(reason, StopReason):
            return reason
        kind, sep, message = reason.partition(": ")
        return cls(kind, message) if sep and kind in STOP_KINDS else cls("collapsed", reason)

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass
class PipelineResult:
    run_id: str
    output_dir: str
    status: RunStatus
    spec_name: str = ""
    last_step: int = 0
    stopped: StopReason | None = None  # why training stopped early (the health gate, a sweep's pruner)
    history: list[dict] = field(default_factory=list, repr=False)
    trainer_seconds: float = 0.0
    seconds: float = 0.0
    checkpoints: dict[int, str] = field(default_factory=dict)
    eval_start: dict[str, float] = field(default_factory=dict)  # eval/* before the first step (eval.on_start)
    eval: dict[str, float] = field(default_factory=dict)  # eval/* of the final checkpoint
    eval_per_prompt: dict[str, list[float]] = field(default_factory=dict, repr=False)  # the final eval, per prompt
    probe: dict | None = None  # the probe report's totals (probe_totals)
    reports: dict[str, str] = field(default_factory=dict)  # run report, probe report, ... -> local path
    forked_from: str = "base model"
    error: str | None = None
    run_name: str = ""  # the run's name in MLflow and Prefect
    mlflow_url: str = ""  # the run's page in the MLflow UI

    @classmethod
    def from_stages(
        cls,
        run_id: str,
        output_dir: str,
        spec_name: str,
        outcome: TrainOutcome,
        checkpoints: dict[int, str],
        probe: ProbeReport | None,
        evaluation: EvalResult | None,
        forked_from: str,
        seconds: float,
    ) -> PipelineResult:
        stopped = StopReason.parse(outcome.stopped)
        status: RunStatus = (
            stopped.kind if stopped else ("probe_failed" if probe is not None and not probe.passed else "finished")
        )
        return cls(
            run_id=run_id,
            output_dir=output_dir,
            status=status,
            spec_name=spec_name,
            last_step=outcome.last_step,
            stopped=stopped,
            history=outcome.history,
            trainer_seconds=outcome.trainer_seconds,
            seconds=seconds,
            checkpoints=dict(checkpoints),
            eval_start={k: v for k, v in (outcome.eval_start or {}).items() if k != "step"},
            eval=dict(evaluation.metrics) if evaluation else {},
            eval_per_prompt=dict(evaluation.per_prompt) if evaluation else {},
            probe=probe_totals(probe) if probe else None,
            forked_from=forked_from,
        )

    @property
    def final_checkpoint(self) -> str | None:
        return self.checkpoints[max(self.checkpoints)] if self.checkpoints else None

    @property
    def rewards(self) -> list[float]:
        return [m["reward"] for m in self.history if "reward" in m]

    def reward_first_last(self) -> tuple[int, float, float] | None:
        """(k, mean training reward of the first k steps, of the last k): k is FIRST_LAST, or half of a run shorter
        than twice that, so the two never overlap; None below two steps."""
        r = self.rewards
        if len(r) < 2:
            return None
        k = min(FIRST_LAST, len(r) // 2)
        return k, sum(r[:k]) / k, sum(r[-k:]) / k

    def reward_line(self) -> str | None:
        """'first 5 steps 0.636 → last 5 steps 0.822', 'first step 0.5 → last step 0.7', '0.500 (one step)'."""
        r = self.rewards
        if len(r) == 1:
            return f"{r[0]:.3f} (one step)"
        first_last = self.reward_first_last()
        if first_last is None:
            return None
        k, first, last = first_last
        steps = "step" if k == 1 else f"{k} steps"
        return f"first {steps} {first:.3f} → last {steps} {last:.3f}"

    def to_dict(self, with_history: bool = False) -> dict:
        d = asdict(self)
        if not with_history:
            d.pop("history")
        d["stopped"] = str(self.stopped) if self.stopped else None  # 'collapsed: ...', as the trainer said it
        d["final_checkpoint"] = self.final_checkpoint
        return d

    def held_out(self) -> list[tuple[str, str]]:
        """(metric, 'before → after') per held-out score of the final checkpoint: '0.289 ± 0.079 (95 %)' where the
        eval gives the score's standard error (eval/accuracy_stderr; ± is 1.96 of them, a 95 % interval, as on every
        Ballast surface), 'before training → ' where eval.on_start ran."""
        out = []
        for k, v in self.eval.items():
            if k.endswith(STDERR):
                continue
            before = f"{self.eval_start[k]:.3f} before training → " if k in self.eval_start else ""
            err = self.eval.get(k + STDERR)
            out.append((k, f"{before}{v:.3f}" + (f" ± {1.96 * err:.3f} (95 %)" if err is not None else "")))
        return out

    def lines(self) -> list[str]:
        """The terminal summary: how the run went, before → after, the probe, where things are."""
        out = []
        if self.reward_line():
            out.append(f"reward (training batches): {self.reward_line()}")
        if self.stopped:
            out.append(f"stopped: {self.stopped}")
        for k, scores in self.held_out():
            out.append(f"{k} (held out): {scores}")
        if self.probe:
            p = self.probe
            versus = f" ({p['versus']})" if p.get("versus") else ""
            out.append(
                f"probe: {p['n_malformed']}/{p['n_samples']} malformed{versus}, "
                f"parity {'ok' if p['parity_ok'] else 'FAILED'} → {'passed' if p['passed'] else 'FAILED'}"
            )
        if self.error:
            out.append(f"error: {self.error}")
        return out

    def markdown(self) -> str:
        """How the run ended, as markdown: the MLflow run's description and Prefect's summary artifact."""
        status = self.status.replace("_", " ")
        head = f"**Ended: {status}** — {self.stopped}." if self.stopped else f"**Ended: {status}.**"
        lines = [line for line in self.lines() if not line.startswith("stopped:")]
        return "\n".join(
            [
                head,
                "",
                *[f"- {line}" for line in lines],
                "",
                f"{self.last_step} steps in {self.seconds:.0f} s (trainer {self.trainer_seconds:.0f} s). "
                "Run report: artifact `report.html`.",
            ]
        )


def probe_totals(report: ProbeReport) -> dict:
    return {
        "n_samples": report.n_samples,
        "n_malformed": report.n_malformed,
        "malformed_rate": report.malformed_rate,
        "malformed_ci": report.malformed_ci,
        "parity_ok": report.parity_ok,
        "passed": report.passed,
        "versus": report.versus(),
    }
