"""The sweep summary page after a confirmation, opened in headless Chromium (tests/test_pages.py's browser): the
verdict is the confirmation's, selection and confirmation scores stand apart, the seed spread is shown, the ✓ and ±
are explained once. The study is a simulated sweep through the real code (tests/test_sweep_statistics.py): one
setting of twelve truly better, confirmed on 128 prompts and three training seeds. A screenshot is left at
SCREENSHOT for a person to look at."""

import os
import shutil
from pathlib import Path

import pytest

from sweeps.report import plot_study, summarize
from tests.test_pages import LONG_FLOAT, PYTHON_REPR, Page, browser  # noqa: F401  (the fixture)
from tests.test_sweep_statistics import TRIALS, simulated_study

pytestmark = pytest.mark.integration  # a browser process

SCREENSHOT = os.environ.get("BALLAST_SWEEP_SCREENSHOT")  # where to copy the page's screenshot, if anywhere


@pytest.fixture(scope="module")
def confirmed_page(tmp_path_factory, browser):  # noqa: F811
    out = tmp_path_factory.mktemp("page")
    effects = [0.0] * TRIALS
    effects[4] = 1.2
    sweep, study, c = simulated_study(0, effects)
    s = summarize(study, sweep)
    s.plots, s.plots_skipped = plot_study(study, sweep, out / "plots")
    s.write(out)
    page = Page(browser, Path(s.html))
    if SCREENSHOT:
        shutil.copy(Path(s.html).with_suffix(".png"), SCREENSHOT)
    return s, c, page


def test_the_page_gives_the_confirmed_verdict_with_the_selection_score_beside_it(confirmed_page):
    s, c, page = confirmed_page
    text = page.text
    assert not page.errors
    assert c.beats and c.claimed == 4
    assert s.verdict_line().startswith("trial 4 beats the base model on all 3 seeds")
    banner = page.page.inner_text(".banner")
    assert banner.startswith("trial 4 beats the base model") and "best on confirmation" in banner
    assert "Verdict: confirmed on prompts the search never saw" in text
    assert "128 confirmation prompts no trial decision reads" in text
    assert "on the selection prompts: score" in text and "on the confirmation prompts (128): score" in text
    assert "across 3 seeds" in text  # the seed spread
    assert "Best trial on the selection prompts" in text and "selection gain ± 95 % (one comparison)" in text
    assert text.count("✓ = the gain's 95 % interval lies wholly above zero") == 1
    assert "compute: trials ran" not in text  # the cost line's minutes say it (no nodes, one trial at a time)
    assert not LONG_FLOAT.search(text) and not PYTHON_REPR.search(text)


def test_the_summary_lines_say_what_the_verdict_rests_on(confirmed_page):
    s, c, _ = confirmed_page
    lines = s.lines()
    assert any(line.startswith("best on confirmation: trial 4") for line in lines)
    assert any(line.startswith("seeds: trial 4 ") and "across 3 seeds" in line for line in lines)
    assert any(line.startswith("kept: ") and "survived confirmation and 3 seeds" in line for line in lines)
    assert any(line.startswith("± is a 95 % interval simultaneous over the 3 trials") for line in lines)
    assert s.best["number"] == 4
    # the claimed trial's settings follow the verdict's footnote: named, not an indented '  with ...' that read as
    # the footnote's; no compute line repeating the cost line's minutes (no nodes, the trials one after another)
    settings = next(line for line in lines if "'s settings: " in line)
    assert settings.startswith("trial 4's settings: ") and "(MLflow run " in settings
    assert not any(line.startswith(("  with ", "compute: ")) for line in lines)


def test_every_plot_is_shown_at_most_at_its_own_size_and_a_narrow_one_beside_another(confirmed_page):
    """A plot is a raster image: stretched past its pixels it only grows blurred (the one-parameter slice plot was
    laid across the whole page, about three times its own width and height). Each is shown at most at its own size,
    and one narrower than a grid cell sits in a cell, not on a row of its own."""
    _, _, page = confirmed_page
    shown = page.page.eval_on_selector_all(
        ".plots img", "els => els.map(e => [e.alt, e.width, e.height, e.naturalWidth, e.naturalHeight, e.className])"
    )
    assert {alt for alt, *_ in shown} >= {"slice", "optimization_history"}
    for alt, width, height, natural_width, natural_height, _ in shown:
        assert 0 < width <= natural_width and 0 < height <= natural_height, (alt, width, height)
    slice_ = next(s for s in shown if s[0] == "slice")
    assert slice_[3] < 700 and slice_[5] == ""  # one parameter: a cell's plot, not a row's
