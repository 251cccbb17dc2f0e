"""The GPU stages on a provisioned node (infra/compute.py): what the flow sends, what the node runs, what comes back.

    python3 -m tasks.remote train --spec NODE_SPEC.yaml --run-id RUN_ID              # on the node: the Compute
    python3 -m tasks.remote probe --spec NODE_SPEC.yaml --run-id RUN_ID --step 6     # runs each stage as the
    python3 -m tasks.remote eval  --spec NODE_SPEC.yaml --run-id RUN_ID --step 6     # flow reaches it
    python3 -m tasks.remote --job JOB.json                     # the same as a typed job (NodeJob): a launcher's ranks

The flow (flows/pipeline.py) has opened the MLflow run; the node trains *that* run. Its spec is the run's, with
the tracking and artifact store resolved to the ones the flow uses and the project folder the node's own
(`node_spec`); nothing else of the flow's machine is assumed to be there. On the node, the train stage:

1. restores the newest checkpoint in the store (and the run's metrics.jsonl and samples files saved next to it),
   so a relaunched node — after a preemption — resumes as `ballast run --resume` does; with no checkpoint yet,
   the run starts from its fork source (fetched from the store) or the base model;
2. runs the trainer with the same callbacks as in the flow's process: metrics to MLflow through `MetricsSink`
   as a resumed run's (`record=`: a (metric, step) MLflow already holds is not sent again, so a replayed step is never
   duplicated), each checkpoint to the store as it is saved, and the run's files next to it; SIGTERM (a
   preemption) stops it at a safe point, after a checkpoint;
3. prints each step as one `ballast-step {json}` line, which the flow turns back into the same progress lines
   (and callbacks) as a local run; at the end the outcome goes to the store (`node/outcome.json`).

The artifact-probe and eval stages read the checkpoint of a step from the store (the URI the flow's checkpoint
stage lists), run the same function as in the flow's process (`probe_checkpoint`, `eval_checkpoint`) and write
the result to the store — `node/probe/<step>/probe_report.json` (and .html), `node/eval/<step>.json` — which the
flow reads back into the same ProbeReport and EvalResult it records for a local run. They talk to no MLflow
server; a relaunch repeats them, as they are idempotent. Every stage marks `node/<stage>.json` running, then
done or failed with the error's class and message, which the flow raises again as that class where it knows
it (`node_error`): a bad checkpoint on the node fails the stage with the line a local run shows. On a SkyPilot
cluster the three stages run on the one node; with a managed job (spot) each stage is a job of its own, on a node
SkyPilot provisions for it.

`train_on_node`, `probe_on_node` and `eval_on_node` are the flow's end: run the stage, relaunch it when the
node was preempted (up to `infra.max_restarts`, unless SkyPilot's managed job recovers by itself), then read
what it wrote back.
"""

from __future__ import annotations

import argparse
import builtins
import json
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from infra.compute import (
    Compute,
    ComputeError,
    LocalCompute,
    SkyPilotCompute,
    SkyPlan,
    Usage,
    check_placement,
    sky_plan,
    sky_task,
)
from infra.skypilot import REMOTE_SPEC_DIR
from infra.store import ChecksumError, StoreUnavailable, open_store
from tasks.checkpoint import CheckpointUploader, checkpoint_prefix, fetch_checkpoint
from tasks.results import EvalResult, ProbeError, ProbeReport, RunInterrupted, TrainOutcome
from tasks.spec import SpecError, dump_spec, load_spec, store_uri
from trainer.callbacks import Callbacks
from trainer.checkpoint import Checkpoint, CheckpointError, list_checkpoints, parse_step_dir, step_dir_name
from trainer.config import InputError
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
    `infra.compute: here` (on the node, training runs in the stage's process, or its infra.nproc_per_node ranks)."""
    node = spec.model_copy(deep=True)
    node.tracking.uri, node.storage.uri, node.project_dir = tracking_uri, store_uri, project_dir
    node.infra.compute = "here"
    return node


def write_node_spec(node, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_spec(node))
    return path


def stage_command(python: str, spec_file: str, run_id: str, stage: str = "train", *args: str) -> list[str]:
    return [python, "-m", "tasks.remote", stage, "--spec", spec_file, "--run-id", run_id, *args]


@dataclass
class Node:
    """A run's compute and the stage commands it runs there (`command`); nothing is provisioned until the flow's
    provision stage."""

    compute: Compute
    python: str  # the node's interpreter
    spec_file: str  # the node spec, as the node reads it
    run_id: str

    def command(self, stage: str, *args: str) -> list[str]:
        return stage_command(self.python, self.spec_file, self.run_id, stage, *args)


@dataclass(frozen=True)
class NodeJob:
    """What a node's process is to do, the whole of it: the stage, the node spec, the run, the checkpoint steps
    (probe: each; eval: one) and, for a rank the node's launcher started under torchrun (`prepared`), that the run
    directory is already restored and where the launcher put a fork's checkpoint. The stage commands build one
    from their arguments; the launcher hands its ranks one as a JSON file (`--job FILE`). Nothing else is read
    from the environment but torchrun's RANK."""

    stage: Literal["train", "probe", "eval"]
    spec: str  # the node spec (node_spec) as YAML, as the node reads it
    run_id: str
    steps: tuple[int, ...] = ()
    prepared: bool = False  # one of the ranks: the launcher restored the run directory they share
    fork_checkpoint: str | None = None  # a fork's first start: the checkpoint the launcher fetched and verified

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self)))
        return path

    @classmethod
    def read(cls, path: str | Path) -> NodeJob:
        """The job in a JSON file; InputError (one line) for a file that is not one."""
        try:
            fields = json.loads(Path(path).read_text())
            job = cls(**{**fields, "steps": tuple(fields.get("steps") or ())})
        except (OSError, ValueError, TypeError) as e:
            raise InputError(
                f"--job {path}: not a node job file ({type(e).__name__}: {e}); the node's launcher "
                "writes it — run a stage with `train|probe|eval --spec FILE --run-id ID`"
            ) from None
        if job.stage not in STAGES:
            raise InputError(f"--job {path}: stage {job.stage!r} is none of {', '.join(STAGES)}")
        return job

    @property
    def step(self) -> int:
        return self.steps[0]


class NodeStageFailed(RuntimeError):
    """The node's stage ended with an error (or was preempted more often than allowed); the message quotes its log."""


# The node's errors the flow raises again as themselves (with builtins' by name); any other is a NodeStageFailed.
NODE_ERRORS = {
    e.__name__: e for e in (InputError, SpecError, CheckpointError, ProbeError, ChecksumError, StoreUnavailable)
}


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


def run_on_node(
    compute: Compute,
    stage: str,
    command: list[str],
    relay: LineRelay,
    max_restarts: int,
    store=None,
    run_id: str | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Run `stage` on the provisioned `compute` until it ends well, relaunching it on preemption; an error the node
    recorded in `store` is raised again (`node_error`), any other failure as NodeStageFailed with its log."""
    restarts = 0
    while True:
        clear_stage_record(store, run_id, stage)
        ended = compute.run(command, env or {}, relay)
        if ended.code == 0:
            return
        if ended.preempted and not compute.recovers_itself and restarts < max_restarts:
            restarts += 1
            where = f" after step {relay.last_step}" if stage == "train" else ""
            again = ", resuming from the store's newest checkpoint" if stage == "train" else " (the stage starts over)"
            relay.say(
                f"{stage}: the node went away{where} ({ended.detail}); relaunching it{again} "
                f"(restart {restarts} of at most {max_restarts})"
            )
            compute.recover()
            continue
        recorded = read_stage_error(store, run_id, stage) if store is not None and not ended.preempted else None
        if recorded is not None:
            raise recorded
        why = "preempted once more than infra.max_restarts allows" if ended.preempted else "failed"
        log = "\n".join(relay.tail[-LOG_TAIL:])
        raise NodeStageFailed(f"the {stage} stage on {compute.name} {why} ({ended.detail}); its last lines:\n{log}")


def clear_stage_record(store, run_id: str | None, stage: str) -> None:
    """Before each launch of `stage`: what an earlier launch recorded (`node/<stage>.json`) is cleared, so a node that
    dies before it writes its own is never read as that earlier one's error."""
    if store is not None and run_id:
        try:
            store.write_text(f"{node_prefix(run_id)}/{stage}.json", json.dumps({"state": "launching"}))
        except Exception as e:  # the store away: the stage's own run finds it so, and says it
            print(f"{stage}: its earlier record on the store was not cleared: {e}", flush=True)


def read_stage_error(store, run_id: str, stage: str) -> Exception | None:
    """The error the node recorded for `stage` (`node/<stage>.json`), as the flow raises it; None when none is."""
    try:
        state = json.loads(store.read_text(f"{node_prefix(run_id)}/{stage}.json"))
    except Exception:  # never written (the node died first), or the store is away: the log says what happened
        return None
    return node_error(state["error"], state["message"]) if state.get("state") == "failed" else None


def node_error(name: str, message: str) -> Exception:
    """The node's error as the flow raises it: the same class and message where the flow knows the class (so the
    stage fails with the line a local run shows), else a NodeStageFailed naming it."""
    known = NODE_ERRORS.get(name) or getattr(builtins, name, None)
    if isinstance(known, type) and issubclass(known, Exception):
        try:
            return known(message)
        except TypeError:  # a class whose constructor takes more than a message
            pass
    return NodeStageFailed(f"{name}: {message}")


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
    store, run_id = (run.store, run.run_id) if run is not None else (None, None)
    run_on_node(compute, "train", command, LineRelay(hooks, say), max_restarts, store, run_id, env)
    return read_outcome(run.store, run.run_id, run.output_dir)


def probe_on_node(
    node: Node, store, steps: Sequence[int], say: Callable[[str], None], max_restarts: int
) -> list[ProbeReport]:
    """The artifact probe of the checkpoints at `steps` on the node; their reports, read back from `store`."""
    command = node.command("probe", *[f"--step={step}" for step in steps])
    run_on_node(node.compute, "artifact-probe", command, LineRelay([], say), max_restarts, store, node.run_id)
    prefix = node_prefix(node.run_id)
    return [
        ProbeReport.from_dict(json.loads(store.read_text(f"{prefix}/probe/{step_dir_name(step)}/probe_report.json")))
        for step in steps
    ]


def eval_on_node(node: Node, store, step: int, say: Callable[[str], None], max_restarts: int) -> EvalResult:
    """The eval of the checkpoint at `step` on the node; its result, read back from `store`."""
    command = node.command("eval", f"--step={step}")
    run_on_node(node.compute, "eval", command, LineRelay([], say), max_restarts, store, node.run_id)
    return EvalResult(**json.loads(store.read_text(f"{node_prefix(node.run_id)}/eval/{step_dir_name(step)}.json")))


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
    restored = prepare_node(spec, run_id, run, source)
    return train_prepared(spec, run_id, run, source, restored)


def prepare_node(spec, run_id: str, run, source) -> int | None:
    """This node's run directory: the store's newest checkpoint (its step; None: none yet), or a fork's checkpoint on
    its first start. Once per node, before its ranks start (they share the directory)."""
    run.output_dir.mkdir(parents=True, exist_ok=True)
    restored = restore_from_store(run.store, run.checkpoint_prefix, run_id, run.output_dir)
    if restored is None and source.checkpoint_uri:  # a fork's first start: its verified checkpoint, from the store
        source.checkpoint = fetch_checkpoint(source.checkpoint_uri, run.cache_dir / "fork")
    print(
        f"node: run {run_id}, "
        + (f"resuming from the store's checkpoint at step {restored}" if restored else "starting at step 1"),
        flush=True,
    )
    return restored


def train_prepared(spec, run_id: str, run, source, restored: int | None) -> TrainOutcome:
    """Train the prepared run directory; under torchrun, only global rank 0 records (MLflow, the store, step lines,
    the outcome), as the trainer itself writes only on rank 0."""
    from tasks.train import run_training

    if os.environ.get("RANK", "0") != "0":
        return run_training(spec, run.output_dir, [], source, resume=restored is not None, progress=False)
    files = RunFiles(run.store, run_id, run.output_dir)
    hooks = [run.metrics, files, CheckpointUploader(run.store, run.checkpoint_prefix), StepLines()]
    outcome = run_training(spec, run.output_dir, hooks, source, resume=restored is not None, progress=False)
    run.metrics.close()
    if run.metrics.mismatches:
        shown = "; ".join(run.metrics.mismatches[:3])
        run.tracking.set_tags(run_id, {"resume_mismatch": f"{len(run.metrics.mismatches)}: {shown}"})
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


def probe_node(spec, run_id: str, steps: Sequence[int]) -> list[ProbeReport]:
    """The artifact probe of run `run_id`'s stored checkpoints at `steps`, as the flow's process runs it; each
    report to the store (JSON and page)."""
    from tasks.probe import probe_checkpoint, run_probe_args

    store, cache = open_store(store_uri(spec)), Path(spec.project_dir).resolve() / "cache" / run_id
    reports = []
    for step in steps:
        uri = store.child_uri(checkpoint_prefix(run_id), step_dir_name(step))  # the flow's checkpoint stage's URI
        report = probe_checkpoint(uri, **run_probe_args(spec, cache))
        where = f"{node_prefix(run_id)}/probe/{step_dir_name(step)}"
        pages = cache / "probe-report" / step_dir_name(step)
        store.put_file(report.write_json(pages / "probe_report.json"), f"{where}/probe_report.json")
        store.put_file(report.write_html(pages / "probe_report.html"), f"{where}/probe_report.html")
        print(
            f"node: artifact-probe of step {step} {'passed' if report.passed else 'FAILED'}: {report.versus()}",
            flush=True,
        )
        reports.append(report)
    return reports


def eval_node(spec, run_id: str, step: int) -> EvalResult:
    """The eval of run `run_id`'s stored checkpoint at `step`, as the flow's process runs it; the result (metrics,
    per-prompt scores, samples) to the store."""
    from tasks.eval import eval_checkpoint

    store, cache = open_store(store_uri(spec)), Path(spec.project_dir).resolve() / "cache" / run_id
    uri = store.child_uri(checkpoint_prefix(run_id), step_dir_name(step))
    result = eval_checkpoint(spec, uri, cache / "eval")
    store.write_text(f"{node_prefix(run_id)}/eval/{step_dir_name(step)}.json", json.dumps(asdict(result)))
    scores = "  ".join(f"{k} {v:.4g}" for k, v in result.metrics.items())
    print(f"node: eval of step {step} done: {scores}", flush=True)
    return result


STAGES = {"train": "train", "probe": "artifact-probe", "eval": "eval"}  # subcommand: the pipeline's stage


def main(argv: list[str] | None = None) -> int:
    job = parse_job(argv)
    spec = load_spec(job.spec)
    store = open_store(store_uri(spec))
    state = f"{node_prefix(job.run_id)}/{STAGES[job.stage]}.json"
    store.write_text(state, json.dumps({"state": "running"}))
    try:
        code = run_node_stage(spec, job)
    except Exception as e:  # recorded for the flow, which raises it again: the line a local run shows
        if not isinstance(e, tuple(NODE_ERRORS.values())):  # a known one is the flow's line alone, as locally
            traceback.print_exc()  # an unexpected error: its traceback in the node's log (Prefect's run log)
        store.write_text(state, json.dumps({"state": "failed", "error": type(e).__name__, "message": str(e)}))
        return 1
    store.write_text(state, json.dumps({"state": "done"}))
    return code


def parse_job(argv: list[str] | None) -> NodeJob:
    """The node's job: from a stage command's arguments, or a job file (`--job FILE`, what a launcher's ranks get)."""
    parser = argparse.ArgumentParser(prog="python3 -m tasks.remote", description=__doc__.splitlines()[0])
    parser.add_argument("--job", help="a node job (NodeJob) as a JSON file, instead of a stage and its arguments")
    sub = parser.add_subparsers(dest="stage")
    helps = {
        "train": "train an opened MLflow run, resuming from the store",
        "probe": "probe the run's stored checkpoints at --step (repeatable)",
        "eval": "evaluate the run's stored checkpoint at --step",
    }
    for name, text in helps.items():
        stage = sub.add_parser(name, help=text)
        stage.add_argument("--spec", required=True, help="the node spec (node_spec) as YAML")
        stage.add_argument("--run-id", required=True)
        if name != "train":
            stage.add_argument("--step", type=int, required=True, action="append")
    args = parser.parse_args(argv)
    if args.job:
        try:
            return NodeJob.read(args.job)
        except InputError as e:
            parser.exit(2, f"{e}\n")
    if not args.stage:
        parser.error("give a stage (train, probe or eval) or --job FILE")
    return NodeJob(args.stage, args.spec, args.run_id, tuple(getattr(args, "step", None) or ()))


def run_node_stage(spec, job: NodeJob) -> int:
    """One stage on this node; its exit status (a preemption's signal for an interrupted train stage)."""
    if job.stage == "probe":
        probe_node(spec, job.run_id, job.steps)
        return 0
    if job.stage == "eval":
        eval_node(spec, job.run_id, job.step)
        return 0
    if spec.infra.nproc_per_node * spec.infra.num_nodes > 1:
        return train_ranks(spec, job)
    return stage_exit(train_node(spec, job.run_id), job.run_id)


def stage_exit(outcome: TrainOutcome, run_id: str, say: bool = True) -> int:
    """The train stage's exit status, and its last line when `say` (rank 0): an interrupted one (a preemption's
    SIGTERM: the checkpoint is in the store) exits with the signal's status."""
    if outcome.interrupted:
        stop = RunInterrupted(outcome.interrupted, outcome.last_step, outcome.last_checkpoint, run=f"run {run_id}")
        if say:
            print(f"node: {stop}", flush=True)
        return stop.exit_code
    if say:
        print(f"node: train done at step {outcome.last_step}", flush=True)
    return 0


def train_ranks(spec, job: NodeJob) -> int:
    """The train stage as infra.nproc_per_node ranks on this node (of infra.num_nodes, from SkyPilot's environment):
    the launcher prepares the run directory once, then runs each rank under torchrun with a job that says so
    (`prepared`, and the fork's checkpoint it fetched); rank 0 records. A rank's failure is one line naming it, and
    its exit status the stage's."""
    from tasks.ranks import launch, node_launch
    from tasks.record import RunRecorder, Tracking

    tracking = Tracking(spec)
    source = tracking.fork_source_of(job.run_id)
    run = RunRecorder(tracking, spec, job.run_id, source, resumed=True)
    if job.prepared:  # one of the ranks: the launcher restored the directory
        if job.fork_checkpoint:
            source.checkpoint = Checkpoint.open(job.fork_checkpoint, verify=False)  # the launcher verified it
        found = list_checkpoints(run.output_dir / "checkpoints")
        restored = found[-1][0] if found else None
        outcome = train_prepared(spec, job.run_id, run, source, restored)
        return stage_exit(outcome, job.run_id, say=os.environ.get("RANK", "0") == "0")
    where = node_launch(dict(os.environ))
    prepare_node(spec, job.run_id, run, source)  # every node its own disk: each node's launcher restores its copy
    fork = str(source.checkpoint.path) if source.checkpoint is not None else None
    ranks = replace(job, prepared=True, fork_checkpoint=fork).write(run.cache_dir / "node-job.json")
    nproc = spec.infra.nproc_per_node
    print(f"node: {nproc} rank(s) here, {nproc * spec.infra.num_nodes} in all", flush=True)
    return launch(nproc, ["-m", "tasks.remote", "--job", str(ranks)], log=sys.stdout, **where)


def node_name(spec_name: str, run_id: str) -> str:
    """A node's name (a SkyPilot cluster name: lower case letters, digits, dashes): the spec's and the run's."""
    slug = re.sub(r"[^a-z0-9-]+", "-", spec_name.lower()).strip("-")[:24].strip("-") or "run"
    return f"ballast-{slug}-" + re.sub(r"[^a-z0-9]+", "", run_id.lower())[:8]


def open_compute(spec, tracking_uri: str, run_id: str) -> Node:
    """The spec's compute for run `run_id` and the stage commands it runs; nothing is provisioned yet. A SkyPilot
    task is validated by SkyPilot's own schema here (ComputeError, one line)."""
    name = node_name(spec.name, run_id)
    project = Path(spec.project_dir).resolve()
    if spec.infra.compute == "local":
        workdir = project / "compute" / name
        node = node_spec(spec, tracking_uri, store_uri(spec), str(workdir / "project"))
        spec_file = write_node_spec(node, project / "compute" / f"{name}.yaml")  # outside the node's disk
        return Node(LocalCompute(name, workdir), sys.executable, str(spec_file), run_id)
    plan = plan_skypilot(spec, tracking_uri, run_id, project / "launch")
    return Node(SkyPilotCompute(plan), "python3", plan.remote_spec, run_id)


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
    nproc_per_node: int | None = Field(
        None, ge=1, description="trainer ranks per node (torchrun), with model.parallel ddp or fsdp2 in the spec"
    )

    def overrides(self) -> list[str]:
        return [f"infra.{k}={json.dumps(v)}" for k, v in self.model_dump(exclude_none=True).items()]


def check_compute(spec) -> None:
    """What a remote node could not use, refused before anything is provisioned (ComputeError, one line)."""
    from tasks.ranks import check_stage_ranks
    from tasks.spec import tracking_uri

    try:
        check_stage_ranks(spec)  # infra.nproc_per_node / num_nodes the compute cannot give, before anything else
    except SpecError as e:
        raise ComputeError(str(e)) from None
    if spec.infra.compute == "here":
        return
    uri = spec.tracking.uri or "sqlite:///(the project folder's mlflow.db)"
    if spec.infra.compute == "local":
        uri = tracking_uri(spec)
    check_placement(spec.infra, uri, store_uri(spec))


if __name__ == "__main__":
    sys.exit(main())
