"""What the stages give back and what a run comes to — one home, so the terminal, the report page, MLflow and a
sweep all read the same objects (tasks/record.py records each):

* `TrainOutcome` — the train stage's (tasks/train.py): the last step, why it stopped early, its history; and
  `RunInterrupted`, the signal that stopped it.
* `EvalResult` — the eval stage's (tasks/eval.py): the held-out metrics of a checkpoint, per prompt too.
* `ProbeReport` — the artifact probe's report (tasks/probe.py): what was probed, every sample with its reasons, the
  checks, and the verdict. Its JSON form (`to_dict`, `schema_version` 1, kind "ballast-probe-report") is what the
  pipeline, `ballast probe --json` and the regression flow write, and what `ballast compare` reads back
  (`from_dict`). Keys are stable; new keys may be added (`baseline`: the starting point probed alike, whose
  malformed rate the verdict is read against — `versus()`). `summary_lines()` is the terminal view, `write_html()`
  the page (tasks/templates/probe_report.html). `ProbeError`: an artifact the probe cannot read at all.

These types import nothing heavy (no torch): the node's entry point (tasks/remote.py) and the CLI's refusals read
them without loading a model's libraries.
* `PipelineResult` — what one pipeline run came to, built from the stage results by the recorder, returned by the
  pipeline flow, read by sweeps (objective values), the CLI and the run report.
"""

from __future__ import annotations

import json
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, get_args

from tasks.pages import render_page
from trainer.health import REASON_MEANINGS, REASONS

# ── the train stage's outcome ──────────────────────────────────────────────────────────────────────


@dataclass
class TrainOutcome:
    output_dir: Path
    last_step: int
    stopped: str | None  # why the run stopped early ('collapsed: ...', 'pruned: ...')
    last_checkpoint: Path | None
    history: list[dict] = field(default_factory=list)  # one metrics dict per step, the resumed-over steps too
    trainer_seconds: float = 0.0  # wall seconds of this invocation's steps
    eval_start: dict | None = None  # eval/* before the first step (eval.on_start)
    interrupted: str | None = None  # the signal that stopped training at a safe point (SIGTERM, SIGINT)

    @property
    def rewards(self) -> list[float]:
        return [m["reward"] for m in self.history if "reward" in m]

    def raise_if_interrupted(self) -> None:
        """A run stopped by a signal goes no further than the checkpoint saved where it stopped."""
        if self.interrupted:
            raise RunInterrupted(self.interrupted, self.last_step, self.last_checkpoint)


class RunInterrupted(Exception):
    """A signal stopped a run: which one, the last step done and its checkpoint, whether it stopped at a safe point
    (after a step, checkpoint saved there) or at once (mid-step: a resume starts from the newest checkpoint, or from
    step 1 without one), and the command that continues it. The exit status is the shell's: 128 + the signal."""

    def __init__(
        self,
        signal_name: str,
        step: int | None = None,
        checkpoint: Path | None = None,
        at_once: bool = False,
        run: str = "the run",
        resume: str | None = None,
        stage: str = "train",
    ):
        self.args = (signal_name,)  # what Exception.__init__ would keep; str() below says the rest
        self.signal, self.step, self.checkpoint, self.at_once = signal_name, step, checkpoint, at_once
        self.run, self.resume, self.stage = run, resume, stage

    @classmethod
    def of(cls, error: BaseException, checkpoints: list[tuple[int, Path]], stage: str = "train") -> RunInterrupted:
        """From a signal that stopped the run at once (KeyboardInterrupt, Prefect's TerminationSignal) in `stage`,
        given the run's checkpoints as (step, path), oldest first."""
        number = getattr(error, "signal", None)
        name = signal.Signals(number).name if isinstance(number, int) else "SIGINT"
        step, path = checkpoints[-1] if checkpoints else (None, None)
        return cls(name, step, path, at_once=True, stage=stage)

    def __str__(self) -> str:
        during = "during a step" if self.stage == "train" else f"during its {self.stage} stage"
        if not self.at_once:
            where = f"after step {self.step}, checkpoint saved ({self.checkpoint})"
        elif self.checkpoint is not None:
            where = f"{during}; it continues from its newest checkpoint, step {self.step} ({self.checkpoint})"
        elif self.stage == "train":
            where = "before its first checkpoint; it starts again from step 1"
        else:
            where = f"{during}, before its first checkpoint; it starts again from step 1"
        resume = f"; continue with: {self.resume}" if self.resume else ""
        return f"{self.run} stopped by {self.signal} {where}{resume}"

    @property
    def exit_code(self) -> int:
        return 128 + int(signal.Signals[self.signal])


# ── the eval stage's result ────────────────────────────────────────────────────────────────────────


@dataclass
class EvalResult:
    checkpoint_uri: str
    step: int  # the checkpoint's step: the final eval is logged at the run's last step
    metrics: dict[str, float]  # eval/reward, eval/accuracy, eval/mean_length
    samples: list[dict] = field(default_factory=list)  # eval.log_samples completions (trainer/samples.py rows)
    per_prompt: dict[str, list[float]] = field(default_factory=dict, repr=False)  # reward/accuracy/length per prompt


# ── the artifact probe's report ─────────────────────────────────────────────────────────────────────


class ProbeError(ValueError):
    """The artifact cannot be probed at all (missing, incomplete, altered, unloadable); the message says why."""


SCHEMA_VERSION = 1
REPORT_KIND = "ballast-probe-report"
CI_LEVEL = 0.95


@dataclass
class Check:
    ok: bool
    detail: str  # one sentence: what was compared, or what is wrong and what to do


@dataclass
class ProbeSample:
    prompt_index: int
    prompt: str
    sample: int  # index of this sample among the prompt's n
    text: str
    reasons: list[str]  # 'repetition_loop: line "foo" x7', ... (trainer.health.classify); [] when healthy
    malformed: bool
    n_tokens: int
    finish_reason: str  # 'stop' | 'length'


@dataclass
class PromptResult:
    index: int
    prompt: str
    answer: str | None
    expected_length: int | None
    n_samples: int
    n_malformed: int
    malformed_rate: float
    reason_counts: dict[str, int]
    mean_tokens: float


@dataclass
class Baseline:
    """What the checkpoint started from (the base model, or the fork's parent) on the same prompts, same settings."""

    model: str  # 'base model <name>' | 'fork parent <uri> (step N)'
    n_samples: int
    n_malformed: int
    malformed_rate: float
    malformed_ci: list[float]
    reason_counts: dict[str, int]
    per_prompt_malformed: list[int]
    per_prompt_mean_tokens: list[float]
    p_value: float  # one-sided Fisher exact: the checkpoint malformed more often than this
    cached: bool  # read from the baseline cache rather than sampled in this probe
    note: str | None = None  # e.g. why the fork's parent could not be used
    samples: list[ProbeSample] = field(default_factory=list)


@dataclass
class ProbeReport:
    checkpoint: str  # the URI probed
    local_path: str  # where it was read from
    step: int | None  # the checkpoint's step (manifest)
    base_model: str  # the base model loaded
    trained_on: str | None  # the base model the manifest names
    code_ref: dict | None  # {"commit", "dirty"} of the code that saved the checkpoint
    created_at: str
    seconds: float
    n_prompts: int
    n_samples: int
    n_malformed: int
    malformed_rate: float
    malformed_ci: list[float]  # Wilson score interval at ci_level
    reason_counts: dict[str, int]  # samples with each reason code, every code of trainer.health.REASONS
    parity_ok: bool  # the reloaded artifact reproduces its save-time logprobs within tolerance
    parity_max_diff: float | None
    parity_tolerance: float
    checks: dict[str, Check]  # base_model, adapter_config, tokenizer, parity
    failures: list[str]  # one actionable sentence per failed check
    per_prompt: list[PromptResult]
    samples: list[ProbeSample]
    settings: dict  # n, temperature, max_tokens, format_tag, ... as probed
    baseline: Baseline | None = None  # the starting point probed alike (probe.compare_to_base)
    ci_level: float = CI_LEVEL
    schema_version: int = SCHEMA_VERSION
    kind: str = REPORT_KIND

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}

    @classmethod
    def from_dict(cls, d: dict) -> ProbeReport:
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        d["checks"] = {k: Check(**c) for k, c in d.get("checks", {}).items()}
        d["per_prompt"] = [PromptResult(**p) for p in d.get("per_prompt", [])]
        d["samples"] = [ProbeSample(**s) for s in d.get("samples", [])]
        if d.get("baseline"):
            base = dict(d["baseline"])
            base["samples"] = [ProbeSample(**s) for s in base.get("samples", [])]
            d["baseline"] = Baseline(**base)
        return cls(**d)

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    def sample_rows(self) -> list[dict]:
        """Every sample as a row like the trainer's sample rows (trainer/samples.py), with its verdict and reasons;
        the baseline's too, marked by `model`."""
        rows = []
        baseline = self.baseline.samples if self.baseline else []
        for model, samples in (("checkpoint", self.samples), ("baseline", baseline)):
            rows += [
                {
                    "step": self.step,
                    "model": model,
                    "prompt": s.prompt,
                    "completion": s.text,
                    "malformed": s.malformed,
                    "reasons": "; ".join(s.reasons),
                    "finish_reason": s.finish_reason,
                    "truncated": s.finish_reason == "length",
                    "tokens": s.n_tokens,
                }
                for s in samples
            ]
        return rows

    def versus(self) -> str:
        """'9.4% malformed vs 6.2% for the base model <name>': the verdict read against the starting point."""
        base = f" vs {self.baseline.malformed_rate:.1%} for the {self.baseline.model}" if self.baseline else ""
        return f"{self.malformed_rate:.1%} malformed{base}"

    def summary_lines(self) -> list[str]:
        """A few lines for a terminal: verdict, totals, reasons, per prompt, failures."""
        lo, hi = self.malformed_ci
        diff = "n/a" if self.parity_max_diff is None else f"{self.parity_max_diff:.3g}"
        lines = [
            f"probe {'PASSED' if self.passed else 'FAILED'}: {self.checkpoint} (step {self.step})",
            f"  malformed {self.n_malformed}/{self.n_samples} = {self.versus()} "
            f"(95% CI {lo:.1%}-{hi:.1%}; cap {self.settings['max_malformed_rate']:g})",
            f"  parity {'ok' if self.parity_ok else 'FAILED'}: max |logprob diff| {diff} "
            f"(tolerance {self.parity_tolerance:g})",
            "  reasons: " + (", ".join(f"{r} {k}" for r, k in self.reason_counts.items() if k) or "none"),
        ]
        if self.baseline:
            b = self.baseline
            lines.append(
                f"  baseline: {b.model}: {b.n_malformed}/{b.n_samples} malformed on the same prompts"
                f"{' (cached)' if b.cached else ''}; one-sided Fisher exact p={b.p_value:.2g}"
                + (f"; {b.note}" if b.note else "")
            )
        for p in self.per_prompt:
            lines.append(f"  prompt {p.index}: {p.n_malformed}/{p.n_samples} malformed  {p.prompt[:60]!r}")
        return lines + [f"  FAILURE: {f}" for f in self.failures]

    def write_html(self, path: str | Path) -> Path:
        """One self-contained page: verdict, totals, checks, reasons (defined on the page), per prompt, samples."""
        return render_page("probe_report.html", path, report=self, reasons=REASONS, meanings=REASON_MEANINGS)


@dataclass
class ProbeFailure:
    """An artifact that could not be probed at all (regression runs count it as a failed probe)."""

    checkpoint: str
    error: str
    failures: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "checkpoint": self.checkpoint,
            "error": self.error,
            "passed": False,
            "parity_ok": False,
            "n_samples": 0,
            "n_malformed": 0,
            "failures": self.failures or [self.error],
            "reason_counts": {},
        }


# ── what a run comes to ─────────────────────────────────────────────────────────────────────────────

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
