"""One global batch, whatever the world size: the torch.distributed pieces the trainer runs on under torchrun.

N ranks compute the loss, the gradients and the metrics of the same global batch one process would. The choices:

- **The process group comes from torchrun's environment** (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), gloo on
  CPU and NCCL on CUDA, with a timeout, so a rank that dies makes the others fail in a collective within it instead
  of hanging. Without WORLD_SIZE (or with 1) nothing is initialised and every helper here is the identity.
- **A rank trains on whole groups.** `shard` gives rank r the r-th contiguous 1/N of the global batch's prompts (the
  prompt sampler's batch, unchanged), so the G completions of a prompt, its rewards and its group advantage stay on
  one rank; the prompts per step must divide by the world size (`check_world`, before any model loads).
- **The loss normalisers are the global batch's.** `reduce_totals` sums BatchTotals over ranks before the
  micro-batch loop, so each rank's loss is its exact share of the global loss and the global gradient is the *sum*
  of the ranks' gradients. DDP and FSDP2 average gradients by default; `wrap` makes both sum (DDP's comm hook,
  FSDP2's gradient divide factor 1), so no loss is rescaled by the world size.
- **Every parameter is used inside the wrapper's forward.** The trainer's chunked logprobs read the decoder and the
  output head directly (trainer/logprobs.py), which a DDP or FSDP2 root would not see; `wrap` therefore wraps a
  `Logprobs` module whose forward *is* `completion_logprobs` of the policy, and the trainer calls that.
- **FSDP2** (`torch.distributed.fsdp.fully_shard` over a 1-D device mesh) shards each decoder layer (the model
  class's `_no_split_modules`), then the root; LoRA is applied before sharding (only the adapter is trainable, the
  frozen base is sharded too); full fine-tuning shards everything. A model class with no such layers is refused
  (`check_shardable`). **DDP** replicates the model (for one that fits a device).
- **The trainer sees one interface.** `World` says how ranks share a step — gather the global batch's lists, take
  this rank's rows, reduce loss normalisers and metric parts, accumulate gradients, hold whole weights, broadcast,
  which rank writes — and is the identity for one process; `Ranks` is the same over torch.distributed. So the step
  (trainer/loop.py) has no branch on the world size.
- **Metrics are reduced over the global batch**, never as a per-rank mean of means: trainer/metrics.py's `Tally`
  hands `World.sums/mins/maxes` the numerators and denominators, mins and maxes of this rank's rows (one all-reduce
  per kind, in float64) and divides after, and `gather` hands every rank the global lists (texts, rewards, lengths)
  for the metrics that need whole groups. Each metric has one definition, for one process and N ranks alike.
- Only rank 0 records: `World.main`.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .loss import BatchTotals

PARALLEL = ("none", "ddp", "fsdp2")
DEFAULT_TIMEOUT_S = 300.0


class DistributedError(RuntimeError):
    """A rank lost the others (one died, or a collective timed out)."""


# ------------------------------------------------------------------------ the world


@dataclass(frozen=True)
class World:
    """How the ranks share a step, for one process: every sharing is the identity. The trainer's step calls these and
    nothing else of torch.distributed, so the algorithm reads the same for one process and for N ranks (`Ranks`)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def main(self) -> bool:
        """Whether this process writes the run's records (metrics, samples, checkpoints): rank 0."""
        return self.rank == 0

    def gather(self, values: Sequence) -> list:
        """The global batch's list: every rank's `values`, concatenated in rank order."""
        return list(values)

    def local_rows(self, result, rows: int):
        """This rank's rows of an AdvantageResult of the global batch (trainer/advantages.py)."""
        return result

    def reduce_totals(self, totals: BatchTotals) -> BatchTotals:
        """The global batch's loss normalisers from this rank's."""
        return totals

    def sum(self, value: float) -> float:
        """A number summed over ranks."""
        return value

    def sums(self, values: list) -> list:
        """Numbers summed over ranks, element by element (a metric's numerators and denominators)."""
        return values

    def mins(self, values: list) -> list:
        """The smallest over ranks, element by element; None is a rank with no value."""
        return values

    def maxes(self, values: list) -> list:
        """The largest over ranks, element by element; None is a rank with no value."""
        return values

    def broadcast(self, value):
        """Rank 0's object on every rank."""
        return value

    def wrap(self, policy: nn.Module, parallel: str) -> nn.Module:
        """The policy as the `Logprobs` module the trainer calls (replicated or sharded over ranks)."""
        return Logprobs(policy)

    @contextmanager
    def accumulating(self, wrapped: nn.Module, last: bool):
        """A micro-batch's backward, gradients reduced over ranks with the last micro-batch of an update only."""
        yield

    @contextmanager
    def full_weights(self, wrapped: nn.Module):
        """The policy's whole weights on every rank within the block (to generate, evaluate or save alone)."""
        yield

    def clip_grad_norm(self, params: Sequence[Tensor], max_norm: float) -> Tensor:
        """torch's clip_grad_norm_ over the global gradient: the total norm, the same on every rank."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)


@dataclass(frozen=True)
class Ranks(World):
    """N ranks under torchrun, each on whole groups of the same global batch: the sharings of `World` over
    torch.distributed (the functions of this module)."""

    def gather(self, values: Sequence) -> list:
        return gather(values)

    def local_rows(self, result, rows: int):
        """Advantages and loss mask of this rank's own completions; the group std and the shares stay the global
        batch's."""
        mine = slice(self.rank * rows, (self.rank + 1) * rows)
        group = len(result.advantages) // max(len(result.group_std), 1)
        groups = slice(mine.start // group, mine.stop // group)
        return replace(
            result,
            advantages=result.advantages[mine],
            loss_mask_seq=result.loss_mask_seq[mine],
            group_std=result.group_std[groups],
        )

    def reduce_totals(self, totals: BatchTotals) -> BatchTotals:
        return reduce_totals(totals)

    def sum(self, value: float) -> float:
        return sum_scalar(value)

    def sums(self, values: list) -> list:
        return _all_reduce([float(v) for v in values], dist.ReduceOp.SUM)

    def mins(self, values: list) -> list:
        return _all_reduce([math.inf if v is None else float(v) for v in values], dist.ReduceOp.MIN)

    def maxes(self, values: list) -> list:
        return _all_reduce([-math.inf if v is None else float(v) for v in values], dist.ReduceOp.MAX)

    def broadcast(self, value):
        return broadcast(value)

    def wrap(self, policy: nn.Module, parallel: str) -> nn.Module:
        return wrap(policy, parallel)

    @contextmanager
    def accumulating(self, wrapped: nn.Module, last: bool):
        with accumulating(wrapped, last):
            yield

    @contextmanager
    def full_weights(self, wrapped: nn.Module):
        with full_weights(wrapped):
            yield

    def clip_grad_norm(self, params: Sequence[Tensor], max_norm: float) -> Tensor:
        return clip_grad_norm(params, max_norm)


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(device: str | torch.device = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """Join the process group torchrun describes in the environment (gloo on CPU, NCCL on CUDA, each rank on CUDA
    device LOCAL_RANK); a collective that waits longer than `timeout_s` for another rank fails. One process (no
    WORLD_SIZE, or 1): no process group, World() on `device`."""
    device = torch.device(device)
    size = env_world_size()
    if size == 1:
        return World(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return Ranks(rank, size, local_rank, device)


LOST_EXIT = 75  # a rank's exit status when a collective failed because another rank is gone (tasks/ranks.py)


@contextmanager
def stop_when_others_are_lost():
    """Around a rank's work: a collective that fails because another rank died or did not answer within the
    process-group timeout ends this rank quietly with LOST_EXIT, so the launcher names the rank that failed first."""
    try:
        yield
    except Exception as e:  # gloo raises RuntimeError, NCCL DistBackendError
        # torch's DistError covers NCCL and the store's timeouts; gloo's are RuntimeErrors naming its own source file.
        # Not any "timed out": a rank's own error (a vLLM request's timeout) is that rank's failure, to be blamed
        if isinstance(e, dist.DistError) or "gloo" in str(e).lower():
            print(
                f"rank {os.environ.get('RANK', '?')}: lost the other ranks ({str(e).splitlines()[0][:160]})",
                file=sys.stderr,
            )
            try:  # else gloo's pair threads abort the interpreter at exit (SIGABRT instead of LOST_EXIT)
                dist.destroy_process_group()
            except Exception:
                pass
            raise SystemExit(LOST_EXIT) from None
        raise


def world() -> World:
    """The current world (after `init`)."""
    if not (dist.is_available() and dist.is_initialized()):
        return World()
    return Ranks(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def is_main() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def close() -> None:
    _WAITING_GROUPS.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def check_world(nproc: int, prompts_per_step: int, device: str, parallel: str) -> None:
    """Refuse, before any model loads, a world the run cannot use: more ranks than cores (CPU) or devices (CUDA), or
    a world size that does not divide the prompts per step (a group is never split across ranks)."""
    if parallel not in PARALLEL:
        raise ValueError(f"model.parallel: {parallel!r} is not one of {', '.join(PARALLEL)}")
    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: give 1 or more processes")
    if nproc > 1 and parallel == "none":
        raise ValueError(f"--nproc {nproc} with model.parallel: none; set model.parallel: ddp or fsdp2 (or --nproc 1)")
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        have, what = torch.cuda.device_count(), "CUDA devices"
    else:
        have, what = len(os.sched_getaffinity(0)), "CPU cores"
    if nproc > have:
        raise ValueError(f"--nproc {nproc}: this machine has {have} {what}; give --nproc {have} or fewer")
    if prompts_per_step % nproc:
        raise ValueError(
            f"--nproc {nproc} does not divide grpo.prompts_per_step {prompts_per_step}: each rank trains whole groups "
            f"of the same global batch; give a world size that divides {prompts_per_step}"
        )


# ------------------------------------------------------------------------ the global batch, shard by shard


def shard(items: Sequence, rank: int, size: int) -> list:
    """Rank `rank`'s contiguous 1/size of the global batch's prompts (whole groups: each prompt's completions are
    sampled, rewarded and normalised on the rank that holds the prompt)."""
    if len(items) % size:
        raise ValueError(f"{len(items)} prompts cannot be split evenly over {size} ranks")
    per = len(items) // size
    return list(items[rank * per : (rank + 1) * per])


def shard_range(n: int, rank: int, size: int) -> range:
    """The positions in the global batch of rank `rank`'s shard (for per-prompt seeds)."""
    per = n // size
    return range(rank * per, (rank + 1) * per)


def reduce_totals(totals: BatchTotals) -> BatchTotals:
    """The global batch's loss normalisers from each rank's (a sum over ranks); the identity in one process."""
    if not _active():
        return totals
    t = torch.tensor([totals.tokens, totals.sequences, totals.rows], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t)
    return BatchTotals(tokens=int(t[0]), sequences=int(t[1]), rows=int(t[2]))


def sum_scalar(value: float) -> float:
    """A float summed over ranks (each rank's share of the loss → the global loss)."""
    if not _active():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return float(t[0])


def gather(values: list) -> list:
    """Every rank's list, concatenated in rank order: the global batch's list on every rank."""
    if not _active():
        return list(values)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, list(values))
    return [v for part in parts for v in part]


def broadcast(value):
    """Rank 0's object on every rank."""
    if not _active():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


_WAITING_GROUPS: dict = {}  # from_main's gloo groups, by timeout
MAIN_EXIT_WAIT_S = 30.0  # how long the other ranks give a failed rank 0 to exit before they do


def from_main(work, timeout_s: float = DEFAULT_TIMEOUT_S):
    """`work()` run on rank 0 alone and its (picklable) result handed to every rank, the others waiting up to
    `timeout_s` (on a gloo group of their own, so a long wait such as a server start does not trip the process
    group's timeout). When `work` raises, rank 0 raises it and the other ranks end with LOST_EXIT, so the launcher
    names rank 0's error. One process: `work()`."""
    if not _active():
        return work()
    if timeout_s not in _WAITING_GROUPS:  # every rank calls from_main in the same order: the same groups
        _WAITING_GROUPS[timeout_s] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    group = _WAITING_GROUPS[timeout_s]
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box = [(True, work())]
        except BaseException:
            dist.broadcast_object_list([(False, None)], src=0, group=group)
            raise
    dist.broadcast_object_list(box, src=0, group=group)
    done, result = box[0]
    if not done:  # rank 0 is on its way out with its error; let it end first, so the launcher names it
        rank = dist.get_rank()
        time.sleep(MAIN_EXIT_WAIT_S)  # torchrun's agent ends this rank (SIGTERM) as soon as rank 0 has exited
        print(f"rank {rank}: stopping, rank 0 failed", file=sys.stderr)
        dist.destroy_process_group()
        raise SystemExit(LOST_EXIT)
    return result


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce(values: list[float], op) -> list[float]:
    """Floats reduced over ranks by `op`, element by element, in float64 (one all-reduce)."""
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    if t.numel():
        dist.all_reduce(t, op=op)
    return t.tolist()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


# ------------------------------------------------------------------------ the model, wrapped


class Logprobs(nn.Module):
    """The policy, whose forward is trainer/logprobs.completion_logprobs: every parameter the trainer uses is used
    inside this forward, so DDP's and FSDP2's hooks see it. `policy` is the model itself (peft or plain)."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, input_ids, attention_mask, completion_len, **kwargs):
        from .logprobs import completion_logprobs

        out = completion_logprobs(self.policy, input_ids, attention_mask, completion_len, **kwargs)
        # not views of the logits: FSDP2's root warns on every call that a view's in-place update would skip its
        # backward hook (the loss updates nothing in place; a copy of B x T values costs nothing beside the logits)
        return tuple(t.clone() if isinstance(t, Tensor) else t for t in out)


def decoder_layer_classes(model: nn.Module) -> set[str]:
    """The class names of the model's repeated blocks (HF's `_no_split_modules`), the FSDP2 units."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    return {n for n in names if any(type(m).__name__ == n for m in base.modules())}


def check_shardable(model: nn.Module, parallel: str) -> None:
    """FSDP2 needs the repeated blocks to shard; refuse a model class that names none."""
    if parallel == "fsdp2" and not decoder_layer_classes(model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        raise ValueError(
            f"model.parallel: fsdp2 cannot shard {type(base).__name__}: the class names no decoder layers "
            "(_no_split_modules) to shard; use model.parallel: ddp"
        )


def check_model_class(name_or_path: str, parallel: str, trust_remote_code: bool = False) -> None:
    """`check_shardable` from the model's config alone (no weights load): its causal-LM class must name the decoder
    layers FSDP2 shards. A model not on disk yet (built or downloaded on first use) is checked when it loads."""
    if parallel != "fsdp2" or not (os.path.isdir(name_or_path) and os.path.isfile(f"{name_or_path}/config.json")):
        return
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None or not getattr(cls, "_no_split_modules", None):
        name = cls.__name__ if cls is not None else type(config).__name__
        raise ValueError(
            f"model.parallel: fsdp2 cannot shard {name}: the class names no decoder layers (_no_split_modules) to "
            "shard; use model.parallel: ddp"
        )


def wrap(policy: nn.Module, parallel: str, device: torch.device | None = None) -> nn.Module:
    """The policy as a `Logprobs` module, replicated (ddp) or sharded (fsdp2) over the world's ranks, gradients
    summed over ranks (module docstring); 'none' or one process: the plain `Logprobs`. Call after LoRA is applied
    and the model is on its device, before the optimizer is built (FSDP2 replaces parameters with DTensors)."""
    module = Logprobs(policy)
    if parallel == "none" or not _active():
        return module
    device = device or (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None)
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            module, device_ids=[device] if device is not None and device.type == "cuda" else None
        )
        ddp.register_comm_hook(None, _sum_hook)
        return ddp
    if parallel == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        check_shardable(policy, parallel)
        on_cuda = device is not None and device.type == "cuda"
        mesh = init_device_mesh("cuda" if on_cuda else "cpu", (dist.get_world_size(),))
        layers = decoder_layer_classes(policy)
        for m in list(policy.modules()):
            if type(m).__name__ in layers:
                fully_shard(m, mesh=mesh)
        fully_shard(module, mesh=mesh)
        for m in module.modules():  # every unit's reduce-scatter sums
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
        with torch.no_grad():  # the root's lazy initialisation, before anything calls a layer on its own (generate)
            ids = torch.ones((1, 2), dtype=torch.long, device=next(policy.parameters()).device)
            module(ids, torch.ones_like(ids), 1)
        module.reshard()  # the root too: every parameter a shard again
        return module
    raise ValueError(f"model.parallel: {parallel!r} is not one of {', '.join(PARALLEL)}")


@contextmanager
def accumulating(wrapped: nn.Module, last: bool):
    """A micro-batch's backward: the gradients are reduced over ranks only with the last micro-batch of an optimizer
    step (DDP's no_sync before it; FSDP2 accumulates unsharded), so a summed reduction counts each share once."""
    if not last and hasattr(wrapped, "no_sync"):
        with wrapped.no_sync():
            yield
        return
    if hasattr(wrapped, "set_requires_gradient_sync"):
        wrapped.set_requires_gradient_sync(last)
    yield


@contextmanager
def full_weights(wrapped: nn.Module):
    """Within the block the policy holds its whole weights on every rank and runs without collectives, so each rank
    may call it on its own (generate, eval, a fingerprint; rank 0 alone may save it): FSDP2's units are gathered and
    kept gathered, then sharded again after. DDP's and one process's policy is whole already."""
    units = [m for m in wrapped.modules() if _is_fsdp(m)]
    for m in units:
        m.set_reshard_after_forward(False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(True)


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _sum_hook(state, bucket):
    """DDP's all-reduce, summed (not averaged): each rank's loss is already its share of the global loss."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def policy_of(wrapped: nn.Module) -> nn.Module:
    """The policy inside a `wrap`ped module."""
    inner = wrapped.module if hasattr(wrapped, "module") and not isinstance(wrapped, Logprobs) else wrapped
    return inner.policy


def full_tensor(t: Tensor) -> Tensor:
    """A parameter or gradient as one whole tensor (an FSDP2 DTensor gathered; a plain tensor as it is)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def clip_grad_norm(params: Sequence[Tensor], max_norm: float) -> Tensor:
    """torch's clip_grad_norm_ over the global gradient (sharded FSDP2 grads included): the total norm, a plain
    tensor, the same on every rank."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return full_tensor(norm)
