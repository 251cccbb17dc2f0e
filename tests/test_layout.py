"""The layering the design promises, checked on the code itself: the trainer imports no orchestration library and
nothing from the layers above it, flows/ reaches the trainer only through tasks/, sweeps/ never imports flows/,
no two modules import each other (directly or round a longer circle), the checkpoint format's names are written
only in trainer/checkpoint.py, and only the recorder imports MLflow (function lengths: test_function_length.py)."""

import ast
import re
from pathlib import Path

from tests.conftest import REPO

ORCHESTRATION = {"prefect", "mlflow", "optuna", "sky"}
PACKAGES = ("trainer", "tasks", "flows", "sweeps", "infra")  # the project's modules; tests/ and bench/ use them


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


# ── import cycles ──────────────────────────────────────────────────────────────────────────────────


def project_modules() -> dict[str, Path]:
    """{dotted module name: path} of every module of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _RuntimeImports(ast.NodeVisitor):
    """The dotted names a module can import when it runs: its import statements at module level and inside functions,
    and `importlib.import_module("...")` with a literal name; not those under `if TYPE_CHECKING:`, which never run."""

    def __init__(self, package: str):
        self.package, self.names = package, []

    def visit_If(self, node: ast.If) -> None:
        for child in node.orelse if _is_type_checking(node.test) else [node.test, *node.body, *node.orelse]:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        self.names += [alias.name for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1] if node.level else []
        module = ".".join(base + ([node.module] if node.module else []))
        self.names += [f"{module}.{alias.name}" for alias in node.names]  # a submodule, or a name in `module`

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            self.names.append(str(node.args[0].value))
        self.generic_visit(node)


def import_graph() -> dict[str, set[str]]:
    """{module: the project's modules it imports at run time}."""
    modules = project_modules()

    def resolve(name: str) -> str | None:  # the longest project module the dotted name starts with
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        visitor = _RuntimeImports(package)
        visitor.visit(ast.parse(path.read_text()))
        graph[name] = {m for m in map(resolve, visitor.names) if m and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle of imports through each module that is on one, as [a, b, ..., a]."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_two_modules_import_each_other_even_inside_a_function():
    """Imports inside functions count: a lazy import is how a circle hides (flows/cli.py loaded flows/commands.py,
    which imported flows/cli.py; trainer/packing.py imported trainer/logprobs.py inside a function, which imported
    trainer/packing.py), and with module-level imports alone neither circle showed. Imports under
    `if TYPE_CHECKING:` do not count: they never run, and they are how a type is named against the dependency's
    direction."""
    assert not cycles(import_graph())


def test_the_cycle_check_finds_a_circle_through_a_function_level_import():
    graph = import_graph()
    assert "flows.commands" in graph["flows.cli"]  # importlib.import_module("flows.commands")
    found = cycles({**graph, "trainer.packing": graph["trainer.packing"] | {"trainer.logprobs"}})
    assert any(set(circle) == {"trainer.logprobs", "trainer.packing"} for circle in found), found


# ── the checkpoint format's one home ───────────────────────────────────────────────────────────────

FORMAT_FILES = {"manifest.json", "trainer_state.json", "optimizer.pt", "scheduler.pt", "rng.json", "lagged.safetensors"}
FORMAT_DIRS = {"adapter", "state", "tokenizer"}  # joined onto a checkpoint's path: `path / "adapter"`
STEP_NAME = re.compile(r"(.*/)?step-(\d*|\*|N+)")  # step-000120, step-*, an f-string's "step-{step:06d}"


def format_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, literal) of each checkpoint-format name written in code — a string constant naming one of its files or
    a step directory, or one of its folders joined onto a path; docstrings, messages and help texts do not count."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if node.value.rsplit("/", 1)[-1] in FORMAT_FILES or STEP_NAME.fullmatch(node.value):
                found.append((node.lineno, node.value))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant):
            if node.right.value in FORMAT_DIRS:
                found.append((node.lineno, f'/ "{node.right.value}"'))
    return found


def test_checkpoint_format_names_are_written_only_in_trainer_checkpoint_py():
    leaks = [
        f"{path.relative_to(REPO)}:{line} {literal}"
        for path in project_modules().values()
        if path != REPO / "trainer" / "checkpoint.py"
        for line, literal in format_names(ast.parse(path.read_text()))
    ]
    assert not leaks, "use trainer/checkpoint.py's names and functions instead: " + ", ".join(leaks)


def test_the_format_check_sees_a_path_join_a_file_name_and_a_step_glob():
    code = 'm = json.loads((c / "manifest.json").read_text())\nw = c / "adapter" / "x"\nany(d.glob("step-*"))\n'
    assert sorted(literal for _, literal in format_names(ast.parse(code))) == ['/ "adapter"', "manifest.json", "step-*"]


# ── MLflow has one caller ──────────────────────────────────────────────────────────────────────────

RECORDER = {
    "tasks/record.py",  # RunRecorder: every MLflow record of a run (tasks/sweep_record.py a sweep's, through Tracking)
    "tasks/tracking.py",  # Tracking: the tracking store every recorder writes through, and what is read back
    "tasks/metrics_sink.py",  # the recorder's per-step metrics, kept on disk while MLflow is away
    "tasks/mlflow_model.py",  # the model-from-code file the recorder logs; it records nothing itself
}


def test_only_the_recorder_imports_mlflow():
    """infra/mlflow_server.py starts and checks the tracking server without importing MLflow; nothing else needs it."""
    importers = sorted(
        str(path.relative_to(REPO))
        for path in project_modules().values()
        if any(
            (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "mlflow" for a in node.names))
            or (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "mlflow")
            for node in ast.walk(ast.parse(path.read_text()))
        )
    )
    assert set(importers) <= RECORDER, importers


# ── the sweep's runners read the pipeline's public surface ────────────────────────────────────────────


def imported_names(path: Path) -> list[tuple[str, str]]:
    """(module, name) of each `from module import name` in the file, at any depth."""
    return [
        (node.module, alias.name)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
        for alias in node.names
    ]


def test_the_sweep_and_its_trial_runners_use_only_public_names_of_the_pipeline():
    """flows/sweep.py and the runners (flows/trials/) share the stages through flows/stages.py, and run a trial's
    pipeline only through the flow itself (`run_pipeline`); no module of the project imports another's private
    (underscored) name."""
    runners = [REPO / "flows" / "sweep.py", *sorted((REPO / "flows" / "trials").glob("*.py"))]
    for path in runners:
        from_pipeline = {name for module, name in imported_names(path) if module == "flows.pipeline"}
        assert from_pipeline <= {"run_pipeline"}, (path, from_pipeline)
    private = [
        f"{path.relative_to(REPO)}: {module}.{name}"
        for path in project_modules().values()
        for module, name in imported_names(path)
        if module.split(".")[0] in PACKAGES and name.startswith("_") and name != "__version__"
    ]
    assert not private, private


def test_flows_sweep_py_reads_as_its_sequence_in_under_300_lines():
    assert len((REPO / "flows" / "sweep.py").read_text().splitlines()) < 300
