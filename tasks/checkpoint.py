"""Checkpoint stage: every checkpoint the trainer saved is in the artifact store, verified, with retention.

`reachable_store` opens the store and checks it once, quickly, so that a run whose store is down fails at its
start. The trainer's callback (`CheckpointUploader`) uploads each checkpoint as it is saved; an upload that fails
(store down) is only recorded, so training goes on, and is tried again with the next checkpoint once a quick
check finds the store back. `sync_checkpoints` then uploads whatever is missing or differs — with retries,
because a store outage is usually transient — and deletes stored checkpoints beyond `checkpoint.keep_last`. If
the store stays unreachable the stage fails naming every checkpoint not uploaded, where it is kept, and the
command that uploads it (`ballast sync RUN_ID`; `ballast run --resume RUN_ID` also finishes the run).
`fetch_checkpoint` is how every later stage reads one back: downloaded (for s3://) and opened with
`Checkpoint.open`, which verifies every file.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from infra.store import ArtifactStore, fetch, open_store
from tasks.spec import ExperimentSpec
from trainer.callbacks import Callbacks
from trainer.checkpoint import MANIFEST, Checkpoint, list_checkpoints, parse_step_dir, step_dir_name
from trainer.resume import check_resume


def check_resumable(spec: ExperimentSpec, output_dir: Path) -> Path | None:
    """The checkpoint a resume of `output_dir` starts from (None: none yet), verified and matching `spec`; a
    CheckpointError otherwise — before any model loads (nothing here imports torch), and with nothing in
    `output_dir` changed."""
    return check_resume(spec.trainer_config(), output_dir)


@dataclass
class CheckpointSet:
    """The run's checkpoints in the artifact store: {step: URI}, oldest first."""

    uris: dict[int, str]

    @property
    def final_step(self) -> int:
        return max(self.uris)

    @property
    def final_uri(self) -> str:
        return self.uris[self.final_step]


class CheckpointUploader(Callbacks):
    """Uploads each checkpoint to the store as the trainer saves it. While the store is down, a checkpoint waits
    (`failed`) and training goes on; each new checkpoint first asks the store, with its short check, whether it is
    back, then uploads the waiting ones too. What still waits at the end, the checkpoint stage uploads."""

    def __init__(self, store: ArtifactStore, prefix: str):
        self.store, self.prefix = store, prefix
        self.uploaded: dict[int, str] = {}
        self.failed: dict[int, Path] = {}
        self.errors: list[str] = []

    def on_checkpoint(self, checkpoint: Checkpoint) -> None:
        self.failed[checkpoint.step] = checkpoint.path
        try:
            if len(self.failed) > 1:  # the store was down: a check costs seconds where an upload could cost minutes
                self.store.check()
            for step, path in sorted(self.failed.items()):
                if path.is_dir():  # not removed by checkpoint.keep_last meanwhile
                    self.uploaded[step] = self.store.put_dir(path, f"{self.prefix}/{path.name}")
                del self.failed[step]
        except Exception as e:  # the checkpoint stage retries; training goes on
            self.errors.append(f"step {checkpoint.step}: {e}")


def checkpoint_prefix(run_id: str) -> str:
    """Where a pipeline run's checkpoints go in the artifact store, relative to its root."""
    return f"runs/{run_id}/checkpoints"


def reachable_store(uri: str) -> ArtifactStore:
    """The artifact store at `uri`, checked once with a short timeout (StoreUnavailable, BucketNotFound or
    PermissionError, each one line naming the endpoint or bucket and the fix)."""
    store = open_store(uri)
    store.check()
    return store


class CheckpointsNotUploaded(RuntimeError):
    """The store did not take some of a run's checkpoints; they are kept locally."""


def run_command(verb: str, run_id: str, project_dir: str | Path) -> str:
    """`ballast VERB RUN_ID` ('run --resume', 'sync') for a run of the project at `project_dir`, which it names
    (--project-dir) when that is not the default (.ballast in the working directory), where the command would not
    find the run."""
    default = Path(".ballast").resolve() == Path(project_dir).resolve()
    return f"ballast {verb} {run_id}" + ("" if default else f" --project-dir {shlex.quote(str(project_dir))}")


def resume_command(run_id: str, project_dir: str | Path) -> str:
    """The command that continues run `run_id`: `ballast run --resume RUN_ID [--project-dir P]`."""
    return run_command("run --resume", run_id, project_dir)


def sync_checkpoints(
    store: ArtifactStore,
    prefix: str,
    ckpt_root: Path,
    keep_last: int,
    run_id: str | None = None,
    project_dir: str | Path = ".ballast",
) -> CheckpointSet:
    """Upload the run's missing or changed checkpoints, apply retention in the store, return what is there. When the
    store fails, CheckpointsNotUploaded names each checkpoint not uploaded and the commands that upload them (for
    run `run_id` of the project at `project_dir`)."""
    local = list_checkpoints(ckpt_root)
    for i, (_, path) in enumerate(local):
        dest = f"{prefix}/{path.name}"
        try:
            local_manifest = json.loads((path / MANIFEST).read_text())
            stored = store.exists(f"{dest}/{MANIFEST}") and json.loads(store.read_text(f"{dest}/{MANIFEST}"))
            if stored != local_manifest:
                store.put_dir(path, dest)
        except Exception as e:
            later = (
                f"; when the store is back, `{run_command('sync', run_id, project_dir)}` uploads them and "
                f"`{resume_command(run_id, project_dir)}` finishes the run"
                if run_id
                else ""
            )
            raise CheckpointsNotUploaded(
                f"{len(local) - i} checkpoint(s) not uploaded to {store.child_uri(prefix)}: "
                f"{', '.join(p.name for _, p in local[i:])} (kept in {ckpt_root}): {e}{later}"
            ) from e
    stored = sorted(s for s in (parse_step_dir(d) for d in store.list_dirs(prefix)) if s is not None)
    for step in stored[:-keep_last]:
        store.delete_dir(f"{prefix}/{step_dir_name(step)}")
    kept = stored[-keep_last:]
    if not kept:
        raise RuntimeError(f"the run saved no checkpoint (nothing under {ckpt_root} or {store.child_uri(prefix)})")
    return CheckpointSet({s: store.child_uri(prefix, step_dir_name(s)) for s in kept})


def fetch_checkpoint(uri: str, cache_dir: Path) -> Checkpoint:
    """The checkpoint at `uri` (a local path or s3://), downloaded to `cache_dir` if remote, every file verified."""
    return Checkpoint.open(fetch(str(uri), Path(cache_dir), verify=False))
