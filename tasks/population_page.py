"""The population's summary page (tasks/templates/population.html): the lineage tree, the winner's schedule, every
replacement and the members at the end. Both drawings are inline SVG made here (no plotting library: a lineage tree is
lanes and arrows), so the page is one self-contained file, logged to MLflow beside population.json.
"""

from __future__ import annotations

import math
from html import escape
from pathlib import Path

from tasks.pages import number, render_page
from trainer.config import SCHEDULED
from trainer.population import PopulationResult, ancestry, member_name

LANE, LEFT, RIGHT, TOP = 34, 110, 90, 28
WIDTH = 1100
COLOURS = {"grpo.beta": "#0969da", "optim.learning_rate": "#1a7f37", "rollout.repetition_penalty": "#9a6700"}


def write_population_page(pop, result: PopulationResult, confirmed, path: Path) -> Path:
    knobs = [k for k in SCHEDULED if k in pop.sweep.space]
    winner = result.members[result.winner] if result.winner is not None else None
    schedule = _schedule_rows(winner["schedule"] if winner else [], knobs)
    return render_page(
        "population.html",
        path,
        name=pop.name,
        population=pop.pbt.population,
        steps=result.step,
        ready=pop.pbt.ready,
        objective=pop.objective,
        quantile=pop.pbt.quantile,
        perturb=" or ×".join(f"{f:g}" for f in pop.pbt.perturb),
        resample=f"{pop.pbt.resample_probability:g}",
        confirmed=confirmed,
        winner=member_name(result.winner) if winner else None,
        lineage_svg=lineage_svg(result, pop.pbt.ready),
        schedule_svg=schedule_svg(schedule, knobs, result.step),
        schedule=schedule,
        knobs=knobs,
        replay=str(Path(path).parent / "winner.yaml"),
        events=[_event_row(e, knobs) for e in result.events],
        members=[_member_row(m, result, knobs) for m in result.members],
    )


def _schedule_rows(schedule: list[dict], knobs: list[str]) -> list[dict]:
    """The schedule's segments with every knob's value in force (a segment may set only some)."""
    rows, now = [], {}
    for seg in schedule:
        now.update({k: seg[SCHEDULED[k]] for k in knobs if seg.get(SCHEDULED[k]) is not None})
        rows.append({"step": seg["step"], "v": dict(now)})
    return rows


def _event_row(e: dict, knobs: list[str]) -> dict:
    return {
        "step": e["step"],
        "member_name": member_name(e["member"]),
        "source_name": member_name(e["source"]),
        "reason": e["reason"],
        "v": {k: e["hparams"].get(k) for k in knobs},
        "how": {k: e["explored"].get(k, "") for k in knobs},
        "diff": f"{e['fingerprint_diff']:.1e}",
    }


def _member_row(m: dict, result: PopulationResult, knobs: list[str]) -> dict:
    return {
        "name": m["name"],
        "score": result.scores.get(m["index"]),
        "rank": m["cfg"]["lora"]["r"],
        "v": {k: m["hparams"].get(k) for k in knobs},
        "collapsed": m["collapsed"],
    }


# ------------------------------------------------------------------------------------------ drawings


def lineage_svg(result: PopulationResult, ready: int) -> str:
    """Lanes per member slot over the steps, an arrow per replacement, the winner's lineage drawn thick."""
    n, steps = len(result.members), max(result.step, 1)
    height = TOP + n * LANE + 30
    x = lambda step: LEFT + (WIDTH - LEFT - RIGHT) * step / steps  # noqa: E731
    y = lambda index: TOP + index * LANE + LANE / 2  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-size="12">']
    out.append(
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#57606a"/></marker></defs>'
    )
    for step in range(ready, steps + 1, ready):
        out.append(
            f'<line x1="{x(step):.1f}" y1="{TOP - 6}" x2="{x(step):.1f}" y2="{height - 24}" stroke="#d0d7de" '
            'stroke-dasharray="4 3"/>'
        )
        out.append(f'<text x="{x(step):.1f}" y="{height - 8}" text-anchor="middle" fill="#656d76">{step}</text>')
    for m in result.members:
        i = m["index"]
        out.append(
            f'<line x1="{x(0):.1f}" y1="{y(i)}" x2="{x(steps):.1f}" y2="{y(i)}" stroke="#afb8c1" stroke-width="2"/>'
        )
        out.append(f'<text x="{LEFT - 10}" y="{y(i) + 4}" text-anchor="end">{escape(m["name"])}</text>')
        score = result.scores.get(i)
        label = number(score) if score is not None and not math.isnan(score) else "—"
        out.append(f'<text x="{x(steps) + 8:.1f}" y="{y(i) + 4}">{label}</text>')
    if result.winner is not None:
        out.append(_winner_path(result, x, y, steps))
    for e in result.events:
        colour = "#cf222e" if e["reason"] == "collapsed" else "#57606a"
        x0, y0, y1 = x(e["step"]), y(e["source"]), y(e["member"])
        bend = x0 + 18
        out.append(
            f'<path d="M{x0:.1f},{y0} C{bend:.1f},{y0} {bend:.1f},{y1} {x0 + 4:.1f},{y1}" fill="none" '
            f'stroke="{colour}" stroke-width="1.5" marker-end="url(#arrow)"><title>step {e["step"]}: '
            f"{member_name(e['member'])} copies {member_name(e['source'])} ({e['reason']})</title></path>"
        )
    out.append("</svg>")
    return "".join(out)


def _winner_path(result: PopulationResult, x, y, steps: int) -> str:
    """The winner's lineage: at each step the lane of the slot that trained that step of its weights."""
    owners = ancestry(result.events, result.winner, steps)
    points = [(x(0), y(owners.get(1, result.winner)))]
    for step in range(1, steps + 1):
        points += [(x(step - 1), y(owners[step])), (x(step), y(owners[step]))]
    d = " ".join(f"{'M' if k == 0 else 'L'}{px:.1f},{py}" for k, (px, py) in enumerate(points))
    return (
        f'<path d="{d}" fill="none" stroke="#8250df" stroke-width="5" stroke-opacity=".55"><title>the winner'
        "'s lineage</title></path>"
    )


def schedule_svg(rows: list[dict], knobs: list[str], steps: int) -> str:
    """One step chart per knob of the winner's schedule (log scale for beta and the learning rate)."""
    w, h, gap = 340, 170, 20
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{len(knobs) * (w + gap)}" height="{h + 20}" font-size="11">'
    ]
    for k, knob in enumerate(knobs):
        out.append(_knob_chart(rows, knob, steps, k * (w + gap), w, h))
    out.append("</svg>")
    return "".join(out)


def _knob_chart(rows: list[dict], knob: str, steps: int, left: float, w: float, h: float) -> str:
    values = [r["v"][knob] for r in rows if knob in r["v"]]
    if not values:
        return ""
    log = knob != "rollout.repetition_penalty" and min(values) > 0
    f = math.log10 if log else (lambda v: v)
    lo, hi = f(min(values)), f(max(values))
    lo, hi = (lo - 0.5, hi + 0.5) if hi - lo < 1e-12 else (lo - 0.08 * (hi - lo), hi + 0.08 * (hi - lo))
    px = lambda s: left + 50 + (w - 60) * (s - 1) / max(steps - 1, 1)  # noqa: E731
    py = lambda v: 20 + (h - 40) * (1 - (f(v) - lo) / (hi - lo))  # noqa: E731
    points, ends = [], [r["step"] for r in rows[1:]] + [steps + 1]
    for r, end in zip(rows, ends):
        v = r["v"][knob]
        points += [(px(r["step"]), py(v)), (px(min(end, steps)), py(v))]
    d = " ".join(f"{'M' if i == 0 else 'L'}{a:.1f},{b:.1f}" for i, (a, b) in enumerate(points))
    return (
        f'<g><text x="{left + 50}" y="12" font-weight="600">{knob}{" (log)" if log else ""}</text>'
        f'<line x1="{left + 50}" y1="{h - 20}" x2="{left + w - 10}" y2="{h - 20}" stroke="#d0d7de"/>'
        f'<text x="{left + 45}" y="{py(max(values)) + 4:.1f}" text-anchor="end">{number(max(values), 4)}</text>'
        f'<text x="{left + 45}" y="{py(min(values)) + 4:.1f}" text-anchor="end">{number(min(values), 4)}</text>'
        f'<text x="{px(1):.1f}" y="{h - 6}">step 1</text><text x="{px(steps):.1f}" y="{h - 6}" text-anchor="end">'
        f'{steps}</text><path d="{d}" fill="none" stroke="{COLOURS.get(knob, "#0969da")}" stroke-width="2.5"/></g>'
    )
