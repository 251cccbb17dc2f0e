"""Fork: where a run starts, and the proof that it starts there.

The source is the base model alone, a checkpoint of an earlier run (its MLflow run id and a step,
the newest by default), or a checkpoint URI (local path or s3://). The checkpoint is fetched from
the artifact store, its manifest verified (every file's sha256), its base model compared with the
spec's, and then base + adapter are loaded exactly as the new run will load them and teacher-forced
over the manifest's fingerprint sequence: the logprobs must match those recorded at save time. That
catches "the fork did not load" (fresh LoRA weights), "the adapter was applied twice", a different
LoRA scaling and a different base model — before any MLflow run or output exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoint import CheckpointError, step_dir_name, verify_checkpoint
from trainer.model import compare_fingerprint, load_policy, model_identity


class ForkError(ValueError):
    """The fork source cannot be found, or does not reproduce its own fingerprint."""


@dataclass
class ForkSource:
    checkpoint_uri: str | None = None
    local_dir: Path | None = None
    parent_run_id: str | None = None
    parent_step: int | None = None
    max_logprob_diff: float | None = None
    manifest: dict | None = None

    @property
    def adapter_dir(self) -> Path | None:
        return self.local_dir / "adapter" if self.local_dir is not None else None


def resolve_fork(spec, client=None) -> ForkSource:
    """Find, fetch and verify the fork source named in spec.fork (or the base model alone)."""
    from tasks.store import fetch, open_store

    f = spec.fork
    if f.run_id is None and f.checkpoint is None:
        return ForkSource()
    if f.run_id and f.checkpoint:
        raise ForkError("fork: give fork.run_id (with fork.step) or fork.checkpoint, not both")
    uri, parent_step = f.checkpoint, f.step
    if f.run_id:
        from tasks.lineage import TAG, find_run
        run = find_run(client, f.run_id)
        prefix = run.data.tags.get(TAG + "checkpoint_prefix")
        if not prefix:
            raise ForkError(f"fork.run_id={f.run_id}: that MLflow run has no checkpoints recorded (tag {TAG}checkpoint_prefix); "
                            "fork a Ballast pipeline run, or give fork.checkpoint")
        store = open_store(prefix)
        steps = sorted(int(d[5:]) for d in store.list_dirs("") if d.startswith("step-") and d[5:].isdigit())
        if not steps:
            raise ForkError(f"fork.run_id={f.run_id}: no checkpoints under {prefix}")
        if parent_step is None:
            parent_step = steps[-1]
        elif parent_step not in steps:
            raise ForkError(f"fork.step={parent_step}: run {f.run_id} has checkpoints at steps {steps} only (retention keeps checkpoint.keep_last)")
        uri = store.child_uri(step_dir_name(parent_step))
    cache = Path(spec.project_dir) / "cache" / "fork"
    local = fetch(uri, cache)
    try:
        manifest = verify_checkpoint(local)
    except CheckpointError as e:
        raise ForkError(f"fork source {uri} failed verification: {e}") from None
    if manifest.get("weights") != "adapter":
        raise ForkError(f"fork source {uri} is a full fine-tune checkpoint; forking supports LoRA adapters")
    return ForkSource(checkpoint_uri=uri, local_dir=local, parent_run_id=f.run_id,
                      parent_step=parent_step if parent_step is not None else manifest.get("step"), manifest=manifest)


def verify_fork(spec, source: ForkSource) -> ForkSource:
    """Load the source as the new run will, and check it reproduces the stored fingerprint."""
    if source.local_dir is None:
        return source
    manifest = source.manifest
    saved_base = manifest.get("base_model", {})
    now_base = model_identity(spec.model)
    for key in ("config_sha256", "weights_sha256"):
        if key in saved_base and key in now_base and saved_base[key] != now_base[key]:
            raise ForkError(f"fork source {source.checkpoint_uri} was trained on base model {saved_base.get('name_or_path')} "
                            f"({key} differs from {spec.model.name_or_path}); set model.name_or_path to the source's base model")
    model, tokenizer = load_policy(spec.model, spec.lora, adapter_path=str(source.adapter_dir), trainable=False)
    device = next(model.parameters()).device
    diff = compare_fingerprint(model, tokenizer, device, manifest["fingerprint"])
    del model
    if not diff <= spec.fork.verify_tolerance:
        raise ForkError(f"fork source {source.checkpoint_uri} does not reproduce its logprob fingerprint (max |diff| {diff:.3g} > "
                        f"{spec.fork.verify_tolerance}): the loaded model is not the one that was saved (adapter missing, applied twice, "
                        "rescaled, or a different base); refusing to fork")
    source.max_logprob_diff = diff
    return source


def fork(spec, client=None) -> ForkSource:
    return verify_fork(spec, resolve_fork(spec, client))
