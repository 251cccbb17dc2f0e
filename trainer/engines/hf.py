"""Rollouts with a Hugging Face model in the trainer's own process (CPU or GPU).

The engine samples from the very model object being trained, so there are no weights to push:
`sync_weights` is a no-op. Each call is seeded from `params.seed`, which the loop derives from the
run seed and the step number, so the rollouts of step k are the same in an uninterrupted run and in
a resumed one (the global RNG is restored afterwards).

The sampling loop is Ballast's own, not `model.generate`, for memory: getting logprobs out of
`generate` means `output_logits=True`, which keeps every step's logits — rows x new tokens x
vocabulary in fp32, 20 GB for 64 completions of 512 tokens over a 152k vocabulary. The loop takes the
sampled token's logprob at each step and keeps only that. It uses a static KV cache, written in place
(generate's dynamic cache is concatenated at every token); on the CPU tiny model it takes the same time
as `generate` (bench/trl_step_time.py).
Sampling follows `generate`'s processors exactly — the same classes from transformers, in its order:
repetition penalty, min_tokens (end tokens suppressed before it), temperature, top-k, top-p, min-p —
then `torch.multinomial`. Stop strings need the text decoded as it grows, so a request with
`stop` goes through `model.generate` (with `output_logits`) instead.

Logprobs are those of the policy at the sampling temperature, log_softmax(logits / T), taken from the
raw logits before penalties and truncation: the distribution the trainer also computes (see
engines/base.py for why not the processed one). Completions keep their end-of-sequence token (the
model must learn to stop); tokens after it are dropped.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch

from .base import Completion, SamplingParams


class HFEngine:
    name = "hf"

    def __init__(self, model, tokenizer, device: torch.device | str):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)
        self.static_cache = True  # False once a model turned out not to support it

    def sync_weights(self, model, step: int) -> None:
        self.model = model

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Completion]]:
        if params.frequency_penalty or params.presence_penalty:
            raise ValueError("rollout.frequency_penalty / presence_penalty are vLLM sampling options; the hf engine "
                             "supports repetition_penalty — set rollout.engine: vllm or use repetition_penalty")
        tok = self.tokenizer
        pad_id = tok.pad_token_id
        eos_ids = _eos_ids(self.model, tok)
        width = max(len(p) for p in prompts)
        rows = [p for p in prompts for _ in range(params.n)]
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, p in enumerate(rows):
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention_mask[i, width - len(p):] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)

        was_training = self.model.training
        self.model.eval()
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(params.seed)
                if params.stop or not self.static_cache:
                    new_tokens, logprobs = _sample_with_generate(self.model, tok, input_ids, attention_mask, params, eos_ids)
                else:
                    try:
                        new_tokens, logprobs = sample(self.model, input_ids, attention_mask, params, eos_ids, pad_id)
                    except TypeError as e:  # a custom (trust_remote_code) model without cache_position / logits_to_keep
                        warnings.warn(f"{type(self.model).__name__} cannot sample with a static KV cache ({e}); "
                                      "the hf engine uses model.generate for it (slower, keeps every step's logits)")
                        self.static_cache = False
                        torch.manual_seed(params.seed)
                        new_tokens, logprobs = _sample_with_generate(self.model, tok, input_ids, attention_mask, params, eos_ids)
        finally:
            self.model.train(was_training)

        new_tokens, logprobs = new_tokens.cpu(), logprobs.cpu()
        eos = set(eos_ids)
        results: list[list[Completion]] = []
        for i, p in enumerate(rows):
            ids = new_tokens[i].tolist()
            finish = "length"
            for j, t in enumerate(ids):
                if t in eos:
                    ids, finish = ids[: j + 1], "stop"
                    break
            text = tok.decode(ids, skip_special_tokens=True)
            if finish == "length" and params.stop and any(s in text for s in params.stop):
                finish = "stop"
            c = Completion(prompt_ids=list(p), token_ids=ids, logprobs=logprobs[i, : len(ids)].tolist(), finish_reason=finish, text=text)
            if i % params.n == 0:
                results.append([])
            results[-1].append(c)
        return results


def _processors(params: SamplingParams, eos_ids: list[int]):
    """generate's logits processors for these settings, in generate's order (min_tokens is applied apart)."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    before = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        before.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    after = LogitsProcessorList()
    if params.temperature != 1.0:
        after.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        after.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        after.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        after.append(MinPLogitsWarper(params.min_p))
    return before, after


@torch.inference_mode()
def sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, eos_ids: list[int],
           pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(new tokens [R, <=N], their logprobs under log_softmax(logits / T) [R, <=N]) for left-padded prompts, with a
    static KV cache. Rows that have ended get pad tokens; the loop stops when every row has ended."""
    from transformers import StaticCache

    rows, width = input_ids.shape
    device = input_ids.device
    n_new = params.max_tokens
    before, after = _processors(params, eos_ids)
    eos = torch.tensor(eos_ids, device=device)
    mask = torch.zeros(rows, width + n_new, dtype=attention_mask.dtype, device=device)
    mask[:, :width] = attention_mask
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = StaticCache(config=model.config, max_cache_len=width + n_new)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                cache_position=torch.arange(width, device=device), logits_to_keep=1)
    position = positions[:, -1:]
    sequence = input_ids  # grown only when the repetition penalty needs to see it
    running = torch.ones(rows, dtype=torch.bool, device=device)
    tokens, logprobs = [], []
    for t in range(n_new):
        logits = out.logits[:, -1].float()
        policy = torch.log_softmax(logits / params.temperature, dim=-1)
        scores = before(sequence, logits) if before else logits
        if t < params.min_tokens:
            scores = scores.index_fill(-1, eos, float("-inf"))
        scores = after(sequence, scores) if after else scores
        chosen = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        chosen = torch.where(running, chosen, torch.full_like(chosen, pad_id))
        tokens.append(chosen)
        logprobs.append(policy.gather(-1, chosen[:, None]).squeeze(1))
        running &= ~torch.isin(chosen, eos)
        if not running.any() or t == n_new - 1:
            break
        if before:
            sequence = torch.cat([sequence, chosen[:, None]], dim=1)
        mask[:, width + t] = 1
        position = position + 1
        out = model(input_ids=chosen[:, None], attention_mask=mask, position_ids=position, past_key_values=cache,
                    use_cache=True, cache_position=torch.tensor([width + t], device=device))
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)


def _sample_with_generate(model, tok, input_ids, attention_mask, params: SamplingParams, eos_ids: list[int]):
    """model.generate with output_logits: for stop strings, which need the text decoded as it grows."""
    kwargs = dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None,
                  max_new_tokens=params.max_tokens, min_new_tokens=params.min_tokens or None,
                  repetition_penalty=params.repetition_penalty, pad_token_id=tok.pad_token_id, eos_token_id=eos_ids,
                  output_logits=True, return_dict_in_generate=True, stop_strings=params.stop or None, tokenizer=tok)
    if params.min_p:
        kwargs["min_p"] = params.min_p
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    new_tokens = out.sequences[:, input_ids.shape[1]:]
    logits = torch.stack(out.logits, dim=1).float() / params.temperature  # [rows, new, V]
    return new_tokens, torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if getattr(model, "generation_config", None) is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model has no end-of-sequence token; set eos_token in the tokenizer or generation_config")
    return ids
