"""The pipeline on a real pretrained chat model: SmolLM2-135M-Instruct (tests/real_model_fixtures.py) runs
examples/smollm2.yaml as shipped, shortened to 2 steps: fork → train → checkpoint → artifact-probe → eval in real
Prefect and real MLflow, with the in-process engine. The trained checkpoint passes the probe read against the base
model; the same checkpoint with its adapter scaled up fails it; rollouts stop at the chat template's <|im_end|>;
what the model wrote is logged with every reward component.
"""

import json
import shutil

import mlflow
import pytest
import yaml
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file, save_file

from tests.conftest import REPO

SHORT = {
    "optim": {"steps": 2},
    "grpo": {"num_generations": 4, "prompts_per_step": 1},
    "rollout": {"max_tokens": 64},
    "checkpoint": {"every": 2},
    "data": {"num_eval_prompts": 8},
    "eval": {"max_tokens": 24, "batch_size": 8},
    "probe": {"num_prompts": 3, "n": 2},
}  # the example's max_tokens (128) and cap (0.5)


def smollm2_spec(model_path, project) -> dict:
    spec = yaml.safe_load((REPO / "examples" / "smollm2.yaml").read_text())
    spec["model"].update(name_or_path=str(model_path))
    for section, values in SHORT.items():
        spec.setdefault(section, {}).update(values)
    return {**spec, "project_dir": str(project)}


@pytest.fixture(scope="module")
def pipeline_run(smollm2, tmp_path_factory, prefect_api):
    from flows.pipeline import ballast_pipeline

    project = tmp_path_factory.mktemp("smollm2-project")
    state = ballast_pipeline(smollm2_spec(smollm2, project), return_state=True)
    result = state.result(raise_on_failure=False)
    assert state.is_completed(), result
    return project, result


def test_two_steps_on_the_real_model_finish_with_the_probe_passed_and_eval_before_and_after(pipeline_run):
    _, result = pipeline_run
    assert result.status == "finished" and result.last_step == 2, result.error
    assert result.probe["passed"], result.probe
    assert 0.0 <= result.eval_start["eval/accuracy"] <= 1.0 and 0.0 <= result.eval["eval/accuracy"] <= 1.0
    assert set(result.checkpoints) == {2}


def test_rollouts_stop_at_the_chat_templates_end_of_turn(pipeline_run):
    _, result = pipeline_run
    rows = [json.loads(line) for line in (REPO / result.output_dir / "samples.jsonl").read_text().splitlines()]
    stopped = [r for r in rows if r["finish_reason"] == "stop"]
    assert stopped, rows  # most of the instruct model's answers end well within 64 tokens
    assert all(
        r["tokens"] < 64 and "<|im_end|>" not in r["completion"] and "<|im_start|>" not in r["completion"]
        for r in stopped
    )


def test_samples_and_every_reward_component_are_logged_as_mlflow_tables(pipeline_run):
    project, result = pipeline_run
    uri = f"sqlite:///{project.resolve() / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{result.run_id}'")
    tables = {}
    for child in children:
        for name in ("samples.json", "eval_samples.json", "probe_samples.json"):
            try:
                tables[name] = json.loads(open(client.download_artifacts(child.info.run_id, name)).read())
            except Exception:  # noqa: BLE001 - the table lives on one stage's run; the others have none
                continue
    assert set(tables) == {"samples.json", "eval_samples.json", "probe_samples.json"}
    columns = tables["samples.json"]["columns"]
    assert {"prompt", "completion", "reward", "rewards/numeric_answer", "finish_reason", "truncated"} <= set(columns)
    assert len(tables["samples.json"]["data"]) == 2 * 4  # both steps, every completion of a 4-completion batch


def test_the_checkpoint_with_its_adapter_scaled_up_fails_the_probe(pipeline_run, smollm2, tmp_path):
    from tasks.probe import probe_checkpoint
    from tasks.spec import load_spec
    from trainer.checkpoint import sha256_file

    project, result = pipeline_run
    scaled = tmp_path / "step-000002"
    shutil.copytree(result.final_checkpoint, scaled)
    adapter = scaled / "adapter" / "adapter_model.safetensors"
    save_file({k: v * 64 if "lora_B" in k else v for k, v in load_file(str(adapter)).items()}, str(adapter))
    manifest = json.loads((scaled / "manifest.json").read_text())  # saved that way by buggy code: hashes match
    manifest["files"]["adapter/adapter_model.safetensors"] = sha256_file(adapter)
    (scaled / "manifest.json").write_text(json.dumps(manifest))
    spec = load_spec(smollm2_spec(smollm2, project))
    report = probe_checkpoint(
        str(scaled),
        spec.probe,
        spec.model,
        tmp_path / "cache",
        lora_cfg=spec.lora,
        baseline_cache=tmp_path / "baseline",
    ).to_dict()
    assert not report["passed"] and not report["parity_ok"], report["failures"]
    assert any(f.startswith("parity failed") for f in report["failures"])
