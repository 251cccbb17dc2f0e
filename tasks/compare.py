"""Compare two probe results — reports, checkpoints, runs or pooled reports of several runs — and say
whether B regressed against A.

    ballast compare A B [--alpha 0.01]
    # A, B: probe report .json | checkpoint (path or s3://) | run directory | MLflow run id

The question is one-sided on purpose: "does B produce malformed output more often than A?" (A is the
reference: the older code ref, the known-good run). So the test is Fisher's exact test on the 2x2
table [[A malformed, A fine], [B malformed, B fine]] with alternative='less' (A's odds of a malformed
sample are lower than B's): a B that got *better* is not a regression, and the p-value is not halved
by looking both ways. Exact, because the counts are small (tens of samples) and zero cells are
normal (a healthy checkpoint has 0 malformed). Verdict at `alpha` (default 0.01):

  * regression — B's malformed rate is higher with p < alpha, or B's artifacts fail parity (they do
    not reproduce their save-time logprobs) while A's pass: a broken save path is a regression even
    when the outputs still look fine;
  * no regression — otherwise.

Each side's rate comes with its Wilson interval. The one-line verdict (`format_verdict`) reads e.g.
"regression: B malformed 35/72 (48.6%) vs A 0/108 (0.0%), Fisher exact p=1.8e-17 (one-sided, alpha 0.01)".

`compare()` returns a `Comparison` (its `to_dict()` is the JSON `ballast compare --json` writes). It also names the
conditions the two sides were probed under that differ (`differences`: the base model trained on, temperature,
max_tokens, the prompts, the format tag, ...): a rate is only comparable to one drawn alike, and a B trained on
another base model or probed hotter is not "no regression" of the code; `format_differences()` is its warning line.
`pool_reports()` adds up the probe reports of k runs of one side (the regression flow's k runs per
code ref) into one report-shaped dict, which `compare()` takes as it takes a single report.
`plot_comparison()` draws the malformed rates with their intervals and, when training histories are
known (metrics.jsonl of runs, MLflow metric history), the metric curves of A and B side by side.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from tasks.pages import render_page  # noqa: E402
from tasks.probe import probe_checkpoint, wilson_interval  # noqa: E402
from tasks.results import CI_LEVEL, REPORT_KIND  # noqa: E402
from tasks.spec import ProbeConfig, default_tracking_uri  # noqa: E402
from tasks.tracking import probe_report_of_run  # noqa: E402
from trainer.checkpoint import MANIFEST, is_checkpoint, list_checkpoints  # noqa: E402
from trainer.config import LoraConfig, ModelConfig  # noqa: E402
from trainer.health import REASONS  # noqa: E402
from trainer.records import read_rows  # noqa: E402

COMPARISON_KIND = "ballast-comparison"
POOLED_KIND = "ballast-probe-pool"
DEFAULT_ALPHA = 0.01
ALTERNATIVE = "less: A's odds of a malformed sample are lower than B's (B is worse)"
RUN_ID_RE = re.compile(r"[0-9a-f]{32}")
# what a probe ran against that changes its malformed rate, (name, the report's field or settings key): two
# sides that differ in one are not a comparison of code alone, and `compare` says so
CONDITIONS = [
    ("base model", "trained_on"),
    ("temperature", "temperature"),
    ("max_tokens", "max_tokens"),
    ("format_tag", "format_tag"),
    ("expected_length", "expected_length"),
    ("length_factor", "length_factor"),
    ("prompts", "prompts"),
    ("system_prompt", "system_prompt"),
    ("prompt_template", "prompt_template"),
]
# training curves drawn side by side: (metric, title)
CURVES = [
    ("reward", "reward"),
    ("completions/mean_length", "completion length"),
    ("health/ngram_repetition", "3-gram repetition"),
    ("kl", "KL to reference"),
]


# ── pooling and the test ───────────────────────────────────────────────────────────────────────────


def pool_reports(reports: list[dict], label: str = "") -> dict:
    """The probe reports of several runs of one side, added up. An entry with an "error" key stands for
    an artifact that could not be probed at all: it counts as a failed probe that fails parity."""
    n = sum(r.get("n_samples", 0) for r in reports)
    bad = sum(r.get("n_malformed", 0) for r in reports)
    reasons: Counter = Counter()
    for r in reports:
        reasons.update(r.get("reason_counts") or {})
    failures = [f"{r.get('checkpoint')}: {f}" for r in reports for f in (r.get("failures") or [])]
    return {
        "kind": POOLED_KIND,
        "label": label,
        "n_reports": len(reports),
        "checkpoints": [r.get("checkpoint") for r in reports],
        "n_samples": n,
        "n_malformed": bad,
        "malformed_rate": bad / n if n else 0.0,
        "malformed_ci": wilson_interval(bad, n),
        "reason_counts": {k: reasons.get(k, 0) for k in REASONS},
        "parity_ok": all(r.get("parity_ok", False) for r in reports),
        "n_parity_failed": sum(not r.get("parity_ok", False) for r in reports),
        "passed": all(r.get("passed", False) for r in reports),
        "n_failed": sum(not r.get("passed", False) for r in reports),
        "failures": failures,
        "conditions": _pooled_conditions([conditions_of(r) for r in reports if "error" not in r]),
        "per_report": [
            {
                k: r.get(k)
                for k in (
                    "checkpoint",
                    "step",
                    "n_samples",
                    "n_malformed",
                    "malformed_rate",
                    "parity_ok",
                    "parity_max_diff",
                    "passed",
                    "error",
                )
            }
            for r in reports
        ],
    }


def conditions_of(report: dict) -> dict:
    """What the report's samples were drawn against (CONDITIONS): the base model the artifact was trained on and the
    probe settings that move the malformed rate. A pooled report carries its own; a key an old report lacks is
    absent."""
    if "conditions" in report:
        return dict(report["conditions"])
    settings = report.get("settings") or {}
    found = {}
    for name, key in CONDITIONS:
        if key == "trained_on":
            model = report.get("trained_on") or report.get("base_model")
            if model:
                found[name] = model
        elif key in settings:
            found[name] = settings[key]
    return found


def _pooled_conditions(each: list[dict]) -> dict:
    """The conditions of k reports as one: a value all share, or {"mixed": [the distinct values]}."""
    pooled = {}
    for name in dict.fromkeys(k for c in each for k in c):
        values = list({json.dumps(c.get(name), sort_keys=True): c.get(name) for c in each}.values())
        pooled[name] = values[0] if len(values) == 1 else {"mixed": values}
    return pooled


def differences(a: dict, b: dict, labels: tuple[str, str] = ("A", "B")) -> list[str]:
    """One phrase per condition the two reports both record and do not share, e.g.
    "base model: A tiny-arith vs B SmolLM2-135M"."""
    ca, cb = conditions_of(a), conditions_of(b)
    return [
        f"{name}: {labels[0]} {_shown(ca[name])} vs {labels[1]} {_shown(cb[name])}"
        for name, _ in CONDITIONS
        if name in ca and name in cb and ca[name] != cb[name]
    ]


def _shown(value) -> str:
    if isinstance(value, dict) and "mixed" in value:
        return "mixed (" + " | ".join(_shown(v) for v in value["mixed"]) + ")"
    return "none" if value is None else str(value)


@dataclass
class ComparedSide:
    """One side of a comparison: its counts, its malformed rate with the Wilson interval, parity."""

    label: str
    n_samples: int
    n_malformed: int
    malformed_rate: float
    malformed_ci: list[float]
    parity_ok: bool
    n_reports: int  # artifacts probed: 1 for a single report, k for a pooled one
    n_parity_failed: int
    passed: bool
    reason_counts: dict[str, int]
    source: str | list | None  # the checkpoint(s) the report is of, or what the user gave


@dataclass
class Comparison:
    """Is B worse than A? The 2x2 table, the one-sided Fisher exact test, parity, and the verdict."""

    a: ComparedSide
    b: ComparedSide
    table: list[list[int]]  # [[A malformed, A fine], [B malformed, B fine]]
    odds_ratio: float
    p_value: float
    alpha: float
    rate_regression: bool  # B is malformed more often than A, p < alpha
    parity_regression: bool  # B's artifacts fail parity while A's pass
    # the conditions A and B were probed under that differ (base model, temperature, ...); empty when alike
    differences: list[str] = field(default_factory=list)
    test: str = "fisher_exact"
    alternative: str = ALTERNATIVE
    ci_level: float = CI_LEVEL
    schema_version: int = 1
    kind: str = COMPARISON_KIND

    @property
    def regression(self) -> bool:
        return self.rate_regression or self.parity_regression

    @property
    def verdict(self) -> str:
        return "regression" if self.regression else "no regression"

    @property
    def summary(self) -> str:
        return format_verdict(self)

    def to_dict(self) -> dict:
        """The JSON form (`ballast compare --json`, comparison.json): every field, the verdict and its line."""
        return {**asdict(self), "regression": self.regression, "verdict": self.verdict, "summary": self.summary}


def _side(report: dict, label: str) -> ComparedSide:
    for key in ("n_samples", "n_malformed"):
        if not isinstance(report.get(key), int):
            raise ValueError(
                f"{label}: not a probe report (no integer {key!r}); give a report written by `ballast probe --json` "
                "or the pipeline's probe_report.json"
            )
    n, bad = report["n_samples"], report["n_malformed"]
    n_reports = report.get("n_reports", 1)
    n_parity_failed = report.get("n_parity_failed", 0 if report.get("parity_ok") else 1)
    return ComparedSide(
        label=report.get("label") or label,
        n_samples=n,
        n_malformed=bad,
        malformed_rate=bad / n if n else 0.0,
        malformed_ci=wilson_interval(bad, n),
        parity_ok=bool(report.get("parity_ok")),
        n_reports=n_reports,
        n_parity_failed=n_parity_failed,
        passed=bool(report.get("passed")),
        reason_counts=report.get("reason_counts") or {},
        source=report.get("checkpoint") or report.get("checkpoints"),
    )


def compare(a: dict, b: dict, alpha: float = DEFAULT_ALPHA, labels: tuple[str, str] = ("A", "B")) -> Comparison:
    """Is B worse than A? One-sided Fisher's exact test on malformed counts, and parity (see the module docstring)."""
    from scipy.stats import fisher_exact

    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha} must be between 0 and 1 (e.g. 0.01)")
    sa, sb = _side(a, labels[0]), _side(b, labels[1])
    table = [
        [sa.n_malformed, sa.n_samples - sa.n_malformed],
        [sb.n_malformed, sb.n_samples - sb.n_malformed],
    ]
    odds_ratio, p_value = fisher_exact(table, alternative="less")
    return Comparison(
        a=sa,
        b=sb,
        table=table,
        odds_ratio=float(odds_ratio),
        p_value=float(p_value),
        alpha=alpha,
        rate_regression=bool(p_value < alpha),
        parity_regression=sa.parity_ok and not sb.parity_ok,
        differences=differences(a, b, (sa.label, sb.label)),
    )


def format_verdict(result: Comparison) -> str:
    """One line: the verdict, both malformed counts and rates, the p-value (and a parity regression, if any)."""
    a, b = result.a, result.b
    line = (
        f"{result.verdict}: {b.label} malformed {b.n_malformed}/{b.n_samples} ({b.malformed_rate:.1%}) vs "
        f"{a.label} {a.n_malformed}/{a.n_samples} ({a.malformed_rate:.1%}), Fisher exact p={result.p_value:.2g} "
        f"(one-sided, alpha {result.alpha:g})"
    )
    if result.parity_regression:
        line += (
            f"; {b.label} fails parity in {b.n_parity_failed} of {b.n_reports} artifact(s) while {a.label} passes "
            "(reloaded weights differ from those saved)"
        )
    return line


def format_differences(result: Comparison) -> str | None:
    """The warning line when A and B were not probed alike, None when they were."""
    if not result.differences:
        return None
    return (
        f"warning: {result.a.label} and {result.b.label} were not probed alike ({'; '.join(result.differences)}): "
        "a difference in malformed rate may come from these, not from B's change; to compare the change alone, "
        "probe both checkpoints with one spec (ballast compare CKPT_A CKPT_B --spec SPEC)"
    )


# ── what A and B can be ────────────────────────────────────────────────────────────────────────────


def read_history(metrics_file: Path) -> list[dict] | None:
    """A run's metrics.jsonl as a list of step dicts; None when there is none."""
    metrics_file = Path(metrics_file)
    if not metrics_file.is_file():
        return None
    return read_rows(metrics_file)


def resolve_target(
    x: str,
    *,
    probe_cfg: ProbeConfig | None = None,
    model_cfg: ModelConfig | None = None,
    lora_cfg: LoraConfig | None = None,
    cache_dir: Path | None = None,
    tracking_uri: str | None = None,
) -> tuple[dict, list[dict] | None]:
    """(report, history) for one side of a comparison:

    * a .json file: a probe report (or pooled report) as written by `ballast probe --json`, the pipeline or
      the regression flow; no history;
    * a checkpoint directory (holds manifest.json) or an s3:// URI: probed now with `probe_cfg` (default
      ProbeConfig()); history from the run's metrics.jsonl when the checkpoint sits in <run>/checkpoints/;
    * a run directory of the trainer (holds checkpoints/): its newest checkpoint probed, history from metrics.jsonl;
    * an MLflow run id: the run's newest probe report artifact and its metric history (`tracking_uri`).
    """

    def probe(uri: str) -> dict:
        return probe_checkpoint(uri, probe_cfg or ProbeConfig(), model_cfg, cache_dir, lora_cfg=lora_cfg).to_dict()

    path = Path(x).expanduser()
    if x.startswith("s3://"):
        return probe(x), None
    if path.is_file():
        try:
            report = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(
                f"{x} is not a JSON probe report ({e}); give a report written by `ballast probe --json`"
            ) from None
        if not isinstance(report, dict) or report.get("kind") not in (REPORT_KIND, POOLED_KIND):
            raise ValueError(
                f"{x} is JSON but not a Ballast probe report (no kind {REPORT_KIND!r}); "
                "give a report written by `ballast probe --json` or the pipeline"
            )
        return report, None
    if path.is_dir():
        if is_checkpoint(path):
            return probe(str(path)), read_history(path.parent.parent / "metrics.jsonl")
        if (path / "checkpoints").is_dir():
            found = list_checkpoints(path / "checkpoints")
            if not found:
                raise ValueError(
                    f"run directory {x} holds no checkpoint under checkpoints/; train it first or give a checkpoint"
                )
            return probe(str(found[-1][1])), read_history(path / "metrics.jsonl")
        if (path / "probe_report.json").is_file():
            return resolve_target(str(path / "probe_report.json"))
        raise ValueError(
            f"{x} is a directory but neither a checkpoint (no {MANIFEST}), a run directory (no checkpoints/) "
            "nor a probe report directory (no probe_report.json)"
        )
    if RUN_ID_RE.fullmatch(x):
        return probe_report_of_run(tracking_uri or default_tracking_uri(), x, [key for key, _ in CURVES])
    raise FileNotFoundError(
        f"{x!r} is neither an existing probe report, checkpoint or run directory, an s3:// URI, nor an "
        "MLflow run id (32 hex characters); check the path"
    )


# ── plots and page ─────────────────────────────────────────────────────────────────────────────────


def _runs(history) -> list[list[dict]]:
    """A history (one run: list of step dicts) or several (list of such lists), as a list of runs."""
    if not history:
        return []
    return [history] if isinstance(history[0], dict) else [h for h in history if h]


def _name(letter: str, label: str) -> str:
    return (letter if label in ("", letter) else f"{letter}: {label}")[:30]


def plot_comparison(result: Comparison, out_dir: Path, history_a=None, history_b=None) -> list[Path]:
    """rates.png (malformed rate with its Wilson interval, A vs B) and, when histories are given,
    curves.png (training metrics of A and B side by side, one thin line per run)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    colors = ("#1f77b4", "#d62728")
    sides = (result.a, result.b)
    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=100)
    for i, (s, color) in enumerate(zip(sides, colors)):
        lo, hi = s.malformed_ci
        rate = s.malformed_rate
        ax.bar(i, rate, color=color, alpha=0.7)
        ax.errorbar(i, rate, yerr=[[rate - lo], [hi - rate]], color="black", capsize=8)
        ax.text(i, hi + 0.02, f"{s.n_malformed}/{s.n_samples}", ha="center", fontsize=9)
    ax.set_xticks([0, 1], [_name("A", sides[0].label), _name("B", sides[1].label)], fontsize=8)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel(f"malformed rate ({result.ci_level:.0%} Wilson CI)")
    ax.set_title(f"{result.verdict} (Fisher one-sided p={result.p_value:.2g})", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths = [out_dir / "rates.png"]
    fig.savefig(paths[0])
    plt.close(fig)

    runs_a, runs_b = _runs(history_a), _runs(history_b)
    if runs_a or runs_b:
        fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.2), dpi=100)
        for ax, (key, title) in zip(axes, CURVES):
            for runs, side, color in ((runs_a, sides[0], colors[0]), (runs_b, sides[1], colors[1])):
                for k, run in enumerate(runs):
                    pts = [(m["step"], m[key]) for m in run if key in m and m[key] == m[key]]
                    if pts:
                        ax.plot(
                            *zip(*pts),
                            color=color,
                            alpha=0.8,
                            linewidth=1,
                            label=_name("A" if side is sides[0] else "B", side.label) if k == 0 else None,
                        )
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out_dir / "curves.png")
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths


def write_comparison_html(
    result: Comparison, path: str | Path, plots: list[Path] = (), extra: dict | None = None
) -> Path:
    """A self-contained page: the verdict line, both sides' counts and intervals, the test, the plots."""
    return render_page("comparison.html", path, r=result, plots=[Path(p) for p in plots], extra=extra or {})
