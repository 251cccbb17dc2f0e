"""The run report: training curves as PNG plots and one HTML page (tasks/templates/run_report.html).

Curves are grouped by what they measure, one unit per axis: reward and held-out scores; KL by its three
estimators; completion length in tokens; 0-1 shares (repetition, garbage, truncation); entropy; the engine-vs-
trainer logprob difference. Noisy per-step curves are drawn faint with a rolling mean on top; eval points
(step 0 too, with eval.on_start) as markers. A gate signal's threshold is a dotted line in its curve's colour; far
above the axis (over OFF_SCALE times its top, every curve of the plot counted) it is named in the legend instead,
so the curves keep their scale. Where the health gate stopped the run a red vertical line marks the step on every
plot. Legends sit below the axes, clear of the curves, in one column when a name is long; the PNG holds all of it.
The page also shows what the model wrote: the final eval's samples and the last training step's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402

from tasks.pages import commit_link, render_page  # noqa: E402
from tasks.results import (
    PipelineResult,  # noqa: E402
    ProbeReport,  # noqa: E402
)
from trainer.config import HealthConfig  # noqa: E402
from trainer.health import GATE_SIGNALS  # noqa: E402


@dataclass(frozen=True)
class Plot:
    name: str
    title: str
    ylabel: str
    keys: tuple[str, ...]


PLOTS = (
    Plot(
        "reward",
        "reward (training batches) and held-out scores",
        "reward / score",
        ("reward", "eval/reward", "eval/accuracy"),
    ),
    Plot("kl", "KL(policy ‖ reference) per token", "nats", ("kl/k1", "kl/k2", "kl/k3")),  # 'kl' is kl/k3
    Plot("length", "completion length", "tokens", ("completions/mean_length", "completions/max_length")),
    Plot(
        "health",
        "text health (shares of completions or n-grams)",
        "share (0-1)",
        ("health/ngram_repetition", "health/garbage_ratio", "completions/clipped_ratio", "health/unique_token_ratio"),
    ),
    Plot("entropy", "policy entropy per token", "nats", ("entropy",)),
    Plot(
        "sampling",
        "engine vs trainer logprob of the sampled tokens",
        "|difference| (nats)",
        ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"),
    ),
    Plot(
        "hacking",
        "reward hacking: length pays, groups converge",
        "correlation / diversity",
        ("hacking/length_reward_corr", "hacking/length_reward_corr_trend", "hacking/group_diversity"),
    ),
    Plot(
        "hacking_trends",
        "reward hacking: rises over the gate's windows",
        "change",
        ("hacking/other_reward_rise", "hacking/correctness_rise", "hacking/train_reward_rise", "hacking/eval_rise"),
    ),
)
SMOOTH, SMOOTH_FROM = 5, 20  # rolling mean over 5 steps for curves of 20 points or more
GATE_ALIASES = {"kl/k3": "kl"}  # the gate watches 'kl', which is kl/k3: its threshold goes on the k3 curve
OFF_SCALE = 3.0  # a threshold this many times above the axis's top is named, not drawn
LEGEND_COLUMN_CHARS = 38  # a legend with a longer label gets one column (two would run past the figure's sides)
GATE_COLOR = "#cf222e"


def plot_history(
    history: list[dict], out_dir: Path, health: HealthConfig | None = None, gate: tuple[int, str] | None = None
) -> list[Path]:
    """One PNG per plot that has data; returns their paths. `gate`: (step, reason) where the health gate stopped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for plot in PLOTS:
        fig = draw_plot(plot, history, health, gate)
        if fig is None:
            continue
        path = out_dir / f"{plot.name}.png"
        fig.savefig(path, bbox_inches="tight", pad_inches=0.1)  # the whole legend, however long its names
        plt.close(fig)
        paths.append(path)
    return paths


def draw_plot(plot: Plot, history: list[dict], health: HealthConfig | None = None, gate: tuple[int, str] | None = None):
    """One plot's matplotlib figure, or None when the history has none of its curves."""
    series = {k: [(m["step"], m[k]) for m in history if k in m and m[k] == m[k]] for k in plot.keys}
    if not any(series.values()):
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    colors = {key: _draw(ax, key, pts) for key, pts in series.items() if pts}
    for key, color in colors.items():  # after every curve, so the axis they share decides what is on it
        _threshold(ax, key, color, health)
    if gate is not None:
        ax.axvline(gate[0], color=GATE_COLOR, linewidth=1.5, label=f"health gate stopped the run (step {gate[0]})")
    ax.set(xlabel="step", ylabel=plot.ylabel, title=plot.title)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))  # no '1e-5' offset over the title
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 10.25 between two points
    labels = ax.get_legend_handles_labels()[1]
    ncol = 1 if max(map(len, labels), default=0) > LEGEND_COLUMN_CHARS else 2  # long names: one column
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=ncol, frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _draw(ax, key: str, pts: list[tuple[int, float]]) -> str:
    """Draw one curve; returns its colour."""
    xs, ys = zip(*pts)
    if key.startswith("eval/"):
        (line,) = ax.plot(xs, ys, marker="o", linestyle="--", label=key)
    elif len(pts) >= SMOOTH_FROM:  # noisy per-step values: faint, with their rolling mean on top
        (line,) = ax.plot(xs, ys, alpha=0.3, linewidth=1)
        means = [
            sum(ys[max(0, i - SMOOTH + 1) : i + 1]) / len(ys[max(0, i - SMOOTH + 1) : i + 1]) for i in range(len(ys))
        ]
        ax.plot(xs, means, color=line.get_color(), label=f"{key} (mean of {SMOOTH})")
    else:
        (line,) = ax.plot(xs, ys, marker=".", label=key)
    return line.get_color()


def _threshold(ax, key: str, color: str, health: HealthConfig | None) -> None:
    """The health gate's threshold for this curve: a dotted line in its colour where it is on the axis or near it,
    a legend entry saying so where it is far above the axis's top (drawing it would flatten every curve)."""
    signal = GATE_ALIASES.get(key, key)
    if health is None or not health.enabled or signal not in GATE_SIGNALS:
        return
    limit = getattr(health, GATE_SIGNALS[signal].field)
    side = "<" if GATE_SIGNALS[signal].below else ">"  # group diversity trips below its threshold
    top = ax.get_ylim()[1]
    if top > 0 and limit > OFF_SCALE * top:
        ax.plot([], [], color=color, linestyle=":", label=f"gate: {signal} {side} {limit:g} (far above the axis)")
    else:
        ax.axhline(limit, color=color, linestyle=":", linewidth=1.2, label=f"gate: {signal} {side} {limit:g}")


def write_run_report(
    path: Path,
    result: PipelineResult,
    plots: list[Path],
    probe: ProbeReport | None,
    links: dict[str, str],
    code: dict | None = None,
    samples: dict[str, list[dict]] | None = None,
) -> Path:
    """The run's page: what it was, how it ended, before → after, the probe's verdict, the curves, and what the model
    wrote. `code`: the Ballast commit that ran it ({commit, dirty}); `samples`: {table title: sample rows
    (trainer/samples.py)}, e.g. the final eval's and the last training step's."""
    code = code or {"commit": "unknown", "dirty": False}
    return render_page(
        "run_report.html",
        path,
        result=result,
        plots=plots,
        probe=probe,
        links=links,
        code=code,
        commit_url=commit_link(code["commit"]),
        samples=samples or {},
    )
