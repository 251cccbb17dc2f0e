"""Checkpoints: the whole training state, written atomically, verified on load.

```
step-000120/
  adapter/          peft save_pretrained (safetensors); `model/` instead for full fine-tuning
  tokenizer/        the tokenizer the run trained with (a mismatch is a classic silent bug)
  state/            optimizer.pt, scheduler.pt (torch.save, loaded with weights_only=True),
                    rng.json (python, numpy, torch), trainer_state.json (step, sampler, health gate),
                    lagged.safetensors (reference snapshots for kl_ref_step_lag)
  manifest.json     sha256 of every file, base model identity, code ref, lineage, config hash,
                    logprob fingerprint
```

A checkpoint is written into `.tmp-step-NNNNNN-<pid>/` beside its final place and renamed into place
only when complete, so a process killed mid-write leaves a temporary directory (ignored, cleaned
later) and never a half checkpoint. Loading verifies every hash in the manifest and refuses a
mismatch naming the file. No pickles beyond `torch.load(weights_only=True)`.

`BALLAST_FAULT=kill-in-checkpoint:<step>` SIGKILLs the process half-way through writing that step's
checkpoint, and `kill-in-step:<step>` half-way through that step (after its rollouts): the
fault-injection hooks the resume tests use.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

MANIFEST = "manifest.json"
FORMAT = "ballast-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or altered."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def code_ref() -> dict:
    """The commit of the Ballast checkout running this code, and whether it has uncommitted changes."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return {"commit": commit or "unknown", "dirty": dirty}


def fault_point(name: str, step: int) -> None:
    """SIGKILL this process here when BALLAST_FAULT names this point (resume tests)."""
    if os.environ.get("BALLAST_FAULT") == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def save_checkpoint(root: Path, step: int, *, model, tokenizer, optimizer, scheduler, trainer_state: dict,
                    manifest_extra: dict, lagged: list[dict[str, torch.Tensor]] | None = None, keep_last: int | None = None) -> Path:
    """Write step-NNNNNN under root atomically; returns its path. `manifest_extra` holds base model
    identity, lineage, config hash and fingerprint; `trainer_state` must be JSON-serialisable."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "state").mkdir(parents=True)
    is_peft = hasattr(model, "peft_config")
    model.save_pretrained(tmp / ("adapter" if is_peft else "model"), safe_serialization=True)
    tokenizer.save_pretrained(tmp / "tokenizer")
    fault_point("kill-in-checkpoint", step)
    torch.save(optimizer.state_dict(), tmp / "state" / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "state" / "scheduler.pt")
    (tmp / "state" / "rng.json").write_text(json.dumps(capture_rng()))
    (tmp / "state" / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1, sort_keys=True))
    if lagged:
        from safetensors.torch import save_file
        flat = {f"{i}/{name}": t.contiguous() for i, snap in enumerate(lagged) for name, t in snap.items()}
        save_file(flat, str(tmp / "state" / "lagged.safetensors"), metadata={"count": str(len(lagged))})
    files = {str(p.relative_to(tmp)): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = {"format": FORMAT, "step": step, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "weights": "adapter" if is_peft else "model", "files": files, **manifest_extra}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    _fsync_tree(tmp)
    if final.exists():  # re-saving a step (e.g. after a resume) replaces the old copy
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep_last:
        apply_retention(root, keep_last)
    return final


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def read_manifest(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    mf = path / MANIFEST
    if not mf.exists():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it is incomplete or not a Ballast checkpoint")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{mf} is not valid JSON ({e}); the checkpoint is corrupt") from None
    if manifest.get("format") != FORMAT or "files" not in manifest:
        raise CheckpointError(f"{mf} is not a {FORMAT} manifest")
    return manifest


def verify_checkpoint(path: Path) -> dict:
    """The manifest, after checking every file's sha256; raises CheckpointError naming the first bad file."""
    path = Path(path)
    manifest = read_manifest(path)
    for rel, digest in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: file {rel} listed in the manifest is missing; the checkpoint is incomplete")
        if sha256_file(f) != digest:
            raise CheckpointError(f"checkpoint {path}: file {rel} does not match its sha256 in the manifest; "
                                  "it was altered or corrupted after saving — restore it or resume from an earlier checkpoint")
    extra = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != MANIFEST
                   and str(p.relative_to(path)) not in manifest["files"])
    if extra:
        raise CheckpointError(f"checkpoint {path}: file {extra[0]} is not in the manifest; something was added after saving")
    return manifest


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit():
            out.append((int(p.name[5:]), p))
    return sorted(out)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under root, verified. Temporary directories of interrupted
    writes are ignored (and removed); an altered newest checkpoint raises rather than silently
    falling back to an older one."""
    root = Path(root)
    if root.is_dir():
        for p in root.glob(".tmp-step-*"):
            shutil.rmtree(p, ignore_errors=True)
    found = list_checkpoints(root)
    if not found:
        return None
    path = found[-1][1]
    verify_checkpoint(path)
    return path


def apply_retention(root: Path, keep_last: int) -> list[Path]:
    found = list_checkpoints(root)
    removed = [p for _, p in found[:-keep_last]] if keep_last > 0 else []
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def load_state(path: Path) -> dict:
    """Optimizer and scheduler state dicts, RNG state, trainer state and lagged snapshots of a verified checkpoint."""
    state = Path(path) / "state"
    out = {
        "optimizer": torch.load(state / "optimizer.pt", weights_only=True, map_location="cpu"),
        "scheduler": torch.load(state / "scheduler.pt", weights_only=True, map_location="cpu"),
        "rng": json.loads((state / "rng.json").read_text()),
        "trainer_state": json.loads((state / "trainer_state.json").read_text()),
        "lagged": [],
    }
    lag_file = state / "lagged.safetensors"
    if lag_file.exists():
        from safetensors import safe_open
        with safe_open(str(lag_file), "pt") as f:
            count = int(f.metadata()["count"])
            snaps: list[dict] = [{} for _ in range(count)]
            for key in f.keys():
                i, name = key.split("/", 1)
                snaps[int(i)][name] = f.get_tensor(key)
        out["lagged"] = snaps
    return out


def capture_rng() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.random.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def restore_rng(rng: dict) -> None:
    random.setstate((rng["python"][0], tuple(rng["python"][1]), rng["python"][2]))
    n = rng["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.random.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    if rng.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in rng["cuda"]])
