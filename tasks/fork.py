"""Fork stage: where a run starts, and the proof that it starts there.

The source is the base model alone, a checkpoint of an earlier run (its MLflow run id and a step, the newest by
default), or a checkpoint URI (local path or s3://). The checkpoint is fetched and verified (every file's
sha256), its base model compared with the spec's, and then base + adapter are loaded exactly as the new run will
load them and teacher-forced over the manifest's fingerprint sequence: the logprobs must match those recorded at
save time. That catches "the fork did not load" (fresh LoRA weights), "the adapter was applied twice", a
different LoRA scaling and a different base model — before any MLflow run or output exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infra.store import open_store
from tasks.checkpoint import fetch_checkpoint
from tasks.spec import ExperimentSpec
from trainer.checkpoint import Checkpoint, CheckpointError, parse_step_dir, step_dir_name
from trainer.config import InputError


class ForkError(InputError):
    """The fork source cannot be found, or does not reproduce its own fingerprint."""


@dataclass
class ForkSource:
    """Where a run starts: nothing (the base model), or a verified checkpoint of an earlier run."""

    checkpoint_uri: str | None = None
    checkpoint: Checkpoint | None = None
    parent_run_id: str | None = None
    parent_step: int | None = None
    max_logprob_diff: float | None = None

    @property
    def adapter_dir(self) -> Path | None:
        return self.checkpoint.adapter_dir if self.checkpoint is not None else None

    def describe(self) -> str:
        if self.checkpoint_uri is None:
            return "base model"
        return f"{self.parent_run_id or self.checkpoint_uri} step {self.parent_step}"


def fork(spec: ExperimentSpec, checkpoint_prefix_of: Callable[[str], str]) -> ForkSource:
    """Find, fetch and verify the fork source named in `spec.fork` (the base model alone when it names none).
    `checkpoint_prefix_of(run_id)` gives a pipeline run's checkpoint location in the store (tasks/record.py)."""
    return verify_fork(spec, resolve_fork(spec, checkpoint_prefix_of))


def resolve_fork(spec: ExperimentSpec, checkpoint_prefix_of: Callable[[str], str]) -> ForkSource:
    f = spec.fork
    if f.run_id is None and f.checkpoint is None:
        return ForkSource()
    if f.run_id and f.checkpoint:
        raise ForkError("fork: give fork.run_id (with fork.step) or fork.checkpoint, not both")
    uri, parent_step = f.checkpoint, f.step
    if f.run_id:
        prefix = checkpoint_prefix_of(f.run_id)
        store = open_store(prefix)
        steps = sorted(s for s in (parse_step_dir(d) for d in store.list_dirs("")) if s is not None)
        if not steps:
            raise ForkError(f"fork.run_id={f.run_id}: no checkpoints under {prefix}")
        if parent_step is None:
            parent_step = steps[-1]
        elif parent_step not in steps:
            raise ForkError(
                f"fork.step={parent_step}: run {f.run_id} has checkpoints at steps {steps} only "
                "(retention keeps checkpoint.keep_last)"
            )
        uri = store.child_uri(step_dir_name(parent_step))
    try:
        checkpoint = fetch_checkpoint(uri, Path(spec.project_dir) / "cache" / "fork")
    except CheckpointError as e:
        raise ForkError(f"fork source {uri} failed verification: {e}") from None
    if checkpoint.adapter_dir is None:
        raise ForkError(f"fork source {uri} is a full fine-tune checkpoint; forking supports LoRA adapters")
    return ForkSource(
        checkpoint_uri=uri,
        checkpoint=checkpoint,
        parent_run_id=f.run_id,
        parent_step=parent_step if parent_step is not None else checkpoint.step,
    )


def verify_fork(spec: ExperimentSpec, source: ForkSource) -> ForkSource:
    """Load the source as the new run will, and check it reproduces the stored fingerprint."""
    if source.checkpoint is None:
        return source
    from trainer.model import compare_fingerprint, load_policy, model_identity  # torch: only where a model loads

    saved_base, now_base = source.checkpoint.base_model, model_identity(spec.model)
    for key in ("config_sha256", "weights_sha256"):
        if key in saved_base and key in now_base and saved_base[key] != now_base[key]:
            raise ForkError(
                f"fork source {source.checkpoint_uri} was trained on base model "
                f"{saved_base.get('name_or_path')} ({key} differs from {spec.model.name_or_path}); "
                "set model.name_or_path to the source's base model"
            )
    model, tokenizer = load_policy(spec.model, spec.lora, adapter_path=str(source.adapter_dir), trainable=False)
    diff = compare_fingerprint(model, tokenizer, next(model.parameters()).device, source.checkpoint.fingerprint)
    del model
    if not diff <= spec.fork.verify_tolerance:
        raise ForkError(
            f"fork source {source.checkpoint_uri} does not reproduce its logprob fingerprint (max |diff| "
            f"{diff:.3g} > {spec.fork.verify_tolerance}): the loaded model is not the one that was saved "
            "(adapter missing, applied twice, rescaled, or a different base); refusing to fork"
        )
    source.max_logprob_diff = diff
    return source
