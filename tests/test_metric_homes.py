"""One home for each step metric, checked on the code itself (as tests/test_layout.py checks the layers): no name of
trainer/metrics.py's METRICS table is defined by two functions in trainer/.

A function *defines* a metric where the name is written as a key: a key of a dict literal whose keys are all metric
names (a metrics dict, not a checkpoint's state or a sample row that shares a word with one), the key of a subscript
assignment (`m["kl"] = ...`), or the name handed to a `Tally` (`t.mean("entropy", ...)`). An f-string stands for every
name it can spell (`f"kl/{name}"` defines kl/k1, kl/k2 and kl/k3). One process and N ranks compute a metric by the same
function (the world reduces its parts), so a second definition is a second formula that can drift from the first.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from tests.conftest import REPO
from trainer.metrics import METRICS, Tally

TALLY_METHODS = {name for name in vars(Tally) if not name.startswith("_") and name != "values"}
# every jsonl line's key (metrics, prompts, samples) and a checkpoint's: the line's step, not a computed metric
NOT_COMPUTED = {"step"}


def _pattern(node: ast.expr) -> str | None:
    """A regex of the names a string literal or f-string can spell; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(re.escape(v.value) if isinstance(v, ast.Constant) else ".+" for v in node.values)
    return None


def _is_metric(pattern: str) -> bool:
    return any(re.fullmatch(pattern, name) for name in METRICS)


def _keys_defined(node: ast.AST) -> list[ast.expr]:
    """The keys `node` writes metrics under (module docstring)."""
    if isinstance(node, ast.Dict):
        keys = [k for k in node.keys if k is not None]  # None: a ** spread
        patterns = [_pattern(k) for k in keys]
        return keys if patterns and all(p is not None and _is_metric(p) for p in patterns) else []
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
        return [node.slice]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in TALLY_METHODS:
        return node.args[:1]
    return []


def metric_definitions(source: str, where: str) -> list[tuple[str, str]]:
    """(name pattern, defining function) for every metric key written inside a function of `source`."""
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = f"{where}:{node.name}"
        for key in _keys_defined(node) if function else []:
            if (pattern := _pattern(key)) is not None:
                found.append((pattern, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), None)
    return found


def homes(sources: dict[str, str]) -> dict[str, set[str]]:
    """{metric name: the functions that define it} over `sources` ({file: code})."""
    definitions = [d for where, code in sources.items() for d in metric_definitions(code, where)]
    out = defaultdict(set)
    for name in METRICS:
        for pattern, function in definitions:
            if re.fullmatch(pattern, name):
                out[name].add(function)
    return out


def trainer_sources(root: Path = REPO) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted((root / "trainer").rglob("*.py"))}


def test_every_step_metric_is_defined_by_one_function_in_the_trainer():
    twice = {name: sorted(fns) for name, fns in homes(trainer_sources()).items() if len(fns) > 1}
    assert not {name: fns for name, fns in twice.items() if name not in NOT_COMPUTED}, twice


def test_the_metrics_a_step_computes_from_tensors_have_their_home_in_metrics_py():
    found = homes(trainer_sources())
    for name in ("entropy", "kl/k3", "clip_ratio/low_min", "policy_ratio/mean", "sampling/staleness/max"):
        assert found[name] == {f"trainer/metrics.py:{fn}" for fn in _home(name)}, name


def _home(name: str) -> set[str]:
    if name == "entropy":
        return {"entropy_metric"}
    return {"sampling_metrics"} if name.startswith("sampling/") else {"update_metrics"}


def test_a_metric_written_by_two_functions_is_found():
    """The check itself: a one-process formula beside a per-rank one (as trainer/ had them) is caught, f-strings
    included, and a checkpoint's state or a sample row sharing a word with a metric is not a definition."""
    one = 'def update_metrics(t):\n    return {"policy_ratio/mean": 1.0, "kl": 0.0}\n'
    ranks = (
        "def update_stats(stats, kl):\n"
        "    for name in ('k1', 'k3'):\n"
        '        stats.masked_mean(f"kl/{name}", kl, 1)\n'
        '    stats.mean("policy_ratio/mean", 1, 1)\n'
        "def reduced(m):\n"
        '    m["kl"] = m["kl/k3"]\n'
        "def sample_row(r):\n"
        '    return {"reward": r, "completion": "x"}\n'
        "def scored(r):\n"
        '    return {"reward": r}\n'
    )
    found = homes({"trainer/metrics.py": one, "trainer/distributed.py": ranks})
    assert found["policy_ratio/mean"] == {"trainer/metrics.py:update_metrics", "trainer/distributed.py:update_stats"}
    assert found["kl"] == {"trainer/metrics.py:update_metrics", "trainer/distributed.py:reduced"}
    assert found["kl/k1"] == {"trainer/distributed.py:update_stats"}
    assert found["reward"] == {"trainer/distributed.py:scored"}
