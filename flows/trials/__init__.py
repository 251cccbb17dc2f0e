"""The trial runners (sweeps/runner.py's interface) and the choice among them: `choose_runner` gives the sweep flow
one of

    SequentialRunner   flows/trials/sequential.py   one trial at a time here, each the pipeline flow
    ConcurrentRunner   flows/trials/concurrent.py   `concurrent_trials` at once here, LoRA adapters over one model
    WorkerRunner       flows/trials/workers.py      K `ballast sweep-worker` processes here, or K worker nodes

What the terminal shows of the trials is flows/trials/lines.py; Ctrl-C said once, flows/trials/interrupts.py.
"""

from __future__ import annotations

from sweeps.runner import TrialRunner

from .concurrent import ConcurrentRunner
from .sequential import SequentialRunner
from .workers import WorkerRunner, node_placement


def choose_runner(sweep, spec, storage_url: str, workers: int = 1) -> TrialRunner:
    """`ballast sweep`'s runner: K > 1 worker processes, or a worker per node when the base spec's train stage has
    a node of its own (infra.compute local or skypilot); else this process's runner. `spec`: the base spec."""
    on_nodes = spec.infra.compute != "here"
    if workers > 1 or on_nodes:
        return WorkerRunner(spec, storage_url, workers, on_nodes)
    return in_process_runner(sweep)


def in_process_runner(sweep, label: str = "") -> TrialRunner:
    """Trials in this process — `concurrent_trials` at once, or one at a time — placed on the node this worker runs
    on when the sweep provisioned one (`ballast sweep-worker` there)."""
    runner = ConcurrentRunner if sweep.concurrent_trials > 1 else SequentialRunner
    return runner(label, node_placement())
