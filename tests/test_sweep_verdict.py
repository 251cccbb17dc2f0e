"""What the sweep's verdict says, and when a stored one is not the verdict: the lines name the trial each claim is
about and the reason it holds or not (the runner-up claimed because the winner missed its interval, not because it
missed a seed); a confirmation stored as it goes (unfinished) or made before more trials ended is not shown, logged
or promoted as the study's answer; the summary's base-model score is the one each gain is paired with."""

import pytest

from flows.promote import pick_trial
from sweeps.baseline import Gain
from sweeps.confirmation import CONFIRMATION_ATTR, Candidate, Confirmation, load_confirmation, verdict_lines
from sweeps.pruning import verdict
from sweeps.report import summarize
from sweeps.space import SweepError
from tasks.results import PipelineResult
from tests.test_sweep_statistics import simulated_study
from trainer.config import HealthConfig

Z = 2.39  # simultaneous over 3


def gain(g: float, se: float, z: float = Z) -> dict:
    return Gain("eval/accuracy", 0.5 + g, 0.5, g, se, "maximize", z, 64).to_dict()


def candidate(number: int, judged: dict, seeds: list[float] = ()) -> Candidate:
    rows = [{"seed": i + 1, "status": "finished", "run_id": None, "steps": 4, "gain": gain(s, 0.05)} for i, s in
            enumerate(seeds)]  # fmt: skip
    return Candidate(number, {"lora.r": number}, gain(judged["gain"] + 0.02, 0.05, 1.96), judged, rows)


def confirmation(candidates: list[Candidate], winner: int, runner_up: int, claimed: int | None) -> Confirmation:
    return Confirmation(
        "eval/accuracy", "maximize", "confirmation", 64, 64, 3, Z, 3, {"kind": "split"}, candidates, winner,
        runner_up, claimed, baseline=0.5,
    )  # fmt: skip


def test_a_runner_up_claimed_because_the_winner_missed_its_interval_is_said_so_with_its_own_seeds():
    # the winner's larger gain has the wider interval: +0.20 ± 0.24 misses; the runner-up's +0.15 ± 0.12 clears
    w, r = candidate(4, gain(0.20, 0.10)), candidate(7, gain(0.15, 0.05), seeds=[0.16, 0.14])
    lines = verdict_lines(confirmation([w, r, candidate(1, gain(0.01, 0.05))], winner=4, runner_up=7, claimed=7))
    assert lines[0].startswith("best on confirmation: trial 4,")
    assert "seeds: not run for the winner, trial 4, which did not clear its interval" in lines
    assert any(line.startswith("seeds: trial 7 ") for line in lines)  # the claimed trial's spread is shown
    assert "trial 7 beats the base model on all 3 seeds (the runner-up: the winner, trial 4, did not clear its " \
        "interval)" in lines  # fmt: skip


def test_a_runner_up_claimed_because_the_winner_missed_a_seed_is_said_so():
    w = candidate(4, gain(0.20, 0.05), seeds=[0.21, -0.02])
    r = candidate(7, gain(0.15, 0.05), seeds=[0.16, 0.14])
    lines = verdict_lines(confirmation([w, r], winner=4, runner_up=7, claimed=7))
    assert [line.split(" ")[2] for line in lines if line.startswith("seeds: trial")] == ["4", "7"]  # both spreads
    assert "trial 7 beats the base model on all 3 seeds (the runner-up: the winner, trial 4, did not hold on every " \
        "seed)" in lines  # fmt: skip


def test_no_claim_names_why_the_winner_and_the_runner_up_each_fell_short():
    w, r = candidate(4, gain(0.20, 0.10)), candidate(7, gain(0.15, 0.05), seeds=[0.16, -0.03])
    lines = verdict_lines(confirmation([w, r], winner=4, runner_up=7, claimed=None))
    assert (
        "no trial beat the base model: the best, trial 4, did not clear its interval; the runner-up, trial 7, did "
        "not hold on every seed"
    ) in lines


def one_more_trial(study, sweep) -> None:
    trial = study.ask()
    trial.suggest_categorical("lora.r", list(range(1, 13)))
    result = PipelineResult("run", "out", "finished", eval={"eval/accuracy": 0.3})
    result.eval_per_prompt = {"accuracy": [0.3] * 128}
    study.tell(trial, verdict(trial, result, sweep, HealthConfig()))


@pytest.fixture
def confirmed():
    """A simulated sweep (tests/test_sweep_statistics.py) whose one good setting is claimed."""
    sweep, study, c = simulated_study(3, [0.0] * 11 + [1.5])
    assert c.complete and c.claimed == 11 and c.stale_reason(study) is None
    return sweep, study


def test_a_confirmation_that_has_not_finished_is_neither_the_summarys_verdict_nor_promoted(confirmed):
    sweep, study = confirmed
    c = load_confirmation(study)
    c.complete, c.claimed, c.candidates[0].seeds = False, None, []  # as stored after scoring, before the seeds
    study.set_user_attr(CONFIRMATION_ATTR, c.to_json())
    s = summarize(study, sweep)
    assert s.confirmation is None and s.confirmation_note.startswith("the confirmation has not finished")
    assert "no confirmed verdict: the confirmation has not finished" in "\n".join(s.lines())
    with pytest.raises(SweepError, match="--promote: the confirmation has not finished"):
        pick_trial(study, "confirmed")


def test_a_confirmation_made_before_more_trials_ended_is_out_of_date(confirmed):
    sweep, study = confirmed
    assert summarize(study, sweep).confirmed().claimed == 11
    one_more_trial(study, sweep)  # `--trials` raised and the search went on
    s = summarize(study, sweep)
    assert s.confirmation is None
    assert s.verdict_line().startswith("not confirmed; best on the selection prompts: trial ")
    assert s.confirmation_note == (
        "the confirmation was made on the first 12 trials and 13 are done now; it is made again when the search ends"
    )
    with pytest.raises(SweepError, match="made on the first 12 trials"):
        pick_trial(study, "confirmed")
    assert pick_trial(study, "11") == 11  # a trial named is promoted as asked


def test_the_summarys_base_model_score_is_the_one_each_gain_is_paired_with(confirmed):
    sweep, study = confirmed
    s = summarize(study, sweep)
    for row in s.trials:
        assert row["score"] - row["gain"] == pytest.approx(s.baseline_score())
    assert s.baseline["n_prompts"] == 256 and s.baseline["selection"][1] == 128


def test_the_seeds_line_gives_the_widest_of_the_seeds_own_intervals():
    """Each seed's gain has its own ± (its own run's scores): the line gave the judged gain's for all of them, 4x
    narrower than a seed's in a real sweep."""
    judged = gain(0.15, 0.01)  # ± 0.024
    r = candidate(7, judged, seeds=[0.16, 0.14])  # each seed ± 2.39 x 0.05 = 0.12
    lines = verdict_lines(confirmation([candidate(4, gain(0.20, 0.10)), r], winner=4, runner_up=7, claimed=7))
    (line,) = [line for line in lines if line.startswith("seeds: trial 7 ")]
    assert line.endswith("each seed ± up to 0.12"), line
