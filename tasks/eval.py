"""Eval stage: the final checkpoint, reloaded from the artifact store into a fresh model, scored on the held-out
set with the standalone decoding of trainer/evaluate.py — the same function in-training eval uses. Nothing of
the trainer's in-memory state is reused. `samples` (eval.log_samples of the completions, trainer/samples.py) become
the MLflow table eval_samples.json (tasks/record.py).

`eval_baseline` scores the model a run starts from — the base model, or the fork source's adapter — on the same
held-out set with the same eval settings: the baseline a sweep reads every trial against (sweeps/baseline.py). Both
keep the per-prompt scores, so a trial and its baseline can be compared prompt by prompt."""

from __future__ import annotations

from pathlib import Path

from tasks.checkpoint import fetch_checkpoint
from tasks.results import EvalResult
from tasks.spec import ExperimentSpec
from trainer.data import load_datasets
from trainer.evaluate import score_held_out
from trainer.rewards import RewardComputer


def eval_checkpoint(
    spec: ExperimentSpec, checkpoint_uri: str, cache_dir: Path, examples: list | None = None
) -> EvalResult:
    """The checkpoint's held-out scores: on the spec's held-out set, or on `examples` (a confirmation file's)."""
    checkpoint = fetch_checkpoint(checkpoint_uri, cache_dir)
    model, tokenizer = checkpoint.load_policy(spec.model, spec.lora)
    held_out = examples if examples is not None else load_datasets(spec.data)[1]
    rewards = RewardComputer(
        spec.rewards, output_dir=cache_dir
    )  # a judge's answers are cached there: a resume pays once
    metrics, per_prompt, samples = score_held_out(
        model, tokenizer, held_out, spec.eval, rewards, spec.data, checkpoint.step
    )
    return EvalResult(str(checkpoint_uri), checkpoint.step, metrics, samples, per_prompt)


def eval_baseline(spec, source, cache_dir: Path, examples: list | None = None) -> EvalResult:
    """The held-out scores (on `examples`, when given) of what a run of `spec` starts from: `source` is its fork
    stage's ForkSource (the base model alone, or a verified checkpoint whose adapter is loaded as the run would)."""
    from trainer.model import load_policy

    adapter = str(source.adapter_dir) if source.adapter_dir is not None else None
    model, tokenizer = load_policy(spec.model, spec.lora, adapter_path=adapter, trainable=False)
    held_out = examples if examples is not None else load_datasets(spec.data)[1]
    rewards = RewardComputer(spec.rewards, output_dir=cache_dir)
    metrics, per_prompt, samples = score_held_out(model, tokenizer, held_out, spec.eval, rewards, spec.data)
    where = source.checkpoint_uri or f"base model {spec.model.name_or_path}"
    return EvalResult(where, source.parent_step or 0, metrics, samples, per_prompt)


def judging_examples(spec: ExperimentSpec, split) -> list:
    """The prompts a claim is made on: the confirmation rows of the held-out set, the user's file, or (nothing kept
    back) the selection rows."""
    from trainer.data import read_examples

    if split.kind == "file":
        return read_examples(split.confirmation_file, "confirm.data", "test")
    held_out = load_datasets(spec.data)[1]
    return split.confirmation(held_out) if split.kind == "split" else split.selection(held_out)


def score_on(spec: ExperimentSpec, source, examples: list, cache_dir: Path) -> dict[str, list[float]]:
    """Per-prompt held-out scores of `source` (a verified ForkSource) on `examples`, with the spec's eval settings."""
    from trainer.model import load_policy

    adapter = str(source.adapter_dir) if source.adapter_dir is not None else None
    model, tokenizer = load_policy(spec.model, spec.lora, adapter_path=adapter, trainable=False)
    rewards = RewardComputer(spec.rewards, output_dir=cache_dir)
    cfg = spec.eval.model_copy(update={"split": None})  # `examples` are the part already
    _, per_prompt, _ = score_held_out(model, tokenizer, examples, cfg, rewards, spec.data)
    return per_prompt
