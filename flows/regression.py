"""The regression flow: the same experiment on two code refs, every final artifact probed, the two sides
compared, one MLflow comparison run that says regression or not (the stages are in tasks/regression.py).

    ballast regress SPEC --ref A --ref B [--runs K] [--steps N] [--repo PATH] [--set K=V]...

A is the reference (e.g. the last good ref), B the candidate. Worktrees are removed at the end; run outputs and
reports stay in the work directory (`<project_dir>/regressions/<time>-<A>-<B>` by default). Exit status of
`ballast regress`: 0 no regression, 1 a regression (or a ref whose training failed), 2 bad arguments.
`prefect.yaml` schedules this flow nightly (deployment `ballast-regression`).
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from tasks.record import record_regression
from tasks.regression import (
    RegressionResult,
    compare_sides,
    plan_regression,
    probe_or_error,
    train_at_ref,
    worktrees,
)

NO_RESULT = dict(cache_policy=NO_CACHE, persist_result=False)
train_at_ref_task = task(train_at_ref, name="train-at-ref", **NO_RESULT)
probe_task = task(probe_or_error, name="artifact-probe", **NO_RESULT)
record_task = task(record_regression, name="record-comparison", **NO_RESULT)


@flow(name="ballast-regression", persist_result=False, log_prints=True)
def ballast_regression(
    spec: str,
    refs: list[str],
    runs: int = 1,
    steps: int | None = None,
    repo: str | None = None,
    overrides: list[str] | None = None,
    alpha: float = 0.01,
    work_dir: str | None = None,
) -> RegressionResult:
    plan = plan_regression(spec, refs, runs, steps, repo, overrides or [], work_dir)
    with worktrees(plan) as sides:
        for side in sides:
            side.runs = [
                train_at_ref_task(
                    side.worktree,
                    side.commit,
                    plan.spec_file,
                    plan.work / "runs" / f"{side.name}-{k}",
                    k,
                    plan.spec,
                    steps,
                )
                for k in range(runs)
            ]
    for side in plan.sides:
        side.reports = [probe_task(r["checkpoint"], plan.spec, plan.work / "cache") for r in side.runs]
    result = compare_sides(plan, alpha)
    result.run_id = record_task(plan.spec, result, plan.work)
    print(result.summary)
    return result
