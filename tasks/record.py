"""MLflow lineage: the one place that writes to (and reads lineage from) MLflow. Stages return typed results;
the recorder turns them into runs, params, metrics, tags and artifacts.

* `Tracking` — the tracking store of a spec (SQLite under the project folder by default, `tracking.uri` for a
  team server) and what can be read back: a run's checkpoint location, its fork source, its spec, the chain.
* `RunRecorder` — one MLflow run per pipeline run with a nested run per stage (`stage(name)`); params are the
  flattened spec (secrets redacted by tasks/spec.py), step metrics go through `MetricsSink` (tasks/metrics_sink.py:
  a background thread, in batches, kept on disk while the server is away), `record(result)` logs a stage's result
  (what the model wrote, too, as MLflow tables: samples.json, eval_samples.json, probe_samples.json),
  `finish()` the report and the verdict, `fail()` and `interrupted()` (a signal: KILLED) how it ended otherwise.
  An http(s) tracking server must answer at start (infra/mlflow_server.py).
* `SweepRecorder` — a sweep's parent run and the verdict of each trial on its child run.

What the MLflow UI shows: the experiment is marked a model-training one (`mlflow.experimentKind`) and every link
Ballast prints opens the UI in that mode; runs carry MLflow's own source, commit and user tags and a description
(`mlflow.note.content`) that says what the run was and how it ended; a pipeline run is named `<spec>-<run id[:8]>`,
its stage runs `<stage> · <that name>`. Run facts with long values (paths, URIs, the full commit) are params under
`ballast.` (output_dir, checkpoint_prefix, fork_checkpoint, base_model, code_commit, model_uri), so the run page's
tag chips stay short enough to read; tags under `ballast.` hold the short ones: status, stop_reason, spec_hash,
data_fingerprint, code_dirty, parent_run_id (the fork's source run: a tag, so `tags.ballast.parent_run_id = '…'`
finds a run's forks), parent_step, fork_logprob_diff, probe_passed, probe_malformed_rate. The Prefect flow run
that recorded the run is linked by the tags `prefect.flow_run_id` and `prefect.flow_run_url` and in the
description; the final checkpoint is the run's MLflow model `model` (tasks/mlflow_model.py), its prompt sets its
dataset inputs.

A sweep's trial run is read side by side with its siblings (MLflow's Compare), so it is recorded for that: its
params are the swept parameters alone (the whole spec is its `spec.yaml` artifact; paths, prefixes and ids are
tags), and its stages are not nested runs — their records go to the trial run itself, which is what a sweep's run
list shows (a `ballast.failed_stage` tag names the stage a crash came from).
"""

from __future__ import annotations

import getpass
import json
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow
from mlflow.entities import Param
from mlflow.tracking import MlflowClient

from infra.mlflow_server import TrackingUnavailable, check_tracking
from infra.store import open_store
from tasks.checkpoint import CheckpointSet, checkpoint_prefix
from tasks.eval import EvalResult
from tasks.fork import ForkSource
from tasks.metrics_sink import PENDING, MetricsSink, guarded
from tasks.probe_report import ProbeReport
from tasks.report import plot_history, write_run_report
from tasks.spec import ExperimentSpec, TrackingConfig, dump_spec, flat_params, spec_hash
from tasks.summary import PipelineResult, RunStatus, StopReason
from tasks.train import RunInterrupted, TrainOutcome
from trainer.checkpoint import Checkpoint, code_ref, list_checkpoints, step_dir_name
from trainer.data import data_fingerprint, load_datasets
from trainer.loop import Callbacks
from trainer.metrics import METRICS  # noqa: F401  (the glossary of what is logged: `ballast metrics`)
from trainer.samples import EVAL_SAMPLES_FILE, SAMPLES_FILE, append_rows, read_rows

if TYPE_CHECKING:  # tasks/compare.py and tasks/regression.py import this module: types only, not imports
    from tasks.compare import Comparison
    from tasks.regression import RegressionResult

TAG = "ballast."
EXPERIMENT_KIND = "custom_model_development"  # mlflow.experimentKind: a model-training experiment, not GenAI
UI_MODE = "workflowType=machine_learning"  # MLflow 3's UI opens in its GenAI mode unless a link asks for this
DEFAULT_UI_URL = "http://127.0.0.1:5000"  # where `ballast ui` serves the embedded store
SOURCE_NAME = "flows/pipeline.py:ballast_pipeline"
LONG_FACTS = ("code_commit", "base_model", "output_dir", "checkpoint_prefix", "fork_checkpoint")
SWEPT_TAG = "swept"  # a sweep trial's run: the comma-joined swept spec fields, its only params
GAIN_TAG = "gain_metric"  # a sweep trial's run: its gain over the baseline, Gain/<objective> (NaN until it ends)
# A run that did not end well is not FINISHED in MLflow (the runs table shows the status, not the tags): the health
# gate stopped it or the probe failed it (FAILED), or a sweep's pruner stopped it on purpose (KILLED).
MLFLOW_STATUS: dict[RunStatus, str] = {
    "finished": "FINISHED",
    "collapsed": "FAILED",
    "probe_failed": "FAILED",
    "pruned": "KILLED",
}
MODEL_NAME = "model"  # the final checkpoint as an MLflow model (tasks/mlflow_model.py); tracking.register_as
MODEL_CODE = Path(__file__).with_name("mlflow_model.py")
TRAINER_CODE = Path(__file__).resolve().parent.parent / "trainer"  # travels with the model: it loads the checkpoint
SAMPLES_SHOWN = 12  # sample rows per table on the run report
PREFECT_URL_TAG = "prefect.flow_run_url"  # given by the flow (flows/view.py flow_run_link) with prefect.flow_run_id
# MLflow's run page (Model metrics) draws a section per metric prefix, sections in alphabetical order and metrics
# with no prefix (reward, kl) last — so it opened on advantages/* and clip_ratio/*, near zero by construction. The
# numbers a person looks at first are also logged under HEADLINE, which sorts before any letter: that section opens.
HEADLINE = "_headline/"
HEADLINE_KEYS = {
    "reward": "reward",
    "eval/reward": "eval_reward",
    "eval/accuracy": "eval_accuracy",
    "kl": "kl",
    "completions/mean_length": "mean_length",
}
# What the model wrote, as MLflow tables (the UI's artifact view shows them as tables): training steps, evals, probes
SAMPLES_TABLE, EVAL_SAMPLES_TABLE, PROBE_SAMPLES_TABLE = "samples.json", "eval_samples.json", "probe_samples.json"


def tracking_uri(spec) -> str:
    if spec.tracking.uri:
        return spec.tracking.uri
    db = Path(spec.project_dir).resolve() / "mlflow.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"


def default_tracking_uri() -> str:
    """The embedded store of the default project folder (.ballast/ under the working directory)."""
    return f"sqlite:///{Path('.ballast').resolve() / 'mlflow.db'}"


def store_uri(spec) -> str:
    return spec.storage.uri or str(Path(spec.project_dir).resolve() / "artifacts")


# ── the tracking store, and lineage read back ──────────────────────────────────────────────────────


class Tracking:
    """The MLflow tracking store and experiment of a spec."""

    def __init__(self, spec):
        self.spec, self.uri = spec, tracking_uri(spec)
        check_tracking(self.uri, spec.tracking)  # a server that is not there fails here, in seconds, with one line
        mlflow.set_tracking_uri(self.uri)
        self.client = guarded(MlflowClient(self.uri), self.uri)
        experiment = self.client.get_experiment_by_name(spec.tracking.experiment)
        if experiment is None:
            # a database store (SQLite, PostgreSQL) keeps artifacts in the project folder, not in ./mlruns of
            # whatever directory the command ran in; a tracking server decides for itself
            server = self.uri.startswith(("http://", "https://", "databricks"))
            location = None if server else (Path(spec.project_dir).resolve() / "mlruns").as_uri()
            self.experiment_id = self.client.create_experiment(
                spec.tracking.experiment, artifact_location=location, tags={"mlflow.experimentKind": EXPERIMENT_KIND}
            )
        else:
            self.experiment_id = experiment.experiment_id
            if "mlflow.experimentKind" not in experiment.tags:  # made before Ballast marked its experiments
                self.client.set_experiment_tag(self.experiment_id, "mlflow.experimentKind", EXPERIMENT_KIND)

    def ui_url(self) -> str:
        """The MLflow UI that links point at: tracking.ui_url, else the tracking server, else `ballast ui`'s address."""
        if self.spec.tracking.ui_url:
            return self.spec.tracking.ui_url.rstrip("/")
        return self.uri.rstrip("/") if self.uri.startswith(("http://", "https://")) else DEFAULT_UI_URL

    def run_url(self, run_id: str) -> str:
        """The run's page in the MLflow UI, in its model-training mode."""
        return f"{self.ui_url()}/#/experiments/{self.experiment_id}/runs/{run_id}?{UI_MODE}"

    def experiment_url(self) -> str:
        return f"{self.ui_url()}/#/experiments/{self.experiment_id}/runs?{UI_MODE}"

    def find_run(self, run_id: str):
        try:
            return self.client.get_run(run_id)
        except Exception:
            raise ValueError(
                f"MLflow run {run_id!r} was not found in {self.uri}; check the run id (ballast ui lists "
                "runs) and tracking.uri"
            ) from None

    def resolve_run_id(self, given: str) -> str:
        """The full run id of `given`: a run id, a run's name (`quickstart-7967ed74`) or the 8-character id in it."""
        try:
            return self.client.get_run(given).info.run_id
        except Exception:
            pass
        quoted = given.replace("'", "")
        found = {
            r.info.run_id: r.info.run_name
            for name_filter in (f"attributes.run_name = '{quoted}'", f"attributes.run_name LIKE '%-{quoted}'")
            for r in self.client.search_runs([self.experiment_id], name_filter, max_results=10)
            if " · " not in (r.info.run_name or "")  # a stage's run ("train · quickstart-7967ed74") is not the run
        }
        if len(found) == 1:
            return next(iter(found))
        if found:
            raise ValueError(f"{given!r} names {len(found)} runs ({', '.join(sorted(found.values()))}); give a run id")
        raise ValueError(
            f"MLflow run {given!r} was not found in {self.uri}; give the run id or run name `ballast run` printed "
            "(ballast ui lists runs) and check tracking.uri"
        )

    def tags(self, run_id: str) -> dict[str, str]:
        """The run's facts: its params and tags (a run's long-valued facts are params, LONG_FACTS)."""
        data = self.find_run(run_id).data
        return {**data.params, **data.tags}

    def checkpoint_prefix(self, run_id: str) -> str:
        prefix = self.tags(run_id).get(TAG + "checkpoint_prefix")
        if not prefix:
            raise ValueError(
                f"fork.run_id={run_id}: that MLflow run has no checkpoints recorded (param "
                f"{TAG}checkpoint_prefix); fork a Ballast pipeline run, or give fork.checkpoint"
            )
        return prefix

    def fork_source_of(self, run_id: str) -> ForkSource:
        """The fork source a run started from, as recorded (for a resume; it was verified when the run began)."""
        tags = self.tags(run_id)
        step = tags.get(TAG + "parent_step")
        return ForkSource(
            checkpoint_uri=tags.get(TAG + "fork_checkpoint"),
            parent_run_id=tags.get(TAG + "parent_run_id"),
            parent_step=int(step) if step and step != "None" else None,
        )

    def output_dir_of(self, run_id: str) -> Path | None:
        out = self.tags(run_id).get(TAG + "output_dir")
        return Path(out) if out else None

    def chain(self, run_id: str) -> list[dict]:
        """[this run, its parent, its parent's parent, ...] as {run_id, parent_step, fork_checkpoint}."""
        out, seen = [], set()
        while run_id and run_id not in seen:
            seen.add(run_id)
            tags = self.tags(run_id)
            out.append(
                {
                    "run_id": run_id,
                    "parent_step": tags.get(TAG + "parent_step"),
                    "fork_checkpoint": tags.get(TAG + "fork_checkpoint"),
                }
            )
            run_id = tags.get(TAG + "parent_run_id")
        return out

    def set_tags(self, run_id: str, tags: dict) -> None:
        for k, v in tags.items():
            if v is not None:
                self.client.set_tag(run_id, k if k.startswith((TAG, "mlflow.", "prefect.")) else TAG + k, str(v))

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i : i + 100])

    def create_run(self, name: str, parent_run_id: str | None = None, tags: dict | None = None) -> str:
        run_tags = {"mlflow.runName": name, **(tags or {})}
        if parent_run_id:
            run_tags["mlflow.parentRunId"] = parent_run_id
        return self.client.create_run(self.experiment_id, tags=run_tags).info.run_id


# ── one pipeline run ───────────────────────────────────────────────────────────────────────────────


class RunRecorder:
    """The MLflow side of one pipeline run. Make one with `start()` (a new run) or `resume()`."""

    def __init__(self, tracking: Tracking, spec: ExperimentSpec, run_id: str, source: ForkSource, resumed: bool):
        self.tracking, self.client, self.spec = tracking, tracking.client, spec
        self.run_id, self.source, self.resumed = run_id, source, resumed
        self.output_dir = Path(spec.project_dir).resolve() / "runs" / run_id
        self.cache_dir = Path(spec.project_dir).resolve() / "cache" / run_id
        self.store = open_store(store_uri(spec))
        self.checkpoint_prefix = checkpoint_prefix(run_id)
        self.metrics = MetricsSink(
            self.client, run_id, spec.tracking.log_every, spool=self.output_dir / PENDING, replayed=resumed
        )
        self.headline = Headline(self.metrics)  # a trainer callback, beside `metrics`
        self.prefect_url: str | None = None  # the Prefect flow run recording this attempt, linked in the description
        self.started = time.perf_counter()
        self._stage_run: str | None = None
        self.flat_stages = False  # a sweep trial's run: stages record onto the run itself (start())
        self.probe_reports: list[ProbeReport] = []
        self.name = self.client.get_run(run_id).info.run_name or run_id
        self.code = code_ref()

    @property
    def url(self) -> str:
        return self.tracking.run_url(self.run_id)

    def tags_now(self) -> dict[str, str]:
        return self.client.get_run(self.run_id).data.tags

    @classmethod
    def start(
        cls,
        tracking: Tracking,
        spec: ExperimentSpec,
        source: ForkSource,
        parent_run_id: str | None = None,
        tags: dict | None = None,
    ) -> RunRecorder:
        run_id = tracking.create_run(spec.name, parent_run_id)
        tracking.client.set_tag(run_id, "mlflow.runName", run_name(spec.name, run_id))
        run = cls(tracking, spec, run_id, source, resumed=False)
        run.prefect_url = (tags or {}).get(PREFECT_URL_TAG)
        run.output_dir.mkdir(parents=True, exist_ok=True)
        (run.output_dir / "spec.yaml").write_text(dump_spec(spec))
        params = flat_params(spec)
        if tags and SWEPT_TAG in tags:  # a sweep trial: the swept parameters are what Compare sets side by side
            run.flat_stages = True
            swept = [k for k in str(tags[SWEPT_TAG]).split(",") if k]
            params = {k: v for k, v in params.items() if k in swept}
            if tags.get(GAIN_TAG):  # logged first, so Compare (which opens on a run's first metric) opens on it
                tracking.client.log_metric(run_id, str(tags[GAIN_TAG]), float("nan"), step=0)
        tracking.log_params(run_id, params)
        run.client.log_artifact(run_id, str(run.output_dir / "spec.yaml"))
        run._lineage(tags)
        run._log_datasets()
        return run

    @classmethod
    def resume(cls, tracking: Tracking, spec: ExperimentSpec, run_id: str, tags: dict | None = None) -> RunRecorder:
        """The recorder of an interrupted run, RUNNING again; `tags` are this attempt's (its Prefect flow run)."""
        run = cls(tracking, spec, run_id, tracking.fork_source_of(run_id), resumed=True)
        run.prefect_url = (tags or {}).get(PREFECT_URL_TAG)
        run.client.update_run(run_id, status="RUNNING")
        run.tracking.set_tags(
            run_id, {"status": "running", "mlflow.note.content": run.note("**Resumed; running.**"), **(tags or {})}
        )
        return run

    def _lineage(self, extra: dict | None) -> None:
        """Where the run came from: long values as params (LONG_FACTS), short ones and MLflow's own as tags."""
        s = self.source
        train_set, _ = load_datasets(self.spec.data)
        long_facts = {
            TAG + k: str(v)[:500]
            for k, v in {
                "fork_checkpoint": s.checkpoint_uri,
                "code_commit": self.code["commit"],
                "base_model": self.spec.model.name_or_path,
                "output_dir": str(self.output_dir),
                "checkpoint_prefix": self.store.child_uri(self.checkpoint_prefix),
            }.items()
            if v is not None
        }
        if self.flat_stages:  # a sweep trial: Compare's axes are for the swept parameters; facts are tags
            self.tracking.set_tags(self.run_id, long_facts)
        else:
            self.tracking.log_params(self.run_id, long_facts)
        diff = None if s.max_logprob_diff is None else f"{s.max_logprob_diff:.3g}"
        self.tracking.set_tags(
            self.run_id,
            {
                "parent_run_id": s.parent_run_id,
                "parent_step": s.parent_step,
                "fork_logprob_diff": diff,
                "code_dirty": self.code["dirty"],
                "spec_hash": spec_hash(self.spec),
                "data_fingerprint": data_fingerprint(train_set),
                "status": "running",
                "mlflow.source.git.commit": self.code["commit"],
                "mlflow.source.name": SOURCE_NAME,
                "mlflow.source.type": "LOCAL",
                "mlflow.user": _user(),
                "mlflow.note.content": self.note("**Running.**"),
                **(extra or {}),
            },
        )

    def _log_datasets(self) -> None:
        """The prompt sets as MLflow dataset inputs (the run page's Datasets): the training prompts and the held-out
        ones, each with its source, digest and rows (prompt, answer)."""
        import pandas as pd
        from mlflow.data.code_dataset_source import CodeDatasetSource
        from mlflow.entities import DatasetInput, InputTag

        data = self.spec.data
        train_set, eval_set = load_datasets(data)
        inputs = []
        for examples, context, source in (
            (train_set, "training", data.source),
            (eval_set, "eval", data.eval_path or data.source),
        ):
            if not examples:
                continue
            rows = pd.DataFrame(
                {
                    "prompt": [e.prompt if isinstance(e.prompt, str) else json.dumps(e.prompt) for e in examples],
                    "answer": [e.answer if isinstance(e.answer, str) else json.dumps(e.answer) for e in examples],
                }
            )
            where = CodeDatasetSource({"ballast.data.source": str(source), "ballast.data.seed": str(data.seed)})
            dataset = mlflow.data.from_pandas(rows, source=where, name=f"{self.spec.name}-{context}", targets="answer")
            inputs.append(DatasetInput(dataset._to_mlflow_entity(), [InputTag("mlflow.data.context", context)]))
        self.client.log_inputs(self.run_id, datasets=inputs)

    def _log_model(self, checkpoint_dir: Path, register: bool) -> str | None:
        """The final checkpoint as an MLflow model (tasks/mlflow_model.py: base model + adapter, loaded through
        trainer/checkpoint.py), with `register` registered as tracking.register_as when that is set; returns its
        URI. The optimizer state stays out of it."""
        if not checkpoint_dir.is_dir():  # a store-only checkpoint (none kept on this disk): nothing to log here
            return None
        import shutil

        checkpoint = Checkpoint.open(checkpoint_dir, verify=False)
        staged = self.output_dir / "mlflow-model"
        shutil.rmtree(staged, ignore_errors=True)
        checkpoint.copy_for_inference(staged / "checkpoint")
        spec = self.spec
        config = {
            "model": spec.model.model_dump(mode="json") | {"device": "auto"},  # wherever it is loaded
            "lora": spec.lora.model_dump(mode="json"),
            "render": {"system_prompt": spec.data.system_prompt, "prompt_template": spec.data.prompt_template},
            "max_tokens": spec.eval.max_tokens,
        }
        (staged / "ballast_model.json").write_text(json.dumps(config, indent=1))
        from mlflow.models import ModelSignature
        from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

        signature = ModelSignature(
            inputs=Schema([ColSpec("string")]),  # a list of prompts, or a table whose column holds them
            outputs=Schema([ColSpec("string")]),
            params=ParamSchema(
                [ParamSpec("max_tokens", "long", spec.eval.max_tokens), ParamSpec("temperature", "double", 0.0)]
            ),
        )
        with mlflow.start_run(run_id=self.run_id):  # resumes this run for the fluent API; the caller ends it
            info = mlflow.pyfunc.log_model(
                name=MODEL_NAME,
                python_model=str(MODEL_CODE),
                artifacts={"checkpoint": str(staged / "checkpoint"), "config": str(staged / "ballast_model.json")},
                code_paths=[str(TRAINER_CODE)],
                signature=signature,
                pip_requirements=_requirements(),
                registered_model_name=spec.tracking.register_as if register else None,
                metadata={
                    "base_model": spec.model.name_or_path,
                    "weights": checkpoint.weights,
                    "checkpoint_step": checkpoint.step,
                    "checkpoint_sha256": _manifest_digest(checkpoint),
                },
                step=checkpoint.step,
            )
        if self.flat_stages:  # a sweep trial's params are its swept parameters alone (Compare's axes)
            self.tracking.set_tags(self.run_id, {TAG + "model_uri": info.model_uri})
        else:
            self.tracking.log_params(self.run_id, {TAG + "model_uri": info.model_uri})  # long: a param (LONG_FACTS)
        return info.model_uri

    def note(self, ending: str) -> str:
        """The run's MLflow description (markdown): how it ended (or that it runs) first — the run page shows the
        first lines and folds the rest — then what the run is."""
        spec, s = self.spec, self.source
        weights = f"LoRA r={spec.lora.r}" if spec.lora.enabled else "full fine-tune"
        start = (
            f"forked from run `{s.parent_run_id}` step {s.parent_step}"
            if s.parent_run_id
            else (f"forked from `{s.checkpoint_uri}`" if s.checkpoint_uri else "from the base model")
        )
        dirty = " with uncommitted changes" if self.code["dirty"] else ""
        prefect = f" [Prefect flow run]({self.prefect_url})." if self.prefect_url else ""
        return (
            f"{ending}\n\nGRPO fine-tuning of `{spec.model.name_or_path}` ({weights}) on `{spec.data.source}` for "
            f"{spec.optim.steps} steps, {start}; fork → train → checkpoint → artifact-probe → eval. Spec "
            f"`{spec.name}` (artifact `spec.yaml`), Ballast commit `{self.code['commit'][:12]}`{dirty}.{prefect}"
        )

    @contextmanager
    def stage(self, name: str):
        """A nested MLflow run for one stage, FAILED with the error when the block raises. A sweep trial's stages
        record onto the trial run itself (`flat_stages`): no nested run, and a crash tags the stage it came from."""
        if self.flat_stages:
            with self._flat_stage(name):
                yield self
            return
        self._stage_run = self.tracking.create_run(f"{name} · {self.name}", self.run_id, {"ballast.stage": name})
        try:
            yield self
        except TrackingUnavailable:
            raise  # nothing can be recorded while the server is away; the flow says what to do
        except BaseException as e:
            interrupted = isinstance(e, RunInterrupted) or not isinstance(e, Exception)  # a signal, not an error
            self.client.set_tag(self._stage_run, "ballast.error", f"{type(e).__name__}: {e}"[:4000])
            self.client.set_terminated(self._stage_run, "KILLED" if interrupted else "FAILED")
            if interrupted:
                raise
            raise StageError(name, e) from e
        else:
            self.client.set_terminated(self._stage_run, "FINISHED")
        finally:
            self._stage_run = None

    @contextmanager
    def _flat_stage(self, name: str):
        self._stage_run = self.run_id
        try:
            yield self
        except TrackingUnavailable:
            raise
        except BaseException as e:
            interrupted = isinstance(e, RunInterrupted) or not isinstance(e, Exception)
            self.tracking.set_tags(self.run_id, {"failed_stage": name, "error": f"{type(e).__name__}: {e}"[:4000]})
            if interrupted:
                raise
            raise StageError(name, e) from e
        finally:
            self._stage_run = None

    def _runs(self, sid: str) -> list[str]:
        """The stage run and the pipeline run, once each (one and the same for a sweep trial's flat stages)."""
        return list(dict.fromkeys((sid, self.run_id)))

    def record(self, result) -> None:
        """Log one stage's result to its stage run (and what belongs there to the pipeline run)."""
        sid = self._stage_run
        if isinstance(result, ForkSource):
            self.tracking.set_tags(
                sid,
                {
                    "source": result.checkpoint_uri or f"base model {self.spec.model.name_or_path}",
                    "parent_run_id": result.parent_run_id,
                    "parent_step": result.parent_step,
                },
            )
            if result.max_logprob_diff is not None:
                self.client.log_metric(sid, "fork/max_logprob_diff", result.max_logprob_diff)
        elif isinstance(result, TrainOutcome):
            self.metrics.close()
            if self.metrics.mismatches:  # a resume that did not replay exactly: the values recorded first are kept
                shown = "; ".join(self.metrics.mismatches[:3])
                self.tracking.set_tags(self.run_id, {"resume_mismatch": f"{len(self.metrics.mismatches)}: {shown}"})
            self.client.log_metric(sid, "trainer_seconds", result.trainer_seconds)
            self.client.log_metric(sid, "last_step", result.last_step)
            if result.stopped:
                self.tracking.set_tags(self.run_id, {"stop_reason": str(StopReason.parse(result.stopped))})
            if not result.interrupted:  # an interrupted run's are logged, all of them, when it is resumed
                self._log_samples(sid, read_rows(self.output_dir / SAMPLES_FILE), SAMPLES_TABLE)
                self._log_samples(sid, read_rows(self.output_dir / EVAL_SAMPLES_FILE), EVAL_SAMPLES_TABLE)
        elif isinstance(result, CheckpointSet):
            path = self.output_dir / "checkpoints.json"
            path.write_text(json.dumps({str(k): v for k, v in result.uris.items()}, indent=1))
            for run_id in self._runs(sid):
                self.client.log_artifact(run_id, str(path))
        elif isinstance(result, ProbeReport):
            self._record_probe(sid, result)
        elif isinstance(result, EvalResult):
            in_training = self._evaluated_in_training(result.step)
            for k, v in result.metrics.items():
                if sid != self.run_id or not in_training:
                    self.client.log_metric(sid, k, v, step=result.step)
            if sid != self.run_id and not in_training:  # the final eval, at the run's last step
                for k, v in result.metrics.items():
                    self.client.log_metric(self.run_id, k, v, step=result.step)
            if not in_training:
                for k, v in headline(result.metrics).items():
                    self.client.log_metric(self.run_id, k, v, step=result.step)
            written = [r for r in read_rows(self.output_dir / EVAL_SAMPLES_FILE) if r.get("step") == result.step]
            if not all(row in written for row in result.samples):  # a resume that repeats the final eval: once
                self._log_samples(sid, result.samples, EVAL_SAMPLES_TABLE)
                append_rows(self.output_dir / EVAL_SAMPLES_FILE, result.samples)  # the run directory has them too
        else:
            raise TypeError(f"no recorder for a {type(result).__name__}")

    def _log_samples(self, sid: str, rows: list[dict], table: str) -> None:
        """Sample rows (trainer/samples.py) as an MLflow table on the stage run and the pipeline run; logging to a
        table that exists appends to it."""
        if not rows:
            return
        columns = list(dict.fromkeys(key for row in rows for key in row))
        data = {column: [row.get(column) for row in rows] for column in columns}
        for run_id in self._runs(sid):
            self.client.log_table(run_id, data, table)

    def _evaluated_in_training(self, step: int) -> bool:
        return any(m.step == step for m in self.client.get_metric_history(self.run_id, "eval/reward"))

    def _record_probe(self, sid: str, report: ProbeReport) -> None:
        where = self.output_dir / "probe" / step_dir_name(report.step)
        report.write_json(where / "probe_report.json")
        report.write_html(where / "probe_report.html")
        for run_id in self._runs(sid):
            self.client.log_artifacts(run_id, str(where), f"probe/{step_dir_name(report.step)}")
            self.client.log_metric(run_id, "probe/malformed_rate", report.malformed_rate, step=report.step)
        self._log_samples(sid, report.sample_rows(), PROBE_SAMPLES_TABLE)
        self.client.set_tag(sid, "ballast.probe_passed", str(report.passed))
        self.tracking.set_tags(
            self.run_id, {"probe_passed": report.passed, "probe_malformed_rate": f"{report.malformed_rate:.4f}"}
        )
        self.probe_reports.append(report)

    def finish(
        self, outcome: TrainOutcome, checkpoints: CheckpointSet, evaluation: EvalResult | None
    ) -> PipelineResult:
        """Plots, the run report, the verdict; the run's MLflow status says how it ended (MLFLOW_STATUS)."""
        probe = self.probe_reports[-1] if self.probe_reports else None
        result = PipelineResult.from_stages(
            self.run_id,
            str(self.output_dir),
            self.spec.name,
            outcome,
            checkpoints.uris,
            probe,
            evaluation,
            self.source.describe(),
            time.perf_counter() - self.started,
        )
        result.run_name, result.mlflow_url = self.name, self.url
        final_eval = [{"step": outcome.last_step, **evaluation.metrics}] if evaluation else []  # the eval stage's
        history = ([outcome.eval_start] if outcome.eval_start else []) + outcome.history + final_eval
        gate = (outcome.last_step, outcome.stopped) if outcome.stopped else None
        plots = plot_history(history, self.output_dir / "plots", self.spec.health, gate)
        self.client.log_artifacts(self.run_id, str(self.output_dir / "plots"), "plots")
        links = {"spec.yaml": "spec.yaml", "MLflow run": self.url}
        if probe is not None:
            links["probe report"] = f"probe/{step_dir_name(probe.step)}/probe_report.html"
        samples = {
            f"Held-out samples (final checkpoint, step {evaluation.step})": evaluation.samples if evaluation else [],
            "Training samples (last step)": _last_step(read_rows(self.output_dir / SAMPLES_FILE)),
        }
        samples = {title: rows[:SAMPLES_SHOWN] for title, rows in samples.items()}
        report = write_run_report(self.output_dir / "report.html", result, plots, probe, links, self.code, samples)
        self.client.log_artifact(self.run_id, str(report))
        if checkpoints.uris:  # a model only a finished run registers; a collapsed one's is logged, to be looked at
            final = self.output_dir / "checkpoints" / step_dir_name(max(checkpoints.uris))
            self._log_model(final, register=result.status == "finished")
        result.reports = {"run": str(report)}
        if probe is not None:
            result.reports["probe"] = str(self.output_dir / links["probe report"])
        self.tracking.set_tags(
            self.run_id, {"status": result.status, "mlflow.note.content": self.note(result.markdown())}
        )
        if not result.stopped and TAG + "stop_reason" in self.tags_now():  # a resumed run's old "stopped by SIGINT"
            self.client.delete_tag(self.run_id, TAG + "stop_reason")
        self.client.set_terminated(self.run_id, MLFLOW_STATUS.get(result.status, "FINISHED"))
        return result

    def fail(self, error: BaseException) -> None:
        """The run ends FAILED with the reason; what was saved stays for --resume."""
        try:
            self.metrics.close()
        except Exception:
            pass
        if isinstance(error, TrackingUnavailable):
            return  # the server is away: nothing can be recorded
        ending = (
            f"**Ended: failed.** {error}\n\nCheckpoints saved so far are kept; continue with "
            f"`ballast run --resume {self.run_id}`."
        )
        self.tracking.set_tags(
            self.run_id,
            {"status": "failed", "stop_reason": str(error)[:4000], "mlflow.note.content": self.note(ending)},
        )
        self.client.set_terminated(self.run_id, "FAILED")

    def interrupted(self, error: BaseException) -> RunInterrupted:
        """A signal stopped the run (SIGTERM, Ctrl-C): KILLED in MLflow, not FAILED; returns what to tell the user."""
        stop = (
            error
            if isinstance(error, RunInterrupted)
            else RunInterrupted.of(error, list_checkpoints(self.output_dir / "checkpoints"))
        )
        stop.run, stop.resume = f"run {self.run_id}", f"ballast run --resume {self.run_id}"
        try:
            self.metrics.close()
        except Exception:
            pass
        self.tracking.set_tags(
            self.run_id,
            {
                "status": "interrupted",
                "stop_reason": str(stop)[:4000],
                "mlflow.note.content": self.note(f"**Ended: interrupted.** {stop}"),
            },
        )
        self.client.set_terminated(self.run_id, "KILLED")
        return stop


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """The headline copies (HEADLINE) of the metrics that have one."""
    return {HEADLINE + name: metrics[k] for k, name in HEADLINE_KEYS.items() if k in metrics}


class Headline(Callbacks):
    """A trainer callback that sends each step's headline copies to the run's metrics sink."""

    def __init__(self, sink: MetricsSink):
        self.sink = sink

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if metrics := headline(metrics):
            self.sink.on_step(step, metrics)


class StageError(RuntimeError):
    def __init__(self, stage: str, cause: BaseException):
        super().__init__(f"stage '{stage}' failed: {type(cause).__name__}: {cause}")
        self.stage, self.cause = stage, cause


def _last_step(rows: list[dict]) -> list[dict]:
    last = max((row.get("step", 0) for row in rows), default=None)
    return [row for row in rows if row.get("step", 0) == last]


def _requirements() -> list[str]:
    """What loading the logged model needs, pinned to what trained it (not inferred: that would load the model)."""
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in ("mlflow", "torch", "transformers", "peft", "safetensors")]


def _manifest_digest(checkpoint: Checkpoint) -> str:
    return checkpoint.manifest_sha256()[:16]


def run_name(spec_name: str, run_id: str) -> str:
    """A pipeline run's name in MLflow and Prefect: the spec's name and the run id's first 8 characters."""
    return f"{spec_name}-{run_id[:8]}"


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in this environment (some containers)
        return "unknown"


# ── a regression comparison ────────────────────────────────────────────────────────────────────────


def record_regression(spec: ExperimentSpec, result: RegressionResult, work: Path) -> str:
    """One MLflow run for a regression comparison (tasks/regression.py); returns its id."""
    tracking = Tracking(spec)
    a, b = result.refs["a"], result.refs["b"]
    run_id = tracking.create_run(f"regression {a['ref']} vs {b['ref']}")
    try:
        note = (
            f"**Regression check**: `{spec.name}` trained on `{a['ref']}` (A, `{a['commit'][:12]}`) and "
            f"`{b['ref']}` (B, `{b['commit'][:12]}`), {result.runs} run(s) each, every final artifact probed.\n\n"
            f"**Verdict: {result.verdict}.** {result.summary}\n\nPage: artifact `comparison.html`."
        )
        tracking.set_tags(
            run_id,
            {
                "kind": "regression",
                "verdict": result.verdict,
                "status": result.verdict,
                "ref_a": a["ref"][:40],
                "ref_b": b["ref"][:40],
                "spec_hash": spec_hash(spec),
                "mlflow.note.content": note,
                "mlflow.user": _user(),
            },
        )
        tracking.log_params(
            run_id,
            {
                "ref_a": a["ref"],
                "ref_b": b["ref"],
                "commit_a": a["commit"],
                "commit_b": b["commit"],
                "runs": str(result.runs),
                "steps": str(result.steps or spec.optim.steps),
                "alpha": str(result.comparison.alpha),
                "repo": result.repo,
                "probe.n": str(spec.probe.n),
                "probe.temperature": str(spec.probe.temperature),
                "probe.max_tokens": str(spec.probe.max_tokens),
                "ballast.base_model": spec.model.name_or_path,
                "ballast.work_dir": str(work),
            },
        )
        metrics = _regression_metrics(result.comparison)
        for k, v in metrics.items():
            tracking.client.log_metric(run_id, k, float(v))
        for name in ("pooled_a.json", "pooled_b.json", "comparison.json", "comparison.html", "spec.yaml"):
            tracking.client.log_artifact(run_id, str(work / name))
        tracking.client.log_artifacts(run_id, str(work / "probes"), "probes")
        for p in result.plots:
            tracking.client.log_artifact(run_id, str(p), "plots")
    except BaseException:
        tracking.client.set_terminated(run_id, "FAILED")
        raise
    tracking.client.set_terminated(run_id, "FINISHED")
    return run_id


# ── a sweep ────────────────────────────────────────────────────────────────────────────────────────


class SweepRecorder:
    """A sweep's MLflow side: one parent run per study (its id kept on the study as PARENT_ATTR), a child run per
    trial (the trial's pipeline run), the trial's verdict on that child run, the summary on the parent."""

    PARENT_ATTR = "ballast.mlflow_parent_run_id"

    def __init__(self, base_spec, study_name: str):
        self.tracking, self.study_name = Tracking(base_spec), study_name
        self.client = self.tracking.client
        self.parent_run_id: str | None = None
        self.objective: str | None = None  # a held-out objective (eval/*): trial runs carry Gain/<it>

    def open_parent(self, study, params: dict[str, str], tags: dict) -> str:
        """The study's parent run: created with the study, found again on resume."""
        run_id = study.user_attrs.get(self.PARENT_ATTR)
        if run_id:
            try:
                self.client.get_run(run_id)
                self.client.update_run(run_id, status="RUNNING")
            except Exception:
                run_id = None  # the study outlived its tracking store: start a new parent run
        if not run_id:
            run_id = self.tracking.create_run(f"sweep {study.study_name}")
            study.set_user_attr(self.PARENT_ATTR, run_id)
            self.tracking.log_params(run_id, params)
        note = (
            f"**Optuna sweep `{study.study_name}`**: each child run is one trial, a pipeline run of the base spec "
            f"with the trial's values; the summary (best trial, importances, plots) lands here when the study has "
            f"its trials.\n\n**Running.**"
        )
        self.tracking.set_tags(
            run_id,
            {
                "kind": "sweep",
                "study": study.study_name,
                "status": "running",
                "mlflow.note.content": note,
                "mlflow.user": _user(),
                **tags,
            },
        )
        self.parent_run_id = run_id
        return run_id

    def join(self, study) -> str:
        run_id = study.user_attrs.get(self.PARENT_ATTR)
        if not run_id:
            raise ValueError(
                f"study {study.study_name!r} has no MLflow parent run recorded; create the sweep with "
                "`ballast sweep FILE` first"
            )
        self.parent_run_id = run_id
        return run_id

    def interrupted(self) -> None:
        """The sweep process was stopped (Ctrl-C): its parent run says so until a resume."""
        if self.parent_run_id:
            self.tracking.set_tags(self.parent_run_id, {"status": "interrupted"})
            self.client.set_terminated(self.parent_run_id, "KILLED")

    def trial_tags(self, number: int, params: dict) -> dict:
        """Tags a trial's pipeline run carries, so its verdict can find it; `swept` makes the swept fields its only
        params (RunRecorder.start)."""
        return {
            "study": self.study_name,
            "trial_number": number,
            SWEPT_TAG: ",".join(params),
            GAIN_TAG: f"Gain/{self.objective}" if self.objective else None,
        }

    def record_baseline(self, baseline) -> None:
        """The base model's held-out scores (sweeps/baseline.py) on the parent run: metrics `baseline/<metric>`,
        and a tag that reads as a sentence."""
        rid = self.parent_run_id
        for k, v in baseline.metrics.items():
            self.client.log_metric(rid, f"baseline/{k}", float(v))
        shown = ", ".join(
            f"{k} {v:.3g} ± {1.96 * baseline.metrics.get(k + '_stderr', 0.0):.2g}"
            for k, v in baseline.metrics.items()
            if not k.endswith("_stderr") and k != "eval/mean_length"
        )
        self.tracking.set_tags(rid, {"baseline": f"{baseline.source}: {shown}"})

    def child_run(self, number: int):
        runs = self.client.search_runs(
            [self.tracking.experiment_id],
            max_results=5,
            order_by=["attributes.start_time DESC"],
            filter_string=f"tags.mlflow.parentRunId = '{self.parent_run_id}' and tags.`ballast.study` = "
            f"'{self.study_name}' and tags.`ballast.trial_number` = '{number}'",
        )
        return runs[0] if runs else None

    def record_trial(self, study, frozen) -> None:
        """Optuna study callback: the trial's verdict onto its child run."""
        run = self.child_run(frozen.number)
        if run is None:
            return
        rid, attrs = run.info.run_id, frozen.user_attrs
        outcome = trial_outcome(frozen)
        tags = {
            "trial_state": frozen.state.name,
            "outcome": outcome,
            "mlflow.runName": f"trial {frozen.number} · {outcome}",
        }
        for key in ("prune_reason", "pruned_by", "error"):
            if attrs.get(key):
                tags[key] = str(attrs[key])[:4000]
        self.tracking.set_tags(rid, tags)
        for key, value in attrs.items():
            if key.startswith("objective/"):
                self.client.log_metric(rid, key, float(value))
        if attrs.get("gain") is not None:  # capitalised: Compare's plots open on the first metric, sorted
            key, step = attrs.get("gain_metric", "score"), int(attrs.get("last_step") or 0)
            self.client.log_metric(rid, f"Gain/{key}", float(attrs["gain"]), step=step)
            self.client.log_metric(rid, f"Gain/{key}_ci95", 1.96 * float(attrs["gain_stderr"]), step=step)
        if frozen.state.name == "PRUNED":  # stopped on purpose, not a crash: FINISHED, the outcome says how
            self.client.set_terminated(rid, "FINISHED")

    def record_interrupted(self, study, frozen) -> None:
        """Heartbeat-stale trial (its worker died): mark its child run KILLED."""
        run = self.child_run(frozen.number)
        if run is None:
            return
        self.tracking.set_tags(run.info.run_id, {"trial_state": "INTERRUPTED", "status": "interrupted"})
        if run.info.status == "RUNNING":
            self.client.set_terminated(run.info.run_id, "KILLED")

    def record_summary(self, summary, out_dir: Path) -> None:
        """summary.json, summary.html and the plots onto the parent run, the best values as metrics."""
        rid = self.parent_run_id
        self.client.log_artifact(rid, str(out_dir / "summary.json"), "summary")
        self.client.log_artifact(rid, str(out_dir / "summary.html"), "summary")
        for p in summary.plots:
            self.client.log_artifact(rid, str(p), "summary/plots")
        best = summary.best_rows()
        for k, v in ((best[0].get("values") or {}) if best else {}).items():
            self.client.log_metric(rid, f"best/{k}", float(v))
        if summary.best and summary.best.get("gain") is not None:
            self.client.log_metric(rid, "best/gain", float(summary.best["gain"]))
            self.client.log_metric(rid, "best/gain_ci95", 1.96 * float(summary.best["gain_stderr"]))
        self.client.log_metric(rid, "trial_steps_saved", float(summary.steps_saved))
        # a sweep whose trials were all pruned or failed found nothing: FAILED, not FINISHED
        status = ("finished" if summary.n_complete else "no_completed_trial") if summary.done else "incomplete"
        self.tracking.set_tags(
            rid,
            {
                "status": status,
                "trial_steps": summary.trial_steps,
                "best_trial": best[0]["number"] if best else None,
                "verdict": summary.verdict_line(),
                "mlflow.note.content": _sweep_note(summary, status),
            },
        )
        self.client.set_terminated(rid, {"finished": "FINISHED", "no_completed_trial": "FAILED"}.get(status, "KILLED"))


def trial_outcome(frozen) -> str:
    """How a trial ended, in a few words (its MLflow run's name and `ballast.outcome`): '+0.10 ± 0.05 over the
    base model', 'pruned: collapsed at step 4', 'pruned at step 8 by the pruner', 'failed: …'."""
    attrs, step = frozen.user_attrs, frozen.user_attrs.get("last_step", "?")
    if frozen.state.name == "PRUNED":
        if attrs.get("pruned_by") == "health_gate":
            return f"pruned: collapsed at step {step}"
        return f"pruned at step {step} by the pruner"
    if frozen.state.name == "FAIL":
        return f"failed: {attrs.get('error') or attrs.get('not_counted') or 'see the run'}"[:200]
    if attrs.get("gain") is not None:
        gain = f"{attrs['gain']:+.2g} ± {1.96 * attrs['gain_stderr']:.2g} over the base model"
        return gain + ("" if attrs.get("beats_baseline") else " (within noise)")
    return frozen.state.name.lower()


def _sweep_note(summary, status: str) -> str:
    """The sweep parent run's MLflow description at the end: how the sweep went, in the summary's own lines."""
    lines = [line for line in summary.lines() if not line.startswith(("summary:", "dashboard:"))]
    return "\n".join(
        [
            f"**Optuna sweep `{summary.study}`**: each child run is one trial.",
            "",
            f"**Ended: {status.replace('_', ' ')}.**",
            "",
            *[f"- {line}" for line in lines],
            "",
            "Page: artifact `summary/summary.html`.",
        ]
    )


# ── reading a run back ─────────────────────────────────────────────────────────────────────────────


def probe_report_of_run(uri: str, run_id: str, curves: list[str]) -> tuple[dict, list[dict] | None]:
    """(the run's newest probe report, its history of the `curves` metrics) from the tracking store at `uri`."""
    check_tracking(uri, TrackingConfig())
    client = MlflowClient(uri)
    try:
        run = client.get_run(run_id)
    except Exception:
        raise ValueError(
            f"MLflow run {run_id} was not found in {uri}; check the run id or pass --tracking-uri"
        ) from None
    steps = sorted(a.path for a in client.list_artifacts(run_id, "probe") if a.is_dir)
    if not steps:
        raise ValueError(
            f"MLflow run {run_id} has no probe report (artifacts probe/step-*/probe_report.json); "
            "it did not reach the probe stage — compare its checkpoint instead"
        )
    with tempfile.TemporaryDirectory() as tmp:
        local = mlflow.artifacts.download_artifacts(
            run_id=run_id, artifact_path=f"{steps[-1]}/probe_report.json", dst_path=tmp, tracking_uri=uri
        )
        report = json.loads(Path(local).read_text())
    by_step: dict[int, dict] = {}
    for key in curves:
        if key in run.data.metrics:
            for m in client.get_metric_history(run_id, key):
                by_step.setdefault(m.step, {"step": m.step})[key] = m.value
    return report, [by_step[s] for s in sorted(by_step)] or None


def _regression_metrics(comparison: Comparison) -> dict[str, float]:
    """The comparison's numbers, each side's suffixed _a or _b."""
    metrics = {"p_value": comparison.p_value, "regression": float(comparison.regression)}
    for side, s in (("a", comparison.a), ("b", comparison.b)):
        metrics.update(
            {
                f"malformed_rate_{side}": s.malformed_rate,
                f"malformed_ci_low_{side}": s.malformed_ci[0],
                f"malformed_ci_high_{side}": s.malformed_ci[1],
                f"n_malformed_{side}": s.n_malformed,
                f"n_samples_{side}": s.n_samples,
                f"parity_failed_{side}": s.n_parity_failed,
            }
        )
    return metrics
