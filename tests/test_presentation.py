"""How numbers and summaries read, everywhere Ballast shows them (terminal, pages, MLflow descriptions): numbers
without float tails, p-values to two significant digits, 'first k steps → last k steps' never overlapping or
repeating one step, how a run ended as markdown, and commit links for the usual code hosts."""

import pytest

from tasks.pages import commit_link, number, percent, significant
from tasks.results import PipelineResult


def result(rewards: list[float], **fields) -> PipelineResult:
    history = [{"step": i + 1, "reward": r} for i, r in enumerate(rewards)]
    return PipelineResult(
        run_id="r" * 32,
        output_dir="/out",
        status=fields.pop("status", "finished"),
        history=history,
        last_step=len(rewards),
        **fields,
    )


@pytest.mark.parametrize(
    "value, shown",
    [
        (0.1379762046749802, "0.138"),
        (12, "12"),
        (12.0, "12"),
        (1234567, "1,234,567"),
        (0.0000123, "1.23e-05"),
        (None, "—"),
        (float("nan"), "—"),
        (True, "yes"),
        (318.0004, "318"),
        (2.5, "2.5"),
    ],
)
def test_a_number_is_shown_without_a_float_tail(value, shown):
    assert number(value) == shown


def test_p_values_keep_two_significant_digits():
    assert significant(0.0076) == "0.0076" and significant(1.8e-17) == "1.8e-17" and significant(None) == "—"
    assert percent(1 / 3) == "33.3%"


@pytest.mark.parametrize(
    "rewards, line",
    [
        ([], None),
        ([0.5], "0.500 (one step)"),
        ([0.5, 0.7], "first step 0.500 → last step 0.700"),
        ([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], "first 3 steps 0.200 → last 3 steps 0.500"),
        ([0.1] * 5 + [0.9] * 7, "first 5 steps 0.100 → last 5 steps 0.900"),
    ],
)
def test_first_and_last_steps_never_overlap(rewards, line):
    assert result(rewards).reward_line() == line


def test_the_terminal_summary_reads_first_and_last_steps():
    assert result([0.25, 0.75]).lines()[0] == "reward (training batches): first step 0.250 → last step 0.750"


def test_markdown_says_how_the_run_ended_and_why():
    md = result([0.5, 0.6], status="collapsed", stopped="collapsed: kl=2 > 1").markdown()
    assert md.startswith("**Ended: collapsed** — collapsed: kl=2 > 1.\n\n- reward (training batches): first step")
    assert "stopped:" not in md  # the reason is in the head line, not repeated


@pytest.mark.parametrize(
    "remote, url",
    [
        ("git@github.com:org/ballast.git", "https://github.com/org/ballast/commit/abc123"),
        ("https://github.com/org/ballast", "https://github.com/org/ballast/commit/abc123"),
        ("https://gitlab.com/group/sub/ballast.git", "https://gitlab.com/group/sub/ballast/-/commit/abc123"),
        ("ssh://git@bitbucket.org/team/ballast.git", "https://bitbucket.org/team/ballast/commits/abc123"),
        ("/srv/git/ballast.git", None),
        ("", None),
    ],
)
def test_a_commit_links_to_its_code_host(remote, url):
    assert commit_link("abc123", remote) == url


def test_a_sweep_trial_reads_as_names_and_rounded_values_not_a_dict():
    from sweeps.report import format_values

    assert format_values({"grpo.beta": 0.0123456789, "lora.r": 8}) == "grpo.beta=0.0123, lora.r=8"
    assert format_values(None) == ""
