"""Compute: where a pipeline's GPU stages run, behind one interface — provision → run(stage) → teardown.

    infra: {compute: local}                                    # a stage process on this machine
    infra: {compute: skypilot, accelerators: H100:1, use_spot: true, cloud: aws}

A `Compute` provisions a node, runs a stage command on it with an environment, hands each line the stage prints
to a callback (the flow relays them to Prefect's run log and the terminal), reports how the stage ended, and is
torn down — always, from the flow's `finally`. Two implementations:

* `LocalCompute` — this machine. The "node" is a scratch directory (`<project>/compute/<name>`) that teardown
  deletes, the stage a subprocess in its own session (a Ctrl-C or SIGTERM meant for the flow does not reach it;
  teardown sends it SIGTERM, then SIGKILL after a grace period). A stage killed by SIGTERM or SIGKILL is
  `preempted`; `recover()` then wipes the scratch directory as a replacement node would have none, so the
  relaunched stage resumes from the store and nothing else. It is the embedded default of the remote path: every
  part of it except SkyPilot's own calls runs in the tests here.
* `SkyPilotCompute` — a SkyPilot cluster (`sky.launch` with `idle_minutes_to_autostop` and `down=True`, the
  backstop if the flow's process dies; the stage by `sky.exec`, its log by `sky.tail_logs`; `sky.down`) or, with
  `use_spot`, a managed job (`sky.jobs.launch` with an `EAGER_NEXT_REGION` recovery strategy; SkyPilot relaunches a
  preempted node and re-runs the stage, which resumes from the store; `sky.jobs.tail_logs`, `sky.jobs.cancel`).
  Secrets go by name and are read from this environment at launch, as for `ballast launch`.

`check_placement` refuses, before anything is provisioned, what a remote node could not use: an accelerator
string SkyPilot refuses, spot without an s3:// store, a SQLite tracking store or a local artifact path.
`Usage` is what a provisioned run cost: node, cloud/region, spot, provision and run seconds, the hourly price
where SkyPilot's catalog is on this machine (it is fetched from the internet on first use; offline: no price).

This module knows nothing of Prefect or MLflow, and imports SkyPilot lazily.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from infra.extras import require_extra
from infra.skypilot import ACCELERATORS_RE, REMOTE_SPEC_DIR, accelerator_count

REPO = Path(__file__).resolve().parent.parent
STOP_GRACE_S = 30.0  # teardown: SIGTERM, this long for the safe stop (a checkpoint), then SIGKILL
PREEMPTED = {-signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM, 128 + signal.SIGKILL}
STAGE_PID = "stage.pid"  # in the local node's directory: the stage process (its own process group)


class ComputeError(ValueError):
    """A placement the node could not use; one line naming the field and the fix (exit 2, nothing provisioned)."""


@dataclass
class StageExit:
    code: int  # the stage's exit status (128 + N for a signal N)
    preempted: bool = False  # the node or the process went away by a signal: relaunch, resume from the store
    detail: str = ""


@dataclass
class Usage:
    """What a provisioned run used; recorded on its MLflow run (tags `ballast.compute.*`, metrics `compute/*`)."""

    compute: str
    node: str
    accelerators: str | None = None
    cloud: str | None = None
    region: str | None = None
    spot: bool = False
    provision_s: float = 0.0
    run_s: float = 0.0
    restarts: int = 0
    hourly_usd: float | None = None
    torn_down: bool = False

    @property
    def cost_usd(self) -> float | None:
        return None if self.hourly_usd is None else self.hourly_usd * (self.provision_s + self.run_s) / 3600

    def tags(self) -> dict[str, str]:
        facts = {
            "compute": self.compute,
            "compute.node": self.node,
            "compute.accelerators": self.accelerators,
            "compute.cloud": self.cloud,
            "compute.region": self.region,
            "compute.spot": "spot" if self.spot else "on-demand",
            "compute.torn_down": str(self.torn_down),
        }
        return {k: str(v) for k, v in facts.items() if v is not None}

    @staticmethod
    def recorded(tags: dict[str, str], metrics: dict[str, float], prefix: str = "ballast.") -> dict | None:
        """What `tags()` (under `prefix`) and `metrics()` put on a run's MLflow record, read back as one dict (the
        metrics without 'compute/', the facts by name) for a sweep's summary to sum; None when the run has none."""
        used: dict = {k.removeprefix("compute/"): v for k, v in metrics.items() if k.startswith("compute/")}
        if not used:
            return None
        for key in ("compute", "node", "accelerators", "cloud", "region"):
            tag = prefix + ("compute" if key == "compute" else f"compute.{key}")
            if tag in tags:
                used[key] = tags[tag]
        used["spot"] = tags.get(prefix + "compute.spot") == "spot"
        used["torn_down"] = tags.get(prefix + "compute.torn_down") == "True"
        return used

    def metrics(self) -> dict[str, float]:
        out = {"compute/provision_s": self.provision_s, "compute/run_s": self.run_s, "compute/restarts": self.restarts}
        if self.hourly_usd is not None:
            out["compute/hourly_usd"] = self.hourly_usd
            out["compute/cost_usd"] = self.cost_usd
        return out

    def line(self) -> str:
        where = "/".join(x for x in (self.cloud, self.region) if x) or "this machine"
        cost = f", ~${self.cost_usd:.2f}" if self.cost_usd is not None else ""
        spot = "spot" if self.spot else "on-demand"
        return (
            f"compute: {self.node} ({self.accelerators or 'no accelerator'}, {spot}, {where}): provisioned in "
            f"{self.provision_s:.0f} s, ran {self.run_s:.0f} s, {self.restarts} restart(s){cost}"
        )


class Compute(Protocol):
    """One node for one run's GPU stages."""

    name: str
    recovers_itself: bool  # SkyPilot managed jobs relaunch a preempted node themselves

    def provision(self) -> None: ...

    def run(self, command: list[str], env: dict[str, str], on_line: Callable[[str], None]) -> StageExit: ...

    def recover(self) -> None: ...

    def teardown(self) -> None: ...

    def usage(self) -> Usage: ...


# ── refused before anything is provisioned ─────────────────────────────────────────────────────────


def check_placement(infra, tracking_uri: str, store_uri: str) -> None:
    """ComputeError (one line) for what a remote node could not use. `infra` is the spec's infra section; the URIs
    are the resolved tracking and artifact store of the run."""
    if infra.compute == "here":
        return
    if infra.compute == "skypilot":
        require_extra("cloud", "infra.compute: skypilot")
    if infra.accelerators:
        check_accelerators(infra.accelerators)
    if infra.compute != "skypilot":
        return  # this machine reaches its own SQLite and directories
    if tracking_uri.startswith("sqlite:") or "://" not in tracking_uri:
        raise ComputeError(
            f"infra.compute: skypilot with tracking {tracking_uri}: the node cannot reach an embedded SQLite "
            "store; set tracking.uri to an MLflow server (http://…) or postgresql://… the node reaches"
        )
    if not store_uri.startswith("s3://"):
        which = "infra.use_spot: true" if infra.use_spot else "infra.compute: skypilot"
        raise ComputeError(
            f"{which} with storage {store_uri}: the node cannot reach a local directory, and a preempted node's "
            "checkpoints would be lost with it; set storage.uri to s3://bucket/prefix"
        )
    if urlhost(tracking_uri) in ("127.0.0.1", "localhost", "::1"):
        raise ComputeError(
            f"tracking.uri {tracking_uri} names this machine's loopback address, which the node cannot reach; give "
            "the tracking server's address on the network"
        )


def check_accelerators(accelerators: str) -> None:
    """The string as SkyPilot parses it (`sky.Resources`), after the NAME[:COUNT] shape check; MissingExtra (one line
    naming the `cloud` extra) where SkyPilot is not installed."""
    if not ACCELERATORS_RE.match(accelerators):
        raise ComputeError(
            f"infra.accelerators={accelerators!r} is not NAME or NAME:COUNT (e.g. 'H100:1', 'A100-80GB:8')"
        )
    require_extra("cloud", f"infra.accelerators={accelerators!r} (read by SkyPilot)")
    import sky

    try:
        sky.Resources(accelerators=accelerators)
    except ValueError as e:
        raise ComputeError(f"infra.accelerators={accelerators!r}: SkyPilot refused it: {first_line(e)}") from None


def urlhost(uri: str) -> str | None:
    from urllib.parse import urlsplit

    return urlsplit(uri).hostname


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# ── this machine ───────────────────────────────────────────────────────────────────────────────────


class LocalCompute:
    """A stage process on this machine, in its own session, with a scratch directory as the node's disk."""

    recovers_itself = False

    def __init__(self, name: str, workdir: Path, stop_grace_s: float = STOP_GRACE_S, cwd: Path | None = None):
        self.name, self.workdir, self.stop_grace_s = name, Path(workdir), stop_grace_s
        self.cwd = Path(cwd or os.getcwd())  # the flow's: relative paths in the spec mean the same on this "node"
        self.proc: subprocess.Popen | None = None
        self._usage = Usage("local", socket.gethostname())
        self._provisioned_at: float | None = None

    def provision(self) -> None:
        started = time.perf_counter()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._provisioned_at = time.perf_counter()
        self._usage.provision_s = self._provisioned_at - started

    def run(self, command: list[str], env: dict[str, str], on_line: Callable[[str], None]) -> StageExit:
        if self._provisioned_at is None:
            raise RuntimeError(f"{self.name}: run before provision")
        self.proc = subprocess.Popen(
            command,
            cwd=self.cwd,
            env={**os.environ, **env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _with_repo(os.environ.get("PYTHONPATH"))},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: signals meant for the flow do not reach it
        )
        (self.workdir / STAGE_PID).write_text(str(self.proc.pid))
        for line in self.proc.stdout:
            on_line(line.rstrip("\n"))
        code = self.proc.wait()
        code = 128 - code if code < 0 else code  # -15 → 143, as a shell reports it
        return StageExit(code, preempted=code in PREEMPTED, detail=f"exit status {code}")

    def recover(self) -> None:
        """A replacement node: the scratch directory starts empty, so the stage resumes from the store alone."""
        self._usage.restarts += 1
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True, exist_ok=True)

    def teardown(self) -> None:
        """Stop the stage if it still runs (SIGTERM: a safe stop; SIGKILL after the grace period), delete the node's
        directory."""
        if self.proc is not None and self.proc.poll() is None:
            stop_process_group(self.proc, self.stop_grace_s)
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self._provisioned_at is not None:
            self._usage.run_s = time.perf_counter() - self._provisioned_at
        self._usage.torn_down = True

    def usage(self) -> Usage:
        return self._usage


def _with_repo(pythonpath: str | None) -> str:
    return os.pathsep.join([str(REPO), *([pythonpath] if pythonpath else [])])


def stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the process's group (it leads its own session), SIGKILL after `grace_s`: what a preemption does."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


# ── SkyPilot ───────────────────────────────────────────────────────────────────────────────────────


@dataclass
class SkyPlan:
    """The SkyPilot task of one run's stage node, in plain values (what --dryrun prints)."""

    name: str
    resources: dict[str, Any]
    setup: str
    run: str
    spec_file: str  # the node spec, mounted at REMOTE_SPEC_DIR/<name>.yaml
    managed: bool  # a managed job (use_spot): SkyPilot recovers preemptions
    num_nodes: int = 1
    secret_names: list[str] = field(default_factory=list)
    autostop_minutes: int = 30
    max_restarts: int = 3

    @property
    def remote_spec(self) -> str:
        return f"{REMOTE_SPEC_DIR}/{self.name}.yaml"

    def task_config(self, with_secret_values: bool = False) -> dict[str, Any]:
        """The task as SkyPilot's YAML schema has it; secret values only for the in-process launch."""
        resources = dict(self.resources)
        if self.managed:
            resources["job_recovery"] = {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": self.max_restarts}
        config: dict[str, Any] = {
            "name": self.name,
            "workdir": str(REPO),
            "num_nodes": self.num_nodes,
            "resources": resources,
            "envs": {"PYTHONUNBUFFERED": "1"},
            "file_mounts": {self.remote_spec: str(Path(self.spec_file).absolute())},
            "setup": self.setup,
            "run": self.run,
        }
        if self.secret_names:
            config["secrets"] = {n: (os.environ[n] if with_secret_values else None) for n in self.secret_names}
        return config

    def yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.task_config(), sort_keys=False)


def sky_plan(infra, name: str, spec_file: Path, stage_command: str, vllm: bool = False) -> SkyPlan:
    """The plan from the spec's infra section; `stage_command` runs the stage against the mounted spec."""
    missing = [n for n in infra.env if n not in os.environ]
    if missing:
        raise ComputeError(
            f"infra.env names {missing[0]!r}, which is not set in this environment; export it before the run (its "
            "value is passed to the node as a SkyPilot secret, never stored)"
        )
    resources: dict[str, Any] = {}
    if infra.accelerators:
        resources["accelerators"] = infra.accelerators
    if infra.cloud:
        resources["infra"] = infra.cloud
    for key in ("cpus", "memory", "disk_size"):
        if getattr(infra, key):
            resources[key] = getattr(infra, key) if key == "disk_size" else str(getattr(infra, key))
    if infra.use_spot:
        resources["use_spot"] = True
    setup = ["set -e", "bash scripts/install.sh"] + (["bash scripts/vllm_env.sh --gpu"] if vllm else [])
    return SkyPlan(
        name=name,
        resources=resources,
        setup="\n".join(setup),
        run=stage_command,
        spec_file=str(spec_file),
        managed=infra.use_spot,
        num_nodes=infra.num_nodes,
        secret_names=list(infra.env),
        autostop_minutes=infra.autostop_minutes,
        max_restarts=infra.max_restarts,
    )


def stage_nodes(plan: SkyPlan, command: list[str]) -> int:
    """The nodes a stage runs on: the train stage on all of them (one torchrun launcher each, which reads its place
    from SKYPILOT_NODE_RANK / SKYPILOT_NODE_IPS: tasks/remote.py train_ranks); the probe and eval on the head alone."""
    return plan.num_nodes if command[2:4] == ["tasks.remote", "train"] else 1


def sky_task(config: dict[str, Any]):
    """A sky.Task through SkyPilot's own schema validation; ComputeError with SkyPilot's first line otherwise."""
    import sky

    try:
        return sky.Task.from_yaml_config(dict(config))
    except Exception as e:  # SkyPilot raises ValueError / jsonschema errors in its own wording
        raise ComputeError(f"SkyPilot refused the task: {first_line(e)}") from None


class SkyPilotCompute:
    """A SkyPilot cluster (on-demand) or managed job (spot) for one run's stage. Not run against a real cloud here:
    no cloud or Kubernetes is reachable from the machines this was written on (README, "On a cluster")."""

    def __init__(self, plan: SkyPlan):
        self.plan, self.name = plan, plan.name
        self.recovers_itself = plan.managed
        self.job_id: int | None = None
        self._usage = Usage(
            "skypilot",
            plan.resources.get("accelerators", "cpu"),
            plan.resources.get("accelerators"),
            plan.resources.get("infra"),
            spot=plan.managed,
        )
        self._provisioned_at: float | None = None
        self._launched = False

    def provision(self) -> None:
        """An on-demand cluster is launched now (setup only), with autostop/autodown as the backstop; a managed
        job's node is provisioned by SkyPilot's jobs controller when the stage is submitted (`run`)."""
        import sky

        started = time.perf_counter()
        if not self.plan.managed:
            task = sky_task({**self.plan.task_config(with_secret_values=True), "run": None})
            request = sky.launch(
                task, cluster_name=self.name, idle_minutes_to_autostop=self.plan.autostop_minutes, down=True
            )
            self._launched = True
            _, handle = sky.stream_and_get(request)
            self._node_facts(getattr(handle, "launched_resources", None))
        self._provisioned_at = time.perf_counter()
        self._usage.provision_s = self._provisioned_at - started

    def run(self, command: list[str], env: dict[str, str], on_line: Callable[[str], None]) -> StageExit:
        import sky

        config = {**self.plan.task_config(with_secret_values=True), "run": " ".join(command)}  # `~` expands there
        config["envs"] = {**config["envs"], **env}
        config["num_nodes"] = stage_nodes(self.plan, command)
        task = sky_task(config)
        if self.plan.managed:
            job_ids, _ = sky.stream_and_get(sky.jobs.launch(task, name=self.name))
            self._launched = True
            self.job_id = job_ids[0]
            for line in _lines(sky.jobs.tail_logs(job_id=self.job_id, follow=True, preload_content=False)):
                on_line(line)
            records = sky.stream_and_get(sky.jobs.queue(refresh=True, job_ids=[self.job_id]))
            record = _field_getter(records[0] if isinstance(records, list) else records[0][0])
            status = str(record("status")).rsplit(".", 1)[-1]
            self._usage.restarts = int(record("recovery_count") or 0)
            return StageExit(0 if status == "SUCCEEDED" else 1, detail=f"managed job {self.job_id}: {status}")
        self.job_id, _ = sky.stream_and_get(sky.exec(task, cluster_name=self.name))
        for line in _lines(sky.tail_logs(self.name, self.job_id, follow=True, preload_content=False)):
            on_line(line)
        statuses = sky.stream_and_get(sky.job_status(self.name, [self.job_id]))
        status = str(statuses.get(self.job_id)).rsplit(".", 1)[-1]
        return StageExit(0 if status == "SUCCEEDED" else 1, detail=f"job {self.job_id} on {self.name}: {status}")

    def recover(self) -> None:
        self._usage.restarts += 1

    def teardown(self) -> None:
        """`sky.down` the cluster, or cancel the managed job if it still runs; autodown covers a dead flow."""
        import sky

        try:
            if self.plan.managed and self.job_id is not None:
                sky.stream_and_get(sky.jobs.cancel(job_ids=[self.job_id]))
            elif self._launched:
                sky.stream_and_get(sky.down(self.name))
        finally:
            if self._provisioned_at is not None:
                self._usage.run_s = time.perf_counter() - self._provisioned_at
            self._usage.torn_down = True

    def usage(self) -> Usage:
        return self._usage

    def _node_facts(self, resources) -> None:
        if resources is None:
            return
        self._usage.node = str(getattr(resources, "instance_type", None) or self._usage.node)
        self._usage.cloud = str(getattr(resources, "cloud", None) or self._usage.cloud)
        self._usage.region = getattr(resources, "region", None)
        try:
            self._usage.hourly_usd = float(resources.get_cost(3600))
        except Exception:
            pass


def _field_getter(record) -> Callable[[str], Any]:
    """A managed job's record: a ManagedJobRecord (attributes) or a dict, depending on the API server's version."""
    return (lambda k: record.get(k)) if isinstance(record, dict) else (lambda k: getattr(record, k, None))


def _lines(stream) -> Iterator[str]:
    """Log lines from a SkyPilot log iterator (chunks of text, None at the end)."""
    buffer = ""
    for chunk in stream if not isinstance(stream, int) else []:
        if chunk is None:
            break
        buffer += chunk
        *done, buffer = buffer.split("\n")
        yield from done
    if buffer:
        yield buffer


def hourly_price(accelerators: str | None, use_spot: bool, cloud: str | None) -> float | None:
    """The catalog's cheapest hourly price for the accelerators, when SkyPilot's catalog is already on this machine
    (never fetched from here); None otherwise."""
    if not accelerators:
        return None
    from sky.catalog import common

    cloud_name = (cloud or "aws").split("/")[0].lower()
    path = Path(common.get_catalog_path(f"{cloud_name}/vms.csv"))
    if not path.exists():
        return None
    from sky import catalog

    name, _, count = accelerators.partition(":")
    try:
        return float(catalog.get_accelerator_hourly_cost(name, int(float(count or 1)), use_spot, clouds=cloud_name))
    except Exception:
        return None


def gpu_count(accelerators: str | None) -> float:
    return accelerator_count(accelerators)
