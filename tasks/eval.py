"""Eval stage: the final checkpoint, reloaded from the artifact store into a fresh model, scored on the held-out
set with the standalone decoding of trainer/evaluate.py — the same function in-training eval uses. Nothing of
the trainer's in-memory state is reused. `samples` (eval.log_samples of the completions, trainer/samples.py) become
the MLflow table eval_samples.json (tasks/record.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tasks.checkpoint import fetch_checkpoint
from trainer.data import load_datasets
from trainer.evaluate import evaluate_with_samples
from trainer.rewards import RewardComputer


@dataclass
class EvalResult:
    checkpoint_uri: str
    step: int  # the checkpoint's step: the final eval is logged at the run's last step
    metrics: dict[str, float]  # eval/reward, eval/accuracy, eval/mean_length
    samples: list[dict] = field(default_factory=list)  # eval.log_samples completions (trainer/samples.py rows)


def eval_checkpoint(spec, checkpoint_uri: str, cache_dir: Path) -> EvalResult:
    checkpoint = fetch_checkpoint(checkpoint_uri, cache_dir)
    model, tokenizer = checkpoint.load_policy(spec.model, spec.lora)
    _, held_out = load_datasets(spec.data)
    rewards = RewardComputer(
        spec.rewards, output_dir=cache_dir
    )  # a judge's answers are cached there: a resume pays once
    metrics, samples = evaluate_with_samples(model, tokenizer, held_out, spec.eval, rewards, spec.data, checkpoint.step)
    return EvalResult(str(checkpoint_uri), checkpoint.step, metrics, samples)
