"""Every page Ballast writes — the run report, the probe report, the sweep summary and the comparison — opened in a
real headless Chromium (Debian's `chromium`, driven by Playwright's Python package): it renders without a console
error, shows its tables, every plot decodes, and no number has a long float tail or looks like a Python repr.

The pages are made by the same functions the pipeline, `ballast probe`, `ballast sweep` and `ballast compare` call,
from results built here (a synthetic training history, a probe report, a real Optuna study), so the tests need no
model. Each test also leaves a full-page screenshot under its tmp folder, for a person to look at.
"""

import re
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial

from tasks.compare import compare, plot_comparison, write_comparison_html
from tasks.report import PLOTS, draw_plot, plot_history, write_run_report
from tasks.results import Check, PipelineResult, ProbeReport, ProbeSample, PromptResult, StopReason
from tests.conftest import REPO
from trainer.config import HealthConfig
from trainer.health import REASONS

pytestmark = pytest.mark.integration  # a browser process

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
LONG_FLOAT = re.compile(r"\d\.\d{6,}")  # 0.1379762046749802
PYTHON_REPR = re.compile(r"\{'|\['|\bTrue\b|\bFalse\b|\bNone\b|\bnan\b")  # {'PRUNED': 4}, parity ok: True


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"{CHROMIUM} is missing: install Debian's chromium (`apt-get install -y chromium`; "
            "scripts/install.sh does it when run as root)"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


class Page:
    """A page opened in the browser, with what its console said."""

    def __init__(self, browser, path: Path):
        self.errors: list[str] = []
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(path.as_uri(), wait_until="load")
        self.page.screenshot(path=str(path.with_suffix(".png")), full_page=True)

    @property
    def text(self) -> str:
        return self.page.inner_text("body")

    def images(self) -> dict[str, bool]:
        """{alt: decoded} for every <img>."""
        return dict(
            self.page.eval_on_selector_all("img", "els => els.map(e => [e.alt, e.complete && e.naturalWidth > 0])")
        )

    def headers(self, table: int) -> list[str]:
        return self.page.eval_on_selector_all(
            f"table >> nth={table} >> tr >> nth=0 >> th", "els => els.map(e => e.innerText.trim())"
        )

    def rows(self, table: int) -> int:
        return self.page.locator(f"table >> nth={table} >> tr").count() - 1

    def links(self) -> dict[str, str]:
        return dict(
            self.page.eval_on_selector_all("a", "els => els.map(e => [e.innerText.trim(), e.getAttribute('href')])")
        )


def assert_clean(page: Page) -> None:
    assert page.errors == []
    assert not LONG_FLOAT.findall(page.text)
    assert not PYTHON_REPR.findall(page.text)
    assert all(page.images().values()), page.images()


# ── the run report ─────────────────────────────────────────────────────────────────────────────────


def history(steps: int, collapse_from: int | None = None) -> list[dict]:
    out = [{"step": 0, "eval/reward": 0.4123456789, "eval/accuracy": 0.25}]
    for s in range(1, steps + 1):
        bad = collapse_from is not None and s >= collapse_from
        out.append(
            {
                "step": s,
                "reward": 0.4 + 0.01 * s + 0.0012345678,
                "kl": 0.002 * s,
                "kl/k1": 0.0021 * s,
                "kl/k2": 0.0019 * s,
                "kl/k3": 0.002 * s,
                "completions/mean_length": 12.0 + (30 if bad else 0),
                "completions/max_length": 24.0,
                "completions/clipped_ratio": 0.95 if bad else 0.05,
                "health/ngram_repetition": 0.8 if bad else 0.1,
                "health/garbage_ratio": 0.0,
                "health/unique_token_ratio": 0.6,
                "entropy": 1.3 - 0.01 * s,
                "sampling/sampling_logp_difference/mean": 1e-6,
                "sampling/sampling_logp_difference/max": 1.2e-5,
            }
        )
    return out


def run_report(tmp: Path, steps: int, stopped: str | None = None, episodes: bool = False) -> Path:
    hist = history(steps, collapse_from=steps - 2 if stopped else None)
    plots = plot_history(hist, tmp / "plots", HealthConfig(), (steps, stopped) if stopped else None)
    result = PipelineResult(
        run_id="0123456789abcdef0123456789abcdef",
        output_dir=str(tmp),
        spec_name="quickstart",
        status="collapsed" if stopped else "finished",
        last_step=steps,
        stopped=StopReason.parse(stopped),
        history=hist[1:],
        trainer_seconds=61.234567,
        seconds=92.87654321,
        checkpoints={steps: f"{tmp}/checkpoints/step-{steps:06d}"},
        eval_start={"eval/reward": 0.4123456789, "eval/accuracy": 0.25},
        eval={"eval/reward": 0.6543210987, "eval/accuracy": 0.625, "eval/accuracy_stderr": 0.0401234},
        probe={
            "n_samples": 24,
            "n_malformed": 1,
            "malformed_rate": 1 / 24,
            "malformed_ci": [0.007, 0.2],
            "parity_ok": True,
            "passed": True,
        },
        run_name="quickstart-01234567",
        mlflow_url="http://127.0.0.1:5000/#/experiments/1/runs/0123?workflowType=x",
    )
    links = {"spec.yaml": "spec.yaml", "MLflow run": result.mlflow_url, "probe report": "probe/probe_report.html"}
    samples = {
        "Held-out samples (final checkpoint, step 30)": [
            {
                "step": steps,
                "prompt": "What is 23+58?",
                "answer": "81",
                "completion": "<answer>81</answer>",
                "reward": 1.0,
                "tokens": 9,
                "finish_reason": "stop",
                "truncated": False,
            },
        ],
        "Training samples (last step)": [
            {
                "step": steps,
                "prompt": "What is 7+46?",
                "answer": "53",
                "completion": "53 53 53 53 53 53",
                "reward": 0.10000001,
                "tokens": 24,
                "finish_reason": "length",
                "truncated": True,
            },
        ],
    }
    if episodes:  # a data.environment run's rows (trainer/samples.py): the whole conversation beside the last turn
        question = "Zoe has 9636 books and buys 2781 more. How many books does Zoe have?"
        samples = {
            "Held-out samples (final checkpoint, step 30)": [
                {
                    "step": steps,
                    "prompt": question,
                    "answer": "12417",
                    "completion": "Zoe has 12417 books.",
                    "reward": 1.1,
                    "tokens": 40,
                    "finish_reason": "stop",
                    "truncated": False,
                    "conversation": "\n".join(
                        [
                            "[system] You solve math problems with a calculator. # Tools ...",
                            "[user] Ava has 3127 stamps and buys 4518 more. How many stamps does Ava have now?",
                            '[assistant] <tool_call>{"name": "calculate", "arguments": {"expression": "3127 + 4518"}}',
                            "[tool calculate] 7645",
                            f"[user] {question}",
                            '[assistant | loss] <tool_call>{"name": "calculate", "arguments": '
                            '{"expression": "9636 + 2781"}}</tool_call>',
                            "[tool calculate] 12417",
                            "[assistant | loss] Zoe has 12417 books.",
                        ]
                    ),
                }
            ]
        }
    code = {"commit": "a" * 40, "dirty": True}
    return write_run_report(tmp / "report.html", result, plots, None, links, code, samples)


def test_run_report_renders_its_summary_and_every_plot(browser, tmp_path):
    page = Page(browser, run_report(tmp_path, steps=30))
    assert_clean(page)
    assert set(page.images()) == {"reward", "kl", "length", "health", "entropy", "sampling"}  # those with data
    text = page.text
    assert "training reward\tfirst 5 steps 0.431 → last 5 steps 0.681" in text
    assert "eval/reward (held out)\t0.412 before training → 0.654" in text
    assert "Ballast commit aaaaaaaaaaaa with uncommitted changes" in text
    assert page.links()["MLflow run"].startswith("http://127.0.0.1:5000/#/experiments/1/runs/")
    assert page.links()["spec.yaml"] == "spec.yaml"


def test_run_report_shows_what_the_model_wrote_and_held_out_uncertainty(browser, tmp_path):
    page = Page(browser, run_report(tmp_path, steps=30))
    assert_clean(page)
    text = page.text
    assert "eval/accuracy (held out)\t0.250 before training → 0.625 ± 0.079 (95 %)" in text
    assert "eval/accuracy_stderr" not in text  # shown beside its score, not as a score of its own
    assert "Held-out samples (final checkpoint, step 30)" in text and "Training samples (last step)" in text
    rows = re.sub(r"\s+", " ", text)  # a completion is a <pre>: the browser puts it on lines of its own
    assert "30 What is 23+58? 81 <answer>81</answer> 1 9 stop" in rows
    assert "30 What is 7+46? 53 53 53 53 53 53 53 0.1 24 length" in rows


def test_run_report_shows_an_episodes_turns_tool_calls_and_results_where_the_loss_applies(browser, tmp_path):
    """A data.environment run's samples: the episode from the row's question on — the model's turns marked `| loss`,
    its tool call, the tool's result — not only its last turn, and not the system prompt and worked example."""
    page = Page(browser, run_report(tmp_path, steps=30, episodes=True))
    assert_clean(page)
    rows = re.sub(r"\s+", " ", page.text)
    assert "episode (the model's turns marked | loss)" in rows
    assert (
        '[assistant | loss] <tool_call>{"name": "calculate", "arguments": {"expression": "9636 + 2781"}}</tool_call> '
        "[tool calculate] 12417 [assistant | loss] Zoe has 12417 books. 1.1 40 stop"
    ) in rows
    assert "[system]" not in rows and "3127 + 4518" not in rows  # the prompt's part, shown in the prompt column


def test_every_plot_legend_fits_its_figure_and_far_above_means_off_the_axis():
    """A legend as wide as its longest names would be cut at the figure's sides (the 'engine vs trainer logprob'
    plot's was); a threshold the axis already spans is drawn, only one far above it is named 'far above'."""
    hist = history(30)
    labels = {}
    for plot in PLOTS:
        fig = draw_plot(plot, hist, HealthConfig())
        if fig is None:
            continue
        fig.canvas.draw()
        legend = fig.axes[0].get_legend().get_window_extent()
        assert 0 <= legend.x0 and legend.x1 <= fig.bbox.width, plot.name
        labels[plot.name] = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "gate: health/ngram_repetition > 0.6" in labels["health"]  # 0.1 curve, 0.6 share beside it: on the axis
    assert "gate: completions/clipped_ratio > 0.9" in labels["health"]
    assert not [label for label in labels["health"] if "far above" in label]
    assert "gate: kl > 1 (far above the axis)" in labels["kl"]  # a 0.06 curve
    assert "gate: sampling/sampling_logp_difference/max > 0.5 (far above the axis)" in labels["sampling"]


def test_a_plot_of_a_few_steps_marks_whole_steps_only():
    """Three points at steps 10-12 (a gate's windowed signal, late in a short run): ticks 10, 11, 12, not 10.25."""
    import matplotlib.pyplot as plt

    history = [{"step": s, "hacking/correctness_rise": 0.8 - 0.4 * (s - 10)} for s in (10, 11, 12)]
    for plot in PLOTS:
        fig = draw_plot(plot, history)
        if fig is None:
            continue
        ticks = [t for t in fig.axes[0].get_xticks() if 10 <= t <= 12]
        plt.close(fig)
        assert ticks == [10, 11, 12], (plot.name, ticks)


def test_run_report_of_a_collapsed_run_says_why_in_its_banner(browser, tmp_path):
    page = Page(browser, run_report(tmp_path, steps=12, stopped="collapsed: health/ngram_repetition=0.8 > 0.6"))
    assert_clean(page)
    assert page.page.inner_text(".banner") == "collapsed — health/ngram_repetition=0.8 > 0.6"


def test_run_report_of_a_short_run_does_not_repeat_one_step_as_first_and_last(browser, tmp_path):
    page = Page(browser, run_report(tmp_path, steps=3))
    assert "first step 0.411 → last step 0.431" in page.text


# ── the probe report ───────────────────────────────────────────────────────────────────────────────


def probe_report(malformed: int = 1, n: int = 6, parity_ok: bool = True) -> ProbeReport:
    prompts = [("What is 23+58?", "81"), ("What is 7+46?", "53")]
    samples = []
    for i, (prompt, answer) in enumerate(prompts):
        for j in range(n // 2):
            bad = i * (n // 2) + j < malformed
            samples.append(
                ProbeSample(
                    i,
                    prompt,
                    j,
                    "81 81 81 81 81 81" if bad else f"<output>{answer}</output>",
                    ["repetition_loop: run '81 ' x6"] if bad else [],
                    bad,
                    18 if bad else 5,
                    "length" if bad else "stop",
                )
            )
    per_prompt = [
        PromptResult(
            i,
            p,
            f"<output>{a}</output>",
            None,
            n // 2,
            sum(s.malformed for s in samples if s.prompt_index == i),
            sum(s.malformed for s in samples if s.prompt_index == i) / (n // 2),
            {r: 0 for r in REASONS},
            7.333333333,
        )
        for i, (p, a) in enumerate(prompts)
    ]
    return ProbeReport(
        checkpoint="/runs/0123/checkpoints/step-000012",
        local_path="/runs/0123/checkpoints/step-000012",
        step=12,
        base_model="tiny-arith",
        trained_on="tiny-arith",
        code_ref={"commit": "b" * 40, "dirty": False},
        created_at="2026-01-01T00:00:00Z",
        seconds=7.0345678,
        n_prompts=2,
        n_samples=n,
        n_malformed=malformed,
        malformed_rate=malformed / n,
        malformed_ci=[0.0301, 0.56349],
        reason_counts={r: 0 for r in REASONS} | {"repetition_loop": malformed},
        parity_ok=parity_ok,
        parity_max_diff=9.5367431640625e-07,
        parity_tolerance=1e-3,
        checks={"parity": Check(parity_ok, "max |logprob diff| 9.54e-07 <= 0.001")},
        failures=[] if parity_ok else ["parity failed: reload the artifact"],
        per_prompt=per_prompt,
        samples=samples,
        settings={
            "n": 3,
            "temperature": 0.7,
            "max_tokens": 48,
            "format_tag": "output",
            "prompts_file": None,
            "max_malformed_rate": 0.25,
            "seed": 0,
        },
    )


def test_probe_report_defines_its_reasons_and_shows_every_sample_with_its_expected_answer(browser, tmp_path):
    page = Page(browser, probe_report().write_html(tmp_path / "probe_report.html"))
    assert_clean(page)
    tables = page.page.locator("table").count()
    sample_table = tables - 1
    assert page.headers(sample_table) == ["#", "prompt", "expected answer", "completion", "reasons", "tokens", "finish"]
    assert page.rows(sample_table) == 6
    reasons = page.page.locator("table >> nth=2 >> tr").all_inner_texts()[1:]
    assert [r.split("\t")[0] for r in reasons] == list(REASONS)
    assert all(r.split("\t")[2] for r in reasons)  # every reason has its definition on the page
    assert "bbbbbbbbbbbb" in page.text and "{'commit'" not in page.text


def test_probe_report_of_a_failed_probe_shows_the_failure(browser, tmp_path):
    page = Page(browser, probe_report(malformed=3, parity_ok=False).write_html(tmp_path / "probe_report.html"))
    assert_clean(page)
    assert page.page.inner_text(".banner").startswith("FAILED — 3 of 6 samples malformed (50.0%)")
    assert "parity failed: reload the artifact" in page.text


# ── the sweep summary ──────────────────────────────────────────────────────────────────────────────

SPACE = {"grpo.beta": FloatDistribution(1e-3, 0.2, log=True), "lora.r": CategoricalDistribution([4, 8, 16])}


FOUR_KNOBS = {  # examples/sweep.yaml's space: the widest trials table a shipped sweep draws
    **SPACE,
    "optim.learning_rate": FloatDistribution(3e-4, 1e-2, log=True),
    "rollout.repetition_penalty": FloatDistribution(1.0, 1.2),
}
PRUNER_REASON = (
    "pruned: eval/reward=0.4609 at step 10 is worse than the pruner's threshold (SuccessiveHalvingPruner over the "
    "trials so far)"
)


def sweep_summary(
    tmp: Path, complete: int, pruned: int, space: dict = SPACE, reason: str | None = None, baseline: bool = False
):
    from sweeps.report import plot_study, summarize
    from sweeps.space import load_sweep

    sweep = load_sweep(REPO / "examples" / "sweep.yaml")
    study = optuna.create_study(study_name=sweep.study_name, direction="maximize")
    study.set_metric_names(["eval/reward"])
    if baseline:  # the base model's score: each trial's gain over it gets its columns
        from sweeps.baseline import BASELINE_ATTR, Baseline

        study.set_user_attr(
            BASELINE_ATTR, Baseline("base model tiny", {"eval/reward": 0.489, "eval/reward_stderr": 0.04}, {}).to_json()
        )
    for i in range(complete + pruned):
        params = {"grpo.beta": 0.0123456789 * (i + 1), "lora.r": [4, 8, 16][i % 3]}
        params.update({k: d.low * (1 + 0.0123456789 * i) for k, d in space.items() if k not in params})
        steps = {s: 0.3 + 0.01 * s * (i + 1) for s in range(1, 6)}
        attrs = {"last_step": 5, "mlflow_run_id": f"{i:x}" * 32}
        if baseline:
            attrs.update(planned_steps=40, score=0.5 + 0.0712345678 * i, gain=0.0112345 + 0.07 * i, gain_stderr=0.04)
            attrs["beats_baseline"] = i > 1
        if i < complete:
            study.add_trial(
                create_trial(
                    params=params,
                    distributions=space,
                    value=0.5 + 0.0712345678 * i,
                    intermediate_values=steps,
                    user_attrs=attrs,
                )
            )
        else:
            attrs.update(
                prune_reason=reason or "collapsed: kl=3.2 > 1 for 2 consecutive steps",
                pruned_by="pruner" if reason else "health_gate",
            )
            study.add_trial(
                create_trial(
                    params=params,
                    distributions=space,
                    state=TrialState.PRUNED,
                    intermediate_values=steps,
                    user_attrs=attrs,
                )
            )
    summary = summarize(study, sweep)
    summary.plots, summary.plots_skipped = plot_study(study, sweep, tmp / "plots")
    summary.storage, summary.n_trials, summary.done = "sqlite:///.ballast/optuna.db", complete + pruned, True
    summary.parent_run_id, summary.dashboard = "f" * 32, "optuna-dashboard sqlite:///.ballast/optuna.db"
    summary.run_url_template = "http://127.0.0.1:5000/#/experiments/1/runs/{run_id}?workflowType=machine_learning"
    summary.write(tmp)
    return Path(summary.html), summary


def test_sweep_summary_is_a_table_of_trials_with_a_column_per_parameter_and_links(browser, tmp_path):
    html, summary = sweep_summary(tmp_path, complete=3, pruned=2)
    page = Page(browser, html)
    assert_clean(page)
    trials = next(i for i in range(page.page.locator("table").count()) if "why it stopped" in page.headers(i))
    assert page.headers(trials) == [
        "#",
        "state",
        "grpo.beta",
        "lora.r",
        "eval/reward",
        "steps",
        "why it stopped",
        "MLflow run",
    ]
    assert page.rows(trials) == 5
    assert "collapsed: kl=3.2 > 1 for 2 consecutive steps" in page.text
    assert page.links()["00000000"] == (
        "http://127.0.0.1:5000/#/experiments/1/runs/00000000000000000000000000000000?workflowType=machine_learning"
    )
    assert {"optimization_history", "slice", "parallel_coordinate", "intermediate_values"} <= set(page.images())


def test_the_trials_table_of_the_four_knobs_fits_a_1300_pixel_window(browser, tmp_path):
    """The shipped sweep's four parameters and the pruner's reasons: the table wraps its headers at the dots and the
    reasons in their column instead of running off the right of the page (a horizontal scroll hid the MLflow links)."""
    html, _ = sweep_summary(tmp_path, complete=3, pruned=3, space=FOUR_KNOBS, reason=PRUNER_REASON, baseline=True)
    page = Page(browser, html)
    page.page.set_viewport_size({"width": 1300, "height": 900})
    trials = next(i for i in range(page.page.locator("table").count()) if "why it stopped" in page.headers(i))
    assert {"optim.learning_rate", "rollout.repetition_penalty", "gain over the base model ± 95 %"} <= set(
        page.headers(trials)
    )
    assert page.page.evaluate("document.documentElement.scrollWidth") <= 1300


def test_sweep_summary_of_one_completed_trial_draws_no_comparison_plots(browser, tmp_path):
    html, summary = sweep_summary(tmp_path, complete=1, pruned=2)
    page = Page(browser, html)
    assert_clean(page)
    assert set(page.images()) == {"intermediate_values"}
    assert "optimization history (1 completed trial: nothing to compare yet)" in page.text


# ── the comparison ─────────────────────────────────────────────────────────────────────────────────


def test_comparison_page_shows_both_sides_the_test_and_its_plot(browser, tmp_path):
    result = compare(probe_report(malformed=0).to_dict(), probe_report(malformed=5).to_dict(), labels=("v1", "v2"))
    plots = plot_comparison(result, tmp_path / "plots")
    page = Page(browser, write_comparison_html(result, tmp_path / "comparison.html", plots, {"A": "a.json"}))
    assert_clean(page)
    assert page.headers(0) == ["", "A", "B"]
    assert "malformed rate\t0.0%\t83.3%" in page.text
    assert set(page.images()) == {"rates"}
    assert "not probed alike" not in page.text


def test_comparison_page_warns_when_the_sides_were_trained_on_other_base_models(browser, tmp_path):
    other = probe_report(malformed=0).to_dict() | {"trained_on": "HuggingFaceTB/SmolLM2-135M"}
    result = compare(probe_report(malformed=0).to_dict(), other, labels=("v1", "v2"))
    page = Page(browser, write_comparison_html(result, tmp_path / "comparison.html", [], {"A": "a.json"}))
    assert_clean(page)
    warning = page.page.inner_text(".banner.warn")
    assert warning.startswith("A and B were not probed alike: base model: v1 tiny-arith vs v2 HuggingFaceTB/SmolLM2")
