"""Module-level Prefect flows for the deployments in prefect.yaml (`entrypoint: flows/deployments.py:<flow>`).

The flows themselves are built by factories next to the code they run (flows/pipeline.py,
flows/regression.py, flows/sweep.py), so that the `ballast` CLI does not import Prefect until it needs it; Prefect's
deployment machinery needs a flow object at module level, so this file holds one per deployment.
A deployment passes plain parameters (a spec *path*, refs), which a worker on the machine that has
this repository checked out resolves from the working directory prefect.yaml sets.
"""
from __future__ import annotations

from prefect import flow

from flows.regression import regression_flow
from flows.sweep import sweep_flow, sweep_worker_flow


@flow(name="ballast-pipeline", persist_result=False, log_prints=True)
def ballast_pipeline(spec_path: str = "examples/quickstart.yaml", overrides: list[str] | None = None,
                     resume_run_id: str | None = None) -> dict:
    """fork → train → checkpoint → artifact-probe → eval on the spec at `spec_path` (see flows/pipeline.py)."""
    from flows.pipeline import configure_prefect, run_pipeline
    from tasks.spec import load_spec

    spec = load_spec(spec_path, overrides or [])
    configure_prefect(spec.project_dir)
    summary = run_pipeline(spec, resume_run_id=resume_run_id, progress=False)
    summary.pop("history", None)
    return summary


# train one spec on two code refs, probe every final artifact, compare (flows/regression.py)
ballast_regression = regression_flow()

# an Optuna sweep of pipeline runs (flows/sweep.py); more workers join it with ballast_sweep_worker
ballast_sweep = sweep_flow()
ballast_sweep_worker = sweep_worker_flow()
