"""`concurrent_trials: N` in a sweep file: a worker trains N trials at once over one base model (trainer/multi.py),
asked and told through Optuna's ask-and-tell interface — and what the sweep leaves is what one trial at a time
leaves.

The same 3-trial grid (seed 0: learning rate 3e-3, then 0.8, which collapses within 3 steps, then 1e-3) is swept
one trial at a time and two at a time, with `ballast sweep` on the tiny model, real Optuna (SQLite), real Prefect
(its test harness) and real MLflow (SQLite): each trial ends in the same state with the same value, user attrs,
eval scores and MLflow params, within trainer/multi.py's tolerance (tests/test_concurrent_trials.py); the
collapsed trial is pruned by the health gate and its slot goes to the third trial while the first still trains.
Each concurrent trial's training is one Prefect task run `train trial-N` of the worker's flow run, in its final state.
A sweep that cannot run concurrently is refused in one line, exit 2, before any study or model exists.
"""

import json
import math

import pytest

from tests.test_concurrent_trials import TOLERANCE
from tests.test_sweep import COLLAPSE_LR, ballast, load, mlflow_client, runs_of, sweep_file

PARENT, LR = "ballast.mlflow_parent_run_id", "optim.learning_rate"
ATTRS = ("last_step", "run_status", "pruned_by", "prune_reason", "score", "gain", "gain_stderr", "beats_baseline")


def close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True  # a pruned trial's Gain/* stays the placeholder NaN (its gain is under 'Gain at stop/*')
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=TOLERANCE["metric_rel"], abs_tol=TOLERANCE["metric_abs"])
    return a == b


@pytest.fixture(scope="module")
def sweeps(tiny_model, tmp_path_factory, prefect_api):
    """{concurrent_trials: what the sweep left} for 1 (one trial at a time) and 2."""
    out = {}
    for n in (1, 2):
        root = tmp_path_factory.mktemp(f"concurrent-{n}")
        project = root / "project"
        rc = ballast("sweep", sweep_file(root / "sweep.yaml", tiny_model, project, trials=3, concurrent_trials=n))
        study = load(project)
        client = mlflow_client(project)
        runs = {int(r.data.tags["ballast.trial_number"]): r for r in runs_of(client, study.user_attrs[PARENT])}
        summary = json.loads((project / "sweeps" / "lr-sweep" / "summary.json").read_text())
        out[n] = dict(rc=rc, trials={t.number: t for t in study.trials}, runs=runs, summary=summary, client=client)
    out["task_runs"] = prefect_task_runs({r.data.tags["prefect.flow_run_id"] for r in out[2]["runs"].values()})
    return out


def prefect_task_runs(flow_run_ids: set[str]) -> list:
    """The task runs of the one flow run the concurrent trials trained in, read back from Prefect's API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    assert len(flow_run_ids) == 1, flow_run_ids  # the worker's flow run: every trial's MLflow run links to it
    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(flow_run_ids))))


def test_a_concurrent_sweep_finishes_its_trials_and_exits_0(sweeps):
    assert sweeps[2]["rc"] == 0 and sweeps[1]["rc"] == 0
    assert sorted(t.state.name for t in sweeps[2]["trials"].values()) == ["COMPLETE", "COMPLETE", "PRUNED"]
    assert sweeps[2]["summary"]["done"] and sweeps[2]["summary"]["states"] == sweeps[1]["summary"]["states"]


def test_each_concurrent_trial_ends_as_the_same_trial_run_alone(sweeps):
    alone, together = sweeps[1]["trials"], sweeps[2]["trials"]
    assert sorted(alone) == sorted(together) == [0, 1, 2]
    for number, t in together.items():
        a = alone[number]
        assert t.params == a.params and t.state == a.state, number
        assert close(t.value, a.value), (number, t.value, a.value)
        for key in ATTRS:
            assert close(t.user_attrs.get(key), a.user_attrs.get(key)), (number, key)
        assert {k for k in t.user_attrs if k.startswith("objective/")} == {
            k for k in a.user_attrs if k.startswith("objective/")
        }


def test_each_concurrent_trials_mlflow_run_has_the_same_params_eval_scores_and_verdict(sweeps):
    alone, together, trials = sweeps[1]["runs"], sweeps[2]["runs"], sweeps[2]["trials"]
    for number, run in together.items():
        a = alone[number]
        assert trials[number].user_attrs["mlflow_run_id"] == run.info.run_id
        assert run.data.params == a.data.params == {"optim.learning_rate": str(trials[number].params[LR])}
        kinds = ("eval/", "Gain/", "Gain at stop/", "objective/")
        evals = {k: v for k, v in run.data.metrics.items() if k.startswith(kinds)}
        assert evals.keys() == {k for k in a.data.metrics if k.startswith(kinds)}
        for k, v in evals.items():
            assert close(v, a.data.metrics[k]), (number, k, v, a.data.metrics[k])
        for tag in ("ballast.status", "ballast.trial_state", "ballast.outcome", "ballast.swept", "ballast.study"):
            assert run.data.tags[tag] == a.data.tags[tag], (number, tag)
        assert run.info.status == a.info.status


def test_each_concurrent_trials_training_is_one_prefect_task_run_named_after_it_in_its_final_state(sweeps):
    trains = {r.name: r for r in sweeps["task_runs"] if r.name.startswith("train")}
    assert sorted(trains) == ["train trial-0", "train trial-1", "train trial-2"]  # one each, none twice
    assert len([r for r in sweeps["task_runs"] if r.name.startswith("train")]) == 3
    done = {name: (r.state.type.value, r.state.name) for name, r in trains.items()}
    assert done == {
        "train trial-0": ("COMPLETED", "Completed"),
        "train trial-1": ("COMPLETED", "Collapsed"),  # stopped by the health gate at a safe point: the trial pruned
        "train trial-2": ("COMPLETED", "Completed"),
    }
    assert trains["train trial-1"].state.message.startswith("stopped after step ")
    assert "collapsed: " in trains["train trial-1"].state.message
    assert trains["train trial-0"].state.message == "trained 4 steps"
    first, collapsed, third = (trains[f"train trial-{n}"] for n in range(3))
    assert all(r.start_time < r.end_time and r.total_run_time.total_seconds() > 0 for r in trains.values())
    assert first.start_time < collapsed.end_time and collapsed.start_time < first.end_time  # trained together
    assert collapsed.end_time <= third.start_time < first.end_time  # the collapsed trial's slot, at once
    assert all(r.state.is_final() for r in sweeps["task_runs"])  # no task run of the flow run left Running


def test_the_sweeps_mlflow_experiment_is_its_studys_opens_on_training_runs_and_compare_is_one_link(sweeps):
    """The experiment is named after the study and marked a model-training one; the summary (terminal, page, parent
    run's note) links MLflow's Compare of every trial run, in the UI's model-training mode."""
    from urllib.parse import unquote

    runs, client = sweeps[2]["runs"], sweeps[2]["client"]
    (experiment_id,) = {r.info.experiment_id for r in runs.values()}
    experiment = client.get_experiment(experiment_id)
    assert experiment.name == "lr-sweep" and experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    summary = sweeps[2]["summary"]
    assert summary["mlflow_url"].endswith(f"/#/experiments/{experiment_id}/runs?workflowType=machine_learning")
    compare = unquote(summary["compare_url"])
    ids = [runs[n].info.run_id for n in sorted(runs)]
    assert f'/#/compare-runs?runs={json.dumps(ids)}&experiments=["{experiment_id}"]' in compare
    assert compare.endswith("&workflowType=machine_learning")
    parent = client.get_run(runs[0].data.tags["mlflow.parentRunId"])
    assert f"[Compare the trials]({summary['compare_url']})" in parent.data.tags["mlflow.note.content"]


def test_a_collapsed_trial_is_pruned_and_its_slot_goes_to_the_next_trial(sweeps):
    trials = sweeps[2]["trials"]
    first, collapsed, third = trials[0], trials[1], trials[2]
    assert collapsed.params[LR] == COLLAPSE_LR and collapsed.state.name == "PRUNED"
    assert collapsed.user_attrs["pruned_by"] == "health_gate" and collapsed.user_attrs["last_step"] < 4
    assert first.datetime_start < collapsed.datetime_complete  # the two trained together
    assert collapsed.datetime_complete <= third.datetime_start < first.datetime_complete  # its slot, at once
    assert third.state.name == "COMPLETE" and third.user_attrs["last_step"] == 4


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"overrides": {"rollout.max_off_policy_steps": 1}}, "rollout.max_off_policy_steps"),
        ({"space": {"lora.enabled": {"type": "categorical", "choices": [True, False]}}}, "lora.enabled"),
        (  # vLLM trials share one server: its settings cannot differ between trials
            {
                "overrides": {"rollout.engine": "vllm"},
                "space": {"rollout.vllm_dtype": {"type": "categorical", "choices": ["float32", "bfloat16"]}},
            },
            "rollout.vllm_dtype",
        ),
    ],
)
def test_a_sweep_that_cannot_run_concurrently_exits_2_in_one_line_before_any_model_loads(
    tiny_model, tmp_path, capsys, monkeypatch, fields, named
):
    import trainer.model

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(trainer.model, "load_policy", no_model)
    project = tmp_path / "project"
    path = sweep_file(tmp_path / "sweep.yaml", tiny_model, project, concurrent_trials=2, **fields)
    assert ballast("sweep", path) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert "'concurrent_trials': 2" in err and named in err and "concurrent_trials: 1" in err, err
    assert not (project / "optuna.db").exists()


def test_a_vllm_sweeps_shared_server_is_sized_for_the_largest_rank_in_the_space(tiny_model, tmp_path):
    from sweeps.space import check_concurrent_sweep, largest_lora_rank, load_sweep

    space = {"lora.r": {"type": "categorical", "choices": [4, 32, 8]}}
    vllm = {"rollout.engine": "vllm"}
    path = sweep_file(tmp_path / "sweep.yaml", tiny_model, tmp_path, concurrent_trials=2, space=space, overrides=vllm)
    sweep = load_sweep(path)
    check_concurrent_sweep(sweep)  # vllm trials can share a server now; hf ones a model
    assert largest_lora_rank(sweep) == 32
    path = sweep_file(tmp_path / "sweep2.yaml", tiny_model, tmp_path, concurrent_trials=2, overrides=vllm)
    assert largest_lora_rank(load_sweep(path)) == 8  # the base spec's


# ── the ask-and-tell loop alone ────────────────────────────────────────────────────────────────────


def two_slots(loop, objective, running_at_once: list[int]):
    """A batch as ConcurrentTraining runs one: up to 2 trials held at once, the oldest told first, a slot refilled."""

    def batch(asked):
        held = []
        for trial in asked:
            held.append(trial)
            running_at_once.append(len(held))
            if len(held) == 2:
                loop.tell(held.pop(0), objective)
        for trial in held:
            loop.tell(trial, objective)

    return batch


def test_the_ask_tell_loop_stops_at_the_total_of_complete_and_pruned_trials(tmp_path):
    import optuna

    from sweeps.study import AskTell, make_storage, open_study
    from tests.test_sweep import study_sweep

    def objective(trial):
        value = trial.suggest_float("x", 0, 1)
        if trial.number % 2:
            raise optuna.TrialPruned("odd")
        return value

    study = open_study(study_sweep(), make_storage(f"sqlite:///{tmp_path / 'optuna.db'}"), 4)
    loop, held, seen = AskTell(study, callbacks=[lambda st, t: seen.append(t.number)], log=lambda m: None), [], []
    report = loop.run(two_slots(loop, objective, held))
    assert report.states == {0: "COMPLETE", 1: "PRUNED", 2: "COMPLETE", 3: "PRUNED"} and seen == [0, 1, 2, 3]
    assert len(study.trials) == 4 and max(held) == 2
    assert all(t.user_attrs["worker"] for t in study.trials)


def test_the_ask_tell_loop_stops_after_consecutive_failed_trials(tmp_path):
    from sweeps.study import AskTell, SweepWorkerError, make_storage, open_study
    from tests.test_sweep import study_sweep

    def objective(trial):
        raise ValueError(f"bad trial {trial.number}")

    study = open_study(study_sweep(), make_storage(f"sqlite:///{tmp_path / 'optuna.db'}"), 10)
    loop = AskTell(study, max_consecutive_failures=3, log=lambda m: None)
    with pytest.raises(SweepWorkerError, match=r"^3 trials in a row failed; the last \(trial 2\): ValueError: bad"):
        loop.run(two_slots(loop, objective, []))
    assert [t.state.name for t in study.trials] == ["FAIL"] * 4  # trial 3 was running beside trial 2: it ends too
    assert study.trials[0].user_attrs["error"] == "ValueError: bad trial 0"
