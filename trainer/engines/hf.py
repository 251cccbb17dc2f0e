"""Rollouts with Hugging Face `generate`, in the trainer's own process (CPU or GPU).

The engine samples from the very model object being trained, so there are no weights to push:
`sync_weights` is a no-op. Each call is seeded from `params.seed`, which the loop derives from the
run seed and the step number, so the rollouts of step k are the same in an uninterrupted run and in
a resumed one.

Logprobs are computed from the raw logits generate returns (`output_logits=True`), divided by the
temperature: the policy distribution the trainer also computes (see engines/base.py for why not the
processed, penalised one). Completions keep their end-of-sequence token (the model must learn to
stop); tokens after it are dropped.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .base import Completion, SamplingParams


class HFEngine:
    name = "hf"

    def __init__(self, model, tokenizer, device: torch.device | str):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)

    def sync_weights(self, model, step: int) -> None:
        self.model = model

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Completion]]:
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
        kwargs = dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None,
                      max_new_tokens=params.max_tokens, repetition_penalty=params.repetition_penalty,
                      pad_token_id=pad_id, eos_token_id=eos_ids, output_logits=True, return_dict_in_generate=True)
        if params.min_p:
            kwargs["min_p"] = params.min_p
        if params.stop:
            kwargs.update(stop_strings=params.stop, tokenizer=tok)
        if params.frequency_penalty or params.presence_penalty:
            raise ValueError("rollout.frequency_penalty / presence_penalty are vLLM sampling options; the hf engine "
                             "supports repetition_penalty — set rollout.engine: vllm or use repetition_penalty")
        was_training = self.model.training
        self.model.eval()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(params.seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed_all(params.seed)
        try:
            out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device), **kwargs)
        finally:
            torch.random.set_rng_state(generator_state)
            self.model.train(was_training)
        new_tokens = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float() / params.temperature  # [rows, new, V]
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1).cpu()
        del logits
        results: list[list[Completion]] = []
        for i, p in enumerate(rows):
            ids = new_tokens[i].tolist()
            finish = "length"
            for j, t in enumerate(ids):
                if t in eos_ids:
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


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if getattr(model, "generation_config", None) is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model has no end-of-sequence token; set eos_token in the tokenizer or generation_config")
    return ids
