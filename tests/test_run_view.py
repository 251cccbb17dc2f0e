"""What a person watching `ballast run` sees, from one real run of the CLI on the tiny model with its output piped
(as tee or a CI log reads it): a progress line per training step and a line per stage as they happen, and at the
end the MLflow run's URL; in Prefect, the flow run named like the MLflow run, its lines in the run's log, a link
artifact to the MLflow run and a markdown summary; in MLflow, the same name."""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import REPO, tiny_spec

PREFECT_READ = """
import json
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId
with get_client(sync_client=True) as c:
    out = []
    for r in c.read_flow_runs():
        logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id])))
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[r.id])))
        out.append({"name": r.name, "logs": [l.message for l in logs],
                    "artifacts": [{"key": a.key, "type": a.type, "data": a.data} for a in arts]})
print("PREFECT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def piped_run(tiny_model, tmp_path_factory):
    """`ballast run` with stdout a pipe; (its output lines, each with the time it arrived), Prefect's record."""
    project = tmp_path_factory.mktemp("view")
    spec = project / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            tiny_spec(
                tiny_model,
                name="viewed",
                project_dir=str(project),
                probe={"n": 2, "max_tokens": 24, "max_malformed_rate": 1.0},
            )
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from flows.cli import main; sys.exit(main())", "run", str(spec)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = [line.rstrip("\n") for line in proc.stdout]
    assert proc.wait(timeout=900) == 0, "\n".join(lines)
    read = subprocess.run(
        [sys.executable, "-c", PREFECT_READ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        # Prefect's own server on the project's database; its 20 s start-up limit is too short for a 2-core machine
        # running other test files (CI, 2026-11-29), and its telemetry would be an error line with no network
        env=env
        | {
            "PREFECT_HOME": str(project / "prefect"),
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300",
            "DO_NOT_TRACK": "1",
        },
    )
    assert read.returncode == 0 and "PREFECT" in read.stdout, read.stderr[-3000:]
    flow_runs = json.loads(read.stdout.split("PREFECT", 1)[1])
    return project, lines, flow_runs


def mlflow_run(project):
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("ballast")
    return next(r for r in client.search_runs([experiment.experiment_id]) if "ballast.stage" not in r.data.tags)


def test_piped_output_has_a_line_per_training_step(piped_run):
    _, lines, _ = piped_run
    steps = [int(m.group(1)) for line in lines if (m := re.match(r"step (\d+)/4  reward ", line))]
    assert steps == [1, 2, 3, 4]


def test_every_stage_after_training_says_when_it_starts_and_ends(piped_run):
    _, lines, _ = piped_run
    for stage in ("checkpoint", "artifact-probe", "eval"):
        start = lines.index(f"▸ {stage} …")
        assert any(line.startswith(f"✓ {stage} done in ") for line in lines[start:])


def test_the_run_ends_with_the_url_of_its_mlflow_run_page(piped_run):
    project, lines, _ = piped_run
    run = mlflow_run(project)
    url = next(line.split(None, 2)[2] for line in lines if line.startswith("MLflow run:"))
    assert url.endswith(f"/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning")


def test_the_prefect_flow_run_has_the_mlflow_run_name(piped_run):
    project, _, flow_runs = piped_run
    run = mlflow_run(project)
    assert [r["name"] for r in flow_runs] == [run.info.run_name] == [f"viewed-{run.info.run_id[:8]}"]


def test_the_prefect_run_log_holds_the_runs_lines(piped_run):
    _, _, flow_runs = piped_run
    logs = flow_runs[0]["logs"]
    assert any(line.startswith("step 4/4  reward ") for line in logs)
    assert any(line.startswith("✓ eval done in ") for line in logs)


def test_prefect_has_a_link_to_the_mlflow_run_and_a_markdown_summary(piped_run):
    project, _, flow_runs = piped_run
    run = mlflow_run(project)
    artifacts = {a["key"]: a for a in flow_runs[0]["artifacts"]}
    assert set(artifacts) == {"ballast-viewed-mlflow-run", "ballast-viewed-summary"}
    assert run.info.run_id in artifacts["ballast-viewed-mlflow-run"]["data"]
    summary = artifacts["ballast-viewed-summary"]
    assert summary["type"] == "markdown" and "**Ended: finished.**" in summary["data"]


def test_an_in_training_eval_prints_its_line_on_a_terminal_with_its_uncertainty():
    """On a terminal the bar shows training progress; an eval's held-out scores get a line of their own above it."""
    import io
    import logging

    from rich.console import Console

    from flows.view import PipelineView

    screen = io.StringIO()
    view = PipelineView(
        50, console=Console(file=screen, force_terminal=True, width=200, highlight=False), log=logging.getLogger("t")
    )
    view.on_step(4, {"reward": 0.5, "kl": 0.01})  # a plain step: the bar shows it
    view.on_step(10, {"reward": 0.5, "eval/accuracy": 0.289, "eval/accuracy_stderr": 0.04, "eval/reward": 0.3})
    lines = [line for line in screen.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1
    assert lines[0].startswith("step 10/50  reward 0.5  eval/accuracy 0.289 ± 0.078  eval/reward 0.3  (")  # 95 %


def test_the_final_summary_shows_held_out_scores_with_their_95_percent_interval():
    from tasks.results import PipelineResult

    result = PipelineResult(
        run_id="r",
        output_dir="/tmp/r",
        status="finished",
        eval_start={"eval/accuracy": 0.25},
        eval={"eval/accuracy": 0.289, "eval/accuracy_stderr": 0.0402, "eval/reward": 0.31},
    )
    assert [line for line in result.lines() if "held out" in line] == [
        "eval/accuracy (held out): 0.250 before training → 0.289 ± 0.079 (95 %)",
        "eval/reward (held out): 0.310",
    ]


def test_a_stop_reason_is_read_once_into_its_kind_and_message():
    from tasks.results import StopReason

    collapsed = StopReason.parse("collapsed: kl=2 > 1 for 2 consecutive steps")
    assert (collapsed.kind, collapsed.message) == ("collapsed", "kl=2 > 1 for 2 consecutive steps")
    assert str(collapsed) == "collapsed: kl=2 > 1 for 2 consecutive steps"
    assert StopReason.parse("pruned: reward=0.1 at step 3") == StopReason("pruned", "reward=0.1 at step 3")
    assert StopReason.parse(None) is None
