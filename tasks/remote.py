"""The train stage on a provisioned node (infra/compute.py): what the flow sends, what the node runs, what comes back.

    python3 -m tasks.remote train --spec NODE_SPEC.yaml --run-id RUN_ID      # on the node (the Compute runs it)

The flow (flows/pipeline.py) has opened the MLflow run; the node trains *that* run. Its spec is the run's, with
the tracking and artifact store resolved to the ones the flow uses and the project folder the node's own
(`node_spec`); nothing else of the flow's machine is assumed to be there. On the node:

1. the newest checkpoint in the store (and the run's metrics.jsonl and samples files saved next to it) is
   restored, so a relaunched node — after a preemption — resumes as `ballast run --resume` does; with no
   checkpoint yet, the run starts from its fork source (fetched from the store) or the base model;
2. the trainer runs with the same callbacks as in the flow's process: metrics to MLflow through `MetricsSink`
   in its `replayed` mode (a (metric, step) MLflow already holds is not sent again, so a replayed step is never
   duplicated), each checkpoint to the store as it is saved, and the run's files next to it; SIGTERM (a
   preemption) stops it at a safe point, after a checkpoint;
3. each step is printed as one `ballast-step {json}` line, which the flow turns back into the same progress
   lines (and callbacks) as a local run; at the end the outcome goes to the store (`node/outcome.json`).

`train_on_node` is the flow's end: run the stage, relaunch it when the node was preempted (up to
`infra.max_restarts`, unless SkyPilot's managed job recovers by itself), then read the outcome back.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from infra.compute import (
    Compute,
    LocalCompute,
    SkyPilotCompute,
    SkyPlan,
    Usage,
    check_placement,
    sky_plan,
    sky_task,
)
from infra.skypilot import REMOTE_SPEC_DIR
from tasks.checkpoint import CheckpointUploader, fetch_checkpoint
from tasks.record import store_uri
from tasks.spec import dump_spec, load_spec
from tasks.train import RunInterrupted, TrainOutcome, run_training
from trainer.checkpoint import parse_step_dir, step_dir_name
from trainer.loop import Callbacks
from trainer.samples import EVAL_SAMPLES_FILE, SAMPLES_FILE

STEP_LINE = "ballast-step "
RUN_FILES = ("metrics.jsonl", "prompts.jsonl", SAMPLES_FILE, EVAL_SAMPLES_FILE)  # kept in the store beside checkpoints
LOG_TAIL = 20  # lines of the node's log quoted when its stage fails


def node_prefix(run_id: str) -> str:
    """Where the node keeps a run's files and outcome in the artifact store."""
    return f"runs/{run_id}/node"


# ── the flow's end ─────────────────────────────────────────────────────────────────────────────────


def node_spec(spec, tracking_uri: str, store_uri: str, project_dir: str):
    """The spec the node runs: the run's own, tracking and storage resolved, the node's project folder, and
    `infra.compute: here` (on the node, training runs in the stage's process)."""
    node = spec.model_copy(deep=True)
    node.tracking.uri, node.storage.uri, node.project_dir = tracking_uri, store_uri, project_dir
    node.infra.compute = "here"
    return node


def write_node_spec(node, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_spec(node))
    return path


def stage_command(python: str, spec_file: str, run_id: str) -> list[str]:
    return [python, "-m", "tasks.remote", "train", "--spec", spec_file, "--run-id", run_id]


class NodeStageFailed(RuntimeError):
    """The node's stage ended with an error (or was preempted more often than allowed); the message quotes its log."""


class LineRelay:
    """The node's log, line by line: a step line becomes `on_step` on the flow's callbacks (the progress lines, a
    sweep's pruning reports), every other line goes to `say` (Prefect's run log)."""

    def __init__(self, hooks: Sequence[Callbacks], say: Callable[[str], None]):
        self.hooks, self.say = list(hooks), say
        self.tail: list[str] = []
        self.last_step = 0

    def __call__(self, line: str) -> None:
        if line.startswith(STEP_LINE):
            record = json.loads(line[len(STEP_LINE) :])
            self.last_step = record["step"]
            for hook in self.hooks:
                hook.on_step(record["step"], record["metrics"])
            return
        self.tail = [*self.tail[-(LOG_TAIL - 1) :], line]
        if line.strip():
            self.say(line)


def train_on_node(
    compute: Compute,
    command: list[str],
    run,
    hooks: Sequence[Callbacks],
    say: Callable[[str], None],
    max_restarts: int,
    env: dict[str, str] | None = None,
) -> TrainOutcome:
    """Run the train stage on the provisioned `compute` for `run` (a RunRecorder); relaunch it on preemption."""
    relay = LineRelay(hooks, say)
    restarts = 0
    while True:
        ended = compute.run(command, env or {}, relay)
        if ended.code == 0:
            break
        if ended.preempted and not compute.recovers_itself and restarts < max_restarts:
            restarts += 1
            say(
                f"train: the node went away after step {relay.last_step} ({ended.detail}); relaunching it, "
                f"resuming from the store's newest checkpoint (restart {restarts} of at most {max_restarts})"
            )
            compute.recover()
            continue
        why = "preempted once more than infra.max_restarts allows" if ended.preempted else "failed"
        log = "\n".join(relay.tail[-LOG_TAIL:])
        raise NodeStageFailed(f"the train stage on {compute.name} {why} ({ended.detail}); its last lines:\n{log}")
    return read_outcome(run.store, run.run_id, run.output_dir)


def read_outcome(store, run_id: str, output_dir: Path) -> TrainOutcome:
    """The node's outcome, and its run files fetched into the flow's output folder (plots, samples tables)."""
    prefix = node_prefix(run_id)
    output_dir.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        if store.exists(f"{prefix}/{name}"):
            store.get_file(f"{prefix}/{name}", output_dir / name)
    data = json.loads(store.read_text(f"{prefix}/outcome.json"))
    last = data["last_checkpoint"]
    return TrainOutcome(
        output_dir,
        data["last_step"],
        data["stopped"],
        Path(last) if last else None,
        data["history"],
        data["trainer_seconds"],
        data["eval_start"],
        data["interrupted"],
    )


def record_usage(run, usage: Usage) -> str:
    """What the node cost, on the run's MLflow record (tags ballast.compute*, metrics compute/*); its line."""
    try:
        run.tracking.set_tags(run.run_id, usage.tags())
        for key, value in usage.metrics().items():
            run.client.log_metric(run.run_id, key, value)
    except Exception as e:  # the teardown's facts never hide how the run ended
        return f"{usage.line()} (not recorded in MLflow: {e})"
    return usage.line()


# ── the node's end ─────────────────────────────────────────────────────────────────────────────────


class StepLines(Callbacks):
    """Each step as one line on stdout, for the flow to relay."""

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        print(STEP_LINE + json.dumps({"step": step, "metrics": metrics}), flush=True)


class RunFiles(Callbacks):
    """The run's files to the store at each checkpoint, before it (a node that dies between the two leaves files
    newer than the newest stored checkpoint, which a resume truncates to the checkpoint's step)."""

    def __init__(self, store, run_id: str, output_dir: Path):
        self.store, self.prefix, self.out = store, node_prefix(run_id), output_dir

    def on_checkpoint(self, checkpoint) -> None:
        self.put()

    def put(self) -> None:
        for name in RUN_FILES:
            if (self.out / name).exists():
                self.store.put_file(self.out / name, f"{self.prefix}/{name}")


def restore_from_store(store, checkpoint_prefix: str, run_id: str, output_dir: Path) -> int | None:
    """The newest stored checkpoint and the run files, into `output_dir`; its step (None: no checkpoint yet)."""
    steps = sorted(s for s in (parse_step_dir(d) for d in store.list_dirs(checkpoint_prefix)) if s is not None)
    if not steps:
        return None
    name = step_dir_name(steps[-1])
    target = output_dir / "checkpoints" / name
    if not target.exists():
        store.get_dir(f"{checkpoint_prefix}/{name}", target)
    prefix = node_prefix(run_id)
    for file in RUN_FILES:
        if store.exists(f"{prefix}/{file}"):
            store.get_file(f"{prefix}/{file}", output_dir / file)
    return steps[-1]


def train_node(spec, run_id: str) -> TrainOutcome:
    """The train stage of run `run_id` on this node, resumed from the store when it has a checkpoint."""
    from tasks.record import RunRecorder, Tracking

    tracking = Tracking(spec)
    source = tracking.fork_source_of(run_id)
    run = RunRecorder(tracking, spec, run_id, source, resumed=True)  # metrics: (metric, step) pairs never twice
    run.output_dir.mkdir(parents=True, exist_ok=True)
    restored = restore_from_store(run.store, run.checkpoint_prefix, run_id, run.output_dir)
    if restored is None and source.checkpoint_uri:  # a fork's first start: its verified checkpoint, from the store
        source.checkpoint = fetch_checkpoint(source.checkpoint_uri, run.cache_dir / "fork")
    print(
        f"node: run {run_id}, "
        + (f"resuming from the store's checkpoint at step {restored}" if restored else "starting at step 1"),
        flush=True,
    )
    files = RunFiles(run.store, run_id, run.output_dir)
    hooks = [run.metrics, files, CheckpointUploader(run.store, run.checkpoint_prefix), StepLines()]
    outcome = run_training(spec, run.output_dir, hooks, source, resume=restored is not None, progress=False)
    run.metrics.close()
    if run.metrics.mismatches:
        shown = "; ".join(run.metrics.mismatches[:3])
        tracking.set_tags(run_id, {"resume_mismatch": f"{len(run.metrics.mismatches)}: {shown}"})
    files.put()
    last = outcome.last_checkpoint
    run.store.write_text(
        f"{node_prefix(run_id)}/outcome.json",
        json.dumps(
            {
                "last_step": outcome.last_step,
                "stopped": outcome.stopped,
                "last_checkpoint": str(last) if last else None,
                "history": outcome.history,
                "trainer_seconds": outcome.trainer_seconds,
                "eval_start": outcome.eval_start,
                "interrupted": outcome.interrupted,
            }
        ),
    )
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tasks.remote", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    train = sub.add_parser("train", help="train an opened MLflow run, resuming from the store")
    train.add_argument("--spec", required=True, help="the node spec (node_spec) as YAML")
    train.add_argument("--run-id", required=True)
    args = parser.parse_args(argv)
    outcome = train_node(load_spec(args.spec), args.run_id)
    if outcome.interrupted:  # a preemption's SIGTERM: the checkpoint is in the store; the exit says which signal
        stop = RunInterrupted(outcome.interrupted, outcome.last_step, outcome.last_checkpoint, run=f"run {args.run_id}")
        print(f"node: {stop}", flush=True)
        return stop.exit_code
    print(f"node: train done at step {outcome.last_step}", flush=True)
    return 0


def node_name(spec_name: str, run_id: str) -> str:
    """A node's name (a SkyPilot cluster name: lower case letters, digits, dashes): the spec's and the run's."""
    slug = re.sub(r"[^a-z0-9-]+", "-", spec_name.lower()).strip("-")[:24].strip("-") or "run"
    return f"ballast-{slug}-" + re.sub(r"[^a-z0-9]+", "", run_id.lower())[:8]


def open_compute(spec, tracking_uri: str, run_id: str) -> tuple[Compute, list[str]]:
    """The spec's compute for run `run_id` and the stage command it runs; nothing is provisioned yet. A SkyPilot
    task is validated by SkyPilot's own schema here (ComputeError, one line)."""
    name = node_name(spec.name, run_id)
    project = Path(spec.project_dir).resolve()
    if spec.infra.compute == "local":
        workdir = project / "compute" / name
        node = node_spec(spec, tracking_uri, store_uri(spec), str(workdir / "project"))
        spec_file = write_node_spec(node, project / "compute" / f"{name}.yaml")  # outside the node's disk
        return LocalCompute(name, workdir), stage_command(sys.executable, str(spec_file), run_id)
    plan = plan_skypilot(spec, tracking_uri, run_id, project / "launch")
    return SkyPilotCompute(plan), plan.run.split()


def plan_skypilot(spec, tracking_uri: str, run_id: str, out_dir: Path) -> SkyPlan:
    """The SkyPilot task of the run's stage node, the node spec written to `out_dir`, validated by SkyPilot."""
    name = node_name(spec.name, run_id)
    node = node_spec(spec, tracking_uri, store_uri(spec), ".ballast-node")
    spec_file = write_node_spec(node, out_dir / f"{name}.spec.yaml")
    command = stage_command("python3", f"{REMOTE_SPEC_DIR}/{name}.yaml", run_id)
    vllm = spec.rollout.engine == "vllm" and not spec.rollout.vllm_url
    plan = sky_plan(spec.infra, name, spec_file, " ".join(command), vllm=vllm)  # safe words; `~` must expand
    sky_task(plan.task_config())  # SkyPilot's schema: an invalid field fails here, before anything is provisioned
    return plan


class NodeChoice(BaseModel):
    """Where a run's GPU stages run, as a Prefect Run form asks it (the `ballast-pipeline` deployment); each field
    set becomes an `infra.*` override of the spec."""

    compute: Literal["here", "local", "skypilot"] | None = Field(
        None, description="here: in the flow's process; local: a stage process here; skypilot: a SkyPilot node"
    )
    accelerators: str | None = Field(None, description="SkyPilot accelerators, e.g. H100:1 or H200:2")
    use_spot: bool | None = Field(None, description="spot instances, preemptions recovered from the store's checkpoint")
    cloud: str | None = Field(None, description="k8s, aws, gcp, aws/us-east-1, ...; default: the cheapest enabled")
    num_nodes: int | None = Field(None, ge=1, description="nodes for the job")

    def overrides(self) -> list[str]:
        return [f"infra.{k}={json.dumps(v)}" for k, v in self.model_dump(exclude_none=True).items()]


def check_compute(spec) -> None:
    """What a remote node could not use, refused before anything is provisioned (ComputeError, one line)."""
    from tasks.record import tracking_uri

    uri = spec.tracking.uri or "sqlite:///(the project folder's mlflow.db)"
    if spec.infra.compute == "local":
        uri = tracking_uri(spec)
    check_placement(spec.infra, uri, store_uri(spec))


if __name__ == "__main__":
    sys.exit(main())
