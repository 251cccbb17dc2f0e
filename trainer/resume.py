"""What a checkpoint may be resumed into: the run's config as saved, against the spec a resume gives, minus what may
change across a resume (RESUMABLE_CHANGES). Free of torch: `ballast train --resume` into the wrong directory or with
a changed spec is refused before any model or optimizer state loads, and a run directory's checkpoints are checked
from their trainer_state.json alone (not from an optimizer state that may be gigabytes)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from . import checkpoint as ckpt
from .config import TrainerConfig
from .records import read_rows
from .samples import EVAL_SAMPLES_FILE, SAMPLES_FILE

RECORDS = ("metrics.jsonl", "prompts.jsonl", SAMPLES_FILE, EVAL_SAMPLES_FILE)  # the run's records a resume cuts back

# what a resume may change: the total step count, and how this machine lays out the same computation — one process,
# DDP or FSDP2 ranks (a checkpoint is the whole trainable state whatever the wrapping, resharded on load:
# trainer/dist_checkpoint.py) and torch's CPU threads; a run started alone continues on --nproc 2 (parallel: none
# there is refused) and a run of 2 ranks continues on a machine with 1
RESUMABLE_CHANGES = {"optim": ("steps",), "model": ("parallel", "torch_threads")}


def resumable_view(cfg: TrainerConfig) -> dict:
    """The config minus what may change across a resume (RESUMABLE_CHANGES): what a checkpoint records."""
    d = cfg.model_dump(mode="json")
    for section, fields in RESUMABLE_CHANGES.items():
        for name in fields:
            d[section].pop(name, None)
    return d


def config_hash(cfg: TrainerConfig) -> str:
    return hashlib.sha256(json.dumps(resumable_view(cfg), sort_keys=True).encode()).hexdigest()[:16]


def refuse_changed_config(saved: dict, now: dict, path: Path) -> None:
    """A CheckpointError naming the first field of `now` (a resumable_view) that differs from the checkpoint's."""

    def first_diff(a, b, prefix=""):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                d = first_diff(a.get(k), b.get(k), f"{prefix}{k}.")
                if d:
                    return d
            return None
        return None if a == b else (prefix.rstrip("."), a, b)

    diff = first_diff(_with_new_defaults(saved), now)
    if saved and diff:
        key, was, is_now = diff
        raise ckpt.CheckpointError(
            f"cannot resume from {path}: spec field {key} was {was!r} and is now {is_now!r}; "
            "resume with the spec the run started with (only optim.steps, model.parallel and model.torch_threads may "
            "change), or fork a new run"
        )


def _with_new_defaults(saved: dict) -> dict:
    """A checkpoint's config with the fields added to TrainerConfig since it was written set to their defaults
    (a field a newer Ballast added, left at its default, changes nothing); as saved if it no longer validates."""
    try:
        return resumable_view(TrainerConfig.model_validate(saved)) if saved else saved
    except Exception:
        return saved


def check_resume(cfg: TrainerConfig, output_dir: str | Path) -> Path | None:
    """The checkpoint a resume of `output_dir` starts from (None: there is none), verified and checked against
    `cfg`, and the run's records read, before any model loads, so a refused resume (CheckpointError, RecordError)
    is quick and leaves the run as it was."""
    checkpoint = ckpt.latest_checkpoint(Path(output_dir) / "checkpoints")
    if checkpoint is None:
        return None
    refuse_changed_config(checkpoint.trainer_state().get("config", {}), resumable_view(cfg), checkpoint.path)
    if checkpoint.step > cfg.optim.steps:  # it said the run was done, and the run directory's spec was rewritten
        raise ckpt.CheckpointError(
            f"cannot resume from {checkpoint.path}: it is at step {checkpoint.step}, past optim.steps "
            f"{cfg.optim.steps}; give more steps than {checkpoint.step} to train on (--steps), or fork a new run "
            "from an earlier checkpoint"
        )
    for name in RECORDS:  # a damaged record (RecordError) would stop the resume after the model load
        read_rows(Path(output_dir) / name)
    return checkpoint.path
