"""The layering the design promises, checked on the code itself: the trainer imports no orchestration library and
nothing from the layers above it, flows/ reaches the trainer only through tasks/, sweeps/ never imports flows/,
and no function in flows/ or tasks/ is longer than a reader can hold (60 lines)."""

import ast

import pytest

from tests.conftest import REPO

ORCHESTRATION = {"prefect", "mlflow", "optuna", "sky"}
MAX_FUNCTION_LINES = 60


def imports(folder: str) -> dict[str, set[str]]:
    """{file: top-level package names it imports} for every .py file under folder."""
    out = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(REPO))] = names
    return out


def test_trainer_imports_no_orchestration_library_and_no_upper_layer():
    for path, names in imports("trainer").items():
        assert not names & (ORCHESTRATION | {"tasks", "flows", "sweeps", "infra"}), (path, names)


def test_flows_reach_the_trainer_only_through_tasks():
    for path, names in imports("flows").items():
        assert "trainer" not in names, path


def test_sweeps_never_import_flows_and_infra_never_imports_tasks():
    assert not any("flows" in names for names in imports("sweeps").values())
    assert not any(names & {"tasks", "flows", "sweeps"} for names in imports("infra").values())


@pytest.mark.parametrize("folder", ["flows", "tasks"])
def test_no_function_is_longer_than_60_lines(folder):
    long = []
    for path in sorted((REPO / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
