"""Padding-free (packed) forward passes for the training step (grpo.pack_sequences).

A GRPO batch is [B, L]: left-padded prompts followed by right-padded completions, so every row costs L positions
in every layer, whatever its real length. Packed, each row's real tokens (prompt and completion, no pads) are laid
end to end into as few rows ("bins") of at most L tokens as first-fit-decreasing finds, with position ids that
restart at 0 for each sequence and no attention mask. transformers then builds a block-diagonal causal mask from
the position ids (`masking_utils.find_packed_sequence_indices`; flash-attention-2 reads them as varlen boundaries),
so no token sees another sequence. The hidden states at the positions that predict each completion token are
gathered back to [B, Tc] and go through the same chunked lm_head + log-softmax as the padded path: logprobs,
entropies and gradients equal the padded forward's to rounding (tests/test_packing.py).

What it saves: the linear layers (most of a small model's FLOPs and activations) see the real tokens and a bin's
trailing pads only. What it does not: with sdpa a bin still costs a dense L x L attention block (flash-attention
skips the masked blocks). It pays when lengths vary, which they do in GRPO; with every completion at max_tokens
and equal prompts nothing is saved.

A model whose attention ignores packed position ids would let sequences see each other: `check_packing`
(trainer/logprobs.py, beside the two forwards it compares) compares packed and padded logprobs on two short
sequences when the trainer starts, and the trainer refuses the setting if they differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Packing:
    """Rows packed into bins, and where each completion token's prediction lands."""

    input_ids: Tensor  # [bins, width]: sequences end to end, then pad
    position_ids: Tensor  # [bins, width]: 0.. per sequence (and per trailing pad run)
    bin_of: Tensor  # [B, Tc]: the bin of the position that predicts completion token (b, j)
    column_of: Tensor  # [B, Tc]: its column; (0, 0) where (b, j) is completion padding
    real: Tensor  # [B, Tc] bool: (b, j) is a real completion token


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Row indices grouped into bins whose lengths sum to at most `capacity`, longest rows placed first."""
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        if lengths[row] > capacity:
            raise ValueError(f"row {row} has {lengths[row]} tokens, more than a bin's {capacity}")
        slot = next((i for i, free in enumerate(room) if free >= lengths[row]), None)
        if slot is None:
            bins.append([])
            room.append(capacity)
            slot = len(bins) - 1
        bins[slot].append(row)
        room[slot] -= lengths[row]
    return bins


def pack(input_ids: Tensor, attention_mask: Tensor, completion_len: int) -> Packing:
    """Pack a [B, L] batch of left-padded prompts + right-padded completions (attention_mask 1 on real tokens, one
    contiguous run per row) into bins of width L."""
    batch, width = input_ids.shape
    mask = attention_mask.bool().cpu()
    lengths = mask.sum(-1).tolist()
    starts = [int(row.nonzero()[0]) if n else 0 for row, n in zip(mask, lengths)]
    for b, (start, n) in enumerate(zip(starts, lengths)):
        if n and not bool(mask[b, start : start + n].all()):
            raise ValueError(f"row {b}: attention_mask marks no single run of real tokens; cannot pack it")
    bins = first_fit_decreasing(lengths, width)
    ids = torch.zeros(len(bins), width, dtype=input_ids.dtype)
    positions = torch.zeros(len(bins), width, dtype=torch.long)
    bin_of = torch.zeros(batch, completion_len, dtype=torch.long)
    column_of = torch.zeros(batch, completion_len, dtype=torch.long)
    real = torch.zeros(batch, completion_len, dtype=torch.bool)
    source = input_ids.cpu()
    first_completion = width - completion_len
    for k, rows in enumerate(bins):
        offset = 0
        for b in rows:
            start, n = starts[b], lengths[b]
            ids[k, offset : offset + n] = source[b, start : start + n]
            positions[k, offset : offset + n] = torch.arange(n)
            # completion token j sits at padded column first_completion + j, predicted from the column before it
            end = start + n  # one past the row's last real token
            j = torch.arange(completion_len)
            column = first_completion + j
            is_real = (column >= start) & (column < end) & (column - 1 >= start)
            bin_of[b, is_real] = k
            column_of[b, is_real] = offset + (column[is_real] - 1 - start)
            real[b] = is_real
            offset += n
        positions[k, offset:] = torch.arange(width - offset)  # the trailing pad is a sequence of its own
    device = input_ids.device
    return Packing(ids.to(device), positions.to(device), bin_of.to(device), column_of.to(device), real.to(device))
