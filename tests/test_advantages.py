"""trainer/advantages.py: group-relative advantages, by hand, for each way of scaling; which completions
are left out of the loss; bad rewards rejected."""

import math

import pytest
import torch

from trainer.advantages import compute_advantages

# Two prompts, G = 3. Group 0: rewards 1, 2, 3 (mean 2, unbiased std 1).
# Group 1: rewards 0, 0, 6 (mean 2, unbiased std sqrt((4 + 4 + 16) / 2) = sqrt(12)).
REWARDS = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 6.0])
EPS = 1e-4


def test_group_scaling_divides_by_each_groups_unbiased_std():
    result = compute_advantages(REWARDS, num_generations=3, scale_rewards="group")
    s1 = math.sqrt(12)
    expected = [-1 / (1 + EPS), 0.0, 1 / (1 + EPS), -2 / (s1 + EPS), -2 / (s1 + EPS), 4 / (s1 + EPS)]
    torch.testing.assert_close(result.advantages, torch.tensor(expected))
    torch.testing.assert_close(result.group_std, torch.tensor([1.0, s1]))


def test_batch_scaling_divides_by_the_std_of_all_rewards():
    result = compute_advantages(REWARDS, num_generations=3, scale_rewards="batch")
    # batch mean 2; squared deviations 1, 0, 1, 4, 4, 16 -> unbiased variance 26 / 5
    batch_std = math.sqrt(26 / 5)
    expected = [d / (batch_std + EPS) for d in [-1.0, 0.0, 1.0, -2.0, -2.0, 4.0]]
    torch.testing.assert_close(result.advantages, torch.tensor(expected))


def test_no_scaling_leaves_reward_minus_group_mean():
    result = compute_advantages(REWARDS, num_generations=3, scale_rewards="none")
    torch.testing.assert_close(result.advantages, torch.tensor([-1.0, 0.0, 1.0, -2.0, -2.0, 4.0]))
    assert result.loss_mask_seq.all()


def test_zero_std_groups_are_counted_and_kept_by_default():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])  # groups of 2: {1, 1}, {0, 1}, {0.5, 0.5}
    result = compute_advantages(rewards, num_generations=2, scale_rewards="group")
    assert result.frac_reward_zero_std == pytest.approx(2 / 3)
    assert result.frac_zero_std_groups == pytest.approx(2 / 3)
    torch.testing.assert_close(result.advantages[[0, 1, 4, 5]], torch.zeros(4))
    assert result.loss_mask_seq.all()


def test_under_batch_scaling_frac_reward_zero_std_is_trls_whole_batch_flag():
    """TRL scales by the batch std under 'batch', so frac_reward_zero_std says whether that std is zero (1 or 0);
    the groups without signal are still counted in frac_zero_std_groups."""
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    spread = compute_advantages(rewards, num_generations=2, scale_rewards="batch")
    assert spread.frac_reward_zero_std == 0.0
    assert spread.frac_zero_std_groups == pytest.approx(2 / 3)
    flat = compute_advantages(torch.full((6,), 0.5), num_generations=2, scale_rewards="batch")
    assert flat.frac_reward_zero_std == 1.0 and flat.frac_zero_std_groups == 1.0


def test_without_scaling_frac_reward_zero_std_still_counts_zero_std_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    result = compute_advantages(rewards, num_generations=2, scale_rewards="none")
    assert result.frac_reward_zero_std == pytest.approx(2 / 3)


def test_zero_std_groups_are_left_out_of_the_loss_when_dropped():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    result = compute_advantages(rewards, num_generations=2, scale_rewards="group", drop_zero_std_groups=True)
    assert result.loss_mask_seq.tolist() == [False, False, True, True, False, False]
    assert result.frac_zero_std_groups == pytest.approx(2 / 3)


def test_truncated_completions_are_masked_but_still_count_in_the_group_statistics():
    truncated = torch.tensor([False, False, True, False, True, False])
    result = compute_advantages(
        REWARDS, num_generations=3, scale_rewards="none", truncated=truncated, mask_truncated=True
    )
    assert result.loss_mask_seq.tolist() == [True, True, False, True, False, True]
    torch.testing.assert_close(result.advantages, torch.tensor([-1.0, 0.0, 1.0, -2.0, -2.0, 4.0]))


def test_truncated_completions_are_kept_unless_masking_is_asked_for():
    truncated = torch.tensor([False, False, True, False, True, False])
    result = compute_advantages(REWARDS, num_generations=3, scale_rewards="group", truncated=truncated)
    assert result.loss_mask_seq.all()


def test_nan_reward_is_rejected_with_the_completion_indices_and_the_fix():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 1.0, 0.0, float("nan")])
    with pytest.raises(ValueError) as error:
        compute_advantages(rewards, num_generations=3, scale_rewards="group")
    assert str(error.value) == (
        "a reward function returned NaN for completion(s) [1, 5]; make it return a finite float"
    )


def test_infinite_reward_is_rejected():
    rewards = torch.tensor([1.0, float("inf"), 0.0, 1.0])
    with pytest.raises(ValueError, match=r"returned inf for completion\(s\) \[1\]"):
        compute_advantages(rewards, num_generations=2, scale_rewards="group")


def test_reward_count_not_divisible_by_group_size_is_rejected():
    with pytest.raises(ValueError, match="num_generations=4"):
        compute_advantages(REWARDS, num_generations=4, scale_rewards="group")
