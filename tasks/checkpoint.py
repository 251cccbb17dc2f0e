"""Checkpoint stage: every checkpoint the trainer saved is in the artifact store, with its manifest,
and retention applies there too.

The trainer's callback uploads each checkpoint as it is saved; an upload that failed (store down)
is only recorded, so training goes on. This stage then uploads whatever is missing — with retries,
because a store outage is usually transient — verifies that each stored checkpoint's manifest matches
the local one, and deletes stored checkpoints beyond `checkpoint.keep_last`. If the store stays
unreachable the stage fails with the reason, and the local checkpoints stay for `ballast run --resume`.
"""
from __future__ import annotations

import json
from pathlib import Path

from trainer.checkpoint import MANIFEST, list_checkpoints


def sync_checkpoints(store, prefix: str, ckpt_root: Path, keep_last: int) -> dict[int, str]:
    """{step: URI} of the run's checkpoints in the store, after uploading the missing ones and applying retention."""
    local = dict(list_checkpoints(ckpt_root))
    for step, path in local.items():
        dest = f"{prefix}/{path.name}"
        if not store.exists(f"{dest}/{MANIFEST}") or json.loads(store.read_text(f"{dest}/{MANIFEST}")) != json.loads((path / MANIFEST).read_text()):
            store.put_dir(path, dest)
    stored = sorted(int(d[5:]) for d in store.list_dirs(prefix) if d.startswith("step-") and d[5:].isdigit())
    for step in stored[:-keep_last]:
        store.delete_dir(f"{prefix}/step-{step:06d}")
    return {s: store.child_uri(prefix, f"step-{s:06d}") for s in stored[-keep_last:]}
