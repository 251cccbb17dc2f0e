"""The README cannot drift from the code: every `ballast ...` command line its code blocks show names a command and
options the CLI has, and runs — with `--dryrun`, or through `ballast validate` for a command that would train —
exiting 0; its sentence on what does not run on several ranks names exactly the fields tasks/ranks.py refuses."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from flows.cli import build_parser
from tasks.ranks import NOT_ON_SEVERAL_RANKS
from tests.conftest import REPO

README = (REPO / "README.md").read_text()
PLACEHOLDERS = {"SPEC": "examples/quickstart.yaml"}  # the spec a placeholder stands for when the line is run
# SPEC on GPU nodes stands for a team's spec: a tracking server and a store the nodes reach, a batch the ranks divide
ON_NODES = ["tracking.uri=http://mlflow.internal:5000", "storage.uri=s3://bucket/ballast", "grpo.prompts_per_step=32"]
CLI = "import sys; from flows.cli import main; sys.exit(main())"


def readme_commands() -> list[str]:
    """Every `ballast ...` line of the README's code blocks (fenced or indented), continuations joined, comments cut."""
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", README, re.S):
        lines += block.splitlines()
    lines += [line[4:] for line in README.splitlines() if line.startswith("    ")]  # indented code blocks
    commands, pending = [], ""
    for line in lines:
        line = pending + re.split(r"\s+#\s", line.strip(), maxsplit=1)[0].strip()
        pending = line[:-1] + " " if line.endswith("\\") else ""
        if not pending and line.startswith("ballast"):
            commands.append(" ".join(line.split()))
    return sorted(set(commands))


def subparser(command: str):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices.get(command)


def runnable(line: str, project_dir) -> list[str] | None:
    """The line as it runs here: optional [..] parts dropped, placeholders filled; a run or launch line with
    --dryrun, a validate, sweep or train line as `ballast validate SPEC`; None for a line that would start something
    else (a server, a UI, a resume) or needs a run or checkpoint to exist."""
    words = shlex.split(re.sub(r"\[[^\]]*\]\.*", "", line))[1:]
    words = [PLACEHOLDERS.get(w, w) for w in words]
    if words in (["--version"], ["metrics"], ["spec-schema"]):
        return words
    if not words or "--resume" in words:
        return None
    command, rest = words[0], words[1:]
    where = ["--set", f"project_dir={project_dir}"]
    spec = [w for i, w in enumerate(rest) if w.endswith(".yaml") and (not i or not rest[i - 1].startswith("--"))]
    sets = [w for i, w in enumerate(rest) if i and rest[i - 1] == "--set"]
    if "SPEC" in line and "infra.compute=skypilot" in sets:
        sets = ON_NODES + sets
    sets = [x for w in sets for x in ("--set", w)]
    if spec and spec[0].startswith(".ballast/"):
        return None  # a spec an earlier command writes (a population's winner), not in a fresh clone
    if command == "run" and spec:
        return ["run", spec[0], *sets, "--dryrun", *where]
    if command in ("validate", "sweep", "train") and spec:
        return ["validate", spec[0], *sets, *where]
    if command == "launch" and spec and "--dryrun" in line:
        return ["launch", spec[0], *sets, "--dryrun", *where]
    return None


COMMANDS = readme_commands()


def test_the_readme_shows_the_commands_it_documents():
    assert len(COMMANDS) >= 15, COMMANDS
    assert "ballast validate SPEC [--set key.path=value]..." in COMMANDS


@pytest.mark.parametrize("line", COMMANDS)
def test_each_readme_command_and_its_options_exist(line):
    words = shlex.split(line.replace("[", " ").replace("]", " ").replace("...", " "))[1:]
    if words == ["--version"]:
        return
    parser = subparser(words[0])
    assert parser is not None, f"README shows `{line}`, but the CLI has no command {words[0]!r}"
    known = {s for action in parser._actions for s in action.option_strings}
    unknown = [w.split("=")[0] for w in words[1:] if w.startswith("--") and w.split("=")[0] not in known]
    assert not unknown, f"README shows `{line}`; `ballast {words[0]}` has no option {unknown}"


RUNNABLE = [line for line in COMMANDS if runnable(line, "X") is not None]


def test_the_commands_that_can_run_here_are_most_of_the_spec_ones():
    assert {shlex.split(line)[1] for line in RUNNABLE} >= {"run", "validate", "sweep", "train", "launch", "metrics"}


@pytest.mark.integration  # a subprocess of the CLI each
@pytest.mark.parametrize("line", RUNNABLE)
def test_each_readme_command_runs_as_a_dry_run_or_validation(line, tmp_path):
    argv = runnable(line, tmp_path / "project")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", CLI, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"`{line}` ran as `ballast {shlex.join(argv)}`: {done.stderr[-2000:]}"


def test_the_readme_names_exactly_what_several_ranks_refuse():
    sentence = re.search(r"and \(for now\)(.*?)\(`tasks/ranks\.py` NOT_ON_SEVERAL_RANKS\)", README, re.S)
    assert sentence, "the README's sentence on what several ranks refuse, pointing at tasks/ranks.py, is gone"
    named = set(re.findall(r"`([a-z_]+\.[a-z_]+)[`:]", sentence.group(1)))
    assert named == set(NOT_ON_SEVERAL_RANKS)


def test_the_readme_does_not_say_the_node_stages_are_unbuilt():
    assert "not built yet" not in README


@pytest.mark.parametrize(
    "overrides, refused",
    [
        (
            ["rollout.engine=offline", "data.source=tests/offline_episodes.jsonl", "grpo.num_generations=2"],
            "rollout.engine: offline",
        ),
        (["grpo.kl_ref_step_lag=2", "grpo.beta=0.05"], "grpo.kl_ref_step_lag: 2"),
    ],
)
def test_several_ranks_refuse_what_the_table_names_in_one_line_with_the_fix(overrides, refused):
    from tasks.ranks import check_ranks
    from tasks.spec import SpecError, load_spec
    from trainer.tiny import SHIPPED

    two_ranks = [f"model.name_or_path={SHIPPED}", "model.parallel=ddp", "grpo.prompts_per_step=8"]
    check_ranks(load_spec("examples/quickstart.yaml", two_ranks), 2, here=False)  # the quickstart runs on two ranks
    with pytest.raises(SpecError, match=rf"^--nproc 2: {refused} does not run on several ranks yet; set "):
        check_ranks(load_spec("examples/quickstart.yaml", two_ranks + overrides), 2, here=False)
