"""The sweep's end, run for real (issue 30): `ballast sweep` on the tiny model splits its held-out prompts, ranks and
prunes on the selection part, and when the search ends scores its top trials and the base model on the confirmation
part, reloading each trial's verified checkpoint; the verdict on the terminal, the study, the MLflow parent run and
the summary page is that confirmation score, with the selection score beside it. A seed run is the trial's settings
trained again with other seeds, a child run of the study's parent, scored on the same confirmation prompts. A user's
own confirmation file is scored as the split's part is. Real Optuna, MLflow, Prefect, torch."""

import json
import math
from pathlib import Path

import pytest

from flows.confirm import SEED_TAG, Judge
from sweeps.baseline import load_baseline
from sweeps.confirmation import SeedJob, load_confirmation
from sweeps.split import load_split
from tasks.eval import judging_examples, score_on
from tasks.fork import ForkSource
from tasks.spec import validate_spec
from tests.conftest import tiny_spec
from tests.test_sweep import HEALTHY_LR, OTHER_LR, ballast, load, mlflow_client, sweep_file


@pytest.fixture(scope="module")
def confirmed_sweep(tiny_model, tmp_path_factory, prefect_api):
    """Two trials of the grid, 8 held-out prompts split 4 / 4, the top 2 confirmed; what it printed and left."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("confirm")
    project = root / "project"
    space = {"optim.learning_rate": {"type": "categorical", "choices": [HEALTHY_LR, OTHER_LR]}}
    path = sweep_file(
        root / "sweep.yaml", tiny_model, project, space=space, confirm={"min_prompts": 4, "top_k": 2, "seeds": 2}
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = ballast("sweep", path)
    study = load(project)
    client = mlflow_client(project)
    parent = client.get_run(study.user_attrs["ballast.mlflow_parent_run_id"])
    summary = json.loads((project / "sweeps" / "lr-sweep" / "summary.json").read_text())
    return dict(rc=rc, out=out.getvalue(), study=study, parent=parent, client=client, summary=summary, path=path)


def test_the_held_out_prompts_split_and_the_trials_are_scored_on_the_selection_part(confirmed_sweep):
    study = confirmed_sweep["study"]
    assert confirmed_sweep["rc"] == 0
    split = load_split(study)
    assert (split.kind, split.n_selection, split.n_confirmation) == ("split", 4, 4)
    assert len(load_baseline(study).per_prompt["reward"]) == 8  # the base model scored once, on every prompt
    for t in study.trials:
        assert t.user_attrs["gain_n"] == 4  # a trial's gain: its selection prompts, paired with the base model's


def test_the_verdict_is_made_on_the_confirmation_prompts_with_the_selection_score_beside_it(confirmed_sweep):
    study, out = confirmed_sweep["study"], confirmed_sweep["out"]
    c = load_confirmation(study)
    assert (c.judged_on, c.n_prompts, c.m, len(c.candidates)) == ("confirmation", 4, 2, 2)
    split, base = load_split(study), load_baseline(study)
    assert c.baseline == pytest.approx(sum(split.confirmation(base.per_prompt["reward"])) / 4)
    for cand in c.candidates:  # each scored anew on prompts no trial decision read
        assert cand.judged["n"] == 4 and cand.judged["z"] == pytest.approx(c.z)
        assert cand.selection["score"] == pytest.approx(study.trials[cand.number].user_attrs["score"])
    assert c.winner in {0, 1}
    assert "best on confirmation: trial " in out and "on 4 prompts the search never saw" in out
    assert out.count("best on confirmation: trial ") == 1  # said by the summary, not first by the confirmation too
    assert "on the selection prompts it scored" in out
    assert "± is a 95 % interval simultaneous over the 2 trials compared" in out
    assert ("beats the base model" in out) or ("no trial beat the base model" in out)


def test_the_parent_run_and_the_summary_carry_the_confirmed_verdict(confirmed_sweep):
    parent, summary, study = confirmed_sweep["parent"], confirmed_sweep["summary"], confirmed_sweep["study"]
    c = load_confirmation(study)
    win = c.candidate(c.winner)  # the verdict's first line: "best on confirmation: trial W"
    assert parent.data.metrics["confirm/winner"] == c.winner
    assert parent.data.metrics["confirm/score"] == pytest.approx(win.judged["score"])
    claimed = parent.data.metrics["confirm/claimed"]
    assert math.isnan(claimed) if c.claimed is None else claimed == c.claimed
    assert parent.data.tags["ballast.claimed_trial"] == ("none" if c.claimed is None else str(c.claimed))
    best = summary.get("best") or {}  # a trial beyond noise on the selection prompts, if one is
    assert parent.data.metrics.get("best/selection_gain") == (pytest.approx(best["gain"]) if best else None)
    assert "best/gain" not in parent.data.metrics  # it read as the verdict's gain beside confirm/gain
    assert parent.data.metrics["confirm/selection_gain"] == pytest.approx(win.selection["gain"])
    assert parent.data.metrics["confirm/prompts"] == 4
    assert parent.data.tags["ballast.confirmed_on"] == "confirmation"
    assert "best on confirmation" in parent.data.tags["ballast.confirmation"]
    assert "best on confirmation: trial" in parent.data.tags["ballast.verdict"]
    assert summary["confirmation"]["winner"] == c.winner
    client = confirmed_sweep["client"]
    for cand in c.candidates:
        run = client.get_run(cand.mlflow_run_id)
        assert run.data.metrics["Confirm/eval/reward"] == pytest.approx(cand.judged["score"])


def test_a_seed_run_is_the_trials_settings_with_other_seeds_scored_on_the_confirmation_prompts(confirmed_sweep):
    from flows.sweep import make_recorder
    from sweeps.space import load_sweep

    study = confirmed_sweep["study"]
    sweep = load_sweep(confirmed_sweep["path"])
    recorder = make_recorder(sweep)
    recorder.join(study)
    trial = study.trials[0]
    judge = Judge(study, sweep, recorder, load_split(study), print)
    job = SeedJob(trial.number, dict(trial.params), 1)
    spec = judge.seed_spec(job)
    assert (spec.optim.seed, spec.rollout.seed) == (1, 1) and spec.optim.learning_rate == trial.params[
        "optim.learning_rate"
    ]
    (result,) = judge.retrain([job])
    assert result.status == "finished" and len(result.per_prompt["reward"]) == 4 and result.steps == 4
    run = confirmed_sweep["client"].get_run(result.run_id)
    assert run.data.tags["mlflow.parentRunId"] == recorder.parent_run_id
    assert run.data.tags[f"ballast.{SEED_TAG}"] == str(trial.number) and run.data.tags["ballast.seed_offset"] == "1"
    assert "ballast.trial_number" not in run.data.tags  # never taken for the trial itself


def test_a_confirmation_file_of_ones_own_is_what_the_claim_is_scored_on(tiny_model, tmp_path):
    rows = [{"prompt": f"{a}+{a}", "answer": str(2 * a)} for a in range(10, 15)]
    (tmp_path / "confirm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from sweeps.split import plan_split

    split = plan_split(8, 0, 0.5, 32, str(tmp_path / "confirm.jsonl"), 5)
    spec = validate_spec(tiny_spec(tiny_model, project_dir=str(tmp_path)), "test")
    examples = judging_examples(spec, split)
    assert [e.prompt for e in examples] == [r["prompt"] for r in rows]
    per_prompt = score_on(spec, ForkSource(), examples, tmp_path / "cache")
    assert len(per_prompt["reward"]) == 5


def test_seed_runs_train_together_when_concurrent_trials_allows(confirmed_sweep):
    """Two seed runs as LoRA adapters over one base model (ConcurrentTraining): each a finished pipeline run of its
    own, scored on the confirmation prompts."""
    from flows.sweep import make_recorder
    from sweeps.space import load_sweep

    study = confirmed_sweep["study"]
    sweep = load_sweep(confirmed_sweep["path"])
    sweep.concurrent_trials = 2
    recorder = make_recorder(sweep)
    recorder.join(study)
    trial = study.trials[1]
    judge = Judge(study, sweep, recorder, load_split(study), print)
    results = judge.retrain([SeedJob(trial.number, dict(trial.params), s) for s in (1, 2)])
    assert [r.status for r in results] == ["finished", "finished"]
    assert all(len(r.per_prompt["reward"]) == 4 and r.steps == 4 for r in results)
    runs = [confirmed_sweep["client"].get_run(r.run_id) for r in results]
    assert [r.data.tags["ballast.seed_offset"] for r in runs] == ["1", "2"]
    assert results[0].per_prompt != results[1].per_prompt or results[0].run_id != results[1].run_id


# ── from answer to run ─────────────────────────────────────────────────────────────────────────────


def test_a_promoted_run_is_the_trials_settings_at_the_base_specs_full_length_with_the_probe_on(confirmed_sweep):
    from flows.promote import promoted_spec
    from sweeps.space import load_sweep

    study = confirmed_sweep["study"]
    sweep = load_sweep(confirmed_sweep["path"])
    sweep.overrides = {"optim.steps": 2, "probe.enabled": False}  # what a sweep shortens its trials with
    trial = study.trials[1]
    spec = promoted_spec(sweep, study, 1, False, ["grpo.beta=0.05"])
    assert spec.optim.steps == 4 and spec.probe.enabled  # the base spec's own length; the probe on
    assert spec.optim.learning_rate == trial.params["optim.learning_rate"] and spec.grpo.beta == 0.05
    assert spec.eval.split is None and spec.fork.checkpoint is None  # every held-out prompt; trained from the start
    cont = promoted_spec(sweep, study, 1, True, [])
    assert cont.fork.checkpoint == trial.user_attrs["checkpoint_uri"] and cont.optim.steps == 1  # 4 planned, 4 ran


def test_promote_refuses_without_a_claim_and_continues_a_named_trial_from_its_checkpoint(confirmed_sweep, capsys):
    study, client = confirmed_sweep["study"], confirmed_sweep["client"]
    c = load_confirmation(study)
    if c.claimed is None:  # the tiny model rarely beats itself on 4 prompts: then the verdict has no claim to promote
        assert ballast("sweep", confirmed_sweep["path"], "--promote") == 2
        assert f"promote it anyway with --promote {c.winner}" in capsys.readouterr().err
    assert ballast("sweep", confirmed_sweep["path"], "--promote", "99") == 2
    assert "has no completed trial 99" in capsys.readouterr().err
    elsewhere = Path(confirmed_sweep["path"]).parent / "elsewhere"  # a sweep run with --set project_dir keeps it there
    assert ballast("sweep", confirmed_sweep["path"], "--promote", "--set", f"project_dir={elsewhere}") == 2
    err = capsys.readouterr().err
    assert "does not exist in this storage (it has none)" in err and f"looked in sqlite:///{elsewhere}" in err
    assert ballast("sweep", confirmed_sweep["path"], "--promote", c.winner, "--continue") == 0
    parent = client.get_run(confirmed_sweep["parent"].info.run_id)
    run = client.get_run(parent.data.tags["ballast.promoted_run"])
    tags = run.data.tags
    assert tags["ballast.promoted_from_trial"] == str(c.winner)
    assert tags["ballast.promoted_from_run"] == study.trials[c.winner].user_attrs["mlflow_run_id"]
    assert tags["ballast.sweep_parent_run"] == parent.info.run_id and tags["ballast.sweep"] == "lr-sweep"
    forked = run.data.params.get("ballast.fork_checkpoint") or tags.get("ballast.fork_checkpoint")
    assert forked == study.trials[c.winner].user_attrs["checkpoint_uri"]  # the verified fork
    assert "probe/malformed_rate" in run.data.metrics  # the probe ran
