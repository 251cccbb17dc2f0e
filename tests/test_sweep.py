"""Sweeps as a user runs them: `ballast sweep FILE` on the tiny model, real Optuna (SQLite), real
Prefect (its test harness), real MLflow (SQLite).

Sweep files are checked before anything runs, naming the field; the space is asked define-by-run;
a sweep records an MLflow parent run with a child run per trial and a summary; a collapsing
configuration is pruned by the health gate within a few steps, its reason on the trial; a sweep
resumes into the same study; a worker killed mid-trial leaves a failed, uncounted trial, and the
resumed sweep runs its configuration again and still completes the requested count (tests/test_sweep_kill.py: to
the uninterrupted sweep's answer).
"""

import os
import signal
import subprocess
import sys
import time

import mlflow
import optuna
import pytest
import yaml
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from tests.conftest import REPO, tiny_spec

HEALTHY_LR, COLLAPSE_LR, OTHER_LR = 1e-3, 0.8, 3e-3


def sweep_file(path, tiny_model, project, **fields):
    """A sweep over the learning rate of 4-step trials on the tiny model (base spec inline)."""
    base = tiny_spec(
        tiny_model,
        name="sweep-test",
        project_dir=str(project),
        probe={"enabled": False},
        optim={"steps": 4, "learning_rate": HEALTHY_LR},
        checkpoint={"every": 100, "keep_last": 1},
        health={"patience": 2},
    )
    data = {
        "study": "lr-sweep",
        "base": base,
        "space": {"optim.learning_rate": {"type": "categorical", "choices": [HEALTHY_LR, COLLAPSE_LR, OTHER_LR]}},
        "sampler": {"type": "grid"},
        "pruner": {"type": "none"},
        "trials": 2,
        "seed": 0,
        "heartbeat": {"interval": 1, "grace_period": 3},
    }
    data.update(fields)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def ballast(*args) -> int:
    from flows.cli import main

    return main([str(a) for a in args])


def load(project, name="lr-sweep") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{project / 'optuna.db'}")


def mlflow_client(project) -> MlflowClient:
    uri = f"sqlite:///{project / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    return MlflowClient(uri)


def runs_of(client, parent_id):
    exp = client.get_run(parent_id).info.experiment_id
    return client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent_id}' and tags.`ballast.study` = 'lr-sweep'")


# ── sweep files ────────────────────────────────────────────────────────────────────────────────────


def base_sweep(tiny_model, tmp_path):
    return yaml.safe_load(sweep_file(tmp_path / "s.yaml", tiny_model, tmp_path / "p").read_text())


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda d: d.update(sampler_type="tpe"), "'sampler_type'"),
        (lambda d: d["space"].update({"optim.lr": {"type": "float", "low": 1e-4, "high": 1e-2}}), "'space.optim.lr'"),
        (lambda d: d["space"].update({"lora": {"type": "categorical", "choices": [1]}}), "'space.lora'"),
        (lambda d: d["space"].update({"lora.r": {"type": "categorical"}}), "'space.lora.r'"),
        (lambda d: d["space"].update({"grpo.beta": {"type": "float", "low": 0.1, "high": 0.01}}), "'space.grpo.beta'"),
        (
            lambda d: d["space"].update({"grpo.beta": {"type": "float", "low": 0.0, "high": 0.1, "log": True}}),
            "'space.grpo.beta'",
        ),
        (lambda d: d["space"].update({"lora.r": {"type": "int", "low": 0, "high": 16}}), "'space.lora.r'"),
        (lambda d: d.update(overrides={"optim.stepz": 3}), "'overrides.optim.stepz'"),
        (lambda d: d.update(objectives=[{"metric": "eval/reward", "direction": "upward"}]), "'objectives.0.direction'"),
        (lambda d: d.update(objectives=[{"metric": "rewrd"}]), "'objectives.0'"),
        (lambda d: d["space"].update({"grpo.beta": {"type": "float", "low": 0.01, "high": 0.1}}), "'sampler'"),
        (lambda d: d.update(trials=9), "'trials'"),
        (  # each value alone is valid; min_tokens 20 beside max_tokens 16 is not (it failed that trial, hours in)
            lambda d: d["space"].update(
                {
                    "rollout.min_tokens": {"type": "categorical", "choices": [0, 20]},
                    "rollout.max_tokens": {"type": "categorical", "choices": [16, 48]},
                }
            ),
            "'space': the trial optim.learning_rate=",
        ),
        (
            lambda d: d.update(
                objectives=[{"metric": "eval/reward"}, {"metric": "stability", "direction": "minimize"}],
                pruner={"type": "median"},
            ),
            "pruner",
        ),
    ],
)
def test_invalid_sweep_files_are_rejected_naming_the_field(tiny_model, tmp_path, change, named):
    from sweeps.space import SweepError, load_sweep

    data = base_sweep(tiny_model, tmp_path)
    change(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SweepError) as e:
        load_sweep(path)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_a_bad_sweep_file_exits_2_before_any_study_exists(tiny_model, tmp_path, capsys):
    data = base_sweep(tiny_model, tmp_path)
    data["space"]["optim.lr"] = {"type": "float", "low": 1e-4, "high": 1e-2}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    assert ballast("sweep", path) == 2
    assert "space.optim.lr" in capsys.readouterr().err
    assert not (tmp_path / "p" / "optuna.db").exists()


def test_suggest_asks_float_log_int_and_categorical_define_by_run():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from sweeps.space import ParamSpec, suggest

    space = {
        "optim.learning_rate": ParamSpec(type="float", low=1e-5, high=0.5, log=True),
        "grpo.num_generations": ParamSpec(type="int", low=4, high=16, step=4),
        "lora.r": ParamSpec(type="categorical", choices=[4, 8, 16]),
        "rollout.repetition_penalty": ParamSpec(type="float", low=1.0, high=1.3),
    }
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = []
    for _ in range(30):
        trial = study.ask()
        seen.append(suggest(trial, space))
        study.tell(trial, 0.0)
    d = study.trials[0].distributions
    assert d["optim.learning_rate"] == FloatDistribution(1e-5, 0.5, log=True)
    assert d["grpo.num_generations"] == IntDistribution(4, 16, step=4)
    assert d["lora.r"] == CategoricalDistribution([4, 8, 16])
    assert all(1e-5 <= s["optim.learning_rate"] <= 0.5 for s in seen)
    assert {s["grpo.num_generations"] for s in seen} == {4, 8, 12, 16}
    assert {s["lora.r"] for s in seen} == {4, 8, 16}
    assert all(1.0 <= s["rollout.repetition_penalty"] <= 1.3 for s in seen)
    # log scale: about half the draws below the geometric middle (~2.2e-3), far from a linear scale's 0.4 %
    assert 8 <= sum(s["optim.learning_rate"] < 2.2e-3 for s in seen) <= 22


def test_a_trial_spec_is_base_plus_overrides_plus_the_trials_values(tiny_model, tmp_path):
    from sweeps.space import load_sweep, trial_spec

    path = sweep_file(
        tmp_path / "s.yaml", tiny_model, tmp_path / "p", overrides={"grpo.beta": 0.1, "rollout.max_tokens": 20}
    )
    sweep = load_sweep(path)
    spec = trial_spec(sweep, {"optim.learning_rate": 0.8, "lora.r": 4}, name="t-3")
    assert (spec.grpo.beta, spec.rollout.max_tokens, spec.optim.learning_rate, spec.lora.r, spec.name) == (
        0.1,
        20,
        0.8,
        4,
        "t-3",
    )
    assert spec.health.enabled and spec.health.patience == 2
    sweep.prune_collapsed = False
    assert trial_spec(sweep, {}).health.enabled is False


def test_stability_is_the_closest_approach_to_a_health_threshold():
    from sweeps.space import stability
    from trainer.config import HealthConfig

    history = [{"kl": 0.25, "completions/clipped_ratio": 0.0}, {"kl": 0.5, "health/ngram_repetition": 0.3}]
    assert stability(history, HealthConfig(kl_max=1.0, ngram_repetition_max=0.6)) == pytest.approx(0.5)
    assert stability(history, HealthConfig(kl_max=0.25, ngram_repetition_max=0.6)) == pytest.approx(2.0)


def synthetic_study(sweep, values_of):
    """A finished in-memory study: 4 completed trials and one pruned by the health gate."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    from optuna.trial import TrialState, create_trial

    study = optuna.create_study(directions=sweep.directions)
    dists = {
        "optim.learning_rate": FloatDistribution(1e-4, 0.5, log=True),
        "lora.r": CategoricalDistribution([4, 8, 16]),
    }
    for i, (lr, r) in enumerate([(1e-3, 4), (3e-3, 8), (1e-2, 16), (3e-4, 8)]):
        study.add_trial(
            create_trial(
                params={"optim.learning_rate": lr, "lora.r": r},
                distributions=dists,
                values=values_of(i),
                user_attrs={"last_step": 8},
            )
        )
    study.add_trial(
        create_trial(
            state=TrialState.PRUNED,
            params={"optim.learning_rate": 0.4, "lora.r": 4},
            distributions=dists,
            user_attrs={"last_step": 3, "pruned_by": "health_gate", "prune_reason": "collapsed: kl=3 > 1"},
        )
    )
    return study


@pytest.mark.parametrize("objectives", [1, 2])
def test_summary_names_the_best_trial_or_pareto_set_and_draws_the_plots(tiny_model, tmp_path, objectives):
    from sweeps.report import plot_study, summarize
    from sweeps.space import load_sweep

    fields = {"objectives": [{"metric": "eval/reward"}, {"metric": "stability", "direction": "minimize"}][:objectives]}
    if objectives == 2:
        fields["pruner"] = {"type": "none"}
    sweep = load_sweep(sweep_file(tmp_path / "s.yaml", tiny_model, tmp_path / "p", **fields))
    study = synthetic_study(sweep, lambda i: [0.1 * (i + 1), [0.9, 0.05, 0.5, 0.1][i]][:objectives])
    s = summarize(study, sweep)
    assert s.states == {"COMPLETE": 4, "PRUNED": 1} and s.trial_steps == 35 and s.pruned_by_health_gate == 1
    assert s.importances["n_complete"] == 4 and "skipped" in s.importances  # too few for an importance ranking
    if objectives == 1:  # no baseline in this study: nothing to be relative to, the best is the best
        assert s.best["number"] == 3 and s.best["values"] == {"eval/reward": pytest.approx(0.4)}
    else:
        assert sorted(r["number"] for r in s.pareto) == [1, 3]  # (0.2, 0.05) and (0.4, 0.1): nothing beats them on both
    plots, skipped = plot_study(study, sweep, tmp_path / "plots")
    names = {p.stem for p in plots}
    assert {"optimization_history", "parallel_coordinate", "slice"} <= names, skipped
    assert ("pareto_front" in names) == (objectives == 2)


# ── a sweep end to end ─────────────────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def finished_sweep(tiny_model, tmp_path_factory, prefect_api):
    """`ballast sweep` for 2 trials of the 3-point grid; what it left, read back at once."""
    root = tmp_path_factory.mktemp("sweep")
    project = root / "project"
    path = sweep_file(root / "sweep.yaml", tiny_model, project)
    rc = ballast("sweep", path)
    study = load(project)
    parent_id = study.user_attrs["ballast.mlflow_parent_run_id"]
    client = mlflow_client(project)
    children = runs_of(client, parent_id)
    artifacts = {a.path for a in client.list_artifacts(parent_id, "summary")}
    artifacts |= {a.path for a in client.list_artifacts(parent_id, "summary/plots")}
    return dict(
        rc=rc,
        root=root,
        project=project,
        path=path,
        trials=study.trials,
        parent=client.get_run(parent_id),
        children=children,
        artifacts=artifacts,
    )


def test_sweep_finishes_its_trials_and_exits_0(finished_sweep):
    assert finished_sweep["rc"] == 0
    states = sorted(t.state.name for t in finished_sweep["trials"])
    assert len(states) == 2 and set(states) <= {"COMPLETE", "PRUNED"}


def test_sweep_is_one_mlflow_parent_run_with_a_child_run_per_trial(finished_sweep):
    parent, children, trials = finished_sweep["parent"], finished_sweep["children"], finished_sweep["trials"]
    assert parent.info.status == "FINISHED"
    assert len(children) == len(trials)  # trials only: their stages are recorded on the trial runs, not below them
    assert parent.data.tags["ballast.kind"] == "sweep" and parent.data.tags["ballast.study"] == "lr-sweep"
    assert "space.optim.learning_rate" in parent.data.params
    by_number = {int(r.data.tags["ballast.trial_number"]): r for r in children}
    assert sorted(by_number) == sorted(t.number for t in trials)
    for t in trials:
        run = by_number[t.number]
        assert run.data.params == {"optim.learning_rate": str(t.params["optim.learning_rate"])}  # the swept ones
        assert run.data.tags["ballast.output_dir"] and run.data.tags["ballast.base_model"]  # facts are tags
        assert run.data.tags["ballast.swept"] == "optim.learning_rate"
        assert run.data.tags["ballast.trial_state"] == t.state.name
        assert run.data.tags["ballast.spec_hash"]  # the pipeline's own lineage is there too
        assert t.user_attrs["mlflow_run_id"] == run.info.run_id
        if t.state.name == "COMPLETE":
            assert run.data.metrics["objective/eval/reward"] == pytest.approx(t.value)
        head = "Gain" if t.state.name == "COMPLETE" else "Gain at stop"  # a pruned trial's gain, apart from final ones
        assert run.data.metrics[f"{head}/eval/reward"] == pytest.approx(t.user_attrs["gain"])
        assert "eval/reward_stderr" in run.data.metrics


def test_the_baseline_is_measured_once_before_the_first_trial_and_every_trial_is_read_against_it(finished_sweep):
    from sweeps.baseline import Z95, load_baseline

    study = load(finished_sweep["project"])
    baseline = load_baseline(study)
    assert baseline.source.startswith("base model ") and len(baseline.per_prompt["reward"]) == 8
    parent = finished_sweep["parent"]
    assert parent.data.metrics["baseline/eval/reward"] == pytest.approx(baseline.metrics["eval/reward"])
    assert parent.data.metrics["baseline/eval/reward_stderr"] == pytest.approx(baseline.metrics["eval/reward_stderr"])
    assert parent.data.tags["ballast.baseline"].startswith(f"{baseline.source}: eval/reward ")
    for t in finished_sweep["trials"]:
        score, gain, se = t.user_attrs["score"], t.user_attrs["gain"], t.user_attrs["gain_stderr"]
        assert gain == pytest.approx(score - baseline.metrics["eval/reward"])
        assert t.user_attrs["beats_baseline"] == (gain > Z95 * se)
    verdict = parent.data.tags["ballast.verdict"]
    assert verdict.startswith(("trial ", "no trial beat the base model"))  # the claim, then what it rests on
    assert "best on the selection prompts: trial " in verdict  # 8 held-out prompts: too few to keep some back


def test_sweep_summary_is_logged_to_the_parent_run(finished_sweep):
    arts = finished_sweep["artifacts"]
    assert {"summary/summary.html", "summary/summary.json"} <= arts
    assert "summary/plots/intermediate_values.png" in arts
    summary_json = finished_sweep["project"] / "sweeps" / "lr-sweep" / "summary.json"
    import json

    s = json.loads(summary_json.read_text())
    assert s["done"] and sum(s["states"].values()) == 2
    assert "optuna-dashboard sqlite:///" in s["dashboard"]


def test_a_collapsing_learning_rate_is_pruned_by_the_health_gate_within_a_few_steps(finished_sweep):
    collapsed = [t for t in finished_sweep["trials"] if t.params["optim.learning_rate"] == COLLAPSE_LR]
    healthy = [t for t in finished_sweep["trials"] if t.params["optim.learning_rate"] != COLLAPSE_LR]
    assert len(collapsed) == 1  # the seed-0 grid runs 3e-3, then 0.8, then 1e-3
    t = collapsed[0]
    assert t.state.name == "PRUNED"
    assert t.user_attrs["pruned_by"] == "health_gate"
    assert t.user_attrs["prune_reason"].startswith("collapsed: ")
    assert t.user_attrs["last_step"] <= 3 < 4
    assert all(h.state.name == "COMPLETE" and h.user_attrs["last_step"] == 4 for h in healthy)
    run = next(r for r in finished_sweep["children"] if int(r.data.tags["ballast.trial_number"]) == t.number)
    assert run.data.tags["ballast.prune_reason"] == t.user_attrs["prune_reason"]


def pipeline_states(study_name: str) -> dict[int, tuple[str, str]]:
    """{trial number: (Prefect state type, state name)} of the sweep's pipeline flow runs."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["ballast-pipeline"])))
    return {
        int(r.parameters["tags"]["trial_number"]): (r.state.type.value, r.state.name)
        for r in runs
        if (r.parameters.get("tags") or {}).get("study") == study_name
    }


def test_a_collapsed_trial_is_pruned_not_a_crash_in_mlflow_and_named_collapsed_in_prefect(finished_sweep):
    runs = {int(r.data.tags["ballast.trial_number"]): r for r in finished_sweep["children"]}
    states = pipeline_states("lr-sweep")
    for t in finished_sweep["trials"]:
        if t.params["optim.learning_rate"] == COLLAPSE_LR:
            run = runs[t.number]
            outcome = f"pruned: collapsed at step {t.user_attrs['last_step']}"
            assert (run.info.status, run.data.tags["ballast.status"]) == ("FINISHED", "collapsed")
            assert run.data.tags["ballast.outcome"] == outcome
            assert run.data.tags["mlflow.runName"] == f"trial {t.number} · {outcome}"
            assert states[t.number] == ("FAILED", "Collapsed")
        else:
            assert (runs[t.number].info.status, runs[t.number].data.tags["ballast.status"]) == ("FINISHED", "finished")
            assert states[t.number] == ("COMPLETED", "Completed")


@pytest.mark.parametrize(
    "status, state",
    [
        ("finished", ("COMPLETED", "Completed")),
        ("collapsed", ("FAILED", "Collapsed")),
        ("probe_failed", ("FAILED", "ProbeFailed")),
        ("pruned", ("CANCELLED", "Pruned")),
    ],
)
def test_a_pipeline_run_ends_in_a_prefect_state_named_for_how_it_ended(status, state):
    from flows.pipeline import final_state
    from tasks.results import PipelineResult

    result = PipelineResult(run_id="r", output_dir="/tmp/r", status=status)
    ended = final_state(result)
    assert (ended.type.value, ended.name) == state and ended.result(raise_on_failure=False) is result


def test_a_trials_final_eval_is_logged_at_its_last_step_not_at_step_0(finished_sweep):
    client = mlflow_client(finished_sweep["project"])
    runs = {int(r.data.tags["ballast.trial_number"]): r for r in finished_sweep["children"]}
    for t in finished_sweep["trials"]:  # a collapsed trial's eval/reward must read as the trained model's
        history = client.get_metric_history(runs[t.number].info.run_id, "eval/reward")
        assert [m.step for m in history] == [t.user_attrs["last_step"]] and t.user_attrs["last_step"] > 0


def test_rerunning_with_more_trials_continues_the_same_study(finished_sweep):
    project = finished_sweep["project"]
    before = {t.number: t.params for t in finished_sweep["trials"]}
    assert ballast("sweep", finished_sweep["path"], "--trials", 3) == 0
    study = load(project)
    done = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(done) == 3 and len(study.trials) == 3
    assert {t.number: t.params for t in study.trials if t.number in before} == before
    assert len({t.params["optim.learning_rate"] for t in done}) == 3  # the grid went on where it stopped
    assert study.user_attrs["ballast.mlflow_parent_run_id"] == finished_sweep["parent"].info.run_id
    assert len(runs_of(mlflow_client(project), finished_sweep["parent"].info.run_id)) == 3


def test_a_changed_sweep_definition_is_refused_for_an_existing_study(finished_sweep, tmp_path, capsys):
    data = yaml.safe_load(finished_sweep["path"].read_text())
    data["space"]["optim.learning_rate"]["choices"] = [1e-3, 2e-3]
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump(data))
    assert ballast("sweep", path) == 2
    assert "different 'space'" in capsys.readouterr().err


def test_a_sweep_with_no_completed_trial_says_so_exits_3_and_its_parent_run_is_failed(
    tiny_model, tmp_path, prefect_api, capsys
):
    project = tmp_path / "project"
    path = sweep_file(
        tmp_path / "sweep.yaml",
        tiny_model,
        project,
        trials=1,
        space={"optim.learning_rate": {"type": "categorical", "choices": [COLLAPSE_LR]}},
    )
    assert ballast("sweep", path) == 3
    assert "no trial completed" in capsys.readouterr().out
    study = load(project)
    assert [t.state.name for t in study.trials] == ["PRUNED"]
    parent = mlflow_client(project).get_run(study.user_attrs["ballast.mlflow_parent_run_id"])
    assert (parent.info.status, parent.data.tags["ballast.status"]) == ("FAILED", "no_completed_trial")


def test_a_set_with_an_unknown_key_exits_2_before_any_study_exists(tiny_model, tmp_path, capsys):
    project = tmp_path / "project"
    path = sweep_file(tmp_path / "sweep.yaml", tiny_model, project)
    assert ballast("sweep", path, "--set", "optim.stepz=3") == 2
    err = capsys.readouterr().err.strip()
    assert "--set optim.stepz: 'optim.stepz' is not a field of the experiment spec" in err and "\n" not in err
    assert not (project / "optuna.db").exists()


# ── the study: seeds and the trial count ───────────────────────────────────────────────────────────


def study_sweep(**fields):
    from sweeps.space import load_sweep

    sweep = {
        "study": "s",
        "base": {"model": {"name_or_path": "unused"}},
        "seed": 0,
        "space": {
            "optim.learning_rate": {"type": "float", "low": 1e-4, "high": 0.5, "log": True},
            "grpo.beta": {"type": "float", "low": 1e-3, "high": 0.2, "log": True},
        },
        "sampler": {"type": "tpe", "n_startup_trials": 4},
    }
    return load_sweep({**sweep, **fields})


def test_a_resumed_study_never_reproposes_a_finished_trials_parameters(tmp_path):
    """`--trials 5` after `--trials 3`, each a new process with a new sampler (as the CLI runs them)."""
    from sweeps.space import suggest
    from sweeps.study import make_storage, open_study, optimize

    sweep, url = study_sweep(), f"sqlite:///{tmp_path / 'optuna.db'}"
    for total in (3, 5):
        study = open_study(sweep, make_storage(url), total)
        optimize(study, lambda trial: suggest(trial, sweep.space)["optim.learning_rate"], log=lambda m: None)
    params = [tuple(t.params.values()) for t in load(tmp_path, "s").trials]
    assert len(params) == 5 and len(set(params)) == 5


def test_a_resume_without_trials_keeps_the_total_an_earlier_trials_set(tmp_path):
    """`--trials 6` once, then `ballast sweep FILE` again (as its interrupt line said it): the total stays 6; a
    file whose `trials:` was edited since sets it; --trials always does."""
    from sweeps.study import TRIALS_ATTR, make_storage, open_study

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    sweep = study_sweep(trials=4)
    totals = [open_study(sweep, make_storage(url), 6).user_attrs[TRIALS_ATTR]]
    totals.append(open_study(sweep, make_storage(url)).user_attrs[TRIALS_ATTR])
    totals.append(open_study(study_sweep(trials=8), make_storage(url)).user_attrs[TRIALS_ATTR])
    totals.append(open_study(study_sweep(trials=8), make_storage(url)).user_attrs[TRIALS_ATTR])
    totals.append(open_study(study_sweep(trials=8), make_storage(url), 3).user_attrs[TRIALS_ATTR])
    assert totals == [6, 6, 8, 8, 3]


def test_the_interrupt_line_repeats_where_the_study_is_and_how_it_runs():
    from flows.cli import build_parser
    from flows.commands import _sweep_again

    typed = ["sweep", "s.yaml", "--storage", "postgresql://me@db/sweeps", "--trials", "6", "--workers", "2"]
    args = build_parser().parse_args([*typed, "--timeout", "3600", "--set", "optim.steps=4"])
    assert _sweep_again(args) == (
        "ballast sweep s.yaml --set optim.steps=4 --storage postgresql://me@db/sweeps --trials 6 --timeout 3600 "
        "--workers 2"
    )
    assert _sweep_again(build_parser().parse_args(["sweep", "s.yaml"])) == "ballast sweep s.yaml"


def test_a_new_study_is_reproducible_from_its_seed(tmp_path):
    from sweeps.space import suggest
    from sweeps.study import make_storage, open_study, optimize

    sweep, seen = study_sweep(), []
    for name in ("a", "b"):
        sweep.study = name
        study = open_study(sweep, make_storage(f"sqlite:///{tmp_path / 'optuna.db'}"), 3)
        optimize(study, lambda trial: suggest(trial, sweep.space)["optim.learning_rate"], log=lambda m: None)
        seen.append([t.params for t in study.trials])
    assert seen[0] == seen[1]


def test_grid_workers_and_resumes_never_repeat_a_grid_point(tmp_path):
    """Three processes (two workers, then a resume) share a 3-point grid: the grid's numbering agrees between them."""
    from sweeps.space import suggest
    from sweeps.study import make_storage, open_study, optimize

    sweep = study_sweep(
        space={"optim.learning_rate": {"type": "categorical", "choices": [1e-3, 0.8, 3e-3]}},
        sampler={"type": "grid"},
        pruner={"type": "none"},
    )
    for worker, total in ((0, 1), (1, 2), (0, 3)):
        study = open_study(sweep, make_storage(f"sqlite:///{tmp_path / 'optuna.db'}"), total, worker=worker)
        optimize(study, lambda trial: suggest(trial, sweep.space)["optim.learning_rate"], log=lambda m: None)
    assert sorted(t.params["optim.learning_rate"] for t in load(tmp_path, "s").trials) == [1e-3, 3e-3, 0.8]


def test_the_worker_stops_at_the_total_of_complete_and_pruned_trials(tmp_path):
    from sweeps.space import suggest
    from sweeps.study import make_storage, open_study, optimize

    def objective(trial):
        value = suggest(trial, sweep.space)["optim.learning_rate"]
        if trial.number % 2:
            raise optuna.TrialPruned("odd")
        return value

    sweep = study_sweep()
    study = open_study(sweep, make_storage(f"sqlite:///{tmp_path / 'optuna.db'}"), 4)
    report = optimize(study, objective, log=lambda m: None)
    assert report.states == {0: "COMPLETE", 1: "PRUNED", 2: "COMPLETE", 3: "PRUNED"}
    assert len(study.trials) == 4


def test_the_worker_stops_after_consecutive_failed_trials(tmp_path):
    from sweeps.study import SweepWorkerError, make_storage, open_study, optimize

    def objective(trial):
        raise ValueError(f"bad trial {trial.number}")

    study = open_study(study_sweep(), make_storage(f"sqlite:///{tmp_path / 'optuna.db'}"), 10)
    failed = r"^3 trials in a row failed; the last \(trial 2\): ValueError: bad trial 2"
    with pytest.raises(SweepWorkerError, match=failed):
        optimize(study, objective, max_consecutive_failures=3, log=lambda m: None)
    assert [t.state.name for t in study.trials] == ["FAIL"] * 3


def test_workers_that_ended_before_the_deadline_did_not_time_out(tmp_path, prefect_api, capsys):
    """`--workers K --timeout T` whose workers all exited (here: refused, the storage they were given has no such
    file) well before T: the sweep is not 'ended by its --timeout'; one whose deadline has passed is."""
    from flows.trials.workers import WorkerRunner
    from sweeps.runner import Budget
    from sweeps.study import make_storage, open_study

    sweep = study_sweep()
    study = open_study(sweep, make_storage(f"sqlite:///{tmp_path / 'optuna.db'}"), 2)
    workers = WorkerRunner(None, f"sqlite:///{tmp_path / 'missing.db'}", 1, on_nodes=False)
    assert workers.run(study, sweep, None, Budget.of(2, 3600)).timed_out is False
    assert workers.run(study, sweep, None, Budget(2, time.time() - 1)).timed_out is True
    assert "worker exit codes: [2]" in capsys.readouterr().out


def test_a_configuration_whose_worker_dies_each_time_is_retried_heartbeat_retries_times(tmp_path, capsys):
    """A configuration that gets its worker killed (the OOM killer) on every attempt: re-queued `heartbeat.retries`
    times, then left failed with a line saying so — it ran first on every resume, and the sweep never got past it."""
    from sweeps.once import HOST
    from sweeps.space import suggest
    from sweeps.study import fail_dead_workers, make_storage, open_study

    sweep = study_sweep(heartbeat={"retries": 2})
    study = open_study(sweep, make_storage(f"sqlite:///{tmp_path / 'optuna.db'}", sweep.heartbeat), 4)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    configurations = []
    for _ in range(4):
        trial = study.ask()
        configurations.append(suggest(trial, sweep.space)["optim.learning_rate"])
        trial.set_user_attr("worker", f"{HOST}:{dead.stdout.strip()}")
        fail_dead_workers(study)
    states = [t.state.name for t in study.trials]
    assert states == ["FAIL"] * 4 + ["WAITING"] and configurations[:3] == [configurations[0]] * 3
    assert configurations[3] != configurations[0]  # a new configuration after the third attempt, queued once again
    assert "its configuration was interrupted 3 times (heartbeat.retries: 2) and is not queued again" in (
        capsys.readouterr().out
    )


def test_a_trial_whose_worker_was_killed_between_ask_and_naming_itself_is_failed_after_the_grace_period(tmp_path):
    """No worker attribute and no heartbeat: Optuna's stale check never finds such a trial, and it stayed RUNNING for
    good — a sweep whose total counted it waited for it ("running elsewhere") forever."""
    from sweeps.study import fail_dead_workers, interrupted_numbers, make_storage, open_study

    sweep = study_sweep(heartbeat={"interval": 1, "grace_period": 2})
    study = open_study(sweep, make_storage(f"sqlite:///{tmp_path / 'optuna.db'}", sweep.heartbeat), 4)
    study.ask()  # the worker died here
    fail_dead_workers(study)
    assert [t.state.name for t in study.trials] == ["RUNNING"]  # within the grace period: perhaps naming itself
    time.sleep(2.5)
    fail_dead_workers(study)
    assert [t.state.name for t in study.trials] == ["FAIL"]  # failed: no longer one of the sweep's running trials
    assert interrupted_numbers(study) == {0}  # noted as interrupted, not counted (it had no values yet to queue)


def test_a_waiting_worker_looks_again_within_a_short_heartbeat_and_at_most_every_five_seconds(tmp_path):
    """The poll read the interval off Optuna's cache wrapper, which has none, so it was always 5 s."""
    from sweeps.study import make_storage, open_study, poll_interval

    intervals = []
    for name, heartbeat in (("short", {"interval": 1}), ("long", {"interval": 30})):
        sweep = study_sweep(heartbeat=heartbeat)
        study = open_study(sweep, make_storage(f"sqlite:///{tmp_path / name}.db", sweep.heartbeat), 4)
        intervals.append(poll_interval(study))
    assert intervals == [1.0, 5.0]


# ── a worker killed mid-trial ──────────────────────────────────────────────────────────────────────


def test_a_worker_killed_mid_trial_leaves_an_uncounted_trial_and_the_sweep_completes(tiny_model, tmp_path, prefect_api):
    project = tmp_path / "project"
    path = sweep_file(
        tmp_path / "sweep.yaml",
        tiny_model,
        project,
        trials=1,
        overrides={"optim.steps": 12},  # time to kill it
        space={"optim.learning_rate": {"type": "categorical", "choices": [HEALTHY_LR]}},
    )
    assert ballast("sweep", path, "--workers", 0) == 0  # the study and parent run only
    env = dict(os.environ, PREFECT_API_URL=prefect_api)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from flows.cli import main; sys.exit(main())",
            "sweep-worker",
            "--study",
            "lr-sweep",
            "--storage",
            f"sqlite:///{project / 'optuna.db'}",
            "--worker",
            "0",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 240
    try:
        while time.time() < deadline:  # kill once the trial has trained a step
            trials = load(project).trials
            if trials and trials[0].intermediate_values:
                break
            assert worker.poll() is None, worker.stderr.read().decode()[-3000:]
            time.sleep(0.2)
        else:
            pytest.fail("the worker never started training")
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    assert load(project).trials[0].state.name == "RUNNING"

    assert ballast("sweep", path) == 0
    study = load(project)
    killed, rest = study.trials[0], study.trials[1:]
    assert killed.state.name == "FAIL"
    assert "ballast.interrupted.0" in study.user_attrs
    assert [t.state.name for t in rest] == ["COMPLETE"]  # exactly the requested count, the killed one not among them
    assert rest[0].params == killed.params  # its configuration was run again
    client = mlflow_client(project)
    runs = runs_of(client, study.user_attrs["ballast.mlflow_parent_run_id"])
    assert [r.data.tags["ballast.trial_number"] for r in runs] == [str(rest[0].number)]  # one MLflow run per trial
    exp = runs[0].info.experiment_id
    killed_run = client.search_runs([exp], "tags.`ballast.trial_number` = '0'", run_view_type=ViewType.DELETED_ONLY)
    assert len(killed_run) == 1 and killed_run[0].data.tags["ballast.trial_state"] == "INTERRUPTED"  # marked, then gone
