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
- **One typed input, a registry of losses.** `grpo_loss` checks its tensors once and prepares a `LossInputs` (each
  tensor's shape written beside it: the ratio, the KL estimates, the correction weights, the masks); the loss of
  `loss_type` is looked up in `POLICY_LOSSES` (`register_policy_loss`, as verl's) and answers a `LossOutputs`. A new
  variant is one registered function of `LossInputs`.
- **No stats here**: `LossTerms` hands back the detached per-token terms, and `trainer/metrics.py` turns the
  whole batch's terms into the reported numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

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


# ------------------------------------------------------------------------ the loss of one (micro-)batch


@dataclass
class LossInputs:
    """What every policy loss reads, checked and prepared once: values at masked positions replaced (so NaN cannot
    leak through 0 * NaN), the importance ratio and the KL estimates computed."""

    logprobs: Annotated[Tensor, "batch seq"]  # log pi_theta of the sampled tokens; gradients flow through these only
    old_logprobs: Annotated[Tensor, "batch seq"]  # log pi_old, the trainer's before the step's first update
    advantages: Annotated[Tensor, "batch 1"]  # one per sequence, in the logprobs' dtype
    mask: Annotated[Tensor, "batch seq"]  # bool: the tokens that count in the loss
    weight: Annotated[Tensor, "batch seq"]  # rollout correction w (0 off the mask; 1 everywhere without one)
    log_ratio: Annotated[Tensor, "batch seq"]  # log pi_theta - log pi_old; [batch 1] at importance_sampling_level
    #                                            sequence (the sequence's mean)
    ratio: Annotated[Tensor, "batch seq"]  # exp(log_ratio), a sequence's repeated over its tokens
    kl: dict[str, Annotated[Tensor, "batch seq"]] | None  # k1, k2, k3 to the reference (None without one)
    tokens_per_seq: Annotated[Tensor, "batch"]  # loss tokens of each sequence
    totals: BatchTotals  # the whole batch's normalisers
    max_completion_length: int | None  # rollout.max_tokens (dr_grpo's normaliser)

    @classmethod
    def of(cls, logprobs, old_logprobs, advantages, mask, cfg, ref_logprobs, correction, totals, max_len) -> LossInputs:
        mask = mask.bool()
        mask_f = mask.to(logprobs.dtype)
        old_logprobs = torch.where(mask, old_logprobs, logprobs.detach())
        if ref_logprobs is not None:
            ref_logprobs = torch.where(mask, ref_logprobs, logprobs.detach())
        weight = (
            torch.ones_like(logprobs) if correction is None else torch.where(mask, correction.to(mask_f.dtype), 0.0)
        )
        tokens_per_seq = mask_f.sum(dim=1)
        log_ratio = logprobs - old_logprobs
        if cfg.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask_f).sum(dim=1) / tokens_per_seq.clamp(min=1)).unsqueeze(1)
        return cls(
            logprobs=logprobs,
            old_logprobs=old_logprobs,
            advantages=advantages.to(logprobs.dtype).unsqueeze(1),
            mask=mask,
            weight=weight,
            log_ratio=log_ratio,
            ratio=torch.exp(log_ratio).expand_as(logprobs),
            kl=kl_estimators(logprobs, ref_logprobs) if ref_logprobs is not None else None,
            tokens_per_seq=tokens_per_seq,
            totals=totals,
            max_completion_length=max_len,
        )


@dataclass
class LossOutputs:
    """A policy loss's answer: this batch's share of the whole batch's loss, and which tokens it clipped."""

    loss: Annotated[Tensor, ""]  # a scalar, with gradient
    clipped_low: Annotated[Tensor, "batch seq"]  # bool (metrics.py's clip_ratio/low_*)
    clipped_high: Annotated[Tensor, "batch seq"]  # bool (clip_ratio/high_*)


PolicyLoss = Callable[[LossInputs, GRPOConfig], LossOutputs]
POLICY_LOSSES: dict[str, PolicyLoss] = {}  # grpo.loss_type -> its loss


def register_policy_loss(*names: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Make the decorated function the loss of each `grpo.loss_type` in `names`."""

    def register(fn: PolicyLoss) -> PolicyLoss:
        POLICY_LOSSES.update(dict.fromkeys(names, fn))
        return fn

    return register


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
    """This (micro-)batch's share of the whole batch's loss by `cfg.loss_type`, and its detached terms. logprobs,
    old_logprobs, ref_logprobs, correction, completion_mask are [B, T]; advantages [B]. `totals` are the whole
    batch's (default: this batch is the whole batch). Gradients flow through `logprobs` only."""
    _check_inputs(
        logprobs, old_logprobs, advantages, completion_mask, cfg, ref_logprobs, correction, max_completion_length
    )
    totals = totals or BatchTotals.of(completion_mask)
    x = LossInputs.of(
        logprobs,
        old_logprobs,
        advantages,
        completion_mask,
        cfg,
        ref_logprobs,
        correction,
        totals,
        max_completion_length,
    )
    out = POLICY_LOSSES[cfg.loss_type](x, cfg)
    return out.loss, _terms(x.ratio, out.clipped_low, out.clipped_high, x.kl)


def _check_inputs(logprobs, old_logprobs, advantages, completion_mask, cfg, ref_logprobs, correction, max_len) -> None:
    """Shapes that match ([B, T] and [B]), dr_grpo's max length, a reference when beta > 0, and no NaN pi_old at a
    loss token."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    named = {"old_logprobs": old_logprobs, "completion_mask": completion_mask}
    named.update({"ref_logprobs": ref_logprobs, "correction": correction})
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} does not match logprobs shape "
                f"{tuple(logprobs.shape)}; both must be [B, T] over the same completion tokens"
            )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} must be [B] = {tuple(logprobs.shape[:1])} "
            f"for logprobs of shape {tuple(logprobs.shape)}: one advantage per sequence"
        )
    if cfg.loss_type == "dr_grpo" and max_len is None:
        raise ValueError(
            "loss_type='dr_grpo' divides by batch * max_completion_length; "
            "pass max_completion_length (rollout.max_tokens)"
        )
    if cfg.beta > 0 and ref_logprobs is None:
        raise ValueError(
            f"grpo.beta={cfg.beta} but no ref_logprobs were given; pass the reference model's "
            f"logprobs or set grpo.beta=0 to train without a KL penalty"
        )
    nan_old = int((torch.isnan(old_logprobs) & completion_mask.bool()).sum())
    if nan_old:
        raise ValueError(
            f"old logprobs contain NaN for {nan_old} tokens; pi_old must be the trainer's own logprobs "
            f"of every sampled token; a NaN must not become ratio 1"
        )


# ------------------------------------------------------------------------ the losses (module docstring)


@register_policy_loss("grpo", "dapo", "dr_grpo")
def clipped_surrogate(x: LossInputs, cfg: GRPOConfig) -> LossOutputs:
    """PPO's clipped surrogate, -min(r A, clip(r, 1 - epsilon, 1 + eps_high) A); the three differ in aggregation."""
    low, high = 1 - cfg.epsilon, 1 + cfg.eps_high
    per_token = -torch.min(x.ratio * x.advantages, torch.clamp(x.ratio, low, high) * x.advantages)
    clipped_low, clipped_high = (x.ratio < low) & (x.advantages < 0), (x.ratio > high) & (x.advantages > 0)
    return LossOutputs(_aggregate(x, per_token, cfg), clipped_low, clipped_high)


@register_policy_loss("cispo")
def cispo(x: LossInputs, cfg: GRPOConfig) -> LossOutputs:
    """-sg(min(r, cispo_max_ratio)) A log pi_theta: a capped token keeps a (scaled) gradient."""
    per_token = -torch.clamp(x.ratio, max=cfg.cispo_max_ratio).detach() * x.advantages * x.logprobs
    capped = (x.ratio > cfg.cispo_max_ratio) & (x.advantages > 0)
    return LossOutputs(_aggregate(x, per_token, cfg), torch.zeros_like(x.mask), capped)


@register_policy_loss("sapo")
def sapo(x: LossInputs, cfg: GRPOConfig) -> LossOutputs:
    """-sigmoid(tau (r - 1)) 4 / tau A: a soft gate, so nothing counts as clipped."""
    adv = x.advantages
    tau = torch.full_like(adv, cfg.sapo_temperature_neg).masked_fill(adv > 0, cfg.sapo_temperature_pos)
    per_token = -torch.sigmoid(tau * (x.ratio - 1)) * (4 / tau) * adv
    return LossOutputs(_aggregate(x, per_token, cfg), torch.zeros_like(x.mask), torch.zeros_like(x.mask))


@register_policy_loss("gmpo")
def gmpo(x: LossInputs, cfg: GRPOConfig) -> LossOutputs:
    """-A exp(mean_t (clipped log r + log w)) per sequence (the geometric mean), plus each sequence's token-mean KL;
    the mean over the batch's sequences. A token mis masked (w = 0) drops out of the mean."""
    adv, log_ratio = x.advantages, x.log_ratio
    bound = torch.clamp(log_ratio, -cfg.gmpo_epsilon, cfg.gmpo_eps_high)
    clipped_log_ratio = torch.where(adv > 0, torch.minimum(log_ratio, bound), torch.maximum(log_ratio, bound))
    kept = x.mask & (x.weight > 0)
    n_kept = kept.sum(dim=1)
    log_w = torch.log(torch.where(kept, x.weight, torch.ones_like(x.weight)))
    log_mean = torch.where(kept, clipped_log_ratio + log_w, 0.0).sum(dim=1) / n_kept.clamp(min=1)
    per_seq = torch.where(n_kept > 0, -torch.exp(log_mean) * adv[:, 0], 0.0)  # [B]
    if cfg.beta > 0:
        kl = torch.where(kept, x.kl[cfg.kl_estimator], 0.0).sum(dim=1)
        per_seq = per_seq + cfg.beta * kl / x.tokens_per_seq.clamp(min=1)
    loss = per_seq.sum() / max(x.totals.sequences, 1)
    return LossOutputs(loss, (log_ratio < -cfg.gmpo_epsilon) & (adv < 0), (log_ratio > cfg.gmpo_eps_high) & (adv > 0))


def _aggregate(x: LossInputs, per_token: Tensor, cfg: GRPOConfig) -> Tensor:
    """The per-token policy term weighted by the rollout correction, plus beta * KL (not where the correction masked),
    summed over loss tokens as `cfg.loss_type` aggregates: this batch's share of the whole batch's loss."""
    per_token = per_token * x.weight
    if cfg.beta > 0:
        per_token = per_token + cfg.beta * x.kl[cfg.kl_estimator] * (x.weight > 0)
    masked = per_token * x.mask.to(x.logprobs.dtype)
    if cfg.loss_type in ("grpo", "sapo"):  # each sequence's token mean, then the mean over sequences
        return (masked.sum(dim=1) / x.tokens_per_seq.clamp(min=1)).sum() / max(x.totals.sequences, 1)
    if cfg.loss_type in ("dapo", "cispo"):  # the mean over all loss tokens
        return masked.sum() / max(x.totals.tokens, 1)
    return masked.sum() / (x.totals.rows * x.max_completion_length)  # dr_grpo: over rows * max_completion_length


def _terms(ratio: Tensor, clipped_low: Tensor, clipped_high: Tensor, kl: dict[str, Tensor] | None) -> LossTerms:
    return LossTerms(
        ratio=ratio.detach(),
        clipped_low=clipped_low.detach(),
        clipped_high=clipped_high.detach(),
        kl=None if kl is None else {k: v.detach() for k, v in kl.items()},
    )
