"""Sharded training state through torch.distributed.checkpoint (DCP), and the plain adapter a sharded run exports.

The choices:

- **Trainable weights and optimizer state only, by fully qualified name.** `torch.distributed.checkpoint.state_dict`
  gives the same names whatever wraps the policy (DDP, FSDP2, or nothing) and whatever the world size, and DCP
  writes each rank's shards with a plan that any world size can read back: a state saved by N ranks loads into M
  (1 → 2, 2 → 1, FSDP2 ↔ DDP ↔ one process), resharded on load. The frozen base is never saved (it is the base
  model, named in the checkpoint's manifest).
- **Every rank saves and loads together** (DCP's collectives); one process needs no process group.
- **What probe, eval and the inference server read is a plain adapter**: `export_adapter` gathers the full LoRA
  tensors on rank 0 and writes them with peft's save_pretrained, exactly what a single-process run writes, so the
  checkpoint layout (trainer/checkpoint.py: adapter/, state/, manifest.json) keeps its meaning.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from . import distributed as dd

_SHARDED = StateDictOptions(ignore_frozen_params=True)
_LOAD = StateDictOptions(ignore_frozen_params=True, strict=False)  # the frozen base is not in the checkpoint
_FULL = StateDictOptions(ignore_frozen_params=True, full_state_dict=True, cpu_offload=True)


def save_sharded(path: str | Path, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write the trainable weights and the optimizer state of a `distributed.wrap`ped policy under `path` (a
    directory), each rank its shards; every rank calls it."""
    model_state, optim_state = get_state_dict(wrapped, optimizer, options=_SHARDED)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path))


def load_sharded(path: str | Path, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what `save_sharded` wrote, by any world size and wrapping, into `wrapped` and `optimizer` (resharded to
    this world); every rank calls it."""
    model_state, optim_state = get_state_dict(wrapped, optimizer, options=_SHARDED)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    result = set_state_dict(
        wrapped, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=_LOAD
    )
    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    missing = [n for n in result.missing_keys if n.removeprefix("module.") in trainable]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the sharded state at {path} does not fit this model: missing {missing[:3]}, unexpected "
            f"{list(result.unexpected_keys)[:3]}; resume with the model and lora settings the run was saved with"
        )


def full_trainable_state(wrapped: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights as whole CPU tensors, named as in the policy itself (no wrapper prefix); complete on
    rank 0 (every rank calls it: it gathers)."""
    state = get_model_state_dict(wrapped, options=_FULL)
    return {name.removeprefix("policy."): t for name, t in state.items()}


def full_optimizer_state(wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state as whole CPU tensors keyed by parameter name (what a checkpoint's optimizer file holds
    for a sharded run); complete on rank 0 (every rank calls it: it gathers)."""
    return get_optimizer_state_dict(wrapped, optimizer, options=_FULL)


def export_adapter(wrapped: nn.Module, directory: str | Path, adapter: str = "default") -> Path | None:
    """The LoRA adapter of a sharded or replicated policy, gathered whole and written on rank 0 by peft's
    save_pretrained (the plain adapter a single process writes); every rank calls it, rank 0 returns the directory."""
    state = full_trainable_state(wrapped)
    if not dd.is_main():
        return None
    policy = dd.policy_of(wrapped)
    policy.save_pretrained(str(directory), state_dict=state, selected_adapters=[adapter])
    return Path(directory)


# ------------------------------------------------------------------------ a plain checkpoint into N ranks, and back


def trainable_names(wrapped: nn.Module) -> list[str]:
    """The trainable parameters' names, as the optimizer's full state keys them, in the optimizer's order."""
    return [n.removeprefix("module.") for n, p in wrapped.named_parameters() if p.requires_grad]


def optimizer_by_name(state: dict, names: list[str]) -> dict:
    """An optimizer state keyed by position (torch's optimizer.state_dict()) keyed by parameter name instead."""
    if all(isinstance(k, str) for k in state["state"]) and all(
        isinstance(p, str) for g in state["param_groups"] for p in g["params"]
    ):
        return state
    return {
        "state": {names[int(i)]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]],
    }


def optimizer_by_position(state: dict, names: list[str]) -> dict:
    """An optimizer state keyed by parameter name (a sharded run's checkpoint) keyed by position, for
    optimizer.load_state_dict in a replicated or single process."""
    index = {name: i for i, name in enumerate(names)}
    if not any(isinstance(k, str) for k in state["state"]) and not any(
        isinstance(p, str) for g in state["param_groups"] for p in g["params"]
    ):
        return state
    return {
        "state": {index[k]: v for k, v in state["state"].items()},
        "param_groups": [{**g, "params": [index[p] for p in g["params"]]} for g in state["param_groups"]],
    }


def load_whole(wrapped: nn.Module, optimizer: torch.optim.Optimizer, weights: dict, optim_state: dict) -> None:
    """Whole trainable weights (named as in the policy, no wrapper prefix) and a whole optimizer state (by position
    or by name) into a sharded policy and its optimizer; every rank calls it with the same values."""
    names = trainable_names(wrapped)
    missing = [n for n in names if n.removeprefix("policy.") not in weights]
    if missing:
        raise ValueError(f"the checkpoint has no weights for {missing[:3]}; it was saved with another model or lora")
    set_model_state_dict(
        wrapped,
        {n: weights[n.removeprefix("policy.")] for n in names},
        options=StateDictOptions(full_state_dict=True, strict=False, ignore_frozen_params=True),
    )
    set_optimizer_state_dict(
        wrapped, optimizer, optimizer_by_name(optim_state, names), options=StateDictOptions(full_state_dict=True)
    )
