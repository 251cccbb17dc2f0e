"""Group-relative advantages: how much better each completion did than its siblings.

Rewards arrive flat, `P * G` of them, grouped by prompt: completions `[p*G, (p+1)*G)` answer prompt p.
The choices made here:

- **Advantage = reward - group mean**, divided by a spread chosen by `scale_rewards`:
  'group' the group's reward std (GRPO), 'batch' the std of all rewards in the batch, 'none' nothing
  (Dr. GRPO: the std division biases towards too-easy and too-hard prompts). `eps` keeps a zero std
  from dividing by zero.
- **Std is TRL's:** the unbiased (Bessel-corrected, `torch.std` default) estimate, for the group and for
  the batch alike, with eps = 1e-4 added to it, so advantages read as they do in TRL. So does
  `frac_reward_zero_std`: the share of completions whose std (the one scaling their advantage; the group's
  for 'none') is zero, so under 'batch' it is 1 or 0. `frac_zero_std_groups` counts groups whose rewards
  are all equal, whatever the scaling.
- **Exclusion is a mask, not a zeroed advantage.** `loss_mask_seq` is False for a completion that
  should get no loss: truncated ones when `mask_truncated` (DAPO overlong filtering), and every member
  of a zero-std group when `drop_zero_std_groups`. The advantages themselves are left as computed (a
  zero-std group's are 0 anyway), so they can still be logged; the trainer zeroes the excluded rows of
  the completion mask. Truncated completions still count in their group's mean and std.
- **Rewards must be finite.** A NaN or inf reward would spread NaN through its whole group's advantages
  and then through the loss; it is rejected with the completions' indices instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor


@dataclass
class AdvantageResult:
    advantages: Tensor  # [P*G] float32: (reward - group mean) / (std + eps), or unscaled for 'none'
    loss_mask_seq: Tensor  # [P*G] bool: False for completions left out of the loss
    group_std: Tensor  # [P] unbiased std of each group's rewards
    frac_reward_zero_std: float  # TRL's: share of completions whose scaling std is zero
    frac_zero_std_groups: float  # share of groups whose rewards are all equal


def _check_advantage_inputs(
    rewards: Tensor, num_generations: int, scale_rewards: str, truncated: Tensor | None, mask_truncated: bool
) -> None:
    """Rewards flat, finite and in whole groups of G >= 2; a known scaling; truncation flags where needed."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a flat [P*G] tensor, got shape {tuple(rewards.shape)}")
    if num_generations < 2:
        raise ValueError(
            f"num_generations must be >= 2 (a group needs siblings to compare with), got {num_generations}"
        )
    if rewards.numel() == 0 or rewards.numel() % num_generations:
        raise ValueError(
            f"got {rewards.numel()} rewards, which is not a positive multiple of "
            f"num_generations={num_generations}; each prompt needs exactly G completions"
        )
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    non_finite = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if non_finite:
        bad = rewards[non_finite]
        kind = "NaN" if torch.isnan(bad).all() else ("inf" if torch.isinf(bad).all() else "NaN or inf")
        raise ValueError(
            f"a reward function returned {kind} for completion(s) {non_finite}; make it return a finite float"
        )
    if truncated is not None and tuple(truncated.shape) != tuple(rewards.shape):
        raise ValueError(f"truncated shape {tuple(truncated.shape)} must match rewards shape {tuple(rewards.shape)}")
    if mask_truncated and truncated is None:
        raise ValueError(
            "mask_truncated=True needs the `truncated` flags (finish_reason == 'length') of each completion"
        )


def compute_advantages(
    rewards: Tensor,
    num_generations: int,
    scale_rewards: Literal["group", "batch", "none"],
    truncated: Tensor | None = None,
    mask_truncated: bool = False,
    drop_zero_std_groups: bool = False,
    eps: float = 1e-4,
) -> AdvantageResult:
    """Advantages for `rewards` [P*G], grouped by consecutive runs of `num_generations`."""
    _check_advantage_inputs(rewards, num_generations, scale_rewards, truncated, mask_truncated)
    rewards = rewards.float()
    grouped = rewards.view(-1, num_generations)  # [P, G]
    group_mean = grouped.mean(dim=1, keepdim=True)
    group_std = grouped.std(dim=1)  # unbiased, as TRL
    advantages = (grouped - group_mean).flatten()

    if scale_rewards == "group":
        advantages = advantages / (group_std.repeat_interleave(num_generations) + eps)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + eps)

    zero_std = torch.isclose(group_std, torch.zeros_like(group_std))  # [P]
    if scale_rewards == "batch":
        batch_std = rewards.std()
        frac_reward_zero_std = float(torch.isclose(batch_std, torch.zeros_like(batch_std)))
    else:
        frac_reward_zero_std = zero_std.float().mean().item()
    loss_mask_seq = torch.ones_like(rewards, dtype=torch.bool)
    if mask_truncated:
        loss_mask_seq &= ~truncated.bool()
    if drop_zero_std_groups:
        loss_mask_seq &= ~zero_std.repeat_interleave(num_generations)

    return AdvantageResult(
        advantages=advantages,
        loss_mask_seq=loss_mask_seq,
        group_std=group_std,
        frac_reward_zero_std=frac_reward_zero_std,
        frac_zero_std_groups=zero_std.float().mean().item(),
    )
