"""What the `ballast` command shows a person: its version, help for every option, a usage line that says what
`run` needs, a spec schema that is a JSON-schema document describing every field, errors in a --set blamed on the
--set, piped output written line by line, no Prefect telemetry notice, and `ballast ui` commands that can be pasted.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import build_parser, main
from flows.commands import ui_commands
from tasks.spec import SpecError, load_spec
from tests.conftest import REPO

QUICKSTART = REPO / "examples" / "quickstart.yaml"


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_version_names_the_installed_distribution(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    from importlib.metadata import version

    assert out.startswith(f"ballast {version('ballast')}")


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_option_of_every_command_has_help(command):
    undocumented = [
        a.dest
        for a in subcommands()[command]._actions
        if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()
    ]
    assert undocumented == []


def test_run_usage_says_a_spec_or_resume_is_needed():
    usage = subcommands()["run"].format_usage()
    assert "ballast run SPEC [--set KEY=VALUE]..." in usage and "ballast run --resume RUN_ID" in usage


def test_the_command_list_appears_once_in_the_usage_line():
    usage = build_parser().format_usage()
    assert usage.strip() == "usage: ballast [-h] [--version] COMMAND ..."


def test_spec_schema_json_is_a_json_schema_document_that_describes_every_field(capsys):
    assert main(["spec-schema", "--json"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    undescribed = [
        f"{name}.{field}"
        for name, d in [("ExperimentSpec", schema), *schema["$defs"].items()]
        for field, p in d.get("properties", {}).items()
        if not p.get("description")
    ]
    assert undescribed == []


def test_a_bad_value_given_with_set_is_blamed_on_the_set_not_the_spec_file():
    with pytest.raises(SpecError) as e:
        load_spec(QUICKSTART, ["grpo.beta=abc"])
    assert str(e.value).startswith("--set grpo.beta=abc: field 'grpo.beta': Input should be a valid number")


def test_an_unknown_field_given_with_set_is_blamed_on_the_set():
    with pytest.raises(SpecError) as e:
        load_spec(QUICKSTART, ["grpo.betaa=0.1"])
    assert str(e.value).startswith("--set grpo.betaa=0.1: unknown field 'grpo.betaa'")


def test_a_bad_value_in_the_spec_file_is_still_the_files(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text(QUICKSTART.read_text().replace("beta: 0.02", "beta: abc"))
    with pytest.raises(SpecError) as e:
        load_spec(spec, ["optim.steps=5"])
    assert str(e.value).startswith(f"{spec}: field 'grpo.beta'")


def test_piped_output_is_written_line_by_line():
    code = (
        "import sys; from flows.cli import main; main(['metrics']); print(sys.stdout.line_buffering, file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stderr.strip().splitlines()[-1] == "True"


def test_no_prefect_telemetry_notice_in_a_terminal(tmp_path):
    """Prefect prints a first-run telemetry notice when imported in a terminal; the CLI turns it off first."""
    env = {k: v for k, v in os.environ.items() if k not in ("DO_NOT_TRACK", "CI")} | {"PREFECT_HOME": str(tmp_path)}
    code = "from flows.cli import main; main(['metrics']); import prefect"
    command = f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"
    shown = subprocess.run(
        ["script", "-qec", command, "/dev/null"], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    assert shown.returncode == 0, shown.stderr
    assert "anonymous usage data" not in shown.stdout


def test_ui_commands_start_mlflow_with_one_worker_and_can_be_pasted():
    commands = ui_commands(Path("/p"), "0.0.0.0", 5000, 4200)
    env, argv = commands["mlflow"]
    assert argv[:2] == ["mlflow", "server"] and argv[argv.index("--workers") + 1] == "1"
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    env, argv = commands["prefect"]
    assert env["DO_NOT_TRACK"] == "1" and env["PREFECT_HOME"] == "/p/prefect"
    assert env["PREFECT_UI_API_URL"] == "http://127.0.0.1:4200/api"
    line = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv)
    assert shlex.split(line)[-len(argv) :] == argv  # what is printed splits back into the same command


def test_spec_schema_lists_every_field_with_its_type_default_and_meaning_section_by_section(capsys):
    from tasks.spec import ExperimentSpec

    assert main(["spec-schema"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "[grpo]" in out and "[rewards[]]  Reward functions; the total reward is their weighted sum." in out
    beta = out.index("  grpo.beta: float, default 0.04")
    assert out[beta + 1].strip() == ExperimentSpec.model_fields["grpo"].annotation.model_fields["beta"].description
    assert "  model.name_or_path: str, required" in out
    assert "  model.gguf_file: str | None, default None" in out
    fields = [line.split(":")[0].strip() for line in out if line.startswith("  ") and not line.startswith("   ")]
    assert len(fields) == len(set(fields)) > 100


def test_spec_schema_piped_into_a_reader_that_stops_early_ends_quietly():
    shell = f"{shlex.quote(sys.executable)} -c 'from flows.cli import main; import sys; sys.exit(main())' "
    done = subprocess.run(
        shell + "spec-schema --json | head -2", shell=True, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.splitlines() == ["{", ' "$schema": "https://json-schema.org/draft/2020-12/schema",']
    assert done.stderr == ""


@pytest.mark.parametrize(
    "given, suggested", [("grpo.betta=0.1", "grpo.beta"), ("optim.learnig_rate=0.1", "optim.learning_rate")]
)
def test_a_misspelt_spec_field_gets_the_nearest_field_as_did_you_mean(given, suggested):
    with pytest.raises(SpecError) as e:
        load_spec(QUICKSTART, [given])
    assert str(e.value) == f"--set {given}: unknown field '{given.split('=')[0]}'; did you mean '{suggested}'?"
