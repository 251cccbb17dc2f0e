"""The policy as one flat forward for rollouts: the LoRA adapter merged into a copy of the decoder layers' weights,
q/k/v and gate/up fused, over a static KV cache of its own (rollout.merged_decode).

Why: a decode step at rollout batch sizes is bound by the number of kernels and Python calls, not by the bytes of
weights it reads (bench/README.md: 6 ms a token step at 64 rows on an H100, 22x the weights' read time). Through
peft each of a Llama layer's seven linears is three matmuls (base, A, B), an add and a module call; here a layer is
four matmuls (qkv, o, gate-up, down) over merged weights, the layout vLLM and gpt-fast decode with:

    x = rms(h) · w_in         qkv = x @ W_qkv^T (+ b)        q, k = rope(q, k)     cache[pos] = k, v
    h = h + sdpa(q, K, V) @ W_o^T                            x = rms(h) · w_post
    g, u = (x @ W_gate_up^T).chunk(2)                        h = h + (act(g) · u) @ W_down^T

Choices:
- Only architectures whose forward this file reproduces: Llama, Mistral without a sliding window and Qwen2 (q/k/v
  bias), every layer full attention, LoRA (if any) plain on Linear layers — no DoRA, no LoRA bias, no LoRA on the
  embeddings or the head. For anything else `MergedDecoder.build` says why not and the engine decodes through the
  model as before.
- The copy is refreshed before each rollout when any weight changed (W + peft's own get_delta_weight for the active
  adapters; the base alone under disable_adapter), in place: it always serves the trainer's current policy, and a
  compiled graph's weight addresses never move. Embeddings, norms and the head are the model's own tensors, not
  copied (LoRA does not train them; a full fine-tune updates them in place).
- Rotary embeddings come from the model's own rotary module, so the config's rope scaling is the model's.
- Left padding: a padded query position attends to itself alone, so its states stay finite (a row that sees no key
  is NaN in some attention kernels, and a NaN key or value poisons every later query even where masked).
- It costs one copy of the decoder layers' weights; rollout.merged_decode 'auto' takes it where it fits
  (`copy_fits`).
- In fp32 the merged logits equal peft's forward's to float rounding (tests/test_merged_decode.py); in bf16 the
  merge rounds W + ΔW once more, which the engine-vs-trainer logprob metrics report and the rollout correction covers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "mistral", "qwen2")
COPY_SHARE = 0.25  # rollout.merged_decode auto: the copy may take this share of the memory free after the model loads


class Output(NamedTuple):
    logits: torch.Tensor  # [R, T, V]


class Cache:
    """Keys and values per layer, [R, kv_heads, length, head_dim], written in place at their cache positions."""

    def __init__(self, layers: int, rows: int, kv_heads: int, length: int, head_dim: int, dtype, device):
        shape = (rows, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        for t in self.keys + self.values:  # a CUDA graph may write them in place: their addresses are fixed
            torch._dynamo.mark_static_address(t)

    def reset(self) -> None:
        for t in self.keys + self.values:
            t.zero_()


class _Layer(torch.nn.Module):
    """One decoder layer's merged, fused weights (buffers: refreshed in place, never trained)."""

    def __init__(self, layer, dtype):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.parts = {
            "qkv": [attn.q_proj, attn.k_proj, attn.v_proj],
            "o": [attn.o_proj],
            "gate_up": [mlp.gate_proj, mlp.up_proj],
            "down": [mlp.down_proj],
        }
        for name, linears in self.parts.items():
            out = sum(_base(m).out_features for m in linears)
            device = _base(linears[0]).weight.device
            self.register_buffer(name, torch.empty(out, _base(linears[0]).in_features, dtype=dtype, device=device))
            has_bias = any(_base(m).bias is not None for m in linears)
            self.register_buffer(f"{name}_bias", torch.zeros(out, dtype=dtype, device=device) if has_bias else None)
        self.q_size, self.kv_size = _base(attn.q_proj).out_features, _base(attn.k_proj).out_features

    @torch.no_grad()
    def refresh(self) -> None:
        for name, linears in self.parts.items():
            weight, bias, row = getattr(self, name), getattr(self, f"{name}_bias"), 0
            for m in linears:
                w, b = _effective(m)
                weight[row : row + w.shape[0]].copy_(w)
                if b is not None:
                    bias[row : row + w.shape[0]].copy_(b)
                row += w.shape[0]


class MergedDecoder(torch.nn.Module):
    """The model's rollout forward over merged weights, called as engines/hf.py calls a Hugging Face model
    (input_ids, attention_mask over the whole cache, position_ids, past_key_values, cache_position, logits_to_keep)
    and returning `.logits`; `new_cache` makes its static cache."""

    def __init__(self, model, dtype):
        super().__init__()
        self.source = [model]  # a list: not a submodule (its parameters are not ours)
        inner = _inner(model)
        config = model.config
        self.config = config
        self.embed = inner.embed_tokens
        self.layers = torch.nn.ModuleList(_Layer(layer, dtype) for layer in inner.layers)
        self.norm, self.rotary = inner.norm, inner.rotary_emb
        self.lm_head = _base(model.get_output_embeddings())
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.eps = config.rms_norm_eps
        from transformers.activations import ACT2FN

        self.act = ACT2FN[config.hidden_act]
        self.seen: tuple | None = None

    @classmethod
    def build(cls, model) -> tuple[MergedDecoder | None, str]:
        """(the merged decoder of `model`, "") or (None, why it cannot have one)."""
        why = unsupported(model)
        if why:
            return None, why
        dtype = _inner(model).embed_tokens.weight.dtype
        return cls(model, dtype), ""

    def copy_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for layer in self.layers for b in layer.buffers())

    def ready(self) -> MergedDecoder:
        """Itself, its weights brought to the model's current ones if any changed since the last call."""
        model = self.source[0]
        seen = _state(model)
        if seen != self.seen:
            for layer in self.layers:
                layer.refresh()
            self.seen = seen
        return self

    def new_cache(self, rows: int, length: int, device) -> Cache:
        dtype = self.layers[0].qkv.dtype
        return Cache(len(self.layers), rows, self.kv_heads, length, self.head_dim, dtype, device)

    def forward(
        self,
        input_ids,
        attention_mask,
        position_ids,
        past_key_values: Cache,
        cache_position,
        use_cache: bool = True,
        logits_to_keep: int = 0,
    ) -> Output:
        rows, width = input_ids.shape
        h = self.embed(input_ids)
        cos, sin = self.rotary(h, position_ids)
        cos, sin = cos[:, None], sin[:, None]
        allowed = _allowed(attention_mask, cache_position)
        for layer, keys, values in zip(self.layers, past_key_values.keys, past_key_values.values):
            qkv = F.linear(layer.input_norm(h), layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
            q = q.view(rows, width, self.heads, self.head_dim).transpose(1, 2)
            k = k.view(rows, width, self.kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(rows, width, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            keys.index_copy_(2, cache_position, k)
            values.index_copy_(2, cache_position, v)
            a = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=allowed, scale=self.head_dim**-0.5, enable_gqa=self.heads != self.kv_heads
            )
            h = h + F.linear(a.transpose(1, 2).reshape(rows, width, -1), layer.o, layer.o_bias)
            gate, up = F.linear(layer.post_norm(h), layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            h = h + F.linear(self.act(gate) * up, layer.down, layer.down_bias)
        h = self.norm(h)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return Output(self.lm_head(h))


def unsupported(model) -> str:
    """Why `model` cannot decode merged ("" when it can)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"model type {kind!r} (merged decode reproduces {', '.join(SUPPORTED)})"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "a layer with sliding-window attention"
    if kind == "mistral" and getattr(config, "sliding_window", None):
        return "Mistral's sliding window"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    from peft.tuners.lora import Linear, LoraLayer
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return "an FSDP2-sharded policy (not yet merged: its layers are whole only while a rollout runs)"
    for name, m in model.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        if type(m) is not Linear:
            return f"a LoRA {type(m).__name__} at {name} (merged decode merges LoRA Linear layers only)"
        if any(m.use_dora.get(a) for a in m.lora_A) or getattr(m, "lora_variant", None):
            return f"a DoRA or other LoRA variant at {name}"
        if any(b.bias is not None for b in m.lora_B.values()):
            return f"LoRA bias at {name}"
    try:
        inner = _inner(model)
        layer = inner.layers[0]
        _ = (layer.self_attn.q_proj, layer.mlp.gate_proj, inner.rotary_emb, inner.norm)
    except AttributeError as e:
        return f"a module layout merged decode does not know ({e})"
    if isinstance(model.get_output_embeddings(), LoraLayer):
        return "LoRA on the output head"
    return ""


def copy_fits(decoder: MergedDecoder, device: torch.device) -> bool:
    """rollout.merged_decode auto, on CUDA: the copy takes at most COPY_SHARE of the device memory free now."""
    free, _ = torch.cuda.mem_get_info(device)
    return decoder.copy_bytes() <= COPY_SHARE * free


def _allowed(attention_mask, cache_position):
    """[R, 1, T, L] bool: key j is seen by the query at cache position p when j <= p and j is no padding, and by a
    padded query itself (so its states stay finite)."""
    length = attention_mask.shape[-1]
    keys = torch.arange(length, device=attention_mask.device)
    causal = keys[None, :] <= cache_position[:, None]  # [T, L]
    own = keys[None, :] == cache_position[:, None]
    return ((attention_mask.bool()[:, None, :] & causal[None]) | own[None])[:, None]


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _inner(model):
    """The decoder stack (…Model with embed_tokens, layers, norm, rotary_emb) under peft and the …ForCausalLM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


def _base(m):
    return m.get_base_layer() if hasattr(m, "get_base_layer") else m


def _effective(m) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Linear's weight as the model applies it now: the base plus each active adapter's update (peft's own merge)."""
    base = _base(m)
    weight = base.weight
    if base is not m and not m.disable_adapters and not m.merged:
        for name in m.active_adapters:
            if name in m.lora_A:
                weight = weight + m.get_delta_weight(name)  # in the adapter's dtype: one rounding
    return weight, base.bias


def _state(model) -> tuple:
    """What the merged copy depends on: every parameter's storage and version, and which adapters act."""
    from peft.tuners.lora import LoraLayer

    params = tuple((p.data_ptr(), p._version) for p in model.parameters())
    adapters = tuple(
        (tuple(m.active_adapters), m.disable_adapters, m.merged) for m in model.modules() if isinstance(m, LoraLayer)
    )
    return params, adapters
