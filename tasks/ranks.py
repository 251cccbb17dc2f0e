"""`ballast train --nproc N`: the trainer's ranks on this node, launched by torch.distributed.run (torchrun).

The choices:

- **Refused before the model loads** (`check_ranks`), in one line: more ranks than CPU cores (gloo) or CUDA devices
  (NCCL), a world size that does not divide grpo.prompts_per_step (a group is never split across ranks),
  model.parallel: none with more than one rank, or fsdp2 for a model class that names no decoder layers to shard.
- **With rollout.engine: vllm the ranks share one server**, which rank 0 starts (or connects to) and pushes each
  adapter version to; every rank samples its own prompts from it (trainer/engines/vllm.py). Several nodes need
  rollout.vllm_url: the server rank 0 starts listens on its own node's loopback.
- **Each rank runs the same `ballast train` command** without --nproc; torchrun's environment (RANK, WORLD_SIZE,
  ...) tells the trainer it is one of N (trainer/distributed.py), one torch thread per core it is given.
- **A rank that dies stops the others**: torchrun's agent ends the rest as soon as one exits with an error (and a
  rank blocked in a collective fails within the process-group timeout); the command then prints one line naming
  the rank that caused it — one that exited with its own error, before one killed by a signal; ranks that only
  lost the others (trainer/distributed.py's LOST_EXIT, gloo's SIGABRT, the agent's SIGTERM) are not blamed — and
  exits with that rank's status.
"""

from __future__ import annotations

import os
import sys
import uuid
from operator import attrgetter

from tasks.spec import ExperimentSpec, SpecError

# What does not run on several ranks yet: field -> (is this value refused, the fix). The README's sentence on it is
# checked against this table (tests/test_readme.py).
NOT_ON_SEVERAL_RANKS = {
    "rollout.engine": (lambda engine: engine == "offline", "hf or vllm (each rank samples its prompts)"),
    "grpo.kl_ref_step_lag": (lambda lag: bool(lag), "null"),
}


def check_ranks(spec: ExperimentSpec, nproc: int, here: bool = True) -> None:
    """SpecError (one line) when `nproc` ranks cannot train `spec` on this machine (`here`), or on nodes whose cores
    and devices are not known here (only what does not depend on them); nothing is loaded."""
    from trainer import distributed

    try:
        if here:
            distributed.check_world(nproc, spec.grpo.prompts_per_step, spec.model.device, spec.model.parallel)
        elif nproc > 1 and spec.model.parallel == "none":
            raise ValueError(f"{nproc} ranks with model.parallel: none; set model.parallel: ddp or fsdp2")
        elif spec.grpo.prompts_per_step % nproc:
            raise ValueError(
                f"{nproc} ranks do not divide grpo.prompts_per_step {spec.grpo.prompts_per_step}: each rank trains "
                f"whole groups of the same global batch; give infra.nproc_per_node x infra.num_nodes dividing it"
            )
        if nproc > 1:
            distributed.check_model_class(spec.model.name_or_path, spec.model.parallel, spec.model.trust_remote_code)
    except ValueError as e:
        raise SpecError(str(e)) from None
    if nproc > 1:
        for field, (refused, fix) in NOT_ON_SEVERAL_RANKS.items():
            value = attrgetter(field)(spec)
            if refused(value):
                raise SpecError(
                    f"--nproc {nproc}: {field}: {value} does not run on several ranks yet; set {field}: {fix}"
                )


def check_stage_ranks(spec: ExperimentSpec) -> None:
    """SpecError (one line) for infra.nproc_per_node / infra.num_nodes the run's compute cannot give its train stage."""
    infra = spec.infra
    nproc, nodes = infra.nproc_per_node, infra.num_nodes
    if nproc * nodes == 1:
        return
    if infra.compute == "here":
        raise SpecError(
            f"infra.nproc_per_node: {nproc}, infra.num_nodes: {nodes} with infra.compute: here: the flow's own process "
            "trains as one rank; set infra.compute: local (ranks in a stage process on this machine) or skypilot, or "
            "train here alone with: ballast train SPEC --nproc N"
        )
    if infra.compute == "local" and nodes > 1:
        raise SpecError(
            f"infra.num_nodes: {nodes} with infra.compute: local: one machine is one node; set infra.num_nodes: 1 "
            "(and infra.nproc_per_node for its ranks) or infra.compute: skypilot"
        )
    if nodes > 1 and spec.rollout.engine == "vllm" and not spec.rollout.vllm_url:
        raise SpecError(
            f"infra.num_nodes: {nodes} with rollout.engine: vllm: the server rank 0 starts listens on its own node's "
            "loopback, which the other nodes cannot reach; set rollout.vllm_url to a server every node reaches (on "
            "the first node, where rank 0 writes the adapters it loads), or infra.num_nodes: 1"
        )
    check_ranks(spec, nproc * nodes, here=infra.compute == "local")


def node_launch(env: dict[str, str]) -> dict:
    """This node's place among the train stage's nodes, from SkyPilot's environment: {} on one node, else
    {nnodes, node_rank, master_addr} (the first of SKYPILOT_NODE_IPS hosts the rendezvous)."""
    nodes = int(env.get("SKYPILOT_NUM_NODES", "1") or 1)
    if nodes == 1:
        return {}
    ips = [ip for ip in env.get("SKYPILOT_NODE_IPS", "").split() if ip]
    rank = env.get("SKYPILOT_NODE_RANK")
    if len(ips) != nodes or rank is None:
        raise SpecError(
            f"SKYPILOT_NUM_NODES is {nodes} but SKYPILOT_NODE_IPS lists {len(ips)} address(es) and SKYPILOT_NODE_RANK "
            f"is {rank!r}; a multi-node train stage runs under SkyPilot, which sets all three on every node"
        )
    return {"nnodes": nodes, "node_rank": int(rank), "master_addr": ips[0]}


def _rendezvous(nnodes: int, node_rank: int, master_addr: str, master_port: int) -> dict:
    """One node: torchrun's c10d rendezvous on a free local port. Several: a static one at the first node, each
    node giving its rank (torchrun --nnodes --node-rank --master-addr --master-port)."""
    if nnodes == 1:
        return dict(rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", run_id=f"ballast-{uuid.uuid4().hex[:8]}")
    endpoint = f"{master_addr}:{master_port}"
    return dict(rdzv_backend="static", rdzv_endpoint=endpoint, rdzv_configs={"rank": node_rank}, run_id="ballast")


def launch(
    nproc: int,
    argv: list[str],
    log=None,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
) -> int:
    """Run `python argv...` as `nproc` ranks under torchrun's agent on this node; 0 when every rank succeeded, else
    the status of the rank that failed first, after one line on `log` (stderr) naming it. With `nnodes` > 1 this node
    is node `node_rank` of a static rendezvous at master_addr:master_port (torchrun --nnodes --node-rank
    --master-addr), and the ranks are numbered node by node."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from trainer.distributed import LOST_EXIT

    log = log or sys.stderr
    threads = max(1, len(os.sched_getaffinity(0)) // nproc)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        max_restarts=0,
        monitor_interval=0.2,
        **_rendezvous(nnodes, node_rank, master_addr, master_port),
    )
    try:
        elastic_launch(config, sys.executable)(*argv)
    except ChildFailedError as e:
        failures = e.failures

        # the cause: a rank that exited with its own error, before one killed by a signal, before one that only lost
        # the others (LOST_EXIT; SIGABRT from gloo on a closed connection; SIGTERM from the agent's teardown)
        def blame(r: int) -> tuple:
            code = failures[r].exitcode
            return (0 if code > 0 and code != LOST_EXIT else 1 if code not in (LOST_EXIT, -6, -15) else 2, r)

        rank = min(failures, key=blame)
        code = failures[rank].exitcode
        what = f"exit status {code}" if code >= 0 else f"signal {-code}"
        world = nproc * nnodes
        others = sorted(set(range(world)) - {rank})
        print(
            f"rank {rank} of {world} failed ({what}); the other rank{'s' if len(others) > 1 else ''} "
            f"({', '.join(map(str, others))}) stopped",
            file=log,
        )
        return code if code > 0 else 1
    return 0
