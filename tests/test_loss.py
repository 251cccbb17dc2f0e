"""trainer/loss.py: the GRPO loss and its gradient, computed by hand for small batches."""
import math

import pytest
import torch

from trainer.config import GRPOConfig
from trainer.loss import grpo_loss

E = math.exp

# ---------------------------------------------------------------------------------------------------
# One batch for the three aggregations: B = 2, T = 3, the second sequence has 2 real tokens.
# Log-ratios (logprobs - old_logprobs) are 0, 0.1, -0.1 and 0.05, 0, (padding): all ratios are inside
# the clip region [0.8, 1.2], so every real token's loss is -ratio * A and its gradient
# d(-ratio * A)/d logprob = -ratio * A, divided by the aggregation's normaliser.
OLD = [[-1.0, -2.0, -1.5], [-0.5, -1.0, -3.0]]
LOG_RATIO = [[0.0, 0.1, -0.1], [0.05, 0.0, 9.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
ADV = [1.0, -2.0]
RATIO = [[1.0, E(0.1), E(-0.1)], [E(0.05), 1.0, 0.0]]   # padding's ratio is irrelevant


def _batch(log_ratio=LOG_RATIO, old=OLD, mask=MASK, adv=ADV):
    old = torch.tensor(old)
    logprobs = (old + torch.tensor(log_ratio)).requires_grad_()
    return logprobs, old, torch.tensor(adv), torch.tensor(mask)


def _loss_and_grad(cfg, logprobs, old, adv, mask, **kwargs):
    loss, stats = grpo_loss(logprobs, old, adv, mask, cfg, **kwargs)
    loss.backward()
    return loss.item(), logprobs.grad, stats


def test_grpo_loss_is_the_mean_over_sequences_of_each_sequences_token_mean():
    loss, grad, _ = _loss_and_grad(GRPOConfig(loss_type="grpo", beta=0.0), *_batch())
    seq0 = (-1 * 1.0 - 1 * E(0.1) - 1 * E(-0.1)) / 3
    seq1 = (2 * E(0.05) + 2 * 1.0) / 2
    assert loss == pytest.approx((seq0 + seq1) / 2)
    # normaliser per token: (tokens in its sequence) * (number of sequences)
    expected_grad = [[-1 * 1.0 / 6, -1 * E(0.1) / 6, -1 * E(-0.1) / 6],
                     [2 * E(0.05) / 4, 2 * 1.0 / 4, 0.0]]
    torch.testing.assert_close(grad, torch.tensor(expected_grad))


def test_dapo_loss_is_the_mean_over_all_real_tokens_of_the_batch():
    loss, grad, _ = _loss_and_grad(GRPOConfig(loss_type="dapo", beta=0.0), *_batch())
    assert loss == pytest.approx((-1.0 - E(0.1) - E(-0.1) + 2 * E(0.05) + 2.0) / 5)
    expected_grad = [[-1.0 / 5, -E(0.1) / 5, -E(-0.1) / 5],
                     [2 * E(0.05) / 5, 2.0 / 5, 0.0]]
    torch.testing.assert_close(grad, torch.tensor(expected_grad))


def test_dr_grpo_loss_divides_the_token_sum_by_batch_times_max_completion_length():
    loss, grad, _ = _loss_and_grad(GRPOConfig(loss_type="dr_grpo", beta=0.0), *_batch(), max_completion_length=4)
    assert loss == pytest.approx((-1.0 - E(0.1) - E(-0.1) + 2 * E(0.05) + 2.0) / (2 * 4))
    expected_grad = [[-1.0 / 8, -E(0.1) / 8, -E(-0.1) / 8],
                     [2 * E(0.05) / 8, 2.0 / 8, 0.0]]
    torch.testing.assert_close(grad, torch.tensor(expected_grad))


def test_dr_grpo_without_max_completion_length_is_rejected():
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(*_batch(), GRPOConfig(loss_type="dr_grpo", beta=0.0))


def test_grpo_leaves_sequences_with_no_real_tokens_out_of_the_sequence_mean():
    logprobs, old, adv, mask = _batch(log_ratio=[[0.0, 0.0, 0.0]] * 2, mask=[[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]],
                                      adv=[1.0, 5.0])
    loss, _ = grpo_loss(logprobs, old, adv, mask, GRPOConfig(loss_type="grpo", beta=0.0))
    assert loss.item() == pytest.approx(-1.0)   # not (-1 + 0) / 2


def test_padding_values_are_ignored_even_when_nan():
    logprobs, old, adv, mask = _batch()
    old[1, 2] = float("nan")
    loss, grad, _ = _loss_and_grad(GRPOConfig(loss_type="dapo", beta=0.0), logprobs, old, adv, mask)
    assert loss == pytest.approx((-1.0 - E(0.1) - E(-0.1) + 2 * E(0.05) + 2.0) / 5)
    assert torch.isfinite(grad).all() and grad[1, 2] == 0


# ---------------------------------------------------------------------------------------------------
# clipping


def test_clipped_tokens_have_no_gradient_and_are_counted_in_the_clip_stats():
    # eps = 0.2. A = [1, -1]. Log-ratios: seq0 [0.5, 0], seq1 [-0.5, 0.5].
    #   seq0 tok0: ratio 1.65 > 1.2, A > 0  -> clipped high: loss -1.2 * 1, no gradient
    #   seq0 tok1: ratio 1                   -> loss -1, gradient -1 / 4
    #   seq1 tok0: ratio 0.61 < 0.8, A < 0  -> clipped low: loss -(0.8 * -1) = 0.8, no gradient
    #   seq1 tok1: ratio 1.65 > 1.2 but A < 0 -> min picks ratio * A (the pessimistic side): not clipped,
    #              loss 1.65, gradient -ratio * A / 4 = 1.65 / 4
    logprobs, old, adv, mask = _batch(log_ratio=[[0.5, 0.0], [-0.5, 0.5]], old=[[-1.0, -1.0], [-1.0, -1.0]],
                                      mask=[[1.0, 1.0], [1.0, 1.0]], adv=[1.0, -1.0])
    loss, grad, stats = _loss_and_grad(GRPOConfig(loss_type="dapo", beta=0.0, epsilon=0.2), logprobs, old, adv, mask)
    assert loss == pytest.approx((-1.2 - 1.0 + 0.8 + E(0.5)) / 4)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.25], [0.0, E(0.5) / 4]]))
    assert stats["clip_ratio/high_mean"] == pytest.approx(1 / 4)
    assert stats["clip_ratio/low_mean"] == pytest.approx(1 / 4)
    assert stats["clip_ratio/region_mean"] == pytest.approx(2 / 4)
    assert stats["is/clip_fraction"] == pytest.approx(2 / 4)
    assert stats["is/mean_importance_ratio"] == pytest.approx((E(0.5) + 1 + E(-0.5) + E(0.5)) / 4)


def test_epsilon_high_moves_only_the_upper_clip_bound():
    # ratio 1.25 with A > 0: clipped at 1 + 0.2, but inside 1 + 0.28 (DAPO clip-higher).
    logprobs, old, adv, mask = _batch(log_ratio=[[math.log(1.25)]], old=[[-1.0]], mask=[[1.0]], adv=[1.0])
    symmetric, _ = grpo_loss(logprobs, old, adv, mask, GRPOConfig(loss_type="dapo", beta=0.0, epsilon=0.2))
    higher, stats = grpo_loss(logprobs, old, adv, mask,
                              GRPOConfig(loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28))
    assert symmetric.item() == pytest.approx(-1.2)
    assert higher.item() == pytest.approx(-1.25)
    assert stats["clip_ratio/high_mean"] == 0.0


# ---------------------------------------------------------------------------------------------------
# KL penalty


def test_beta_adds_beta_times_the_k3_estimate_to_each_token():
    # Ratio 1 everywhere; ref - logprob = [0.5, -0.2] and [0.1, (padding)]. A = [1, -1].
    logprobs, old, adv, mask = _batch(log_ratio=[[0.0, 0.0], [0.0, 0.0]], old=[[-1.0, -2.0], [-1.0, -1.0]],
                                      mask=[[1.0, 1.0], [1.0, 0.0]], adv=[1.0, -1.0])
    ref = logprobs.detach() + torch.tensor([[0.5, -0.2], [0.1, 3.0]])
    cfg = GRPOConfig(loss_type="dapo", beta=0.1, kl_estimator="k3")
    loss, grad, stats = _loss_and_grad(cfg, logprobs, old, adv, mask, ref_logprobs=ref)

    k3 = [E(d) - d - 1 for d in (0.5, -0.2, 0.1)]
    assert loss == pytest.approx((-1.0 - 1.0 + 1.0) / 3 + 0.1 * sum(k3) / 3)
    # d k3 / d logprob = 1 - exp(ref - logprob)
    expected_grad = [[(-1.0 + 0.1 * (1 - E(0.5))) / 3, (-1.0 + 0.1 * (1 - E(-0.2))) / 3],
                     [(1.0 + 0.1 * (1 - E(0.1))) / 3, 0.0]]
    torch.testing.assert_close(grad, torch.tensor(expected_grad))
    assert stats["kl"] == pytest.approx(sum(k3) / 3)
    assert stats["kl/k3"] == pytest.approx(sum(k3) / 3)
    assert stats["kl/k1"] == pytest.approx((-0.5 + 0.2 - 0.1) / 3)
    assert stats["kl/k2"] == pytest.approx(0.5 * (0.25 + 0.04 + 0.01) / 3)


def test_kl_estimator_chooses_which_estimate_goes_into_the_loss():
    logprobs, old, adv, mask = _batch(log_ratio=[[0.0]], old=[[-1.0]], mask=[[1.0]], adv=[0.0])
    ref = logprobs.detach() + 0.5
    k1_loss, _ = grpo_loss(logprobs, old, adv, mask, GRPOConfig(loss_type="dapo", beta=0.1, kl_estimator="k1"),
                           ref_logprobs=ref)
    k2_loss, _ = grpo_loss(logprobs, old, adv, mask, GRPOConfig(loss_type="dapo", beta=0.1, kl_estimator="k2"),
                           ref_logprobs=ref)
    assert k1_loss.item() == pytest.approx(0.1 * -0.5)
    assert k2_loss.item() == pytest.approx(0.1 * 0.5 * 0.25)


def test_kl_is_reported_without_entering_the_loss_when_beta_is_zero():
    logprobs, old, adv, mask = _batch(log_ratio=[[0.0]], old=[[-1.0]], mask=[[1.0]], adv=[1.0])
    ref = logprobs.detach() + 0.5
    loss, stats = grpo_loss(logprobs, old, adv, mask, GRPOConfig(loss_type="dapo", beta=0.0), ref_logprobs=ref)
    assert loss.item() == pytest.approx(-1.0)
    assert stats["kl"] == pytest.approx(E(0.5) - 0.5 - 1)


def test_beta_without_reference_logprobs_is_rejected():
    with pytest.raises(ValueError, match="beta=0.04 but no ref_logprobs"):
        grpo_loss(*_batch(), GRPOConfig(loss_type="dapo", beta=0.04))


# ---------------------------------------------------------------------------------------------------
# sequence-level importance sampling (GSPO)


def test_sequence_level_ratio_is_the_exp_of_the_mean_token_log_ratio():
    # seq0 log-ratios [0.05, 0.15, (pad)] -> ratio e^0.1 for both tokens; seq1 [-0.3, 0, 0.3] -> ratio 1.
    # A = [1, -1]; dapo over 5 tokens. Each token's gradient: -exp(s) * A * (tokens of its sequence / 5)
    # * (1 / tokens of its sequence) = -exp(s) * A / 5.
    logprobs, old, adv, mask = _batch(log_ratio=[[0.05, 0.15, 5.0], [-0.3, 0.0, 0.3]],
                                      mask=[[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], adv=[1.0, -1.0])
    cfg = GRPOConfig(loss_type="dapo", beta=0.0, importance_sampling_level="sequence")
    loss, grad, stats = _loss_and_grad(cfg, logprobs, old, adv, mask)
    assert loss == pytest.approx((2 * -E(0.1) + 3 * 1.0) / 5)
    expected_grad = [[-E(0.1) / 5, -E(0.1) / 5, 0.0], [1 / 5, 1 / 5, 1 / 5]]
    torch.testing.assert_close(grad, torch.tensor(expected_grad))
    assert stats["is/mean_importance_ratio"] == pytest.approx((2 * E(0.1) + 3 * 1.0) / 5)


# ---------------------------------------------------------------------------------------------------
# inputs the loss refuses


def test_nan_old_logprobs_at_real_tokens_are_rejected():
    logprobs, old, adv, mask = _batch()
    old[0, 1] = float("nan")
    old[1, 0] = float("nan")
    with pytest.raises(ValueError, match="old logprobs contain NaN for 2 tokens"):
        grpo_loss(logprobs, old, adv, mask, GRPOConfig(loss_type="dapo", beta=0.0))


def test_mismatched_shapes_are_rejected_with_both_shapes_named():
    logprobs, old, adv, mask = _batch()
    with pytest.raises(ValueError, match=r"old_logprobs shape \(2, 2\).*logprobs shape \(2, 3\)"):
        grpo_loss(logprobs, old[:, :2], adv, mask, GRPOConfig(loss_type="dapo", beta=0.0))
    with pytest.raises(ValueError, match=r"advantages shape \(3,\)"):
        grpo_loss(logprobs, old, torch.zeros(3), mask, GRPOConfig(loss_type="dapo", beta=0.0))
