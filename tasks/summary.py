"""What one pipeline run came to: `PipelineResult`, built from the stage results by the recorder, returned by
the pipeline flow, read by sweeps (objective values), the CLI and the run report. One definition, so the terminal,
the report page and a sweep all read the same numbers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tasks.eval import EvalResult
from tasks.probe_report import ProbeReport
from tasks.train import TrainOutcome

FIRST_LAST = 5  # steps averaged for "reward, first 5 → last 5" (halves of shorter runs)


@dataclass
class PipelineResult:
    run_id: str
    output_dir: str
    status: str  # finished | collapsed | pruned | probe_failed | failed | interrupted
    spec_name: str = ""
    last_step: int = 0
    stopped: str | None = None  # the trainer's stop reason ('collapsed: ...', 'pruned: ...')
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
        if outcome.stopped:
            status = "pruned" if outcome.stopped.startswith("pruned:") else "collapsed"
        elif probe is not None and not probe.passed:
            status = "probe_failed"
        else:
            status = "finished"
        return cls(
            run_id=run_id,
            output_dir=output_dir,
            status=status,
            spec_name=spec_name,
            last_step=outcome.last_step,
            stopped=outcome.stopped,
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
        d["final_checkpoint"] = self.final_checkpoint
        return d

    def lines(self) -> list[str]:
        """The terminal summary: how the run went, before → after, the probe, where things are."""
        out = []
        if self.reward_line():
            out.append(f"reward (training batches): {self.reward_line()}")
        if self.stopped:
            out.append(f"stopped: {self.stopped}")
        for k, v in self.eval.items():
            before = f"{self.eval_start[k]:.3f} before training → " if k in self.eval_start else ""
            out.append(f"{k} (held out): {before}{v:.3f}")
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
