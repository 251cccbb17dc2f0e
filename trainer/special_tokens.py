"""The special tokens a model needs to stop where its chat template ends a turn, checked at load.

A model converted or copied by hand can come with special tokens that disagree (SmolLM2 read from its GGUF by
transformers: `eos_token = <|im_start|>`, no pad, while its generation config stops at `<|im_end|>`). Nothing
fails: rollouts stop at the wrong token, or never, and every completion runs to max_tokens. So at load:

- errors (ValueError naming the file and the fix): no stop token at all; a special-token id outside the
  model's vocabulary; the chat template's assistant terminator (the token right after an assistant message,
  `<|im_end|>` for ChatML, `</s>` for the tiny model) is not a stop token;
- warnings: the tokenizer's eos is not among the generation config's eos ids, or equals its bos.

The stop tokens are the generation config's eos ids plus the tokenizer's eos: what the rollout engines stop at.
The terminator is found by rendering a one-turn conversation with a sentinel answer, so it works for any
template without parsing it; a template that renders nothing recognisable after the answer is not checked.
"""

from __future__ import annotations

import warnings

SENTINEL = "Ballast-sentinel-answer"


def generation_eos_ids(generation_config) -> list[int]:
    """The generation config's eos_token_id as a list (it may be an int, a list or None)."""
    ids = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if ids is None:
        return []
    return [int(i) for i in ids] if isinstance(ids, (list, tuple)) else [int(ids)]


def stop_token_ids(tokenizer, generation_config) -> list[int]:
    """What the rollout engines stop at: the generation config's eos ids, then the tokenizer's eos if not among them."""
    ids = generation_eos_ids(generation_config)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def assistant_terminator(tokenizer) -> int | None:
    """Id of the special token the chat template writes right after an assistant message, or None when the
    template writes no special token there (or cannot render a user/assistant turn)."""
    conversation = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # a template that refuses this conversation (jinja raise_exception): nothing to check
        return None
    if not isinstance(text, str) or SENTINEL not in text:
        return None
    after = text.split(SENTINEL, 1)[1]
    ids = tokenizer.encode(after, add_special_tokens=False) if after else []
    special = set(tokenizer.all_special_ids) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
    }
    return ids[0] if ids and ids[0] in special else None


def check_special_tokens(tokenizer, vocab_size: int, generation_config, where: str) -> list[str]:
    """Raise ValueError for special tokens that would break generation; warn (and return the warnings) for those
    that are merely inconsistent. `where` names the model directory in the messages."""
    stops = stop_token_ids(tokenizer, generation_config)
    if not stops:
        raise ValueError(
            f"the model at {where} has no end-of-sequence token (neither eos_token in "
            "tokenizer_config.json nor eos_token_id in generation_config.json); set the token that ends "
            "an assistant turn"
        )
    named = {
        "bos_token": tokenizer.bos_token_id,
        "eos_token": tokenizer.eos_token_id,
        "pad_token": tokenizer.pad_token_id,
        "unk_token": tokenizer.unk_token_id,
    }
    config_eos = generation_eos_ids(generation_config)
    named.update({f"generation_config eos_token_id[{i}]": t for i, t in enumerate(config_eos)})
    for name, token_id in named.items():
        if token_id is not None and not 0 <= token_id < vocab_size:
            raise ValueError(
                f"the model at {where}: {name} is id {token_id}, outside its vocabulary of {vocab_size} "
                "embeddings; fix the id in its tokenizer_config.json / generation_config.json"
            )

    terminator = assistant_terminator(tokenizer)
    if terminator is not None and terminator not in stops:
        raise ValueError(
            f"the model at {where}: its chat template ends an assistant turn with {_show(tokenizer, terminator)}, "
            f"which is not a stop token (stop ids {stops}), so completions would never end; add {terminator} to "
            "eos_token_id in its generation_config.json (or set eos_token to it in tokenizer_config.json)"
        )

    found = []
    eos = tokenizer.eos_token_id
    better = terminator if terminator not in (None, eos) else (config_eos[0] if config_eos else None)
    if eos is not None and config_eos and eos not in config_eos:
        listed = ", ".join(_show(tokenizer, i) for i in config_eos)
        found.append(
            f"the model at {where}: the tokenizer's eos_token {_show(tokenizer, eos)} is not among the "
            f"generation config's eos ids ({listed}); set eos_token to "
            f"{tokenizer.convert_ids_to_tokens(better)!r} in its tokenizer_config.json"
        )
    if eos is not None and eos == tokenizer.bos_token_id:
        found.append(
            f"the model at {where}: eos_token and bos_token are the same token {_show(tokenizer, eos)}; "
            "set eos_token to the token that ends an assistant turn in its tokenizer_config.json"
        )
    for message in found:
        warnings.warn(message, UserWarning, stacklevel=3)
    return found


def _show(tokenizer, token_id: int) -> str:
    return f"{tokenizer.convert_ids_to_tokens(token_id)!r} (id {token_id})"
