"""An environment a user writes in one file: the tools of a multi-turn episode, and its first messages.

    data:
      environment: calculator_env:Calculator    # module:Class, importable from the spec's folder (as rewards are)
      max_turns: 4                              # the model's turns per episode (rollout.max_tokens each)
      max_episode_tokens: 256                   # sampled + inserted tokens after the prompt, in all
      tool_timeout_s: 5                         # a tool running longer ends its episode

The class, one instance per episode:

    class Calculator:
        def reset(self, prompt, answer, **columns):   # the dataset row -> the first messages, or the user's text
            return prompt
        def add(self, a: int, b: int) -> int:         # a public method with type hints and a docstring is a tool
            '''Add two whole numbers.

            Args:
                a: The first number.
                b: The second number.
            '''
            return a + b
        def step(self, text: str):                    # optional: answer free text (a str or message(s)); None ends
            ...
        def reward(self) -> float:                    # optional: read from the final state, beside the spec's rewards
            ...

Choices, on purpose:

- Tool schemas are OpenAI's tools format, generated from each method's signature and Google-style docstring by
  transformers' `get_json_schema` (what TRL does): a parameter without a type hint or a description is refused, as
  the model could not be told what to pass. `reset`, `step`, `reward` and `close` are not tools.
- The tools reach the model through the chat template's own `tools` (Qwen, Llama 3.1, Hermes templates render
  them). A template that ignores `tools` (SmolLM2's ChatML) gets them the way Qwen2.5's template writes them: a
  `# Tools` block with the schemas in <tools></tools>, appended to the system message (`HERMES_TOOLS`).
- Calls are parsed as the templates ask the model to write them: Hermes/Qwen `<tool_call>{"name", "arguments"}
  </tool_call>` (any number per turn), Mistral's `[TOOL_CALLS][{...}]`, or a turn that is one JSON object
  `{"name", "arguments" | "parameters"}` (Llama 3.1). A call the model writes wrong (not JSON, an unknown tool,
  arguments that do not fit the signature) gets the error as the tool's answer and the episode goes on: it is the
  model's mistake to learn from. A tool that raises, or runs past tool_timeout_s, ends its episode with the error
  as the last observation (`episodes/tool_errors`), never the step: a hung tool's thread is left behind (a daemon).
- Everything that can be checked without a model is checked when the spec is: the import, the class, every tool's
  schema, and one `reset` on the first row of the training and held-out data (`check_environment`). One line
  naming the environment and the row, exit 2.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import InputError

RESERVED = ("reset", "step", "reward", "close")
HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class EnvironmentInputError(InputError):
    """An environment that cannot run as written; the message names the environment, the row and the fix."""


@dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None  # why the call cannot be made as written (the model's mistake), else None


@dataclass
class Environment:
    """A user's environment class, checked: its tools, their schemas, and what else it defines."""

    name: str  # as the spec gives it, 'module:Class'
    cls: type
    tools: list[str]
    schemas: list[dict]
    has_step: bool
    has_reward: bool
    params: dict[str, inspect.Signature] = field(default_factory=dict)  # each tool's signature (bound instance)

    def new(self, where: str) -> Any:
        try:
            return self.cls()
        except (Exception, SystemExit) as e:
            raise EnvironmentInputError(
                f"{where}: data.environment={self.name!r}: {self.cls.__name__}() raised {type(e).__name__}: {e}; "
                "the class must be built with no arguments (one instance per episode)"
            ) from None


def load_environment(name: str, spec_dir: str | Path | None = None) -> Environment:
    """The class 'module:Class' names, imported from the spec's folder or the working directory, with its tools'
    schemas generated; EnvironmentInputError naming what is wrong otherwise."""
    from transformers.utils import get_json_schema  # no torch: the spec is checked before it loads

    from .rewards import add_import_dirs

    where = f"data.environment={name!r}"
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise EnvironmentInputError(f"{where}: expected 'module:Class' (a file module.py beside the spec)")
    add_import_dirs(spec_dir)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise EnvironmentInputError(
                f"{where}: module {module_name!r} not found beside the spec or in the working directory"
            ) from None
        raise EnvironmentInputError(f"{where}: importing {module_name!r} failed: {e}; install what it imports") from e
    except (Exception, SystemExit) as e:  # a module that calls sys.exit() must not end the command silently
        raise EnvironmentInputError(
            f"{where}: importing {module_name!r} raised {type(e).__name__}: {e}; fix the module"
        ) from None
    cls = getattr(module, attr, None)
    if not inspect.isclass(cls):
        what = "nothing" if cls is None else f"a {type(cls).__name__}"
        raise EnvironmentInputError(f"{where}: {module_name}.{attr} is {what}, not a class")
    if not callable(getattr(cls, "reset", None)):
        raise EnvironmentInputError(
            f"{where}: {cls.__name__} has no reset(**row) method giving an episode's first messages (or text)"
        )
    tools = [
        n
        for n, member in inspect.getmembers(cls, inspect.isfunction)
        if not n.startswith("_") and n not in RESERVED and n in _own_names(cls)
    ]
    instance_free = {n: getattr(cls, n) for n in tools}
    schemas, params = [], {}
    for n, fn in instance_free.items():
        bound = fn.__get__(object.__new__(cls))  # a bound method without running __init__: `self` leaves the schema
        try:
            schema = get_json_schema(bound)
        except Exception as e:  # TypeHintParsingException, DocstringParsingException
            raise EnvironmentInputError(
                f"{where}: the tool {n}() cannot be described to the model ({e}); give every parameter a type hint "
                "and the method a docstring with an Args: line per parameter, or start its name with _ if it is "
                "not a tool"
            ) from None
        schema["function"].pop("return", None)
        schemas.append(schema)
        params[n] = inspect.signature(bound, eval_str=True)
    has_step = callable(getattr(cls, "step", None))
    if not tools and not has_step:
        raise EnvironmentInputError(
            f"{where}: {cls.__name__} has no tools (public methods with type hints and a docstring) and no "
            "step(text) method: the model could never act in it"
        )
    return Environment(name, cls, tools, schemas, has_step, callable(getattr(cls, "reward", None)), params)


def _own_names(cls: type) -> set[str]:
    return {n for klass in cls.__mro__ if klass is not object for n in vars(klass)}


def first_messages(env: Environment, instance: Any, row: dict, data, where: str) -> list[dict]:
    """The episode's first messages: reset(**row) — a str is the user's message, as a prompt is (data.system_prompt
    and data.prompt_template apply) — with the tools written into the system message when the template would
    not render them itself (`tools_in_system`)."""
    from .data import chat_messages

    try:
        first = instance.reset(**row)
    except (Exception, SystemExit) as e:
        raise EnvironmentInputError(
            f"{where}: data.environment={env.name!r}: reset() refused the row ({type(e).__name__}: {e}); fix the "
            "row or reset(**row) (it gets prompt, answer and the row's other columns)"
        ) from None
    if isinstance(first, str):
        return chat_messages(first, data)
    if isinstance(first, list) and first and all(isinstance(m, dict) and "role" in m for m in first):
        return chat_messages([dict(m) for m in first], data)
    raise EnvironmentInputError(
        f"{where}: data.environment={env.name!r}: reset() returned {str(first)[:60]!r}; return the user's message "
        'as a string, or chat messages like [{"role": "user", "content": "..."}]'
    )


def with_tools_in_system(messages: list[dict], schemas: list[dict]) -> list[dict]:
    """The messages with HERMES_TOOLS appended to the system message (one added when there is none)."""
    block = HERMES_TOOLS.format(tools="\n".join(json.dumps(s) for s in schemas))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}] + messages[1:]
    return [{"role": "system", "content": block}] + messages


def template_renders_tools(tokenizer, schemas: list[dict]) -> bool:
    """Whether the chat template writes `tools` itself (rendering with them differs from without)."""
    probe = [{"role": "user", "content": "x"}]
    plain = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    return tokenizer.apply_chat_template(probe, tools=schemas, add_generation_prompt=True, tokenize=False) != plain


def row_of(example) -> dict:
    """What reset(**row) receives: prompt, answer and the row's other columns."""
    return {"prompt": example.prompt, "answer": example.answer, **example.columns}


def check_environment(data, spec_dir: str | Path | None, examples: tuple[Sequence, Sequence]) -> Environment:
    """What the spec check can know before a model loads: the class imports, its tools have schemas, and reset
    accepts the first row of the training data (and of the held-out data). Raises EnvironmentInputError."""
    env = load_environment(data.environment, spec_dir)
    for name, rows in zip(("data.source", "held-out data"), examples):
        if rows:
            first_messages(env, env.new(f"{name} row 0"), row_of(rows[0]), data, f"{name} row 0")
    return env


# ------------------------------------------------------------------------ tool calls

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_tool_calls(text: str, env: Environment) -> list[ToolCall]:
    """The calls in one turn of the model (module docstring: the formats); [] when it answered without one."""
    if "<tool_call>" in text:
        bodies = _HERMES.findall(text)
    elif text.lstrip().startswith("[TOOL_CALLS]"):
        bodies = [text.lstrip()[len("[TOOL_CALLS]") :]]
    elif text.strip().startswith("{") and text.strip().endswith("}") and '"name"' in text:
        bodies = [text.strip()]
    else:
        return []
    calls: list[ToolCall] = []
    for body in bodies:
        try:
            parsed = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"the tool call is not JSON ({e.msg}): {body[:80]}"))
            continue
        for item in parsed if isinstance(parsed, list) else [parsed]:
            calls.append(_call_of(item, env))
    return calls


def _call_of(item: Any, env: Environment) -> ToolCall:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return ToolCall("", {}, f'a tool call is {{"name": ..., "arguments": {{...}}}}, not {str(item)[:80]}')
    name = item["name"]
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI's wire format: the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if name not in env.tools:
        return ToolCall(name, {}, f"there is no tool {name!r}; the tools are {', '.join(env.tools) or 'none'}")
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, f"the arguments of {name} must be an object, not {str(arguments)[:60]}")
    try:
        env.params[name].bind(**arguments)
    except TypeError as e:
        return ToolCall(name, arguments, f"{name}{env.params[name]}: {e}")
    return ToolCall(name, arguments)


@dataclass
class ToolResult:
    content: str  # what the tool message says
    failed: bool  # the tool raised or hung: the episode ends here


def run_tool(instance: Any, call: ToolCall, timeout_s: float) -> ToolResult:
    """Run one call on the episode's instance, in a thread with a deadline: its return value as text, or the error."""
    if call.error is not None:
        return ToolResult(f"error: {call.error}", failed=False)
    box: dict = {}

    def target():
        try:
            box["value"] = getattr(instance, call.name)(**call.arguments)
        except BaseException as e:  # noqa: BLE001 — any failure of user code is the observation
            box["error"] = e

    thread = threading.Thread(target=target, name=f"ballast-tool-{call.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return ToolResult(f"error: {call.name} did not return within {timeout_s:g} s (data.tool_timeout_s)", True)
    if "error" in box:
        e = box["error"]
        return ToolResult(f"error: {call.name} raised {type(e).__name__}: {e}", True)
    value = box.get("value")
    return ToolResult(value if isinstance(value, str) else json.dumps(value, default=str), False)
