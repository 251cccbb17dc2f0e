"""No function in flows/, tasks/, sweeps/ or trainer/ is longer than a reader can hold on one screen: 60 lines,
counted by the AST from `def` to the function's last line (decorators not counted, docstring and comments counted).
A longer function is split where the split names a real step."""

import ast

import pytest

from tests.conftest import REPO

MAX_FUNCTION_LINES = 60
FOLDERS = ("flows", "tasks", "sweeps", "trainer")

# None is allowed: a (path, name) here would name a function still being split.
ALLOWED: set[tuple[str, str]] = set()


def long_functions(folder: str, root=REPO) -> list[tuple[str, str, int, int]]:
    """(path, name, first line, length) of every function under root/folder longer than MAX_FUNCTION_LINES."""
    out = []
    for path in sorted((root / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    out.append((str(path.relative_to(root)), node.name, node.lineno, lines))
    return out


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_function_is_longer_than_60_lines(folder):
    long = [f"{p}:{line} {name} ({n} lines)" for p, name, line, n in long_functions(folder) if (p, name) not in ALLOWED]
    assert not long, long


def test_the_counter_sees_a_long_function(tmp_path):
    """The count is of lines from `def` to the end: 61 lines is one too many, 60 is not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows" / "a.py").write_text(f"def sixty():\n{body}\n\n\ndef sixty_one():\n{body}\n    return x0\n")
    assert [(name, n) for _, name, _, n in long_functions("flows", tmp_path)] == [("sixty_one", 61)]
