"""SIGKILL `ballast sweep examples/sweep.yaml` at random moments, resume each, and check it ends with the answer of
the uninterrupted sweep.

    python bench/sweep_kill.py                          # 10 kills: 5 one trial at a time, 5 with concurrent_trials 2
    python bench/sweep_kill.py --kills 4 --trials 6 --seed 1 --concurrent off

One uninterrupted sweep per mode (one trial at a time; `concurrent_trials: 2`) is the reference. Then, `--kills`
times, alternating the modes: a fresh project, `ballast sweep` started and SIGKILLed (its whole process group, the
Prefect server it started too) at a random moment between its first trial's start and the reference's end (drawn
from a seeded RNG), then `ballast sweep` again until it finishes. Each resumed sweep is checked against its mode's
reference:

- the same trials: the same configurations, each once, ended the same way (COMPLETE or PRUNED) with the same value;
- the same best trial (its configuration and value);
- one MLflow run per trial under the sweep's parent run (the killed attempt's run deleted when it ran again).

Prints a row per kill and a summary table per mode; exits 1 if any check failed. tests/test_sweep_kill.py is the
deterministic version of one such kill (and of a Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CLI = "import sys; from flows.cli import main; sys.exit(main())"
MODES = {"off": 1, "on": 2}  # concurrent trials


def sweep_file(where: Path, concurrent: int, trials: int | None) -> Path:
    """examples/sweep.yaml, its base spec found from anywhere, `concurrent_trials` set (and `trials`, if given)."""
    data = yaml.safe_load((REPO / "examples" / "sweep.yaml").read_text())
    data["base"] = str(REPO / "examples" / data["base"])
    data["concurrent_trials"] = concurrent
    if trials:
        data["trials"] = trials
    where.mkdir(parents=True, exist_ok=True)
    path = where / "sweep.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def sweep(path: Path, env: dict) -> subprocess.Popen:
    project = path.parent / "project"
    command = [sys.executable, "-c", CLI, "sweep", str(path), "--set", f"project_dir={project}"]
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def study(path: Path):
    import optuna

    name = yaml.safe_load(path.read_text())["study"]
    return optuna.load_study(study_name=name, storage=f"sqlite:///{path.parent / 'project' / 'optuna.db'}")


def first_trial_started(path: Path) -> bool:
    try:
        return len(study(path).trials) > 0
    except Exception:  # no storage or study yet
        return False


def answer(path: Path) -> dict:
    """The finished study: {configuration: (state, value)} of its counted trials, and the best (configuration, value)."""
    s = study(path)
    done = [t for t in s.trials if t.state.name in ("COMPLETE", "PRUNED")]
    key = lambda t: tuple(sorted(t.params.items()))  # noqa: E731
    ended = {key(t): (t.state.name, t.value) for t in done}
    best = (key(s.best_trial), s.best_value) if any(t.state.name == "COMPLETE" for t in done) else None
    return {"trials": ended, "each once": len(ended) == len(done), "best": best, "counted": {t.number for t in done}}


def one_run_per_trial(path: Path, counted: set[int]) -> bool:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{path.parent / 'project' / 'mlflow.db'}")
    parent = study(path).user_attrs["ballast.mlflow_parent_run_id"]
    exp = client.get_run(parent).info.experiment_id
    runs = client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent}'", max_results=1000)
    trials = [int(r.data.tags["ballast.trial_number"]) for r in runs if "ballast.trial_number" in r.data.tags]
    seeds = [  # the confirmation's seed runs (flows/seeds.py): one per (trial, seed)
        (r.data.tags.get("ballast.seed_of_trial"), r.data.tags.get("ballast.seed_offset"))
        for r in runs
        if "ballast.trial_number" not in r.data.tags
    ]
    return sorted(trials) == sorted(counted) and len(seeds) == len(set(seeds))


def reference(work: Path, mode: str, trials: int | None, env: dict) -> tuple[dict, float]:
    path = sweep_file(work / f"reference-{mode}", MODES[mode], trials)
    proc = sweep(path, env)
    while not first_trial_started(path) and proc.poll() is None:
        time.sleep(0.2)
    started = time.monotonic()  # the window a kill can fall in: from the first trial's start to the sweep's end
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"the uninterrupted sweep (concurrent {mode}) failed:\n{err[-3000:]}")
    return answer(path), time.monotonic() - started


def kill_at_random(path: Path, env: dict, rng: random.Random, window_s: float) -> tuple[float, int]:
    """Start the sweep, SIGKILL its process group at a random moment of the window; (seconds in, exit code)."""
    proc = sweep(path, env)
    while not first_trial_started(path):
        if proc.poll() is not None:
            return 0.0, proc.returncode
        time.sleep(0.2)
    delay = rng.uniform(0.0, window_s)
    try:
        proc.wait(timeout=delay)
        return delay, proc.returncode  # it finished first: the resume has nothing to do
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return delay, -9


def checks(path: Path, want: dict) -> dict[str, bool]:
    got = answer(path)
    return {
        "same trials": got["trials"] == want["trials"] and got["each once"],
        "same best": got["best"] == want["best"],
        "one run per trial": one_run_per_trial(path, got["counted"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--trials", type=int, help="the study's total (default: the sweep file's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrent", choices=["both", "off", "on"], default="both")
    parser.add_argument("--work", default=str(REPO / ".ballast" / "bench" / "sweep-kill"))
    args = parser.parse_args()

    import shutil

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "BALLAST_FAULT"}
    modes = ["off", "on"] if args.concurrent == "both" else [args.concurrent]
    refs = {}
    for mode in modes:
        refs[mode] = reference(work, mode, args.trials, env)
        print(f"uninterrupted sweep, concurrent trials {mode}: {refs[mode][1]:.0f} s from its first trial to its end")
    rng, tally = random.Random(args.seed), {mode: [0, 0] for mode in modes}
    print(f"{'kill':>4} {'conc':>4} {'at s':>6} {'exit':>5} {'resume s':>9}  checks")
    for i in range(args.kills):
        mode = modes[i % len(modes)]
        want, window = refs[mode]
        path = sweep_file(work / f"kill-{i:02d}", MODES[mode], args.trials)
        delay, code = kill_at_random(path, env, rng, window)
        started = time.monotonic()
        resumed = sweep(path, env)
        _, err = resumed.communicate()
        took = time.monotonic() - started
        tally[mode][1] += 1
        if resumed.returncode != 0:
            last = (err.strip().splitlines() or ["?"])[-1]
            print(f"{i:>4} {mode:>4} {delay:>6.1f} {code!s:>5} {took:>9.0f}  RESUME FAILED: {last}", flush=True)
            continue
        result = checks(path, want)
        tally[mode][0] += all(result.values())
        shown = ", ".join(f"{k} {'ok' if v else 'DIFFERENT'}" for k, v in result.items())
        print(f"{i:>4} {mode:>4} {delay:>6.1f} {code!s:>5} {took:>9.0f}  {shown}", flush=True)
    print(f"\n{'concurrent trials':<18} {'killed':>6} {'equal to uninterrupted':>23}")
    for mode, (equal, killed) in tally.items():
        print(f"{mode:<18} {killed:>6} {equal:>23}")
    equal, killed = sum(t[0] for t in tally.values()), sum(t[1] for t in tally.values())
    print(f"{equal} of {killed} killed-and-resumed sweeps ended equal to the uninterrupted sweep")
    return 0 if equal == killed else 1


if __name__ == "__main__":
    sys.exit(main())
