"""`ballast validate SPEC` and `ballast run SPEC --dryrun` (issue 23 §7, §10): what a run would refuse — the spec, its
data, its rewards (each user function called once on placeholder completions), the model's source and the device —
refused in seconds with one line and exit 2, before torch, transformers, Prefect or MLflow is imported; a spec that
passes exits 0 with a summary of what the run would do. Each command runs in its own process, as a user runs it,
and reports which heavy modules it imported."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, tiny_spec

HEAVY = ("torch", "transformers", "peft", "prefect", "mlflow")
# the command, then its exit status and the heavy modules it imported, as the last line of stdout
PROBE = (
    "import json, sys\nfrom flows.cli import main\nrc = main(sys.argv[1:])\n"
    f"print(json.dumps([rc, sorted(m for m in {HEAVY!r} if m in sys.modules)]))\n"
)


def ballast(*args, cwd=REPO, **env) -> tuple[int, list[str], str, list[str]]:
    """(exit status, heavy modules imported, stdout without the probe's line, non-empty stderr lines)."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )
    *out, last = proc.stdout.splitlines() or [""]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    rc, imported = json.loads(last)
    return rc, imported, "\n".join(out), [line for line in proc.stderr.splitlines() if line.strip()]


def write_spec(tmp_path, **sections) -> str:
    """The tiny test spec with a model directory that need not exist yet (it is built on first use)."""
    spec = tiny_spec(tmp_path / "model", **sections)
    spec["model"]["build_if_missing"] = "tiny-arith"
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


@pytest.mark.parametrize("command", [("validate",), ("run", "--dryrun")], ids=["validate", "run --dryrun"])
@pytest.mark.parametrize("example", ["quickstart.yaml", "smollm2.yaml"])
def test_the_shipped_examples_pass_without_importing_torch(command, example):
    rc, imported, out, err = ballast(command[0], f"examples/{example}", *command[1:])
    assert (rc, imported, err) == (0, [], [])
    assert (
        out.splitlines()[0]
        == f"examples/{example}: valid — spec, data, rewards, model and device checked; nothing was run"
    )
    assert "eval/accuracy reads" in out


@pytest.mark.parametrize("command", [("validate",), ("run", "--dryrun")], ids=["validate", "run --dryrun"])
def test_a_broken_spec_is_refused_with_one_line_and_exit_2_without_importing_torch(command, tmp_path):
    spec = write_spec(tmp_path, rewards=[{"name": "tests.reward_fixtures:nan_for_fourth"}])
    rc, imported, out, err = ballast(command[0], spec, *command[1:])
    assert (rc, imported, out, len(err)) == (2, [], "", 1), err
    assert err[0].startswith(f"error: {spec}: rewards[0] (tests.reward_fixtures:nan_for_fourth): reward ")
    assert "returned nan for completion 3" in err[0]


def test_a_set_override_is_validated_too(tmp_path):
    rc, imported, out, err = ballast("validate", write_spec(tmp_path), "--set", "grpo.num_generations=0")
    assert (rc, imported, len(err)) == (2, [], 1)
    assert err[0].startswith("error: --set grpo.num_generations=0: field 'grpo.num_generations'")


def test_dryrun_of_a_resume_is_refused(tmp_path):
    rc, imported, out, err = ballast("run", "--resume", "abc", "--dryrun")
    assert (rc, imported) == (2, [])
    assert err == [
        "error: --dryrun checks a SPEC before a new run; run abc was checked when it started (resume it with "
        "`ballast run --resume abc`)"
    ]


# ── broken custom rewards: refused before the model loads (issue 23 §7) ─────────────────────────────────────────


@pytest.mark.parametrize(
    "function, returned",
    [
        ("nan_for_fourth", "returned nan for completion 3"),
        ("returns_none", "returned None (NoneType), not a list"),
        ("returns_a_string", "returned '1.0' (str), not a list"),
        ("one_short", "returned 7 values for 8 completions"),
        ("raises_on_call", "raised TypeError: string indices must be integers"),
    ],
)
def test_a_broken_reward_stops_ballast_train_before_torch_is_imported(function, returned, tmp_path):
    spec = write_spec(tmp_path, rewards=[{"name": "exact_answer"}, {"name": f"tests.reward_fixtures:{function}"}])
    rc, imported, out, err = ballast("train", spec, "--quiet")
    assert (rc, imported, len(err)) == (2, [], 1), err
    assert "rewards[1]" in err[0] and f"'{function}'" in err[0] and returned in err[0], err[0]
    assert "found by calling it once, before the model loads, on 8 placeholder completions" in err[0]


# ── the model's source, offline (issue 23 §10) ─────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("command", [("validate",), ("run",), ("train", "--quiet")], ids=["validate", "run", "train"])
def test_a_hub_name_not_in_the_cache_offline_is_one_line_before_prefect_or_torch(command, tmp_path):
    spec = tiny_spec("ballast-tests/no-such-model", project_dir=str(tmp_path / "project"))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    rc, imported, out, err = ballast(command[0], tmp_path / "spec.yaml", *command[1:], HF_HUB_OFFLINE="1")
    assert (rc, imported, len(err)) == (2, [], 1), err
    assert err[0].startswith(
        "error: model.name_or_path='ballast-tests/no-such-model' is neither a local directory nor in the local "
        "Hugging Face cache, and downloads are off (HF_HUB_OFFLINE=1); fetch it once with `hf download "
        "ballast-tests/no-such-model`"
    )


def test_a_model_directory_to_be_built_passes(tmp_path):
    rc, imported, out, err = ballast("validate", write_spec(tmp_path))
    assert (rc, imported, err) == (0, [], [])
    assert f"model     {tmp_path / 'model'} (built on first use from tiny-arith), device cpu" in out


# ── warnings: one clean line (issue 23 §7) ─────────────────────────────────────────────────────────────────────


def test_a_warning_is_one_line_without_the_source_line_under_it(tmp_path):
    spec = write_spec(tmp_path, rewards=[{"name": "tests.reward_fixtures:length_bonus"}])
    rc, imported, out, err = ballast("validate", spec)
    assert (rc, imported) == (0, [])
    assert err == [
        "warning: eval/accuracy will not be reported: the rewards (length_bonus) hold no correctness reward "
        "(numeric_answer, boxed_answer, regex_answer, exact_answer, or a function with correctness = True); "
        "eval/reward is the held-out score. Add one, or set eval.reward"
    ]
    assert "eval/accuracy reads none (eval/reward is the score)" in out


@pytest.mark.parametrize("sweep", ["sweep.yaml", "sweep-smollm2.yaml"])
def test_a_sweep_file_is_validated_as_a_sweep_its_space_and_its_base_spec(sweep):
    rc, imported, out, err = ballast("validate", f"examples/{sweep}")
    assert (rc, imported, err) == (0, [], [])
    lines = out.splitlines()
    assert (
        lines[0]
        == f"examples/{sweep}: valid sweep — the sweep file, its space and its base spec checked; nothing was run"
    )
    assert lines[2] == "  space     grpo.beta (log), optim.learning_rate (log), lora.r, rollout.repetition_penalty"
    assert "eval/accuracy reads" in out


def test_a_sweep_whose_space_names_no_spec_field_is_refused_with_one_line(tmp_path):
    sweep = yaml.safe_load((REPO / "examples" / "sweep.yaml").read_text())
    sweep["base"] = str(REPO / "examples" / "quickstart.yaml")
    sweep["space"]["optim.learning_rat"] = sweep["space"].pop("optim.learning_rate")
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    rc, imported, out, err = ballast("validate", path)
    assert (rc, imported, out, len(err)) == (2, [], "", 1), err
    assert err[0].startswith(f"error: {path}: field 'space.optim.learning_rat'")


def test_a_placement_the_node_could_not_use_is_refused_without_importing_torch(tmp_path):
    """infra.compute: skypilot with the embedded SQLite store: refused by the node's own checks (tasks/remote.py),
    which import no model library (13.8 s to refuse before, 1.2 s now, measured on 2 cores)."""
    spec = write_spec(tmp_path, infra={"compute": "skypilot"})
    rc, imported, out, err = ballast("run", spec)
    assert (rc, imported, out, len(err)) == (2, [], "", 1), err
    assert err[0].startswith("error: infra.compute: skypilot with tracking sqlite:///")


def test_the_nodes_entry_point_refuses_a_bad_job_file_without_importing_torch(tmp_path):
    """`python -m tasks.remote --job FILE` on a node: a job file it cannot read is refused before any model library
    is imported (12.3 s before, 1.1 s now)."""
    job = tmp_path / "job.json"
    job.write_text('{"stage": "train"}')
    check = "import runpy, sys\ntry:\n    runpy.run_module('tasks.remote', run_name='__main__')\nfinally:\n" + (
        f"    print(sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", check, "--job", str(job)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    *said, imported = proc.stderr.splitlines()
    assert (proc.returncode, imported) == (2, "[]"), proc.stderr[-2000:]
    assert said == [
        f"--job {job}: not a node job file (TypeError: NodeJob.__init__() missing 2 required positional arguments: "
        "'spec' and 'run_id'); the node's launcher writes it — run a stage with `train|probe|eval --spec FILE "
        "--run-id ID`"
    ]
