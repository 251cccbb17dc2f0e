"""A feature whose optional extra is not installed (issue 28 §3): `ballast validate` and the run refuse it alike, in
one line naming the extra to install, exit status 2, no traceback — SkyPilot (the `cloud` extra), vLLM's separate
environment (`ballast vllm-env`), and TRL for the benchmarks that run it (the `bench` extra).

This machine has every extra installed, so each command runs in its own process whose `sitecustomize` (on
PYTHONPATH) puts a finder first on `sys.meta_path` that refuses the extra's modules, as an environment without them
does: `import sky` raises ModuleNotFoundError there.
"""

import json
import os
import subprocess
import sys

import pytest
import yaml

from infra.extras import installed, require_extra
from tests.conftest import REPO, tiny_spec

BLOCKER = """import sys


class WithoutTheExtra:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {modules!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, WithoutTheExtra())
"""
HEAVY = ("torch", "transformers", "prefect", "mlflow", "sky")
PROBE = (
    "import json, sys\nfrom flows.cli import main\nrc = main(sys.argv[1:])\n"
    f"print(json.dumps([rc, sorted(m for m in {HEAVY!r} if m in sys.modules)]))\n"
)
CLOUD = "install the 'cloud' extra: pip install 'ballast[cloud]'"


def without(modules: tuple[str, ...], tmp_path) -> dict:
    """The environment of a process in which `modules` cannot be imported."""
    site = tmp_path / "without"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER.format(modules=modules))
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{site}"}


def ballast(env: dict, *args, cwd=REPO) -> tuple[int, list[str], list[str]]:
    """(exit status, heavy modules imported, non-empty stderr lines) of a `ballast` command in its own process."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600, env=env
    )
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    rc, imported = json.loads(proc.stdout.splitlines()[-1])
    return rc, imported, [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.fixture
def spec(tmp_path) -> str:
    spec = tiny_spec(tmp_path / "model", project_dir=str(tmp_path / "project"))
    spec["model"]["build_if_missing"] = "tiny-arith"
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def test_the_environment_without_the_extra_cannot_import_it(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import sky"], env=without(("sky",), tmp_path), capture_output=True)
    assert proc.returncode == 1 and b"ModuleNotFoundError: No module named 'sky'" in proc.stderr


@pytest.mark.parametrize(
    "command",
    [("validate",), ("run", "--dryrun"), ("run",)],
    ids=["validate", "run --dryrun", "run"],
)
def test_skypilot_without_the_cloud_extra_is_refused_before_anything_starts(command, spec, tmp_path):
    sets = ("--set", "infra.compute=skypilot", "--set", "infra.accelerators=H100:1")
    rc, imported, err = ballast(without(("sky",), tmp_path), command[0], spec, *command[1:], *sets)
    assert (rc, imported, len(err)) == (2, [], 1), err
    assert err[0] == (
        f"error: infra.compute: skypilot needs SkyPilot, not installed here (no module 'sky'); {CLOUD} (from a "
        "checkout: pip install -e '.[cloud]')"
    )


def test_accelerators_for_a_local_node_without_the_cloud_extra_are_refused_naming_it(spec, tmp_path):
    sets = ("--set", "infra.compute=local", "--set", "infra.accelerators=H100:1")
    rc, imported, err = ballast(without(("sky",), tmp_path), "validate", spec, *sets)
    assert (rc, len(err)) == (2, 1), err
    assert err[0].startswith("error: infra.accelerators='H100:1' (read by SkyPilot) needs SkyPilot") and CLOUD in err[0]
    assert "prefect" not in imported and "sky" not in imported


def test_ballast_launch_without_the_cloud_extra_is_refused_and_writes_nothing(spec, tmp_path):
    rc, imported, err = ballast(without(("sky",), tmp_path), "launch", spec, "--dryrun")
    assert (rc, len(err)) == (2, 1), err
    assert err[0].startswith("error: ballast launch needs SkyPilot") and CLOUD in err[0]
    assert not (tmp_path / "project" / "launch").exists()


def test_an_installed_extra_passes_and_a_module_the_import_system_cannot_find_is_missing():
    require_extra("cloud", "infra.compute: skypilot")  # SkyPilot is installed here: not refused
    assert installed("sky") and not installed("ballast_no_such_module")


@pytest.mark.parametrize("command", ["validate", "train"])
def test_the_vllm_engine_without_its_environment_is_refused_naming_ballast_vllm_env(command, tmp_path):
    rollout = {"engine": "vllm", "vllm_python": str(tmp_path / "venv/bin/python")}
    spec = tiny_spec(tmp_path / "model", rollout=rollout, project_dir=str(tmp_path / "project"))
    spec["model"]["build_if_missing"] = "tiny-arith"
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    rc, imported, err = ballast(dict(os.environ, PYTHONPATH=str(REPO)), command, tmp_path / "spec.yaml")
    assert (rc, imported, len(err)) == (2, [], 1), err
    assert err[0] == (
        f"error: rollout.vllm_python='{tmp_path / 'venv/bin/python'}' does not exist; create the environment with "
        "`ballast vllm-env` and set rollout.vllm_python to the python it prints"
    )


@pytest.mark.parametrize(
    "script, feature",
    [
        (["bench/trl_step_time.py", "--steps", "1"], "bench/trl_step_time.py (TRL's GRPOTrainer beside Ballast's)"),
        (["bench/memory.py", "--rows", "trl"], "bench/memory.py's TRL rows (leave them out with --rows)"),
    ],
    ids=["trl_step_time", "memory"],
)
def test_a_benchmark_that_runs_trl_without_the_bench_extra_is_refused_in_one_line(script, feature, tmp_path):
    env = without(("trl", "accelerate"), tmp_path)
    proc = subprocess.run([sys.executable, *script], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"error: {feature} needs TRL and accelerate, not installed here (no module 'trl'); install the 'bench' extra: "
        "pip install 'ballast[bench]' (from a checkout: pip install -e '.[bench]')"
    ]
