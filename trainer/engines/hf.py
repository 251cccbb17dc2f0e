"""Rollouts with a Hugging Face model in the trainer's own process (CPU or GPU).

The engine samples from the very model object being trained, so `sync_weights` is a no-op. Each call is
seeded from `params.seed` (the loop derives it from the run seed and the step), so the rollouts of step k
are the same in an uninterrupted run and a resumed one; the global RNG is restored afterwards.

The sampling loop is Ballast's own, not `model.generate`: logprobs out of `generate` need
`output_logits=True`, which keeps every step's logits (20 GB for 64 x 512 tokens over a 152k vocabulary);
the loop keeps only the sampled token's logprob. It writes a static KV cache in place, and on CUDA runs
the one-token step compiled into CUDA graphs (`CompiledDecoder`, rollout.compile_decode). Sampling follows
`generate`'s processors exactly — the same transformers classes in its order: repetition penalty,
min_tokens, temperature, top-k, top-p, min-p — then `torch.multinomial`, so the same seed draws the same
tokens. With `fused_sampling` (and a compiled decode) the draw runs inside the compiled step instead
(engines/fused.py): the same distribution, counter-based noise per (prompt seed, row, step), no per-token host work.
With `merged_decode` requests under the model's active adapter decode through a copy of its layers with the adapter
merged in and the projections fused (engines/merged.py): four matmuls a layer instead of peft's 21.
With per-prompt seeds (`SamplingParams.seeds`, what the trainer passes) each prompt's rows draw from a
generator of their own, so a prompt samples the same tokens whichever prompts share its batch: a rank's shard of
the global batch, or another trial's rows. Stop strings need the text decoded as it grows: a request with `stop`
goes through `generate` (one prompt at a time when seeded per prompt). `generate_many` samples several requests in
one batch, each with its own settings and seeds and, for trials sharing one base model (trainer/multi.py), its own
LoRA adapter: row slices per adapter or peft's per-row `adapter_names` (eager), or with `stacked_lora` every adapter
stacked with a per-row slot (engines/stacked.py), which runs inside the compiled step, the fused draw included.

Logprobs are the policy's at the sampling temperature, log_softmax(logits / T), from the raw logits before
penalties and truncation (engines/base.py says why). Completions keep their end-of-sequence token (the
model must learn to stop); tokens after it are dropped.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from .base import Completion, SamplingParams
from .fused import decode_and_sample, sample_fused
from .merged import MergedDecoder, copy_fits
from .stacked import plain_lora_linears, stacked_for

CACHE_LEN_BUCKET = 64  # compiled decode: cache lengths are rounded up to this, so runs reuse one graph
MAX_KEPT_CACHES = 2  # compiled decode: (model, rows) shapes whose KV cache is kept between calls
STOP_CHECK_EVERY = 8  # compiled decode: tokens between checks that every row ended (each check syncs the GPU)


class HFEngine:
    name = "hf"

    def __init__(
        self,
        model,
        tokenizer,
        device: torch.device | str,
        compile_decode: str = "never",
        fused_sampling: bool = False,
        stacked_lora: bool = False,
        lora_slots: int = 1,
        lora_rank: int = 0,
        merged_decode: str = "never",
    ):
        """compile_decode: 'auto' (on CUDA), 'always' or 'never' — rollout.compile_decode. fused_sampling: with a
        compiled decode, draw each token inside the compiled step (engines/fused.py: the same distribution as the
        eager loop, another random stream); requests with per-row adapters keep the eager draw unless stacked_lora.
        stacked_lora: requests that name their adapters decode with every adapter stacked and a per-row slot
        (engines/stacked.py: one forward for all rows, inside the compiled step), room made for `lora_slots`
        adapters of rank `lora_rank` at first; else with row slices or peft's per-row `adapter_names`. merged_decode:
        'auto' (where the copy fits), 'always' or 'never' — rollout.merged_decode: requests under the model's active
        adapter decode through a merged, fused copy of its layers (engines/merged.py)."""
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)
        self.static_cache = True  # False once a model turned out not to support it
        compiled = compile_decode == "always" or (compile_decode == "auto" and self.device.type == "cuda")
        self.decoder = CompiledDecoder() if compiled else None
        self.fused_sampling = fused_sampling and compiled
        self.stacked_lora, self.lora_slots, self.lora_rank = stacked_lora, lora_slots, lora_rank
        self.stacked = None  # the StackedLora of the last call that used one (kept: its tensors' addresses stay)
        self.merged_decode = merged_decode
        self.merged: MergedDecoder | None = None  # built at the first rollout that can use it
        self.merged_why = ""  # why the model decodes without it, once that is known

    def sync_weights(self, model, step: int) -> None:
        if model is not self.model:
            self.merged, self.merged_why = None, ""
        self.model = model

    def close(self) -> None:
        pass

    def generate(
        self, prompts: Sequence[list[int]], params: SamplingParams, adapters: Sequence[str] | None = None
    ) -> list[list[Completion]]:
        """For each prompt, params.n completions; `adapters`: the LoRA adapter each prompt samples under (None: the
        model's active adapter)."""
        return self.generate_many([(prompts, params, adapters)])[0]

    @torch.no_grad()
    def generate_many(
        self, requests: Sequence[tuple[Sequence[list[int]], SamplingParams, Sequence[str] | None]]
    ) -> list[list[list[Completion]]]:
        """Several requests sampled in one batch, for several trials sharing one base model (trainer/multi.py): each
        request its prompts, its sampling settings and seeds, and the LoRA adapter each of its prompts samples
        under (peft's per-row `adapter_names`; None: the model's active adapter, then for every request). The rows go
        through the model together; each request's tokens are drawn with its own settings from its own generators."""
        _check_requests(requests)
        rows = [p for prompts, params, _ in requests for p in prompts for _ in range(params.n)]
        segments, start = [], 0
        for prompts, params, _ in requests:
            segments.append(Segment(slice(start, start + len(prompts) * params.n), params))
            start += len(prompts) * params.n
        input_ids, attention_mask = _left_padded(rows, self.tokenizer.pad_token_id, self.device)
        per_row, by_request, adapters = self._adapter_rows(requests, segments)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), adapters:
                active = all(names is None for _, _, names in requests)  # the model's active adapter alone
                new_tokens, logprobs = self._sample(input_ids, attention_mask, segments, per_row, by_request, active)
        finally:
            self.model.train(was_training)
        return _completions(rows, segments, new_tokens.cpu(), logprobs.cpu(), self.tokenizer, self._eos_ids())

    def _eos_ids(self) -> list[int]:
        return _eos_ids(self.model, self.tokenizer)

    def _adapter_rows(self, requests, segments) -> tuple[dict | None, list[str] | None, AbstractContextManager]:
        """How the rows take their adapters: (peft's per-row `adapter_names`, None, -), (None, one adapter per request
        over its contiguous rows, their row slices) when every request has one and every LoRA layer is plain, (None,
        None, the stacked forward) with stacked_lora and plain layers, or (None, None, -): the active adapter."""
        named = [adapters is not None for _, _, adapters in requests]
        if any(named) and not all(named):
            raise ValueError("name the adapters of every request, or of none")
        if not all(named):
            return None, None, contextlib.nullcontext()
        names = [a for _, p, adapters in requests for a in adapters for _ in range(p.n)]
        plain = plain_lora_linears(self.model) is not None
        if self.stacked_lora and plain and self.static_cache and not any(p.stop for _, p, _ in requests):
            self.stacked = stacked_for(self.stacked, self.model, names, self.lora_slots, self.lora_rank)
            return None, None, self.stacked.use(self.stacked.row_slots(names, self.device))
        if plain and all(len(set(adapters)) == 1 for _, _, adapters in requests):
            by_request = [adapters[0] for _, _, adapters in requests]
            return None, by_request, _adapters_by_rows(self.model, [(s.rows, a) for s, a in zip(segments, by_request)])
        return {"adapter_names": names}, None, contextlib.nullcontext()

    def _sample(
        self, input_ids, attention_mask, segments, per_row, by_request, active_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(new tokens, logprobs) by the fastest path these requests allow: the draw inside the compiled step
        (fused_sampling), the static-cache loop (compiled or eager), or generate (stop strings, custom models)."""
        eos_ids, pad_id = self._eos_ids(), self.tokenizer.pad_token_id
        if any(s.params.stop for s in segments) or not self.static_cache:
            return _sample_segments_with_generate(
                self.model, self.tokenizer, input_ids, attention_mask, segments, eos_ids, per_row
            )
        model = self._merged() if active_only else self.model
        try:
            if self.fused_sampling and per_row is None and by_request is None:
                return sample_fused(
                    model,
                    input_ids,
                    attention_mask,
                    segments,
                    eos_ids,
                    pad_id,
                    self.decoder,
                    STOP_CHECK_EVERY,
                    prefill=_prefill,
                )
            torch.manual_seed(segments[0].params.seed)
            extra = {"decoder": self.decoder} if self.decoder is not None else {}
            for segment in segments:
                segment.generators = _generators(segment.params.seeds, self.device)
            return sample(
                model,
                input_ids,
                attention_mask,
                segments[0].params,
                eos_ids,
                pad_id,
                per_row=per_row,
                segments=segments,
                **extra,
            )
        except TypeError as e:  # a custom (trust_remote_code) model without cache_position / logits_to_keep
            warnings.warn(
                f"{type(self.model).__name__} cannot sample with a static KV cache ({e}); "
                "the hf engine uses model.generate for it (slower, keeps every step's logits)",
                stacklevel=3,
            )
            self.static_cache = False
            return _sample_segments_with_generate(
                self.model, self.tokenizer, input_ids, attention_mask, segments, eos_ids, per_row
            )

    def _merged(self):
        """The merged decoder, brought up to the model's weights, when rollout.merged_decode allows one; else the
        model itself."""
        if self.merged_decode == "never" or self.merged_why:
            return self.model
        if self.merged is None:
            if self.merged_decode == "auto" and self.device.type != "cuda":
                self.merged_why = "auto decodes merged on CUDA only"
                return self.model
            self.merged, self.merged_why = MergedDecoder.build(self.model)
            if self.merged is not None and self.merged_decode == "auto" and not copy_fits(self.merged, self.device):
                self.merged, self.merged_why = None, "its copy of the weights would not fit in the free memory"
            if self.merged is None:
                if self.merged_decode == "always":
                    warnings.warn(f"rollout.merged_decode: {self.merged_why}; decoding through the model", stacklevel=4)
                return self.model
        return self.merged.ready()


def _check_requests(requests) -> None:
    for _, params, _ in requests:
        if params.frequency_penalty or params.presence_penalty:
            raise ValueError(
                "rollout.frequency_penalty / presence_penalty are vLLM sampling options; the hf engine "
                "supports repetition_penalty — set rollout.engine: vllm or use repetition_penalty"
            )


def _left_padded(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [R, longest], each prompt right-aligned after pad tokens."""
    width = max(len(p) for p in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(rows):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention_mask[i, width - len(p) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def _completions(rows, segments, new_tokens, logprobs, tok, eos_ids) -> list[list[list[Completion]]]:
    """Per request, per prompt, its params.n Completions: cut after the first end token (kept) or at max_tokens."""
    eos = set(eos_ids)
    out: list[list[list[Completion]]] = []
    for segment in segments:
        params, results = segment.params, []
        for i in range(segment.rows.start, segment.rows.stop):
            ids = new_tokens[i, : params.max_tokens].tolist()  # a shorter request's rows are padded past it
            finish = "length"
            for j, t in enumerate(ids):
                if t in eos:
                    ids, finish = ids[: j + 1], "stop"
                    break
            text = tok.decode(ids, skip_special_tokens=True)
            if finish == "length" and params.stop and any(s in text for s in params.stop):
                finish = "stop"
            c = Completion(
                prompt_ids=list(rows[i]),
                token_ids=ids,
                logprobs=logprobs[i, : len(ids)].tolist(),
                finish_reason=finish,
                text=text,
            )
            if (i - segment.rows.start) % params.n == 0:
                results.append([])
            results[-1].append(c)
        out.append(results)
    return out


@contextlib.contextmanager
def _adapters_by_rows(model, rows: list[tuple[slice, str]]):
    """Every LoRA layer of `model` adds adapter `name`'s update to the rows `rows` of the batch only, for the block:
    peft's per-row `adapter_names` does the same with a gather and a scatter per layer and adapter, indexed by Python
    lists; contiguous rows are views (4 quickstart trials, 2 steps: 64 -> 58 CPU seconds). A row's LoRA matmul runs
    over its adapter's rows alone, as in a lone run, and is added as peft adds it."""
    layers = plain_lora_linears(model)

    def forward_of(layer):
        def forward(x, *args, **kwargs):
            result = layer.base_layer(x, *args, **kwargs)
            for these, name in rows:
                if name not in layer.lora_A:
                    continue
                a, b = layer.lora_A[name], layer.lora_B[name]
                sub = x[these].to(a.weight.dtype)
                result[these] += (b(a(layer.lora_dropout[name](sub))) * layer.scaling[name]).to(result.dtype)
            return result

        return forward

    for layer in layers:
        layer.forward = forward_of(layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # back to the class's


@dataclass
class Segment:
    """Rows of one batch drawn with their own sampling settings (and, with params.seeds, generators)."""

    rows: slice
    params: SamplingParams
    generators: list[torch.Generator] | None = None


def _processors(params: SamplingParams, eos_ids: list[int]):
    """generate's logits processors for these settings, in generate's order (min_tokens is applied apart)."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

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


class CompiledDecoder:
    """The one-token decode step, compiled once per model (torch.compile mode "reduce-overhead": CUDA graphs on
    a GPU, inductor kernels on CPU), and the static KV caches it runs over, kept between calls and reset in place
    (graphs replay on fixed addresses, so a cache must not move). In fp32 it draws the same tokens as the eager loop
    (tests/test_hf_engine.py on CPU, bench/gpu_step.py on a GPU); ending is checked every STOP_CHECK_EVERY tokens,
    not every token, since a check waits for the GPU; prefill stays eager (its shape changes with the prompts).

    One cache per model and number of rows, at most MAX_KEPT_CACHES of them (the least recently used goes), each as
    long as the longest call it served, rounded up to a multiple of CACHE_LEN_BUCKET: a shorter call reuses it (its
    mask hides the rest), a longer one replaces it. So a run whose prompt widths vary holds one cache, and compiles
    one graph per growth, where a cache per width held one more cache (a 0.5B Llama's 64 rows x 320 positions: 1
    GiB in bf16) and compiled one more graph for each width bucket it met, never freeing either; past torch's
    recompile limit (8) it would have decoded eagerly."""

    def __init__(self):
        self.step_fns: dict[int, object] = {}
        self.caches: dict[tuple, tuple[int, object]] = {}  # (model, rows, device) -> (length, cache); newest last
        self.fused_fn = None

    def cache_len(self, needed: int) -> int:
        return -(-needed // CACHE_LEN_BUCKET) * CACHE_LEN_BUCKET

    def cache(self, model, rows: int, needed: int, device: torch.device) -> tuple[object, int]:
        """A kept cache of `rows` rows at least `needed` positions long, reset, and its length."""
        key = (id(model), rows, str(device))
        length, cache = self.caches.pop(key, (0, None))
        if length >= needed:
            cache.reset()
        else:
            cache = None  # the outgrown cache is freed before its successor is made, which can reuse its memory
            while len(self.caches) >= MAX_KEPT_CACHES:
                self.caches.pop(next(iter(self.caches)))
            length = self.cache_len(needed)
            cache = _new_cache(model, rows, length, device)
        self.caches[key] = (length, cache)  # put back last: the most recently used
        return cache, length

    def step(self, model):
        fn = self.step_fns.get(id(model))
        if fn is None:
            self.step_fns.clear()
            fn = self.step_fns[id(model)] = torch.compile(model.__call__, mode="reduce-overhead", dynamic=False)
        return fn

    def fused_step(self):
        """engines/fused.py's step and draw, compiled as one graph (the model is an argument: one compile serves
        any model of the same shapes, a new one being a recompile)."""
        if self.fused_fn is None:
            self.fused_fn = torch.compile(decode_and_sample, mode="reduce-overhead", dynamic=False)
        return self.fused_fn


@torch.inference_mode()
def sample(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    params: SamplingParams,
    eos_ids: list[int],
    pad_id: int,
    decoder: CompiledDecoder | None = None,
    generators: list[torch.Generator] | None = None,
    per_row: dict | None = None,
    segments: list[Segment] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(new tokens [R, <=N], their logprobs under log_softmax(logits / T) [R, <=N]) for left-padded prompts, with a
    static KV cache. Ended rows get pad tokens; the loop stops when every row has ended (checked every token, or
    every STOP_CHECK_EVERY with a compiled `decoder`, whose one-token steps run over a cache that outlives the call).
    With `generators` (one per prompt, its params.n rows in a row) each prompt's rows draw from their own; else from
    the global RNG. `per_row` (e.g. {"adapter_names": [...]}) goes to every model call. `segments` (rows with their
    own settings and generators) replace `params` and `generators`, each stopping after its own max_tokens."""
    per_row = per_row or {}
    rows, width = input_ids.shape
    device = input_ids.device
    segments = segments or [Segment(slice(0, rows), params, generators)]
    n_new = max(s.params.max_tokens for s in segments)
    processors = [_processors(s.params, eos_ids) for s in segments]
    grow = any(before for before, _ in processors)
    eos = torch.tensor(eos_ids, device=device)
    step_fn, check_every = (model, 1) if decoder is None else (decoder.step(model), STOP_CHECK_EVERY)
    out, mask, cache = _prefill(model, input_ids, attention_mask, n_new, decoder, per_row)
    position = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]
    cache_positions = torch.arange(width, width + n_new, device=device)  # made once: no host-to-device copy per token
    sequence = input_ids  # grown only when the repetition penalty needs to see it
    running = torch.ones(rows, dtype=torch.bool, device=device)
    tokens, logprobs = [], []
    for t in range(n_new):
        logits = out.logits[:, -1].to(
            dtype=torch.float32, copy=True
        )  # a graph's output is overwritten by its next replay
        chosen, picked = _draw_step(logits, segments, processors, sequence, eos, t, running, pad_id)
        tokens.append(chosen)
        logprobs.append(picked)
        running = _still_running(running, chosen, eos, segments, t)
        if t == n_new - 1 or ((t + 1) % check_every == 0 and not running.any()):
            break
        if grow:
            sequence = torch.cat([sequence, chosen[:, None]], dim=1)
        mask[:, width + t] = 1
        position = position + 1
        if decoder is not None:
            torch.compiler.cudagraph_mark_step_begin()
        out = step_fn(
            input_ids=chosen[:, None],
            attention_mask=mask,
            position_ids=position,
            past_key_values=cache,
            use_cache=True,
            cache_position=cache_positions[t : t + 1],
            **per_row,
        )
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)


def _prefill(model, input_ids, attention_mask, n_new: int, decoder: CompiledDecoder | None, per_row: dict):
    """The prompts' forward into a static cache long enough for n_new tokens (the decoder's own, kept between calls,
    with a compiled decode): (its output, the attention mask over the whole cache, the cache)."""
    rows, width = input_ids.shape
    device = input_ids.device
    if decoder is None:
        cache_len = width + n_new
        cache = _new_cache(model, rows, cache_len, device)
    else:
        cache, cache_len = decoder.cache(model, rows, width + n_new, device)
    mask = torch.zeros(rows, cache_len, dtype=attention_mask.dtype, device=device)
    mask[:, :width] = attention_mask
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
        cache_position=torch.arange(width, device=device),
        logits_to_keep=1,
        **per_row,
    )
    return out, mask, cache


def _new_cache(model, rows: int, length: int, device):
    """A static KV cache for `model`: the merged decoder's own, or transformers' StaticCache."""
    if isinstance(model, MergedDecoder):
        return model.new_cache(rows, length, device)
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=length)


def _still_running(running, chosen, eos, segments: list[Segment], t: int) -> torch.Tensor:
    """The rows still running after token t: not ended by an end token, nor by their request's max_tokens."""
    running = running & ~torch.isin(chosen, eos)
    for segment in segments:
        if t == segment.params.max_tokens - 1:  # a shorter request's rows end here; pads after
            running[segment.rows] = False
    return running


def _draw_step(logits, segments: list[Segment], processors, sequence, eos, t: int, running, pad_id: int):
    """Each segment's rows' next token, drawn with its processors and generators (pad where a row has ended), and
    its logprob under log_softmax(logits / T): (tokens [R], logprobs [R])."""
    policies, draws = [], []
    for segment, (before, after) in zip(segments, processors):
        p, these, seen = segment.params, logits[segment.rows], sequence[segment.rows]
        policies.append(torch.log_softmax(these / p.temperature, dim=-1))
        scores = before(seen, these) if before else these
        if t < p.min_tokens:
            scores = scores.index_fill(-1, eos, float("-inf"))
        scores = after(seen, scores) if after else scores
        draws.append(_draw(torch.softmax(scores, dim=-1), segment.generators, p.n))
    chosen = draws[0] if len(draws) == 1 else torch.cat(draws)
    chosen = torch.where(running, chosen, torch.full_like(chosen, pad_id))
    picked = [policy.gather(-1, chosen[s.rows, None]).squeeze(1) for s, policy in zip(segments, policies)]
    return chosen, picked[0] if len(picked) == 1 else torch.cat(picked)


def _generators(seeds: list[int] | None, device: torch.device) -> list[torch.Generator] | None:
    """One generator per prompt, seeded from SamplingParams.seeds (None: sample from the global RNG)."""
    if seeds is None:
        return None
    return [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]


def _draw(probs: torch.Tensor, generators: list[torch.Generator] | None, per_prompt: int) -> torch.Tensor:
    """One token per row from `probs` [R, V]: rows i*per_prompt ... (i+1)*per_prompt-1 from generators[i]."""
    if generators is None:
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    if len(generators) * per_prompt != probs.shape[0]:
        prompts = probs.shape[0] // per_prompt
        raise ValueError(f"{len(generators)} seeds for {prompts} prompts; give one seed per prompt")
    rows = [
        torch.multinomial(probs[i * per_prompt : (i + 1) * per_prompt], num_samples=1, generator=g)
        for i, g in enumerate(generators)
    ]
    return torch.cat(rows).squeeze(1)


def _sample_segments_with_generate(model, tok, input_ids, attention_mask, segments, eos_ids, per_row):
    """_sample_with_generate on each segment's rows, with its settings; padded to one width."""
    parts = []
    for s in segments:
        these = None if per_row is None else {k: v[s.rows] for k, v in per_row.items()}
        parts.append(
            _sample_with_generate(model, tok, input_ids[s.rows], attention_mask[s.rows], s.params, eos_ids, these)
        )
    return parts[0] if len(parts) == 1 else _cat_padded(parts, tok.pad_token_id)


def _cat_padded(parts: list[tuple[torch.Tensor, torch.Tensor]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, logprobs) pairs of different widths, right-padded to one and concatenated over rows."""
    width = max(tokens.shape[1] for tokens, _ in parts)
    tokens = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad) for t, _ in parts])
    logprobs = torch.cat([torch.nn.functional.pad(lp, (0, width - lp.shape[1])) for _, lp in parts])
    return tokens, logprobs


def _sample_with_generate(
    model, tok, input_ids, attention_mask, params: SamplingParams, eos_ids: list[int], per_row: dict | None = None
):
    """model.generate with output_logits: for stop strings, which need the text decoded as it grows. Seeded per
    prompt (params.seeds), each prompt's rows are generated alone, from its own seed, and padded to one width."""
    per_row = per_row or {}
    if params.seeds is None:
        torch.manual_seed(params.seed)
        return _generate_rows(model, tok, input_ids, attention_mask, params, eos_ids, **per_row)
    n, parts = params.n, []
    for i, seed in enumerate(params.seeds):
        torch.manual_seed(int(seed))
        rows = slice(i * n, (i + 1) * n)
        these = {k: v[rows] for k, v in per_row.items()}
        parts.append(_generate_rows(model, tok, input_ids[rows], attention_mask[rows], params, eos_ids, **these))
    return _cat_padded(parts, tok.pad_token_id)


def _generate_rows(model, tok, input_ids, attention_mask, params: SamplingParams, eos_ids: list[int], **per_row):
    """(new tokens, their logprobs) of model.generate on these rows, from the global RNG."""
    kwargs = dict(
        **per_row,
        do_sample=True,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k or None,
        max_new_tokens=params.max_tokens,
        min_new_tokens=params.min_tokens or None,
        repetition_penalty=params.repetition_penalty,
        pad_token_id=tok.pad_token_id,
        eos_token_id=eos_ids,
        output_logits=True,
        return_dict_in_generate=True,
        stop_strings=params.stop or None,
        tokenizer=tok,
    )
    if params.min_p:
        kwargs["min_p"] = params.min_p
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    new_tokens = out.sequences[:, input_ids.shape[1] :]
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
