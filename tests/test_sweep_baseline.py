"""A sweep's answer is relative (DESIGN.md, third round): held-out scores carry their standard error, a trial's gain
over the baseline is paired over the same prompts with an uncertainty, "best" is said only of a trial beyond noise,
pruning's saving is counted, and the summary page — opened in headless Chromium — shows the baseline wherever it
shows a score. Real Optuna studies (in memory), real matplotlib and Chromium; no model needed."""

import math
import random
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial

from sweeps.baseline import BASELINE_ATTR, Baseline, paired_gain
from sweeps.report import MIN_IMPORTANCE_TRIALS, plot_study, summarize
from sweeps.space import SweepError, load_sweep
from trainer.evaluate import stderr

SPACE = {
    "optim.learning_rate": {"type": "float", "low": 1e-4, "high": 0.5, "log": True},
    "lora.r": {"type": "categorical", "choices": [4, 8, 16]},
}
DISTS = {"optim.learning_rate": FloatDistribution(1e-4, 0.5, log=True), "lora.r": CategoricalDistribution([4, 8, 16])}


def sweep_of(tmp_path, **fields):
    base = {"name": "rel", "model": {"name_or_path": "/models/not-loaded-here"}, "project_dir": str(tmp_path)}
    return load_sweep({"study": "rel", "base": base, "space": SPACE, "trials": 6, **fields})


# ── uncertainty ────────────────────────────────────────────────────────────────────────────────────


def test_the_standard_error_is_the_sample_deviation_over_root_n():
    assert stderr([1.0, 0.0, 1.0, 0.0]) == pytest.approx(math.sqrt(1 / 3) / 2)
    assert stderr([0.7]) == 0.0


def test_a_paired_gain_is_the_mean_difference_with_its_standard_error():
    base = [0.0, 1.0, 0.0, 1.0, 0.0]
    trial = [1.0, 1.0, 0.0, 1.0, 1.0]
    g = paired_gain("eval/accuracy", trial, base)
    assert (g.score, g.baseline, g.gain) == (pytest.approx(0.8), pytest.approx(0.4), pytest.approx(0.4))
    assert g.stderr == pytest.approx(stderr([1, 0, 0, 0, 1]))  # 0.2449
    assert g.ci95 == pytest.approx(1.96 * g.stderr)
    assert not g.beats_baseline  # +0.4 ± 0.48: five prompts cannot tell
    assert g.describe() == "eval/accuracy 0.8 vs 0.4 for the base model (+0.4 ± 0.48)"
    many = paired_gain("eval/accuracy", trial * 20, base * 20)
    assert many.gain == pytest.approx(0.4) and many.beats_baseline


def test_a_minimised_objective_gains_by_going_down():
    g = paired_gain("eval/mean_length", [10.0] * 30, [12.0, 13.0] * 15, direction="minimize")
    assert g.gain == pytest.approx(-2.5) and g.beats_baseline


def test_a_paired_gain_needs_the_same_prompts():
    with pytest.raises(ValueError, match="same prompts"):
        paired_gain("eval/reward", [1.0, 0.0], [1.0])


# ── the summary ────────────────────────────────────────────────────────────────────────────────────


def relative_study(trial_rates: list[float], n: int = 96, collapsed: int = 1, pruned: int = 1) -> optuna.Study:
    """Completed trials with the given true accuracy (scored on n prompts), against a base model at 0.3; then
    `collapsed` trials pruned by the health gate and `pruned` by the pruner, each planned for 8 steps."""
    rng = random.Random(0)
    base = [float(rng.random() < 0.3) for _ in range(n)]
    study = optuna.create_study(direction="maximize")
    study.set_user_attr(
        BASELINE_ATTR,
        Baseline(
            "base model tiny", {"eval/reward": sum(base) / n, "eval/reward_stderr": stderr(base)}, {"reward": base}
        ).to_json(),
    )
    k = len(trial_rates) + collapsed + pruned
    lrs = [1e-4 * (4000 ** (i / (k - 1))) for i in range(k)]  # spread over the log range
    for i, rate in enumerate(trial_rates):
        scores = [float(b or rng.random() < (rate - 0.3) / 0.7) for b in base]  # keeps what the base got right
        g = paired_gain("eval/reward", scores, base)
        attrs = dict(last_step=8, planned_steps=8, score=g.score, gain=g.gain, gain_stderr=g.stderr)
        attrs["beats_baseline"] = g.beats_baseline
        params = {"optim.learning_rate": lrs[i], "lora.r": [4, 8, 16][i % 3]}
        iv = {4: g.score - 0.05, 8: g.score}
        study.add_trial(
            create_trial(params=params, distributions=DISTS, value=g.score, user_attrs=attrs, intermediate_values=iv)
        )
    for j in range(collapsed + pruned):
        by = "health_gate" if j < collapsed else "pruner"
        attrs = dict(last_step=3 if by == "health_gate" else 4, planned_steps=8, pruned_by=by, score=0.05)
        attrs["prune_reason"] = "collapsed: kl=3 > 1" if by == "health_gate" else "pruned: eval/reward=0.2 at step 4"
        params = {"optim.learning_rate": lrs[len(trial_rates) + j], "lora.r": 4}
        study.add_trial(
            create_trial(
                params=params,
                distributions=DISTS,
                state=TrialState.PRUNED,
                user_attrs=attrs,
                intermediate_values={4: 0.1},
            )
        )
    return study


def test_best_is_a_trial_that_beats_the_base_model_beyond_noise(tmp_path):
    study = relative_study([0.32, 0.75, 0.5])
    s = summarize(study, sweep_of(tmp_path))
    assert s.best["number"] == 1 and s.best["beats_baseline"] and s.closest is None
    gain = s.best["gain"]
    assert gain == pytest.approx(s.best["score"] - s.baseline["metrics"]["eval/reward"])
    assert s.verdict_line() == (
        f"best: trial 1, eval/reward {s.best['score']:.3g} vs {s.baseline['metrics']['eval/reward']:.3g} for the base "
        f"model ({gain:+.2g} ± {1.96 * s.best['gain_stderr']:.2g})"
    )
    assert any(line.startswith("baseline: eval/reward ") and "base model tiny" in line for line in s.lines())


def test_no_trial_beyond_noise_means_no_best(tmp_path):
    study = relative_study([0.3, 0.31], n=40)
    s = summarize(study, sweep_of(tmp_path))
    assert s.best is None and s.closest is not None
    assert s.verdict_line().startswith("no trial beat the base model beyond noise; closest: trial ")
    assert not any(line.startswith("best:") for line in s.lines())


def test_pruning_saves_the_steps_pruned_trials_did_not_run(tmp_path):
    s = summarize(relative_study([0.5, 0.6], collapsed=2, pruned=1), sweep_of(tmp_path))
    assert s.planned_steps == 5 * 8
    assert s.steps_saved == (8 - 3) * 2 + (8 - 4)
    assert s.pruned_by_health_gate == 2 and s.pruned_by_pruner == 1
    assert "saved 14 of 40 trial-steps (35%)" in s.pruning_line()
    assert s.pruning_line().startswith("pruning: 2 trials collapsed and were pruned, 1 stopped by the pruner")
    one = summarize(relative_study([0.5, 0.6], collapsed=1), sweep_of(tmp_path))
    assert one.pruning_line().startswith("pruning: 1 trial collapsed and was pruned, 1 stopped by the pruner")


def test_the_pruner_stops_a_trial_at_a_rung_but_never_at_its_last_step(tmp_path):
    """A trial whose held-out score is the worst at its last eval has still finished: pruning it there would save no
    step and throw its result away (it was reported PRUNED after 40 of 40 steps)."""
    from sweeps.pruning import TrialPruning
    from tasks.spec import validate_spec

    sweep = load_sweep(
        {
            **sweep_of(tmp_path).model_dump(mode="json", exclude_none=True),
            "pruner": {"type": "successive_halving", "min_resource": 4, "reduction_factor": 2},
        }
    )
    spec = validate_spec({"name": "t", "model": {"name_or_path": "m"}, "optim": {"steps": 8}, "eval": {"every": 4}})
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.SuccessiveHalvingPruner(4, 2))
    for score in (0.9, 0.8, 0.7):  # better trials before: a rung at step 4 and at step 8
        t = study.ask()
        for step in (4, 8):
            t.report(score, step)
            t.should_prune()  # each rung's value is kept when the trial asks the pruner there
        study.tell(t, score)
    worst = TrialPruning(study.ask(), sweep, spec)
    worst.on_step(4, {"eval/reward": 0.1})
    assert worst.should_stop(4, {}).startswith("pruned: eval/reward=0.1 at step 4 is worse")
    last = TrialPruning(study.ask(), sweep, spec)
    last.on_step(8, {"eval/reward": 0.1})
    assert last.trial.should_prune()  # the pruner would ...
    assert last.should_stop(8, {}) is None  # ... but step 8 of 8 is the end of the trial


def test_importances_wait_for_enough_completed_trials_and_say_how_many(tmp_path):
    few = summarize(relative_study([0.4, 0.5, 0.6]), sweep_of(tmp_path))
    assert few.importances["n_complete"] == 3 and f"from {MIN_IMPORTANCE_TRIALS} on" in few.importances["skipped"]
    rates = [0.3 + 0.05 * i for i in range(MIN_IMPORTANCE_TRIALS)]
    enough = summarize(relative_study(rates), sweep_of(tmp_path))
    assert enough.importances["n_complete"] == MIN_IMPORTANCE_TRIALS
    assert set(enough.importances["eval/reward"]) == {"optim.learning_rate", "lora.r"}


def test_the_plots_draw_every_trial_and_no_second_importance_ranking(tmp_path):
    sweep = sweep_of(tmp_path)
    study = relative_study([0.4, 0.6, 0.7] + [0.5] * MIN_IMPORTANCE_TRIALS)
    plots, skipped = plot_study(study, sweep, tmp_path / "plots")
    assert {p.stem for p in plots} == {"optimization_history", "parallel_coordinate", "slice", "intermediate_values"}
    assert skipped == {}


# ── the sweep file ─────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("field", ["eval.temperature", "data.num_eval_prompts"])
def test_a_space_over_what_the_baseline_shares_is_refused(tmp_path, field):
    with pytest.raises(SweepError, match=f"'space.{field}': a sweep reads every trial against one baseline"):
        sweep_of(tmp_path, space={**SPACE, field: {"type": "categorical", "choices": [1, 2]}})


def test_set_overrides_the_base_spec_and_an_unknown_key_is_refused(tmp_path):
    base = {"name": "rel", "model": {"name_or_path": "/m"}, "project_dir": str(tmp_path)}
    sweep = load_sweep({"base": base, "space": SPACE}, ["optim.steps=12"])
    assert sweep.base["optim"]["steps"] == 12
    with pytest.raises(SweepError, match="--set optim.stepz: 'optim.stepz' is not a field"):
        load_sweep({"base": base, "space": SPACE}, ["optim.stepz=12"])


def test_set_wins_over_the_files_overrides_and_a_searched_field_is_refused(tmp_path):
    """`ballast pbt examples/pbt.yaml --set optim.steps=10` trained 40 steps: the file's overrides set optim.steps
    and were applied over the base spec the --set had edited, and nothing said so."""
    from sweeps.space import trial_spec

    base = {"name": "rel", "model": {"name_or_path": "/m"}, "project_dir": str(tmp_path)}
    data = {"base": base, "space": SPACE, "overrides": {"optim.steps": 40, "grpo.num_generations": 4}}
    sweep = load_sweep(data, ["optim.steps=10"])
    assert sweep.overrides == {"optim.steps": 10, "grpo.num_generations": 4}
    assert trial_spec(sweep, {}).optim.steps == 10
    searched = next(iter(SPACE))
    with pytest.raises(SweepError, match=f"--set {searched}: sweep searches {searched} \\(field 'space'\\)"):
        load_sweep(data, [f"{searched}=0.5"])
    promoted = load_sweep(data, [f"{searched}=0.5"], searching=False)  # --promote: the one run takes it
    file_field = "^--set concurrent_trials: 'concurrent_trials' is a field of the sweep file"
    with pytest.raises(SweepError, match=file_field):
        load_sweep(data, ["concurrent_trials=2"])  # it was 'not a field of the experiment spec' and no more
    assert promoted.base[searched.split(".")[0]][searched.split(".")[1]] == 0.5


def test_a_spent_timeout_starts_no_trial(tmp_path):
    from sweeps.study import optimize

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'o.db'}", study_name="t")
    study.set_user_attr("ballast.n_trials", 3)
    report = optimize(study, lambda t: 1.0, timeout_s=0.0)
    assert report.timed_out and report.ran == [] and study.trials == []


def test_successive_halving_prunes_on_the_held_out_score_when_trials_evaluate(tmp_path):
    from sweeps.pruning import report_metric
    from sweeps.space import trial_spec
    from sweeps.study import make_pruner

    sweep = sweep_of(
        tmp_path,
        overrides={"eval.every": 4},
        pruner={"type": "successive_halving", "min_resource": 4, "reduction_factor": 2},
    )
    pruner = make_pruner(sweep)
    assert isinstance(pruner, optuna.pruners.SuccessiveHalvingPruner)
    spec = trial_spec(sweep, {"optim.learning_rate": 1e-3, "lora.r": 8})
    assert report_metric(sweep, spec) == "eval/reward"
    assert report_metric(sweep_of(tmp_path), trial_spec(sweep_of(tmp_path), {})) == "reward"  # no in-training eval


def test_a_minimised_length_objective_reports_the_training_length_to_the_pruner_not_the_reward(tmp_path):
    """The pruner compares reported values in the objective's direction: for eval/mean_length (minimise) the training
    reward, better when higher, would stop the trials paid the most."""
    from sweeps.pruning import report_metric
    from sweeps.space import trial_spec

    sweep = sweep_of(tmp_path, objectives=[{"metric": "eval/mean_length", "direction": "minimize"}])
    assert report_metric(sweep, trial_spec(sweep, {})) == "completions/mean_length"


# ── the page ───────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.integration
def test_the_summary_page_leads_with_the_verdict_and_shows_the_baseline(tmp_path):
    from tests.test_pages import CHROMIUM, FLAGS, Page, assert_clean

    sweep = sweep_of(tmp_path)
    study = relative_study([0.32, 0.75, 0.5], collapsed=2)
    s = summarize(study, sweep)
    s.plots, s.plots_skipped = plot_study(study, sweep, tmp_path / "plots")
    s.storage, s.n_trials, s.done, s.dashboard = "sqlite:///o.db", 6, True, "optuna-dashboard sqlite:///o.db"
    s.write(tmp_path)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = Page(browser, Path(s.html))
        assert_clean(page)
        banner = page.page.inner_text(".banner")
        assert banner == s.verdict_line() and banner.startswith("best: trial 1, eval/reward ")
        assert s.baseline_line() in page.text and "saved 14 of 48 trial-steps" in page.text
        trials = next(i for i in range(page.page.locator("table").count()) if "why it stopped" in page.headers(i))
        assert "gain over the base model ± 95 %" in page.headers(trials)
        assert "Not computed: 3 completed trials" in page.text
        assert set(page.images()) == {"optimization_history", "parallel_coordinate", "slice", "intermediate_values"}
        browser.close()
