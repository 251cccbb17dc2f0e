"""Select on one set, judge on another (DESIGN.md, fourth round): a sweep's held-out prompts are dealt, by a seeded
rule, into selection prompts the trials are scored on and confirmation prompts no trial decision reads; a held-out
set too small to split is not split and says so; a confirmation file of the user's own is taken. Held-out evals may
sample several completions a prompt, and their standard error stays one over prompts. Real tiny model for the eval."""

import json

import pytest

from sweeps.space import SweepError, base_spec, baseline_spec, load_sweep, sweep_split, trial_spec
from sweeps.split import Split, plan_split, selection_score
from tasks.spec import SpecError, validate_spec
from tests.conftest import tiny_spec
from trainer.config import EvalConfig, HeldOutSplit, split_indices
from trainer.data import load_datasets

SPACE = {"grpo.beta": {"type": "float", "low": 0.01, "high": 0.1}}


def sweep_file(tmp_path, eval_prompts: int = 96, **fields):
    base = tiny_spec("/models/not-loaded-here", project_dir=str(tmp_path), data={"num_eval_prompts": eval_prompts})
    return load_sweep(
        {"study": "split", "base": base, "space": SPACE, "objectives": [{"metric": "eval/accuracy"}], **fields}
    )


def test_the_split_is_seeded_disjoint_and_covers_the_held_out_set_in_order():
    selection, confirmation = split_indices(100, seed=3, confirm_share=0.25)
    assert len(confirmation) == 25 and len(selection) == 75
    assert sorted(selection + confirmation) == list(range(100))
    assert selection == sorted(selection) and confirmation == sorted(confirmation)
    assert split_indices(100, seed=3, confirm_share=0.25) == (selection, confirmation)
    assert split_indices(100, seed=4, confirm_share=0.25)[1] != confirmation


def test_a_sweeps_trials_score_the_selection_prompts_and_its_baseline_every_prompt(tmp_path):
    sweep = sweep_file(tmp_path, eval_prompts=96, seed=7)
    split = sweep_split(sweep)
    assert (split.kind, split.n_held_out, split.n_selection, split.n_confirmation) == ("split", 96, 48, 48)
    trial = trial_spec(sweep, {"grpo.beta": 0.05})
    assert trial.eval.split == HeldOutSplit(part="selection", confirm_share=0.5, seed=7)
    assert "split" not in (baseline_spec(sweep).get("eval") or {})
    held_out = load_datasets(trial.data)[1]
    from trainer.evaluate import held_out_part

    assert held_out_part(held_out, trial.eval.split) == [held_out[i] for i in split.selection_rows]
    confirm = HeldOutSplit(part="confirmation", confirm_share=0.5, seed=7)
    assert held_out_part(held_out, confirm) == [held_out[i] for i in split.confirmation_rows]


def test_a_held_out_set_too_small_to_split_keeps_every_prompt_for_selection_and_says_why(tmp_path):
    sweep = sweep_file(tmp_path, eval_prompts=40)
    split = sweep_split(sweep)
    assert split.kind == "none" and split.n_selection == 40 and not split.confirms
    assert "40 prompts and each part needs at least 32 (confirm.min_prompts)" in split.describe()
    assert "split" not in base_spec(sweep)["eval"]


def test_an_objective_that_is_not_a_held_out_score_has_nothing_to_confirm(tmp_path):
    sweep = sweep_file(tmp_path, objectives=[{"metric": "stability", "direction": "minimize"}])
    assert sweep_split(sweep).kind == "none"
    assert "the objective stability is not a held-out score" in sweep_split(sweep).reason


def test_a_confirmation_file_of_ones_own_is_read_relative_to_the_sweep_file(tmp_path):
    rows = [{"prompt": f"{a}+{a}", "answer": str(2 * a)} for a in range(10, 50)]
    (tmp_path / "confirm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = tiny_spec("/models/not-loaded-here", project_dir=str(tmp_path))
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps({"base": base, "space": SPACE, "confirm": {"data": "confirm.jsonl"}}))
    sweep = load_sweep(path)
    split = sweep_split(sweep)
    assert (split.kind, split.n_confirmation, split.confirmation_file) == ("file", 40, str(tmp_path / "confirm.jsonl"))
    assert split.selection_rows == list(range(8))  # every held-out prompt selects
    assert "split" not in base_spec(sweep)["eval"]


def test_a_missing_confirmation_file_is_refused_naming_the_field(tmp_path):
    base = tiny_spec("/models/not-loaded-here", project_dir=str(tmp_path))
    with pytest.raises(SweepError, match="confirm.data: data file 'nowhere.jsonl'"):
        load_sweep({"base": base, "space": SPACE, "confirm": {"data": "nowhere.jsonl"}})


def test_the_sweep_file_may_not_set_eval_split_itself(tmp_path):
    base = tiny_spec("/models/not-loaded-here", project_dir=str(tmp_path))
    with pytest.raises(SweepError, match="'eval.split' is the sweep's to set"):
        load_sweep({"base": base, "space": SPACE, "overrides": {"eval.split.seed": 3}})


def test_seeds_and_top_k_may_change_between_runs_of_a_study_but_the_split_may_not(tmp_path):
    a = sweep_file(tmp_path, confirm={"seeds": 1, "top_k": 3})
    assert a.definition() == sweep_file(tmp_path, confirm={"seeds": 3, "top_k": 2}).definition()
    assert a.definition() != sweep_file(tmp_path, confirm={"share": 0.3}).definition()


def test_the_selection_score_reads_a_whole_held_out_list_on_its_selection_rows():
    split = plan_split(6, seed=0, share=0.5, min_prompts=1)
    whole = [float(i) for i in range(6)]
    assert selection_score(whole, split, whole_held_out=True) == sum(whole[i] for i in split.selection_rows) / 3
    assert selection_score([1.0, 0.0], split) == 0.5
    assert Split.from_json(split.to_json()) == split


def test_several_samples_a_prompt_need_sampling():
    with pytest.raises(ValueError, match="samples_per_prompt: 4 with temperature 0"):
        EvalConfig(samples_per_prompt=4)
    with pytest.raises(SpecError, match="eval.temperature above 0"):
        validate_spec(tiny_spec("/models/x", eval={"samples_per_prompt": 2}))


def test_a_held_out_score_with_several_samples_a_prompt_is_their_mean_with_a_standard_error_over_prompts(tiny_model):
    from tasks.spec import validate_spec
    from trainer.evaluate import score_held_out, stderr
    from trainer.model import load_policy
    from trainer.rewards import RewardComputer

    spec = validate_spec(tiny_spec(tiny_model, eval={"temperature": 1.0, "samples_per_prompt": 4}))
    model, tokenizer = load_policy(spec.model, spec.lora, trainable=False)
    held_out = load_datasets(spec.data)[1]
    metrics, per_prompt, rows = score_held_out(model, tokenizer, held_out, spec.eval, RewardComputer(spec.rewards))
    accuracy = per_prompt["accuracy"]
    assert len(accuracy) == len(held_out) == 8  # one score a prompt: pairs with a baseline's
    assert all(a * 4 == round(a * 4) for a in accuracy)  # the mean of 4 right-or-wrong samples
    assert len({a for a in accuracy}) > 1  # sampled: not every prompt alike
    assert metrics["eval/accuracy"] == pytest.approx(sum(accuracy) / 8)
    assert metrics["eval/accuracy_stderr"] == pytest.approx(stderr(accuracy))  # over the 8 prompts, not 32 samples
