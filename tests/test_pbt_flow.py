"""`ballast pbt FILE` end to end on the tiny model: the Prefect flow, the MLflow lineage (a parent run, a child run per
member with its hyperparameters per step and a tag per replacement), the winner confirmed on the confirmation prompts,
its replay spec, and the summary page opened in headless Chromium (a screenshot is left beside it). Bad population
files are one line, exit 2."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tasks.spec import validate_spec
from tests.conftest import REPO, tiny_spec
from tests.test_pages import CHROMIUM, FLAGS

CLI = "import sys; from flows.cli import main; sys.exit(main())"


def ballast(*args: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "BALLAST_FAULT"}
    return subprocess.run(
        [sys.executable, "-c", CLI, *args], cwd=REPO, env=environment, capture_output=True, text=True, timeout=900
    )


def population_file(tmp: Path, model: Path, **pbt) -> Path:
    base = tiny_spec(model, name="tiny-pbt", project_dir=str(tmp / "project"), optim={"steps": 4})
    base["data"]["num_eval_prompts"] = 16
    base["probe"] = {"enabled": False}
    data = {
        "study": "tiny-pbt",
        "base": base,
        "space": {
            "grpo.beta": {"type": "float", "low": 1e-3, "high": 0.2, "log": True},
            "optim.learning_rate": {"type": "float", "low": 3e-4, "high": 1e-2, "log": True},
            "lora.r": {"type": "categorical", "choices": [4, 8]},
        },
        "objectives": [{"metric": "eval/reward", "direction": "maximize"}],
        "confirm": {"min_prompts": 4},
        "seed": 1,
        "pbt": {"population": 2, "ready": 2, "quantile": 0.5, **pbt},
    }
    path = tmp / "pbt.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def population(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pbt-flow")
    done = ballast("pbt", str(population_file(tmp, tiny_model)))
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, done.stdout


def test_the_population_records_a_parent_run_and_a_child_run_per_member_with_its_schedule(population):
    tmp, _ = population
    root = tmp / "project" / "populations" / "tiny-pbt"
    runs = json.loads((root / "mlflow.json").read_text())
    client = MlflowClient(f"sqlite:///{tmp / 'project' / 'mlflow.db'}")
    parent = client.get_run(runs["parent"])
    assert parent.data.tags["ballast.kind"] == "population" and parent.data.params["pbt.population"] == "2"
    assert {"confirmed/winner", "confirmed/baseline", "confirmed/gain", "confirmed/ci95"} <= set(parent.data.metrics)
    assert parent.data.tags["ballast.pbt.verdict"].startswith("confirmed on 8 confirmation prompts: winner ")
    state = json.loads((root / "population.json").read_text())
    for name in ("member-00", "member-01"):
        run = client.get_run(runs[name])
        assert run.data.tags["mlflow.parentRunId"] == runs["parent"]
        assert [m.step for m in client.get_metric_history(runs[name], "pbt/beta")] == [1, 2, 3, 4]
    (event,) = state["events"]
    copied = client.get_run(runs[f"member-{event['member']:02d}"])
    said = copied.data.tags["ballast.pbt.replaced.000002"]
    assert said.startswith(f"from member-{event['source']:02d} (exploit)")
    assert [m.value for m in client.get_metric_history(copied.info.run_id, "pbt/copied_from")] == [event["source"]]


def test_the_terminal_follows_the_population_as_it_trains(population):
    """It said nothing before the end: the start line (printed inside the flow) went to Prefect's log alone."""
    _, stdout = population
    lines = stdout.splitlines()
    assert lines[0].startswith("population tiny-pbt: 2 members, 4 steps, ranked every 2 on eval/reward")
    ranked = [i for i, line in enumerate(lines) if line.startswith("  step 2/4, ") and "; ranked: member-0" in line]
    assert ranked and lines[ranked[0] + 1].startswith("    member-0") and " <- copy of member-0" in lines[ranked[0] + 1]
    assert any(line.startswith("  step 4/4, ") and "; ranked: " in line for line in lines)
    assert lines.index(next(line for line in lines if line.startswith("confirming the winner member-0"))) > ranked[0]


def test_the_winner_is_confirmed_on_prompts_no_ranking_read_and_its_replay_spec_carries_its_schedule(population):
    tmp, stdout = population
    root = tmp / "project" / "populations" / "tiny-pbt"
    assert "confirmed on 8 confirmation prompts" in stdout
    verdict = next(line for line in stdout.splitlines() if "confirmed on 8 confirmation prompts" in line)
    assert " ± " in verdict and ("beats the base model" in verdict or "does not beat the base model" in verdict)
    winner = int(stdout.split("winner member-")[1][:2])
    final = json.loads((root / "population.json").read_text())["members"][winner]["hparams"]
    spec = validate_spec(yaml.safe_load((root / "winner.yaml").read_text()), "winner.yaml")
    assert spec.eval.split.part == "selection" and spec.eval.every == 2
    assert spec.grpo.schedule[0].step == 1
    assert spec.grpo.schedule[-1].beta == final["grpo.beta"]
    assert spec.grpo.schedule[-1].learning_rate == final["optim.learning_rate"]
    assert spec.lora.r == final["lora.r"]


def test_the_summary_page_draws_the_lineage_and_the_winners_schedule_in_chromium(population):
    from playwright.sync_api import sync_playwright

    tmp, _ = population
    page_path = tmp / "project" / "populations" / "tiny-pbt" / "pbt.html"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(page_path.as_uri())
        assert page.locator("#lineage svg path").count() >= 2  # the winner's lineage and the replacement's arrow
        assert page.locator("#schedule svg path").count() == 2  # beta and the learning rate
        text = page.inner_text("body")
        assert "member-00" in text and "exploit" in text
        assert "the winner, confirmed on 8 confirmation prompts: member-0" in text  # the banner names it
        page.screenshot(path=str(page_path.with_suffix(".png")), full_page=True)
        browser.close()
    assert not errors


def test_starting_a_saved_population_again_is_one_line_exit_2_naming_resume(population):
    """Before any flow run or model load (it printed a Prefect traceback first): the saved population is untouched."""
    tmp, _ = population
    saved = next((tmp / "project" / "populations").glob("*/population.json"))
    before = saved.read_bytes()
    done = ballast("pbt", str(tmp / "pbt.yaml"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr[-2000:]
    assert "already has a run" in done.stderr and "--resume" in done.stderr
    assert saved.read_bytes() == before


def test_a_space_field_a_population_cannot_schedule_is_one_line_exit_2(tiny_model, tmp_path):
    path = population_file(tmp_path, tiny_model)
    data = yaml.safe_load(path.read_text())
    data["space"]["grpo.epsilon"] = {"type": "float", "low": 0.1, "high": 0.3}
    path.write_text(yaml.safe_dump(data))
    done = ballast("pbt", str(path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "space.grpo.epsilon" in done.stderr and "overrides" in done.stderr


def test_ctrl_c_saves_the_population_and_names_the_resume_command_which_finishes_it(tiny_model, tmp_path):
    path = population_file(tmp_path, tiny_model)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    proc = subprocess.Popen(
        [sys.executable, "-c", CLI, "pbt", str(path)],
        cwd=REPO,
        env={**environment, "BALLAST_FAULT": "hold-in-step:3"},  # step 3 waits for the signal: it lands there
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    root = tmp_path / "project" / "populations" / "tiny-pbt"
    deadline = time.monotonic() + 900
    while not (root / "population.json").exists():  # saved at ranking step 2; the signal then lands in step 3
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 130, err[-3000:]
    assert f"continue it with: ballast pbt {path} --resume" in out
    assert json.loads((root / "population.json").read_text())["step"] == 3
    resumed = ballast("pbt", str(path), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((root / "population.json").read_text())["step"] == 4
    runs = json.loads((root / "mlflow.json").read_text())
    client = MlflowClient(f"sqlite:///{tmp_path / 'project' / 'mlflow.db'}")
    for name in ("member-00", "member-01"):  # each step once in MLflow, across the interruption
        assert [m.step for m in client.get_metric_history(runs[name], "pbt/beta")] == [1, 2, 3, 4]


def test_a_population_whose_every_member_collapses_ends_without_a_winner_and_so_does_its_resume(tiny_model, tmp_path):
    """Every member's gate trips at the last step (no replacement there): no winner to confirm or replay — exit 3 and
    a line that says so (it raised a TypeError writing winner.yaml) — and a resume of that save, which trains no more
    steps, finds the same: which members collapsed is saved with them (a resume forgot it and named one winner)."""
    path = population_file(tmp_path, tiny_model)
    data = yaml.safe_load(path.read_text())
    data["base"]["health"] = {"min_step": 4, "patience": 1, "kl_max": -1.0}  # KL >= 0: trips at step 4, the last
    path.write_text(yaml.safe_dump(data))
    root = tmp_path / "project" / "populations" / "tiny-pbt"
    for args in ([], ["--resume"]):
        done = ballast("pbt", str(path), *args)
        assert done.returncode == 3, done.stderr[-3000:]
        assert "winner none" in done.stdout and "no winner: every member's health gate tripped" in done.stdout
        assert not (root / "winner.yaml").exists()
    members = json.loads((root / "population.json").read_text())["members"]
    assert all(m["collapsed"] and m["collapsed"].startswith("collapsed") for m in members), members


def test_a_confirmation_file_of_ones_own_judges_the_winner_whatever_the_data_source(tiny_model, tmp_path):
    """`confirm.data` with a built-in data.source (the quickstart's arith): the winner is scored on the file's rows
    (its eval_path, which a built-in source ignores, was all it set: the selection prompts judged it again)."""
    rows = [{"prompt": f"{a}+{a}", "answer": str(2 * a)} for a in range(10, 15)]
    (tmp_path / "confirm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = population_file(tmp_path, tiny_model)
    data = yaml.safe_load(path.read_text())
    data["confirm"]["data"] = "confirm.jsonl"
    path.write_text(yaml.safe_dump(data))
    done = ballast("pbt", str(path))
    assert done.returncode in (0, 3), done.stderr[-3000:]
    assert "confirmed on 5 confirm.data prompts" in done.stdout, done.stdout[-2000:]


def test_a_fresh_start_over_an_attempt_killed_before_its_first_save_opens_new_runs_and_records(tiny_model, tmp_path):
    """Killed inside its first save (the members' checkpoints written, population.json not): nothing to resume, so
    a plain start runs again — in new MLflow runs (it took over the dead attempt's, its params and its logged
    steps) with member records that hold each step once; the dead attempt's runs end FAILED."""
    path = population_file(tmp_path, tiny_model)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    killed = subprocess.run(
        [sys.executable, "-c", CLI, "pbt", str(path)],
        cwd=REPO,
        env={**environment, "BALLAST_FAULT": "kill-in-population-save:2"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    root = tmp_path / "project" / "populations" / "tiny-pbt"
    assert not (root / "population.json").exists()
    old = json.loads((root / "mlflow.json").read_text())
    done = ballast("pbt", str(path))
    assert done.returncode in (0, 3), done.stderr[-3000:]
    runs = json.loads((root / "mlflow.json").read_text())
    assert not set(runs.values()) & set(old.values())
    client = MlflowClient(f"sqlite:///{tmp_path / 'project' / 'mlflow.db'}")
    assert {client.get_run(r).info.status for r in old.values()} == {"FAILED"}
    for name in ("member-00", "member-01"):
        steps = [json.loads(line)["step"] for line in (root / name / "metrics.jsonl").read_text().splitlines()]
        assert sorted(steps) == sorted(set(steps)), (name, steps)
        assert [m.step for m in client.get_metric_history(runs[name], "pbt/beta")] == [1, 2, 3, 4]


def test_validate_checks_a_population_file_as_ballast_pbt_would_without_running_it():
    done = ballast("validate", "examples/pbt.yaml")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("examples/pbt.yaml: valid population")
    assert "8 members, ranked every 5 steps on eval/reward" in lines[1]
    assert "64 selection prompts" in lines[2]


def test_a_confirm_section_that_is_not_a_mapping_is_one_line_exit_2(tiny_model, tmp_path, capsys):
    from flows.cli import main

    path = population_file(tmp_path, tiny_model)
    data = yaml.safe_load(path.read_text())
    data["confirm"] = 0.5  # it raised an AttributeError with a traceback, before the sweep's own check
    path.write_text(yaml.safe_dump(data))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "field 'confirm'" in err


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"model": {"device": "cuda:3"}}, "model.device"),
        ({"model": {"name_or_path": "/nowhere/model", "build_if_missing": None}}, "name_or_path='/nowhere/model'"),
        ({"lora": {"enabled": False}}, "lora.enabled is false; a population's members train LoRA adapters"),
        ({"pbt": {"perturb": [0.0, -1.0]}}, "field 'perturb.0': Input should be greater than 0"),
    ],
    ids=["a device that is not there", "a model that is not there", "lora off", "a factor that is not above 0"],
)
def test_what_a_population_cannot_run_on_is_refused_by_validate_and_pbt_before_any_run_opens(
    tiny_model, tmp_path, change, fragment
):
    """`ballast validate` and `ballast pbt` refuse in one line, exit 2: a model or device that is not here passed
    validate and failed `pbt` after it opened an MLflow run per member, left RUNNING, with tracebacks."""
    path = population_file(tmp_path, tiny_model)
    data = yaml.safe_load(path.read_text())
    for section, fields in change.items():
        (data if section == "pbt" else data["base"]).setdefault(section, {}).update(fields)
    path.write_text(yaml.safe_dump(data))
    for command in ("validate", "pbt"):
        done = ballast(command, str(path))
        lines = done.stderr.strip().splitlines()
        assert (done.returncode, len(lines)) == (2, 1), done.stderr[-3000:]
        assert lines[0].startswith("error: ") and fragment in lines[0], lines[0]
    assert not (tmp_path / "project" / "mlflow.db").exists()
