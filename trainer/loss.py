"""The GRPO loss: importance ratio, clipping, rollout correction, KL penalty and aggregation.

    per_token = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + eps_high) * A) * w + beta * KL_estimate

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
  sequence's tokens, then the sequences that have loss tokens; 'dapo' averages all loss tokens; 'dr_grpo'
  divides the token sum by rows * max_completion_length. Masked (mis) tokens stay in the normalisers.
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
    clipped_low: Tensor  # bool: ratio < 1 - epsilon with A < 0
    clipped_high: Tensor  # bool: ratio > 1 + eps_high with A > 0
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

    # ---- clipped surrogate, weighted by the rollout correction -----------------------------------
    low, high = 1 - cfg.epsilon, 1 + cfg.eps_high
    adv = advantages.to(logprobs.dtype).unsqueeze(1)  # [B, 1]
    per_token_loss = -torch.min(ratio * adv, torch.clamp(ratio, low, high) * adv) * weight

    # ---- KL penalty (not for tokens the correction masked) ---------------------------------------
    kl = kl_estimators(logprobs, ref_logprobs) if ref_logprobs is not None else None
    if cfg.beta > 0:
        per_token_loss = per_token_loss + cfg.beta * kl[cfg.kl_estimator] * (weight > 0)

    # ---- this batch's share of the whole batch's loss --------------------------------------------
    masked_loss = per_token_loss * mask_f
    if cfg.loss_type == "grpo":
        per_seq = masked_loss.sum(dim=1) / tokens_per_seq.clamp(min=1)
        loss = per_seq.sum() / max(totals.sequences, 1)
    elif cfg.loss_type == "dapo":
        loss = masked_loss.sum() / max(totals.tokens, 1)
    else:  # dr_grpo
        loss = masked_loss.sum() / (totals.rows * max_completion_length)

    with torch.no_grad():
        terms = LossTerms(
            ratio=ratio.detach(),
            clipped_low=(ratio < low) & (adv < 0),
            clipped_high=(ratio > high) & (adv > 0),
            kl=None if kl is None else {k: v.detach() for k, v in kl.items()},
        )
    return loss, terms
