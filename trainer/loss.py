"""The GRPO loss: importance ratio, clipping, rollout correction, KL penalty and aggregation.

    per_token = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + eps_high) * A) * w + beta * KL_estimate

`loss_type` grpo, dapo and dr_grpo differ only in the aggregation below. Three more replace the clipped term
with their paper's (r = ratio, A = advantage, sg = stop-gradient, w = rollout correction, |o_i| = the tokens of
sequence i, sums over loss tokens; tests/test_loss_variants.py checks each against a direct transcription of the
formula and against TRL's code):

- **cispo** (CISPO, MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by the clipped, stop-gradient IS weight, so
  a clipped token still has a gradient (scaled), unlike PPO's clip that drops it:
      J = 1 / sum_i |o_i| * sum_i sum_t sg(min(r_it, cispo_max_ratio)) * A_i * log pi_theta(o_it)
  (the paper's clip(r, 1 - eps_low^IS, 1 + eps_high^IS) with no lower bound, as the paper sets it; TRL's
  `loss_type='cispo'`). Token-mean aggregation over the batch, as dapo.
- **sapo** (Soft Adaptive Policy Optimization, arXiv 2511.20347): a sigmoid gate instead of the hard clip,
      J = 1/G sum_i 1/|o_i| sum_t f(r_it) A_i,   f(x) = sigmoid(tau (x - 1)) * 4 / tau,
  tau = sapo_temperature_pos if A_i > 0 else sapo_temperature_neg. Its gradient weight 4 s (1 - s) r (s the
  sigmoid) is exactly the policy gradient at r = 1 and fades smoothly off-policy. Aggregated as grpo.
- **gmpo** (Geometric-Mean Policy Optimization, arXiv 2507.20673): the geometric mean of the token terms,
      J = 1/G sum_i ( prod_t |min(r_it A_i, clip(r_it, e^-gmpo_epsilon, e^gmpo_epsilon_high) A_i)| )^(1/|o_i|) sgn(A_i)
  computed in log space as A_i * exp(mean_t clipped log r_it) (log r clipped one-sidedly by the sign of A, PPO's
  min written in logs, as the paper's code and TRL's GMPOTrainer). One term per sequence, mean over sequences;
  the KL is each sequence's token mean (as TRL). The rollout correction enters the geometric mean as a token
  factor (exp(mean_t (clipped log r_it + log w_it))), and a token mis masks drops out of it.

The choices made here (every option is a field of `GRPOConfig`, documented there):

- **Ratio** = exp(logprobs - old_logprobs) per token, where old_logprobs (pi_old) are the trainer's own
  logprobs before the step's first update; with `importance_sampling_level='sequence'` (GSPO) the
  log-ratio is the mean over the sequence's real tokens, one ratio per sequence. A clipped token
  contributes a constant, so no gradient.
- **Rollout correction** `w` (`rollout_correction`): pi_old / pi_engine for the engine that sampled,
  truncated (tis) or masked (mis), per token or per sequence. It weights the policy-gradient term only,
  as TRL does; a token whose weight is 0 (masked) gets no loss at all, its KL term included.
- **KL** to the reference by `kl_estimator` (k1 | k2 | k3), weighted by `beta`; `beta > 0` without
  `ref_logprobs` is an error, not a silent beta = 0.
- **Aggregation over the whole batch.** A step's batch may be split into micro-batches; each call returns
  its micro-batch's exact share of the whole batch's loss, using `BatchTotals` of the whole batch, so the
  shares add up to the same loss and gradient however the batch is split. 'grpo' averages each
  sequence's tokens, then the sequences that have loss tokens (so does 'sapo'; 'gmpo' averages its per-sequence
  terms over the same sequences); 'dapo' (and 'cispo') averages all loss tokens; 'dr_grpo' divides the token sum
  by rows * max_completion_length. Masked (mis) tokens stay in the normalisers.
- **Masks**: `completion_mask` is 1 for tokens that count in the loss; rows left out (truncated,
  zero-std groups) are all zero. Values at masked positions are ignored, even NaN; NaN in `old_logprobs`
  at a real token raises.
- **No stats here**: `LossTerms` hands back the detached per-token terms, and `trainer/metrics.py` turns the
  whole batch's terms into the reported numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.config import GRPOConfig, RolloutCorrectionConfig
from trainer.logprobs import kl_estimators


@dataclass(frozen=True)
class BatchTotals:
    """The whole batch's loss normalisers, fixed before the micro-batch loop."""

    tokens: int  # tokens that count in the loss (dapo)
    sequences: int  # sequences with at least one such token (grpo)
    rows: int  # all rows, those left out of the loss included (dr_grpo: rows * max_completion_length)

    @classmethod
    def of(cls, loss_mask: Tensor) -> BatchTotals:
        per_row = loss_mask.bool().sum(dim=1)
        return cls(tokens=int(per_row.sum()), sequences=int((per_row > 0).sum()), rows=int(loss_mask.shape[0]))


@dataclass
class LossTerms:
    """Detached per-token terms of one call, [B, T] (sequence-level values repeated over their tokens)."""

    ratio: Tensor  # pi_theta / pi_old
    clipped_low: Tensor  # bool: ratio < 1 - epsilon with A < 0 (gmpo: log-ratio < -gmpo_epsilon; cispo, sapo: none)
    clipped_high: Tensor  # bool: ratio > 1 + eps_high with A > 0 (gmpo: log-ratio > gmpo_eps_high; cispo: ratio >
    #                       cispo_max_ratio, TRL's cispo_clip_ratio; sapo: none, its gate is soft)
    kl: dict[str, Tensor] | None  # k1, k2, k3 when ref_logprobs were given

    @staticmethod
    def cat(parts: list[LossTerms]) -> LossTerms:
        kl = None if parts[0].kl is None else {k: torch.cat([p.kl[k] for p in parts]) for k in parts[0].kl}
        return LossTerms(
            torch.cat([p.ratio for p in parts]),
            torch.cat([p.clipped_low for p in parts]),
            torch.cat([p.clipped_high for p in parts]),
            kl,
        )


@dataclass
class Correction:
    """The rollout-correction weight of each token, [B, T], and which tokens the bounds changed."""

    weight: Tensor  # w applied to the policy-gradient term (1 everywhere with mode off)
    ratio: Tensor  # pi_old / pi_engine before the bounds (per sequence for level 'sequence')
    truncated: Tensor  # bool: tis moved w to a bound
    masked: Tensor  # bool: mis set w to 0


def rollout_correction(
    old_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, cfg: RolloutCorrectionConfig
) -> Correction:
    """Weights pi_old / pi_engine for the tokens of `mask` ([B, T]), bounded by `cfg`. Engine logprobs must
    be finite wherever `mask` is 1 unless cfg.mode is 'off' (the caller checks and names the engine)."""
    real = mask.bool() & torch.isfinite(engine_logprobs)
    log_ratio = torch.where(real, old_logprobs - engine_logprobs, torch.zeros_like(old_logprobs))
    if cfg.level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(old_logprobs)
    ratio = torch.exp(log_ratio)
    outside = (ratio < cfg.low) | (ratio > cfg.high)
    none = torch.zeros_like(real)
    if cfg.mode == "tis":
        return Correction(torch.clamp(ratio, cfg.low, cfg.high), ratio, outside & real, none)
    if cfg.mode == "mis":
        return Correction(torch.where(outside, torch.zeros_like(ratio), ratio), ratio, none, outside & real)
    return Correction(torch.ones_like(ratio), ratio, none, none)


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    cfg: GRPOConfig,
    ref_logprobs: Tensor | None = None,
    correction: Tensor | None = None,
    totals: BatchTotals | None = None,
    max_completion_length: int | None = None,
) -> tuple[Tensor, LossTerms]:
    """This (micro-)batch's share of the whole batch's loss, and its detached terms. logprobs, old_logprobs,
    ref_logprobs, correction, completion_mask are [B, T]; advantages [B]. `totals` are the whole batch's
    (default: this batch is the whole batch). Gradients flow through `logprobs` only."""
    # ---- check the inputs ------------------------------------------------------------------------
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    named = {"old_logprobs": old_logprobs, "completion_mask": completion_mask}
    if ref_logprobs is not None:
        named["ref_logprobs"] = ref_logprobs
    if correction is not None:
        named["correction"] = correction
    for name, tensor in named.items():
        if tensor.shape != logprobs.shape:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} does not match logprobs shape "
                f"{tuple(logprobs.shape)}; both must be [B, T] over the same completion tokens"
            )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} must be [B] = {tuple(logprobs.shape[:1])} "
            f"for logprobs of shape {tuple(logprobs.shape)}: one advantage per sequence"
        )
    if cfg.loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError(
            "loss_type='dr_grpo' divides by batch * max_completion_length; "
            "pass max_completion_length (rollout.max_tokens)"
        )
    if cfg.beta > 0 and ref_logprobs is None:
        raise ValueError(
            f"grpo.beta={cfg.beta} but no ref_logprobs were given; pass the reference model's "
            f"logprobs or set grpo.beta=0 to train without a KL penalty"
        )

    mask = completion_mask.bool()
    mask_f = mask.to(logprobs.dtype)
    nan_old = int((torch.isnan(old_logprobs) & mask).sum())
    if nan_old:
        raise ValueError(
            f"old logprobs contain NaN for {nan_old} tokens; pi_old must be the trainer's own logprobs "
            f"of every sampled token; a NaN must not become ratio 1"
        )
    # Values at masked positions are ignored; replace them so that NaN cannot leak through 0 * NaN.
    old_logprobs = torch.where(mask, old_logprobs, logprobs.detach())
    if ref_logprobs is not None:
        ref_logprobs = torch.where(mask, ref_logprobs, logprobs.detach())
    weight = torch.ones_like(logprobs) if correction is None else torch.where(mask, correction.to(logprobs.dtype), 0.0)
    totals = totals or BatchTotals.of(completion_mask)
    tokens_per_seq = mask_f.sum(dim=1)  # [B]

    # ---- importance ratio ------------------------------------------------------------------------
    log_ratio = logprobs - old_logprobs  # [B, T]
    if cfg.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask_f).sum(dim=1) / tokens_per_seq.clamp(min=1)).unsqueeze(1)  # [B, 1]
    ratio = torch.exp(log_ratio).expand_as(logprobs)  # [B, T]

    adv = advantages.to(logprobs.dtype).unsqueeze(1)  # [B, 1]
    kl = kl_estimators(logprobs, ref_logprobs) if ref_logprobs is not None else None
    if cfg.loss_type == "gmpo":
        loss, clipped_low, clipped_high = _gmpo(log_ratio, adv, mask, weight, kl, tokens_per_seq, totals, cfg)
        return loss, _terms(ratio, clipped_low, clipped_high, kl)

    # ---- the policy term of each token, weighted by the rollout correction -----------------------
    none = torch.zeros_like(mask)
    if cfg.loss_type == "cispo":
        per_token_loss = -torch.clamp(ratio, max=cfg.cispo_max_ratio).detach() * adv * logprobs
        clipped_low, clipped_high = none, (ratio > cfg.cispo_max_ratio) & (adv > 0)
    elif cfg.loss_type == "sapo":
        tau = torch.full_like(adv, cfg.sapo_temperature_neg).masked_fill(adv > 0, cfg.sapo_temperature_pos)
        per_token_loss = -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * adv
        clipped_low, clipped_high = none, none
    else:  # the clipped surrogate
        low, high = 1 - cfg.epsilon, 1 + cfg.eps_high
        per_token_loss = -torch.min(ratio * adv, torch.clamp(ratio, low, high) * adv)
        clipped_low, clipped_high = (ratio < low) & (adv < 0), (ratio > high) & (adv > 0)
    per_token_loss = per_token_loss * weight

    # ---- KL penalty (not for tokens the correction masked) ---------------------------------------
    if cfg.beta > 0:
        per_token_loss = per_token_loss + cfg.beta * kl[cfg.kl_estimator] * (weight > 0)

    # ---- this batch's share of the whole batch's loss --------------------------------------------
    masked_loss = per_token_loss * mask_f
    if cfg.loss_type in ("grpo", "sapo"):
        per_seq = masked_loss.sum(dim=1) / tokens_per_seq.clamp(min=1)
        loss = per_seq.sum() / max(totals.sequences, 1)
    elif cfg.loss_type in ("dapo", "cispo"):
        loss = masked_loss.sum() / max(totals.tokens, 1)
    else:  # dr_grpo
        loss = masked_loss.sum() / (totals.rows * max_completion_length)
    return loss, _terms(ratio, clipped_low, clipped_high, kl)


def _gmpo(
    log_ratio: Tensor,
    adv: Tensor,
    mask: Tensor,
    weight: Tensor,
    kl: dict[str, Tensor] | None,
    tokens_per_seq: Tensor,
    totals: BatchTotals,
    cfg: GRPOConfig,
) -> tuple[Tensor, Tensor, Tensor]:
    """GMPO's share of the loss (module docstring), and its clip flags. log_ratio is per token ([B, T])."""
    bound = torch.clamp(log_ratio, -cfg.gmpo_epsilon, cfg.gmpo_eps_high)
    clipped_log_ratio = torch.where(adv > 0, torch.minimum(log_ratio, bound), torch.maximum(log_ratio, bound))
    kept = mask & (weight > 0)  # tokens in the geometric mean: a token mis masked drops out
    n_kept = kept.sum(dim=1)
    log_w = torch.log(torch.where(kept, weight, torch.ones_like(weight)))
    log_mean = torch.where(kept, clipped_log_ratio + log_w, 0.0).sum(dim=1) / n_kept.clamp(min=1)
    per_seq = torch.where(n_kept > 0, -torch.exp(log_mean) * adv[:, 0], 0.0)  # [B]
    if cfg.beta > 0:
        per_seq = per_seq + cfg.beta * torch.where(kept, kl[cfg.kl_estimator], 0.0).sum(dim=1) / tokens_per_seq.clamp(
            min=1
        )
    loss = per_seq.sum() / max(totals.sequences, 1)
    return loss, (log_ratio < -cfg.gmpo_epsilon) & (adv < 0), (log_ratio > cfg.gmpo_eps_high) & (adv > 0)


def _terms(ratio: Tensor, clipped_low: Tensor, clipped_high: Tensor, kl: dict[str, Tensor] | None) -> LossTerms:
    return LossTerms(
        ratio=ratio.detach(),
        clipped_low=clipped_low.detach(),
        clipped_high=clipped_high.detach(),
        kl=None if kl is None else {k: v.detach() for k, v in kl.items()},
    )
