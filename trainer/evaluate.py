"""Held-out evaluation, decoded exactly as a standalone user decodes.

`generate_texts` is what a user writes by hand — chat template, left padding, `model.generate` —
and nothing else: no rollout engine, no logprob bookkeeping, no trainer-side patches. In-training
eval (every `eval.every` steps), the pipeline's final eval and `ballast generate` all call it, and
tests/test_trainer.py checks it against a hand-written `generate` call, so eval cannot quietly
decode differently from what users will see.
"""
from __future__ import annotations

import torch

from .config import EvalConfig
from .data import Example, render_prompt


@torch.no_grad()
def generate_texts(model, tokenizer, prompts: list[str], max_tokens: int, temperature: float = 0.0,
                   batch_size: int = 32, seed: int = 0) -> list[str]:
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    texts: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = [render_prompt(tokenizer, p) for p in prompts[start:start + batch_size]]
            batch = tokenizer.pad({"input_ids": chunk}, padding=True, return_tensors="pt").to(device)
            kwargs = dict(max_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id)
            if temperature > 0:
                kwargs.update(do_sample=True, temperature=temperature)
            else:
                kwargs.update(do_sample=False)
            # sampling is seeded per batch, in a forked RNG: eval never moves the training run's random state
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed + start)
                out = model.generate(**batch, **kwargs)
            texts += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        model.train(was_training)
    return texts


def evaluate(model, tokenizer, examples: list[Example], cfg: EvalConfig, rewards) -> dict[str, float]:
    """eval/reward, eval/accuracy (the share scoring 1 on cfg.reward) and eval/mean_length."""
    if not examples:
        return {}
    texts = generate_texts(model, tokenizer, [e.prompt for e in examples], cfg.max_tokens, cfg.temperature, cfg.batch_size)
    total, parts = rewards(texts, [e.answer for e in examples], [e.prompt for e in examples])
    accuracy = parts.get(cfg.reward)
    lengths = [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    out = {"eval/reward": sum(total) / len(total), "eval/mean_length": sum(lengths) / len(lengths)}
    if accuracy is not None:
        out["eval/accuracy"] = sum(1.0 for a in accuracy if a >= 1.0) / len(accuracy)
    return out
