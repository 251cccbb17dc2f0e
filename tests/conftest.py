"""Shared fixtures: the moto S3 server (tests/s3_fixtures.py) and the tiny offline model.

The tiny model is the one shipped in trainer/assets/tiny-arith/ (built once by scripts/build_tiny_model.py), so
every machine tests the same bits; it is loaded through from_pretrained like any Hugging Face model, from where it
lies (tests never write into it).
"""

import ast
import inspect
import json
import os
import re
import shutil
import textwrap
import uuid
from pathlib import Path

import pytest

pytest_plugins = ["tests.s3_fixtures", "tests.real_model_fixtures"]

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from trainer.tiny import SHIPPED

    return SHIPPED


def perturb_lora(model, seed: int, scale: float = 0.05) -> None:
    """Give every lora_B weight random values (peft starts them at zero), as after some training."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)


def tiny_spec(model_path, **sections) -> dict:
    """A small, fast experiment spec on the tiny model; sections override/extend the defaults."""
    spec = {
        "model": {"name_or_path": str(model_path), "device": "cpu"},
        "lora": {"r": 8, "alpha": 16},
        "data": {"num_prompts": 64, "num_eval_prompts": 8},
        # a reward with spread in every group, so every step has a learning signal
        "rewards": [{"name": "exact_answer"}, {"name": "tests.reward_fixtures:length_bonus", "weight": 0.1}],
        "grpo": {"num_generations": 4, "prompts_per_step": 2, "beta": 0.04},
        "rollout": {"max_tokens": 24},
        "optim": {"steps": 4, "learning_rate": 1e-3},
        "checkpoint": {"every": 2, "keep_last": 5},
        "eval": {"every": 0, "max_tokens": 24},
    }
    for name, value in sections.items():
        if isinstance(value, dict):
            spec.setdefault(name, {}).update(value)
        else:
            spec[name] = value
    if spec["rollout"].get("engine") == "vllm":  # a server a test starts: a machine busy with other test files is slow
        spec["rollout"].setdefault("vllm_startup_timeout_s", VLLM_STARTUP_TIMEOUT_S)
    return spec


# The seconds a vLLM server a test starts may take to answer: the default (240 s) is a user's machine; a 2-core one
# running three test files at a time took over 240 s for a server that answered a few seconds later (CI, 2026-11-29).
VLLM_STARTUP_TIMEOUT_S = 600


# ── the `integration` marker ──────────────────────────────────────────────────────────────────────
# A test is an integration test when it needs a real model, a server process (moto, Prefect, MLflow, vLLM,
# PostgreSQL) or a subprocess (the CLI, a node, ranks: read from its code and the module's helpers it calls);
# `pytest -m "not integration"` (`bash scripts/test.sh --fast`) runs the unit tests alone. The marker is given here,
# from what each test asks for and does, so no test can be filed under the wrong one.
INTEGRATION_FIXTURES = {
    "tiny_model",
    "built_tiny",
    "moto_server",
    "s3_bucket",
    "prefect",
    "prefect_server",
    "smollm2",
    "vllm_python",
    "finished_run",
    "quickstart",
    "straight_run",
}
INTEGRATION_MODULES = {
    "test_pipeline",
    "test_sweep",
    "test_sweep_postgres",
    "test_regression",
    "test_vllm",
    "test_deployments",
    "test_skypilot",
    "test_bad_inputs",
    "test_nothing_lost",
    "test_outages",
    "test_signals",
    "test_terminal",
    "test_resume_records",
}


# ── a chat template with tools (tests/test_offline.py, tests/test_environment.py) ───────────────────

# The tiny model's template has no tool role; this one does, and writes a newline after each assistant turn's end
# token, which is not sampled: it must come in as an inserted token.
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}Tools: {{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'tool' %}<|user|>[tool] {{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}"
    "{% if message['tool_calls'] is defined %}{% for call in message['tool_calls'] %}"
    "<call>{{ call['function']['name'] }}({{ call['function']['arguments'] }})</call>{% endfor %}{% endif %}"
    "{{ eos_token }}\n"
    "{% else %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tool_model(tiny_model, tmp_path_factory):
    """The tiny model with TOOL_TEMPLATE as its chat template."""
    return model_with_template(tiny_model, tmp_path_factory.mktemp("tool-model") / "model", TOOL_TEMPLATE)


def model_with_template(model: Path, path: Path, template: str) -> Path:
    """A copy of `model` at `path` with `template` as its chat template."""
    shutil.copytree(model, path)
    set_chat_template(path, template)
    return path


def set_chat_template(path: Path, template: str) -> None:
    """Where transformers reads it from: chat_template.jinja when there is one (transformers 5), else the config."""
    if (path / "chat_template.jinja").is_file():
        (path / "chat_template.jinja").write_text(template)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))


# ── team paths: Prefect's test server, PostgreSQL ────────────────────────────────────────────────────

PG = "postgresql://postgres@127.0.0.1:5432"  # the machine's PostgreSQL, trust auth


@pytest.fixture(scope="session")
def prefect_api():
    """Prefect's test harness (a temporary API server and database), one per test process (each xdist worker):
    started by the first test that asks for it (~9 s of a server's start on 2 cores), kept to the end. Tests that
    read flow runs back filter them by what they ran (a flow name and a study), never count the whole API's.
    Yields its API URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield PREFECT_API_URL.value()


def postgres_database(prefix: str):
    """Yield the URL of a new database on the local PostgreSQL, dropped after (use with `yield from` in a fixture)."""
    import psycopg2  # a dependency of Ballast (psycopg2-binary); the team path is tested, never skipped

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    try:
        conn = psycopg2.connect(f"{PG}/postgres", connect_timeout=5)
    except psycopg2.OperationalError as e:
        raise RuntimeError(
            f"the team-path tests need PostgreSQL on 127.0.0.1:5432 with trust auth (see the README): {e}"
        ) from None
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name}")
    try:
        yield f"{PG}/{name}"
    finally:
        with conn.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.close()


# tasks.ranks.launch starts ranks as torchrun does
STARTS_A_PROCESS = re.compile(
    r"\bsubprocess\.|\bPopen\(|\.Process\(|\bstart_processes\(|\bpexpect\.|\bfrom tasks\.ranks import launch\b"
)


def _starts_a_process(function, module) -> bool:
    """The test's own code, or a function of its module it calls, starts a process (the CLI, a node, ranks)."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    called = {n.id for n in ast.walk(ast.parse(textwrap.dedent(source))) if isinstance(n, ast.Name)}
    helpers = [getattr(module, name) for name in called if inspect.isfunction(getattr(module, name, None))]
    sources = [source] + [inspect.getsource(h) for h in helpers if h.__module__ == module.__name__]
    return any(STARTS_A_PROCESS.search(text) for text in sources)


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if (
            module in INTEGRATION_MODULES
            or INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ()))
            or _starts_a_process(getattr(item, "function", None), item.module)
        ):
            item.add_marker(pytest.mark.integration)
    _longest_first(items)


def pytest_runtest_setup(item):
    """Prefect sets up its console log handler when its flow API is first imported, on the sys.stderr of that
    moment: first imported in a test that asks for capsys, the handler kept that test's capture after it closed, and
    every later test of the process whose code logged through Prefect failed (a closed file, then a RecursionError
    from Prefect's log_prints). Such a test's setup, ahead of capsys, imports it under pytest's own capture, which
    lives as long as the process."""
    if "capsys" in getattr(item, "fixturenames", ()):
        import prefect.main  # noqa: F401 — sets up Prefect's logging on import


# ── the order the files run in ────────────────────────────────────────────────────────────────────
# Two workers take whole files (--dist loadfile) as they free up, so a long file taken last leaves the other worker
# idle to the end. tests/test_costs.json holds each file's seconds (setup, call and teardown of its tests) as
# measured on 2 cores; the files run longest first — a file the table does not know before all of them — which
# scripts/test.sh keeps with --no-loadscope-reorder (xdist otherwise orders the files by their number of tests).
# `BALLAST_RECORD_TEST_COSTS=1 bash scripts/test.sh` writes the run's figures into the table.
TEST_COSTS = Path(__file__).with_name("test_costs.json")
_spent: dict[str, float] = {}


def _file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def _longest_first(items: list) -> None:
    costs = json.loads(TEST_COSTS.read_text()) if TEST_COSTS.exists() else {}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(_file_of(item.nodeid), i)
    unknown = float("inf")
    items.sort(key=lambda item: (-costs.get(_file_of(item.nodeid), unknown), first_seen[_file_of(item.nodeid)]))


def pytest_runtest_logreport(report):
    if os.environ.get("BALLAST_RECORD_TEST_COSTS"):
        _spent[_file_of(report.nodeid)] = _spent.get(_file_of(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session):
    """With BALLAST_RECORD_TEST_COSTS set, this run's seconds per file into tests/test_costs.json (the controller
    process writes it: it hears every worker's reports)."""
    if not _spent or hasattr(session.config, "workerinput"):
        return
    costs = json.loads(TEST_COSTS.read_text()) if TEST_COSTS.exists() else {}
    costs.update({name: round(seconds, 1) for name, seconds in _spent.items()})
    TEST_COSTS.write_text(json.dumps(dict(sorted(costs.items(), key=lambda kv: -kv[1])), indent=1) + "\n")
