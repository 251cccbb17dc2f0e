"""trainer/metrics.py is the glossary: a real step reports exactly its names, and each value means what the
glossary (and TRL, where the name is TRL's) says, shown on small constructed batches."""

import math

import pytest
import torch

from tests.conftest import tiny_spec
from trainer.config import RolloutCorrectionConfig, TrainerConfig
from trainer.loop import GRPOTrainer
from trainer.loss import LossTerms, rollout_correction
from trainer.metrics import (
    METRICS,
    completion_metrics,
    describe,
    entropy_metric,
    mean_over_updates,
    reward_metrics,
    sampling_metrics,
    update_metrics,
)

# names a step reports only sometimes: eval/* at eval steps, judge/* with the judge reward, perf/* with a known peak
CONDITIONAL = ("eval/", "judge/", "perf/")


def test_a_real_step_reports_exactly_the_documented_names(tiny_model, tmp_path):
    spec = tiny_spec(tiny_model, optim={"steps": 1, "gradient_accumulation_steps": 2})
    trainer = GRPOTrainer(TrainerConfig.model_validate(spec), tmp_path, progress=False)
    reported = set(trainer.train(1).history[0])
    trainer.close()
    functions = ("exact_answer", "length_bonus")
    documented = {n for n in METRICS if "<fn>" not in n and not n.startswith(CONDITIONAL)}
    documented |= {f"rewards/{fn}/{stat}" for fn in functions for stat in ("mean", "std")}
    assert reported == documented
    for name in reported:
        assert describe(name)


def test_undocumented_names_are_refused_by_describe():
    assert describe("rewards/anything/std") == METRICS["rewards/<fn>/std"]
    with pytest.raises(KeyError, match="undocumented metric 'rewards/x/median'"):
        describe("rewards/x/median")


# ---------------------------------------------------------------------------------------------------
# rewards and completions


def test_reward_std_is_the_std_of_all_rewards_and_each_function_has_its_own():
    m = reward_metrics(
        [1.0, 2.0, 3.0, 6.0],
        {"a": [0.0, 1.0, 1.0, 0.0], "b": [2.0, 2.0, 2.0, 2.0]},
        frac_reward_zero_std=0.5,
        frac_zero_std_groups=0.5,
    )
    assert m["reward"] == 3.0
    assert m["reward_std"] == pytest.approx(math.sqrt((4 + 1 + 0 + 9) / 3))  # unbiased, over the batch
    assert m["rewards/a/mean"] == 0.5 and m["rewards/a/std"] == pytest.approx(math.sqrt(1 / 3))
    assert m["rewards/b/std"] == 0.0


def test_terminated_lengths_count_only_completions_that_ended_and_are_0_when_none_did():
    m = completion_metrics([5, 9, 3, 7], ["stop", "length", "stop", "stop"])
    assert (m["completions/min_terminated_length"], m["completions/max_terminated_length"]) == (3.0, 7.0)
    assert m["completions/mean_terminated_length"] == 5.0 and m["completions/clipped_ratio"] == 0.25
    assert (m["completions/min_length"], m["completions/max_length"]) == (3.0, 9.0)
    none = completion_metrics([4, 4], ["length", "length"])
    assert none["completions/min_terminated_length"] == none["completions/max_terminated_length"] == 0.0


# ---------------------------------------------------------------------------------------------------
# the update: clip ratios, entropy

# Two completions with loss tokens (3 and 2) and one left out of the loss (row 2).
LOSS_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])


def _terms(low, high, ratio=None):
    low, high = torch.tensor(low), torch.tensor(high)
    return LossTerms(
        ratio=torch.ones(3, 3) if ratio is None else torch.tensor(ratio), clipped_low=low, clipped_high=high, kl=None
    )


def test_token_level_clip_ratios_are_shares_of_loss_tokens_and_per_completion_extremes():
    # row 0: 1 of 3 tokens clipped low; row 1: 2 of 2 clipped high; row 2 (not in the loss) all flagged
    terms = _terms(
        low=[[True, False, False], [False, False, False], [True, True, True]],
        high=[[False, False, False], [True, True, False], [True, True, True]],
    )
    m = update_metrics(terms, LOSS_MASK, "token")
    assert m["clip_ratio/low_mean"] == pytest.approx(1 / 5)
    assert m["clip_ratio/high_mean"] == pytest.approx(2 / 5)
    assert m["clip_ratio/region_mean"] == pytest.approx(3 / 5)
    assert m["clip_ratio/low_min"] == 0.0  # row 1 has no low-clipped token
    assert m["clip_ratio/high_max"] == 1.0  # row 1: all its tokens
    assert not {"kl", "kl/k1", "kl/k2", "kl/k3"} & set(m)  # no reference given: no KL measured, none reported


def test_policy_ratio_mean_is_over_loss_tokens():
    terms = _terms(
        low=[[False] * 3] * 3, high=[[False] * 3] * 3, ratio=[[1.0, 1.2, 0.8], [1.5, 0.5, 99.0], [99.0, 99.0, 99.0]]
    )
    assert update_metrics(terms, LOSS_MASK, "token")["policy_ratio/mean"] == pytest.approx(5.0 / 5)


def test_entropy_is_averaged_over_loss_tokens_only():
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0], [100.0, 100.0, 100.0]])
    assert entropy_metric(entropy, LOSS_MASK)["entropy"] == pytest.approx(15 / 5)
    assert math.isnan(entropy_metric(entropy, torch.zeros(3, 3))["entropy"])  # nothing counts: not 0


def test_values_over_updates_are_averaged_and_nan_only_when_every_update_is():
    m = mean_over_updates([{"loss": 1.0, "x": math.nan}, {"loss": 3.0, "x": math.nan}, {"loss": 2.0, "x": math.nan}])
    assert m["loss"] == 2.0 and math.isnan(m["x"])


# ---------------------------------------------------------------------------------------------------
# engine vs trainer

OLD = torch.full((3, 3), -1.0)
# log(pi_old / pi_engine): row 0 [1.0, 0.1, -0.2], row 1 [0.3, (no logprob), pad], row 2 (not in loss) [2, 2, 2]
ENGINE = OLD - torch.tensor([[1.0, 0.1, -0.2], [0.3, 0.0, 0.0], [2.0, 2.0, 2.0]])
ENGINE[1, 1] = float("nan")
ENGINE[1, 2] = float("nan")
TOKENS = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def sampling(engine=ENGINE, staleness=(0, 0, 0), **cfg):
    cfg = RolloutCorrectionConfig(**cfg)
    corr = rollout_correction(OLD, engine, LOSS_MASK, cfg)
    return sampling_metrics(OLD, engine, TOKENS, LOSS_MASK, corr, cfg, staleness)


def test_logp_difference_covers_every_token_with_an_engine_logprob_and_the_valid_share_is_reported():
    m = sampling(mode="tis")
    assert m["sampling/frac_logprobs_valid"] == pytest.approx(7 / 8)
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx((1.0 + 0.1 + 0.2 + 0.3 + 6.0) / 7)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(2.0)
    assert m["sampling/staleness/mean"] == 0.0 and m["sampling/staleness/max"] == 0.0


def test_tis_weights_and_truncated_share_are_over_loss_tokens():
    m = sampling(mode="tis", high=2.0)
    weights = [2.0, math.exp(0.1), math.exp(-0.2), math.exp(0.3)]  # e^1 capped at 2
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(2.0)
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(math.exp(-0.2))
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(sum(weights) / 4)
    assert m["sampling/truncated_fraction"] == pytest.approx(1 / 5)
    assert m["sampling/masked_fraction"] == 0.0


def test_mis_masked_share_and_masked_weights_count_as_zero():
    m = sampling(mode="mis", low=0.9, high=2.0)
    assert m["sampling/masked_fraction"] == pytest.approx(2 / 5)  # e^1 and e^-0.2
    assert m["sampling/importance_sampling_ratio/min"] == 0.0
    assert m["sampling/truncated_fraction"] == 0.0


def test_sequence_level_weights_are_one_per_completion():
    m = sampling(mode="tis", level="sequence", high=5.0)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(0.9))
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(math.exp(0.3))


def test_with_correction_off_the_ratio_is_reported_unbounded():
    m = sampling(mode="off")
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(math.e)
    assert m["sampling/truncated_fraction"] == 0.0 and m["sampling/masked_fraction"] == 0.0


def test_without_any_engine_logprob_the_sampling_values_are_nan_not_zero():
    m = sampling(engine=torch.full((3, 3), float("nan")), mode="off")
    assert m["sampling/frac_logprobs_valid"] == 0.0
    for name in ("sampling_logp_difference/mean", "sampling_logp_difference/max", "importance_sampling_ratio/mean"):
        assert math.isnan(m[f"sampling/{name}"]), name
