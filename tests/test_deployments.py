"""prefect.yaml against a real local Prefect server (SQLite, offline): `prefect deploy --all` registers
the pipeline, the nightly regression and the sweep (and sweep-worker) deployments, and the server gives
back their entrypoints, parameters, work pool and the regression's cron schedule."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import REPO

PREFECT = str(Path(sys.executable).with_name("prefect"))
STARTUP_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """A `prefect server start` subprocess on a free port, its state in a temporary PREFECT_HOME."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        PREFECT_LOGGING_LEVEL="WARNING",
        PREFECT_SERVER_UI_ENABLED="false",
    )
    log = open(home / "server.log", "w")
    server = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"prefect server did not come up on port {port}:\n{(home / 'server.log').read_text()[-3000:]}"
                )
            time.sleep(1)
        yield {"api": api, "env": env}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def prefect_cli(server, *args) -> subprocess.CompletedProcess:
    proc = subprocess.run([PREFECT, *args], cwd=REPO, env=server["env"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"prefect {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def deployed(prefect_server):
    """prefect.yaml applied with the Prefect CLI, then read back through the Prefect client."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    pool = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"][0]["work_pool"]["name"]
    prefect_cli(prefect_server, "work-pool", "create", pool, "--type", "process")
    prefect_cli(prefect_server, "--no-prompt", "deploy", "--all")

    async def read():
        async with get_client() as client:
            deployments = await client.read_deployments()
            return {d.name: d for d in deployments}, {
                d.id: (await client.read_flow(d.flow_id)).name for d in deployments
            }

    with temporary_settings(updates={PREFECT_API_URL: prefect_server["api"]}):
        return asyncio.run(read())


def test_prefect_yaml_declares_pipeline_and_scheduled_regression():
    config = yaml.safe_load((REPO / "prefect.yaml").read_text())
    by_name = {d["name"]: d for d in config["deployments"]}
    assert set(by_name) >= {"ballast-pipeline", "ballast-regression"}
    assert by_name["ballast-regression"]["schedules"][0]["cron"] == "0 3 * * *"


DEPLOYMENTS = ("ballast-pipeline", "ballast-regression", "ballast-sweep", "ballast-sweep-worker", "ballast-pbt")


def test_every_deployment_is_registered_with_its_flow(deployed):
    deployments, flow_names = deployed
    assert set(deployments) == set(DEPLOYMENTS)
    for name in DEPLOYMENTS:
        assert flow_names[deployments[name].id] == name
        module = {"ballast-pipeline": "pipeline", "ballast-regression": "regression", "ballast-pbt": "pbt"}.get(
            name, "sweep"
        )
        function = "run_experiment" if name == "ballast-pipeline" else name.replace("-", "_")
        assert deployments[name].entrypoint == f"flows/{module}.py:{function}"
    assert {d.work_pool_name for d in deployments.values()} == {"ballast-local"}


def test_sweep_deployments_take_the_sweep_file_and_a_shared_study(deployed):
    deployments, _ = deployed
    sweep, worker = deployments["ballast-sweep"], deployments["ballast-sweep-worker"]
    assert sweep.parameters == {"sweep_path": "examples/sweep.yaml", "workers": 1} and sweep.schedules == []
    properties = set(sweep.parameter_openapi_schema["properties"])
    assert {"sweep_path", "trials", "workers", "storage", "overrides", "timeout_s", "node"} == properties
    assert set(worker.parameter_openapi_schema["required"]) == {"study", "storage"}


def test_the_population_deployment_takes_the_population_file_and_resume(deployed):
    deployments, _ = deployed
    pbt = deployments["ballast-pbt"]
    assert pbt.parameters == {"file": "examples/pbt.yaml"} and pbt.schedules == []
    assert set(pbt.parameter_openapi_schema["properties"]) == {"file", "overrides", "resume"}


def test_regression_deployment_runs_nightly_with_its_parameters(deployed):
    deployments, _ = deployed
    regression = deployments["ballast-regression"]
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in regression.schedules] == [
        ("0 3 * * *", "UTC", True)
    ]
    assert regression.parameters == {
        "spec": "examples/quickstart.yaml",
        "refs": ["HEAD~1", "HEAD"],
        "runs": 3,
        "alpha": 0.01,
    }
    schema = regression.parameter_openapi_schema["properties"]
    assert {"spec", "refs", "runs", "steps", "repo", "alpha"} <= set(schema)


def test_pipeline_deployment_runs_from_this_checkout(deployed):
    deployments, _ = deployed
    pipeline = deployments["ballast-pipeline"]
    assert pipeline.parameters == {"spec": "examples/quickstart.yaml"}
    assert pipeline.schedules == []
    assert pipeline.pull_steps == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO.resolve())}}
    ]


def test_the_sweep_run_form_has_described_parameters_and_the_node_choice():
    """The sweep's Run form, as `prefect deploy` builds it: each field described, `node` the pipeline's typed choice."""
    from prefect.utilities.callables import parameter_schema

    from flows.sweep import ballast_sweep

    schema = parameter_schema(ballast_sweep).model_dump()
    form = schema["properties"]
    assert list(form) == ["sweep_path", "trials", "workers", "storage", "overrides", "timeout_s", "node"]
    assert all(field.get("description") for field in form.values())
    assert "PGPASSWORD" in form["storage"]["description"] and '"key.path=value"' in form["overrides"]["description"]
    choice = schema["definitions"]["NodeChoice"]["properties"]
    assert {"compute", "accelerators", "use_spot", "cloud", "num_nodes", "nproc_per_node"} == set(choice)
    assert choice["compute"]["anyOf"][0]["enum"] == ["here", "local", "skypilot"]


def test_the_pipeline_run_form_has_described_parameters_and_nothing_internal():
    """The Run form is the deployed flow's parameter schema, built as `prefect deploy` builds it."""
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import run_experiment

    form = parameter_schema(run_experiment).model_dump()["properties"]
    assert list(form)[:3] == ["spec", "overrides", "resume_run_id"]
    assert not {"parent_run_id", "tags", "callbacks", "progress"} & set(form)  # the CLI's and sweeps' internals
    assert all(field.get("description") for field in form.values())
    assert form["spec"]["type"] == "string" and form["spec"]["default"] == "examples/quickstart.yaml"
    assert "experiment YAML" in form["spec"]["description"]
    assert form["overrides"]["anyOf"][0] == {"type": "array", "items": {"type": "string"}}
    assert '"key.path=value"' in form["overrides"]["description"]
    assert "grpo.beta=0.1" in form["overrides"]["description"]
    assert "MLflow run id" in form["resume_run_id"]["description"]


def test_the_deployed_pipeline_form_is_the_one_registered(deployed):
    deployments, _ = deployed
    form = deployments["ballast-pipeline"].parameter_openapi_schema["properties"]
    assert {"spec", "overrides", "resume_run_id"} <= set(form)
    assert not {"parent_run_id", "tags", "callbacks", "progress"} & set(form)
    assert all(form[name].get("description") for name in form)
