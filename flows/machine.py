"""Whether this machine has room for the threads a sweep's trials use: a CPU trial whose torch threads compete with
other jobs for the cores samples several times slower (on 2 cores beside another job, 107-172 s a sampling pass
instead of 14 s), and a sweep that says nothing for ten minutes looks hung. `load_warning` is the one line said at
the sweep's start when the other processes' CPU use plus the trials' threads is more than the cores can serve.

The other processes' use is measured, not read off the load average: /proc/stat's busy time over half a second,
less this process's own. The load average also counts tasks waiting on I/O and lags by a minute; on this project's
2-core VMs it read 0.7 on a machine whose cores were 99 % idle, and the sweep warned of a busy machine on every
start.
"""

from __future__ import annotations

import os
import time


def trial_threads(spec) -> int:
    """torch intra-op threads one trial uses: model.torch_threads, else torch's default (one per core)."""
    if spec.model.torch_threads:
        return int(spec.model.torch_threads)
    import torch

    return int(torch.get_num_threads())


def others_cpus(seconds: float = 0.5) -> float:
    """How many cores' worth of CPU the machine's other processes use now: /proc/stat's busy time over `seconds`,
    less this process's (all its threads). Where there is no /proc/stat (macOS), the 1-minute load average."""
    try:
        before, mine = _busy_ticks(), time.process_time()
        time.sleep(seconds)
        after, mine = _busy_ticks(), time.process_time() - mine
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]
    others = (after - before) / os.sysconf("SC_CLK_TCK") - mine  # seconds of CPU the other processes spent
    return max(0.0, others / seconds)


def _busy_ticks() -> int:
    """Clock ticks every core has been busy since boot, from /proc/stat's first line (idle and iowait are not)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(ticks) - ticks[3] - ticks[4]


def load_warning(spec, concurrent: int = 1, load: float | None = None, cpus: int | None = None) -> str | None:
    """One line when other work leaves the trials fewer cores than their threads, else None (GPU runs: None).
    `load`: the cores' worth of CPU other processes use (measured when not given)."""
    if str(spec.model.device).startswith("cuda"):
        return None
    cpus = cpus or os.cpu_count() or 1
    load = others_cpus() if load is None else load
    threads = trial_threads(spec)
    free = cpus - load
    if load < 0.5 or free >= min(threads, cpus) - 0.5:
        return None
    room = max(1, int(free))
    fewer = f", or set model.torch_threads: {room} (--set model.torch_threads={room})" if room < threads else ""
    at_once = f" (x{concurrent} trials at once)" if concurrent > 1 else ""
    return (
        f"warning: this machine is busy (other processes use {load:.1f} of its {cpus} cores) and each trial uses "
        f"{threads} torch thread{'s' * (threads != 1)}{at_once}: "
        f"sampling may run several times slower than on an idle machine; stop the other work{fewer}"
    )
