"""Sweeps over nodes: with the base spec's `infra.compute` local or skypilot, `ballast sweep --workers K` runs each
worker on a node of its own through the compute interface, sharing the study (PostgreSQL) and MLflow; the trials
run on their worker's node (never provisioning again), every node is torn down, and the summary sums what the
compute cost. A storage or placement the nodes could not use is refused in one line before anything exists. The
SkyPilot side is tested up to its SDK: the worker's task, validated by SkyPilot's own schema.
"""

import contextlib
import io
import json
from datetime import datetime, timedelta

import mlflow
import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import PG, postgres_database, tiny_spec

N_TRIALS = 3
STUDY = "node-sweep"


@pytest.fixture(scope="module")
def database():
    """A fresh PostgreSQL database for the study, dropped after."""
    yield from postgres_database("ballast_nodes")


def write_sweep(path, base: dict, trials: int = N_TRIALS):
    sweep = {
        "study": STUDY,
        "base": base,
        "trials": trials,
        "sampler": {"type": "random"},
        "pruner": {"type": "none"},
        "space": {"optim.learning_rate": {"type": "float", "low": 1e-4, "high": 3e-3, "log": True}},
    }
    path.write_text(yaml.safe_dump(sweep))
    return path


# ── two workers, each on a node of this machine ───────────────────────────────────────────────────


@pytest.fixture(scope="module")
def node_sweep(tiny_model, tmp_path_factory, database, prefect_api):
    """`ballast sweep --workers 2` with `infra.compute: local` over PostgreSQL; what it left, read back at once."""
    from flows.cli import main

    root = tmp_path_factory.mktemp("node-sweep")
    project = root / "project"
    base = tiny_spec(
        tiny_model,
        name="node-sweep",
        project_dir=str(project),
        probe={"enabled": False},
        data={"num_prompts": 32, "num_eval_prompts": 4},
        optim={"steps": 2, "learning_rate": 1e-3},
        checkpoint={"every": 100, "keep_last": 1},
        infra={"compute": "local"},
    )
    path = write_sweep(root / "sweep.yaml", base)
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as env, contextlib.redirect_stdout(out):
        env.setenv("PREFECT_API_URL", prefect_api)  # the workers' flows in the harness's API; none started here
        rc = main(["sweep", str(path), "--storage", database, "--workers", "2"])
    out = out.getvalue()
    return dict(rc=rc, out=out, project=project, study=optuna.load_study(study_name=STUDY, storage=database))


def test_two_workers_on_local_nodes_finish_the_study_and_both_nodes_are_torn_down(node_sweep):
    project, study, out = node_sweep["project"], node_sweep["study"], node_sweep["out"]
    assert node_sweep["rc"] == 0, out[-4000:]
    done = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(done) == N_TRIALS
    nodes = [json.loads(v) for k, v in study.user_attrs.items() if k.startswith("ballast.node.")]
    assert sorted(n["name"].split()[0] for n in nodes) == ["worker-0", "worker-1"]
    assert all(n["compute"] == "local" and n["torn_down"] and n["run_s"] > 0 for n in nodes)
    assert not any((project / "compute").glob("ballast-*"))  # each node's scratch directory is gone


def test_each_trial_ran_on_its_workers_node_with_one_mlflow_run(node_sweep):
    project, study = node_sweep["project"], node_sweep["study"]
    uri = f"sqlite:///{project / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    parent = client.get_run(study.user_attrs["ballast.mlflow_parent_run_id"])
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(int(r.data.tags["ballast.trial_number"]) for r in children) == list(range(N_TRIALS))
    for run in children:
        assert "/compute/ballast-node-sweep-w" in run.data.tags["ballast.output_dir"]  # the node's project folder
        assert "ballast.compute" not in run.data.tags  # the trial trained on the worker's node: no node of its own
    assert {t.user_attrs["mlflow_run_id"] for t in study.trials} == {r.info.run_id for r in children}


def test_the_node_sweep_shows_provision_and_teardown_of_each_worker_in_prefect(node_sweep):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    with get_client(sync_client=True) as client:
        names = {
            r.name
            for r in client.read_task_runs(
                task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="worker-")), limit=50
            )
        }
    assert {"worker-0", "worker-1", "provision worker-0", "provision worker-1"} <= names
    assert {"teardown worker-0", "teardown worker-1"} <= names


def test_the_node_sweep_summary_sums_the_compute(node_sweep):
    project, study, out = node_sweep["project"], node_sweep["study"], node_sweep["out"]
    summary = json.loads((project / "sweeps" / STUDY / "summary.json").read_text())
    compute = summary["compute"]
    assert len(compute["nodes"]) == 2 and compute["cost_usd"] is None and compute["unpriced"] == 2
    assert compute["trial_s"] > 0 and compute["run_s"] >= max(n["run_s"] for n in compute["nodes"])
    line = next(line for line in out.splitlines() if line.startswith("compute: trials ran"))
    assert "2 nodes provisioned in" in line and line.endswith("price unknown")
    assert "<h2>Compute</h2>" in (project / "sweeps" / STUDY / "summary.html").read_text()
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    parent = client.get_run(study.user_attrs["ballast.mlflow_parent_run_id"])
    assert parent.data.metrics["compute/nodes"] == 2 and parent.data.tags["ballast.compute"] == line
    assert parent.data.tags["ballast.compute.worker-0"].startswith("compute: ")
    assert "[worker 1] " in out  # the workers' lines, relayed with their prefix


# ── refused before anything exists ─────────────────────────────────────────────────────────────────

REMOTE_BASE = {
    "name": "big",
    "model": {"name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"},
    "tracking": {"uri": "http://mlflow.team.internal:5000"},
    "storage": {"uri": "s3://team-bucket/ballast"},
    "infra": {"compute": "skypilot", "accelerators": "H100:1", "use_spot": True},
}


@pytest.mark.parametrize(
    "storage, message",
    [
        (None, "infra.compute: skypilot with study storage sqlite:///"),
        ("sqlite:///{tmp}/optuna.db", "a worker node cannot reach a SQLite file on this machine"),
        ("postgresql://ballast@127.0.0.1/sweeps", "names this machine's loopback address"),
    ],
)
def test_a_study_storage_skypilot_workers_could_not_reach_is_refused_in_one_line_with_exit_2(
    tmp_path, capsys, storage, message
):
    from flows.cli import main

    project = tmp_path / "project"
    path = write_sweep(tmp_path / "sweep.yaml", {**REMOTE_BASE, "project_dir": str(project)})
    argv = ["sweep", str(path), "--workers", "2"]
    if storage:
        argv += ["--storage", storage.format(tmp=tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not project.exists() and not (tmp_path / "optuna.db").exists()  # no study, no node, nothing written


@pytest.mark.parametrize(
    "storage, message",
    [
        (f"{PG}/ballast_no_such_database", 'database "ballast_no_such_database" does not exist'),
        ("postgresql://postgres@127.0.0.1:1/sweeps", "port 1 failed"),  # nothing listens there
    ],
)
def test_a_study_storage_that_does_not_open_is_refused_in_one_line_before_the_flow_starts(
    tmp_path, capsys, storage, message
):
    from flows.cli import main

    project = tmp_path / "project"
    path = write_sweep(
        tmp_path / "sweep.yaml", {"name": "t", "model": {"name_or_path": "m"}, "project_dir": str(project)}
    )
    assert main(["sweep", str(path), "--storage", storage]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot open the Optuna storage") and message in err
    assert len(err.splitlines()) == 1  # no flow ran: no Prefect traceback of its failure
    assert not project.exists()  # nor any Prefect or MLflow store started


def test_a_placement_a_node_could_not_use_is_refused_for_sweep_workers_too(tmp_path, capsys):
    from flows.cli import main

    base = {**REMOTE_BASE, "project_dir": str(tmp_path / "project"), "storage": {"uri": str(tmp_path / "store")}}
    path = write_sweep(tmp_path / "sweep.yaml", base)
    assert main(["sweep", str(path), "--workers", "2", "--storage", "postgresql://ballast@db.team.internal/s"]) == 2
    err = capsys.readouterr().err.strip()
    assert "infra.use_spot: true with storage" in err and len(err.splitlines()) == 1


def test_a_sweep_worker_given_a_sqlite_file_that_is_not_there_is_refused_and_creates_none(tmp_path, capsys):
    from flows.cli import main

    missing = tmp_path / "optuna-typo.db"
    for url in (f"sqlite:///{missing}", "sqlite:///:memory:"):
        assert main(["sweep-worker", "--study", "s", "--storage", url]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --storage {url}: no such SQLite database") and len(err.splitlines()) == 1
    assert not missing.exists()  # before: Optuna made an empty database there, then said the study was not in it


def test_local_nodes_reach_this_machines_sqlite_and_loopback_database():
    from sweeps.study import check_worker_placement
    from tasks.spec import load_spec

    spec = load_spec({"model": {"name_or_path": "m"}, "infra": {"compute": "local"}})
    check_worker_placement(spec, "sqlite:////tmp/optuna.db")
    check_worker_placement(spec, f"{PG}/sweeps")


# ── the SkyPilot worker, as SkyPilot would take it ─────────────────────────────────────────────────


def test_a_skypilot_worker_is_a_task_skypilot_accepts_running_the_sweep_worker_with_node_placement(tmp_path):
    from flows.trials.workers import NODE_ENV, worker_node
    from infra.compute import SkyPilotCompute, sky_task
    from tasks.spec import load_spec

    spec = load_spec({**REMOTE_BASE, "project_dir": str(tmp_path / "project")})
    storage = "postgresql://ballast@db.team.internal:5432/sweeps"
    node = worker_node(spec, STUDY, storage, 1, spec.tracking.uri, "http://127.0.0.1:4200/api")
    assert isinstance(node.compute, SkyPilotCompute) and node.compute.name == "ballast-node-sweep-w1"
    plan = node.compute.plan
    config = {**plan.task_config(with_secret_values=True), "run": " ".join(node.command)}  # as run() submits it
    config["envs"] = {**config["envs"], **node.env}
    task = sky_task(config)
    assert task.run == f"python3 -m flows.cli sweep-worker --study {STUDY} --storage {storage} --worker 1 --no-summary"
    assert plan.managed and task.num_nodes == 1
    placement = json.loads(task.envs[NODE_ENV])
    assert placement == {
        "tracking_uri": "http://mlflow.team.internal:5000",
        "store_uri": "s3://team-bucket/ballast",
        "project_dir": ".ballast-node",
    }
    assert "PREFECT_API_URL" not in task.envs  # this machine's loopback API: the node runs its own


# ── the summary's sum ──────────────────────────────────────────────────────────────────────────────


def test_the_summary_sums_worker_nodes_and_trials_own_nodes_and_says_which_had_no_price(tmp_path):
    from optuna.trial import TrialState, create_trial

    from sweeps.report import ComputeTotal, summarize
    from sweeps.space import load_sweep

    sweep = load_sweep(
        {
            "study": STUDY,
            "base": {"model": {"name_or_path": "m"}, "project_dir": str(tmp_path)},
            "space": {"optim.learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
        }
    )
    study = optuna.create_study(study_name=STUDY, direction="maximize")
    worker = {"compute": "skypilot", "provision_s": 100.0, "run_s": 500.0, "restarts": 1, "hourly_usd": 3.6}
    study.set_user_attr("ballast.node.20250101T000000.0", json.dumps({**worker, "name": "worker-0", "cost_usd": 0.6}))
    start = datetime(2025, 1, 1)
    for used in ({"provision_s": 10.0, "run_s": 50.0, "restarts": 0, "cost_usd": 0.25, "torn_down": True}, None):
        trial = create_trial(
            state=TrialState.COMPLETE,
            value=0.5,
            params={"optim.learning_rate": 1e-3},
            distributions={"optim.learning_rate": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)},
            user_attrs={"compute": used} if used else {},
        )
        trial.datetime_start, trial.datetime_complete = start, start + timedelta(seconds=30)
        study.add_trial(trial)
    compute = summarize(study, sweep).compute
    assert compute.trial_s == pytest.approx(60.0)
    assert len(compute.nodes) == 2 and compute.provision_s == 110.0 and compute.run_s == 550.0
    assert compute.restarts == 1 and compute.cost_usd == pytest.approx(0.85) and compute.unpriced == 0
    assert compute.span_s == pytest.approx(30.0)  # the two trials ran at the same time
    assert compute.line() == (
        "compute: trials ran 1.0 min in all, 0.5 min from the first start to the last end (they overlapped); "
        "2 nodes provisioned in 110 s, ran 550 s, 1 restart, ~$0.85"
    )
    assert ComputeTotal.of([], 60.0, 58.0).line() == "compute: trials ran 1.0 min in all"  # one after another
    study.set_user_attr("ballast.node.20250101T000000.1", json.dumps({"name": "worker-1", "torn_down": False}))
    compute = summarize(study, sweep).compute
    assert compute.cost_text() == "~$0.85 for the priced nodes, price unknown for 1"
    assert compute.line().endswith("NOT torn down: worker-1 (tear it down by hand)")


def test_a_trials_own_train_stage_node_is_kept_on_the_trial_from_its_mlflow_run(tmp_path):
    from types import SimpleNamespace

    from flows.trials.sequential import keep_trial_usage
    from infra.compute import Usage
    from tasks.remote import record_usage
    from tasks.spec import load_spec
    from tasks.sweep_record import SweepRecorder

    recorder = SweepRecorder(load_spec({"model": {"name_or_path": "m"}, "project_dir": str(tmp_path)}), STUDY)
    study = optuna.create_study(study_name=STUDY)
    recorder.open_parent(study, {}, {})
    run_id = recorder.tracking.create_run("trial 0", recorder.parent_run_id)
    recorder.tracking.set_tags(run_id, recorder.trial_tags(0, {}))
    usage = Usage("skypilot", "p5.4xlarge", "H100:1", "aws", "us-east-1", True, 120.0, 600.0, 1, 4.0, True)
    record_usage(SimpleNamespace(tracking=recorder.tracking, client=recorder.client, run_id=run_id), usage)
    trial = study.ask()
    keep_trial_usage(trial, recorder)
    kept = study.trials[0].user_attrs["compute"]
    assert kept["provision_s"] == 120.0 and kept["run_s"] == 600.0 and kept["restarts"] == 1
    assert kept["cost_usd"] == pytest.approx(0.8) and kept["torn_down"] and kept["spot"]
    assert (kept["compute"], kept["node"], kept["cloud"]) == ("skypilot", "p5.4xlarge", "aws")
