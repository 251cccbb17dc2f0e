"""The GRPO loss: importance ratio, clipping, KL penalty and aggregation, in one function.

    per_token = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + eps_high) * A) + beta * KL_estimate

The choices made here (every option is a field of `GRPOConfig`, documented there):

- **Ratio** = exp(logprobs - old_logprobs) per token; with `importance_sampling_level='sequence'`
  (GSPO) the log-ratio is the mean over the sequence's real tokens, one ratio per sequence, broadcast
  to its tokens.
- **Clipping** with a separate upper bound (`epsilon_high`, DAPO clip-higher). A token whose ratio is
  clipped contributes a constant, so no gradient.
- **KL** to the reference, per token, by the estimator `kl_estimator` (k1 | k2 | k3, see
  logprobs.kl_estimators), weighted by `beta`. `beta > 0` without `ref_logprobs` is an error, not a
  silent beta = 0. All three estimators are reported whenever `ref_logprobs` is given.
- **Aggregation** (`loss_type`): 'grpo' averages each sequence's tokens, then the sequences that have
  tokens; 'dapo' averages all real tokens of the batch; 'dr_grpo' sums them and divides by
  B * max_completion_length, a constant that does not depend on the lengths sampled.
- **Masks**: `completion_mask` is 1 for real completion tokens. Sequences left out of the loss (truncated,
  zero-std groups) arrive as all-zero rows. Values at masked positions are ignored, even NaN.
- **Missing old logprobs are the caller's decision.** NaN in `old_logprobs` at a real token raises:
  treating it as ratio 1 would silently turn importance sampling into REINFORCE.
- **Stats** are masked means over real tokens, with TRL's names: 'kl', 'clip_ratio/low_mean',
  'clip_ratio/high_mean', 'clip_ratio/region_mean'; plus 'kl/k1|k2|k3', 'is/mean_importance_ratio' and
  'is/clip_fraction' (= clip_ratio/region_mean).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from trainer.config import GRPOConfig
from trainer.logprobs import kl_estimators


def grpo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, completion_mask: Tensor,
              cfg: GRPOConfig, ref_logprobs: Optional[Tensor] = None,
              max_completion_length: Optional[int] = None) -> tuple[Tensor, dict[str, float]]:
    """Scalar loss and its stats for one batch. logprobs, old_logprobs, ref_logprobs, completion_mask
    are [B, T]; advantages [B]. Gradients flow through `logprobs` only."""
    # ---- check the inputs ------------------------------------------------------------------------
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    named = {"old_logprobs": old_logprobs, "completion_mask": completion_mask}
    if ref_logprobs is not None:
        named["ref_logprobs"] = ref_logprobs
    for name, tensor in named.items():
        if tensor.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} does not match logprobs shape "
                             f"{tuple(logprobs.shape)}; both must be [B, T] over the same completion tokens")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages shape {tuple(advantages.shape)} must be [B] = {tuple(logprobs.shape[:1])} "
                         f"for logprobs of shape {tuple(logprobs.shape)}: one advantage per sequence")
    if cfg.loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' divides by batch * max_completion_length; "
                         "pass max_completion_length (rollout.max_tokens)")
    if cfg.beta > 0 and ref_logprobs is None:
        raise ValueError(f"grpo.beta={cfg.beta} but no ref_logprobs were given; pass the reference model's "
                         f"logprobs or set grpo.beta=0 to train without a KL penalty")

    mask = completion_mask.bool()
    mask_f = mask.to(logprobs.dtype)
    nan_old = int((torch.isnan(old_logprobs) & mask).sum())
    if nan_old:
        raise ValueError(f"old logprobs contain NaN for {nan_old} tokens; the engine's logprobs are missing or "
                         f"unreadable. Recompute them (grpo.old_logprobs='recompute') or fix the trajectory "
                         f"reader before calling the loss; a NaN must not become ratio 1 (REINFORCE)")
    # Values at masked positions are ignored; replace them so that NaN cannot leak through 0 * NaN.
    old_logprobs = torch.where(mask, old_logprobs, logprobs.detach())
    if ref_logprobs is not None:
        ref_logprobs = torch.where(mask, ref_logprobs, logprobs.detach())

    tokens_per_seq = mask_f.sum(dim=1)                                   # [B]
    num_tokens = tokens_per_seq.sum()

    def masked_mean(values: Tensor) -> float:
        return ((values * mask_f).sum() / num_tokens.clamp(min=1)).item()

    # ---- importance ratio ------------------------------------------------------------------------
    log_ratio = logprobs - old_logprobs                                  # [B, T]
    if cfg.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask_f).sum(dim=1) / tokens_per_seq.clamp(min=1)).unsqueeze(1)  # [B, 1]
    ratio = torch.exp(log_ratio).expand_as(logprobs)                     # [B, T]

    # ---- clipped surrogate -----------------------------------------------------------------------
    low, high = 1 - cfg.epsilon, 1 + cfg.eps_high
    adv = advantages.to(logprobs.dtype).unsqueeze(1)                     # [B, 1]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, low, high) * adv
    per_token_loss = -torch.min(unclipped, clipped)                      # [B, T]

    # ---- KL penalty ------------------------------------------------------------------------------
    kl = kl_estimators(logprobs, ref_logprobs) if ref_logprobs is not None else None
    if cfg.beta > 0:
        per_token_loss = per_token_loss + cfg.beta * kl[cfg.kl_estimator]

    # ---- aggregation -----------------------------------------------------------------------------
    masked_loss = per_token_loss * mask_f
    if cfg.loss_type == "grpo":
        has_tokens = tokens_per_seq > 0
        per_seq = masked_loss.sum(dim=1) / tokens_per_seq.clamp(min=1)
        loss = (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1)
    elif cfg.loss_type == "dapo":
        loss = masked_loss.sum() / num_tokens.clamp(min=1)
    else:  # dr_grpo
        loss = masked_loss.sum() / (logprobs.shape[0] * max_completion_length)

    # ---- stats -----------------------------------------------------------------------------------
    with torch.no_grad():
        is_low = (ratio < low) & (adv < 0)
        is_high = (ratio > high) & (adv > 0)
        stats = {
            "clip_ratio/low_mean": masked_mean(is_low.float()),
            "clip_ratio/high_mean": masked_mean(is_high.float()),
            "clip_ratio/region_mean": masked_mean((is_low | is_high).float()),
            "is/mean_importance_ratio": masked_mean(ratio),
        }
        stats["is/clip_fraction"] = stats["clip_ratio/region_mean"]
        if kl is not None:
            for name in ("k1", "k2", "k3"):
                stats[f"kl/{name}"] = masked_mean(kl[name])
            stats["kl"] = stats["kl/k3"]
    return loss, stats
