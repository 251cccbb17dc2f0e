"""`ballast launch` builds a SkyPilot task that SkyPilot itself accepts: resources from `infra:`, the
pipeline as the run command over the validated spec, the trainer/vLLM GPU split, and secrets passed by
name, never written. Nothing is provisioned here (no cloud or Kubernetes can be reached): `--dryrun`
and SkyPilot's own task schema are the real components under test."""

import shlex

import pytest
import yaml

from flows.cli import main
from infra.skypilot import LaunchError, plan_launch, to_sky_task
from tasks.spec import dump_spec, load_spec
from tests.conftest import REPO

SPEC = {
    "name": "Big Run_1",
    "model": {"name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"},
    "rollout": {"engine": "vllm"},
    "infra": {"accelerators": "H200:2", "cloud": "k8s", "env": ["HF_TOKEN"]},
}


def spec_file(tmp_path, **changes):
    spec = {**SPEC, "project_dir": str(tmp_path / "project"), **changes}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_dryrun_writes_a_task_skypilot_accepts_running_the_validated_spec(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_sekret_value")
    argv = [
        "launch",
        str(spec_file(tmp_path)),
        "--dryrun",
        "--set",
        "optim.steps=200",
        "--down",
        "--idle-minutes",
        "30",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    by_hand = shlex.split(out.split("By hand:")[1].strip())
    assert by_hand[:4] == ["sky", "launch", "-c", "ballast-big-run-1"]
    import sky.client.cli.command as sky_cli

    parsed = sky_cli.launch.make_context("launch", by_hand[2:]).params  # read by SkyPilot's own CLI, not run
    assert (parsed["cluster"], parsed["down"], parsed["idle_minutes_to_autostop"]) == ("ballast-big-run-1", True, 30)
    assert parsed["entrypoint"] == (str(tmp_path / "project" / "launch" / "ballast-big-run-1.sky.yaml"),)
    assert [name for name, _ in parsed["secret"]] == ["HF_TOKEN"]  # its value from the environment, as launch's
    task_yaml = tmp_path / "project" / "launch" / "ballast-big-run-1.sky.yaml"
    config = yaml.safe_load(task_yaml.read_text())
    task = to_sky_task(config)  # SkyPilot's own schema validation
    (resources,) = task.resources
    assert resources.accelerators == {"H200": 2}
    assert task.num_nodes == 1 and task.workdir == str(REPO)
    assert "bash scripts/install.sh" in task.setup and "bash scripts/vllm_env.sh --gpu" in task.setup
    assert task.run == "python3 -m flows.cli run ~/.ballast-launch/ballast-big-run-1.yaml"
    ((remote, local),) = config["file_mounts"].items()
    assert remote == "~/.ballast-launch/ballast-big-run-1.yaml"
    node_spec = load_spec(local)  # what the node runs: the validated spec, overrides applied, GPUs split
    assert node_spec.optim.steps == 200
    assert (node_spec.model.device, node_spec.rollout.device) == ("cuda:0", "cuda:1")


def test_secrets_are_names_in_the_yaml_and_values_only_in_the_launched_task(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_sekret_value")
    spec = load_spec(spec_file(tmp_path))
    plan, _ = plan_launch(spec, REPO, dump_spec=dump_spec)
    assert main(["launch", str(spec_file(tmp_path)), "--dryrun"]) == 0
    written = "".join(p.read_text() for p in (tmp_path / "project" / "launch").iterdir())
    assert "hf_sekret_value" not in written and "HF_TOKEN" in written
    assert "hf_sekret_value" not in plan.spec_yaml
    launched = to_sky_task(plan.task_config(tmp_path / "s.yaml", with_secret_values=True))
    assert {k: v.get_secret_value() for k, v in launched.secrets.items()} == {
        "HF_TOKEN": "hf_sekret_value"
    }  # SkyPilot keeps it redacted
    assert "HF_TOKEN" not in launched.envs


def test_a_secret_that_is_not_set_here_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert main(["launch", str(spec_file(tmp_path)), "--dryrun"]) == 2
    err = capsys.readouterr().err
    assert "infra.env names 'HF_TOKEN'" in err and "export it" in err
    assert not (tmp_path / "project" / "launch").exists() or not any((tmp_path / "project" / "launch").iterdir())


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("infra.accelerators", "H200:x", "infra.accelerators='H200:x' is not NAME or NAME:COUNT"),
        ("infra.cloud", "nosuchcloud", "SkyPilot refused the task"),
    ],
)
def test_invalid_infra_is_refused_with_exit_2(tmp_path, capsys, field, value, message):
    assert (
        main(
            [
                "launch",
                str(spec_file(tmp_path, infra={"accelerators": "H100"})),
                "--dryrun",
                "--set",
                f"{field}={value}",
            ]
        )
        == 2
    )
    assert message in capsys.readouterr().err


def test_devices_the_spec_sets_are_kept_and_one_gpu_shares(tmp_path):
    spec = load_spec(
        spec_file(
            tmp_path,
            model={"name_or_path": "m", "device": "cuda:1"},
            infra={"accelerators": "H200:2"},
            rollout={"engine": "vllm", "device": "cuda:0"},
        )
    )
    _, node_spec = plan_launch(spec, REPO, dump_spec=dump_spec)
    assert (node_spec.model.device, node_spec.rollout.device) == ("cuda:1", "cuda:0")
    one = load_spec(spec_file(tmp_path, infra={"accelerators": "H100:1"}))
    plan, node_spec = plan_launch(one, REPO, dump_spec=dump_spec)
    assert node_spec.rollout.device is None and any("shares the trainer's GPU" in n for n in plan.notes)


def test_launch_warns_when_results_would_stay_on_the_node(tmp_path):
    spec = load_spec(spec_file(tmp_path, infra={"accelerators": "H100:1"}))
    plan, _ = plan_launch(spec, REPO, dump_spec=dump_spec)
    assert any(n.startswith("tracking.uri is unset") for n in plan.notes)
    kept = load_spec(
        spec_file(
            tmp_path,
            infra={"accelerators": "H100:1"},
            tracking={"uri": "postgresql://db/mlflow"},
            storage={"uri": "s3://bucket/ballast"},
        )
    )
    plan, _ = plan_launch(kept, REPO, dump_spec=dump_spec)
    assert not any("lost" in n for n in plan.notes)


def test_plan_refuses_a_malformed_accelerator_string_before_skypilot():
    spec = load_spec({**SPEC, "infra": {"accelerators": "two H200s"}})
    with pytest.raises(LaunchError, match="infra.accelerators='two H200s'"):
        plan_launch(spec, REPO, dump_spec=dump_spec)


def test_negative_idle_minutes_are_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    assert main(["launch", str(spec_file(tmp_path)), "--dryrun", "--idle-minutes", "-5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --idle-minutes -5: give 0 or more (leave it out for no autostop)"
    assert not (tmp_path / "project").exists()
