"""Live multi-turn episodes with an environment (data.environment): token-exact sequences whose loss and logprobs
are on sampled tokens only, tools described from their signatures, calls parsed and run with their errors and
timeouts as observations, budgets, the drift check against a template that re-renders history, refusals before the
model loads, and a resumed run equal to an uninterrupted one.

Real-model tests run the tiny model through the HF engine, with the offline episodes' tool template (a tool role; an
end-of-turn newline that is inserted, not sampled). The tiny model never writes a tool call, so the tool paths of the
runner are driven by `Scripted`, an engine that samples nothing and serves the turns a test writes (their logprobs
-0.5): what a model would write, to check what the runner does with it."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TOOL_TEMPLATE, model_with_template, tiny_spec
from trainer.engines.base import Completion, SamplingParams

REPO = Path(__file__).resolve().parent.parent

# ── schemas, calls and tools: no model ─────────────────────────────────────────────────────────────


def test_public_typed_documented_methods_become_tools_with_openai_schemas():
    from trainer.environment import load_environment

    env = load_environment("tests.environment_fixtures:Calculator")
    assert env.tools == ["add", "divide", "wait"] and env.has_reward and not env.has_step
    assert env.schemas[0] == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two whole numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "integer", "description": "The second number."},
                },
                "required": ["a", "b"],
            },
        },
    }


def test_tool_calls_are_parsed_in_the_hermes_mistral_and_llama_formats():
    from trainer.environment import load_environment, parse_tool_calls

    env = load_environment("tests.environment_fixtures:Calculator")
    two = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' + (
        '<tool_call>{"name": "divide", "arguments": "{\\"a\\": 6, \\"b\\": 3}"}</tool_call>'
    )
    assert [(c.name, c.arguments, c.error) for c in parse_tool_calls(two, env)] == [
        ("add", {"a": 1, "b": 2}, None),
        ("divide", {"a": 6, "b": 3}, None),
    ]
    mistral = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 4, "b": 5}}]'
    llama = '{"name": "add", "parameters": {"a": 7, "b": 8}}'
    assert [c.arguments for c in parse_tool_calls(mistral, env) + parse_tool_calls(llama, env)] == [
        {"a": 4, "b": 5},
        {"a": 7, "b": 8},
    ]
    assert parse_tool_calls("The answer is 3.", env) == []


@pytest.mark.parametrize(
    "text, error",
    [
        ("<tool_call>{add(1, 2)}</tool_call>", "the tool call is not JSON"),
        (
            '<tool_call>{"name": "mul", "arguments": {}}</tool_call>',
            "there is no tool 'mul'; the tools are add, divide",
        ),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "add(a: int, b: int) -> int: missing a"),
    ],
)
def test_a_call_written_wrong_gets_the_error_as_its_result_and_the_episode_goes_on(text, error):
    from trainer.environment import load_environment, parse_tool_calls, run_tool

    env = load_environment("tests.environment_fixtures:Calculator")
    [call] = parse_tool_calls(text, env)
    result = run_tool(env.new("row 0"), call, timeout_s=1)
    assert error in result.content and result.content.startswith("error: ") and not result.failed


def test_a_tool_that_raises_or_hangs_fails_with_the_error_as_its_result():
    from trainer.environment import ToolCall, load_environment, run_tool

    env = load_environment("tests.environment_fixtures:Calculator")
    instance = env.new("row 0")
    raised = run_tool(instance, ToolCall("divide", {"a": 1, "b": 0}), timeout_s=5)
    assert raised.failed and raised.content == "error: divide raised ZeroDivisionError: division by zero"
    hung = run_tool(instance, ToolCall("wait", {"seconds": 30}), timeout_s=0.2)
    assert hung.failed and hung.content == "error: wait did not return within 0.2 s (data.tool_timeout_s)"
    assert run_tool(instance, ToolCall("add", {"a": 2, "b": 3}), timeout_s=5).content == "5"


# ── refused with the spec, before a model loads ───────────────────────────────────────────────────


@pytest.mark.parametrize(
    "environment, message",
    [
        ("tests.no_such_module:Env", "module 'tests.no_such_module' not found beside the spec"),
        ("tests.environment_fixtures:Nope", "tests.environment_fixtures.Nope is nothing, not a class"),
        ("tests.environment_fixtures:Untyped", "the tool add() cannot be described to the model"),
        (
            "tests.environment_fixtures:Picky",
            "data.source row 0: data.environment='tests.environment_fixtures:Picky':"
            " reset() refused the row (ValueError: cannot read",
        ),
    ],
    ids=["not importable", "no such class", "untyped tool", "reset rejects the first row"],
)
def test_an_environment_that_cannot_run_is_refused_with_the_spec_in_one_line(environment, message):
    from tasks.spec import SpecError, load_spec

    spec = tiny_spec("m", data={"environment": environment})
    with pytest.raises(SpecError) as e:
        load_spec(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_ballast_validate_refuses_a_tool_without_type_hints_with_exit_2(tmp_path):
    spec = tiny_spec("m", data={"environment": "tests.environment_fixtures:Untyped"})
    (tmp_path / "spec.yaml").write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "validate", str(tmp_path / "spec.yaml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "the tool add() cannot be described to the model" in done.stderr
    assert len([line for line in done.stderr.splitlines() if line.strip()]) == 1


# ── episodes on the tiny model ────────────────────────────────────────────────────────────────────


def with_template(tool_model, tmp_path, template: str) -> Path:
    return model_with_template(tool_model, tmp_path / "model", template)


@pytest.fixture(scope="module")
def policy(tool_model):
    from trainer.config import LoraConfig, ModelConfig
    from trainer.model import load_policy

    return load_policy(ModelConfig(name_or_path=str(tool_model), device="cpu"), LoraConfig(r=8, alpha=16))


def runner_for(tokenizer, environment, max_tokens=32, **data):
    from trainer.config import DataConfig
    from trainer.episodes import EpisodeRunner

    return EpisodeRunner.from_config(DataConfig(environment=environment, **data), tokenizer, max_tokens)


def arith(n=2):
    from trainer.data import arith_examples

    return arith_examples(n, seed=3)


def pieces(c: Completion) -> list[tuple[int, list[int]]]:
    """The completion's tokens as runs of (loss mask value, ids)."""
    out = []
    for t, m in zip(c.token_ids, c.loss_mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


def test_an_episode_is_its_sampled_turns_and_the_inserted_messages_between_them(policy):
    from trainer.engines.hf import HFEngine, _eos_ids

    model, tokenizer = policy
    runner = runner_for(tokenizer, "tests.environment_fixtures:CheckAgain", max_turns=3)
    params = SamplingParams(n=2, max_tokens=32, seeds=[11, 12])
    groups = runner.run(HFEngine(model, tokenizer, "cpu"), arith(), params)
    inserted = tokenizer.encode("\n<|user|>Check again.<|assistant|>", add_special_tokens=False)
    for example, group in zip(arith(), groups):
        for c in group:
            prompt = f"<s>You add numbers.\n<|user|>{example.prompt}<|assistant|>"
            assert c.prompt_ids == tokenizer.encode(prompt, add_special_tokens=False)
            runs = pieces(c)
            n = c.episode["turns"]  # up to 3: the model's turns, an inserted message after each but the last
            assert [m for m, _ in runs] == [1, 0] * (n - 1) + [1]
            assert all(ids == inserted for m, ids in runs if not m)
            turns = [ids for m, ids in runs if m]
            assert all(ids[-1] in _eos_ids(model, tokenizer) for ids in turns[:-1])  # the model ended each turn
            assert (turns[-1][-1] in _eos_ids(model, tokenizer)) == (c.finish_reason == "stop")  # or ran out
            assert [math.isfinite(lp) for lp in c.logprobs] == [bool(m) for m in c.loss_mask]
            assert c.text == tokenizer.decode(runs[-1][1], skip_special_tokens=True)
            cut = c.episode["cut"]  # a stop ends the episode; a turn that runs out cuts it, as may the 3rd turn's end
            assert (
                cut is None
                if c.finish_reason == "stop"
                else cut in (("max_tokens",) if n < 3 else ("max_tokens", "max_turns"))
            )
            assert c.episode["drift"] is False  # this template re-renders the history as it was sent
    # the tiny model (built on the machine running the tests) ends its first turn; how long it goes on after "Check
    # again." depends on that build, so the test asks for episodes of more than one turn, not for exactly three
    assert max(c.episode["turns"] for group in groups for c in group) >= 2
    assert groups[0][0].token_ids != groups[0][1].token_ids  # the group's episodes are sampled apart


def test_an_episode_is_the_same_whatever_shares_its_batch(policy):
    from trainer.engines.hf import HFEngine

    model, tokenizer = policy
    runner = runner_for(tokenizer, "tests.environment_fixtures:CheckAgain", max_turns=3)
    engine = HFEngine(model, tokenizer, "cpu")
    together = runner.run(engine, arith(2), SamplingParams(n=2, max_tokens=32, seeds=[11, 12]))
    alone = runner.run(engine, arith(2)[1:], SamplingParams(n=2, max_tokens=32, seeds=[12]))
    assert [c.token_ids for c in alone[0]] == [c.token_ids for c in together[1]]
    for a, b in zip(alone[0], together[1]):
        assert a.logprobs == pytest.approx(b.logprobs, nan_ok=True, abs=1e-5)


@pytest.mark.parametrize(
    "data, max_tokens, cut, turns",
    [
        ({"max_turns": 1}, 32, "max_turns", 1),  # the tiny model ends its first turn: the environment wants more
        ({"max_turns": 3, "max_episode_tokens": 30}, 32, "max_episode_tokens", None),
        ({"max_turns": 3}, 2, "max_tokens", 1),
    ],
    ids=["turns", "episode tokens", "turn tokens"],
)
def test_a_budget_cuts_the_episode_as_a_truncated_completion(policy, data, max_tokens, cut, turns):
    from trainer.engines.hf import HFEngine

    model, tokenizer = policy
    runner = runner_for(tokenizer, "tests.environment_fixtures:CheckAgain", **data)
    runner.max_tokens = max_tokens
    [[c]] = runner.run(HFEngine(model, tokenizer, "cpu"), arith(1), SamplingParams(n=1, max_tokens=32, seeds=[5]))
    assert c.finish_reason == "length" and c.episode["cut"] == cut
    if turns is not None:
        assert c.episode["turns"] == turns
    if "max_episode_tokens" in data:
        assert len(c.token_ids) <= data["max_episode_tokens"]
    assert c.loss_mask[-1] == 1  # an episode never ends on inserted tokens: they would be trained on as context only


RERENDER_ASSISTANT = TOOL_TEMPLATE.replace(
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}",
    "{% elif message['role'] == 'assistant' %}<|assistant|>"
    "{{ message['content'] if loop.index0 >= ns.last else message['content'] | upper }}",
).replace(
    "{% for message in messages %}",
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for message in messages %}",
    1,
)
# a user message answering the model is written with a trailing space once more follows (as Qwen's template closes a
# tool message differently when another follows): the last one, as it was sent, without
RERENDER_USER = TOOL_TEMPLATE.replace(
    "<|user|>{{ message['content'] }}{% elif",
    "<|user|>{{ message['content'] }}"
    "{{ ' ' if loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'assistant' and not loop.last else '' }}"
    "{% elif",
)


def test_drift_is_reported_when_the_template_re_renders_inserted_messages_differently(tool_model, tmp_path):
    from transformers import AutoTokenizer

    from trainer.config import LoraConfig, ModelConfig
    from trainer.engines.hf import HFEngine
    from trainer.episodes import episode_metrics
    from trainer.model import load_policy

    path = with_template(tool_model, tmp_path, RERENDER_USER)
    model, tokenizer = load_policy(ModelConfig(name_or_path=str(path), device="cpu"), LoraConfig(r=8, alpha=16))
    assert isinstance(tokenizer, type(AutoTokenizer.from_pretrained(path)))
    runner = runner_for(tokenizer, "tests.environment_fixtures:CheckAgain", max_turns=2)
    [group] = runner.run(HFEngine(model, tokenizer, "cpu"), arith(1), SamplingParams(n=2, max_tokens=32, seeds=[5]))
    for c in group:  # trained as sent: the inserted message as the template wrote it when it was the last one
        assert pieces(c)[1][1] == tokenizer.encode("\n<|user|>Check again.<|assistant|>", add_special_tokens=False)
    assert all(c.episode["drift"] for c in group)
    assert episode_metrics(group)["episodes/drift"] == 1.0


def test_a_template_that_rewrites_the_models_earlier_turns_is_refused_naming_the_environment_and_row(
    tool_model, tmp_path
):
    from trainer.config import LoraConfig, ModelConfig
    from trainer.engines.hf import HFEngine
    from trainer.environment import EnvironmentInputError
    from trainer.model import load_policy

    path = with_template(tool_model, tmp_path, RERENDER_ASSISTANT)
    model, tokenizer = load_policy(ModelConfig(name_or_path=str(path), device="cpu"), LoraConfig(r=8, alpha=16))
    runner = runner_for(tokenizer, "tests.environment_fixtures:CheckAgain", max_turns=2)
    with pytest.raises(EnvironmentInputError) as e:
        runner.run(HFEngine(model, tokenizer, "cpu"), arith(1), SamplingParams(n=1, max_tokens=32, seeds=[5]))
    message = str(e.value)
    assert message.startswith("row 0: data.environment='tests.environment_fixtures:CheckAgain': re-rendered, the ")
    assert "no longer holds the model's turn 1 as it sampled it" in message and "\n" not in message


def test_a_template_that_cannot_render_the_tools_is_refused_before_the_first_rollout(tool_model, tmp_path):
    from transformers import AutoTokenizer

    from trainer.environment import EnvironmentInputError

    path = with_template(tool_model, tmp_path, "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}")
    with pytest.raises(EnvironmentInputError, match="the model's chat template cannot render the tools' schemas"):
        runner_for(AutoTokenizer.from_pretrained(path), "tests.environment_fixtures:Calculator")


# ── the tool paths, with turns written by the test ────────────────────────────────────────────────


class Scripted:
    """An engine that serves, for each call, the next turn of `turns` to every prompt (logprobs -0.5)."""

    name = "scripted"
    overlaps_training = False

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.prompts = tokenizer, list(turns), []

    def generate(self, prompts, params):
        self.prompts.append([list(p) for p in prompts])
        text = self.turns.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        c = Completion(prompt_ids=[], token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", text=text)
        return [[c] for _ in prompts]


CALL = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'.format


def test_tool_results_are_appended_as_tool_messages_and_only_the_models_turns_carry_loss(policy):
    _, tokenizer = policy
    runner = runner_for(tokenizer, "tests.environment_fixtures:Calculator", 256, max_turns=3)
    engine = Scripted(tokenizer, [CALL("add", '{"a": 23, "b": 58}'), "<output>81</output>"])
    [[c]] = runner.run(engine, arith(1), SamplingParams(n=1, max_tokens=32, seeds=[1]))
    assert c.prompt_ids == tokenizer.encode(
        f"<s>Tools: add, divide, wait\n<|user|>{arith(1)[0].prompt}<|assistant|>", add_special_tokens=False
    )
    runs = pieces(c)
    assert [m for m, _ in runs] == [1, 0, 1]
    assert tokenizer.decode(runs[1][1]) == "\n<|user|>[tool] 81<|assistant|>"
    assert engine.prompts[1] == [c.prompt_ids + runs[0][1] + runs[1][1]]  # turn 2 was sampled from exactly these
    assert c.episode["messages"][-2] == {"role": "tool", "name": "add", "content": "81", "tool_call_id": "call_0_0"}
    assert (c.episode["tool_calls"], c.episode["tool_errors"], c.episode["environment_reward"]) == (1, 0, 0.5)
    assert [lp == -0.5 for lp in c.logprobs] == [bool(m) for m in c.loss_mask]


def test_a_tool_that_raises_ends_its_episode_with_the_error_and_the_batch_goes_on(policy):
    from trainer.episodes import conversation_text, episode_metrics

    _, tokenizer = policy
    runner = runner_for(tokenizer, "tests.environment_fixtures:Calculator", 256, max_turns=3, tool_timeout_s=0.2)
    engine = Scripted(tokenizer, [CALL("divide", '{"a": 1, "b": 0}')])
    [[c]] = runner.run(engine, arith(1), SamplingParams(n=1, max_tokens=32, seeds=[1]))
    assert c.loss_mask == [1] * len(c.token_ids) and c.finish_reason == "stop"  # one turn; the error is not trained on
    assert c.episode["messages"][-1]["content"] == "error: divide raised ZeroDivisionError: division by zero"
    assert episode_metrics([c])["episodes/tool_errors"] == 1.0
    assert conversation_text(c).splitlines()[-2:] == [
        '[assistant | loss] <tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>',
        "[tool divide] error: divide raised ZeroDivisionError: division by zero",
    ]
    hung = Scripted(tokenizer, [CALL("wait", '{"seconds": 30}')])
    [[c]] = runner.run(hung, arith(1), SamplingParams(n=1, max_tokens=32, seeds=[1]))
    assert c.episode["tool_errors"] == 1 and "did not return within 0.2 s" in c.episode["messages"][-1]["content"]


def test_a_model_that_keeps_calling_tools_is_cut_by_max_turns(policy):
    _, tokenizer = policy
    runner = runner_for(tokenizer, "tests.environment_fixtures:Calculator", 256, max_turns=2)
    engine = Scripted(tokenizer, [CALL("add", '{"a": 1, "b": 2}'), CALL("add", '{"a": 3, "b": 4}')])
    [[c]] = runner.run(engine, arith(1), SamplingParams(n=1, max_tokens=32, seeds=[1]))
    assert c.finish_reason == "length" and c.episode["cut"] == "max_turns" and c.episode["tool_calls"] == 2
    assert c.loss_mask[-1] == 1


# ── training, eval and resume ─────────────────────────────────────────────────────────────────────


def env_trainer(model_path, out, **sections):
    from trainer.config import TrainerConfig
    from trainer.loop import GRPOTrainer

    defaults = {
        "data": {
            "num_prompts": 16,
            "num_eval_prompts": 2,
            "environment": "tests.environment_fixtures:CheckAgain",
            "max_turns": 2,
        },
        "rollout": {"max_tokens": 32, "log_samples": 2},
        "optim": {"steps": 2, "learning_rate": 1e-3},
        "checkpoint": {"every": 1, "keep_last": 5},
        "eval": {"every": 0, "on_start": True, "max_tokens": 32},
    }
    for name, value in sections.items():
        defaults[name] = {**defaults.get(name, {}), **value}
    return GRPOTrainer(TrainerConfig.model_validate(tiny_spec(model_path, **defaults)), out, progress=False)


def test_a_step_on_episodes_trains_on_sampled_tokens_and_reports_episodes(tool_model, tmp_path):
    from trainer.records import read_rows

    t = env_trainer(tool_model, tmp_path)
    result = t.train(1)
    t.close()
    m = result.history[0]
    assert m["sampling/frac_logprobs_valid"] == 1.0
    assert m["sampling/sampling_logp_difference/max"] < 1e-4  # engine and trainer agree on every sampled token
    assert m["episodes/turns_mean"] == 2.0 and m["episodes/cut_by_budget"] == 1.0  # CheckAgain outlasts max_turns=2
    assert m["episodes/tool_calls_mean"] == 0.0 and m["episodes/drift"] == 0.0
    assert result.eval_start["eval/episodes/turns_mean"] == 2.0  # the held-out rows ran the same environment
    rows = read_rows(tmp_path / "samples.jsonl")
    assert len(rows) == 2 and all("[user] Check again.\n[assistant | loss] " in r["conversation"] for r in rows)


def test_a_resumed_run_with_episodes_in_flight_equals_an_uninterrupted_one(tool_model, tmp_path):
    sections = {"rollout": {"max_off_policy_steps": 1}, "eval": {"on_start": False}}
    straight = env_trainer(tool_model, tmp_path / "straight", **sections)
    straight_history = straight.train(2).history
    straight.close()
    first = env_trainer(tool_model, tmp_path / "resumed", **sections)
    first.train(1)  # the batch of step 2, sampled ahead, is saved in the checkpoint with its episodes
    first.close()
    resumed = env_trainer(tool_model, tmp_path / "resumed", **sections)
    assert resumed.resume().name == "step-000001"
    assert resumed.rollouts.made[2].result().completions[0].episode["turns"] == 2
    again = resumed.train(2).history
    resumed.close()
    for name in ("loss", "reward", "completions/mean_length", "episodes/turns_mean", "grad_norm"):
        assert again[0][name] == pytest.approx(straight_history[1][name], abs=1e-6), name
    straight_samples = (tmp_path / "straight" / "samples.jsonl").read_text().splitlines()
    assert (tmp_path / "resumed" / "samples.jsonl").read_text().splitlines() == straight_samples
