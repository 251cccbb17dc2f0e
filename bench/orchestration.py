"""What the pipeline's orchestration (Prefect, MLflow, the artifact store) adds to the trainer alone.

Both sides run as a user runs them, each in its own process, one after the other on the same spec:
  A. `ballast train SPEC`  — the trainer alone (model load, training, checkpoints, metrics.jsonl);
  B. `ballast run SPEC`    — the Prefect flow: fork → train → checkpoint → probe → eval, with MLflow
     lineage and checkpoints uploaded to the store — run twice: *cold* (a new project folder: Prefect's
     and MLflow's databases are created) and *warm* (the same folder again, as every later run is).
Orchestration overhead = B - A - (probe + eval stages), the two stages being work that A does not do.
The stage durations come from the run's MLflow records. Reported in seconds and as % of A.

    python bench/orchestration.py [--spec examples/quickstart.yaml] [--steps N [N ...]] [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def ballast(*args: str) -> float:
    """Wall seconds of one `ballast` command in its own process (Prefect's state in the project folder)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL" and k != "PREFECT_HOME"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode not in (0, 3):
        sys.exit(f"ballast {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return seconds


def stages_of_newest_run(project: Path) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ballast")
    parent = client.search_runs(
        [exp.experiment_id], "tags.`ballast.spec_hash` != ''", order_by=["attributes.start_time DESC"], max_results=1
    )[0]
    kids = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return {r.data.tags["ballast.stage"]: (r.info.end_time - r.info.start_time) / 1000 for r in kids}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="examples/quickstart.yaml")
    ap.add_argument("--steps", type=int, nargs="+", default=[None], help="run lengths to compare (default the spec's)")
    ap.add_argument("--model", default=None, help="model.name_or_path override (e.g. a cached tiny model)")
    args = ap.parse_args()

    from tasks.spec import load_spec
    from trainer.model import ensure_model

    root = Path(tempfile.mkdtemp(prefix="ballast-bench-orch-"))
    project = root / "project"
    table = []
    for i, steps in enumerate(args.steps):
        sets = [f"project_dir={project}"] + ([f"optim.steps={steps}"] if steps else [])
        if args.model:
            sets.append(f"model.name_or_path={Path(args.model).absolute()}")
        overrides = [x for s in sets for x in ("--set", s)]
        spec = load_spec(REPO / args.spec, sets)
        ensure_model(spec.model)  # built once, before anything is timed
        alone = ballast("train", args.spec, *overrides, "--output", str(root / f"alone-{i}"), "--quiet")
        table.append((f"{spec.optim.steps} steps", "A. ballast train (trainer alone)", alone, None))
        for label in ("cold", "warm") if i == 0 else ("warm",):
            wall = ballast("run", args.spec, *overrides)
            stages = stages_of_newest_run(project)
            beyond = stages.get("artifact-probe", 0.0) + stages.get("eval", 0.0)
            overhead = wall - alone - beyond
            table.append(("", f"B. ballast run, {label}", wall, None))
            table.append(("", f"   stages: train {stages.get('train', 0):.1f}, probe + eval {beyond:.1f}", None, None))
            table.append(("", f"   overhead ({label}) = B - A - probe - eval", overhead, 100 * overhead / alone))

    print(
        f"\norchestration overhead: {args.spec}, device {spec.model.device}, {os.cpu_count()} CPU cores; "
        "each command in its own process; cold = a new project folder, warm = every later run"
    )
    print(f"{'run':<11}{'what':<52}{'seconds':>9}{'% of A':>9}")
    print("-" * 81)
    for run, name, sec, pct in table:
        print(f"{run:<11}{name:<52}{'' if sec is None else f'{sec:.1f}':>9}{'' if pct is None else f'{pct:.1f}%':>9}")
    print("-" * 81)
    print("target: orchestration adds < 10% to the trainer's own time")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
