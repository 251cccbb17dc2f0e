"""Sampling as tensor code a compiled decode step can hold: every setting a per-row tensor, the draw a Gumbel-max
over counter-based noise, no generator object and no host sync.

The eager loop (engines/hf.py `sample`) runs transformers' logits processors and one `torch.multinomial` per prompt
with that prompt's `torch.Generator`: exact, but a dozen kernels and Python calls per token that a CUDA graph cannot
hold. Here the same settings, in generate's order — repetition penalty, min_tokens, temperature, top-k, top-p,
min-p — are per-row tensors (`RowSampling`), so rows of different requests (trials) share one graph, and the draw is
argmax(scores + Gumbel noise), which samples softmax(scores) exactly. The noise of row r at step t for token v is a
hash of (the row's prompt seed, its index within the prompt, t, v) (splitmix64's finaliser over int64 tensors):

- a prompt's rows draw the same tokens whatever else shares the batch (the guarantee per-prompt generators give);
- a step is a pure function of its inputs, so a resumed run samples what the uninterrupted one did;
- the tokens are not those of the eager loop for the same seed (another random stream), only the same
  distribution: tests/test_fused_sampling.py checks it with a chi-square test against the eager processors, and
  the logprobs (log_softmax(logits / T) at the drawn token, before penalties and truncation) to 1e-5 in fp32.

The uniforms have 24 bits, so the Gumbel noise is cut at about 17: a token needs 1 - 3e-8 of the probability mass
behind it before the cut shows. Top-p is generate's rule on one descending sort (a token is kept while the mass
above it is below top_p; the top token always is); ties at the top-k boundary are kept, as generate keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# splitmix64 (Steele, Lea, Flood 2014) constants, as signed int64 (torch has no uint64 arithmetic)
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64
_ROW, _STEP = 0x632BE59BD9B4E019, 0x3C6EF372FE94F82B  # spread the counters apart before mixing
UNIFORM_BITS = 24


@dataclass
class RowSampling:
    """The sampling settings of each row [R], as tensors on the rows' device. top_k 0 and top_p 1 are off."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    repetition_penalty: torch.Tensor  # float32
    min_tokens: torch.Tensor  # int64
    seed: torch.Tensor  # int64: the row's prompt seed
    index: torch.Tensor  # int64: the row's index among its prompt's completions

    @classmethod
    def from_params(cls, segments: list[tuple[int, object]], device) -> RowSampling:
        """`segments`: (rows, SamplingParams) in row order; params.seeds gives each prompt's seed (else params.seed
        for every prompt), params.n rows per prompt."""
        values: dict[str, list] = {name: [] for name in cls.__dataclass_fields__}
        for rows, p in segments:
            prompts = rows // p.n
            seeds = list(p.seeds) if p.seeds is not None else [p.seed] * prompts
            for seed in seeds:
                for j in range(p.n):
                    values["temperature"].append(p.temperature)
                    values["top_k"].append(p.top_k or 0)
                    values["top_p"].append(p.top_p)
                    values["min_p"].append(p.min_p or 0.0)
                    values["repetition_penalty"].append(p.repetition_penalty)
                    values["min_tokens"].append(p.min_tokens)
                    values["seed"].append(int(seed))
                    values["index"].append(j)
        ints = {"top_k", "min_tokens", "seed", "index"}
        return cls(
            **{
                k: torch.tensor(v, dtype=torch.int64 if k in ints else torch.float32, device=device)
                for k, v in values.items()
            }
        )


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (logical shifts by masking the sign-extended bits)."""
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _MIX1
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def gumbel_noise(seed: torch.Tensor, index: torch.Tensor, step: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[R, V] float32 Gumbel(0, 1) noise, a pure function of (seed[r], index[r], step, token id); `token_ids` [V] is
    arange(V), given rather than made in the graph (inductor's CPU code for int64 arithmetic on an arange made
    inside the graph corrupted memory in torch 2.13)."""
    row = _mix(seed * _GOLDEN + index * _ROW + step * _STEP)
    bits = (_mix(row[:, None] + (token_ids[None, :] + 1) * _GOLDEN) >> (64 - UNIFORM_BITS)) & ((1 << UNIFORM_BITS) - 1)
    u = (bits.to(torch.float32) + 0.5) / float(1 << UNIFORM_BITS)
    return -torch.log(-torch.log(u))


def processed_scores(
    logits: torch.Tensor,
    rows: RowSampling,
    seen: torch.Tensor,
    eos: torch.Tensor,
    step: torch.Tensor,
    token_ids=None,
    truncate: bool = True,
) -> torch.Tensor:
    """The scores [R, V] generate's processors would give, with -inf for every token they remove. `seen` [R, V] bool:
    the tokens in each row's sequence so far (prompt, padding and sampled), for the repetition penalty. truncate
    False: no row has top-k, top-p or min-p, and the sort over the vocabulary they need is skipped."""
    penalty = rows.repetition_penalty[:, None]
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    scores = torch.where(seen, penalised, logits)
    token_ids = _token_ids(logits) if token_ids is None else token_ids
    early = (step < rows.min_tokens)[:, None] & torch.isin(token_ids, eos)
    scores = scores.masked_fill(early, float("-inf")) / rows.temperature[:, None]
    if not truncate:
        return scores
    ordered, order = scores.sort(dim=-1, descending=True)
    vocab = scores.shape[1]
    k = torch.where(rows.top_k > 0, rows.top_k.clamp(max=vocab), vocab)
    kth = ordered.gather(1, (k - 1)[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(dim=-1)
    above = probs.cumsum(dim=-1) - probs  # the mass of the tokens sorted above each
    drop = (above >= rows.top_p[:, None]) & (rows.top_p[:, None] < 1.0)
    drop[:, 0] = False
    ordered = ordered.masked_fill(drop, float("-inf"))
    probs = ordered.softmax(dim=-1)
    drop = probs < rows.min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.full_like(scores, float("-inf")).scatter(1, order, ordered)


def _token_ids(logits: torch.Tensor) -> torch.Tensor:
    return torch.arange(logits.shape[1], device=logits.device, dtype=torch.int64)


def sample_rows(
    logits: torch.Tensor,
    rows: RowSampling,
    seen: torch.Tensor,
    eos: torch.Tensor,
    step: torch.Tensor,
    token_ids=None,
    truncate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [R], its logprob [R] under log_softmax(logits / T)) for one decode step; `step` a 0-d int64 tensor
    (a tensor, so a compiled graph serves every step); `token_ids` arange(V) (made here when not given)."""
    logits = logits.float()
    token_ids = _token_ids(logits) if token_ids is None else token_ids
    scores = processed_scores(logits, rows, seen, eos, step, token_ids, truncate)
    token = (scores + gumbel_noise(rows.seed, rows.index, step, token_ids)).argmax(dim=-1)
    policy = torch.log_softmax(logits / rows.temperature[:, None], dim=-1)
    return token, policy.gather(1, token[:, None]).squeeze(1)


# ── the decode loop: one compiled graph per token, forward and draw together ──────────────────────────


def decode_and_sample(
    model,
    input_ids,
    attention_mask,
    position_ids,
    cache,
    cache_position,
    row_tensors,
    seen,
    eos,
    step,
    token_ids,
    truncate,
):
    """One decode step and its draw: what CompiledDecoder.fused_step compiles into one graph."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        cache_position=cache_position,
    )
    return sample_rows(out.logits[:, -1], RowSampling(*row_tensors), seen, eos, step, token_ids, truncate)


def _row_tensors(segments, device) -> tuple[RowSampling, torch.Tensor]:
    """The rows' settings, and the step after which each row stops (its request's max_tokens)."""
    parts = []
    for s in segments:
        p = s.params
        if p.seeds is None:  # one stream per prompt from the request's seed, as per-prompt seeds give
            prompts = (s.rows.stop - s.rows.start) // p.n
            p = replace(p, seeds=[p.seed * 1_000_003 + i for i in range(prompts)])
        parts.append((s.rows.stop - s.rows.start, p))
    ends = [s.params.max_tokens for s in segments for _ in range(s.rows.start, s.rows.stop)]
    return RowSampling.from_params(parts, device), torch.tensor(ends, device=device)


@torch.inference_mode()
def sample_fused(
    model, input_ids, attention_mask, segments, eos_ids: list[int], pad_id: int, decoder, check_every, prefill
):
    """(new tokens [R, <=N], their logprobs [R, <=N]) as engines/hf.py `sample` returns them, each token drawn inside
    the compiled step (`decoder.fused_step`): the host only queues one graph replay per token and looks at the
    rows every `check_every` tokens to stop when all have ended. Prefill (the eager loop's, engines/hf.py, into the
    decoder's cache) and the first draw run eagerly."""

    rows, width = input_ids.shape
    device = input_ids.device
    n_new = max(s.params.max_tokens for s in segments)
    sampling, ends = _row_tensors(segments, device)
    row_tensors = tuple(getattr(sampling, name) for name in RowSampling.__dataclass_fields__)
    eos = torch.tensor(eos_ids, device=device)
    out, mask, cache = prefill(model, input_ids, attention_mask, n_new, decoder, {})
    position = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]
    logits = out.logits[:, -1]
    seen = torch.zeros(rows, logits.shape[-1], dtype=torch.bool, device=device).scatter_(1, input_ids, True)
    penalise = any(s.params.repetition_penalty != 1.0 for s in segments)
    steps, cache_positions = torch.arange(n_new, device=device), torch.arange(width, width + n_new, device=device)
    token_ids = _token_ids(logits)
    truncate = any(s.params.top_k or s.params.top_p < 1.0 or s.params.min_p for s in segments)
    token, logprob = sample_rows(logits, sampling, seen, eos, steps[0], token_ids, truncate)
    step_fn = decoder.fused_step()
    running, tokens, logprobs = torch.ones(rows, dtype=torch.bool, device=device), [], []
    for t in range(n_new):
        token = torch.where(running, token, torch.full_like(token, pad_id))
        tokens.append(token)
        logprobs.append(logprob)
        running &= ~torch.isin(token, eos) & (ends > t + 1)
        if t == n_new - 1 or ((t + 1) % check_every == 0 and not running.any()):
            break
        if penalise:
            seen.scatter_(1, token[:, None], True)
        mask[:, width + t] = 1
        position = position + 1
        torch.compiler.cudagraph_mark_step_begin()
        token, logprob = step_fn(
            model,
            token[:, None],
            mask,
            position,
            cache,
            cache_positions[t : t + 1],
            row_tensors,
            seen,
            eos,
            steps[t + 1],
            token_ids,
            truncate,
        )
        token, logprob = token.clone(), logprob.clone()  # a graph's outputs are overwritten by its next replay
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)
