"""Compute is a stage: a pipeline run with `infra.compute: local` goes provision → train → checkpoint →
artifact-probe → eval → teardown, train, probe and eval each a stage process on a provisioned "node", the same
path as SkyPilot but for SkyPilot's own calls. The node trains the run the flow opened, through the store alone: a
preempted node (SIGTERM, then SIGKILL, of the stage's process group) is relaunched by the flow and resumes from
the store's newest checkpoint, and the finished run equals an uninterrupted one. The probe and eval the node
writes to the store come back as the results the flow records for a local run, and a node's error as the error a
local stage raises. Teardown always happens; the run records what the node cost.
The SkyPilot side is tested up to its SDK: the task it would submit, validated by SkyPilot's own schema.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from infra.compute import STAGE_PID, ComputeError, LocalCompute, check_placement, sky_task
from tasks.remote import LineRelay, NodeStageFailed, node_error, node_name, plan_skypilot
from tasks.spec import load_spec
from tests.conftest import REPO, tiny_spec
from trainer.checkpoint import step_dir_name
from trainer.loop import Callbacks

STEPS = 6
WAIT_S = 900


def node_spec_dict(tiny_model, project: Path, **changes) -> dict:
    sections = {"infra": {"compute": "local", "max_restarts": 2}, **changes}
    return tiny_spec(
        tiny_model,
        name="node-run",
        project_dir=str(project),
        optim={"steps": STEPS, "learning_rate": 3e-3},
        checkpoint={"every": 2, "keep_last": 10},
        probe={"n": 2, "max_tokens": 16, "expected_length": 8, "max_malformed_rate": 1.0},
        **sections,
    )


def task_run_names(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            sort=TaskRunSort.EXPECTED_START_TIME_ASC,
        )
    return [r.name.rsplit("-", 1)[0] for r in runs]


def flow_log_lines(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # what the flow logged, sent
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [log.message for log in logs]


def run_flow(spec: dict):
    from flows.pipeline import ballast_pipeline

    state = ballast_pipeline(spec, progress=False, return_state=True)
    return state, state.result(raise_on_failure=False)


def adapter(result) -> dict:
    return load_file(str(Path(result.final_checkpoint) / "adapter" / "adapter_model.safetensors"))


def step_rewards(tracking_uri: str, run_id: str) -> list[tuple[int, float]]:
    history = MlflowClient(tracking_uri).get_metric_history(run_id, "reward")
    return sorted((m.step, m.value) for m in history)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model, tmp_path_factory, prefect_api):
    project = tmp_path_factory.mktemp("uninterrupted") / "project"
    state, result = run_flow(node_spec_dict(tiny_model, project))
    return project, state, result


def test_a_local_compute_run_shows_each_stage_as_a_task_and_tears_the_node_down(uninterrupted):
    project, state, result = uninterrupted
    assert state.is_completed(), state.message
    assert result.status == "finished" and result.last_step == STEPS
    names = task_run_names(state.state_details.flow_run_id)
    assert names == ["fork", "provision", "train", "checkpoint", "artifact-probe", "eval", "teardown"]
    assert not any((project / "compute").glob("ballast-*/"))  # the node's disk is gone


def test_the_node_trains_the_flows_mlflow_run_and_records_what_it_used(uninterrupted):
    project, _, result = uninterrupted
    uri = f"sqlite:///{project.resolve() / 'mlflow.db'}"
    rewards = step_rewards(uri, result.run_id)
    assert [s for s, _ in rewards] == list(range(1, STEPS + 1))  # every step once, on the run the flow opened
    run = MlflowClient(uri).get_run(result.run_id)
    assert run.data.tags["ballast.compute"] == "local"
    assert run.data.tags["ballast.compute.spot"] == "on-demand"
    assert run.data.tags["ballast.compute.torn_down"] == "True"
    assert run.data.metrics["compute/restarts"] == 0
    assert run.data.metrics["compute/run_s"] > 0
    assert [round(r, 6) for r in result.rewards] == [round(v, 6) for _, v in rewards]


def test_probe_and_eval_run_on_the_node_and_come_back_as_the_results_the_flow_records(uninterrupted):
    project, state, result = uninterrupted
    lines = flow_log_lines(state.state_details.flow_run_id)
    assert any(line.startswith(f"node: artifact-probe of step {STEPS} ") for line in lines)  # relayed from the node
    assert any(line.startswith(f"node: eval of step {STEPS} done") for line in lines)
    node = project / "artifacts" / "runs" / result.run_id / "node"
    stored = json.loads((node / "probe" / step_dir_name(STEPS) / "probe_report.json").read_text())
    recorded = json.loads((Path(result.output_dir) / "probe" / step_dir_name(STEPS) / "probe_report.json").read_text())
    assert recorded == stored and stored["checkpoint"] == result.checkpoints[STEPS]
    assert (node / "probe" / step_dir_name(STEPS) / "probe_report.html").exists()
    evaluated = json.loads((node / "eval" / f"{step_dir_name(STEPS)}.json").read_text())
    assert evaluated["metrics"] == result.eval and evaluated["checkpoint_uri"] == result.checkpoints[STEPS]


def test_the_nodes_eval_equals_evaluating_the_final_checkpoint_in_the_flows_process(
    tiny_model, uninterrupted, tmp_path
):
    from tasks.eval import eval_checkpoint

    project, _, result = uninterrupted
    here = eval_checkpoint(load_spec(node_spec_dict(tiny_model, project)), result.checkpoints[STEPS], tmp_path)
    assert result.eval == pytest.approx(here.metrics, abs=1e-9)
    assert result.eval_per_prompt == pytest.approx(here.per_prompt, abs=1e-9)
    uri = f"sqlite:///{project.resolve() / 'mlflow.db'}"
    logged = MlflowClient(uri).get_metric_history(result.run_id, "eval/reward")
    assert [(m.step, m.value) for m in logged] == [(STEPS, pytest.approx(here.metrics["eval/reward"], abs=1e-9))]


def test_a_bad_checkpoint_fails_the_probe_on_the_node_with_the_error_a_local_probe_raises(
    tiny_model, tmp_path, uninterrupted
):
    from infra.store import open_store
    from tasks.checkpoint import checkpoint_prefix
    from tasks.probe import probe_checkpoint
    from tasks.remote import open_compute, probe_on_node
    from tasks.results import ProbeError
    from tasks.spec import store_uri

    _, _, clean = uninterrupted
    spec = load_spec(node_spec_dict(tiny_model, tmp_path / "project"))
    store, run_id = open_store(store_uri(spec)), "0123456789abcdef"
    final = Path(clean.final_checkpoint)
    store.put_dir(final, f"{checkpoint_prefix(run_id)}/{final.name}")
    uri = store.child_uri(checkpoint_prefix(run_id), final.name)
    with open(Path(uri) / "adapter" / "adapter_model.safetensors", "ab") as f:
        f.write(b"altered after it was saved")
    with pytest.raises(ProbeError) as here:
        probe_checkpoint(uri, spec.probe, spec.model, tmp_path / "cache", lora_cfg=spec.lora)
    node = open_compute(spec, "sqlite:///unused.db", run_id)
    node.compute.provision()
    said = []
    try:
        with pytest.raises(ProbeError) as there:
            probe_on_node(node, store, [STEPS], said.append, max_restarts=0)
    finally:
        node.compute.teardown()
    assert str(there.value) == str(here.value) and "cannot probe" in str(here.value)
    assert not any("Traceback" in line or "cannot probe" in line for line in said)  # the flow raises its one line


def test_a_two_rank_train_stage_on_the_node_equals_the_one_rank_run(tiny_model, uninterrupted, tmp_path):
    """`infra.nproc_per_node: 2` (model.parallel: ddp): the node's train stage is two torchrun ranks (gloo), rank 0
    recording. The run equals the one-rank run of the same spec: every step's reward logged once on the flow's MLflow
    run, equal to fp32 reduction-order rounding, and the final adapter within tests/test_distributed.py's tolerance;
    probe and eval read its checkpoint as any other."""
    _, _, alone = uninterrupted
    project = tmp_path / "project"
    spec = node_spec_dict(tiny_model, project, infra={"compute": "local", "max_restarts": 2, "nproc_per_node": 2})
    spec["model"]["parallel"] = "ddp"
    state, result = run_flow(spec)
    assert state.is_completed(), state.message
    assert result.status == "finished" and result.last_step == STEPS
    lines = flow_log_lines(state.state_details.flow_run_id)
    assert any("node: 2 rank(s) here, 2 in all" in line for line in lines), lines
    rewards = step_rewards(f"sqlite:///{project.resolve() / 'mlflow.db'}", result.run_id)
    assert [s for s, _ in rewards] == list(range(1, STEPS + 1))  # each step once: rank 0 alone records
    assert [v for _, v in rewards] == pytest.approx(alone.rewards, abs=1e-5)
    got, want = adapter(result), adapter(alone)
    assert got.keys() == want.keys()
    # tests/test_distributed.py's parameter tolerance: 1 % of a step per update (Adam's g / sqrt(v) magnifies the
    # rounding of a near-zero gradient summed in another order); measured 1.2e-5 against 1.8e-4 here
    assert max(float((got[k] - want[k]).abs().max()) for k in got) <= 0.01 * 3e-3 * STEPS
    assert result.eval.keys() == alone.eval.keys() and result.eval["eval/reward"] == pytest.approx(
        alone.eval["eval/reward"]
    )


def test_a_node_job_is_the_stage_commands_arguments_and_reads_back_from_its_file(tmp_path):
    """A node's process takes a typed job: the stage command's arguments and the launcher's job file for its ranks
    (prepared, the fork's checkpoint) are one NodeJob; nothing is read from the environment."""
    from tasks.remote import NodeJob, parse_job

    assert parse_job(["probe", "--spec", "n.yaml", "--run-id", "abc", "--step", "3", "--step", "6"]) == NodeJob(
        "probe", "n.yaml", "abc", (3, 6)
    )
    assert parse_job(["eval", "--spec", "n.yaml", "--run-id", "abc", "--step", "6"]).step == 6
    ranks = NodeJob("train", "n.yaml", "abc", prepared=True, fork_checkpoint="/cache/fork/step-000004")
    assert parse_job(["--job", str(ranks.write(tmp_path / "job.json"))]) == ranks


def test_a_bad_node_job_file_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "job.json").write_text('{"stage": "train", "spec": "n.yaml"}')
    done = subprocess.run(
        [sys.executable, "-m", "tasks.remote", "--job", str(tmp_path / "job.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().startswith(f"--job {tmp_path / 'job.json'}: not a node job file"), done.stderr


def test_a_nodes_error_is_raised_again_as_its_class_where_the_flow_knows_it():
    from tasks.results import ProbeError
    from trainer.checkpoint import CheckpointError

    assert type(node_error("ProbeError", "cannot probe x")) is ProbeError
    assert type(node_error("CheckpointError", "bad")) is CheckpointError
    assert str(node_error("FileNotFoundError", "artifact x does not exist")) == "artifact x does not exist"
    unknown = node_error("CudaOutOfMemory", "out of memory")
    assert isinstance(unknown, NodeStageFailed) and str(unknown) == "CudaOutOfMemory: out of memory"


def preempt_when(project: Path, step: int, grace_s: float, done: threading.Event, log: list) -> None:
    """Once the node's metrics.jsonl has `step`, SIGTERM the stage's process group, then SIGKILL after `grace_s`
    (a spot preemption); once only."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not done.is_set():
        for metrics in project.glob("compute/ballast-*/project/runs/*/metrics.jsonl"):
            lines = [line for line in metrics.read_text().splitlines() if '"step"' in line]
            if len(lines) >= step:
                pid = int((metrics.parents[3] / STAGE_PID).read_text())
                os.killpg(pid, signal.SIGTERM)
                time.sleep(grace_s)
                try:
                    os.killpg(pid, signal.SIGKILL)
                    log.append("SIGKILL")
                except ProcessLookupError:
                    log.append("exited before SIGKILL")
                return
        time.sleep(0.1)


def test_a_preempted_node_is_relaunched_and_the_run_equals_an_uninterrupted_one(
    tiny_model, tmp_path, prefect_api, uninterrupted
):
    _, _, clean = uninterrupted
    project = tmp_path / "project"
    done, log = threading.Event(), []
    killer = threading.Thread(target=preempt_when, args=(project, 3, 2.0, done, log), daemon=True)
    killer.start()
    try:
        state, result = run_flow(node_spec_dict(tiny_model, project))
    finally:
        done.set()
        killer.join()
    assert log, "the node was never preempted"
    assert state.is_completed(), state.message
    uri = f"sqlite:///{project.resolve() / 'mlflow.db'}"
    run = MlflowClient(uri).get_run(result.run_id)
    assert run.data.metrics["compute/restarts"] == 1
    rewards = step_rewards(uri, result.run_id)
    assert [s for s, _ in rewards] == list(range(1, STEPS + 1))  # no step missing or logged twice
    assert [v for _, v in rewards] == pytest.approx([r for r in clean.rewards], abs=1e-6)
    assert result.rewards == pytest.approx(clean.rewards, abs=1e-6)
    mine, theirs = adapter(result), adapter(clean)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert "ballast.resume_mismatch" not in run.data.tags


# ── LocalCompute alone ─────────────────────────────────────────────────────────────────────────────


def script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "stage.py"
    path.write_text(body)
    return [sys.executable, str(path)]


def test_local_compute_streams_lines_and_reports_a_signal_as_a_preemption(tmp_path):
    compute = LocalCompute("n", tmp_path / "node")
    compute.provision()
    lines = []
    ended = compute.run(script(tmp_path, "print('a'); print('b')"), {}, lines.append)
    assert (ended.code, ended.preempted, lines) == (0, False, ["a", "b"])
    body = "import os, signal; print('up', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    ended = compute.run(script(tmp_path, body), {}, lines.append)
    assert (ended.code, ended.preempted) == (137, True)
    ended = compute.run(script(tmp_path, "raise SystemExit(3)"), {}, lines.append)
    assert (ended.code, ended.preempted) == (3, False)
    compute.teardown()
    assert not (tmp_path / "node").exists() and compute.usage().torn_down


def test_teardown_stops_a_stage_that_still_runs_with_sigterm_then_sigkill(tmp_path):
    compute = LocalCompute("n", tmp_path / "node", stop_grace_s=1.0)
    compute.provision()
    body = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
    )
    started = threading.Event()
    worker = threading.Thread(
        target=lambda: compute.run(script(tmp_path, body), {}, lambda line: started.set()), daemon=True
    )
    worker.start()
    assert started.wait(60)
    compute.teardown()  # SIGTERM is ignored by the stage: SIGKILL after the grace period
    worker.join(60)
    assert compute.proc.returncode == -signal.SIGKILL and not worker.is_alive()


def test_the_flow_relaunches_a_preempted_stage_and_fails_past_max_restarts(tmp_path):
    from tasks.remote import train_on_node

    compute = LocalCompute("n", tmp_path / "node")
    compute.provision()
    always_killed = "import os, signal; print('hello', flush=True); os.kill(os.getpid(), signal.SIGTERM)"
    said = []
    with pytest.raises(NodeStageFailed, match="preempted once more than infra.max_restarts allows") as e:
        train_on_node(compute, script(tmp_path, always_killed), None, [], said.append, max_restarts=2)
    assert "hello" in str(e.value)
    assert compute.usage().restarts == 2 and sum("relaunching" in s for s in said) == 2


def test_step_lines_from_the_node_reach_the_flows_callbacks():
    seen = []

    class Hook(Callbacks):
        def on_step(self, step, metrics):
            seen.append((step, metrics["reward"]))

    said = []
    relay = LineRelay([Hook()], said.append)
    relay('ballast-step {"step": 3, "metrics": {"reward": 0.5}}')
    relay("some warning")
    assert seen == [(3, 0.5)] and said == ["some warning"] and relay.last_step == 3


def test_a_sigterm_to_the_flow_does_not_reach_the_stage_process_group(tmp_path):
    compute = LocalCompute("n", tmp_path / "node")
    compute.provision()
    compute.run(script(tmp_path, "print('x')"), {}, lambda line: None)
    assert os.getpgid(os.getpid()) != compute.proc.pid  # the stage led its own session
    compute.teardown()


# ── refused before anything is provisioned ─────────────────────────────────────────────────────────

REMOTE = {
    "name": "big",
    "model": {"name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"},
    "tracking": {"uri": "http://mlflow.team.internal:5000"},
    "storage": {"uri": "s3://team-bucket/ballast"},
    "infra": {"compute": "skypilot", "accelerators": "H100:1", "use_spot": True, "env": ["HF_TOKEN"]},
}


def spec_file(tmp_path: Path, **infra) -> Path:
    data = {**REMOTE, "project_dir": str(tmp_path / "project"), "infra": {**REMOTE["infra"], **infra}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "override, message",
    [
        ("infra.accelerators=H100:x", "infra.accelerators='H100:x' is not NAME or NAME:COUNT"),
        ("infra.accelerators=H100:1:2", "infra.accelerators='H100:1:2'"),
        ("storage.uri=/data/ballast", "infra.use_spot: true with storage /data/ballast"),
        ("tracking.uri=null", "the node cannot reach an embedded SQLite store"),
        ("tracking.uri=http://127.0.0.1:5000", "loopback address"),
        ("infra.cloud=nosuchcloud", "SkyPilot refused the task"),
    ],
)
def test_remote_infra_the_node_could_not_use_is_refused_in_one_line_with_exit_2(
    tmp_path, monkeypatch, capsys, override, message
):
    from flows.cli import main

    monkeypatch.setenv("HF_TOKEN", "hf_value")
    assert main(["run", str(spec_file(tmp_path)), "--set", override, "--dryrun"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "project" / "runs").exists()


def test_an_accelerator_string_skypilot_refuses_is_refused_with_its_reason():
    from infra.compute import check_accelerators

    with pytest.raises(ComputeError, match="infra.accelerators='H100:0': SkyPilot refused it: Accelerator count must"):
        check_accelerators("H100:0")


def test_check_placement_accepts_local_compute_with_embedded_stores(tmp_path):
    spec = load_spec({"model": {"name_or_path": "m"}, "infra": {"compute": "local"}})
    check_placement(spec.infra, "sqlite:////tmp/x.db", str(tmp_path))  # this machine reaches its own stores


# ── the SkyPilot task, as SkyPilot would take it ───────────────────────────────────────────────────


def test_dryrun_of_a_spot_h100_run_prints_a_managed_job_skypilot_accepts_with_secrets_by_name(
    tmp_path, monkeypatch, capsys
):
    from flows.cli import main

    monkeypatch.setenv("HF_TOKEN", "hf_sekret_value")
    assert main(["run", str(spec_file(tmp_path)), "--dryrun"]) == 0
    out = capsys.readouterr().out
    assert "hf_sekret_value" not in out and "HF_TOKEN" in out
    config = yaml.safe_load("\n".join(line for line in out.splitlines() if not line.startswith("#")))
    task = sky_task({**config, "secrets": {"HF_TOKEN": "x"}})  # SkyPilot's schema (names get values at launch)
    (resources,) = task.resources
    assert resources.accelerators == {"H100": 1} and resources.use_spot
    assert resources.job_recovery == {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 3}
    assert config["secrets"] == {"HF_TOKEN": None}
    name = node_name("big", "RUN_ID")
    assert task.run == f"python3 -m tasks.remote train --spec ~/.ballast-launch/{name}.yaml --run-id RUN_ID"
    ((remote, local),) = config["file_mounts"].items()
    node = load_spec(local)  # the spec the node runs: the team's stores, its own project folder, trains in-process
    assert (node.tracking.uri, node.storage.uri) == (REMOTE["tracking"]["uri"], REMOTE["storage"]["uri"])
    assert node.infra.compute == "here" and remote.endswith(f"{name}.yaml")
    assert "hf_sekret_value" not in Path(local).read_text()


def test_dryrun_of_a_two_node_on_demand_job_is_a_cluster_task_skypilot_accepts(tmp_path, monkeypatch, capsys):
    from flows.cli import main

    monkeypatch.setenv("HF_TOKEN", "x")
    path = spec_file(tmp_path, use_spot=False, num_nodes=2, accelerators="H200:2", cloud="k8s", disk_size=200)
    path.write_text(path.read_text().replace("name_or_path:", "parallel: ddp\n  name_or_path:"))  # 2 ranks need it
    assert main(["run", str(path), "--dryrun"]) == 0
    out = capsys.readouterr().out
    assert "cluster (autodown after idle)" in out
    task = sky_task(yaml.safe_load("\n".join(line for line in out.splitlines() if not line.startswith("#"))))
    (resources,) = task.resources
    assert task.num_nodes == 2 and resources.accelerators == {"H200": 2} and resources.disk_size == 200
    assert not resources.use_spot and resources.job_recovery is None


def test_the_skypilot_compute_is_planned_without_provisioning(tmp_path, monkeypatch):
    from tasks.remote import open_compute

    monkeypatch.setenv("HF_TOKEN", "x")
    spec = load_spec(spec_file(tmp_path))
    node = open_compute(spec, spec.tracking.uri, "0123456789abcdef")
    compute = node.compute
    assert compute.recovers_itself and compute.name == "ballast-big-01234567"
    assert " ".join(node.command("train")) == compute.plan.run  # the task's own stage; probe and eval alike:
    assert node.command("eval", "--step=6")[3:] == [
        "eval",
        "--spec",
        compute.plan.remote_spec,
        "--run-id",
        "0123456789abcdef",
        "--step=6",
    ]
    assert compute.usage().spot and compute.usage().accelerators == "H100:1"
    plan = plan_skypilot(spec, spec.tracking.uri, "0123456789abcdef", tmp_path / "launch")
    launched = sky_task(plan.task_config(with_secret_values=True))
    assert {k: v.get_secret_value() for k, v in launched.secrets.items()} == {"HF_TOKEN": "x"}


def test_a_multi_node_train_stage_runs_on_every_node_and_the_probe_and_eval_on_the_head(tmp_path, monkeypatch):
    """SkyPilot runs the train stage's command on each of the cluster's nodes, where one launcher per node starts
    its ranks (tasks/remote.py train_ranks); the probe and eval stages are tasks of one node."""
    from infra.compute import stage_nodes
    from tasks.remote import open_compute

    monkeypatch.setenv("HF_TOKEN", "x")
    data = yaml.safe_load(spec_file(tmp_path, num_nodes=2, nproc_per_node=4, use_spot=False).read_text())
    data["model"]["parallel"] = "fsdp2"
    spec = load_spec(data)
    node = open_compute(spec, spec.tracking.uri, "0123456789abcdef")
    plan = node.compute.plan
    train = sky_task({**plan.task_config(), "run": " ".join(node.command("train")), "num_nodes": 2})
    assert train.num_nodes == stage_nodes(plan, node.command("train")) == 2
    assert stage_nodes(plan, node.command("eval", "--step=6")) == stage_nodes(plan, node.command("probe")) == 1
    assert load_spec(plan.spec_file).infra.nproc_per_node == 4  # what each node's launcher starts


def test_a_nodes_place_comes_from_skypilots_environment():
    from tasks.ranks import node_launch
    from tasks.spec import SpecError

    assert node_launch({}) == {} and node_launch({"SKYPILOT_NUM_NODES": "1"}) == {}
    env = {"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n"}
    assert node_launch(env) == {"nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.5"}
    with pytest.raises(SpecError, match="SKYPILOT_NODE_IPS lists 1 address"):
        node_launch({**env, "SKYPILOT_NODE_IPS": "10.0.0.5"})


def test_two_nodes_launchers_meet_at_the_first_nodes_address_and_number_their_ranks_node_by_node(tmp_path):
    """What SkyPilot starts on each node of a 2-node train stage, here as two processes of this machine: each
    node's launcher (tasks.ranks.launch, its place from node_launch) starts one rank; they rendezvous at the first
    node's address (static, as torchrun --nnodes 2 --node-rank R --master-addr) and form one gloo world of 2."""
    from flows.runtime import free_port

    rank_script = tmp_path / "rank.py"
    rank_script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([float(dist.get_rank() + 1)])\n"
        "dist.all_reduce(t)\n"
        "print(f'rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():g}', flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    port = free_port()
    launcher = (
        "import os, sys; from tasks.ranks import launch, node_launch; "
        f"sys.exit(launch(1, [{str(rank_script)!r}], master_port={port}, **node_launch(dict(os.environ))))"
    )
    env = {**os.environ, "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1\n"}
    nodes = [
        subprocess.Popen(
            [sys.executable, "-c", launcher],
            env={**env, "SKYPILOT_NODE_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
        for r in (0, 1)
    ]
    outs = [node.communicate(timeout=120)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs
    assert "rank 0 of 2 sum 3" in outs[0] and "rank 1 of 2 sum 3" in outs[1], outs


@pytest.mark.parametrize(
    "infra, parallel, prompts, message",
    [
        ({"compute": "here", "nproc_per_node": 2}, "ddp", 2, "set infra.compute: local (ranks in a stage process"),
        ({"compute": "local", "num_nodes": 2}, "ddp", 2, "infra.num_nodes: 2 with infra.compute: local"),
        ({"compute": "local", "nproc_per_node": 2}, "none", 2, "model.parallel: none"),
        ({"compute": "local", "nproc_per_node": 2}, "ddp", 3, "does not divide grpo.prompts_per_step 3"),
    ],
)
def test_ranks_the_compute_cannot_give_are_refused_in_one_line_before_the_model_loads(
    tiny_model, tmp_path, capsys, infra, parallel, prompts, message
):
    from flows.cli import main

    spec = node_spec_dict(tiny_model, tmp_path / "project", infra={"max_restarts": 2, **infra})
    spec["model"]["parallel"], spec["grpo"]["prompts_per_step"] = parallel, prompts
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err
    assert not (tmp_path / "project" / "mlflow.db").exists()


def test_several_nodes_on_vllm_need_a_server_every_node_reaches():
    """Rank 0's own vLLM server listens on its node's loopback: several nodes need rollout.vllm_url; one node, or a
    given server, is accepted."""
    from tasks.ranks import check_stage_ranks
    from tasks.spec import SpecError

    def spec(nodes: int, **rollout):
        return load_spec(
            {
                "model": {"name_or_path": "m", "parallel": "fsdp2"},
                "grpo": {"prompts_per_step": 8},
                "rollout": {"engine": "vllm", **rollout},
                "infra": {"compute": "skypilot", "nproc_per_node": 2, "num_nodes": nodes},
            }
        )

    with pytest.raises(SpecError, match="infra.num_nodes: 2 with rollout.engine: vllm: .* set rollout.vllm_url"):
        check_stage_ranks(spec(2))
    check_stage_ranks(spec(2, vllm_url="http://head.internal:8000"))
    check_stage_ranks(spec(1))


def test_the_stage_entrypoint_refuses_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "tasks.remote", "train"], capture_output=True, text=True)
    assert out.returncode == 2 and "--spec" in out.stderr
