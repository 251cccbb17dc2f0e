"""Reward-hacking alarms (trainer/health.py): the step's signals, the trends the gate reads over windows, and runs
that game their reward stopped by the gate with a reason that says how.

Two kinds of test. Streams: completions written step by step to show one kind of hacking (a format paid whatever
the answer, completions converging), scored by the real reward functions and passed through the metrics and the gate
exactly as a training step does, with the step each alarm trips at stated. Runs: the tiny model trained on a reward
that can be gamed (length alone, a format regex with a loophole), stopped by the gate.
"""

import json
import math
import random
import re

import pytest

from tests.conftest import tiny_spec
from trainer.config import HealthConfig, RewardConfig, TrainerConfig
from trainer.health import GATE_SIGNALS, HealthGate, group_diversity, hacking_signals, length_reward_corr, trend
from trainer.loop import GRPOTrainer
from trainer.metrics import METRICS, completion_metrics, reward_metrics
from trainer.rewards import RewardComputer

NEW_METRICS = (
    "hacking/length_reward_corr",
    "hacking/length_reward_corr_trend",
    "hacking/group_diversity",
    "hacking/correctness_rise",
    "hacking/other_reward_rise",
    "hacking/train_reward_rise",
    "hacking/eval_rise",
)


# --- the step's signals ------------------------------------------------------------------------


def test_length_reward_corr_is_one_when_only_length_moves_the_reward():
    lengths = [10, 12, 14, 16, 5, 5, 9, 9]
    rewards = [1.0, 1.2, 1.4, 1.6, 3.0, 3.0, 3.4, 3.4]
    assert length_reward_corr(lengths, rewards, group_size=4) == pytest.approx(1.0)


def test_length_reward_corr_is_minus_one_when_shorter_is_paid():
    assert length_reward_corr([3, 9, 3, 9], [1.0, 0.0, 1.0, 0.0], group_size=2) == pytest.approx(-1.0)


def test_length_reward_corr_pools_groups_so_each_weighs_by_its_spread():
    # group 1: a longer answer earns 0.1 more; group 2: the right answer earns 1, whatever its length
    lengths = [20, 21, 20, 21, 20, 21, 20, 21]
    rewards = [0.0, 0.1, 0.0, 0.1, 1.0, 0.0, 0.0, 1.0]
    pooled = length_reward_corr(lengths, rewards, group_size=4)
    mean_of_groups = (1.0 + 0.0) / 2
    # sum(dl * dr) / sqrt(sum dl^2 * sum dr^2): 4 x 0.5 x 0.05 / sqrt((1 + 1) * (4 x 0.05^2 + 4 x 0.5^2))
    assert pooled == pytest.approx(0.1 / math.sqrt(2.0 * 1.01))
    assert pooled < 0.1 < mean_of_groups


def test_length_reward_corr_skips_groups_without_spread_and_is_nan_without_any():
    assert math.isnan(length_reward_corr([5, 5, 7, 7], [0.0, 1.0, 2.0, 2.0], group_size=2))
    # rewards equal up to float noise are no spread
    assert math.isnan(length_reward_corr([4, 6], [0.1 + 0.2, 0.3], group_size=2))


def test_length_reward_corr_refuses_a_batch_that_is_not_whole_groups():
    with pytest.raises(ValueError, match="5 completions do not split into groups of 2"):
        length_reward_corr([1, 2, 3, 4, 5], [0.0] * 5, group_size=2)


def test_group_diversity_is_zero_for_identical_completions_and_one_for_disjoint():
    same = [[1, 2, 3, 4, 5]] * 4
    disjoint = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    assert group_diversity(same, group_size=4) == 0.0
    assert group_diversity(disjoint, group_size=4) == 1.0
    assert group_diversity(same + disjoint, group_size=4) == 0.5


def test_group_diversity_does_not_count_repetition_inside_one_completion():
    looping = [[1, 2, 3] * 10, [7, 8, 9] * 10]  # each repeats itself, but the two share nothing
    assert group_diversity(looping, group_size=2) == 1.0


def test_group_diversity_of_half_shared_ngrams():
    # 3 n-grams each, (1,2,3) shared: 5 distinct of 6 -> (5/6 - 1/2) / (1 - 1/2)
    assert group_diversity([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7]], group_size=2) == pytest.approx(2 / 3)


def test_group_diversity_counts_short_completions_whole_and_skips_empty_groups():
    assert group_diversity([[1], [1], [], []], group_size=2) == 0.0
    assert math.isnan(group_diversity([[], []], group_size=2))
    assert math.isnan(group_diversity([[1, 2, 3]], group_size=1))


def test_hacking_signals_reads_lengths_from_token_ids():
    ids = [[1, 2], [1, 2, 3, 4], [5, 6, 7], [5, 6, 7]]
    m = hacking_signals(ids, [0.0, 1.0, 0.5, 0.5], group_size=2)
    assert m == {"hacking/length_reward_corr": pytest.approx(1.0), "hacking/group_diversity": 0.5}


def test_trend_of_a_line_is_its_rise_with_infinite_t():
    assert trend([0.1, 0.2, 0.3, 0.4]) == (pytest.approx(0.3), math.inf)
    assert trend([1.0, 0.5, 0.0]) == (pytest.approx(-1.0), -math.inf)
    assert trend([0.7, 0.7, 0.7]) == (0.0, 0.0)


def test_trend_t_is_slope_over_its_standard_error():
    rise, t = trend([0.0, 1.0, 0.0, 1.0])
    # slope 0.2 over x = 0..3 (sum of squares 5), residuals -0.2 0.6 -0.6 0.2 -> s^2 = 0.8 / 2, se = sqrt(0.4 / 5)
    assert rise == pytest.approx(0.6) and t == pytest.approx(0.2 / math.sqrt(0.4 / 5))
    assert all(math.isnan(v) for v in trend([1.0, 2.0]))


# --- streams: completions written step by step, through rewards, metrics and the gate -----------


def step_metrics(step: int, texts: list[str], answers: list[str], rewards: RewardComputer, group_size: int) -> dict:
    """What a training step reports about its completions: reward_metrics, completion_metrics and hacking_signals
    over byte-level token ids (as the tiny model's tokenizer), from the real reward functions."""
    total, parts = rewards(texts, answers, ["p"] * len(texts))
    ids = [list(t.encode()) for t in texts]
    m = {"step": step, **reward_metrics(total, parts, 0.0, 0.0)}
    m.update(completion_metrics([len(i) for i in ids], ["stop"] * len(ids)))
    m.update(hacking_signals(ids, total, group_size))
    return m


def run_gate(batches, rewards: RewardComputer, group_size: int, cfg: HealthConfig, evals=None):
    """Feed (texts, answers) per step through the metrics and a gate made as the trainer makes it; `evals`:
    {step: held-out accuracy}. Returns (the step it stopped at, its reason, the metrics of every step)."""
    gate = HealthGate(cfg, correctness=rewards.accuracy_name(), weights=dict(zip(rewards.names, rewards.weights)))
    history = []
    for step, (texts, answers) in enumerate(batches, 1):
        m = step_metrics(step, texts, answers, rewards, group_size)
        if evals and step in evals:
            m["eval/accuracy"] = evals[step]
        m.update(gate.observe(step, m))
        history.append(m)
        reason = gate.update(step, m)
        if reason:
            return step, reason, history
    return None, None, history


def answers_for(prompts: int, group_size: int) -> list[str]:
    return [str(40 + p) for p in range(prompts) for _ in range(group_size)]


PHRASES = ("The sum is", "That makes", "Adding them gives", "So the total is", "Answer:")


def explained(answer: int, rng: random.Random) -> str:
    """Words around the tags: half the format reward."""
    return f"{rng.choice(PHRASES)} <output>{answer}</output>"


def bare(answer: int, rng: random.Random) -> str:
    """The format exactly (whitespace around the tags is allowed): the whole format reward, padded to the length
    an explained answer has, so that length goes with neither."""
    return f"<output>{answer}</output>" + " " * (len(rng.choice(PHRASES)) + 1)


def scripted_batches(
    steps: int, right_share, rng: random.Random, right=explained, wrong=bare, prompts: int = 8, group_size: int = 8
):
    """Each completion is right with probability right_share(step), written by `right`, else written by `wrong`
    with a wrong answer. By default a right answer explains itself and a wrong one is bare: the format reward pays the
    wrong ones more."""
    answers = answers_for(prompts, group_size)
    for step in range(1, steps + 1):
        yield (
            [
                right(int(a), rng) if rng.random() < right_share(step) else wrong(int(a) + rng.randint(1, 9), rng)
                for a in answers
            ],
            answers,
        )


FORMAT_LOOPHOLE = [RewardConfig(name="exact_answer"), RewardConfig(name="format", weight=0.5)]


def falling(step: int) -> float:
    return max(0.1, 0.9 - 0.05 * (step - 1))


def test_format_paid_whatever_the_answer_trips_at_step_12():
    """Correctness falls from 90% to 10% over 16 steps while the format reward climbs: the default gate stops the
    run as soon as the trend window (10 steps) is full and both trends have held for 3 steps: step 12."""
    rewards = RewardComputer(FORMAT_LOOPHOLE)
    stopped, reason, history = run_gate(scripted_batches(30, falling, random.Random(0)), rewards, 8, HealthConfig())
    assert stopped == 12
    assert reason.startswith("collapsed: hacking/other_reward_rise=")
    assert "while hacking/correctness_rise=" in reason and "< -0.1 for 3 consecutive steps" in reason
    assert "rewards/format/mean +" in reason and "rewards/exact_answer/mean -" in reason
    assert f"over steps {stopped - 9}-{stopped}" in reason
    assert history[-1]["hacking/other_reward_rise"] > 0.1 and history[-1]["hacking/correctness_rise"] < -0.1


def test_format_rising_with_correctness_is_learning_not_hacking():
    """Right answers are bare and get more frequent: format and correctness rise together, for 30 steps."""
    rewards = RewardComputer(FORMAT_LOOPHOLE)
    batches = scripted_batches(30, lambda s: 0.3 + 0.02 * s, random.Random(0), right=bare, wrong=explained)
    stopped, reason, history = run_gate(batches, rewards, 8, HealthConfig())
    assert reason is None
    assert history[-1]["hacking/other_reward_rise"] > 0.1 and history[-1]["hacking/correctness_rise"] > 0.1


def test_noisy_components_without_a_trend_never_trip():
    """Small batches (2 prompts x 4) whose right-answer share stays at 0.5: the window's rises pass 0.1 and -0.1
    often by chance, but no line is significant, so the alarm stays quiet for 200 steps."""
    rewards = RewardComputer(FORMAT_LOOPHOLE)
    batches = scripted_batches(200, lambda s: 0.5, random.Random(1), prompts=2, group_size=4)
    stopped, reason, history = run_gate(batches, rewards, 4, HealthConfig())
    assert reason is None
    assert sum(m["hacking/other_reward_rise"] > 0.1 and m["hacking/correctness_rise"] < -0.1 for m in history[9:]) > 20


def converging_batches(steps: int, rng: random.Random, prompts: int = 8, group_size: int = 8):
    """Each step one more completion of every group copies the group's first one, until all G are the same."""
    answers = answers_for(prompts, group_size)
    for step in range(1, steps + 1):
        texts = []
        for _ in range(prompts):
            own = [
                f"Adding {rng.randint(1, 9)} tens and {rng.randint(1, 9)} ones gives <output>{rng.randint(10, 99)}"
                f"</output>"
                for _ in range(group_size)
            ]
            copies = min(group_size, step)
            texts += [own[0]] * copies + own[copies:]
        yield texts, answers


def test_completions_converging_inside_their_groups_trip_the_diversity_alarm_at_step_10():
    """One more completion of each group copies the first every step: diversity falls from 0.16, below
    group_diversity_min (0.02) at step 8 where all 8 are the same text, and the gate stops the run 3 steps into the
    collapse, at step 10."""
    rewards = RewardComputer([RewardConfig(name="exact_answer")])
    stopped, reason, history = run_gate(converging_batches(30, random.Random(2)), rewards, 8, HealthConfig())
    diversity = [m["hacking/group_diversity"] for m in history]
    assert diversity[0] > 0.1 and diversity[5] > 0.02 and set(diversity[7:]) == {0.0}
    assert stopped == 10
    assert reason.startswith(
        "collapsed: hacking/group_diversity=0 < 0.02 for 3 consecutive steps (the completions "
        "of a prompt are converging on one text"
    )


def test_length_paid_stream_trips_at_the_third_step():
    rewards = RewardComputer([RewardConfig(name="tests.reward_fixtures:length_bonus")])
    rng = random.Random(3)
    batches = [(["<output>" + "7" * rng.randint(1, 30) + "</output>" for _ in range(16)], ["7"] * 16)] * 5
    stopped, reason, _ = run_gate(batches, rewards, 8, HealthConfig())
    assert stopped == 3
    assert reason.startswith(
        "collapsed: hacking/length_reward_corr=1 > 0.8 for 3 consecutive steps (reward hacking: "
        "within a prompt's group the longer completions are paid more, so the reward pays length)"
    )


def divergence_batches(steps: int, rng: random.Random):
    """Training completions get right more often each step: the training reward rises."""
    return scripted_batches(steps, lambda s: min(0.95, 0.3 + 0.02 * s), rng, right=bare, wrong=explained)


def test_training_reward_up_while_held_out_accuracy_falls_trips_at_the_third_eval_point():
    """eval every 5 steps; held-out accuracy falls 0.6 -> 0.5 -> 0.45 while the training reward climbs: with the
    default window of 3 eval points the gate stops the run at step 15."""
    rewards = RewardComputer(FORMAT_LOOPHOLE)
    stopped, reason, history = run_gate(
        divergence_batches(30, random.Random(4)), rewards, 8, HealthConfig(), evals={5: 0.6, 10: 0.5, 15: 0.45, 20: 0.4}
    )
    assert stopped == 15
    assert reason.startswith("collapsed: hacking/train_reward_rise=")
    assert (
        "while hacking/eval_rise=-0.15 < 0.02 for 1 consecutive eval point (reward hacking: the training reward "
        "rises while the held-out score does not: mean training reward since each eval point +" in reason
    )
    assert "eval/accuracy -0.15 over the last 3 eval points" in reason
    assert [m["step"] for m in history if not math.isnan(m["hacking/train_reward_rise"])] == [15]


def test_held_out_accuracy_rising_with_training_reward_does_not_trip():
    rewards = RewardComputer(FORMAT_LOOPHOLE)
    stopped, reason, history = run_gate(
        divergence_batches(30, random.Random(4)),
        rewards,
        8,
        HealthConfig(),
        evals={5: 0.6, 10: 0.65, 15: 0.72, 20: 0.75, 25: 0.8, 30: 0.82},
    )
    assert reason is None
    assert [round(m["hacking/eval_rise"], 2) for m in history if not math.isnan(m["hacking/eval_rise"])] == [
        0.12,
        0.1,
        0.08,
        0.07,
    ]


def test_without_eval_points_the_divergence_signals_stay_nan():
    rewards = RewardComputer(FORMAT_LOOPHOLE)
    _, _, history = run_gate(divergence_batches(12, random.Random(4)), rewards, 8, HealthConfig())
    assert all(math.isnan(m["hacking/train_reward_rise"]) and math.isnan(m["hacking/eval_rise"]) for m in history)


def test_without_a_correctness_reward_the_component_alarm_is_off():
    rewards = RewardComputer([RewardConfig(name="format")])
    stopped, _, history = run_gate(scripted_batches(20, falling, random.Random(5)), rewards, 8, HealthConfig())
    assert stopped is None and all(math.isnan(m["hacking/correctness_rise"]) for m in history)
    assert history[-1]["hacking/other_reward_rise"] > 0.1  # still reported: format rose


def test_a_zero_weight_component_pays_nothing_so_its_rise_is_not_an_alarm():
    rewards = RewardComputer([RewardConfig(name="exact_answer"), RewardConfig(name="format", weight=0.0)])
    stopped, _, history = run_gate(scripted_batches(20, falling, random.Random(0)), rewards, 8, HealthConfig())
    assert stopped is None and all(math.isnan(m["hacking/other_reward_rise"]) for m in history)


def test_gate_state_resumes_the_windows_exactly():
    """A checkpoint after step 7 (the state through JSON, as the checkpoint stores it), resumed in a fresh gate:
    every step's trends and verdicts are those of the uninterrupted gate, the stop included."""
    rewards = RewardComputer(FORMAT_LOOPHOLE)
    batches = list(scripted_batches(16, falling, random.Random(0)))

    def steps(resume_after=None) -> str:
        gate, seen = HealthGate(HealthConfig(), "exact_answer", {"exact_answer": 1.0, "format": 0.5}), []
        for step, (texts, answers) in enumerate(batches, 1):
            m = step_metrics(step, texts, answers, rewards, 8)
            m.update(gate.observe(step, m))
            seen.append([m, gate.update(step, m)])
            if step == resume_after:
                state = json.loads(json.dumps(gate.state_dict()))
                gate = HealthGate(HealthConfig(), "exact_answer", {"exact_answer": 1.0, "format": 0.5})
                gate.load_state_dict(state)
        return json.dumps(seen)  # NaN as NaN: equal where the values are

    straight = steps()
    assert steps(resume_after=7) == straight
    assert json.loads(straight)[-1][1].startswith("collapsed: hacking/other_reward_rise=")


# --- runs: the tiny model trained on a reward that can be gamed --------------------------------


def train(tiny_model, out, **sections):
    trainer = GRPOTrainer(TrainerConfig.model_validate(tiny_spec(tiny_model, **sections)), out, progress=False)
    try:
        return trainer.train()
    finally:
        trainer.close()


def test_a_run_paid_only_for_length_is_stopped_by_the_default_gate_naming_the_correlation(tiny_model, tmp_path):
    """rewards: [length_bonus] alone, everything else default. The tiny model's answers differ in length only by the
    digits of the sum, and in every group where they differ the longer ones are paid more (correlation 1): the
    default gate stops the run within 8 steps (at step 7 here: steps 1, 6 and 7 had such a group), naming the
    correlation, and keeps the checkpoint of the step it stopped at."""
    result = train(
        tiny_model,
        tmp_path,
        rewards=[{"name": "tests.reward_fixtures:length_bonus"}],
        optim={"steps": 12},
        checkpoint={"every": 100},
    )
    assert result.stopped is not None and result.last_step <= 8
    corr, rest = re.fullmatch(r"collapsed: hacking/length_reward_corr=([0-9.]+) (.*)", result.stopped).groups()
    assert float(corr) > 0.95  # the reward is the completion's length: near-perfect correlation inside each group
    assert rest == (
        "> 0.8 for 3 consecutive steps (reward hacking: within a prompt's group the longer completions are paid more, "
        "so the reward pays length)"
    )
    assert result.last_checkpoint.name == f"step-{result.last_step:06d}"
    seen = [m["hacking/length_reward_corr"] for m in result.history if not math.isnan(m["hacking/length_reward_corr"])]
    assert seen[-3:] == [pytest.approx(1.0, abs=0.01)] * 3


LOOPHOLE_RUN = dict(
    rewards=[{"name": "exact_answer", "weight": 0.0}, {"name": "tests.reward_fixtures:two_digit_format"}],
    grpo={"num_generations": 8, "prompts_per_step": 4, "beta": 0.0},
    optim={"steps": 30, "learning_rate": 2e-3},
    checkpoint={"every": 100},
    data={"num_prompts": 256, "num_eval_prompts": 32},
)


def test_a_format_loophole_is_stopped_when_held_out_accuracy_falls_as_training_reward_rises(tiny_model, tmp_path):
    """The reward is two_digit_format alone, a format regex that pays <output>NN</output> whatever the answer;
    exact_answer, weight 0, is the correctness watched. The model learns to answer the three-digit sums with two
    digits: the training reward rises, greedy held-out accuracy (eval every 5 steps) falls, and the default gate
    stops the run at the third eval point, step 15, within 20."""
    result = train(tiny_model, tmp_path, eval={"every": 5, "max_tokens": 24}, **LOOPHOLE_RUN)
    assert result.stopped is not None and result.last_step <= 20
    assert result.stopped.startswith("collapsed: hacking/train_reward_rise=")
    assert "(reward hacking: the training reward rises while the held-out score does not: " in result.stopped
    evals = [m["eval/accuracy"] for m in result.history if "eval/accuracy" in m]
    assert len(evals) == result.last_step // 5 and evals[-1] < evals[0] - 0.1
    last = result.history[-1]
    assert last["hacking/train_reward_rise"] > 0.1 and last["hacking/eval_rise"] == pytest.approx(evals[-1] - evals[0])


# --- documentation and the report ------------------------------------------------------------


def test_every_new_metric_is_in_the_glossary():
    for name in NEW_METRICS:
        assert name in METRICS and len(METRICS[name]) > 40


def test_every_alarm_threshold_is_a_documented_health_field():
    fields = HealthConfig.model_fields
    for alarm in GATE_SIGNALS.values():
        for field in [alarm.field, alarm.patience] + ([alarm.also[1]] if alarm.also else []):
            assert field in fields and (fields[field].description or field == "patience"), field
