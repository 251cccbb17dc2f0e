"""trainer/loss.py: the GRPO loss and its gradient, computed by hand for small batches; the same loss and
gradient however the batch is split into micro-batches; the rollout correction (TIS, MIS)."""

import math

import pytest
import torch

from trainer.config import GRPOConfig, RolloutCorrectionConfig
from trainer.loss import BatchTotals, grpo_loss, rollout_correction
from trainer.metrics import update_metrics

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
RATIO = [[1.0, E(0.1), E(-0.1)], [E(0.05), 1.0, 0.0]]  # padding's ratio is irrelevant


def _batch(log_ratio=LOG_RATIO, old=OLD, mask=MASK, adv=ADV):
    old = torch.tensor(old)
    logprobs = (old + torch.tensor(log_ratio)).requires_grad_()
    return logprobs, old, torch.tensor(adv), torch.tensor(mask)


def _loss_and_grad(cfg, logprobs, old, adv, mask, **kwargs):
    loss, terms = grpo_loss(logprobs, old, adv, mask, cfg, **kwargs)
    loss.backward()
    return loss.item(), logprobs.grad, update_metrics(terms, mask, cfg.importance_sampling_level)


def test_grpo_loss_is_the_mean_over_sequences_of_each_sequences_token_mean():
    loss, grad, _ = _loss_and_grad(GRPOConfig(loss_type="grpo", beta=0.0), *_batch())
    seq0 = (-1 * 1.0 - 1 * E(0.1) - 1 * E(-0.1)) / 3
    seq1 = (2 * E(0.05) + 2 * 1.0) / 2
    assert loss == pytest.approx((seq0 + seq1) / 2)
    # normaliser per token: (tokens in its sequence) * (number of sequences)
    expected_grad = [[-1 * 1.0 / 6, -1 * E(0.1) / 6, -1 * E(-0.1) / 6], [2 * E(0.05) / 4, 2 * 1.0 / 4, 0.0]]
    torch.testing.assert_close(grad, torch.tensor(expected_grad))


def test_dapo_loss_is_the_mean_over_all_real_tokens_of_the_batch():
    loss, grad, _ = _loss_and_grad(GRPOConfig(loss_type="dapo", beta=0.0), *_batch())
    assert loss == pytest.approx((-1.0 - E(0.1) - E(-0.1) + 2 * E(0.05) + 2.0) / 5)
    expected_grad = [[-1.0 / 5, -E(0.1) / 5, -E(-0.1) / 5], [2 * E(0.05) / 5, 2.0 / 5, 0.0]]
    torch.testing.assert_close(grad, torch.tensor(expected_grad))


def test_dr_grpo_loss_divides_the_token_sum_by_batch_times_max_completion_length():
    loss, grad, _ = _loss_and_grad(GRPOConfig(loss_type="dr_grpo", beta=0.0), *_batch(), max_completion_length=4)
    assert loss == pytest.approx((-1.0 - E(0.1) - E(-0.1) + 2 * E(0.05) + 2.0) / (2 * 4))
    expected_grad = [[-1.0 / 8, -E(0.1) / 8, -E(-0.1) / 8], [2 * E(0.05) / 8, 2.0 / 8, 0.0]]
    torch.testing.assert_close(grad, torch.tensor(expected_grad))


def test_dr_grpo_without_max_completion_length_is_rejected():
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(*_batch(), GRPOConfig(loss_type="dr_grpo", beta=0.0))


def test_grpo_leaves_sequences_with_no_real_tokens_out_of_the_sequence_mean():
    logprobs, old, adv, mask = _batch(
        log_ratio=[[0.0, 0.0, 0.0]] * 2, mask=[[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], adv=[1.0, 5.0]
    )
    loss, _ = grpo_loss(logprobs, old, adv, mask, GRPOConfig(loss_type="grpo", beta=0.0))
    assert loss.item() == pytest.approx(-1.0)  # not (-1 + 0) / 2


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
    logprobs, old, adv, mask = _batch(
        log_ratio=[[0.5, 0.0], [-0.5, 0.5]],
        old=[[-1.0, -1.0], [-1.0, -1.0]],
        mask=[[1.0, 1.0], [1.0, 1.0]],
        adv=[1.0, -1.0],
    )
    loss, grad, stats = _loss_and_grad(GRPOConfig(loss_type="dapo", beta=0.0, epsilon=0.2), logprobs, old, adv, mask)
    assert loss == pytest.approx((-1.2 - 1.0 + 0.8 + E(0.5)) / 4)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.25], [0.0, E(0.5) / 4]]))
    assert stats["clip_ratio/high_mean"] == pytest.approx(1 / 4)
    assert stats["clip_ratio/low_mean"] == pytest.approx(1 / 4)
    assert stats["clip_ratio/region_mean"] == pytest.approx(2 / 4)
    assert stats["clip_ratio/low_min"] == 0.0 and stats["clip_ratio/high_max"] == pytest.approx(1 / 2)
    assert stats["policy_ratio/mean"] == pytest.approx((E(0.5) + 1 + E(-0.5) + E(0.5)) / 4)


def test_epsilon_high_moves_only_the_upper_clip_bound():
    # ratio 1.25 with A > 0: clipped at 1 + 0.2, but inside 1 + 0.28 (DAPO clip-higher).
    logprobs, old, adv, mask = _batch(log_ratio=[[math.log(1.25)]], old=[[-1.0]], mask=[[1.0]], adv=[1.0])
    symmetric, _ = grpo_loss(logprobs, old, adv, mask, GRPOConfig(loss_type="dapo", beta=0.0, epsilon=0.2))
    higher, terms = grpo_loss(
        logprobs, old, adv, mask, GRPOConfig(loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28)
    )
    assert symmetric.item() == pytest.approx(-1.2)
    assert higher.item() == pytest.approx(-1.25)
    assert update_metrics(terms, mask, "token")["clip_ratio/high_mean"] == 0.0


# ---------------------------------------------------------------------------------------------------
# KL penalty


def test_beta_adds_beta_times_the_k3_estimate_to_each_token():
    # Ratio 1 everywhere; ref - logprob = [0.5, -0.2] and [0.1, (padding)]. A = [1, -1].
    logprobs, old, adv, mask = _batch(
        log_ratio=[[0.0, 0.0], [0.0, 0.0]],
        old=[[-1.0, -2.0], [-1.0, -1.0]],
        mask=[[1.0, 1.0], [1.0, 0.0]],
        adv=[1.0, -1.0],
    )
    ref = logprobs.detach() + torch.tensor([[0.5, -0.2], [0.1, 3.0]])
    cfg = GRPOConfig(loss_type="dapo", beta=0.1, kl_estimator="k3")
    loss, grad, stats = _loss_and_grad(cfg, logprobs, old, adv, mask, ref_logprobs=ref)

    k3 = [E(d) - d - 1 for d in (0.5, -0.2, 0.1)]
    assert loss == pytest.approx((-1.0 - 1.0 + 1.0) / 3 + 0.1 * sum(k3) / 3)
    # d k3 / d logprob = 1 - exp(ref - logprob)
    expected_grad = [
        [(-1.0 + 0.1 * (1 - E(0.5))) / 3, (-1.0 + 0.1 * (1 - E(-0.2))) / 3],
        [(1.0 + 0.1 * (1 - E(0.1))) / 3, 0.0],
    ]
    torch.testing.assert_close(grad, torch.tensor(expected_grad))
    assert stats["kl"] == pytest.approx(sum(k3) / 3)
    assert stats["kl/k3"] == pytest.approx(sum(k3) / 3)
    assert stats["kl/k1"] == pytest.approx((-0.5 + 0.2 - 0.1) / 3)
    assert stats["kl/k2"] == pytest.approx(0.5 * (0.25 + 0.04 + 0.01) / 3)


def test_kl_estimator_chooses_which_estimate_goes_into_the_loss():
    logprobs, old, adv, mask = _batch(log_ratio=[[0.0]], old=[[-1.0]], mask=[[1.0]], adv=[0.0])
    ref = logprobs.detach() + 0.5
    k1_loss, _ = grpo_loss(
        logprobs, old, adv, mask, GRPOConfig(loss_type="dapo", beta=0.1, kl_estimator="k1"), ref_logprobs=ref
    )
    k2_loss, _ = grpo_loss(
        logprobs, old, adv, mask, GRPOConfig(loss_type="dapo", beta=0.1, kl_estimator="k2"), ref_logprobs=ref
    )
    assert k1_loss.item() == pytest.approx(0.1 * -0.5)
    assert k2_loss.item() == pytest.approx(0.1 * 0.5 * 0.25)


def test_kl_is_reported_without_entering_the_loss_when_beta_is_zero():
    logprobs, old, adv, mask = _batch(log_ratio=[[0.0]], old=[[-1.0]], mask=[[1.0]], adv=[1.0])
    ref = logprobs.detach() + 0.5
    loss, terms = grpo_loss(logprobs, old, adv, mask, GRPOConfig(loss_type="dapo", beta=0.0), ref_logprobs=ref)
    assert loss.item() == pytest.approx(-1.0)
    assert update_metrics(terms, mask, "token")["kl"] == pytest.approx(E(0.5) - 0.5 - 1)


def test_beta_without_reference_logprobs_is_rejected():
    with pytest.raises(ValueError, match="beta=0.04 but no ref_logprobs"):
        grpo_loss(*_batch(), GRPOConfig(loss_type="dapo", beta=0.04))


# ---------------------------------------------------------------------------------------------------
# sequence-level importance sampling (GSPO)


def test_sequence_level_ratio_is_the_exp_of_the_mean_token_log_ratio():
    # seq0 log-ratios [0.05, 0.15, (pad)] -> ratio e^0.1 for both tokens; seq1 [-0.3, 0, 0.3] -> ratio 1.
    # A = [1, -1]; loss_type grpo (the only aggregation allowed with sequence-level ratios): each sequence's
    # loss is -r * A, and d(-r * A)/d logprob_j = -r * A / (its tokens), divided by its tokens again (the
    # sequence mean) and by the 2 sequences: seq0 -e^0.1 / 4 per token, seq1 1 / (3 * 3 * 2) * 3 = 1 / 6.
    logprobs, old, adv, mask = _batch(
        log_ratio=[[0.05, 0.15, 5.0], [-0.3, 0.0, 0.3]], mask=[[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], adv=[1.0, -1.0]
    )
    cfg = GRPOConfig(loss_type="grpo", beta=0.0, importance_sampling_level="sequence")
    loss, grad, stats = _loss_and_grad(cfg, logprobs, old, adv, mask)
    assert loss == pytest.approx((-E(0.1) + 1.0) / 2)
    expected_grad = [[-E(0.1) / 4, -E(0.1) / 4, 0.0], [1 / 6, 1 / 6, 1 / 6]]
    torch.testing.assert_close(grad, torch.tensor(expected_grad))
    assert stats["policy_ratio/mean"] == pytest.approx((2 * E(0.1) + 3 * 1.0) / 5)


def test_clip_ratios_at_sequence_level_count_sequences_not_tokens():
    # eps 0.2. seq0 (1 token) mean log-ratio 0.5 with A > 0: clipped high; seq1 (3 tokens) ratio 1: not clipped.
    # At token level 1 of 4 tokens would be clipped; at sequence level (TRL) it is 1 of 2 sequences.
    logprobs, old, adv, mask = _batch(
        log_ratio=[[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]], mask=[[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]], adv=[1.0, 1.0]
    )
    _, terms = grpo_loss(
        logprobs, old, adv, mask, GRPOConfig(loss_type="grpo", beta=0.0, importance_sampling_level="sequence")
    )
    stats = update_metrics(terms, mask, "sequence")
    assert stats["clip_ratio/high_mean"] == pytest.approx(1 / 2)
    assert stats["clip_ratio/region_mean"] == pytest.approx(1 / 2)
    assert stats["clip_ratio/high_max"] == 1.0 and stats["clip_ratio/low_min"] == 0.0


# ---------------------------------------------------------------------------------------------------
# inputs the loss refuses


def test_nan_old_logprobs_at_real_tokens_are_rejected():
    logprobs, old, adv, mask = _batch()
    old[0, 1] = float("nan")
    old[1, 0] = float("nan")
    with pytest.raises(ValueError, match="old logprobs contain NaN for 2 tokens.*must not become ratio 1"):
        grpo_loss(logprobs, old, adv, mask, GRPOConfig(loss_type="dapo", beta=0.0))


def test_mismatched_shapes_are_rejected_with_both_shapes_named():
    logprobs, old, adv, mask = _batch()
    with pytest.raises(ValueError, match=r"old_logprobs shape \(2, 2\).*logprobs shape \(2, 3\)"):
        grpo_loss(logprobs, old[:, :2], adv, mask, GRPOConfig(loss_type="dapo", beta=0.0))
    with pytest.raises(ValueError, match=r"advantages shape \(3,\)"):
        grpo_loss(logprobs, old, torch.zeros(3), mask, GRPOConfig(loss_type="dapo", beta=0.0))


# ---------------------------------------------------------------------------------------------------
# the same loss and gradient however the batch is split
#
# Eight rows with uneven lengths; row 2 is truncated-and-masked and rows 6-7 a dropped zero-std group, so
# their masks are all zero. Micro-batches of 4, 2 and 1 row(s) hold very different token counts.
LENGTHS = [5, 1, 6, 2, 3, 6, 4, 2]
LEFT_OUT = {2, 6, 7}


def _split_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    mask = torch.tensor(
        [[1.0 if t < n and b not in LEFT_OUT else 0.0 for t in range(T)] for b, n in enumerate(LENGTHS)]
    )
    old = -torch.rand(B, T, generator=g) * 3
    logprobs = old + (torch.rand(B, T, generator=g) - 0.5) * 0.6  # ratios in [0.74, 1.35]: some clipped
    ref = old + (torch.rand(B, T, generator=g) - 0.5)
    adv = torch.randn(B, generator=g)
    return logprobs, old, ref, adv, mask


def _accumulated(cfg, parts, with_totals=True):
    """Loss and gradient summed over `parts` micro-batches, as the trainer accumulates them."""
    logprobs, old, ref, adv, mask = _split_batch()
    logprobs.requires_grad_()
    totals = BatchTotals.of(mask) if with_totals else None
    size = len(LENGTHS) // parts
    total = 0.0
    for i in range(parts):
        s = slice(i * size, (i + 1) * size)
        loss, _ = grpo_loss(
            logprobs[s], old[s], adv[s], mask[s], cfg, ref_logprobs=ref[s], totals=totals, max_completion_length=8
        )
        (loss if with_totals else loss / parts).backward()
        total += loss.item() if with_totals else loss.item() / parts
    return total, logprobs.grad


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo", "sapo", "gmpo"])
@pytest.mark.parametrize("parts", [2, 4, 8])
def test_micro_batches_add_up_to_the_whole_batchs_loss_and_gradient(loss_type, parts):
    cfg = GRPOConfig(loss_type=loss_type, beta=0.04, epsilon=0.2)
    whole_loss, whole_grad = _accumulated(cfg, 1)
    loss, grad = _accumulated(cfg, parts)
    assert loss == pytest.approx(whole_loss, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-6, atol=1e-8)
    assert grad[sorted(LEFT_OUT)].abs().sum() == 0  # rows out of the loss get no gradient


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo", "gmpo"])
def test_normalising_each_micro_batch_by_itself_would_change_the_gradient(loss_type):
    """What the trainer did before: each micro-batch normalised by its own tokens (or sequences), divided by
    the number of micro-batches. The split-invariance test above catches exactly this."""
    cfg = GRPOConfig(loss_type=loss_type, beta=0.04)
    _, whole_grad = _accumulated(cfg, 1)
    _, naive_grad = _accumulated(cfg, 4, with_totals=False)
    assert (naive_grad - whole_grad).abs().max() > 1e-3


def test_batch_totals_count_loss_tokens_sequences_with_tokens_and_all_rows():
    *_, mask = _split_batch()
    assert BatchTotals.of(mask) == BatchTotals(tokens=5 + 1 + 2 + 3 + 6, sequences=5, rows=8)  # rows 0, 1, 3, 4, 5


# ---------------------------------------------------------------------------------------------------
# rollout correction: pi_old (the trainer's) / pi_engine


OLD_LP = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
ENGINE_LP = OLD_LP - torch.tensor([[1.0, 0.1, -0.2], [0.3, 0.4, 0.0]])  # log w: 1, 0.1, -0.2 | 0.3, 0.4, (pad)
CORR_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _correction(**cfg):
    return rollout_correction(OLD_LP, ENGINE_LP, CORR_MASK, RolloutCorrectionConfig(**cfg))


def test_tis_caps_token_weights_at_the_upper_bound():
    c = _correction(mode="tis", level="token", high=2.0)
    torch.testing.assert_close(c.weight[0], torch.tensor([2.0, E(0.1), E(-0.2)]))  # e^1 = 2.72 capped at 2
    torch.testing.assert_close(c.weight[1, :2], torch.tensor([E(0.3), E(0.4)]))
    assert c.truncated.tolist() == [[True, False, False], [False, False, False]]
    assert not c.masked.any()


def test_tis_lower_bound_raises_small_weights():
    c = _correction(mode="tis", level="token", low=0.9, high=2.0)
    assert c.weight[0, 2].item() == pytest.approx(0.9)  # e^-0.2 = 0.82 raised
    assert c.truncated[0].tolist() == [True, False, True]


def test_sequence_weight_is_the_product_of_the_token_ratios():
    c = _correction(mode="tis", level="sequence", high=5.0)
    torch.testing.assert_close(c.weight[0], torch.full((3,), E(0.9)))  # 1 + 0.1 - 0.2
    torch.testing.assert_close(c.weight[1], torch.full((3,), E(0.7)))  # padding does not count


def test_mis_masks_tokens_outside_the_bounds_and_keeps_the_others_weights():
    c = _correction(mode="mis", level="token", low=0.9, high=1.45)
    torch.testing.assert_close(c.weight[0], torch.tensor([0.0, E(0.1), 0.0]))
    torch.testing.assert_close(c.weight[1, :2], torch.tensor([E(0.3), 0.0]))  # e^0.4 = 1.49 > 1.45
    assert c.masked.tolist() == [[True, False, True], [False, True, False]]


def test_mis_at_sequence_level_masks_the_whole_sequence():
    c = _correction(mode="mis", level="sequence", high=2.2)  # e^0.9 = 2.46 > 2.2
    assert c.weight[0].tolist() == [0.0, 0.0, 0.0] and c.masked[0].all()
    torch.testing.assert_close(c.weight[1], torch.full((3,), E(0.7)))


def test_off_applies_no_weight_but_keeps_the_ratio_for_the_metrics():
    c = _correction(mode="off")
    assert c.weight.eq(1).all() and not c.truncated.any() and not c.masked.any()
    assert c.ratio[0, 0].item() == pytest.approx(E(1.0))


def test_the_correction_weights_the_policy_gradient_of_each_token():
    # Ratio pi_theta / pi_old = 1 (first update), A = [1, -1], dapo over 5 tokens: without correction a
    # token's gradient is -A / 5; with TIS (cap 2) it is -A * w / 5.
    logprobs, old, adv, mask = _batch(
        log_ratio=[[0.0] * 3] * 2, old=OLD_LP.tolist(), mask=CORR_MASK.tolist(), adv=[1.0, -1.0]
    )
    w = _correction(mode="tis", high=2.0).weight
    loss, grad, _ = _loss_and_grad(GRPOConfig(loss_type="dapo", beta=0.0), logprobs, old, adv, mask, correction=w)
    expected = torch.tensor([[-2.0, -E(0.1), -E(-0.2)], [E(0.3), E(0.4), 0.0]]) / 5
    torch.testing.assert_close(grad, expected)
    assert loss == pytest.approx(expected.sum().item())


def test_a_masked_token_gets_no_loss_not_even_kl_but_stays_in_the_normaliser():
    # MIS masks token (0, 0) and (0, 2) and (1, 1). beta = 0.1 with ref - logprob = 0.5 everywhere: the kept
    # tokens (0, 1) and (1, 0) get policy and KL gradients over 5 tokens; the masked ones none at all.
    logprobs, old, adv, mask = _batch(
        log_ratio=[[0.0] * 3] * 2, old=OLD_LP.tolist(), mask=CORR_MASK.tolist(), adv=[1.0, -1.0]
    )
    ref = logprobs.detach() + 0.5
    w = _correction(mode="mis", low=0.9, high=1.45).weight
    _, grad, _ = _loss_and_grad(
        GRPOConfig(loss_type="dapo", beta=0.1), logprobs, old, adv, mask, ref_logprobs=ref, correction=w
    )
    kl_grad = 0.1 * (1 - E(0.5))
    expected = torch.tensor([[0.0, -E(0.1) + kl_grad, 0.0], [E(0.3) + kl_grad, 0.0, 0.0]]) / 5
    torch.testing.assert_close(grad, expected)
