"""The pipeline flow against real Prefect (its test harness), real MLflow (SQLite, and PostgreSQL),
the artifact store on disk and on S3 (a moto server on loopback).

Fork → train → checkpoint → artifact-probe → eval all complete in Prefect and are recorded in MLflow;
forks verify and carry lineage; a tampered fork source leaves nothing behind; a store that is down fails
the run at its start, before anything exists.
"""

import json
import os
import subprocess
import sys
import uuid

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO, tiny_spec

STAGES = {"fork", "train", "checkpoint", "artifact-probe", "eval"}


@pytest.fixture(scope="module")
def prefect(prefect_api):
    return prefect_api  # the test process's harness (tests/conftest.py)


def pipeline_spec(tiny_model, project, **sections):
    base = dict(
        name="pipeline-test",
        project_dir=str(project),
        probe={"n": 2, "max_tokens": 24, "max_malformed_rate": 1.0},
        eval={"every": 2, "max_tokens": 24},
    )
    base.update(sections)
    return tiny_spec(tiny_model, **base)


def run(spec_dict, resume_run_id=None):
    from flows.pipeline import ballast_pipeline
    from tasks.results import PipelineResult

    state = ballast_pipeline(spec_dict, resume_run_id=resume_run_id, return_state=True)
    result = state.result(raise_on_failure=False)
    return state, (result.to_dict() if isinstance(result, PipelineResult) else result)


def task_run_names(flow_run_id) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name.rsplit("-", 1)[0]: r.state.type.value for r in runs}


def flow_run_name(state) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(state.state_details.flow_run_id).name


def mlflow_client(project) -> MlflowClient:
    uri = f"sqlite:///{project.resolve() / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    return MlflowClient(uri)


def stage_runs(client, run_id) -> dict[str, str]:
    parent = client.get_run(run_id)
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    return {r.data.tags["ballast.stage"]: r.info.status for r in children}


@pytest.fixture(scope="module")
def finished_run(tiny_model, tmp_path_factory, prefect):
    project = tmp_path_factory.mktemp("project")
    spec = pipeline_spec(
        tiny_model, project, optim={"steps": 4, "learning_rate": 3e-3}, tracking={"register_as": "pipeline-test"}
    )
    state, summary = run(spec)
    assert state.is_completed(), summary
    return project, state, summary


def test_all_five_stages_complete_in_prefect_and_mlflow(finished_run):
    project, state, summary = finished_run
    assert summary["status"] == "finished"
    tasks = task_run_names(state.state_details.flow_run_id)
    assert set(tasks) == STAGES and set(tasks.values()) == {"COMPLETED"}
    client = mlflow_client(project)
    assert stage_runs(client, summary["run_id"]) == {s: "FINISHED" for s in STAGES}


def test_lineage_tags_params_metrics_and_artifacts(finished_run):
    project, _, summary = finished_run
    client = mlflow_client(project)
    r = client.get_run(summary["run_id"])
    tags = r.data.tags
    for key in ("code_dirty", "spec_hash", "data_fingerprint"):
        assert tags.get(f"ballast.{key}"), key
    for key in ("code_commit", "base_model", "checkpoint_prefix", "output_dir"):  # long values: params (run page)
        assert r.data.params.get(f"ballast.{key}"), key
    assert tags["ballast.status"] == "finished"
    assert r.data.params["grpo.beta"] == "0.04" and r.data.params["optim.steps"] == "4"
    assert [m.step for m in client.get_metric_history(r.info.run_id, "reward")] == [1, 2, 3, 4]
    assert [m.step for m in client.get_metric_history(r.info.run_id, "eval/reward")] == [2, 4]
    artifacts = {a.path for a in client.list_artifacts(r.info.run_id)}
    assert {"spec.yaml", "checkpoints.json", "report.html", "plots", "probe"} <= artifacts
    plots = {a.path for a in client.list_artifacts(r.info.run_id, "plots")}
    assert {"plots/reward.png", "plots/kl.png", "plots/length.png", "plots/health.png"} <= plots


def test_checkpoints_are_in_the_store_with_retention(finished_run):
    from infra.store import open_store

    project, _, summary = finished_run
    store = open_store(str(project / "artifacts"))
    stored = store.list_dirs(f"runs/{summary['run_id']}/checkpoints")
    assert stored == ["step-000002", "step-000004"]
    assert set(summary["checkpoints"]) == {2, 4}


def test_secrets_never_reach_mlflow(tiny_model, tmp_path, prefect, monkeypatch):
    from tasks.spec import SpecError, load_spec

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value-never-logged")
    with pytest.raises(SpecError, match="infra.env.api_key.*looks like a secret"):
        load_spec(pipeline_spec(tiny_model, tmp_path, infra={"env": {"api_key": "sk-live"}}))


def test_fork_chain_a_b_c_verifies_and_walks_back(tiny_model, finished_run, prefect, tmp_path):
    from tasks.record import Tracking
    from tasks.spec import load_spec

    project, _, a = finished_run
    b_state, b = run(
        pipeline_spec(
            tiny_model,
            project,
            name="b",
            fork={"run_id": a["run_id"], "step": 2},
            optim={"steps": 2},
            probe={"enabled": False},
        )
    )
    assert b_state.is_completed(), b
    client = mlflow_client(project)
    tags = client.get_run(b["run_id"]).data.tags
    assert client.get_run(b["run_id"]).data.tags["ballast.parent_run_id"] == a["run_id"]
    assert tags["ballast.parent_step"] == "2"
    assert float(tags["ballast.fork_logprob_diff"]) < 1e-4
    # the fork continued from the parent's step-2 adapter, not from a fresh one
    b_metrics = [json.loads(line) for line in open(os.path.join(b["output_dir"], "metrics.jsonl"))]
    assert b_metrics[0]["kl"] > 0  # the policy starts away from the base model
    c_state, c = run(
        pipeline_spec(
            tiny_model,
            project,
            name="c",
            fork={"run_id": b["run_id"]},
            optim={"steps": 1},
            checkpoint={"every": 1},
            probe={"enabled": False},
        )
    )
    assert c_state.is_completed(), c
    chain = Tracking(load_spec(pipeline_spec(tiny_model, project))).chain(c["run_id"])
    assert [x["run_id"] for x in chain] == [c["run_id"], b["run_id"], a["run_id"]]
    assert chain[0]["parent_step"] == "2"  # c forked b's newest checkpoint, step 2


def test_fork_from_tampered_checkpoint_fails_and_leaves_no_run(tiny_model, finished_run, prefect, tmp_path):
    import shutil

    project, _, a = finished_run
    src = tmp_path / "tampered"
    shutil.copytree(os.path.join(a["output_dir"], "checkpoints", "step-000004"), src)
    cfg = src / "adapter" / "adapter_config.json"
    cfg.write_text(cfg.read_text().replace('"lora_alpha": 16', '"lora_alpha": 64'))
    client = mlflow_client(project)
    before = len(client.search_runs([client.get_experiment_by_name("ballast").experiment_id]))
    state, result = run(pipeline_spec(tiny_model, project, name="bad-fork", fork={"checkpoint": str(src)}))
    assert state.is_failed()
    assert "stage 'fork' failed" in str(result) and "adapter/adapter_config.json" in str(result)
    assert flow_run_name(state) == "bad-fork-failed"  # not "bad-fork-starting" for good
    assert len(client.search_runs([client.get_experiment_by_name("ballast").experiment_id])) == before


def test_fork_that_does_not_reproduce_its_fingerprint_is_refused(tiny_model, finished_run, prefect, tmp_path):
    """The adapter config was changed by buggy code *before* hashing: the hash passes, the fingerprint does not."""
    import hashlib
    import shutil

    project, _, a = finished_run
    src = tmp_path / "rescaled"
    shutil.copytree(os.path.join(a["output_dir"], "checkpoints", "step-000004"), src)
    cfg = src / "adapter" / "adapter_config.json"
    cfg.write_text(cfg.read_text().replace('"lora_alpha": 16', '"lora_alpha": 64'))
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["files"]["adapter/adapter_config.json"] = hashlib.sha256(cfg.read_bytes()).hexdigest()
    (src / "manifest.json").write_text(json.dumps(manifest))
    state, result = run(pipeline_spec(tiny_model, project, name="rescaled-fork", fork={"checkpoint": str(src)}))
    assert state.is_failed() and "does not reproduce its logprob fingerprint" in str(result)


def test_pipeline_on_s3_and_postgres_mlflow(tiny_model, tmp_path, prefect, s3_bucket):
    db = f"ballast_{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["psql", "-h", "127.0.0.1", "-U", "postgres", "-c", f"create database {db}"], check=True, capture_output=True
    )
    uri = f"postgresql://postgres@127.0.0.1:5432/{db}"
    spec = pipeline_spec(
        tiny_model,
        tmp_path,
        optim={"steps": 2},
        tracking={"uri": uri},
        storage={"uri": f"s3://{s3_bucket}/ballast"},
        probe={"n": 1, "max_tokens": 24, "max_malformed_rate": 1.0},
    )
    state, summary = run(spec)
    assert state.is_completed(), summary
    assert summary["final_checkpoint"].startswith(f"s3://{s3_bucket}/ballast/runs/")
    client = MlflowClient(uri)
    assert stage_runs(client, summary["run_id"]) == {s: "FINISHED" for s in STAGES}
    from infra.store import open_store

    assert open_store(f"s3://{s3_bucket}/ballast").list_dirs(f"runs/{summary['run_id']}/checkpoints") == ["step-000002"]


def test_store_outage_at_start_fails_the_run_before_any_run_or_output_exists(
    tiny_model, tmp_path, prefect, moto_server, monkeypatch
):
    """A store that is down fails the run at its start (tests/test_outages.py: one that goes away mid-run)."""
    spec = pipeline_spec(
        tiny_model, tmp_path, optim={"steps": 2}, storage={"uri": "s3://any-bucket/b"}, probe={"enabled": False}
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    state, result = run(spec)
    assert state.is_failed() and "cannot reach the S3 endpoint http://127.0.0.1:9" in str(result)
    assert not (tmp_path / "runs").exists()
    client = mlflow_client(tmp_path)
    assert client.search_runs([client.get_experiment_by_name("ballast").experiment_id]) == []


def test_cli_run_and_resume_by_run_id(tiny_model, tmp_path):
    """`ballast run SPEC` through the CLI, with Prefect's ephemeral API and nothing configured."""
    import yaml

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(pipeline_spec(tiny_model, tmp_path / "proj", optim={"steps": 2}, probe={"enabled": False}))
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(spec)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MLflow run:" in proc.stdout and "report:" in proc.stdout and ": finished" in proc.stdout
    run_id = proc.stdout.split("run id:")[1].split()[0]
    assert "ballast.model_uri" in mlflow_client(tmp_path / "proj").get_run(run_id).data.params  # a model logged ...
    for advice in ("Add type hints to the `predict`", "An input example was not provided"):
        assert advice not in proc.stdout + proc.stderr  # ... without MLflow's two lines of advice on the terminal
    again = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--resume", run_id, "--project-dir", str(tmp_path / "proj")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.startswith(f"run {run_id} already ended (finished); nothing to resume.")


def test_full_finetune_runs_the_whole_pipeline_with_probe_and_eval(tiny_model, tmp_path, prefect):
    """lora.enabled: false saves a complete model directory, which the probe and the eval load back."""
    spec = pipeline_spec(
        tiny_model,
        tmp_path,
        optim={"steps": 2, "learning_rate": 1e-4},
        lora={"enabled": False},
        grpo={"num_generations": 4, "prompts_per_step": 2, "beta": 0.0},
    )
    state, summary = run(spec)
    assert state.is_completed(), summary
    assert summary["status"] == "finished" and summary["probe"]["parity_ok"]
    assert set(summary["eval"]) >= {"eval/reward", "eval/accuracy"}
    client = mlflow_client(tmp_path)
    assert stage_runs(client, summary["run_id"]) == {s: "FINISHED" for s in STAGES}


def test_the_final_checkpoint_is_an_mlflow_model_that_loads_and_decodes_as_the_eval_did(finished_run, tiny_model):
    project, _, summary = finished_run
    client = mlflow_client(project)
    uri = client.get_run(summary["run_id"]).data.params["ballast.model_uri"]
    experiment = client.get_run(summary["run_id"]).info.experiment_id
    (logged,) = [m for m in client.search_logged_models([experiment]) if m.source_run_id == summary["run_id"]]
    assert logged.source_run_id == summary["run_id"] and uri == f"models:/{logged.model_id}"
    model = mlflow.pyfunc.load_model(uri)
    assert model.metadata.metadata["base_model"] == str(tiny_model)
    assert model.metadata.metadata["checkpoint_step"] == 4 and model.metadata.metadata["weights"] == "adapter"
    rows = [json.loads(line) for line in open(os.path.join(summary["output_dir"], "eval_samples.jsonl"))]
    final = [r for r in rows if r["step"] == 4][:2]  # the greedy eval of step 4, the final checkpoint
    texts = model.predict([r["prompt"] for r in final], params={"max_tokens": 24})
    assert texts == [r["completion"] for r in final] and all(texts)


def test_a_finished_run_registers_its_model_under_tracking_register_as(finished_run):
    project, _, summary = finished_run
    (version,) = mlflow_client(project).search_model_versions("name = 'pipeline-test'")
    assert version.run_id == summary["run_id"] and str(version.version) == "1"


def test_the_mlflow_run_names_its_prefect_flow_run(finished_run):
    project, state, summary = finished_run
    from prefect.settings import PREFECT_UI_URL

    tags = mlflow_client(project).get_run(summary["run_id"]).data.tags
    flow_run_id = str(state.state_details.flow_run_id)
    assert tags["prefect.flow_run_id"] == flow_run_id
    assert tags["prefect.flow_run_url"] == f"{PREFECT_UI_URL.value()}/runs/flow-run/{flow_run_id}"
    assert f"[Prefect flow run]({tags['prefect.flow_run_url']})." in tags["mlflow.note.content"]


def test_the_prompt_sets_are_the_runs_dataset_inputs(finished_run):
    project, _, summary = finished_run
    inputs = mlflow_client(project).get_run(summary["run_id"]).inputs.dataset_inputs
    by_context = {next(t.value for t in i.tags if t.key == "mlflow.data.context"): i.dataset for i in inputs}
    assert {k: d.name for k, d in by_context.items()} == {
        "training": "pipeline-test-training",
        "eval": "pipeline-test-eval",
    }
    assert json.loads(by_context["training"].profile)["num_rows"] == 64
    assert json.loads(by_context["eval"].profile)["num_rows"] == 8
    assert json.loads(by_context["training"].source)["tags"]["ballast.data.source"] == "arith"


def test_the_headline_metrics_open_the_run_pages_charts(finished_run):
    """MLflow's run page orders chart sections alphabetically, unprefixed metrics last: '_headline/' comes first."""
    project, _, summary = finished_run
    client = mlflow_client(project)
    rid = summary["run_id"]
    sections = sorted({k.split("/")[0] for k in client.get_run(rid).data.metrics if "/" in k})
    assert sections[0] == "_headline"
    for key, copy in (("reward", "reward"), ("kl", "kl"), ("eval/reward", "eval_reward")):
        original = sorted((m.step, m.value) for m in client.get_metric_history(rid, key))
        assert sorted((m.step, m.value) for m in client.get_metric_history(rid, f"_headline/{copy}")) == original


def test_the_run_report_shows_what_the_model_wrote(finished_run):
    _, _, summary = finished_run
    html = open(os.path.join(summary["output_dir"], "report.html")).read()
    assert "Held-out samples (final checkpoint, step 4)" in html and "Training samples (last step)" in html
    last = [json.loads(line) for line in open(os.path.join(summary["output_dir"], "samples.jsonl"))][-1]
    assert last["step"] == 4 and f"<code>{last['prompt']}</code>" in html


def test_a_deployment_run_with_a_bad_override_names_overrides_and_its_flow_run_failed(tiny_model, tmp_path, prefect):
    import yaml

    from flows.pipeline import run_experiment

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(pipeline_spec(tiny_model, tmp_path, name="formed")))
    state = run_experiment(str(path), overrides=["grpo.beta=lots"], return_state=True)
    message = str(state.result(raise_on_failure=False))
    assert state.is_failed() and "overrides: grpo.beta=lots" in message and "--set" not in message
    assert flow_run_name(state) == "formed-failed"
