"""trainer/health.py: the text-health detectors, classify(), batch_health() and the HealthGate."""

import json
import math
import random
from pathlib import Path

import pytest

from trainer.config import HealthConfig
from trainer.health import (
    REASONS,
    HealthGate,
    batch_health,
    classify,
    garbage_score,
    is_garbage,
    ngram_repetition,
    reason_code,
    repetition_loop,
    symbol_soup,
    tagged_content,
    unique_token_ratio,
)

PYTHON_FUNCTION = '''def score(items: list[int]) -> dict:
    """Sum and count."""
    total = 0
    for x in items:
        if x > 0 and x % 2 == 0:
            total += x ** 2
        else:
            total -= 1
    return {"total": total, "n": len(items), "ok": [i for i in items if i]}
'''
JS_NESTED_BRACES = (
    "function f(a, b, c) {\n  if (a) {\n    if (b) {\n      if (c) {\n        go();\n      }\n    }\n  }\n}\n"
)
SIMILAR_LINES = "x = 1\ny = 2\nz = 3\nw = 4\nprint(x)\nprint(y)\n"
MARKDOWN_LIST = "Steps:\n\n- add the tens: 20 + 50 = 70\n- add the ones: 3 + 8 = 11\n- total: 81\n\n**Answer:** 81\n"
JSON_OBJECT = '{"name": "ballast", "values": [1, 2, 3], "nested": {"a": null, "b": true}, "zeros": [0, 0, 0]}'
MARKDOWN_TABLE = "| a | b | c |\n| --- | --- | --- |\n| 0 | 0 | 0 |\n| 1 | 0 | 0 |\n"
PROSE = "The sum of 23 and 58 is 81, because 3 + 8 = 11 carries one into the tens."
NON_ENGLISH = "Привет, мир! 你好，世界。 Ça va très bien, merci — à demain."
TREE_OUTPUT = "src\n├── main.py\n└── util\n    └── io.py\n"
FINE_TEXTS = {
    "short answer": "7",
    "tagged answer": "<output>42</output>",
    "python": PYTHON_FUNCTION,
    "nested braces": JS_NESTED_BRACES,
    "similar lines": SIMILAR_LINES,
    "markdown list": MARKDOWN_LIST,
    "json": JSON_OBJECT,
    "markdown table": MARKDOWN_TABLE,
    "prose": PROSE,
    "non-english": NON_ENGLISH,
    "tree": TREE_OUTPUT,
    "rule and hex": "# " + "=" * 70 + "\nMASK = 0xFFFFFFFFFFFFFFFF\n",
    "emoji in a sentence": "Done, all tests pass 🎉",
}


def byte_soup(encoding: str, seed: int = 0, n: int = 300) -> str:
    rng = random.Random(seed)
    return bytes(rng.randrange(256) for _ in range(n)).decode(encoding, errors="replace")


# --- ngram_repetition / unique_token_ratio ---------------------------------------------------


def test_ngram_repetition_counts_repeated_ngrams_over_all_ngrams():
    # 3-grams of 1 2 3 1 2 3: (123) (231) (312) (123) -> one repeat of four
    assert ngram_repetition([1, 2, 3, 1, 2, 3], n=3) == pytest.approx(1 / 4)


def test_ngram_repetition_of_distinct_tokens_is_zero():
    assert ngram_repetition(list(range(50))) == 0.0


def test_ngram_repetition_of_one_token_repeated_tends_to_one():
    assert ngram_repetition([7] * 102, n=3) == pytest.approx(99 / 100)


def test_ngram_repetition_is_zero_below_n_plus_one_items():
    assert ngram_repetition([5, 5, 5], n=3) == 0.0
    assert ngram_repetition([], n=3) == 0.0


def test_ngram_repetition_works_on_characters():
    assert ngram_repetition("abababab", n=2) == pytest.approx(5 / 7)


def test_ngram_repetition_rejects_n_below_one():
    with pytest.raises(ValueError, match="n=0"):
        ngram_repetition([1, 2], n=0)


def test_unique_token_ratio_is_distinct_over_total():
    assert unique_token_ratio([1, 1, 2, 3]) == 0.75


def test_unique_token_ratio_of_empty_is_one():
    assert unique_token_ratio([]) == 1.0


# --- garbage --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FINE_TEXTS)
def test_ordinary_texts_are_not_garbage(name):
    assert not is_garbage(FINE_TEXTS[name])


def test_code_and_prose_score_zero():
    for text in (PYTHON_FUNCTION, JS_NESTED_BRACES, JSON_OBJECT, PROSE, NON_ENGLISH, "42"):
        assert garbage_score(text) == 0.0


def test_control_characters_and_replacement_chars_are_garbage():
    assert is_garbage("\x00\x07ÿþ\ufffd\x01\x02\x1b")


def test_control_characters_inside_a_word_are_garbage():
    assert is_garbage("ans\x00\x01\x02wer\x03")


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1", "ascii"])
def test_random_byte_soup_is_garbage(encoding):
    assert is_garbage(byte_soup(encoding))


def test_one_stray_replacement_char_at_the_end_of_a_long_text_is_not_garbage():
    assert not is_garbage(PROSE + "\ufffd")


def test_mostly_emoji_is_garbage():
    assert is_garbage("🎉🎉🎉🎉")


def test_empty_text_is_not_garbage():
    assert garbage_score("") == 0.0 and not is_garbage("")


# --- repetition loops -----------------------------------------------------------------------


@pytest.mark.parametrize("name", FINE_TEXTS)
def test_ordinary_texts_have_no_repetition_loop(name):
    assert repetition_loop(FINE_TEXTS[name]) is None


def test_line_repeated_ten_times_is_a_loop():
    assert repetition_loop("Let me check.\n" + "The answer is 81.\n" * 10) == 'line "The answer is 81." x10'


def test_line_repeated_three_times_is_a_loop():
    assert repetition_loop("foo\nfoo\nfoo\n") == 'line "foo" x3'


def test_line_repeated_twice_is_not_a_loop():
    assert repetition_loop("foo bar\nfoo bar\nbaz\n") is None


def test_block_of_lines_repeated_is_a_loop():
    assert repetition_loop("step one\nstep two\n" * 4) == '2 lines "step one / step two" x4'


def test_repeated_word_is_a_loop():
    assert repetition_loop("and then the the the the the the") == 'word "the" x6'


def test_four_copies_of_a_word_is_a_loop_three_is_not():
    assert repetition_loop("the the the the") == 'word "the" x4'
    assert repetition_loop("no no no, that is wrong") is None


def test_repeated_symbol_word_is_a_loop():
    assert repetition_loop("= = = = =") == 'word "=" x5'


def test_repeated_phrase_is_a_loop():
    assert repetition_loop("I think that I think that I think that so") == 'words "I think that" x3'


def test_repeated_characters_without_spaces_are_a_loop():
    assert repetition_loop("<output>" + "abc" * 12) == 'chars "abc" x12'


def test_single_character_run_is_a_loop():
    assert repetition_loop("8" + "1" * 40) == 'chars "1" x40'


def test_long_loop_description_is_truncated():
    desc = repetition_loop(("x" * 60 + "\n") * 5)
    assert desc.startswith('line "' + "x" * 40 + '…"') and desc.endswith(" x5")


# --- loops that differ only in numbers, as real models write them --------------------------------
# Each degenerate text is cut where SmolLM2-135M-Instruct's tokenizer reaches 512 tokens (measured), as a
# completion that ran into max_tokens=512 is.

NUMBERED_LIST_LOOP = (
    "To add 17 and 25, follow these steps:\n\n"
    + "".join(f"{i}. Add the ones digits together and carry the one to the tens.\n" for i in range(1, 200))
)[:1936]
SUBTITLE_TIMESTAMP_LOOP = "".join(
    f"{i}\n00:{i // 60:02d}:{i % 60:02d},000 --> 00:{(i + 1) // 60:02d}:{(i + 1) % 60:02d},000\n" for i in range(1, 400)
)[:563]
INLINE_TIMES_LOOP = ("The times are " + ", ".join(f"{9 + i // 60}:{i % 60:02d} AM" for i in range(400)))[:664]
DATE_STAMP_LOOP = "".join(f"2024-01-{1 + i // 24:02d} {i % 24:02d}:00:00\n" for i in range(400))[:512]
PRIMES = (
    "The first 30 primes are "
    + ", ".join(
        map(
            str,
            [
                2,
                3,
                5,
                7,
                11,
                13,
                17,
                19,
                23,
                29,
                31,
                37,
                41,
                43,
                47,
                53,
                59,
                61,
                67,
                71,
                73,
                79,
                83,
                89,
                97,
                101,
                103,
                107,
                109,
                113,
            ],
        )
    )
    + "."
)
TIMES_TABLE = "Here is the 7 times table:\n" + "".join(f"{i} x 7 = {7 * i}\n" for i in range(1, 13))
TRAINING_LOG = "Output:\n" + "".join(
    f"Epoch {i}/10 - loss: {1 / i:.4f} - accuracy: {0.5 + i / 25:.2f}\n" for i in range(1, 11)
)
NUMBERED_STEPS = "1. Boil the water.\n2. Put the tea bag in a cup.\n3. Pour the water.\n4. Wait 3 minutes.\n5. Enjoy.\n"


@pytest.mark.parametrize(
    "text, start",
    [
        (NUMBERED_LIST_LOOP, 'line "1. Add the ones digits together and carr…" x29'),
        (SUBTITLE_TIMESTAMP_LOOP, '2 lines "1 / 00:00:01,000 --> 00:00:02,000" x17'),
        (INLINE_TIMES_LOOP, 'words "9:00 AM," x71'),
        (DATE_STAMP_LOOP, 'line "2024-01-01 00:00:00" x25'),
    ],
)
def test_lines_differing_only_in_numbers_are_a_loop(text, start):
    assert repetition_loop(text) == start + ", differing only in numbers"


def test_numbered_loop_needs_twelve_copies_of_a_worded_line():
    lines = "".join(f"{i}. Add the numbers.\n" for i in range(1, 12))
    assert repetition_loop(lines) is None
    assert (
        repetition_loop(lines + "12. Add the numbers.\n") == 'line "1. Add the numbers." x12, differing only in numbers'
    )


def test_numbered_loop_without_spaces_is_caught_by_characters():
    text = "".join(f"[{i}:{i + 1}]" for i in range(10, 40))
    assert repetition_loop(text) == 'chars "[0:0]" x30, differing only in numbers (digits shown as 0)'


@pytest.mark.parametrize(
    "text", [PRIMES, TIMES_TABLE, TRAINING_LOG, NUMBERED_STEPS], ids=["primes", "times table", "log", "steps"]
)
def test_number_lists_tables_and_logs_are_not_loops(text):
    assert repetition_loop(text) is None


# What SmolLM2-135M-Instruct really writes (sampled with the hf engine; tests/smollm2_answers.jsonl says how):
# wrong sums, rambling, "####" lines, numbered steps and chat answers with lists, code and tables; none is a loop
# or garbage, however wrong.
SMOLLM2_ANSWERS = [
    json.loads(line) for line in (Path(__file__).parent / "smollm2_answers.jsonl").read_text().splitlines()
]


@pytest.mark.parametrize("row", SMOLLM2_ANSWERS, ids=[f"answer{i}" for i in range(len(SMOLLM2_ANSWERS))])
def test_real_smollm2_answers_are_neither_loops_nor_garbage(row):
    assert repetition_loop(row["text"]) is None and not is_garbage(row["text"])


# --- symbol and emoji soup ---------------------------------------------------------------------


def emoji_soup(seed: int = 0) -> str:
    """512 SmolLM2 tokens of emoji runs mixed with short words: a per-character score misses it."""
    rng = random.Random(seed)
    emoji = "🌈✨🦄💖🎶🌸🌼🌻🍀🔥💫⭐🎉🥳😍🙌👏💯🌟🍓"
    words = ["so", "happy", "vibes", "love", "yay", "wow", "fun", "sunshine", "party", "magic"]
    parts = [
        "".join(rng.choice(emoji) for _ in range(rng.randint(1, 3))) if rng.random() < 0.55 else rng.choice(words)
        for _ in range(200)
    ]
    return " ".join(parts)[:563]


def test_emoji_soup_is_garbage_though_its_character_score_is_low():
    soup = emoji_soup()
    assert garbage_score(soup) < 0.15
    assert is_garbage(soup) and symbol_soup(soup) == "144 symbols or emoji to 64 words"


def test_classify_reports_symbol_soup_as_garbage():
    text = "wow ✨ amazing 🌟 party 💫 time ⭐ yay 🎉 love 🥳 happy 🎈 fun 🎁"
    assert classify(text, [1], "stop", 32) == ["garbage: symbol soup (8 symbols or emoji to 8 words)"]


@pytest.mark.parametrize(
    "text",
    [
        "Great job! 🎉 You solved it. Keep going 💪",
        "✅ Drink water\n✅ Sleep eight hours\n✅ Walk every day\n✅ Eat vegetables\n✅ Read a book\n",
        "Rating: ⭐⭐⭐⭐⭐ (5/5) — the best pancakes in town.",
        TREE_OUTPUT * 4,
    ],
    ids=["sentence", "emoji bullets", "rating", "tree"],
)
def test_emoji_in_ordinary_text_is_not_soup(text):
    assert symbol_soup(text) is None and not is_garbage(text)


# --- classify -------------------------------------------------------------------------------


def test_healthy_completion_has_no_reasons():
    assert (
        classify("<output>81</output>", [1, 2, 3], "stop", max_tokens=32, format_tag="output", expected_length=19) == []
    )


def test_classify_reports_repetition_loop_with_detail():
    assert classify("foo\n" * 7, [1] * 14, "stop", max_tokens=32) == ['repetition_loop: line "foo" x7']


def test_classify_reports_length_cap_from_finish_reason():
    assert classify("<output>8", [1] * 32, "length", max_tokens=32) == [
        "length_cap: stopped at 32 tokens (max_tokens=32)"
    ]


def test_classify_reports_missing_format():
    assert classify("81", [1], "stop", 32, format_tag="output") == ["format_missing: no <output>...</output> pair"]


def test_classify_reports_open_tag_without_close_as_missing_format():
    assert [reason_code(r) for r in classify("<output>81", [1], "stop", 32, format_tag="output")] == ["format_missing"]


def test_classify_reports_empty_tag_as_missing_format():
    assert classify("<output> </output>", [1], "stop", 32, format_tag="output") == [
        "format_missing: <output></output> is empty"
    ]


def test_classify_reports_garbage():
    (reason,) = classify("\x00\x07\ufffd\x01ab", [1], "stop", 32)
    assert reason_code(reason) == "garbage" and reason.startswith("garbage: score 0.67")


def test_classify_reports_too_long():
    assert classify("abcdefghijklmnopqrst", [1], "stop", 32, expected_length=5) == [
        "too_long: 20 chars > 3 x expected 5"
    ]


def test_classify_uses_length_factor():
    assert classify("abcdefghij", [1], "stop", 32, expected_length=5, length_factor=2.5) == []


def test_classify_reasons_come_in_order_of_reasons():
    text = "\x00\x01\x02\x03 " * 12  # a loop of control characters, no tag, long
    reasons = classify(text, [1] * 32, "length", 32, format_tag="output", expected_length=4)
    assert [reason_code(r) for r in reasons] == list(REASONS)


def test_reason_code_without_detail_is_the_reason():
    assert reason_code("garbage") == "garbage"


def test_tagged_content_is_the_first_pair():
    assert tagged_content("x <output> 4 </output> <output>5</output>", "output") == " 4 "
    assert tagged_content("<output>4", "output") is None


def test_bad_tag_name_is_rejected():
    with pytest.raises(ValueError, match="tag='<output>'"):
        tagged_content("x", "<output>")


# --- batch_health ---------------------------------------------------------------------------


def test_batch_health_gives_exactly_the_three_means():
    texts = ["<output>1</output>", "\x00\x01\x02\x03"]
    ids = [[1, 2, 3, 4], [5, 5, 5, 5, 5]]
    assert batch_health(texts, ids) == {
        "health/ngram_repetition": pytest.approx((0.0 + 2 / 3) / 2),
        "health/unique_token_ratio": pytest.approx((1.0 + 0.2) / 2),
        "health/garbage_ratio": 0.5,
    }


def test_batch_health_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 texts but 1 token id lists"):
        batch_health(["a", "b"], [[1]])


def test_batch_health_of_empty_batch_is_nan():
    assert all(math.isnan(v) for v in batch_health([], []).values())


# --- HealthGate -----------------------------------------------------------------------------

HEALTHY = {
    "completions/clipped_ratio": 0.1,
    "health/ngram_repetition": 0.05,
    "health/garbage_ratio": 0.0,
    "kl": 0.02,
    "sampling/sampling_logp_difference/max": 0.01,
    "hacking/length_reward_corr": 0.1,
    "hacking/group_diversity": 0.3,
}


def test_collapsing_run_trips_after_exactly_patience_steps():
    gate = HealthGate(HealthConfig(patience=3))
    clipped = [0.1, 0.3, 0.6, 0.95, 1.0, 1.0, 1.0]
    results = [gate.update(step, {**HEALTHY, "completions/clipped_ratio": c}) for step, c in enumerate(clipped, 1)]
    assert results[:5] == [None] * 5  # above 0.9 from step 4; steps 4 and 5 are two of three
    assert results[5].startswith("collapsed: completions/clipped_ratio=1 > 0.9 for 3 consecutive steps")


def test_the_logprob_difference_counts_only_in_steps_trained_on_the_current_policys_batch():
    """With rollout.max_off_policy_steps the difference is mostly the intended policy lag (measured on the
    quickstart with vLLM: max 1.7 at k=1, 5.0 at k=2): those steps are not read; on-policy steps are."""
    lagged = {**HEALTHY, "sampling/sampling_logp_difference/max": 2.0, "sampling/staleness/max": 1.0}
    gate = HealthGate(HealthConfig(patience=2))
    assert [gate.update(step, lagged) for step in range(1, 6)] == [None] * 5
    on_policy = {**lagged, "sampling/staleness/max": 0.0}
    results = [gate.update(step, on_policy) for step in range(6, 8)]
    assert results[0] is None and "sampling/sampling_logp_difference/max=2 > 0.5" in results[1]


def test_rising_repetition_trips_with_value_threshold_and_steps():
    gate = HealthGate(HealthConfig(patience=3))
    reps = [0.05, 0.2, 0.65, 0.7, 0.82]
    results = [gate.update(step, {**HEALTHY, "health/ngram_repetition": r}) for step, r in enumerate(reps, 1)]
    assert results[:4] == [None] * 4
    assert results[4].startswith("collapsed: health/ngram_repetition=0.82 > 0.6 for 3 consecutive steps")


def test_healthy_run_never_trips_under_default_config():
    gate = HealthGate(HealthConfig())
    rng = random.Random(0)
    for step in range(1, 201):
        metrics = {name: value * rng.uniform(0.5, 1.5) for name, value in HEALTHY.items()}
        assert gate.update(step, metrics) is None


def test_counter_resets_when_signal_comes_back_in_range():
    gate = HealthGate(HealthConfig(patience=3))
    for step, kl in enumerate([2.0, 2.0, 0.5, 2.0, 2.0], 1):
        assert gate.update(step, {"kl": kl}) is None
    assert gate.update(6, {"kl": 2.0}).startswith("collapsed: kl=2 > 1 for 3 consecutive steps")


def test_signals_are_counted_separately():
    gate = HealthGate(HealthConfig(patience=2))
    assert gate.update(1, {"kl": 5.0, "health/garbage_ratio": 0.0}) is None
    assert gate.update(2, {"kl": 0.0, "health/garbage_ratio": 0.9}) is None
    assert gate.update(3, {"kl": 0.0, "health/garbage_ratio": 0.9}).startswith("collapsed: health/garbage_ratio=0.9")


def test_logprob_diff_message_says_what_it_means():
    gate = HealthGate(HealthConfig(patience=1))
    reason = gate.update(1, {"sampling/sampling_logp_difference/max": 3.0})
    assert reason.startswith("collapsed: sampling/sampling_logp_difference/max=3 > 0.5 for 1 consecutive step (")
    assert "engine and trainer disagree on logprobs" in reason
    assert "stale or double-applied adapter" in reason and "sampling configuration" in reason


def test_missing_or_nan_signals_are_skipped():
    gate = HealthGate(HealthConfig(patience=2))
    assert gate.update(1, {"kl": 5.0}) is None
    assert gate.update(2, {"kl": math.nan}) is None
    assert gate.update(3, {}) is None
    assert gate.update(4, {"kl": 5.0}).startswith("collapsed: kl=5")


def test_steps_below_min_step_never_trip_nor_count():
    gate = HealthGate(HealthConfig(patience=2, min_step=5))
    assert [gate.update(step, {"kl": 9.0}) for step in range(1, 6)] == [None] * 5
    assert gate.update(6, {"kl": 9.0}).startswith("collapsed: kl=9 > 1 for 2 consecutive steps")


def test_disabled_gate_never_trips():
    gate = HealthGate(HealthConfig(enabled=False, patience=1))
    for step in range(1, 10):
        assert gate.update(step, {"kl": 100.0, "completions/clipped_ratio": 1.0}) is None


def test_state_round_trip_resumes_the_count_exactly():
    collapsing = {**HEALTHY, "health/garbage_ratio": 0.8}
    gate = HealthGate(HealthConfig(patience=3))
    gate.update(1, collapsing)
    gate.update(2, collapsing)
    resumed = HealthGate(HealthConfig(patience=3))
    resumed.load_state_dict(gate.state_dict())
    assert resumed.state_dict() == gate.state_dict()
    assert resumed.update(3, collapsing).startswith("collapsed: health/garbage_ratio=0.8 > 0.5 for 3 consecutive steps")
