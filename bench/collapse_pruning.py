"""Collapse pruning: the trial-steps a sweep saves by pruning collapsing trials at once, against the
same sweep without it — and whether both find the same best configuration.

    python bench/collapse_pruning.py                               # sweeps/collapse_bench.yaml, both arms
    python bench/collapse_pruning.py --model trainer/assets/tiny-arith   # the shipped tiny model

The same sweep file runs twice, each arm in its own project folder and study:

- **pruned**: `prune_collapsed: true` — a trial whose health gate trips is pruned at that step;
- **unpruned**: `prune_collapsed: false` — the gate is off in the trials, so every configuration runs
  all its steps and is judged by its final eval alone (what a hand-run sweep does).

Both use the grid sampler with the same seed, so they evaluate the same configurations in the same
order, and no other pruner (the median pruner would save more steps, and blur what is measured).
A trial-step is one GRPO step of one trial; "trial s" sums the trials' durations (each a whole
pipeline run: model load, steps, checkpoint, eval), "wall s" includes the sweep's own start-up (the
first arm also starts Prefect's local server). Prints a table per configuration and a summary; writes
results.json to the output folder. Savings depend on the share of the space that collapses and on
trial length: roughly share × (steps − steps to trip) / steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run_arm(sweep_path: Path, arm: str, out: Path, model: str | None, steps: int | None) -> dict:
    from flows.cli import main
    from sweeps.space import load_sweep

    sweep = load_sweep(sweep_path)
    data = yaml.safe_load(sweep_path.read_text())
    base = dict(sweep.base)
    base["project_dir"] = str(out / arm)
    if model:
        base["model"] = {**base.get("model", {}), "name_or_path": str(Path(model).resolve()), "build_if_missing": None}
    elif not Path(base["model"]["name_or_path"]).is_absolute():
        base["model"]["name_or_path"] = str((REPO / base["model"]["name_or_path"]).resolve())
    data.update(base=base, study=f"{sweep.study_name}-{arm}", prune_collapsed=(arm == "pruned"))
    if steps:
        data.setdefault("overrides", {})["optim.steps"] = steps
    path = out / f"{arm}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    t0 = time.perf_counter()
    rc = main(["sweep", str(path)])
    seconds = time.perf_counter() - t0
    summary = json.loads((out / arm / "sweeps" / data["study"] / "summary.json").read_text())
    return {"rc": rc, "seconds": seconds, "summary": summary}


def config_key(params: dict) -> str:
    return ", ".join(
        f"{k.split('.')[-1]}={v:g}" if isinstance(v, float) else f"{k.split('.')[-1]}={v}"
        for k, v in sorted(params.items())
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", default=str(REPO / "sweeps" / "collapse_bench.yaml"))
    ap.add_argument("--model", help="tiny model directory to use instead of the quickstart's (built on first use)")
    ap.add_argument("--steps", type=int, help="trial length (overrides optim.steps of the sweep)")
    ap.add_argument("--out", default=str(REPO / ".ballast" / "bench" / f"collapse-{time.strftime('%Y%m%d-%H%M%S')}"))
    args = ap.parse_args()
    out = Path(args.out).resolve()

    arms = {
        arm: run_arm(Path(args.sweep).resolve(), arm, out, args.model, args.steps) for arm in ("pruned", "unpruned")
    }
    rows = {}
    for arm, r in arms.items():
        for t in r["summary"]["trials"]:
            rows.setdefault(config_key(t["params"]), {})[arm] = t

    print(
        f"\nCollapse pruning on {Path(args.sweep).name}: same grid, same order; pruned = health gate prunes, unpruned = gate off\n"
    )
    print(f"{'configuration':<34} {'pruned: state, steps':<28} {'unpruned: steps, eval/reward':<30}")
    for key, by in rows.items():
        p, u = by.get("pruned", {}), by.get("unpruned", {})
        pv = f"{p.get('state', '-')}, {p.get('steps', '-')}"
        if p.get("state") == "COMPLETE":
            pv += f" ({list(p['values'].values())[0]:.3f})"
        uv = f"{u.get('steps', '-')}, " + (f"{list(u['values'].values())[0]:.3f}" if u.get("values") else "-")
        print(f"{key:<34} {pv:<28} {uv:<30}")

    print(
        f"\n{'arm':<10} {'trials':>6} {'complete':>8} {'pruned':>6} {'trial-steps':>11} {'trial s':>7} {'wall s':>7}  best configuration (eval/reward)"
    )
    for arm, r in arms.items():
        s = r["summary"]
        best = s.get("best") or {}
        bv = f"{list(best['values'].values())[0]:.3f}" if best.get("values") else "-"
        print(
            f"{arm:<10} {sum(s['states'].values()):>6} {s['states'].get('COMPLETE', 0):>8} {s['states'].get('PRUNED', 0):>6} "
            f"{s['trial_steps']:>11} {sum(t['seconds'] or 0 for t in s['trials']):>7.0f} {r['seconds']:>7.0f}  "
            f"{config_key(best.get('params', {}))} ({bv})"
        )
    steps_p, steps_u = arms["pruned"]["summary"]["trial_steps"], arms["unpruned"]["summary"]["trial_steps"]
    saved = 1 - steps_p / steps_u if steps_u else 0.0
    best_p = (arms["pruned"]["summary"].get("best") or {}).get("params")
    best_u = (arms["unpruned"]["summary"].get("best") or {}).get("params")
    print(
        f"\ntrial-steps saved by collapse pruning: {steps_u - steps_p} of {steps_u} = {saved:.0%} "
        f"(target >= 40%): {'met' if saved >= 0.40 else 'NOT met'}"
    )
    print(
        f"same best configuration: {'yes' if best_p == best_u else 'NO'}  ({config_key(best_p or {})} vs {config_key(best_u or {})})"
    )
    (out / "results.json").write_text(
        json.dumps(
            {
                "saved": saved,
                "same_best": best_p == best_u,
                "arms": {a: {"seconds": r["seconds"], "summary": r["summary"]} for a, r in arms.items()},
            },
            indent=1,
            default=str,
        )
    )
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
