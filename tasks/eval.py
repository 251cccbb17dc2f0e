"""Eval stage: the final checkpoint, reloaded from the artifact store into a fresh model, scored on the
held-out set with the standalone decoding of trainer/evaluate.py (the same function in-training eval
uses). Nothing of the trainer's in-memory state is reused."""
from __future__ import annotations

from pathlib import Path

from trainer.data import load_datasets
from trainer.evaluate import evaluate
from trainer.model import load_policy
from trainer.rewards import RewardComputer


def eval_checkpoint(spec, checkpoint_uri: str, cache_dir: Path) -> dict[str, float]:
    from tasks.store import fetch

    local = fetch(checkpoint_uri, cache_dir)
    adapter = local / "adapter"
    model_cfg = spec.model if adapter.exists() else spec.model.model_copy(update={"name_or_path": str(local / "model"), "build_if_missing": None})
    model, tokenizer = load_policy(model_cfg, spec.lora, adapter_path=str(adapter) if adapter.exists() else None, trainable=False)
    _, held_out = load_datasets(spec.data)
    return evaluate(model, tokenizer, held_out, spec.eval, RewardComputer(spec.rewards))
