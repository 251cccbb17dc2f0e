"""What a user reads agrees with the statistics (issue 30): the plots' legends list only what happened and their log
axes are labelled, a trial's bar is its paired interval read against the base model's line (no band of the base
model's own interval), the sweep's MLflow experiment is its study's, `ballast validate SWEEP` refuses an edited file
of an existing study as the run would, and a busy machine is said at the start."""

import math
import subprocess
import sys
import time

import optuna
import pytest
import yaml

from flows.machine import load_warning
from sweeps.report import _legend_kinds, _plot_row, _slice
from sweeps.space import baseline_spec, load_sweep
from tasks.spec import validate_spec
from tests.conftest import tiny_spec
from tests.test_sweep_baseline import relative_study, sweep_of


def test_legends_list_only_the_kinds_of_trial_that_happened():
    labels = [h.get_label() for h in _legend_kinds([{"kind": "COMPLETE"}, {"kind": "pruned"}])]
    assert labels == ["complete", "pruned (pruner)"]  # nothing collapsed: no 'collapsed' in the legend


def test_a_log_scaled_parameter_axis_has_labelled_ticks_and_each_trial_its_paired_interval(tmp_path):
    study = relative_study([0.32, 0.75, 0.5], collapsed=0)
    sweep = sweep_of(tmp_path)
    rows = [_plot_row(t, sweep) for t in study.trials]
    assert all(r["ci95"] == pytest.approx(1.96 * t.user_attrs["gain_stderr"]) for r, t in zip(rows, study.trials)
               if t.state.name == "COMPLETE")  # fmt: skip
    fig = _slice(rows, sweep, "eval/reward", (0.3, 0.0))
    lr_axis = fig.axes[0]
    labels = [t.get_text() for t in lr_axis.get_xticklabels()]
    assert labels == ["1.00e-04", "7.07e-03", "0.5"]  # the range's ends and its geometric middle
    assert [t for t in lr_axis.get_xticks()] == pytest.approx([1e-4, math.sqrt(1e-4 * 0.5), 0.5])
    middle = [dict(r, params={**r["params"], "optim.learning_rate": 3e-3}) for r in rows]  # none near the ends
    low, high = _slice(middle, sweep, "eval/reward", (0.3, 0.0)).axes[0].get_xlim()
    assert low < 1e-4 and high > 0.5  # the range's ends on the axis whatever the trials sampled: their labels drawn
    fours = [dict(r, params={**r["params"], "lora.r": 4}) for r in rows]  # one of three choices sampled
    rank_axis = _slice(fours, sweep, "eval/reward", (0.3, 0.0)).axes[1]
    assert [t.get_text() for t in rank_axis.get_xticklabels()] == ["4", "8", "16"]
    assert rank_axis.get_xlim()[0] < 0 and rank_axis.get_xlim()[1] > 2  # every choice on the axis
    legend = [t.get_text() for t in lr_axis.get_legend().get_texts()] if lr_axis.get_legend() else []
    legend += [t.get_text() for t in fig.axes[-1].get_legend().get_texts()]
    assert "base model ± 95 %" not in legend and "bars: each trial's paired 95 % interval" in legend
    assert "collapsed (health gate)" not in legend


def test_the_sweeps_mlflow_experiment_is_named_after_its_study(tmp_path):
    sweep = sweep_of(tmp_path)
    assert validate_spec(baseline_spec(sweep), "x").tracking.experiment == "rel"
    named = sweep_of(tmp_path, overrides={"tracking.experiment": "mine"})
    assert validate_spec(baseline_spec(named), "x").tracking.experiment == "mine"


def test_a_busy_machine_is_said_with_the_fix():
    spec = validate_spec(tiny_spec("/models/not-loaded-here", model={"torch_threads": 2}), "x")
    line = load_warning(spec, load=2.6, cpus=2)
    assert line.startswith(
        "warning: this machine is busy (other processes use 2.6 of its 2 cores) and each trial uses 2 torch threads"
    )
    assert "--set model.torch_threads=1" in line
    assert load_warning(spec, load=0.2, cpus=2) is None
    one = validate_spec(tiny_spec("/models/not-loaded-here", model={"torch_threads": 1}), "x")
    line = load_warning(one, load=6.7, cpus=2)  # one thread already: fewer is no advice, only the other work is
    assert line.endswith("stop the other work") and "torch_threads" not in line, line
    assert load_warning(spec, load=1.0, cpus=8) is None


def test_the_busy_check_measures_what_other_processes_use_now():
    """It read the load average, which counts tasks waiting on I/O and lags by a minute: 0.7 on this project's idle
    2-core VMs, so every sweep started with a warning of a busy machine. A process spinning beside it is seen."""
    from flows.machine import others_cpus

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started
        assert others_cpus(1.0) >= 0.7  # its core, or on a loaded machine its share and the rest of the load
    finally:
        spinner.kill()
        spinner.wait()


def test_validate_refuses_an_edited_sweep_file_of_an_existing_study(tiny_model, tmp_path, capsys):
    from flows.cli import main
    from sweeps.study import make_storage, open_study

    project = tmp_path / "p"
    base = tiny_spec(tiny_model, project_dir=str(project))
    data = {"study": "edited", "base": base, "space": {"grpo.beta": {"type": "float", "low": 0.01, "high": 0.1}},
            "overrides": {"optim.steps": 4}, "trials": 2}  # fmt: skip
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    project.mkdir()
    sweep = load_sweep(path)
    open_study(sweep, make_storage(f"sqlite:///{project / 'optuna.db'}"))
    assert main(["validate", str(path)]) == 0
    assert "resumes   study edited in sqlite:///" in capsys.readouterr().out
    data["overrides"]["optim.steps"] = 6
    path.write_text(yaml.safe_dump(data))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        "study 'edited' already exists in this storage with a different 'overrides'" in err and "\n" not in err.strip()
    )
    assert optuna.load_study(study_name="edited", storage=f"sqlite:///{project / 'optuna.db'}")


def test_a_trial_run_carries_its_log_scaled_parameters_as_their_log_and_a_pruned_gain_apart(tmp_path):
    """MLflow's Compare draws linear axes: a log-scaled parameter is also logged as log10/<name>; a pruned trial's
    gain is `Gain at stop/*`, never mixed with the completed trials' final `Gain/*`."""
    from sweeps.space import base_spec
    from tasks.sweep_record import SweepRecorder

    study = relative_study([0.75], collapsed=0, pruned=1)
    sweep = sweep_of(tmp_path)
    recorder = SweepRecorder(validate_spec(base_spec(sweep), "x"), "rel")
    recorder.objective, recorder.log_scaled = "eval/reward", ["optim.learning_rate"]
    recorder.open_parent(study, {}, {})
    runs = {}
    for t in study.trials:
        runs[t.number] = recorder.tracking.create_run(f"trial {t.number}", recorder.parent_run_id)
        recorder.tracking.set_tags(runs[t.number], {"study": "rel", "trial_number": t.number})
        t.user_attrs["gain_metric"] = "eval/reward"
        t.user_attrs.setdefault("gain", -0.1)  # the pruned trial's, at the step it stopped
        t.user_attrs.setdefault("gain_stderr", 0.05)
        recorder.record_trial(study, t)
    done, pruned = (recorder.client.get_run(runs[n]).data.metrics for n in (0, 1))
    assert done["log10/optim.learning_rate"] == pytest.approx(math.log10(study.trials[0].params["optim.learning_rate"]))
    assert "Gain/eval/reward" in done and "Gain at stop/eval/reward" not in done
    assert "Gain at stop/eval/reward" in pruned and "Gain/eval/reward" not in pruned


def test_a_seed_runs_progress_line_shows_the_score_the_trials_lines_show(tmp_path, capsys):
    from flows.trials.lines import seed_progress

    sweep = sweep_of(tmp_path, objectives=[{"metric": "eval/accuracy", "direction": "maximize"}])
    progress = seed_progress(sweep, 0, 1, steps=8)
    progress.tty = False
    progress.on_step(4, {"reward": 0.25, "eval/reward": 0.1, "eval/accuracy": 0.4})
    line = capsys.readouterr().out.strip()
    assert line.startswith("trial 0 (seed +1): step 4/8, reward 0.250, eval/accuracy 0.400")  # not eval/reward
