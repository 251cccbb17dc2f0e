"""Per-token logprobs of chosen tokens, computed without ever holding fp32 logits for a whole batch.

A GRPO step needs log p(token) for every completion token under the policy, the old policy and the
reference. The naive way — `log_softmax(model(ids).logits.float()).gather(...)` — materialises
batch x length x vocab fp32 logits (8 x 1024 x 128k tokens is 4 GiB, twice over with the
log-softmax), and a silent `gather` over tensors of different lengths once made a KL of 0.04 read as
30. The choices made here:

- **Chunked over rows.** Logits are formed `chunk_size` rows (tokens) at a time, upcast to fp32 per
  chunk only, and reduced to one number per row: `logit[label] - logsumexp(logits)` (the same value
  as `log_softmax(...)[label]`, without keeping a second vocab-sized tensor). Under autograd every
  chunk is wrapped in activation checkpointing (`torch.utils.checkpoint`, non-reentrant), so the
  backward pass recomputes a chunk's logits instead of keeping every chunk's: the memory saving holds
  for training, not just for inference (no vocabulary-sized tensor is saved for backward). The trainer's
  default (grpo.logprob_chunk_size) is 128 rows on CPU: SmolLM2's 768 completion tokens x 49k vocabulary
  took +1035 MiB for forward + backward in one chunk, +118 MiB in chunks of 128, and no more time. On a GPU
  it is 1024: there 128-row chunks are launch-bound (a 0.5B Llama's 64 x 291-token forward + backward on an
  H100: 0.55 s in chunks of 128, 0.32 s in chunks of 1024 for 0.9 GiB more, 0.25 s for full logits).
- **From hidden states.** `completion_logprobs` runs the model's decoder (`model.get_decoder()`, which
  works for a plain transformers model and, through attribute forwarding, for a peft `PeftModel`) and
  applies the output embedding (`model.get_output_embeddings()`) chunk by chunk, so the model's own
  full `logits` tensor is never built. The matmul runs in the weight's dtype, exactly as the model's
  `lm_head` does, and only its output is upcast; results match `model(...).logits` to rounding. Models
  whose logits are more than `lm_head(hidden)` (final-logit soft-capping, a logit scale) or whose
  output layer is itself wrapped (LoRA on `lm_head`) fall back to the model's own logits, still reduced
  chunk by chunk.
- **Temperature.** Logprobs are those of `softmax(logits / temperature)`: the distribution the rollout
  engine sampled from (see engines/base.py), so engine and trainer logprobs compare like with like.
- **Left padding.** Prompts are left-padded, so positions come from the attention mask
  (`cumsum - 1`, clamped at 0), as `generate` does; a padded row gives the same logprobs as unpadded.
- **Shapes are checked, never truncated.** Every function raises ValueError naming both shapes when
  logits/hidden rows and labels disagree, and when a label is outside the vocabulary.
- **Entropy** is `logsumexp(z) - sum p z` with 0 log 0 = 0, so a -inf logit (a masked token) gives a
  finite entropy and gradient.
- **KL estimators.** `kl_estimators` gives Schulman's k1, k2, k3 of KL(policy || reference) per
  token, for tokens sampled from the policy; all three are logged, one goes into the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .packing import pack

# ---------------------------------------------------------------------------------------------------
# shape checks


def _check_rows_match_labels(what: str, tensor: Tensor, labels: Tensor, lead_ndim: int) -> None:
    """`tensor`'s first `lead_ndim` dims must equal `labels.shape` exactly."""
    if labels.dim() != lead_ndim or tuple(tensor.shape[:lead_ndim]) != tuple(labels.shape):
        raise ValueError(
            f"{what} shape {tuple(tensor.shape)} does not line up with labels shape {tuple(labels.shape)}: "
            f"the leading dims {tuple(tensor.shape[:lead_ndim])} must equal the labels' shape. Shift and slice "
            f"both to the same positions before calling (nothing is truncated silently)."
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be an integer tensor of token ids, got dtype {labels.dtype}")


def _check_labels_in_vocab(labels: Tensor, vocab_size: int) -> None:
    if labels.numel() == 0:
        return
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"labels hold token ids in [{low}, {high}] but the vocabulary has {vocab_size} entries; "
            f"replace ignore-index values (e.g. -100) with a real token id and mask those positions instead"
        )


# ---------------------------------------------------------------------------------------------------
# one chunk of rows: logits -> (logprob of the label, entropy)


def _chunk_logprobs(logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool):
    """logits [n, V] (any dtype), labels [n] -> fp32 logprobs [n] and entropy [n] (or None)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    log_normaliser = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_normaliser
    if not with_entropy:
        return logprobs, None
    return logprobs, _entropy(logits, log_normaliser)


def _entropy(logits: Tensor, log_normaliser: Tensor) -> Tensor:
    """H = logsumexp(z) - sum_i p_i z_i, with p_i z_i = 0 wherever p_i = 0 (0 log 0 = 0): a -inf logit (a masked
    token) gives a finite entropy and a finite gradient, where -sum(p * log p) gives NaN for both."""
    p = torch.softmax(logits, dim=-1)
    return log_normaliser - (p * torch.where(p > 0, logits, 0.0)).sum(-1)


def _chunked(fn, row_tensors: list[Tensor], shared: tuple, chunk_size: int, with_entropy: bool):
    """Apply fn(*row_chunks, *shared) over row chunks and concatenate its (logprobs, entropy) outputs.

    Under autograd each chunk is checkpointed, so its vocab-sized intermediates are freed after the
    forward and recomputed in the backward."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in list(row_tensors) + list(shared)
    )
    n_rows = row_tensors[0].shape[0]
    logprob_chunks, entropy_chunks = [], []
    for start in range(0, n_rows, chunk_size):
        chunk = [t[start : start + chunk_size] for t in row_tensors]
        if needs_grad:
            logprobs, entropy = checkpoint(fn, *chunk, *shared, use_reentrant=False)
        else:
            logprobs, entropy = fn(*chunk, *shared)
        logprob_chunks.append(logprobs)
        entropy_chunks.append(entropy)
    if n_rows == 0:
        empty = torch.zeros(0, dtype=torch.float32, device=row_tensors[0].device)
        return empty, (empty if with_entropy else None)
    logprobs = torch.cat(logprob_chunks)
    entropy = torch.cat(entropy_chunks) if with_entropy else None
    return logprobs, entropy


# ---------------------------------------------------------------------------------------------------
# public functions


def selective_log_softmax(logits: Tensor, labels: Tensor, chunk_size: int = 128) -> Tensor:
    """log_softmax(logits.float())[..., label] for logits [N, V] or [B, T, V] and labels [N] or [B, T].

    Returns float32 with the labels' shape. Rows are processed `chunk_size` at a time, so fp32 logits
    for the whole batch never exist at once."""
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must be [N, V] or [B, T, V], got shape {tuple(logits.shape)}")
    _check_rows_match_labels("logits", logits, labels, logits.dim() - 1)
    vocab_size = logits.shape[-1]
    _check_labels_in_vocab(labels, vocab_size)

    def fn(logits_chunk, labels_chunk):
        return _chunk_logprobs(logits_chunk, labels_chunk, 1.0, with_entropy=False)

    logprobs, _ = _chunked(fn, [logits.reshape(-1, vocab_size), labels.reshape(-1)], (), chunk_size, False)
    return logprobs.view(labels.shape)


def logprobs_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 128,
    with_entropy: bool = False,
    lm_head_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs of `labels` under softmax((hidden @ W.T + bias) / temperature), chunk by chunk.

    hidden [B, T, H], lm_head_weight [V, H], labels [B, T] -> (logprobs [B, T] fp32, entropy [B, T] fp32
    or None). The logits of one chunk of rows exist at a time, in fp32 only for that chunk."""
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, T, H], got shape {tuple(hidden.shape)}")
    _check_rows_match_labels("hidden", hidden, labels, 2)
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight shape {tuple(lm_head_weight.shape)} must be [V, H] with "
            f"H = {hidden.shape[-1]} (the hidden size of hidden {tuple(hidden.shape)})"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _check_labels_in_vocab(labels, lm_head_weight.shape[0])

    def fn(hidden_chunk, labels_chunk, weight, bias):
        logits = F.linear(hidden_chunk, weight, bias)
        return _chunk_logprobs(logits, labels_chunk, temperature, with_entropy)

    batch, length, hidden_size = hidden.shape
    logprobs, entropy = _chunked(
        fn,
        [hidden.reshape(-1, hidden_size), labels.reshape(-1)],
        (lm_head_weight, lm_head_bias),
        chunk_size,
        with_entropy,
    )
    return logprobs.view(batch, length), (entropy.view(batch, length) if with_entropy else None)


def _next_token_positions(length: int, completion_len: int) -> slice:
    """Positions whose outputs predict the last `completion_len` tokens: token t is predicted at t - 1."""
    return slice(length - completion_len - 1, length - 1)


def _position_ids(attention_mask: Tensor) -> Tensor:
    """Positions for a left-padded batch: 0 at the first real token; pads get 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _logits_are_lm_head_output(model) -> bool:
    """True when logits == get_output_embeddings()(last hidden state) and that layer is a plain Linear."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:  # e.g. a peft LoRA layer wrapping lm_head
        return False
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) is not None:
        return False
    if getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        return False
    return True


def completion_logprobs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_len: int,
    temperature: float = 1.0,
    chunk_size: int = 128,
    with_entropy: bool = False,
    packed: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs (and entropy) of the completion tokens `input_ids[:, L - completion_len:]` under `model`.

    input_ids, attention_mask [B, L], left-padded prompts followed by the completions; `model` is a HF
    causal LM, plain or peft-wrapped. Returns (logprobs [B, completion_len] fp32, entropy or None).
    Positions where the completion is padding get a logprob too (of the pad token, or with `packed` of an
    arbitrary position): mask them in the loss. `packed` runs the model over the rows' real tokens laid end to
    end (trainer/packing.py) instead of the padded batch; the result is the same to rounding."""
    _check_completion_shape(input_ids, attention_mask, completion_len)
    labels = input_ids[:, input_ids.shape[1] - completion_len :]
    inputs, predicting = _model_inputs(input_ids, attention_mask, completion_len, packed)
    if _logits_are_lm_head_output(model):
        hidden = model.get_decoder()(**inputs).last_hidden_state
        head = model.get_output_embeddings()
        return logprobs_from_hidden(
            predicting(hidden),
            head.weight,
            labels,
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
            lm_head_bias=head.bias,
        )
    # Fallback: the model's own logits (built in the model's dtype), reduced to fp32 chunk by chunk.
    logits = predicting(model(**inputs).logits)
    return _logprobs_from_logits(logits, labels, temperature, chunk_size, with_entropy)


def _check_completion_shape(input_ids: Tensor, attention_mask: Tensor, completion_len: int) -> None:
    if input_ids.dim() != 2 or tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
            f"must both be [B, L] with the same shape"
        )
    length = input_ids.shape[1]
    if not 1 <= completion_len <= length - 1:
        raise ValueError(
            f"completion_len={completion_len} must be in [1, L - 1] = [1, {length - 1}] for input_ids "
            f"of shape {tuple(input_ids.shape)}: the first completion token is predicted from the token "
            f"before it, so at least one prompt token must precede the completion"
        )


def _model_inputs(input_ids: Tensor, attention_mask: Tensor, completion_len: int, packed: bool):
    """The model's keyword inputs, and the function taking its per-position outputs to the positions that
    predict the completion tokens: [B, completion_len, ...]."""
    if packed:
        plan = pack(input_ids, attention_mask, completion_len)
        inputs = dict(input_ids=plan.input_ids, attention_mask=None, position_ids=plan.position_ids, use_cache=False)

        def predicting(outputs: Tensor) -> Tensor:  # [bins, width, ...] -> [B, completion_len, ...]
            return outputs[plan.bin_of, plan.column_of]

        return inputs, predicting
    inputs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=_position_ids(attention_mask),
        use_cache=False,
    )
    positions = _next_token_positions(input_ids.shape[1], completion_len)

    def predicting(outputs: Tensor) -> Tensor:  # [B, L, ...] -> [B, completion_len, ...]
        return outputs[:, positions]

    return inputs, predicting


def _logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float, chunk_size: int, with_entropy: bool):
    """Logprobs (and entropy) of labels [B, C] from logits [B, C, V] in any dtype, in fp32 chunk by chunk."""
    _check_rows_match_labels("logits", logits, labels, 2)
    _check_labels_in_vocab(labels, logits.shape[-1])

    def fn(logits_chunk, labels_chunk):
        return _chunk_logprobs(logits_chunk, labels_chunk, temperature, with_entropy)

    (batch, completion_len), vocab_size = labels.shape, logits.shape[-1]
    logprobs, entropy = _chunked(fn, [logits.reshape(-1, vocab_size), labels.reshape(-1)], (), chunk_size, with_entropy)
    return logprobs.view(batch, completion_len), (entropy.view(batch, completion_len) if with_entropy else None)


def check_packing(model, vocab_size: int, device: torch.device) -> float:
    """The largest difference between packed and padded logprobs of two short random sequences under `model`.
    A model whose attention crosses packed sequences shows it here, as a difference far above rounding."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (2, 12), generator=generator).to(device)
    mask = torch.ones_like(ids)
    mask[0, :6], mask[1, :7] = 0, 0  # 6 and 5 real tokens, left-padded: the two pack into one bin of 12
    was_training = model.training
    model.eval()  # no dropout: the two forwards must see the same weights
    try:
        with torch.no_grad():
            padded, _ = completion_logprobs(model, ids, mask, 3)
            packed, _ = completion_logprobs(model, ids, mask, 3, packed=True)
    finally:
        model.train(was_training)
    return float((padded - packed).abs().max())


def kl_estimators(logp: Tensor, ref_logp: Tensor) -> dict[str, Tensor]:
    """Schulman's per-token estimators of KL(policy || ref) for tokens sampled from the policy.

    With log r = ref_logp - logp: k1 = -log r (unbiased, high variance, can be negative),
    k2 = (log r)^2 / 2 (biased, low variance, good when the two are close),
    k3 = r - 1 - log r (unbiased, always >= 0)."""
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp shape {tuple(logp.shape)} and ref_logp shape {tuple(ref_logp.shape)} must match")
    log_r = ref_logp - logp
    return {
        "k1": -log_r,
        "k2": 0.5 * log_r**2,
        "k3": torch.exp(log_r) - log_r - 1,
    }
