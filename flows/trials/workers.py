"""Trials in K worker processes: `ballast sweep-worker` processes on this machine sharing the study's storage, or
one worker on each of K nodes (infra/compute.py) — the runner `ballast sweep --workers K` uses, and the one a base
spec whose `infra.compute` is local or skypilot gets with any --workers. Each worker runs one of the in-process
runners (sequential or concurrent) through its own `ballast-sweep-worker` flow; this runner waits for them.

**Workers on nodes.** Each worker is started through the compute interface, as the pipeline runs its train stage:
a node per worker (a SkyPilot cluster or managed job each; a scratch directory and a process of its own for
`local`), `ballast sweep-worker` run there with its lines relayed here, prefixed, and the node torn down whatever
happens (success, failure, Ctrl-C) — the tasks `provision worker-i` / `teardown worker-i` in Prefect. On the node a
trial's spec is placed as `node_spec` places a pipeline's (tasks/remote.py): `infra.compute: here`, the flow's
tracking and artifact store, the node's project folder (NODE_ENV); so trials never provision again. What each node
used is kept on the study and on the sweep's parent run, and summed in the summary. The storage must be one the
nodes reach (sweeps/study.py `check_worker_placement`).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client

from flows.stages import provision_task, teardown_task
from infra.compute import Compute, LocalCompute, SkyPilotCompute, StageExit, Usage, sky_plan, sky_task, urlhost
from sweeps.runner import Budget, RunnerReport
from sweeps.study import LOOPBACK, NODE_ATTR, n_done, target
from tasks.remote import LineRelay, node_name, node_spec, write_node_spec
from tasks.spec import store_uri
from tasks.sweep_record import SweepRecorder

CLI = "import sys; from flows.cli import main; sys.exit(main())"
NODE_ENV = "BALLAST_SWEEP_NODE"  # on a worker node: where its trials keep their files (JSON, `worker_node`)
DEADLINE_ENV = "BALLAST_SWEEP_DEADLINE"  # --timeout's end (epoch seconds) for the workers `ballast sweep` starts


class WorkerRunner:
    """K workers: processes here (`on_nodes` False) or each on a node of its own (the base spec's infra.compute)."""

    def __init__(self, spec, storage_url: str, k: int, on_nodes: bool):
        self.spec, self.storage_url, self.k, self.on_nodes = spec, storage_url, k, on_nodes

    def run(self, study, sweep, recorder: SweepRecorder, budget: Budget) -> RunnerReport:
        deadline = {DEADLINE_ENV: str(budget.deadline)} if budget.deadline else {}  # for workers elsewhere
        if self.on_nodes:
            run_on_nodes(study, self.spec, recorder, self.storage_url, self.k, deadline)
        elif any(codes := spawn_workers(study.study_name, self.storage_url, self.k, deadline)):
            print(f"worker exit codes: {codes}")
        # the deadline ended it only if it has passed: workers that all failed before it did not time out
        return RunnerReport(timed_out=budget.spent() and n_done(study) < target(study))


def node_placement() -> dict | None:
    """On a worker node the sweep provisioned: where its trials keep their files and record (NODE_ENV); else None."""
    return json.loads(os.environ.get(NODE_ENV) or "null")


def worker_budget(trials: int) -> Budget:
    """A worker's budget: the study's total, and the deadline of the `ballast sweep --timeout` that started it."""
    deadline = os.environ.get(DEADLINE_ENV)
    return Budget(trials, None if deadline is None else float(deadline))


def spawn_workers(study_name: str, storage_url: str, k: int, extra_env: dict[str, str]) -> list[int]:
    """K `ballast sweep-worker` processes on this machine, sharing the storage (and this Prefect API); exit codes."""
    env = dict(os.environ, PREFECT_API_URL=prefect_api(), **extra_env)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                CLI,
                "sweep-worker",
                "--study",
                study_name,
                "--storage",
                storage_url,
                "--worker",
                str(i),
                "--no-summary",
            ],
            env=env,
        )
        for i in range(k)
    ]
    try:
        return [p.wait() for p in procs]
    except BaseException:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        raise


@dataclass
class WorkerNode:
    """One sweep worker on a node of its own: the compute, the `ballast sweep-worker` command it runs there and its
    environment. Torn down once, by its thread or by the flow on Ctrl-C, whichever comes first."""

    index: int
    compute: Compute
    command: list[str]
    env: dict[str, str]
    ended: StageExit | None = None
    tail: list[str] = field(default_factory=list)  # its last lines, quoted when it fails
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def label(self) -> str:
        return f"worker-{self.index}"

    def teardown(self) -> None:
        with self.lock:
            if not self.compute.usage().torn_down:
                teardown_task.with_options(task_run_name=f"teardown {self.label}")(self.compute)

    def record(self) -> dict:
        """Its usage as the study keeps it (sweeps/report.py sums these)."""
        usage: Usage = self.compute.usage()
        return {"name": f"{self.label} ({self.compute.name})", **asdict(usage), "cost_usd": usage.cost_usd}


def worker_node(spec, study_name: str, storage_url: str, index: int, tracking_uri: str, api_url: str) -> WorkerNode:
    """Worker `index`'s node — a LocalCompute or a SkyPilot cluster / managed job, as tasks/remote.py's
    `open_compute` builds a run's — and what runs there; nothing is provisioned yet. The node's trials keep their
    files in the node's own project folder and record to the flow's tracking and artifact store (NODE_ENV)."""
    name = node_name(study_name, f"w{index}")
    argv = ["sweep-worker", "--study", study_name, "--storage", storage_url, "--worker", str(index), "--no-summary"]
    project = Path(spec.project_dir).resolve()
    placement = {"tracking_uri": tracking_uri, "store_uri": store_uri(spec)}
    env = {}
    if spec.infra.compute == "local" or urlhost(api_url) not in LOOPBACK:  # its flows in this Prefect, if it can
        env["PREFECT_API_URL"] = api_url
    if spec.infra.compute == "local":
        workdir = project / "compute" / name
        env[NODE_ENV] = json.dumps({**placement, "project_dir": str(workdir / "project")})
        return WorkerNode(index, LocalCompute(name, workdir), [sys.executable, "-m", "flows.cli", *argv], env)
    env[NODE_ENV] = json.dumps({**placement, "project_dir": ".ballast-node"})
    command = shlex.join(["python3", "-m", "flows.cli", *argv])
    node = node_spec(spec, tracking_uri, placement["store_uri"], ".ballast-node")  # the base spec, for the record
    spec_file = write_node_spec(node, project / "launch" / f"{name}.spec.yaml")
    vllm = spec.rollout.engine == "vllm" and not spec.rollout.vllm_url
    plan = sky_plan(spec.infra, name, spec_file, command, vllm=vllm)
    sky_task({**plan.task_config(), "envs": {**plan.task_config()["envs"], **env}})  # SkyPilot's schema, now
    return WorkerNode(index, SkyPilotCompute(plan), [command], env)


def run_worker_node(node: WorkerNode) -> StageExit:
    """Provision the worker's node, run the worker there (its lines here, prefixed), tear the node down."""
    prefix = f"[worker {node.index}] "

    def say(line: str) -> None:
        print(line if line.startswith(prefix) else prefix + line, flush=True)

    try:
        provision_task.with_options(task_run_name=f"provision {node.label}")(node.compute)
        with node.lock:
            if node.compute.usage().torn_down:  # the flow was stopped while this node was being provisioned
                return StageExit(130, detail="stopped before it started")
        relay = LineRelay([], say)
        node.ended = node.compute.run(node.command, node.env, relay)
        node.tail = relay.tail
        return node.ended
    finally:
        node.teardown()


worker_node_task = task(run_worker_node, name="sweep-worker", cache_policy=NO_CACHE, persist_result=False)


def run_on_nodes(
    study, spec, recorder: SweepRecorder, storage_url: str, k: int, extra_env: dict[str, str]
) -> list[WorkerNode]:
    """K workers, each on its own node, at once (Prefect's thread pool); every node torn down before this returns,
    a Ctrl-C too. What each used goes onto the study and the sweep's parent run."""
    api = prefect_api()
    nodes = [worker_node(spec, study.study_name, storage_url, i, recorder.tracking.uri, api) for i in range(k)]
    for n in nodes:
        n.env.update(extra_env)
    futures = []
    try:
        futures = [worker_node_task.with_options(task_run_name=n.label).submit(n) for n in nodes]
        for f in futures:
            f.wait()
    finally:
        for n in nodes:  # after a Ctrl-C: stops the workers (SIGTERM: a trial stops at a safe point), downs the nodes
            n.teardown()
        for f in futures:
            f.wait()
        keep_node_usage(study, recorder, nodes)
    for n, f in zip(nodes, futures):
        ended = f.result(raise_on_failure=False)
        if isinstance(ended, BaseException):
            print(f"[worker {n.index}] its node {n.compute.name} failed: {type(ended).__name__}: {ended}", flush=True)
        elif ended.code != 0:
            last = "\n".join(n.tail[-8:])
            print(f"[worker {n.index}] ended on {n.compute.name} with {ended.detail}; its last lines:\n{last}")
    return nodes


def keep_node_usage(study, recorder: SweepRecorder, nodes: list[WorkerNode]) -> None:
    """Each node's usage: a study user attr (the summary sums them), a tag and a line."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for n in nodes:
        usage = n.compute.usage()
        print(f"[worker {n.index}] {usage.line()}{'' if usage.torn_down else ' — NOT torn down'}", flush=True)
        try:
            study.set_user_attr(f"{NODE_ATTR}{stamp}.{n.index}", json.dumps(n.record()))
            recorder.tracking.set_tags(recorder.parent_run_id, {f"compute.{n.label}": usage.line()})
        except Exception as e:  # how the nodes were used never hides how the sweep ended
            print(f"[worker {n.index}] its usage was not recorded: {e}", flush=True)


def prefect_api() -> str:
    """The Prefect API this process uses (the embedded server's too), for the workers' flow runs."""
    with get_client(sync_client=True) as client:
        return str(client.api_url)
