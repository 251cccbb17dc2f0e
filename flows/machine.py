"""Whether this machine has room for the threads a sweep's trials use: a CPU trial whose torch threads compete with
other jobs for the cores samples several times slower (on 2 cores beside another job, 107-172 s a sampling pass
instead of 14 s), and a sweep that says nothing for ten minutes looks hung. `load_warning` is the one line said at
the sweep's start when the 1-minute load average plus the trials' threads is more than the cores can serve."""

from __future__ import annotations

import os


def trial_threads(spec) -> int:
    """torch intra-op threads one trial uses: model.torch_threads, else torch's default (one per core)."""
    if spec.model.torch_threads:
        return int(spec.model.torch_threads)
    import torch

    return int(torch.get_num_threads())


def load_warning(spec, concurrent: int = 1, load: float | None = None, cpus: int | None = None) -> str | None:
    """One line when other work leaves the trials fewer cores than their threads, else None (GPU runs: None)."""
    if str(spec.model.device).startswith("cuda"):
        return None
    cpus = cpus or os.cpu_count() or 1
    load = os.getloadavg()[0] if load is None else load
    threads = trial_threads(spec)
    free = cpus - load
    if load < 0.5 or free >= min(threads, cpus) - 0.5:
        return None
    room = max(1, int(free))
    fewer = f", or set model.torch_threads: {room} (--set model.torch_threads={room})" if room < threads else ""
    return (
        f"warning: this machine is busy (load {load:.1f} on {cpus} cores) and each trial uses {threads} torch "
        f"thread{'s' * (threads != 1)}{' (x' + str(concurrent) + ' trials at once)' if concurrent > 1 else ''}: "
        f"sampling may run several times slower than on an idle machine; stop the other work{fewer}"
    )
