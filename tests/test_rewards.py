"""trainer/rewards.py: the built-in rewards, resolving 'module:function', and RewardComputer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.spec import SpecError, load_spec
from trainer.config import RewardConfig
from trainer.data import Example
from trainer.rewards import REGISTRY, RewardComputer, RewardError, check_rewards, is_correctness, register, resolve

REPO = Path(__file__).resolve().parent.parent


def score(name: str, completions: list[str], answers: list[str] | None = None, **kwargs) -> list[float]:
    fn = resolve(RewardConfig(name=name, kwargs=kwargs))
    answers = answers if answers is not None else [""] * len(completions)
    return fn(completions=completions, answers=answers, prompts=["p"] * len(completions))


# --- built-ins ------------------------------------------------------------------------------


def test_exact_answer_compares_stripped_tag_content():
    completions = ["<output>81</output>", "<output> 81 \n</output>", "<output>18</output>", "81", "<output>81"]
    assert score("exact_answer", completions, ["81"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_exact_answer_uses_the_first_tag_pair():
    assert score("exact_answer", ["<output>1</output><output>81</output>"], ["81"]) == [0.0]


def test_exact_answer_tag_is_configurable():
    assert score("exact_answer", ["<answer>7</answer>", "<output>7</output>"], ["7", "7"], tag="answer") == [1.0, 0.0]


def test_regex_answer_compares_the_first_group():
    completions = ["The answer is 81.", "answer is  81 ", "The answer is 18", "no idea"]
    assert score("regex_answer", completions, ["81"] * 4, pattern=r"answer is\s*(\d+)") == [1.0, 1.0, 0.0, 0.0]


def test_format_full_credit_for_only_the_tag_pair():
    assert score("format", ["<output>81</output>", "  <output>81</output>\n"]) == [1.0, 1.0]


def test_format_half_credit_for_text_outside_the_tags():
    assert score("format", ["So: <output>81</output>", "<output>8</output><output>1</output>"]) == [0.5, 0.5]


def test_format_no_credit_without_a_pair_or_with_empty_content():
    assert score("format", ["81", "<output>81", "<output> </output>", "</output>81<output>"]) == [0.0, 0.0, 0.0, 0.0]


def test_format_tag_is_configurable():
    assert score("format", ["<answer>7</answer>"], tag="answer") == [1.0]


def test_length_penalty_is_relative_excess_clipped_at_minus_one():
    assert score("length_penalty", ["a" * 5, "a" * 10, "a" * 15, "a" * 100], target_chars=10) == [0.0, 0.0, -0.5, -1.0]


def test_repetition_penalty_on_words_is_minus_ngram_repetition():
    assert score("repetition_penalty", ["a b c a b c", "one two three four"], n=3) == [pytest.approx(-1 / 4), 0.0]


def test_repetition_penalty_on_chars():
    assert score("repetition_penalty", ["abababab"], n=2, unit="chars") == [pytest.approx(-5 / 7)]


# --- resolve --------------------------------------------------------------------------------


def test_user_function_by_module_and_name_gets_its_kwargs():
    fn = resolve(RewardConfig(name="tests.reward_fixtures:length_bonus", kwargs={"scale": 0.5}))
    assert fn(completions=["abcd", ""], answers=["", ""], prompts=["", ""]) == [2.0, 0.0]


def test_trl_style_user_function_finds_answers_in_kwargs():
    fn = resolve(RewardConfig(name="tests.reward_fixtures:trl_style"))
    assert fn(completions=["7 ", "8"], answers=["7", "7"], prompts=["", ""]) == [1.0, 0.0]


def test_unknown_module_names_the_spec_and_the_fix():
    with pytest.raises(ValueError) as e:
        resolve(RewardConfig(name="no_such_module_xyz:bar"), index=2)
    assert str(e.value).startswith(
        "rewards[2].name='no_such_module_xyz:bar': module 'no_such_module_xyz' not found; "
        "give a built-in (exact_answer, "
    )
    assert "importable module:function" in str(e.value)


def test_missing_function_is_named():
    with pytest.raises(
        ValueError,
        match=r"rewards\[0\]\.name='tests.reward_fixtures:nope': "
        r"module 'tests.reward_fixtures' has no attribute 'nope'",
    ):
        resolve(RewardConfig(name="tests.reward_fixtures:nope"), index=0)


def test_non_callable_is_rejected():
    with pytest.raises(ValueError, match="'NOT_A_FUNCTION' is a int, not a function"):
        resolve(RewardConfig(name="tests.reward_fixtures:NOT_A_FUNCTION"))


def test_unknown_builtin_suggests_the_close_one():
    with pytest.raises(
        ValueError, match=r"rewards\[1\]\.name='exact_anwser' is not a built-in reward; did you mean 'exact_answer'\?"
    ):
        resolve(RewardConfig(name="exact_anwser"), index=1)


def test_misspelled_kwarg_is_rejected_before_any_rollout():
    with pytest.raises(
        ValueError, match=r"rewards\[0\]: 'exact_answer' cannot be called with kwargs=\{'tga': 'answer'\}"
    ):
        resolve(RewardConfig(name="exact_answer", kwargs={"tga": "answer"}), index=0)


def test_missing_required_kwarg_is_rejected():
    with pytest.raises(ValueError, match="missing a required argument: 'pattern'"):
        resolve(RewardConfig(name="regex_answer"))


def test_invalid_kwarg_values_are_rejected():
    with pytest.raises(ValueError, match="has no group"):
        resolve(RewardConfig(name="regex_answer", kwargs={"pattern": r"\d+"}))
    with pytest.raises(ValueError, match="target_chars=0 must be a number > 0"):
        resolve(RewardConfig(name="length_penalty", kwargs={"target_chars": 0}))


def test_user_function_with_other_parameter_names_is_rejected():
    with pytest.raises(ValueError, match=r"takes \(c, a, p\), no 'completions'.* name its data parameters completions"):
        resolve(RewardConfig(name="tests.reward_fixtures:positional_only"))


def test_a_user_function_is_given_only_the_batch_parameters_it_names():
    rc = RewardComputer(
        [
            RewardConfig(name="tests.reward_fixtures:without_prompts"),
            RewardConfig(name="tests.reward_fixtures:completions_only"),
        ]
    )
    _, parts = rc(["7", "12"], ["7", "8"], ["3+4=", "4+4="], country=["FR", "PE"])
    assert parts == {"without_prompts": [1.0, 0.0], "completions_only": [0.0, 1.0]}
    rc.trial([Example(prompt="3+4=", answer="7", columns={"country": "FR"})])  # the check before the model, too


def test_register_adds_a_builtin_and_refuses_a_duplicate():
    @register("always_one")
    def always_one(completions, answers, prompts):
        return [1.0] * len(completions)

    try:
        assert score("always_one", ["x", "y"]) == [1.0, 1.0]
        with pytest.raises(ValueError, match="already registered"):
            register("always_one")(always_one)
    finally:
        del REGISTRY["always_one"]


# --- RewardComputer -------------------------------------------------------------------------


def test_total_is_the_weighted_sum_and_components_are_raw():
    rc = RewardComputer([RewardConfig(name="exact_answer", weight=2.0), RewardConfig(name="format", weight=0.5)])
    total, parts = rc(["<output>81</output>", "x <output>81</output>", "81"], ["81"] * 3, ["23+58"] * 3)
    assert parts == {"exact_answer": [1.0, 1.0, 0.0], "format": [1.0, 0.5, 0.0]}
    assert total == [2.5, 2.25, 0.0]


def test_component_name_of_user_function_is_the_function_name():
    rc = RewardComputer([RewardConfig(name="tests.reward_fixtures:length_bonus")])
    assert rc.names == ["length_bonus"]


def test_duplicate_names_get_their_index():
    rc = RewardComputer(
        [
            RewardConfig(name="format"),
            RewardConfig(name="exact_answer"),
            RewardConfig(name="format", kwargs={"tag": "answer"}),
        ]
    )
    assert rc.names == ["format_0", "exact_answer", "format_2"]
    _, parts = rc(["<answer>1</answer>"], ["1"], ["p"])
    assert parts == {"format_0": [0.0], "exact_answer": [0.0], "format_2": [1.0]}


def test_judge_style_reward_scores_contiguous_groups():
    rc = RewardComputer([RewardConfig(name="tests.reward_fixtures:group_best", kwargs={"group_size": 2})])
    total, _ = rc(["a", "abc", "abcd", "ab"], ["", "", "", ""], ["p1", "p1", "p2", "p2"])
    assert total == [0.0, 1.0, 1.0, 0.0]


def test_nan_is_rejected_naming_function_and_completion():
    rc = RewardComputer([RewardConfig(name="tests.reward_fixtures:nan_for_fourth")])
    with pytest.raises(
        ValueError,
        match=r"^reward 'nan_for_fourth' returned nan for completion 3; reward functions must return finite floats$",
    ):
        rc(["a"] * 5, [""] * 5, [""] * 5)


def test_inf_is_rejected():
    rc = RewardComputer([RewardConfig(name="tests.reward_fixtures:inf_everywhere")])
    with pytest.raises(ValueError, match="reward 'inf_everywhere' returned inf for completion 0"):
        rc(["a"], [""], [""])


def test_wrong_count_is_rejected():
    rc = RewardComputer([RewardConfig(name="tests.reward_fixtures:one_short")])
    with pytest.raises(
        ValueError,
        match="reward 'one_short' returned 3 values for 4 completions; "
        "reward functions must return one float per completion",
    ):
        rc(["a"] * 4, [""] * 4, [""] * 4)


def test_non_number_is_rejected():
    rc = RewardComputer([RewardConfig(name="tests.reward_fixtures:strings")])
    with pytest.raises(ValueError, match=r"reward 'strings' returned '1' \(str\) for completion 0"):
        rc(["a"], [""], [""])


def test_mismatched_batch_is_rejected():
    rc = RewardComputer([RewardConfig(name="exact_answer")])
    with pytest.raises(ValueError, match="got 2 completions, 1 answers, 2 prompts"):
        rc(["a", "b"], ["1"], ["p", "q"])


def test_empty_reward_list_is_rejected():
    with pytest.raises(ValueError, match="rewards is empty"):
        RewardComputer([])


# --- numeric_answer, boxed_answer, tag_answer ------------------------------------------------


@pytest.mark.parametrize(
    "completion",
    [
        "42",
        "The answer is 42.",
        "17 + 25 = 42",
        "= 42",
        "So Tom has 42 apples now.",
        "42.0",
        "$42",
        "**42**",
        "Let me think: 17 + 20 = 37, then 37 + 5 = 42",
        "The answer is: 42\n",
    ],
)
def test_numeric_answer_takes_the_last_number(completion):
    assert score("numeric_answer", [completion], ["42"]) == [1.0]


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("It costs $1,234.", "1234"),
        ("1,234,567 people", "1234567"),
        ("The result is -5.", "-5"),
        ("The result is \u22125", "-5"),
        ("x = 3.50", "3.5"),
        ("about 50%", "50"),
        ("81", "81.0"),
        ("It is 4.", "$4"),
    ],
)
def test_numeric_answer_normalises_both_sides(completion, answer):
    assert score("numeric_answer", [completion], [answer]) == [1.0]


@pytest.mark.parametrize(
    "completion",
    [
        "42 is wrong, it is 43",
        "17 + 25",
        "no idea",
        "",
        "4 2",
        "420",
        "-42",
        "x42",
        "42km",
    ],
)
def test_numeric_answer_scores_zero_for_another_last_number_or_none(completion):
    assert score("numeric_answer", [completion], ["42"]) == [0.0]


def test_numeric_answer_minus_between_numbers_is_subtraction():
    assert score("numeric_answer", ["10-5", "10 - 5 = 5", "it is -5"], ["-5"] * 3) == [0.0, 0.0, 1.0]


def test_numeric_answer_can_take_the_first_number():
    assert score("numeric_answer", ["42, since 17 + 25 = 42 and not 43"], ["42"], pick="first") == [1.0]


def test_numeric_answer_tolerance_is_absolute():
    assert score("numeric_answer", ["3.14", "3.2"], ["3.14159"] * 2, tolerance=0.01) == [1.0, 0.0]


def test_numeric_answer_refuses_an_answer_that_is_not_one_number():
    with pytest.raises(ValueError, match=r"numeric_answer: the answer 'forty-two' holds 0 numbers, not one"):
        score("numeric_answer", ["42"], ["forty-two"])


def test_numeric_answer_refuses_bad_kwargs():
    with pytest.raises(
        ValueError, match=r"rewards\[0\]\.kwargs: numeric_answer: pick='middle' must be 'last' or 'first'"
    ):
        resolve(RewardConfig(name="numeric_answer", kwargs={"pick": "middle"}), index=0)


@pytest.mark.parametrize(
    "completion, answer, want",
    [
        (r"so \boxed{42}", "42", 1.0),
        (r"\boxed{41} no, \boxed{42}", "42", 1.0),
        (r"\boxed{ 1,234 }", "1234", 1.0),
        (r"$\boxed{-3.0}$", "-3", 1.0),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),
        (r"\boxed{x + 1}", "x+1", 1.0),
        (r"\boxed{43}", "42", 0.0),
        ("42", "42", 0.0),
        (r"\boxed{42", "42", 0.0),
        (r"\boxed{2x}", "2", 0.0),
    ],
)
def test_boxed_answer_compares_the_last_box(completion, answer, want):
    assert score("boxed_answer", [completion], [answer]) == [want]


def test_tag_answer_is_exact_answer():
    assert REGISTRY["tag_answer"] is REGISTRY["exact_answer"]
    assert score("tag_answer", ["<output>7</output>", "7"], ["7", "7"]) == [1.0, 0.0]


# --- correctness rewards and eval.reward ------------------------------------------------------


def test_correctness_builtins_are_marked_in_the_registry():
    assert sorted(n for n, fn in REGISTRY.items() if is_correctness(fn)) == [
        "boxed_answer",
        "exact_answer",
        "numeric_answer",
        "regex_answer",
        "tag_answer",
    ]


def test_eval_accuracy_reads_the_first_correctness_reward_by_default():
    rc = RewardComputer(
        [RewardConfig(name="format"), RewardConfig(name="numeric_answer"), RewardConfig(name="exact_answer")]
    )
    assert rc.accuracy_name() == "numeric_answer"


def test_eval_reward_names_the_component_to_read():
    rc = RewardComputer([RewardConfig(name="numeric_answer"), RewardConfig(name="format")])
    assert rc.accuracy_name("format") == "format"


def test_user_function_marked_correctness_counts():
    rc = RewardComputer(
        [
            RewardConfig(name="length_penalty", kwargs={"target_chars": 9}),
            RewardConfig(name="tests.reward_fixtures:starts_with_answer"),
        ]
    )
    assert rc.accuracy_name() == "starts_with_answer"


def test_without_a_correctness_reward_there_is_no_accuracy():
    rc = RewardComputer([RewardConfig(name="format"), RewardConfig(name="tests.reward_fixtures:length_bonus")])
    assert rc.accuracy_name() is None


def test_unknown_eval_reward_fails_the_spec_naming_field_and_choices():
    spec = {
        "model": {"name_or_path": "m"},
        "rewards": [{"name": "numeric_answer"}, {"name": "format"}],
        "eval": {"reward": "exact_answer"},
    }
    with pytest.raises(
        SpecError,
        match=r"^spec: eval.reward='exact_answer' is not one of the experiment's rewards "
        r"\(numeric_answer, format\); name one of them, or leave eval.reward unset",
    ):
        load_spec(spec)


def test_check_rewards_returns_the_accuracy_component():
    assert check_rewards([RewardConfig(name="format"), RewardConfig(name="boxed_answer")]) == "boxed_answer"


def test_check_rewards_warns_that_accuracy_is_absent_without_a_correctness_reward():
    with pytest.warns(
        UserWarning,
        match=r"eval/accuracy will not be reported: the rewards \(format, length_penalty\) "
        "hold no correctness reward",
    ):
        assert (
            check_rewards(
                [RewardConfig(name="format"), RewardConfig(name="length_penalty", kwargs={"target_chars": 9})]
            )
            is None
        )


# --- user functions: where they are found, how they fail ------------------------------------


def test_user_function_that_raises_names_the_reward():
    rc = RewardComputer(
        [RewardConfig(name="numeric_answer"), RewardConfig(name="tests.reward_fixtures:raises_on_call")]
    )
    with pytest.raises(
        RewardError,
        match=r"^reward 'raises_on_call' \(tests.reward_fixtures:raises_on_call\) raised "
        r"TypeError: string indices must be integers.*; fix the function",
    ):
        rc(["1", "2"], ["1", "2"], ["p", "q"])


def test_reward_module_next_to_the_spec_is_importable(tmp_path):
    folder = tmp_path / "experiment"
    folder.mkdir()
    (folder / "my_task_rewards.py").write_text(
        "def shouty(completions, answers, prompts):\n    return [float(c.isupper()) for c in completions]\n"
    )
    (folder / "spec.yaml").write_text("model: {name_or_path: m}\nrewards: [{name: 'my_task_rewards:shouty'}]\n")
    code = (
        "import sys\nfrom tasks.spec import load_spec\nfrom trainer.rewards import RewardComputer\n"
        "spec = load_spec(sys.argv[1])\nprint(RewardComputer(spec.rewards)(['HI', 'hi'], ['', ''], ['', ''])[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(folder / "spec.yaml")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.stdout.strip() == "[1.0, 0.0]", out.stderr


def test_reward_module_in_the_working_directory_is_importable(tmp_path):
    (tmp_path / "cwd_rewards.py").write_text(
        "def one(completions, answers, prompts):\n    return [1.0] * len(completions)\n"
    )
    code = (
        "from trainer.config import RewardConfig\nfrom trainer.rewards import resolve\n"
        "print(resolve(RewardConfig(name='cwd_rewards:one'))(completions=['a'], answers=[''], prompts=['']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.stdout.strip() == "[1.0]", out.stderr


def test_missing_reward_module_fails_the_spec_before_torch_is_imported(tmp_path):
    (tmp_path / "spec.yaml").write_text("model: {name_or_path: m}\nrewards: [{name: 'nowhere_rewards:fn'}]\n")
    code = (
        "import sys\nfrom tasks.spec import SpecError, load_spec\ntry:\n"
        "    load_spec(sys.argv[1])\nexcept SpecError as e:\n    print(e)\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "spec.yaml")], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    lines = out.stdout.splitlines()
    assert lines[0].startswith(
        f"{tmp_path / 'spec.yaml'}: rewards[0].name='nowhere_rewards:fn': module 'nowhere_rewards' not found"
    ), out.stderr
    assert lines[1] == "[]"


def test_rewards_module_does_not_import_torch():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, trainer.rewards, trainer.data\nprint(sorted({'torch', 'transformers'} & set(sys.modules)))",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "[]", out.stderr


# --- issue 23: what a user's own task needs --------------------------------------------------------------------


def user_spec(*rewards, **sections) -> dict:
    return {"model": {"name_or_path": "m"}, "rewards": list(rewards), **sections}


def test_a_misspelt_kwarg_is_refused_though_the_function_takes_kwargs():
    with pytest.raises(
        SpecError,
        match=r"^spec: rewards\[0\]\.kwargs\.tolerence: 'tests.reward_fixtures:reads_kwargs' has no parameter "
        r"'tolerence', and its \*\*kwargs would swallow it unread; did you mean 'tolerance'\?",
    ):
        load_spec(user_spec({"name": "tests.reward_fixtures:reads_kwargs", "kwargs": {"tolerence": 0.1}}))


def test_a_kwarg_the_function_names_or_documents_is_accepted():
    load_spec(user_spec({"name": "tests.reward_fixtures:reads_kwargs", "kwargs": {"tolerance": 0.1}}))
    fn = resolve(RewardConfig(name="tests.reward_fixtures:reads_documented_kwargs", kwargs={"bonus": 0.5}))
    assert fn(completions=["a"], answers=["b"], prompts=["c"]) == [0.5]


def test_eval_reward_takes_the_module_function_name_as_the_rewards_list_gives_it():
    name = "tests.reward_fixtures:starts_with_answer"
    spec = load_spec(user_spec({"name": "format"}, {"name": name}, eval={"reward": name}))
    assert RewardComputer(spec.rewards).accuracy_name(spec.eval.reward) == "starts_with_answer"
    assert check_rewards(spec.rewards, name) == "starts_with_answer"


def test_eval_reward_naming_two_rewards_asks_for_the_metric_name():
    name = "tests.reward_fixtures:starts_with_answer"
    with pytest.raises(
        SpecError,
        match=r"eval.reward='tests.reward_fixtures:starts_with_answer' names 2 of the rewards; give the "
        r"metric name of one \(starts_with_answer_0, starts_with_answer_1\)",
    ):
        load_spec(user_spec({"name": name}, {"name": name}, eval={"reward": name}))


def test_a_typo_in_a_reward_name_is_reported_against_rewards_not_eval_reward():
    with pytest.raises(
        SpecError,
        match=r"^spec: rewards\[0\]\.name='tests.reward_fixtures:starts_with_answr': module 'tests.reward_fixtures' "
        r"has no attribute 'starts_with_answr'; did you mean 'tests.reward_fixtures:starts_with_answer'\?",
    ):
        load_spec(user_spec({"name": "tests.reward_fixtures:starts_with_answr"}, eval={"reward": "starts_with_answer"}))


def test_columns_reach_a_function_that_names_them_or_takes_kwargs_and_never_a_builtin():
    from tests import reward_fixtures

    rc = RewardComputer(
        [
            RewardConfig(name="exact_answer"),
            RewardConfig(name="tests.reward_fixtures:capital_match"),
            RewardConfig(name="tests.reward_fixtures:echo_columns"),
        ]
    )
    reward_fixtures.SEEN.clear()
    total, parts = rc(["Paris", "Rome"], ["Paris", "Lima"], ["France?", "Peru?"], country=["FR", "PE"], tag=["x", "y"])
    assert parts == {"exact_answer": [0.0, 0.0], "capital_match": [1.0, 0.0], "echo_columns": [1.0, 1.0]}
    assert reward_fixtures.SEEN == [
        {"answers": ["Paris", "Lima"], "prompts": ["France?", "Peru?"], "country": ["FR", "PE"], "tag": ["x", "y"]}
    ]


def test_a_column_that_is_also_a_spec_kwarg_is_refused(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "France?", "answer": "Paris", "strict": true}\n')
    with pytest.raises(
        SpecError,
        match=r"rewards\[0\] \(tests.reward_fixtures:capital_match\): data column 'strict' and rewards\[0\]\.kwargs\."
        r"strict both give 'tests.reward_fixtures:capital_match' its 'strict'; rename the column or drop the kwarg",
    ):
        load_spec(
            user_spec(
                {"name": "tests.reward_fixtures:capital_match", "kwargs": {"strict": True}}, data={"source": str(data)}
            )
        )


@pytest.mark.parametrize(
    "name, completion, kwargs",
    [
        ("exact_answer", "<output>Lima, Peru</output>", {}),
        ("numeric_answer", "It is 1.5", {}),
        ("boxed_answer", "\\boxed{Lima, Peru}", {}),
        ("regex_answer", "answer: Lima, Peru", {"pattern": r"answer: (.*)"}),
    ],
)
def test_correctness_builtins_accept_any_of_a_list_of_answers(name, completion, kwargs):
    answers = ["Lima", "Lima, Peru"] if name != "numeric_answer" else ["2", "1.5"]
    assert score(
        name, [completion, "<output>Quito</output> \\boxed{Quito} answer: Quito 7"], [answers] * 2, **kwargs
    ) == [
        1.0,
        0.0,
    ]


def test_a_user_reward_gets_the_accepted_answers_as_the_list():
    fn = resolve(RewardConfig(name="tests.reward_fixtures:trl_style"))
    assert fn(completions=["a"], answers=[["a", "b"]], prompts=["p"]) == [0.0]  # its own business what a list means


def test_a_required_parameter_may_be_a_column_and_one_neither_given_nor_a_column_is_refused(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "Capital of Peru?", "answer": "Lima", "country": "Peru"}\n')
    (tmp_path / "caps.py").write_text(
        "def capital(completions, answers, prompts, country):\n"
        "    return [float(a in c) for c, a in zip(completions, answers)]\n"
    )
    spec = {"model": {"name_or_path": "m"}, "rewards": [{"name": "caps:capital"}], "data": {"source": str(data)}}
    (tmp_path / "spec.yaml").write_text(json.dumps(spec))
    load_spec(tmp_path / "spec.yaml")
    spec["data"] = {"source": "arith"}
    (tmp_path / "spec.yaml").write_text(json.dumps(spec))
    with pytest.raises(
        SpecError,
        match=r"rewards\[0\]: 'caps:capital' needs 'country', which is neither in rewards\[0\]\.kwargs nor a column "
        r"of the data \(it has none besides prompt and answer\)",
    ):
        load_spec(tmp_path / "spec.yaml")
