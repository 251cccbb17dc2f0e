"""The recorder: stage results into MLflow records — the one place that writes a run to MLflow. Stages return typed
results; the recorder turns them into runs, params, metrics, tags, tables and artifacts. The tracking store and
what is read back from it are tasks/tracking.py's; a sweep's parent and trial verdicts, tasks/sweep_record.py's.

* `RunRecorder` — one MLflow run per pipeline run with a nested run per stage (`stage(name)`); params are the
  flattened spec (secrets redacted by tasks/spec.py), step metrics go through `MetricsSink` (tasks/metrics_sink.py:
  a background thread, in batches, kept on disk while the server is away, each (metric, step) once across kills
  and resumes), `record(result)` logs a stage's result, `finish()` the report and the verdict, `fail()` and
  `interrupted()` (a signal: KILLED) how it ended otherwise.
* `record(result)` looks the result's type up in `RECORDERS`, a registry filled by `@records(Type)` below — one
  function per result (ForkSource, TrainOutcome, CheckpointSet, ProbeReport, EvalResult). A registry, not a
  `record` method on each result: the results stay plain data of their stages, which know nothing of MLflow, and
  this module stays the one that writes to it.
* The run directory is the record and MLflow mirrors it, so recording anything again — a resume repeats the stages
  after training — leaves it once: metrics logged to the pipeline run outside the sink are sent only where MLflow
  lacks the (metric, step) (`log_metrics`), and what the model wrote — samples.json, eval_samples.json,
  probe_samples.json — is put whole as an MLflow table (`put_table`) from the run directory's files (the final
  eval's rows are added to eval_samples.jsonl first), replacing what the table held (MLflow's `log_table` appends).
* `record_regression` — a regression comparison (tasks/regression.py) as one MLflow run; `sync_run` — what
  `ballast sync` sends: the metrics MLflow lacks (tasks/metrics_sink.py `sync_record`) and the tables.

What the MLflow UI shows: runs carry MLflow's own source, commit and user tags and a description
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

import json
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import mlflow
from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

from infra.mlflow_server import TrackingUnavailable
from infra.store import open_store
from tasks.checkpoint import CheckpointSet, checkpoint_prefix, resume_command
from tasks.compare import Comparison
from tasks.fork import ForkSource
from tasks.metrics_sink import PENDING, RECORD, Held, MetricsSink, now_ms, step_metrics, sync_record
from tasks.regression import RegressionResult
from tasks.report import plot_history, write_run_report
from tasks.results import EvalResult, PipelineResult, ProbeReport, RunInterrupted, RunStatus, StopReason, TrainOutcome
from tasks.spec import ExperimentSpec, dump_spec, flat_params, spec_hash, store_uri
from tasks.tracking import GAIN_TAG, SWEPT_TAG, TAG, Tracking, run_name, user_name
from trainer.callbacks import Callbacks
from trainer.checkpoint import Checkpoint, code_ref, list_checkpoints, step_dir_name
from trainer.data import data_fingerprint, load_datasets
from trainer.metrics import METRICS  # noqa: F401  (the glossary of what is logged: `ballast metrics`)
from trainer.records import append_rows, hold, read_rows, release
from trainer.samples import EVAL_SAMPLES_FILE, SAMPLES_FILE

SOURCE_NAME = "flows/pipeline.py:ballast_pipeline"
LONG_FACTS = ("code_commit", "base_model", "output_dir", "checkpoint_prefix", "fork_checkpoint")
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


# ── one pipeline run ───────────────────────────────────────────────────────────────────────────────


def signal_behind(e: BaseException) -> BaseException | None:
    """The signal that stopped a stage — Ctrl-C's KeyboardInterrupt, SIGTERM's, Prefect's TerminationSignal: a
    BaseException that is not an Exception — when `e` is one, or when `e` was raised while one was being handled:
    Ctrl-C landing in Prefect's task engine before its task run exists makes the engine's crash handler raise
    ValueError('Task run is not set'), which must still read as the stop it is, not as the stage's failure."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if not isinstance(e, Exception):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


class RunRecorder:
    """The MLflow side of one pipeline run. Make one with `start()` (a new run) or `resume()`."""

    def __init__(self, tracking: Tracking, spec: ExperimentSpec, run_id: str, source: ForkSource, resumed: bool):
        self.tracking, self.client, self.spec = tracking, tracking.client, spec
        self.run_id, self.source, self.resumed = run_id, source, resumed
        self.output_dir = Path(spec.project_dir).resolve() / "runs" / run_id
        self.cache_dir = Path(spec.project_dir).resolve() / "cache" / run_id
        self.store = open_store(store_uri(spec))
        self.checkpoint_prefix = checkpoint_prefix(run_id)
        self.metrics = MetricsSink(  # a resumed run's first sends what its record holds and MLflow lacks
            self.client,
            run_id,
            spec.tracking.log_every,
            spool=self.output_dir / PENDING,
            record=self.output_dir if resumed else None,
            copies=headline,
        )
        self.headline = Headline(self.metrics)  # a trainer callback, beside `metrics`
        self.prefect_url: str | None = None  # the Prefect flow run recording this attempt, linked in the description
        self.started = time.perf_counter()
        self.stage_run: str | None = None  # the MLflow run of the stage being recorded (`stage`)
        self.signalled_stage = "train"  # the stage a signal stopped (`interrupted` says where the run stopped)
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
        run.hold()
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
        run.hold()  # RunBusy while another process records it (the run itself, still training; a sync)
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
                "mlflow.user": user_name(),
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
        try:  # a signal while MLflow creates the stage's run stopped this stage too
            self.stage_run = self.tracking.create_run(f"{name} · {self.name}", self.run_id, {"ballast.stage": name})
            yield self
        except TrackingUnavailable:
            raise  # nothing can be recorded while the server is away; the flow says what to do
        except BaseException as e:
            signal = e if isinstance(e, RunInterrupted) else signal_behind(e)  # a signal, not an error
            if self.stage_run is not None:
                self.client.set_tag(self.stage_run, "ballast.error", f"{type(e).__name__}: {e}"[:4000])
                self.client.set_terminated(self.stage_run, "FAILED" if signal is None else "KILLED")
            if signal is not None:
                self.signalled_stage = name
                if signal is not e:
                    raise signal from None  # what a library raised while it handled the signal is not the story
                raise
            raise StageError(name, e) from e
        else:
            self.client.set_terminated(self.stage_run, "FINISHED")
        finally:
            self.stage_run = None

    @contextmanager
    def _flat_stage(self, name: str):
        self.stage_run = self.run_id
        try:
            yield self
        except TrackingUnavailable:
            raise
        except BaseException as e:
            signal = e if isinstance(e, RunInterrupted) else signal_behind(e)
            self.tracking.set_tags(self.run_id, {"failed_stage": name, "error": f"{type(e).__name__}: {e}"[:4000]})
            if signal is not None:
                self.signalled_stage = name
                if signal is not e:
                    raise signal from None  # what a library raised while it handled the signal is not the story
                raise
            raise StageError(name, e) from e
        finally:
            self.stage_run = None

    @property
    def stage_and_run(self) -> list[str]:
        """The stage run and the pipeline run, once each (one and the same for a sweep trial's flat stages)."""
        return list(dict.fromkeys((self.stage_run, self.run_id)))

    def record(self, result) -> None:
        """Log one stage's result to its stage run (and what belongs there to the pipeline run): the recorder
        RECORDERS holds for its type."""
        kind = next((t for t in type(result).__mro__ if t in RECORDERS), None)
        if kind is None:
            raise TypeError(f"no recorder for a {type(result).__name__}: register one with @records in tasks/record.py")
        RECORDERS[kind](self, result)

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        """`metrics` at `step` on `run_id` in one batch; on the pipeline run only the ones MLflow lacks there (a
        resume records the stages after training again)."""
        batch = step_metrics(step, metrics, now_ms())
        if run_id == self.run_id:
            batch = Held(self.client, run_id).lacks(batch)
        if batch:
            self.client.log_batch(run_id, metrics=batch)

    def put_tables(self, tables: dict[str, list[dict]], run_ids: list[str] | None = None) -> None:
        """Each table's rows whole onto the stage run and the pipeline run (or `run_ids`), in place of what it held."""
        for run_id in run_ids or self.stage_and_run:
            for table, rows in tables.items():
                put_table(self.client, run_id, rows, table)

    def evaluated_in_training(self, step: int) -> bool:
        """Whether the record holds an in-training eval at `step` (its eval/* metrics are then already logged)."""
        rows = read_rows(self.output_dir / RECORD)
        return any(row["step"] == step and any(k.startswith("eval/") for k in row) for row in rows)

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
        self.release()
        return result

    def fail(self, error: BaseException) -> None:
        """The run ends FAILED with the reason; what was saved stays for --resume."""
        try:
            self.metrics.close()
        except Exception:
            pass
        if isinstance(error, TrackingUnavailable):
            self.release()
            return  # the server is away: nothing can be recorded
        ending = (
            f"**Ended: failed.** {error}\n\nCheckpoints saved so far are kept; continue with "
            f"`{resume_command(self.run_id, self.spec.project_dir)}`."
        )
        self.tracking.set_tags(
            self.run_id,
            {"status": "failed", "stop_reason": str(error)[:4000], "mlflow.note.content": self.note(ending)},
        )
        self.client.set_terminated(self.run_id, "FAILED")
        self.release()

    def interrupted(self, error: BaseException) -> RunInterrupted:
        """A signal stopped the run (SIGTERM, Ctrl-C): KILLED in MLflow, not FAILED; returns what to tell the user."""
        stop = (
            error
            if isinstance(error, RunInterrupted)
            else RunInterrupted.of(error, list_checkpoints(self.output_dir / "checkpoints"), self.signalled_stage)
        )
        stop.run, stop.resume = f"run {self.run_id}", resume_command(self.run_id, self.spec.project_dir)
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
        self.tracking.kill_running_children(self.run_id)  # a stage run the signal left open (one it came while made)
        self.release()
        return stop

    def hold(self) -> None:
        """This process records the run (trainer/records.py `hold`): a pipeline run's, not a node's, whose run
        directory is the node's own copy."""
        hold(self.output_dir, f"the pipeline run {self.run_id}")

    def release(self) -> None:
        """The run ended here: another process may record it now (`ballast sync`, a resume)."""
        release(self.output_dir)


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """The headline copies (HEADLINE) of the metrics that have one."""
    return {HEADLINE + name: metrics[k] for k, name in HEADLINE_KEYS.items() if k in metrics}


class Headline(Callbacks):
    """A trainer callback that sends each step's headline copies to the run's metrics sink, on the steps whose
    metrics it sends (the same copies a resumed sink sends from the record: its `copies`)."""

    def __init__(self, sink: MetricsSink):
        self.sink = sink

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if (copies := headline(metrics)) and self.sink.takes(step, metrics):
            self.sink.put(step, copies)


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


# ── what each stage result records ─────────────────────────────────────────────────────────────────

RECORDERS: dict[type, Callable[[RunRecorder, object], None]] = {}


def records(kind: type):
    """Registers the function that records a stage result of type `kind` (RunRecorder.record looks it up)."""

    def register(fn):
        RECORDERS[kind] = fn
        return fn

    return register


@records(ForkSource)
def record_fork(run: RunRecorder, source: ForkSource) -> None:
    """Where the run started, on the fork stage's run, and how closely the forked model reproduced its source."""
    run.tracking.set_tags(
        run.stage_run,
        {
            "source": source.checkpoint_uri or f"base model {run.spec.model.name_or_path}",
            "parent_run_id": source.parent_run_id,
            "parent_step": source.parent_step,
        },
    )
    if source.max_logprob_diff is not None:
        run.log_metrics(run.stage_run, {"fork/max_logprob_diff": source.max_logprob_diff})


@records(TrainOutcome)
def record_training(run: RunRecorder, outcome: TrainOutcome) -> None:
    """The step metrics' last batch (and a resume's mismatches), the stage's figures, why it stopped, and the
    samples tables as the run directory holds them."""
    run.metrics.close()
    if run.metrics.mismatches:  # a resume that did not replay exactly: the values recorded first are kept
        shown = "; ".join(run.metrics.mismatches[:3])
        run.tracking.set_tags(run.run_id, {"resume_mismatch": f"{len(run.metrics.mismatches)}: {shown}"})
    run.log_metrics(run.stage_run, {"trainer_seconds": outcome.trainer_seconds, "last_step": outcome.last_step})
    if outcome.stopped:
        run.tracking.set_tags(run.run_id, {"stop_reason": str(StopReason.parse(outcome.stopped))})
    run.put_tables(
        {
            SAMPLES_TABLE: read_rows(run.output_dir / SAMPLES_FILE),
            EVAL_SAMPLES_TABLE: read_rows(run.output_dir / EVAL_SAMPLES_FILE),
        }
    )


@records(CheckpointSet)
def record_checkpoints(run: RunRecorder, checkpoints: CheckpointSet) -> None:
    """Where each checkpoint is stored, as checkpoints.json on the stage run and the pipeline run."""
    path = run.output_dir / "checkpoints.json"
    path.write_text(json.dumps({str(k): v for k, v in checkpoints.uris.items()}, indent=1))
    for run_id in run.stage_and_run:
        run.client.log_artifact(run_id, str(path))


@records(ProbeReport)
def record_probe(run: RunRecorder, report: ProbeReport) -> None:
    """The probe report (JSON and page) of one checkpoint, its malformed rate, its samples, whether it passed."""
    where = run.output_dir / "probe" / step_dir_name(report.step)
    report.write_json(where / "probe_report.json")
    report.write_html(where / "probe_report.html")
    run.probe_reports.append(report)
    for run_id in run.stage_and_run:
        run.client.log_artifacts(run_id, str(where), f"probe/{step_dir_name(report.step)}")
        run.log_metrics(run_id, {"probe/malformed_rate": report.malformed_rate}, report.step)
    run.put_tables({PROBE_SAMPLES_TABLE: [row for probed in run.probe_reports for row in probed.sample_rows()]})
    run.client.set_tag(run.stage_run, "ballast.probe_passed", str(report.passed))
    run.tracking.set_tags(
        run.run_id, {"probe_passed": report.passed, "probe_malformed_rate": f"{report.malformed_rate:.4f}"}
    )


@records(EvalResult)
def record_eval(run: RunRecorder, result: EvalResult) -> None:
    """The final checkpoint's held-out scores: on the eval stage's run, and on the pipeline run unless an
    in-training eval at that step put them there; its samples into the run directory, then to MLflow. The run
    directory's rows at a step are one eval's, the one whose scores the pipeline run holds (MLflow keeps a step's
    first value): the in-training eval's at that step, else the first final eval's — a resume that runs the final
    eval again adds none (a sampled eval on a GPU need not draw the same completions twice)."""
    eval_samples = run.output_dir / EVAL_SAMPLES_FILE
    if run.stage_run != run.run_id:
        run.log_metrics(run.stage_run, result.metrics, result.step)
    if not run.evaluated_in_training(result.step):  # the final eval, at the run's last step
        run.log_metrics(run.run_id, {**result.metrics, **headline(result.metrics)}, result.step)
        if not any(row.get("step") == result.step for row in read_rows(eval_samples)):
            append_rows(eval_samples, result.samples)
    run.put_tables({EVAL_SAMPLES_TABLE: result.samples}, [run.stage_run])
    run.put_tables({EVAL_SAMPLES_TABLE: read_rows(eval_samples)}, [run.run_id])


def put_table(client, run_id: str, rows: list[dict], table: str) -> None:
    """`rows` (trainer/samples.py) as the MLflow table `table` of `run_id`, replacing the one it held: the file
    MlflowClient.log_table writes (pandas' split JSON) and its mark in `mlflow.loggedArtifacts` — but log_table
    appends to a table that exists, and a table here mirrors the run directory's rows, each once."""
    if not rows:
        return
    import pandas as pd

    columns = list(dict.fromkeys(key for row in rows for key in row))
    frame = pd.DataFrame({column: [row.get(column) for row in rows] for column in columns})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / table
        frame.to_json(path, orient="split", index=False, date_format="iso")
        client.log_artifact(run_id, str(path), str(Path(table).parent) if Path(table).parent.name else None)
    logged = json.loads(client.get_run(run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
    if {"path": table, "type": "table"} not in logged:
        client.set_tag(run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps([*logged, {"path": table, "type": "table"}]))


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
                "mlflow.user": user_name(),
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


# ── ballast sync ───────────────────────────────────────────────────────────────────────────────────


def sync_run(tracking: Tracking, spec: ExperimentSpec, run_id: str, run_dir: Path) -> int:
    """What `ballast sync` sends of a run that is not running: the metrics MLflow lacks (kept in the spool, or in the
    record up to the newest checkpoint: tasks/metrics_sink.py), then the samples tables as the run directory holds
    them; returns how many metrics were sent."""
    sent = sync_record(tracking.client, run_id, run_dir, spec.tracking.log_every, headline)
    for table, name in ((SAMPLES_TABLE, SAMPLES_FILE), (EVAL_SAMPLES_TABLE, EVAL_SAMPLES_FILE)):
        put_table(tracking.client, run_id, read_rows(run_dir / name), table)
    return sent
