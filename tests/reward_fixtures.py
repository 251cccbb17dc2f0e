"""User reward functions for the tests (tests/test_rewards.py, tests/test_hacking_alarms.py), resolved as
'tests.reward_fixtures:<name>'."""

import re


def length_bonus(completions, answers, prompts, scale=1.0):
    return [scale * len(c) for c in completions]


def group_best(completions, answers, prompts, group_size=2):
    """A judge-style reward: 1.0 for the longest completion of each contiguous group."""
    out = []
    for g in range(0, len(completions), group_size):
        group = completions[g : g + group_size]
        best = max(range(len(group)), key=lambda i: len(group[i]))
        out.extend(1.0 if i == best else 0.0 for i in range(len(group)))
    return out


def trl_style(prompts, completions, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, kwargs["answers"])]


def nan_for_fourth(completions, answers, prompts):
    return [float("nan") if i == 3 else 0.0 for i in range(len(completions))]


def inf_everywhere(completions, answers, prompts):
    return [float("inf")] * len(completions)


def one_short(completions, answers, prompts):
    return [0.0] * (len(completions) - 1)


def strings(completions, answers, prompts):
    return ["1"] * len(completions)


def positional_only(c, a, p):
    return [0.0] * len(c)


def without_prompts(completions, answers):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answers)]


def completions_only(completions, country):
    return [float(len(c) > 1) for c in completions]


NOT_A_FUNCTION = 3


def raises_on_call(completions, answers, prompts):
    return [float(answers[i]["score"]) for i in range(len(completions))]  # answers are strings: TypeError


def starts_with_answer(completions, answers, prompts):
    return [1.0 if c.startswith(a) else 0.0 for c, a in zip(completions, answers)]


starts_with_answer.correctness = True


# --- rewards that can be gamed (tests/test_hacking_alarms.py) ------------------------------------


def two_digit_format(completions, answers, prompts):
    """A format check with a loophole: it pays <output>N</output> with one or two digits, whatever the answer (its
    author thought every sum has two digits), so the policy learns to cut three-digit sums short."""
    return [1.0 if re.fullmatch(r"\s*<output>\d{1,2}</output>\s*", c) else 0.0 for c in completions]


# --- broken rewards, refused by the trial call before the model loads (tests/test_rewards.py) -------------------


def returns_none(completions, answers, prompts):
    scores = [float(c == a) for c, a in zip(completions, answers)]  # noqa: F841  (forgot to return it)


def returns_a_string(completions, answers, prompts):
    return "1.0"


def nan_for_empty(completions, answers, prompts):
    return [float("nan") if not c else 1.0 for c in completions]


CALLS = {"nan_from_third_call": 0}


def nan_from_third_call(completions, answers, prompts):
    """1.0, then NaN from its third call in the process on: the spec check's call and step 1 pass, step 2 is NaN."""
    CALLS["nan_from_third_call"] += 1
    return [float("nan") if CALLS["nan_from_third_call"] >= 3 else 1.0 for _ in completions]


def nan_for_sampled(completions, answers, prompts):
    """1.0 for the spec check's placeholder completions, NaN for anything else: passes validate, is NaN in step 1."""
    from trainer.rewards import PLACEHOLDERS, accepted

    def placeholder(c, a):
        return any(c == p.format(answer=accepted(a)[0]) for p in PLACEHOLDERS)

    return [1.0 if placeholder(c, a) else float("nan") for c, a in zip(completions, answers)]


def last_word(completions, answers, prompts):
    return [float(c.split()[-1] == a) for c, a in zip(completions, answers)]  # IndexError on an empty completion


# --- rewards that take the data's columns and options ----------------------------------------------------------


def capital_match(completions, answers, prompts, country=None, strict=False):
    """1.0 when the completion names the answer; `country` is the data's column."""
    return [float(a.lower() in c.lower()) for c, a in zip(completions, answers)]


def reads_kwargs(completions, answers, prompts, tolerance=0.0, **kwargs):
    return [float(len(kwargs.get("country") or []) >= 0) for _ in completions]


def reads_documented_kwargs(completions, answers, prompts, **kwargs):
    """Options: `bonus` (float, added to every score), read from kwargs."""
    return [float(kwargs.get("bonus", 0.0)) for _ in completions]


def echo_columns(completions, answers, prompts, **kwargs):
    """Records what it was given: 1.0 per completion (SEEN holds the calls)."""
    SEEN.append({"answers": answers, "prompts": prompts, **kwargs})
    return [1.0] * len(completions)


SEEN: list = []


def dies_mid_step(completions, answers, prompts):
    """0 for every completion. With BALLAST_TEST_SIGKILL="RANK:PATH", the process of torchrun rank RANK kills itself
    with SIGKILL on its first call once PATH exists (a checkpoint directory): mid-step, after its rollouts and before
    the update, in the step after that checkpoint (tests/test_distributed.py)."""
    import os
    import signal

    rank, _, path = os.environ.get("BALLAST_TEST_SIGKILL", "").partition(":")
    if path and rank == os.environ.get("RANK") and os.path.exists(path):
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(completions)
