"""Checkpoints: the one home of the format — layout, names, manifest, hashing, saving and loading.

```
step-000120/
  adapter/        peft save_pretrained (safetensors); for full fine-tuning `model/` instead, a complete Hugging
                  Face model directory (weights, config, generation config *and* tokenizer) anyone can load
  tokenizer/      the tokenizer the run trained with (a mismatch is a classic silent bug)
  state/          optimizer.pt, scheduler.pt (loaded with weights_only=True), rng.json, trainer_state.json,
                  lagged.safetensors (reference snapshots for kl_ref_step_lag)
  manifest.json   sha256 of every file, base model identity, code ref, lineage, config hash, logprob fingerprint
```

Written into `.tmp-step-NNNNNN-<pid>/` and renamed into place when complete, so a killed process leaves a
temporary directory (ignored, cleaned later), never a half checkpoint. `Checkpoint.open` verifies every hash
and refuses a mismatch naming the file; fork, train/resume, eval, probe and the store all read checkpoints
through it. No pickles beyond `torch.load(weights_only=True)`.

`BALLAST_FAULT=kill-in-checkpoint:<step>` SIGKILLs the process half-way through writing that step's
checkpoint, `kill-in-step:<step>` half-way through that step: the hooks the resume tests use.
`kill-after-logged:<step>` SIGKILLs a pipeline run once MLflow holds that step's metrics (tasks/metrics_sink.py).
`hold-in-step:<step>` holds that step until a stop signal has arrived (`SIGNALLED`, set by the trainer's
SafePoint): the signal tests' way to land a signal inside a known step whatever the machine's speed.
`hold-in-probe:<step>` holds the artifact probe of that step's checkpoint the same way (no SafePoint runs there: the
signal's exception ends the wait).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .config import InputError, LoraConfig, ModelConfig

if TYPE_CHECKING:
    import torch

# torch, numpy, peft, safetensors and the model loader are imported by the functions that save or load tensors: the
# format's names, manifests and hashes (what the store, a fork's refusals and `ballast compare` read) load none of
# them, so a mistyped run id or a missing checkpoint is refused in the time Python takes to start, not torch's

MANIFEST = "manifest.json"
ADAPTER_CONFIG = "adapter_config.json"  # peft's, inside adapter/
FORMAT = "ballast-checkpoint/1"
STEP_DIR = re.compile(r"step-(\d{6,})")
HASH_BLOCK = 1 << 20


class CheckpointError(InputError):
    """A checkpoint that is missing, incomplete or altered, or that the run cannot resume from."""


# ── names and hashes ───────────────────────────────────────────────────────────────────────────────


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a directory named like `step-000120`; None for any other name."""
    m = STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def is_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a directory holding a checkpoint manifest (not verified: `Checkpoint.open` does that)."""
    return (Path(path) / MANIFEST).is_file()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(HASH_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def code_ref() -> dict:
    """The commit of the Ballast checkout running this code, and whether it has uncommitted changes."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=here,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return {"commit": commit or "unknown", "dirty": dirty}


SIGNALLED = threading.Event()  # a stop signal (SIGTERM, SIGINT) reached the training loop's SafePoint
HOLD_TIMEOUT_S = 900.0  # a held step that no signal reaches fails instead of hanging a test run


def fault_armed(name: str, step: int) -> bool:
    """Whether BALLAST_FAULT names this fault point (`NAME:STEP`)."""
    return os.environ.get("BALLAST_FAULT") == f"{name}:{step}"


def fault_point(name: str, step: int) -> None:
    """When BALLAST_FAULT names this point: SIGKILL this process here (a 'kill-' point, the resume tests), or wait
    here until a stop signal has arrived (a 'hold-' point, the signal tests)."""
    if not fault_armed(name, step):
        return
    if name.startswith("hold-"):
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while not SIGNALLED.is_set():  # a sleep, not Event.wait: the signal handler runs between the sleeps
            if time.monotonic() > deadline:
                raise RuntimeError(f"BALLAST_FAULT={name}:{step}: no stop signal came within {HOLD_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        return
    os.kill(os.getpid(), signal.SIGKILL)


# ── reading ────────────────────────────────────────────────────────────────────────────────────────


@dataclass
class TrainingState:
    """What a resume restores besides the weights."""

    optimizer: dict
    scheduler: dict
    rng: dict
    trainer: dict  # step, sampler, health gate, resumable config
    lagged: list[dict]  # reference snapshots (kl_ref_step_lag), oldest first


@dataclass(frozen=True)
class Checkpoint:
    """A saved checkpoint directory and its manifest. Make one with `Checkpoint.open(path)`."""

    path: Path
    manifest: dict

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> Checkpoint:
        """The checkpoint at `path`; with `verify`, every file is checked against its sha256 first."""
        path = Path(path)
        manifest = read_manifest(path)
        if verify:
            _verify_files(path, manifest)
        return cls(path, manifest)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def weights(self) -> str:
        """'adapter' (LoRA) or 'model' (full fine-tuning)."""
        return self.manifest.get("weights", "adapter")

    @property
    def weights_dir(self) -> Path:
        return self.path / self.weights

    @property
    def adapter_dir(self) -> Path | None:
        return self.path / "adapter" if self.weights == "adapter" else None

    @property
    def model_dir(self) -> Path | None:
        """A complete Hugging Face model directory (full fine-tuning only)."""
        return self.path / "model" if self.weights == "model" else None

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"

    def adapter_config(self) -> dict | None:
        """The saved adapter's config (peft's adapter/adapter_config.json: r, lora_alpha, target_modules); None for a
        full-model checkpoint or one without the file. A file that is not valid JSON raises CheckpointError naming it.
        """
        path = self.adapter_dir / ADAPTER_CONFIG if self.adapter_dir is not None else None
        if path is None or not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path.relative_to(self.path)} is not valid JSON ({e})") from None

    def manifest_sha256(self) -> str:
        """The sha256 of the manifest file, which names every other file's: one digest for the whole checkpoint."""
        return sha256_file(self.path / MANIFEST)

    def copy_for_inference(self, dest: Path) -> Path:
        """The weights (adapter/ or model/), the tokenizer/ when saved and the manifest, copied to `dest`: what loading
        the checkpoint for inference needs, without the training state (optimizer, scheduler, RNG)."""
        dest = Path(dest)
        for part in (self.weights_dir, self.tokenizer_dir):
            if part.is_dir():
                shutil.copytree(part, dest / part.name)
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.path / MANIFEST, dest / MANIFEST)
        return dest

    @property
    def fingerprint(self) -> dict | None:
        return self.manifest.get("fingerprint")

    @property
    def base_model(self) -> dict:
        return self.manifest.get("base_model") or {}

    @property
    def lora(self) -> dict | None:
        return self.manifest.get("lora")

    @property
    def code_ref(self) -> dict | None:
        return self.manifest.get("code_ref")

    def trainer_state(self) -> dict:
        """state/trainer_state.json alone (step, sampler, the resumable config the run trained with), read without
        loading the optimizer."""
        return json.loads((self.path / "state" / "trainer_state.json").read_text())

    def training_state(self) -> TrainingState:
        import torch
        from safetensors import safe_open

        state = self.path / "state"
        lagged: list[dict] = []
        lag_file = state / "lagged.safetensors"
        if lag_file.exists():
            with safe_open(str(lag_file), "pt") as f:
                lagged = [{} for _ in range(int(f.metadata()["count"]))]
                for key in f.keys():
                    i, name = key.split("/", 1)
                    lagged[int(i)][name] = f.get_tensor(key)
        return TrainingState(
            optimizer=torch.load(state / "optimizer.pt", weights_only=True, map_location="cpu"),
            scheduler=torch.load(state / "scheduler.pt", weights_only=True, map_location="cpu"),
            rng=json.loads((state / "rng.json").read_text()),
            trainer=json.loads((state / "trainer_state.json").read_text()),
            lagged=lagged,
        )

    def load_policy(self, model_cfg: ModelConfig, lora_cfg: LoraConfig | None = None, trainable: bool = False):
        """(model, tokenizer) from this checkpoint alone — never a trainer's memory: the base model named by
        `model_cfg` with the saved adapter, or the saved full model directory (with its own tokenizer)."""
        from .model import load_policy

        lora_cfg = lora_cfg or LoraConfig()
        if self.adapter_dir is not None:
            return load_policy(
                model_cfg,
                lora_cfg.model_copy(update={"enabled": True}),
                adapter_path=str(self.adapter_dir),
                trainable=trainable,
            )
        saved = model_cfg.model_copy(update={"name_or_path": str(self.model_dir), "build_if_missing": None})
        return load_policy(saved, lora_cfg.model_copy(update={"enabled": False}), trainable=trainable)

    def load_weights_into(self, model, adapter: str = "default") -> None:
        """Copy the saved weights into `model` (a peft model for an adapter checkpoint, into its adapter `adapter`;
        else the full model)."""
        from safetensors.torch import load_file

        if self.adapter_dir is not None:
            from peft import set_peft_model_state_dict

            weights = load_file(str(self.adapter_dir / "adapter_model.safetensors"))
            result = set_peft_model_state_dict(model, weights, adapter_name=adapter)
            if getattr(result, "unexpected_keys", None):
                raise CheckpointError(
                    f"checkpoint {self.path}: adapter has unexpected weights "
                    f"{result.unexpected_keys[:3]}; it was saved with a different LoRA configuration"
                )
            return
        state = {}
        for f in sorted(self.model_dir.glob("*.safetensors")):
            state.update(load_file(str(f)))
        model.load_state_dict(state, strict=False)


def read_manifest(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    mf = path / MANIFEST
    if not mf.exists():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it is incomplete or not a Ballast checkpoint")
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mf} is not valid JSON ({e}); the checkpoint is corrupt") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise CheckpointError(f"{mf} is not a {FORMAT} manifest")
    return manifest


def verify_files(path: Path, files: dict[str, str], where: str | None = None) -> None:
    """Check every file of a manifest's `files` map (relative path -> sha256) under `path`; raises CheckpointError
    naming the first that is missing, altered or outside `path`. `where` names the artifact in messages."""
    where = where or f"checkpoint {path}"
    root = Path(path).resolve()
    for rel, digest in sorted(files.items()):
        f = (root / rel).resolve()
        if root not in f.parents:
            raise CheckpointError(f"{where}: the manifest names {rel!r}, outside the artifact; the manifest is corrupt")
        if not f.is_file():
            raise CheckpointError(f"{where}: file {rel} listed in the manifest is missing; it is incomplete")
        if sha256_file(f) != str(digest).removeprefix("sha256:").lower():
            raise CheckpointError(
                f"{where}: file {rel} does not match its sha256 in the manifest; it was altered or "
                "corrupted after saving — restore it or resume from an earlier checkpoint"
            )


def _verify_files(path: Path, manifest: dict) -> None:
    verify_files(path, manifest["files"])
    extra = sorted(
        str(p.relative_to(path))
        for p in path.rglob("*")
        if p.is_file() and p.name != MANIFEST and str(p.relative_to(path)) not in manifest["files"]
    )
    if extra:
        raise CheckpointError(
            f"checkpoint {path}: file {extra[0]} is not in the manifest; something was added after saving"
        )


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint directory under root, oldest first (not verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = ((parse_step_dir(p.name), p) for p in root.iterdir() if p.is_dir())
    return sorted((step, p) for step, p in found if step is not None)


def latest_checkpoint(root: Path) -> Checkpoint | None:
    """The newest complete checkpoint under root, verified. Temporary directories of interrupted writes are
    removed; an altered newest checkpoint raises rather than silently falling back to an older one."""
    root = Path(root)
    if root.is_dir():
        for p in root.glob(".tmp-step-*"):
            shutil.rmtree(p, ignore_errors=True)
    found = list_checkpoints(root)
    return Checkpoint.open(found[-1][1]) if found else None


# ── writing ────────────────────────────────────────────────────────────────────────────────────────


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model,
    tokenizer,
    optimizer,
    scheduler,
    trainer_state: dict,
    manifest_extra: dict,
    lagged: list[dict[str, torch.Tensor]] | None = None,
    keep_last: int | None = None,
    adapter: str = "default",
) -> Checkpoint:
    """Write step-NNNNNN under root atomically. `manifest_extra` holds base model identity, lineage, config hash
    and fingerprint; `trainer_state` must be JSON-serialisable. `adapter`: which of the model's LoRA adapters
    (several trials may share one base model, trainer/multi.py); it is saved as a lone run's would be."""
    import torch
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "state").mkdir(parents=True)
    weights = _write_weights(tmp, model, tokenizer, adapter)
    fault_point("kill-in-checkpoint", step)
    torch.save(optimizer.state_dict(), tmp / "state" / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "state" / "scheduler.pt")
    (tmp / "state" / "rng.json").write_text(json.dumps(capture_rng()))
    (tmp / "state" / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1, sort_keys=True))
    if lagged:
        flat = {f"{i}/{name}": t.contiguous() for i, snap in enumerate(lagged) for name, t in snap.items()}
        save_file(flat, str(tmp / "state" / "lagged.safetensors"), metadata={"count": str(len(lagged))})
    files = {str(p.relative_to(tmp)): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = {
        "format": FORMAT,
        "step": step,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "weights": weights,
        "files": files,
        **manifest_extra,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    _fsync_tree(tmp)
    if final.exists():  # re-saving a step (e.g. after a resume) replaces the old copy
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep_last:
        apply_retention(root, keep_last)
    return Checkpoint(final, manifest)


def _write_weights(tmp: Path, model, tokenizer, adapter: str) -> str:
    """The weights ('adapter': peft's adapter/ of `adapter`; 'model': a complete model directory) and tokenizer/."""
    weights = "adapter" if hasattr(model, "peft_config") else "model"
    if weights == "adapter" and adapter != "default":  # peft writes a named adapter into a folder of that name
        model.save_pretrained(tmp / "named", safe_serialization=True, selected_adapters=[adapter])
        (tmp / "named" / adapter).rename(tmp / weights)
        shutil.rmtree(tmp / "named")
    else:
        model.save_pretrained(tmp / weights, safe_serialization=True)
    if weights == "model":
        tokenizer.save_pretrained(tmp / "model")  # a full fine-tune is a complete model directory
    tokenizer.save_pretrained(tmp / "tokenizer")
    return weights


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def apply_retention(root: Path, keep_last: int) -> list[Path]:
    found = list_checkpoints(root)
    removed = [p for _, p in found[:-keep_last]] if keep_last > 0 else []
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


# ── random state ───────────────────────────────────────────────────────────────────────────────────


def capture_rng() -> dict:
    import numpy as np
    import torch

    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.random.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def restore_rng(rng: dict) -> None:
    import numpy as np
    import torch

    random.setstate((rng["python"][0], tuple(rng["python"][1]), rng["python"][2]))
    n = rng["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.random.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    if rng.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in rng["cuda"]])
