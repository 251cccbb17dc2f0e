"""`ballast train --nproc N`: the trainer's ranks on this node, launched by torch.distributed.run (torchrun).

The choices:

- **Refused before the model loads** (`check_ranks`), in one line: more ranks than CPU cores (gloo) or CUDA devices
  (NCCL), a world size that does not divide grpo.prompts_per_step (a group is never split across ranks),
  model.parallel: none with more than one rank, or fsdp2 for a model class that names no decoder layers to shard.
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

from tasks.spec import ExperimentSpec, SpecError


def check_ranks(spec: ExperimentSpec, nproc: int) -> None:
    """SpecError (one line) when `nproc` ranks cannot train `spec` on this machine; nothing is loaded."""
    from trainer import distributed

    try:
        distributed.check_world(nproc, spec.grpo.prompts_per_step, spec.model.device, spec.model.parallel)
        if nproc > 1:
            distributed.check_model_class(spec.model.name_or_path, spec.model.parallel, spec.model.trust_remote_code)
    except ValueError as e:
        raise SpecError(str(e)) from None
    if nproc > 1:
        unsupported = {
            "rollout.engine": (spec.rollout.engine, spec.rollout.engine != "hf", "hf (each rank samples its prompts)"),
            "rollout.max_off_policy_steps": (spec.rollout.max_off_policy_steps, spec.rollout.max_off_policy_steps, "0"),
            "grpo.kl_ref_step_lag": (spec.grpo.kl_ref_step_lag, spec.grpo.kl_ref_step_lag, "null"),
        }
        for field, (value, refused, fix) in unsupported.items():
            if refused:
                raise SpecError(
                    f"--nproc {nproc}: {field}: {value} does not run on several ranks yet; set {field}: {fix}"
                )


def launch(nproc: int, argv: list[str], log=None) -> int:
    """Run `python argv...` as `nproc` ranks under torchrun's agent on this node; 0 when every rank succeeded, else
    the status of the rank that failed first, after one line on `log` (stderr) naming it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from trainer.distributed import LOST_EXIT

    log = log or sys.stderr
    threads = max(1, len(os.sched_getaffinity(0)) // nproc)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"ballast-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.2,
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
        others = sorted(set(range(nproc)) - {rank})
        print(
            f"rank {rank} of {nproc} failed ({what}); the other rank{'s' if len(others) > 1 else ''} "
            f"({', '.join(map(str, others))}) stopped",
            file=log,
        )
        return code if code > 0 else 1
    return 0
