"""What a person watching a pipeline run sees besides MLflow: the terminal and Prefect.

* Terminal. On a terminal the trainer draws its progress bar; every later stage (checkpoint, artifact-probe, eval)
  shows a spinner with its name and elapsed time, so the screen never sits frozen with nothing named, and says
  what it found when it ends. Piped (tee, CI logs) there is no bar to redraw: one line per stage and about
  PIPED_LINES lines of training progress instead, each flushed as it is written.
  An in-training eval prints its line on a terminal too, above the bar.
* Prefect. The same lines go to the flow run's log through Prefect's run logger (the UI's Logs tab); the flow run
  takes the MLflow run's name (`<spec>-<run id[:8]>`), or `<spec>-failed` when it fails before that run exists; a
  link artifact points at the MLflow run and a markdown artifact holds the summary, both keyed by the spec's name
  so the Artifacts page keeps their history. The MLflow run links back: FLOW_RUN_ID_TAG and FLOW_RUN_URL_TAG.

The flow (flows/pipeline.py) tells the view what happened; the recorder (tasks/record.py) never calls it.
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
from prefect.settings import PREFECT_UI_URL
from rich.console import Console

from flows import runtime
from tasks.checkpoint import CheckpointSet
from tasks.fork import ForkSource
from tasks.results import STDERR, EvalResult, PipelineResult, ProbeReport, RunInterrupted, StopReason, TrainOutcome
from tasks.train import Callbacks

PIPED_LINES = 20  # about this many training-progress lines per run when output is piped
PREFECT_UI_PORT = 4200  # where `ballast ui` serves the Prefect UI of the embedded store (flows/cli.py's default)
FLOW_RUN_ID_TAG, FLOW_RUN_URL_TAG = "prefect.flow_run_id", "prefect.flow_run_url"  # on the MLflow run


class PipelineView(Callbacks):
    """The terminal and the Prefect run log of one pipeline run. `terminal=False` (sweep trials): Prefect only. The
    flow tells it when the run is open, when a stage starts and ends and what it returned, and how the run ended;
    the trainer tells it each step (a trainer callback)."""

    def __init__(self, total_steps: int, terminal: bool = True, console: Console | None = None, log=None):
        self.console = console or Console(soft_wrap=True, highlight=False)
        self.terminal, self.total = terminal, total_steps
        self.piped = not self.console.is_terminal
        self.every = max(1, round(total_steps / PIPED_LINES))
        self.log = log or get_run_logger()  # the flow run's log (the UI's Logs tab)
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
        """A progress line every `every` steps (the terminal shows it only when piped: a terminal has the bar) and
        one per in-training eval, on the terminal too (printed above the bar: the bar shows no held-out score)."""
        evaluated = any(k.startswith("eval/") for k in metrics)
        if step and step % self.every and step != self.total and not evaluated:
            return
        elapsed = time.perf_counter() - self.started
        keys = [k for k in ("reward", "kl", "completions/mean_length") if k in metrics]
        values = "  ".join([f"{k} {metrics[k]:.4g}" for k in keys] + eval_scores(metrics))
        self.say(f"step {step}/{self.total}  {values}  ({elapsed:.0f} s)", terminal=self.piped or evaluated)

    def opened(self, run_name: str, url: str, spec_name: str) -> None:
        """The flow run takes the MLflow run's name and links to it."""
        rename_flow_run(run_name)
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
    return f"{_named()}-starting"


def name_failed_start() -> None:
    """The flow run failed before its MLflow run existed (a spec error, a fork refused, a store down): its name says
    so (`<spec>-failed`) instead of keeping `<spec>-starting` for good. Outside a flow run: nothing to rename."""
    if flow_run.id:
        try:
            rename_flow_run(f"{_named()}-failed")
        except Exception:  # the name is a courtesy: the error that failed the run is what must come through
            pass


def rename_flow_run(name: str) -> None:
    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run_id=flow_run.id, name=name)


def _named() -> str:
    params = flow_run.parameters
    if params.get("resume_run_id"):
        return f"resume-{params['resume_run_id'][:8]}"
    spec = params.get("spec")
    name = spec.get("name") if isinstance(spec, dict) else getattr(spec, "name", None)
    if name is None and isinstance(spec, str):
        try:
            name = (yaml.safe_load(Path(spec).read_text()) or {}).get("name")
        except (OSError, yaml.YAMLError, AttributeError):
            name = None
    return name or "experiment"


def flow_run_link() -> dict[str, str]:
    """MLflow tags naming this flow run: its id and its page in the Prefect UI (the one `ballast ui` serves for the
    embedded API, else the server's, PREFECT_UI_URL). Empty outside a flow run."""
    if not flow_run.id:
        return {}
    ui = f"http://127.0.0.1:{PREFECT_UI_PORT}" if runtime.embedded() else PREFECT_UI_URL.value()
    link = {FLOW_RUN_ID_TAG: flow_run.id}
    if ui:
        link[FLOW_RUN_URL_TAG] = f"{ui.rstrip('/')}/runs/flow-run/{flow_run.id}"  # the UI's route for a flow run
    return link


def eval_scores(metrics: dict[str, float]) -> list[str]:
    """'eval/accuracy 0.289 ± 0.079' for each held-out score in `metrics`, the half-width of its 95 % interval (1.96
    standard errors, the ± of every Ballast surface: sweeps/statistics.py) beside it when given."""
    out = []
    for k in sorted(k for k in metrics if k.startswith("eval/") and not k.endswith(STDERR)):
        err = metrics.get(k + STDERR)
        out.append(f"{k} {metrics[k]:.4g}" + (f" ± {1.96 * err:.2g}" if err is not None else ""))
    return out


def describe(result) -> str | None:
    """One line saying what a stage found."""
    if isinstance(result, ForkSource):
        if result.checkpoint_uri is None:
            return "fork: starting from the base model"
        diff = "" if result.max_logprob_diff is None else f" (max |logprob diff| {result.max_logprob_diff:.2g})"
        return f"fork: starting from {result.describe()}, verified{diff}"
    if isinstance(result, TrainOutcome):
        stopped = StopReason.parse(result.stopped)
        return f"train: {'stopped at' if stopped else 'ended at'} step {result.last_step}" + (
            f" — {stopped}" if stopped else ""
        )
    if isinstance(result, CheckpointSet):
        return f"checkpoint: {len(result.uris)} kept in the store, final {result.final_uri}"
    if isinstance(result, ProbeReport):
        return (
            f"artifact-probe: step {result.step}: {result.n_malformed}/{result.n_samples} = {result.versus()}, "
            f"parity {'ok' if result.parity_ok else 'FAILED'} → {'passed' if result.passed else 'FAILED'}"
        )
    if isinstance(result, EvalResult):
        said = ", ".join(eval_scores(result.metrics))
        return f"eval: {said}" + (" (± is a 95 % interval)" if "±" in said else "")
    return None


def artifact_key(spec_name: str, what: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) for one spec's artifacts of one kind."""
    return re.sub(r"[^a-z0-9]+", "-", f"ballast-{spec_name}-{what}".lower()).strip("-")
