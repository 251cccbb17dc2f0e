"""The population's decisions (trainer/pbt.py): who copies whom, and with which hyperparameters it goes on."""

import math

from trainer.pbt import Knob, Policy, decide, explore, initial_hparams, quantile_size, rank

KNOBS = (
    Knob("grpo.beta", 1e-3, 0.2, log=True),
    Knob("optim.learning_rate", 3e-4, 1e-2, log=True),
    Knob("rollout.repetition_penalty", 1.0, 1.2),
)


def policy(**kw) -> Policy:
    return Policy(knobs=KNOBS, fixed={"lora.r": [4, 8, 16]}, seed=3, **kw)


def population(n: int = 8) -> dict[int, dict]:
    return dict(enumerate(initial_hparams(policy(), n)))


def test_initial_hparams_are_drawn_inside_the_space_and_are_seeded():
    first, again = initial_hparams(policy(), 8), initial_hparams(policy(), 8)
    assert first == again
    assert len({round(hp["grpo.beta"], 12) for hp in first}) == 8  # members start apart
    for hp in first:
        for k in KNOBS:
            assert k.low <= hp[k.name] <= k.high
        assert hp["lora.r"] in (4, 8, 16)


def test_the_bottom_quarter_copies_a_member_of_the_top_quarter():
    hp = population(8)
    scores = {m: float(m) for m in hp}  # member 7 best, 0 worst
    out = decide(policy(), 10, hp, scores)
    assert sorted(r.member for r in out) == [0, 1]
    assert all(r.source in (6, 7) and r.reason == "exploit" and r.step == 10 for r in out)


def test_a_copy_perturbs_each_knob_by_0_8_or_1_25_or_resamples_it_and_keeps_its_sources_rank():
    hp = population(8)
    for step in range(1, 40):
        for r in decide(policy(), step, hp, {m: float(m) for m in hp}):
            assert r.hparams["lora.r"] == hp[r.source]["lora.r"]
            for k in KNOBS:
                how, got, was = r.explored[k.name], r.hparams[k.name], hp[r.source][k.name]
                assert how in ("x0.8", "x1.25", "resample")
                assert k.low <= got <= k.high
                if how != "resample":
                    assert math.isclose(got, k.clip(was * float(how[1:])))


def test_resample_probability_one_always_resamples_and_zero_never_does():
    import random

    always = explore(policy(resample_probability=1.0), population()[0], random.Random(0))[1]
    never = explore(policy(resample_probability=0.0), population()[0], random.Random(0))[1]
    assert set(always.values()) == {"resample"}
    assert "resample" not in never.values()


def test_the_same_scores_give_the_same_decisions_and_another_step_may_differ():
    hp, scores = population(8), {m: float(m % 3) for m in range(8)}
    assert decide(policy(), 5, hp, scores) == decide(policy(), 5, hp, scores)
    assert any(decide(policy(), s, hp, scores) != decide(policy(), 5, hp, scores) for s in range(6, 12))


def test_a_collapsed_member_is_replaced_at_once_from_the_last_rankings_top_between_rankings():
    hp = population(8)
    out = decide(policy(), 7, hp, {m: float(m) for m in hp}, collapsed={3}, ready=False)
    assert [(r.member, r.reason) for r in out] == [(3, "collapsed")]
    assert out[0].source in (6, 7)


def test_before_the_first_ranking_a_collapsed_member_copies_a_healthy_one():
    hp = population(4)
    out = decide(policy(), 2, hp, None, collapsed={1}, ready=False)
    assert [r.member for r in out] == [1] and out[0].source in (0, 2, 3)


def test_a_collapsed_member_is_not_a_source_even_with_the_best_score():
    hp = population(8)
    out = decide(policy(), 10, hp, {m: float(m) for m in hp}, collapsed={7})
    assert {r.member for r in out} == {7, 0, 1}
    assert all(r.source != 7 for r in out)


def test_minimising_ranks_the_lowest_score_first():
    assert rank(policy(maximize=False), {0: 2.0, 1: 1.0, 2: 3.0}) == [1, 0, 2]
    assert rank(policy(), {0: 2.0, 1: float("nan"), 2: 3.0}) == [2, 0, 1]


def test_the_quantile_is_at_most_half_the_population_and_one_member_is_never_replaced():
    assert quantile_size(policy(quantile=0.5), 5) == 2
    assert quantile_size(policy(), 8) == 2
    assert quantile_size(policy(), 1) == 0
    assert decide(policy(), 4, population(1), {0: 1.0}) == []


# ── what a person reads: the confirmed verdict and the progress lines ──────────────────────────────


def test_the_confirmed_winner_beats_the_base_model_only_when_its_paired_interval_clears_zero():
    """The verdict read 'gain +0.325' with no interval, and the page's banner was green for any gain above zero."""
    from tasks.population import Confirmed

    clear = Confirmed(0.931, 0.606, 64, "confirmation", "eval/reward", 0.12)
    assert clear.beats
    assert clear.line() == (
        "confirmed on 64 confirmation prompts: winner eval/reward 0.931 vs 0.606 for the base model, +0.33 ± 0.12: "
        "beats the base model (± is a 95 % interval, paired over the prompts)"
    )
    noise = Confirmed(0.65, 0.606, 64, "confirmation", "eval/reward", 0.12)
    assert not noise.beats and noise.line().endswith(
        "+0.044 ± 0.12: does not beat the base model beyond noise (± is a 95 % interval, paired over the prompts)"
    )
    shorter = Confirmed(40.0, 60.0, 8, "confirm.data", "eval/mean_length", 5.0, "minimize")
    assert shorter.beats and "confirmed on 8 confirm.data prompts" in shorter.line()
    optimistic = Confirmed(0.9, 0.5, 6, "selection", "eval/reward", 0.1)
    assert "6 selection prompts (nothing was kept back: the prompts that ranked it)" in optimistic.line()
    unpaired = Confirmed(0.9, 0.5, 6, "confirmation", "eval/score", None)
    assert not unpaired.beats and "no interval, no claim" in unpaired.line()


def test_a_population_says_each_ranking_and_who_copied_whom_as_it_trains(capsys):
    """`ballast pbt` said nothing until its end. Piped (here), a line at each ranking step and each collapse."""
    from flows.pbt import PopulationProgress
    from trainer.population import Round

    progress = PopulationProgress()
    rewards = {0: 0.5, 1: 0.7}
    progress(Round(1, 4, rewards, None, {}, [], {}))  # no ranking yet: nothing in a log
    copy = {"member": 0, "source": 1, "reason": "exploit", "explored": {"grpo.beta": "x1.25"}}
    progress(Round(2, 4, rewards, [1, 0], {0: 0.4, 1: 0.8}, [copy], {}))
    progress(Round(3, 4, rewards, None, {0: 0.4, 1: 0.8}, [], {1: "collapsed: kl=4.2 > 1"}))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("  step 2/4, reward 0.600 mean, 0.700 best, 1 replaced, ETA ")
    assert lines[0].endswith("; ranked: member-01 0.800, member-00 0.400")
    assert lines[1] == "    member-00 <- copy of member-01 (bottom of the ranking); grpo.beta x1.25"
    assert lines[2] == "  step 3: member-01 collapsed (kl=4.2 > 1)"
    assert len(lines) == 3
