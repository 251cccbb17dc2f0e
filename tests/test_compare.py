"""Comparing two probe results: the field's numbers (0/108 vs 35/72) are a regression with p far below
0.001, equal rates are not, a B that got better is not (the test is one-sided), a B whose artifacts fail
parity is; and `ballast compare` exits 0 / 1 / 2 for no regression / regression / bad arguments."""

import json

import pytest

from tasks.compare import (
    compare,
    format_differences,
    format_verdict,
    plot_comparison,
    pool_reports,
    resolve_target,
)
from tasks.probe import wilson_interval
from tasks.results import REPORT_KIND
from trainer.health import REASONS


def report(n_malformed: int, n_samples: int, parity_ok: bool = True, checkpoint: str = "ckpt", **extra) -> dict:
    """A probe report with only the fields a comparison reads (and `extra`: trained_on, settings)."""
    return extra | {
        "kind": REPORT_KIND,
        "schema_version": 1,
        "checkpoint": checkpoint,
        "n_samples": n_samples,
        "n_malformed": n_malformed,
        "malformed_rate": n_malformed / n_samples,
        "parity_ok": parity_ok,
        "passed": parity_ok and n_malformed / n_samples <= 0.25,
        "failures": [] if parity_ok else ["parity failed: ..."],
        "reason_counts": {r: (n_malformed if r == "repetition_loop" else 0) for r in REASONS},
    }


def test_the_field_numbers_are_a_regression_with_p_far_below_0_001():
    result = compare(report(0, 108), report(35, 72))
    assert result.verdict == "regression" and result.regression and result.rate_regression
    assert result.p_value < 1e-3
    assert result.p_value == pytest.approx(1.78e-17, rel=0.01)
    assert result.summary == (
        "regression: B malformed 35/72 (48.6%) vs A 0/108 (0.0%), Fisher exact p=1.8e-17 (one-sided, alpha 0.01)"
    )


@pytest.mark.parametrize("a, b", [((0, 108), (0, 108)), ((5, 60), (5, 60)), ((35, 72), (35, 72)), ((3, 18), (4, 18))])
def test_equal_or_similar_rates_are_no_regression(a, b):
    result = compare(report(*a), report(*b))
    assert result.verdict == "no regression" and not result.regression
    assert result.p_value > 0.01
    assert format_verdict(result).startswith("no regression: B malformed")


def test_a_b_that_got_better_is_no_regression():
    result = compare(report(35, 72), report(0, 108))
    assert not result.regression and result.p_value == pytest.approx(1.0)


def test_intervals_are_wilson_95():
    result = compare(report(0, 108), report(35, 72))
    assert result.a.malformed_ci == pytest.approx([0.0, 0.0343], abs=1e-4)
    assert result.b.malformed_ci == pytest.approx([0.3743, 0.5993], abs=1e-4)
    assert wilson_interval(0, 0) == [0.0, 1.0]


def test_alpha_sets_the_verdict():
    a, b = report(0, 18), report(4, 18)  # one-sided p = 0.052
    assert not compare(a, b, alpha=0.01).regression
    assert compare(a, b, alpha=0.1).regression
    with pytest.raises(ValueError, match="alpha"):
        compare(a, b, alpha=1.5)


def test_parity_failure_only_in_b_is_a_regression_even_at_equal_rates():
    result = compare(report(0, 24), report(0, 24, parity_ok=False))
    assert result.regression and result.parity_regression and not result.rate_regression
    assert "B fails parity in 1 of 1 artifact(s) while A passes" in result.summary
    assert not compare(report(0, 24, parity_ok=False), report(0, 24, parity_ok=False)).regression


def test_pooled_reports_add_up_and_count_unloadable_artifacts_as_parity_failures():
    unloadable = {
        "checkpoint": "c3",
        "error": "cannot load",
        "passed": False,
        "parity_ok": False,
        "n_samples": 0,
        "n_malformed": 0,
        "failures": ["cannot load"],
        "reason_counts": {},
    }
    pooled = pool_reports([report(1, 24, checkpoint="c1"), report(3, 24, checkpoint="c2"), unloadable], label="main")
    assert (pooled["n_samples"], pooled["n_malformed"], pooled["n_reports"]) == (48, 4, 3)
    assert pooled["malformed_ci"] == wilson_interval(4, 48)
    assert pooled["reason_counts"]["repetition_loop"] == 4
    assert not pooled["parity_ok"] and pooled["n_parity_failed"] == 1 and pooled["n_failed"] == 1
    assert pooled["failures"] == ["c3: cannot load"]
    result = compare(pool_reports([report(0, 24)] * 3, "old"), pooled, labels=("old", "main"))
    assert result.regression and result.summary.startswith("regression: main malformed 4/48")


def test_sides_trained_on_other_base_models_or_probed_hotter_are_named():
    settings = {"temperature": 0.7, "max_tokens": 48, "prompts": "held-out", "seed": 0, "device": "cpu"}
    a = report(0, 108, trained_on="tiny-arith", settings=settings)
    b = report(0, 108, trained_on="HuggingFaceTB/SmolLM2-135M", settings=settings | {"temperature": 1.2, "seed": 3})
    result = compare(a, b, labels=("v1", "v2"))
    assert not result.regression  # the verdict is the test's; the warning stands beside it
    assert result.differences == [
        "base model: v1 tiny-arith vs v2 HuggingFaceTB/SmolLM2-135M",
        "temperature: v1 0.7 vs v2 1.2",
    ]  # seed and device do not move a malformed rate: not named
    assert format_differences(result).startswith("warning: v1 and v2 were not probed alike (base model: v1 tiny")
    assert compare(a, dict(a)).differences == []
    assert compare(report(0, 108), b).differences == []  # a report that records nothing is not called different


def test_pooled_reports_keep_the_conditions_they_share_and_mark_the_mixed_ones():
    runs = [report(0, 24, trained_on="tiny-arith", settings={"temperature": t, "max_tokens": 48}) for t in (0.7, 1.0)]
    pooled = pool_reports(runs, label="main")
    assert pooled["conditions"] == {
        "base model": "tiny-arith",
        "temperature": {"mixed": [0.7, 1.0]},
        "max_tokens": 48,
    }
    single = report(0, 24, trained_on="tiny-arith", settings={"temperature": 0.7, "max_tokens": 48})
    assert compare(pool_reports([single] * 2), pooled).differences == ["temperature: A 0.7 vs main mixed (0.7 | 1.0)"]


def test_the_json_form_holds_every_field_the_verdict_and_its_line():
    result = compare(report(0, 108), report(35, 72))
    saved = json.loads(json.dumps(result.to_dict()))
    assert saved["kind"] == "ballast-comparison" and saved["table"] == [[0, 108], [35, 37]]
    assert (saved["verdict"], saved["regression"], saved["summary"]) == ("regression", True, result.summary)
    assert saved["a"]["malformed_ci"] == result.a.malformed_ci and saved["b"]["label"] == "B"


def test_plots_show_rates_and_curves_side_by_side(tmp_path):
    result = compare(report(0, 108), report(35, 72))
    history = [{"step": s, "reward": 0.1 * s, "kl": 0.01 * s} for s in range(1, 6)]
    paths = plot_comparison(result, tmp_path, history_a=[history, history], history_b=history)
    assert [p.name for p in paths] == ["rates.png", "curves.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)
    assert [p.name for p in plot_comparison(result, tmp_path / "no-history")] == ["rates.png"]


def test_resolve_target_reads_a_report_and_refuses_other_json(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(report(1, 10)))
    assert resolve_target(str(good)) == (report(1, 10), None)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a Ballast probe report"):
        resolve_target(str(other))
    with pytest.raises(FileNotFoundError, match="neither"):
        resolve_target(str(tmp_path / "missing.json"))


def test_resolve_target_reads_an_mlflow_runs_probe_report_and_metric_history(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("e", artifact_location=(tmp_path / "mlruns").as_uri())
    run_id = client.create_run(experiment).info.run_id
    for step in (1, 2, 3):
        client.log_metric(run_id, "reward", 0.1 * step, step=step)
    for step, bad in ((2, 5), (4, 1)):  # the newest probe report is the one compared
        folder = tmp_path / f"step-{step:06d}"
        folder.mkdir()
        (folder / "probe_report.json").write_text(json.dumps(report(bad, 24)))
        client.log_artifacts(run_id, str(folder), f"probe/step-{step:06d}")
    got, history = resolve_target(run_id, tracking_uri=uri)
    assert got["n_malformed"] == 1
    assert [(m["step"], m["reward"]) for m in history] == [(1, 0.1), (2, 0.2), (3, pytest.approx(0.3))]
    with pytest.raises(ValueError, match="was not found"):
        resolve_target("0" * 32, tracking_uri=uri)


# ── the command ────────────────────────────────────────────────────────────────────────────────────


@pytest.fixture
def reports(tmp_path):
    paths = {}
    for name, (bad, n) in {"old": (0, 108), "new": (35, 72), "same": (0, 108)}.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(report(bad, n)))
    return paths


def test_cli_compare_exits_1_on_a_regression_and_writes_results(reports, tmp_path, capsys):
    from flows.cli import main

    rc = main(
        [
            "compare",
            str(reports["old"]),
            str(reports["new"]),
            "--json",
            str(tmp_path / "cmp.json"),
            "--html",
            str(tmp_path / "cmp.html"),
            "--label-a",
            "v1",
            "--label-b",
            "v2",
        ]
    )
    assert rc == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(
        "regression: v2 malformed 35/72 (48.6%) vs v1 0/108 (0.0%), Fisher exact p=1.8e-17"
    )
    saved = json.loads((tmp_path / "cmp.json").read_text())
    assert saved["verdict"] == "regression" and saved["p_value"] < 1e-3
    assert saved["a"]["source"] == str(reports["old"]) and saved["b"]["n_malformed"] == 35
    page = (tmp_path / "cmp.html").read_text()
    assert "regression: v2 malformed" in page and "data:image/png;base64" in page


def test_cli_compare_exits_0_on_equal_rates(reports, capsys):
    from flows.cli import main

    assert main(["compare", str(reports["old"]), str(reports["same"])]) == 0
    assert capsys.readouterr().out.startswith("no regression")


def test_cli_compare_warns_when_the_sides_were_trained_on_other_base_models(tmp_path, capsys):
    from flows.cli import main

    paths = []
    for name, model in (("a", "tiny-arith"), ("b", "HuggingFaceTB/SmolLM2-135M")):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report(0, 108, trained_on=model, settings={"temperature": 0.7})))
    rc = main(["compare", *map(str, paths), "--json", str(tmp_path / "cmp.json"), "--html", str(tmp_path / "c.html")])
    out, err = capsys.readouterr()
    assert rc == 0 and out.startswith("no regression")
    warning = "warning: A and B were not probed alike (base model: A tiny-arith vs B HuggingFaceTB/SmolLM2-135M)"
    assert len(err.splitlines()) == 1 and err.startswith(warning)  # one line, on stderr: stdout stays the verdict
    assert json.loads((tmp_path / "cmp.json").read_text())["differences"] == [
        "base model: A tiny-arith vs B HuggingFaceTB/SmolLM2-135M"
    ]
    assert (
        "not probed alike: base model: A tiny-arith vs B HuggingFaceTB/SmolLM2-135M"
        in (tmp_path / "c.html").read_text()
    )


def test_cli_compare_bad_arguments_exit_2(reports, tmp_path, capsys):
    from flows.cli import main

    assert main(["compare", str(reports["old"]), str(tmp_path / "missing.json")]) == 2
    assert "B:" in capsys.readouterr().err
    assert main(["compare", str(reports["old"]), str(reports["new"]), "--alpha", "2"]) == 2
    not_a_report = tmp_path / "x.json"
    not_a_report.write_text("[1, 2]")
    assert main(["compare", str(not_a_report), str(reports["new"])]) == 2
