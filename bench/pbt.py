"""Does a population pay? PBT (examples/pbt.yaml, P = 8) against the TPE sweep of examples/sweep.yaml and against
random search, at an equal budget of trial-steps on the quickstart model, each over several seeds.

    python bench/pbt.py                       # seeds 0 1 2, P = 8, 40 steps: 320 trial-steps an arm a seed
    python bench/pbt.py --seeds 0 --steps 20  # a quicker look

What is compared, on purpose:

- **The budget is trial-steps**: PBT trains P members for `steps` each (P × steps); a sweep gets `P` trials of `steps`
  (its planned trial-steps equal PBT's; its pruner may spend fewer, which the table shows). confirm.seeds is 1 in
  both sweeps (no retraining of the winner on other seeds: that would spend trial-steps PBT does not).
- **The score is confirmed**: each arm's winner on the confirmation prompts no decision of that arm read (the same
  seeded split of the same 128 held-out prompts, sweeps/split.py), as the base model's score there; reported as
  the winner's score and its gain over the base model.
- **Wall** is each arm's command end to end (model load, baseline and confirmation evals included), on this machine.
  Run it on a quiet machine: the arms run one after another and share nothing but the tiny model's cache.

Each arm runs the real command (`ballast pbt`, `ballast sweep`) in a project folder of its own under
.ballast/bench/pbt/; the table is printed and written to .ballast/bench/pbt/results.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / ".ballast" / "bench" / "pbt"
CLI = "import sys; from flows.cli import main; sys.exit(main())"


def arm_file(kind: str, seed: int, population: int, steps: int) -> Path:
    """The arm's file: examples/pbt.yaml or examples/sweep.yaml with the seed, steps and project folder of this run."""
    source = REPO / "examples" / ("pbt.yaml" if kind == "pbt" else "sweep.yaml")
    data = yaml.safe_load(source.read_text())
    project = OUT / f"{kind}-seed{seed}"
    shutil.rmtree(project, ignore_errors=True)  # each arm from scratch: a rerun of the bench must not resume one
    data["base"] = str(source.parent / data["base"])
    data["seed"], data["study"] = seed, f"bench-{kind}-{seed}"
    data["overrides"] = {**data["overrides"], "optim.steps": steps, "project_dir": str(project)}
    if kind == "pbt":
        data["pbt"]["population"] = population
    else:
        data["trials"], data["confirm"] = population, {"seeds": 1}
        data["sampler"] = {"type": "random"} if kind == "random" else data["sampler"]
    path = OUT / f"{kind}-seed{seed}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_arm(kind: str, seed: int, population: int, steps: int) -> dict:
    path = arm_file(kind, seed, population, steps)
    command = ["pbt", str(path)] if kind == "pbt" else ["sweep", str(path)]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CLI, *command], cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode not in (0, 3):
        raise SystemExit(f"{kind} seed {seed} exited {done.returncode}:\n{done.stderr[-2000:]}")
    row = {"arm": kind, "seed": seed, "wall_s": wall}
    row.update(_pbt_result(done.stdout, population, steps) if kind == "pbt" else _sweep_result(path))
    return row


def _pbt_result(stdout: str, population: int, steps: int) -> dict:
    m = re.search(r"confirmed on (\d+) \w+ prompts: winner ([-\d.]+) vs base model ([-\d.]+)", stdout)
    if m is None:
        return {"trial_steps": population * steps, "score": None, "baseline": None}
    return {"trial_steps": population * steps, "score": float(m.group(2)), "baseline": float(m.group(3))}


def _sweep_result(path: Path) -> dict:
    import optuna

    from sweeps.confirmation import load_confirmation

    data = yaml.safe_load(path.read_text())
    storage = f"sqlite:///{data['overrides']['project_dir']}/optuna.db"
    study = optuna.load_study(study_name=data["study"], storage=storage)
    spent = sum(t.user_attrs.get("last_step", 0) for t in study.trials)  # a pruned trial's steps too
    conf = load_confirmation(study)
    winner = conf.candidate(conf.winner) if conf is not None else None
    if winner is None or winner.judged is None:
        return {"trial_steps": spent, "score": None, "baseline": None}
    return {"trial_steps": spent, "score": conf.baseline + winner.judged["gain"], "baseline": conf.baseline}


def table(rows: list[dict]) -> str:
    out = ["| arm | seeds | confirmed eval/reward of the winner (mean ± sd) | gain over base | trial-steps | wall s |"]
    out.append("|---|---|---|---|---|---|")
    for arm in ("pbt", "tpe", "random"):
        mine = [r for r in rows if r["arm"] == arm]
        scores = [r["score"] for r in mine if r["score"] is not None]
        gains = [r["score"] - r["baseline"] for r in mine if r["score"] is not None]
        if not mine:
            continue
        sd = statistics.stdev(scores) if len(scores) > 1 else 0.0
        mean = f"{statistics.mean(scores):.3f} ± {sd:.3f}" if scores else "—"
        gain = f"{statistics.mean(gains):+.3f}" if gains else "—"
        steps = statistics.mean(r["trial_steps"] for r in mine)
        wall = statistics.mean(r["wall_s"] for r in mine)
        out.append(f"| {arm} | {len(mine)} | {mean} | {gain} | {steps:.0f} | {wall:.0f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--population", type=int, default=8, help="P; the sweeps get P trials")
    ap.add_argument("--steps", type=int, default=40, help="steps per member / trial (a multiple of pbt.ready: 5)")
    ap.add_argument("--arms", nargs="+", default=["pbt", "tpe", "random"], choices=["pbt", "tpe", "random"])
    args = ap.parse_args()
    rows = []
    for seed in args.seeds:
        for arm in args.arms:
            rows.append(run_arm(arm, seed, args.population, args.steps))
            print(json.dumps(rows[-1]), flush=True)
    (OUT / "results.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
