"""Several LoRA adapters in one batch as tensor code a compiled decode step can hold: stacked weights and a per-row
adapter index (the BGMV idea of Punica and S-LoRA, in plain torch).

peft's per-row `adapter_names` (and engines/hf.py's `_adapters_by_rows`) loop in Python over the adapters of every
LoRA layer, gathering and scattering each one's rows: a graph cannot hold that, so concurrent trials decoded outside
the compiled step. Here each LoRA Linear holds its slots' adapters stacked:

    A [N, r, in]   B [N, out, r]   scale [N]      (r the largest rank; a smaller rank's rows of A and columns of B
                                                   are zeros, as is a slot whose adapter does not adapt the layer)

and adds, for a batch row whose adapter is slot k, scale[k] * B[k] (A[k] x). It is computed for all rows at once:

    u = x @ A.view(N * r, in)^T            [rows, T, N * r]   every slot's down-projection (N * r columns: small)
    u = u * (one_hot(k) * scale)[row]      zeros but the row's own slot
    y = u @ B.permute(1, 0, 2).view(out, N * r)^T

two dense matmuls with fixed shapes and no Python per row or data-dependent host sync. Gathering each row's A[k]
instead would read rows x r x in weights per layer (at 256 rows more bytes than the model's own weights each token
step); the N-fold down-projection costs N * r / out of the base matmul (4 adapters of rank 16 at out 1024: 6 %).
The zeros add exact zeros, so a row's value is its adapter's alone up to the order of the sums: on the tiny model's
logits in fp32, 3-5e-6 from peft's per-row forward, each as far from the fp64 forward (tests/test_stacked_lora.py).

Weights stay in sync by `refresh`, which copies every slot's adapter into the stacked tensors in place (LoRA weights
only, a few MB; addresses never move, so a CUDA graph recorded over them stays valid): the engine refreshes before
each generate call, after whatever optimizer steps came between. Slots keep their place while the adapter set
changes (a trial leaves, the next takes its slot): the shapes, and so the compiled graph, change only when more
slots or a larger rank are needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch


def plain_lora_linears(model) -> list | None:
    """The model's LoRA layers when every one is a plain LoRA Linear (no DoRA or other variant, no LoRA bias, no
    embedding or convolution adapter, not merged): those the stacked forward (and engines/hf.py's row slices) can
    take over. None otherwise (peft's per-row path then)."""
    from peft.tuners.lora import Linear, LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for m in layers:
        if type(m) is not Linear or getattr(m, "lora_variant", None) or m.merged:
            return None
        if any(b.bias is not None for b in m.lora_B.values()):
            return None
    return layers


class _Stack:
    """One LoRA Linear's slots, stacked: A [N, r, in], B as [out, N * r], scale [N]."""

    def __init__(self, layer, slots: int, rank: int):
        a_any = next(iter(layer.lora_A.values())).weight
        dtype, device = a_any.dtype, a_any.device
        self.a = torch.zeros(slots, rank, layer.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(layer.out_features, slots, rank, dtype=dtype, device=device)
        self.scale = torch.zeros(slots, dtype=dtype, device=device)
        if device.type == "cuda":  # a CUDA graph reads them where they are: no copy into the graph per replay
            for t in (self.a, self.b, self.scale):
                torch._dynamo.mark_static_address(t)

    @torch.no_grad()
    def copy(self, layer, names: Sequence[str | None]) -> None:
        for k, name in enumerate(names):
            if name is None or name not in layer.lora_A:
                self.a[k].zero_()
                self.b[:, k].zero_()
                self.scale[k] = 0.0
                continue
            a, b = layer.lora_A[name].weight, layer.lora_B[name].weight  # [r_k, in], [out, r_k]
            r = a.shape[0]
            self.a[k, :r].copy_(a)
            self.a[k, r:].zero_()
            self.b[:, k, :r].copy_(b)
            self.b[:, k, r:].zero_()
            self.scale[k] = float(layer.scaling[name])


class StackedLora:
    """Every LoRA Linear of a peft model with its adapters stacked in `slots` slots; `rows` [R, N] is each batch
    row's one-hot slot (set by `use`), which every stacked forward reads."""

    def __init__(self, model, slots: int = 1, rank: int = 1):
        self.model, self.slots, self.rank = model, slots, rank
        self.names: list[str | None] = [None] * slots
        self.layers = plain_lora_linears(model)
        if self.layers is None:
            raise ValueError("stacked LoRA needs plain LoRA Linear layers (no DoRA, variant, bias or merged adapter)")
        self.stacks = [_Stack(layer, slots, rank) for layer in self.layers]
        self.forwards = [self._forward_of(layer, stack) for layer, stack in zip(self.layers, self.stacks)]
        self.rows: torch.Tensor | None = None

    @staticmethod
    def fits(stacked: StackedLora | None, model, names: Sequence[str]) -> bool:
        """Whether `stacked` can hold `names` of `model` without new shapes (more slots, a larger rank)."""
        if stacked is None or stacked.model is not model or len(set(names)) > stacked.slots:
            return False
        if plain_lora_linears(model) != stacked.layers:
            return False
        return _largest_rank(stacked.layers, names) <= stacked.rank

    def refresh(self, names: Sequence[str]) -> None:
        """Give each of `names` a slot (keeping those already placed) and copy every slot's current weights in."""
        wanted = list(dict.fromkeys(names))
        kept = [n if n in wanted else None for n in self.names]
        for name in wanted:
            if name not in kept:
                kept[kept.index(None)] = name
        self.names = kept
        for layer, stack in zip(self.layers, self.stacks):
            stack.copy(layer, self.names)

    def row_slots(self, row_names: Sequence[str], device) -> torch.Tensor:
        """The one-hot [R, N] of each row's slot."""
        index = torch.tensor([self.names.index(n) for n in row_names], device=device)
        return torch.nn.functional.one_hot(index, self.slots).to(self.stacks[0].a.dtype)

    @contextlib.contextmanager
    def use(self, rows: torch.Tensor):
        """Every LoRA Linear computes its stacked forward with `rows` [R, N] for the block (the same function objects
        each time, so a compiled step's guards on them hold from one call to the next)."""
        self.rows = rows
        for layer, forward in zip(self.layers, self.forwards):
            layer.forward = forward
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.forward  # back to the class's (peft's)
            self.rows = None

    def _forward_of(self, layer, stack: _Stack):
        slots, rank = self.slots, self.rank

        def forward(x, *args, **kwargs):
            result = layer.base_layer(x, *args, **kwargs)
            lead = x.shape[:-1]
            u = x.to(stack.a.dtype) @ stack.a.view(slots * rank, -1).T
            weight = (self.rows * stack.scale).view(self.rows.shape[0], *([1] * (len(lead) - 1)), slots, 1)
            u = (u.view(*lead, slots, rank) * weight).view(*lead, slots * rank)
            return result + (u @ stack.b.view(-1, slots * rank).T).to(result.dtype)

        return forward


def _largest_rank(layers, names) -> int:
    """The largest rank any of `names` (None: every adapter) has in any of `layers` (a rank_pattern varies it)."""
    return max(
        (a.weight.shape[0] for layer in layers for n, a in layer.lora_A.items() if names is None or n in names),
        default=1,
    )


def stacked_for(current: StackedLora | None, model, names: Sequence[str], slots: int = 1, rank: int = 0):
    """A StackedLora of `model` holding `names` (the current one when it fits, else one with room for them, at least
    `slots` slots and rank `rank`), refreshed: every slot's weights as they are now."""
    if not StackedLora.fits(current, model, names):
        distinct = len(set(names))
        slots = max(slots, distinct, current.slots if current is not None and current.model is model else 0)
        layers = plain_lora_linears(model) or []
        rank = max(rank, _largest_rank(layers, None))  # room for every adapter the model holds: a slot may take any
        current = StackedLora(model, slots, rank)
    current.refresh(names)
    return current
