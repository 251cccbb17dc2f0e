"""How much the pipeline's orchestration (Prefect, MLflow logging, store uploads) adds to the trainer.

Runs the same spec twice in one process, side by side:
  A. the trainer alone: GRPOTrainer(...).train() — what `ballast train` does;
  B. the whole Prefect flow: fork → train → checkpoint → probe → eval, with MLflow and the store.
Orchestration overhead = B's wall time minus A's wall time minus the probe and eval stages' own
work (which A does not do); reported in seconds and as % of the trainer's own time. Prefect's
ephemeral API server start-up is part of B and reported on its own line.

    python bench/orchestration.py [--spec examples/quickstart.yaml] [--steps N]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def stage_seconds(project: Path, run_id: str) -> dict[str, float]:
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    parent = client.get_run(run_id)
    kids = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    return {r.data.tags["ballast.stage"]: (r.info.end_time - r.info.start_time) / 1000 for r in kids}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="examples/quickstart.yaml")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--model", default=None, help="model.name_or_path override (e.g. a cached tiny model)")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ballast-bench-orch-"))
    overrides = [f"project_dir={root / 'project'}"]
    if args.steps:
        overrides.append(f"optim.steps={args.steps}")
    if args.model:
        overrides.append(f"model.name_or_path={args.model}")
    from flows.pipeline import configure_prefect
    from tasks.spec import load_spec
    spec = load_spec(args.spec, overrides)
    configure_prefect(spec.project_dir)
    from trainer.model import ensure_model
    ensure_model(spec.model)

    # A. the trainer alone
    from trainer.loop import GRPOTrainer
    t0 = time.perf_counter()
    trainer = GRPOTrainer(spec.trainer_config(), root / "alone", progress=False)
    trainer.train(spec.optim.steps)
    trainer.close()
    alone = time.perf_counter() - t0

    # B. the whole flow (Prefect's ephemeral server starts inside it)
    from flows.pipeline import pipeline_flow
    t0 = time.perf_counter()
    summary = pipeline_flow()(spec.model_dump(mode="json"))
    flow_wall = time.perf_counter() - t0
    stages = stage_seconds(Path(spec.project_dir).resolve(), summary["run_id"])
    stage_sum = sum(stages.values())
    work_beyond_training = stages.get("artifact-probe", 0) + stages.get("eval", 0)
    overhead = flow_wall - alone - work_beyond_training

    rows = [("trainer alone (A)", alone), ("whole flow (B)", flow_wall)]
    rows += [(f"  stage {k}", v) for k, v in sorted(stages.items())]
    rows += [("  outside stages (Prefect start-up, flow, MLflow setup)", flow_wall - stage_sum),
             ("orchestration overhead = B - A - probe - eval", overhead)]
    print(f"\norchestration overhead: {spec.optim.steps} steps of {args.spec}, device {spec.model.device}")
    print(f"{'what':<58}{'seconds':>10}")
    print("-" * 68)
    for name, sec in rows:
        print(f"{name:<58}{sec:>10.1f}")
    print("-" * 68)
    print(f"overhead as % of the trainer's own time: {100 * overhead / alone:.1f}%  (target < 10%)")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
