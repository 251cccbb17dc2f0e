"""User reward functions for tests/test_rewards.py, resolved as 'tests.reward_fixtures:<name>'."""


def length_bonus(completions, answers, prompts, scale=1.0):
    return [scale * len(c) for c in completions]


def group_best(completions, answers, prompts, group_size=2):
    """A judge-style reward: 1.0 for the longest completion of each contiguous group."""
    out = []
    for g in range(0, len(completions), group_size):
        group = completions[g:g + group_size]
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


NOT_A_FUNCTION = 3
