"""The artifact probe's report: what was probed, every sample with its reasons, the checks, and the verdict.

`ProbeReport` is the one definition of the report; its JSON form (`to_dict`, `schema_version` 1, kind
"ballast-probe-report") is what the pipeline, `ballast probe --json` and the regression flow write, and what
`ballast compare` reads back (`from_dict`). Keys are stable; new keys may be added (`baseline`: the starting point
probed alike, whose malformed rate the verdict is read against — `versus()`). `summary_lines()` is the terminal view,
`write_html()` the page (tasks/templates/probe_report.html).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tasks.pages import render_page
from trainer.health import REASON_MEANINGS, REASONS

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
