"""From answer to run: `ballast sweep FILE --promote` starts the full run of the sweep's confirmed winner.

    ballast sweep examples/sweep.yaml --promote              # the trial that beat the base model on every seed
    ballast sweep examples/sweep.yaml --promote 7            # trial 7, whatever the verdict said
    ballast sweep examples/sweep.yaml --promote --continue   # go on from the trial's checkpoint (a verified fork)
    ballast sweep examples/sweep.yaml --promote --set optim.steps=400   # and a field of the run changed

The run is a pipeline run (flows/pipeline.py) of the study's base spec with the trial's values, less what the sweep
changed to make trials cheap: the step count is the base spec's own (the sweep's `overrides` may have shortened it),
the artifact probe is on, and its evals score every held-out prompt (no selection part). With `--continue` it forks
from the trial's final checkpoint — fetched, verified against its fingerprint (tasks/fork.py) — and trains the steps
the trial had left to the full count. Its MLflow run carries the lineage: tags `ballast.promoted_from_trial`,
`ballast.promoted_from_run` (the trial's run), `ballast.sweep` and `ballast.sweep_parent_run`; the study's parent run
gets `ballast.promoted_run`. A sweep with no confirmed claim is refused unless a trial is named.
"""

from __future__ import annotations

from sweeps.confirmation import load_confirmation
from sweeps.space import SweepError, SweepSpec, baseline_spec, trial_spec
from tasks.spec import ExperimentSpec, set_path, validate_spec

CONFIRMED = "confirmed"  # --promote with no trial number: the one the verdict claimed


def pick_trial(study, which: str) -> int:
    """The trial to promote: the verdict's claim (`which` 'confirmed'), or the number given."""
    if which != CONFIRMED:
        try:
            number = int(which)
        except ValueError:
            raise SweepError(f"--promote {which}: give a trial number, or nothing for the confirmed winner") from None
        done = {t.number: t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"}
        if number not in done:
            raise SweepError(
                f"--promote {number}: study {study.study_name!r} has no completed trial {number} (completed: "
                f"{sorted(done) or 'none'})"
            )
        return number
    c = load_confirmation(study)
    if c is None:
        raise SweepError(
            f"--promote: study {study.study_name!r} has no confirmed verdict yet; run the sweep to its end "
            "(ballast sweep FILE), or name a trial: --promote N"
        )
    if why := c.stale_reason(study):
        raise SweepError(
            f"--promote: {why}; run the sweep to its end (ballast sweep FILE) for the verdict, or name a trial: "
            "--promote N"
        )
    if c.claimed is None:
        raise SweepError(
            f"--promote: no trial of {study.study_name!r} beat the base model on confirmation and every seed (the "
            f"best there was trial {c.winner}); promote it anyway with --promote {c.winner}"
        )
    return c.claimed


def promoted_spec(sweep: SweepSpec, study, number: int, cont: bool, overrides: list[str]) -> ExperimentSpec:
    """The full run of trial `number`: base spec + the sweep's overrides + the trial's values, the base spec's own
    step count, the probe on, every held-out prompt; forked from the trial's checkpoint with `cont`."""
    trial = study.trials[number]
    full_steps = (sweep.base.get("optim") or {}).get("steps")
    data = trial_spec(sweep, dict(trial.params), f"{sweep.study_name}-trial-{number}", baseline_spec(sweep))
    data = data.model_dump(mode="json")
    data["optim"]["steps"] = int(full_steps or ExperimentSpec.model_fields["optim"].default_factory().steps)
    data["probe"]["enabled"] = True
    data.setdefault("health", {})["enabled"] = (sweep.base.get("health") or {}).get("enabled", True)
    if cont:
        uri = trial.user_attrs.get("checkpoint_uri")
        if not uri:
            raise SweepError(f"--continue: trial {number} kept no checkpoint; promote it without --continue")
        ran = int(trial.user_attrs.get("last_step") or 0)
        data["fork"] = {"checkpoint": uri}
        data["optim"]["steps"] = max(1, data["optim"]["steps"] - ran)
        data["name"] = f"{sweep.study_name}-trial-{number}-continued"
    for item in overrides:
        set_path(data, item)
    return validate_spec(data, f"--promote {number}")


def lineage_tags(study, number: int, parent_run_id: str | None, cont: bool) -> dict:
    trial = study.trials[number]
    return {
        "promoted_from_trial": number,
        "promoted_from_run": trial.user_attrs.get("mlflow_run_id"),
        "sweep": study.study_name,
        "sweep_parent_run": parent_run_id,
        "promoted": "continued from the trial's checkpoint" if cont else "trained from the start",
    }


def promote(study, sweep: SweepSpec, which: str, cont: bool, overrides: list[str]):
    """Start the promoted run and tie it to the study; its PipelineResult."""
    from flows.pipeline import run_pipeline
    from flows.sweep import make_recorder

    number = pick_trial(study, which)
    spec = promoted_spec(sweep, study, number, cont, overrides)
    recorder = make_recorder(sweep)
    recorder.join(study)
    how = f"from trial {number}'s checkpoint, {spec.optim.steps} more steps" if cont else f"{spec.optim.steps} steps"
    print(f"promote: trial {number} of {study.study_name} ({how}, the probe on) as run {spec.name}", flush=True)
    result = run_pipeline(
        spec.model_dump(mode="json"),
        tags=lineage_tags(study, number, recorder.parent_run_id, cont),
        flow_run_name=spec.name,
    )
    recorder.tracking.set_tags(recorder.parent_run_id, {"promoted_run": result.run_id})
    return result
