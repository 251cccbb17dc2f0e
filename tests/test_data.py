"""trainer/data.py: built-in sources, .jsonl files, the prompt template and system prompt, render_prompt."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.spec import SpecError, load_spec
from trainer.config import DataConfig, RewardConfig
from trainer.data import SOURCES, chat_messages, load_datasets, read_jsonl, render_prompt, reward_columns
from trainer.rewards import check_rewards, numbers_in

REPO = Path(__file__).resolve().parent.parent
# SmolLM2's ChatML template, shortened: with no system message of ours it inserts its own default one
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are SmolLM.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level tokenizer (every byte one token) with the ChatML template, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({ch: len(specials) + b for b, ch in bytes_to_unicode().items()})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", chat_template=CHATML)


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


# --- rendering ------------------------------------------------------------------------------


def test_without_system_prompt_or_template_the_prompt_is_the_only_message(tokenizer):
    only_message = tokenizer.apply_chat_template([{"role": "user", "content": "23+58"}], add_generation_prompt=True)
    assert render_prompt(tokenizer, "23+58") == list(
        only_message["input_ids"] if "input_ids" in only_message else only_message
    )
    assert render_prompt(tokenizer, "23+58", DataConfig()) == render_prompt(tokenizer, "23+58")
    assert (
        tokenizer.decode(render_prompt(tokenizer, "23+58"))
        == "<|im_start|>system\nYou are SmolLM.<|im_end|>\n<|im_start|>user\n23+58<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_wraps_the_prompt_in_the_user_message(tokenizer):
    data = DataConfig(prompt_template="What is {prompt}? Answer with just the number.")
    assert tokenizer.decode(render_prompt(tokenizer, "23 + 58", data)).endswith(
        "<|im_start|>user\nWhat is 23 + 58? Answer with just the number.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_system_prompt_replaces_the_templates_default(tokenizer):
    data = DataConfig(system_prompt="You are a calculator.", prompt_template="{prompt} =")
    assert tokenizer.decode(render_prompt(tokenizer, "2 + 2", data)) == (
        "<|im_start|>system\nYou are a calculator.<|im_end|>\n"
        "<|im_start|>user\n2 + 2 =<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_messages_are_system_then_user():
    data = DataConfig(system_prompt="Be brief.", prompt_template="Q: {prompt}")
    assert chat_messages("hi", data) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: hi"},
    ]
    assert chat_messages("hi") == [{"role": "user", "content": "hi"}]


def test_braces_in_a_prompt_are_kept_as_they_are():
    assert chat_messages("f(x) = {x}", DataConfig(prompt_template="Solve {prompt}"))[0]["content"] == "Solve f(x) = {x}"


def test_doubled_braces_in_a_template_are_literal():
    assert chat_messages("1 + 1", DataConfig(prompt_template="{{json}}: {prompt}"))[0]["content"] == "{json}: 1 + 1"


@pytest.mark.parametrize("template, found", [("What is it?", "none"), ("{prompt} {answer}", "answer"), ("{0}", "0")])
def test_template_needs_prompt_and_nothing_else(template, found):
    with pytest.raises(ValueError, match=rf"must contain {{prompt}} and no other field \(found {found}\)"):
        DataConfig(prompt_template=template)


def test_unbalanced_brace_in_a_template_is_refused():
    with pytest.raises(ValueError, match=r"not a format string .*literal braces as \{\{ \}\}"):
        DataConfig(prompt_template="{prompt} {")


# --- built-in sources -----------------------------------------------------------------------


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_builtin_sources_are_seeded(source):
    cfg = DataConfig(source=source, num_prompts=20, num_eval_prompts=10, seed=3)
    assert load_datasets(cfg) == load_datasets(cfg)
    assert load_datasets(cfg)[0] != load_datasets(cfg.model_copy(update={"seed": 4}))[0]


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_builtin_eval_set_is_held_out(source):
    train, held_out = load_datasets(DataConfig(source=source, num_prompts=200, num_eval_prompts=50))
    assert len(train) == 200 and len(held_out) == 50
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}


def test_sums_are_two_operands_with_their_sum():
    train, _ = load_datasets(DataConfig(source="sums", num_prompts=100))
    for e in train:
        a, b = numbers_in(e.prompt)
        assert e.prompt == f"{a:.0f} + {b:.0f}" and 10 <= a <= 99 and 10 <= b <= 99 and e.answer == f"{a + b:.0f}"


def test_word_problem_answers_follow_from_their_numbers():
    """Two amounts: the answer is their sum; three: the first two added, the third taken away."""
    train, _ = load_datasets(DataConfig(source="word_problems", num_prompts=300))
    for e in train:
        found = numbers_in(e.prompt)
        want = found[0] + found[1] - (found[2] if len(found) == 3 else 0)
        assert float(e.answer) == want and want > 0, e


def test_quickstart_arith_data_is_unchanged():
    train, held_out = load_datasets(DataConfig(num_prompts=3, num_eval_prompts=2))
    assert [(e.prompt, e.answer) for e in train] == [("49+97", "146"), ("53+5", "58"), ("33+65", "98")]
    assert [(e.prompt, e.answer) for e in held_out] == [("66+84", "150"), ("40+66", "106")]  # as before templates


# --- .jsonl files ---------------------------------------------------------------------------


def test_jsonl_reads_prompt_and_answer_with_numbers_as_text(tmp_path):
    path = write_lines(
        tmp_path / "d.jsonl", '{"prompt": "2 + 2", "answer": 4}', "", '{"prompt": "name?", "answer": "Ballast"}'
    )
    assert [(e.prompt, e.answer) for e in read_jsonl(path)] == [("2 + 2", "4"), ("name?", "Ballast")]


def test_jsonl_line_that_is_a_list_names_file_and_line(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", '{"prompt": "a", "answer": "1"}', '["b", "2"]')
    with pytest.raises(ValueError, match=rf"^{path}:2 is a JSON list, not an object"):
        read_jsonl(path)


def test_jsonl_line_without_prompt_names_file_line_and_fields(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", '{"question": "b", "answer": "2"}')
    with pytest.raises(ValueError, match=rf"^{path}:1 has no 'prompt' field \(it has answer, question\)"):
        read_jsonl(path)


def test_jsonl_line_that_is_not_json_names_file_and_line(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", '{"prompt": "a"}', "{prompt: b}")
    with pytest.raises(ValueError, match=rf"^{path}:2 is not JSON"):
        read_jsonl(path)


def test_jsonl_prompt_must_be_a_string_or_messages(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", '{"prompt": 5}')
    with pytest.raises(ValueError, match=rf"^{path}:1: 'prompt' is a int; give the user's message as a string"):
        read_jsonl(path)
    path = write_lines(tmp_path / "d.jsonl", '{"prompt": ["a"]}')
    with pytest.raises(ValueError, match=rf"^{path}:1: 'prompt'\[0\] is \"a\", not a message with a string 'role'"):
        read_jsonl(path)


def test_missing_data_file_names_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.eval_path: data file .*nope.jsonl does not exist"):
        load_datasets(
            DataConfig(
                source=str(write_lines(tmp_path / "d.jsonl", '{"prompt": "a"}')), eval_path=str(tmp_path / "nope.jsonl")
            )
        )


def test_unknown_source_names_the_builtins():
    with pytest.raises(
        ValueError, match=r"data.source='sum' is neither a built-in source \(arith, sums, word_problems\)"
    ):
        load_datasets(DataConfig(source="sum"))


# --- checked at spec validation, before torch -------------------------------------------------


def test_bad_data_file_fails_the_spec_with_file_and_line(tmp_path):
    data = write_lines(tmp_path / "d.jsonl", '{"prompt": "a", "answer": "1"}', "[1, 2]")
    with pytest.raises(SpecError, match=rf"^spec: {data}:2 is a JSON list, not an object"):
        load_spec({"model": {"name_or_path": "m"}, "data": {"source": str(data)}})


def test_bad_data_file_fails_before_torch_is_imported(tmp_path):
    data = write_lines(tmp_path / "d.jsonl", '{"answer": "1"}')
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"model: {{name_or_path: m}}\ndata: {{source: {data}}}\n")
    code = (
        "import sys\nfrom tasks.spec import SpecError, load_spec\ntry:\n    load_spec(sys.argv[1])\n"
        "except SpecError as e:\n    print(e)\nprint(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(spec)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == [
        f"{spec}: {data}:1 has no 'prompt' field (it has answer); add the user's message as 'prompt' (or the "
        "conversation as 'messages')",
        "[]",
    ], out.stderr


def test_shipped_smollm2_example_has_a_held_out_task_rendered_through_its_template():
    """The task sections of examples/smollm2.yaml (its model section belongs to the model build)."""
    spec = yaml.safe_load((REPO / "examples" / "smollm2.yaml").read_text())
    data = DataConfig(**spec["data"])
    train, held_out = load_datasets(data)
    assert len(train) == data.num_prompts and len(held_out) == data.num_eval_prompts
    messages = chat_messages(train[0].prompt, data)
    assert messages[0] == {"role": "system", "content": data.system_prompt}
    assert messages[1]["content"] == data.prompt_template.format(prompt=train[0].prompt) != train[0].prompt
    assert check_rewards([RewardConfig(**r) for r in spec["rewards"]], spec["eval"].get("reward")) == "numeric_answer"


# --- issue 23: the rows a researcher has ----------------------------------------------------------------------


def test_chat_messages_rows_are_conversations_and_a_last_assistant_turn_is_the_answer(tmp_path):
    rows = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Peru?"}]},
        {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"}]},
        {"prompt": [{"role": "user", "content": "Capital of Chile?"}], "answer": "Santiago"},  # TRL's chat prompt
    ]
    path = write_lines(tmp_path / "d.jsonl", *map(json.dumps, rows))
    assert [(e.prompt, e.answer) for e in read_jsonl(path)] == [
        (rows[0]["messages"], ""),
        ([{"role": "user", "content": "Capital of France?"}], "Paris"),
        (rows[2]["prompt"], "Santiago"),
    ]


def test_a_conversation_renders_through_the_chat_template_as_it_is(tokenizer):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Peru?"}]
    assert tokenizer.decode(render_prompt(tokenizer, conversation)) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of Peru?<|im_end|>\n<|im_start|>assistant\n"
    )
    user_only = conversation[1:]
    assert chat_messages(user_only, DataConfig(system_prompt="Answer in one word.")) == [
        {"role": "system", "content": "Answer in one word."},
        *user_only,
    ]


@pytest.mark.parametrize(
    "row, fragment",
    [
        ({"messages": [{"role": "user", "content": "a"}], "prompt": "b"}, "has both 'prompt' and 'messages'"),
        ({"messages": [{"role": "assistant", "content": "a"}]}, "'messages' must end with a user message"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "answer": "c"},
            "ends with an assistant message and the row has an 'answer' too",
        ),
        ({"messages": []}, "'messages' is an empty list"),
        ({"prompt": "a", "answer": []}, "'answer' is an empty list"),
        ({"prompt": "a", "answer": ["x", {"y": 1}]}, "'answer'[1] is a dict"),
        ({"prompt": "a", "answers": "x"}, "a column may not be named 'answers'"),
    ],
)
def test_a_bad_row_is_refused_naming_file_and_line(row, fragment, tmp_path):
    path = write_lines(tmp_path / "d.jsonl", json.dumps(row))
    with pytest.raises(ValueError, match=rf"^{path}:1") as e:
        read_jsonl(path)
    assert fragment in str(e.value)


def test_a_template_cannot_apply_to_conversations(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", json.dumps({"messages": [{"role": "user", "content": "a"}]}))
    with pytest.raises(ValueError, match="^data.prompt_template applies to string prompts"):
        load_datasets(DataConfig(source=str(path), prompt_template="Q: {prompt}"))


def test_a_list_of_accepted_answers_is_kept_as_texts(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", '{"prompt": "Capital of Peru?", "answer": ["Lima", "Lima, Peru", 7]}')
    assert read_jsonl(path)[0].answer == ["Lima", "Lima, Peru", "7"]


def test_other_columns_are_kept_for_the_rewards_and_a_missing_one_is_none(tmp_path):
    path = write_lines(
        tmp_path / "d.jsonl",
        '{"prompt": "a", "answer": "1", "country": "Peru", "difficulty": 2}',
        '{"prompt": "b", "answer": "2", "country": "Chile"}',
    )
    examples = read_jsonl(path)
    assert [e.columns for e in examples] == [
        {"country": "Peru", "difficulty": 2},
        {"country": "Chile", "difficulty": None},
    ]
    assert reward_columns(examples, repeat=2) == {
        "country": ["Peru", "Peru", "Chile", "Chile"],
        "difficulty": [2, 2, None, None],
    }


def test_a_parquet_file_and_a_saved_datasets_directory_are_read_like_jsonl(tmp_path):
    import datasets

    rows = [
        {"prompt": "Capital of Peru?", "answer": ["Lima"], "country": "Peru"},
        {"prompt": "Capital of Chile?", "answer": ["Santiago"], "country": "Chile"},
    ]
    want = [(r["prompt"], r["answer"], {"country": r["country"]}) for r in rows]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table, "test": table.select([1])}).save_to_disk(str(tmp_path / "splits"))
    read = lambda examples: [(e.prompt, e.answer, e.columns) for e in examples]  # noqa: E731
    assert read(load_datasets(DataConfig(source=str(tmp_path / "d.parquet")))[0]) == want
    assert read(load_datasets(DataConfig(source=str(tmp_path / "saved")))[0]) == want
    train, held_out = load_datasets(DataConfig(source=str(tmp_path / "splits"), eval_path=str(tmp_path / "splits")))
    assert (read(train), read(held_out)) == (want, want[1:])
    with pytest.raises(
        ValueError, match=r"^data.split='validation': the DatasetDict at .*splits has the splits train, test"
    ):
        load_datasets(DataConfig(source=str(tmp_path / "splits"), split="validation"))


def test_a_data_path_is_found_from_the_spec_folder_whatever_the_working_directory(tmp_path):
    folder = tmp_path / "task"
    folder.mkdir()
    write_lines(folder / "train.jsonl", '{"prompt": "a", "answer": "1"}')
    write_lines(folder / "held_out.jsonl", '{"prompt": "b", "answer": "2"}')
    (folder / "spec.yaml").write_text(
        "model: {name_or_path: m}\ndata: {source: train.jsonl, eval_path: held_out.jsonl}\n"
        "rewards: [{name: exact_answer}]\n"
    )
    code = (
        "import sys\nfrom tasks.spec import load_spec\ns = load_spec(sys.argv[1]).data\nprint(s.source, s.eval_path)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "task/spec.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert out.stdout.split() == [str(folder / "train.jsonl"), str(folder / "held_out.jsonl")], out.stderr


def test_a_data_path_in_neither_place_names_both(tmp_path):
    (tmp_path / "spec.yaml").write_text("model: {name_or_path: m}\ndata: {source: nowhere.jsonl}\n")
    with pytest.raises(SpecError, match=r"data.source: data file 'nowhere.jsonl' is neither in the spec's folder \("):
        load_spec(tmp_path / "spec.yaml")


def test_columns_reach_the_reward_in_training_steps_and_evals(tiny_model, tmp_path):
    from tasks.spec import load_spec as load
    from tests import reward_fixtures
    from tests.conftest import tiny_spec
    from trainer.loop import GRPOTrainer

    rows = [json.dumps({"prompt": f"{a}+{a}", "answer": str(2 * a), "country": f"c{a}"}) for a in range(1, 9)]
    write_lines(tmp_path / "train.jsonl", *rows)
    write_lines(tmp_path / "held_out.jsonl", *rows[:2])
    spec = load(
        tiny_spec(
            tiny_model,
            data={"source": str(tmp_path / "train.jsonl"), "eval_path": str(tmp_path / "held_out.jsonl")},
            rewards=[{"name": "exact_answer"}, {"name": "tests.reward_fixtures:echo_columns"}],
            optim={"steps": 1},
            eval={"every": 1, "max_tokens": 8},
        )
    )
    reward_fixtures.SEEN.clear()
    trainer = GRPOTrainer(spec.trainer_config(), tmp_path / "run", progress=False)
    trainer.train()
    trainer.close()
    step, evaluation = reward_fixtures.SEEN
    prompts = [p for i, p in enumerate(step["prompts"]) if i % 4 == 0]  # 2 prompts x 4 completions
    assert step["country"] == [f"c{p.split('+')[0]}" for p in prompts for _ in range(4)]
    assert evaluation["country"] == ["c1", "c2"]


def test_a_built_in_source_takes_its_held_out_prompts_from_eval_path_when_given(tmp_path):
    """data.eval_path beside a built-in source was ignored: the run scored on prompts it drew instead."""
    held_out = write_lines(tmp_path / "held_out.jsonl", '{"prompt": "What is 40+2?", "answer": "42"}')
    train, drawn = load_datasets(DataConfig(source="arith", num_prompts=8, num_eval_prompts=4))
    train_too, given = load_datasets(DataConfig(source="arith", num_prompts=8, eval_path=str(held_out)))
    assert [e.prompt for e in given] == ["What is 40+2?"] and len(drawn) == 4
    assert [e.prompt for e in train_too] == [e.prompt for e in train]  # the training prompts are the source's still
