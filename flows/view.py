"""What a person watching a pipeline run sees besides MLflow: the terminal and Prefect.

* Terminal. On a terminal the trainer draws its progress bar; every later stage (checkpoint, artifact-probe, eval)
  shows a spinner with its name and elapsed time, so the screen never sits frozen with nothing named, and says
  what it found when it ends. Piped (tee, CI logs) there is no bar to redraw: one line per stage and about
  PIPED_LINES lines of training progress instead, each flushed as it is written.
* Prefect. The same lines go to the flow run's log through Prefect's run logger (the UI's Logs tab); the flow run
  takes the MLflow run's name (`<spec>-<run id[:8]>`); a link artifact points at the MLflow run and a markdown
  artifact holds the summary, both keyed by the spec's name so the Artifacts page keeps their history.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import yaml
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from rich.console import Console

from tasks.checkpoint import CheckpointSet
from tasks.eval import EvalResult
from tasks.fork import ForkSource
from tasks.probe_report import ProbeReport
from tasks.record import RunView
from tasks.summary import PipelineResult
from tasks.train import RunInterrupted, TrainOutcome

PIPED_LINES = 20  # about this many training-progress lines per run when output is piped


class PipelineView(RunView):
    """The terminal and the Prefect run log of one pipeline run. `terminal=False` (sweep trials): Prefect only."""

    def __init__(self, total_steps: int, terminal: bool = True):
        self.console = Console(soft_wrap=True, highlight=False)
        self.terminal, self.total = terminal, total_steps
        self.piped = not self.console.is_terminal
        self.every = max(1, round(total_steps / PIPED_LINES))
        self.log = get_run_logger()
        self.started = time.perf_counter()
        self._status = None

    @property
    def bar(self) -> bool:
        """Whether the trainer should draw its progress bar (a terminal that can redraw it)."""
        return self.terminal and not self.piped

    def say(self, line: str, terminal: bool = True) -> None:
        self.log.info(line)
        if self.terminal and terminal:
            self.console.print(line)

    def stage_started(self, name: str) -> None:
        self.log.info(f"{name}: started")
        if not self.terminal or name in ("fork", "train"):  # the fork was verified already; training has its bar
            return
        if self.piped:
            self.console.print(f"▸ {name} …")
        else:
            self._status = self.console.status(f"[bold]{name}[/bold] …")
            self._status.start()

    def stage_ended(self, name: str, seconds: float, error: BaseException | None) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        if error or name != "fork":  # the fork stage only records the source verified before the run began
            ended = (
                "stopped after"
                if isinstance(error, RunInterrupted) or not isinstance(error, Exception)
                else "failed after"
            )  # a signal (SIGTERM, Ctrl-C), not an error
            self.say(f"{'✗' if error else '✓'} {name} {ended if error else 'done in'} {seconds:.1f} s")

    def recorded(self, result) -> None:
        line = describe(result)
        if line:
            self.say(line if isinstance(result, ForkSource) else f"  {line}")

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if step and step % self.every and step != self.total and not any(k.startswith("eval/") for k in metrics):
            return
        elapsed = time.perf_counter() - self.started
        keys = [k for k in ("reward", "kl", "completions/mean_length") if k in metrics]
        keys += sorted(k for k in metrics if k.startswith("eval/"))
        values = "  ".join(f"{k} {metrics[k]:.4g}" for k in keys)
        self.say(f"step {step}/{self.total}  {values}  ({elapsed:.0f} s)", terminal=self.piped)

    def opened(self, run_name: str, url: str, spec_name: str) -> None:
        """The flow run takes the MLflow run's name and links to it."""
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run_id=flow_run.id, name=run_name)
        create_link_artifact(
            link=url,
            link_text=f"MLflow run {run_name}",
            key=artifact_key(spec_name, "mlflow-run"),
            description="This pipeline run's lineage, params, metrics and artifacts in MLflow",
        )
        self.say(f"MLflow run {run_name}: {url}", terminal=False)

    def finished(self, result: PipelineResult) -> None:
        """The markdown summary artifact."""
        links = [f"[MLflow run {result.run_name}]({result.mlflow_url})"] + [
            f"{name} report: `{path}`" for name, path in result.reports.items()
        ]
        create_markdown_artifact(
            markdown=f"# {result.run_name}\n\n{result.markdown()}\n\n" + "  \n".join(links),
            key=artifact_key(result.spec_name, "summary"),
            description="How this pipeline run ended",
        )


def starting_name() -> str:
    """The flow run's name until the MLflow run exists (then `opened` renames it): the spec's name, or the name of
    the run a resume continues."""
    params = flow_run.parameters
    if params.get("resume_run_id"):
        return f"resume-{params['resume_run_id'][:8]}"
    spec = params.get("spec")
    name = spec.get("name") if isinstance(spec, dict) else None
    if name is None and isinstance(spec, str):
        try:
            name = (yaml.safe_load(Path(spec).read_text()) or {}).get("name")
        except (OSError, yaml.YAMLError, AttributeError):
            name = None
    return f"{name or 'experiment'}-starting"


def describe(result) -> str | None:
    """One line saying what a stage found."""
    if isinstance(result, ForkSource):
        if result.checkpoint_uri is None:
            return "fork: starting from the base model"
        diff = "" if result.max_logprob_diff is None else f" (max |logprob diff| {result.max_logprob_diff:.2g})"
        return f"fork: starting from {result.describe()}, verified{diff}"
    if isinstance(result, TrainOutcome):
        return f"train: {'stopped at' if result.stopped else 'ended at'} step {result.last_step}" + (
            f" — {result.stopped}" if result.stopped else ""
        )
    if isinstance(result, CheckpointSet):
        return f"checkpoint: {len(result.uris)} kept in the store, final {result.final_uri}"
    if isinstance(result, ProbeReport):
        return (
            f"artifact-probe: step {result.step}: {result.n_malformed}/{result.n_samples} = {result.versus()}, "
            f"parity {'ok' if result.parity_ok else 'FAILED'} → {'passed' if result.passed else 'FAILED'}"
        )
    if isinstance(result, EvalResult):
        return "eval: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(result.metrics.items()))
    return None


def artifact_key(spec_name: str, what: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) for one spec's artifacts of one kind."""
    return re.sub(r"[^a-z0-9]+", "-", f"ballast-{spec_name}-{what}".lower()).strip("-")
