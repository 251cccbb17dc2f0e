"""How hard a step works the device, and how the update should spend its memory: the model FLOPs of a GRPO step, the
device's peak, and the choice of packing and gradient checkpointing when the spec leaves them to Ballast ("auto").

Plain arithmetic on numbers (no torch import): tested on constructed inputs (tests/test_perf.py); the trainer feeds
it the model's config, the device's name and free memory, and the step's token counts.

**FLOPs** (`step_flops`), N the parameters of the base model's matmuls per token (`matmul_params`: attention
projections, MLP, lm_head; embedding lookups are no matmuls) and N_lora the trainable adapter's:

- a forward is 2N a token (a multiply and an add per weight);
- the update's forward + backward is 6N a token when every weight trains (forward 2N, activation gradients 2N, weight
  gradients 2N), but a LoRA run's base is frozen: no weight gradients for it, so 4N + 6 N_lora. Quoting 6N for a
  LoRA update (as a full fine-tune's MFU does) would overstate its utilisation by half;
- recomputation under gradient checkpointing is not counted (model FLOPs, not hardware FLOPs), nor attention's
  score and value products (4 x layers x hidden x context a token forward; a few % of 2N at a few hundred tokens);
- the step: generation 2N per prompt and completion token of each row (prefill, then one token at a time over the
  KV cache), the reference forward 2N a token when beta > 0, and the update's per token times num_iterations.

`perf/mfu_update` is the update's FLOPs over time/update x peak, `perf/mfu_wall` the step's over step_time x peak
(trainer/metrics.py). **Peak**: dense bf16/fp16 tensor-core FLOP/s from a small table by device name (H100 SXM and
H200 989, H100 PCIe 756, A100 312 TFLOP/s), times the ranks; on a device the table does not know, on CPU or in fp32
there is none and the metrics are not logged, unless the spec sets model.peak_tflops.
"""

from __future__ import annotations

from dataclasses import dataclass

# dense bf16 / fp16 tensor-core peak, TFLOP/s (no sparsity); the first name contained in the device's name wins
PEAK_TFLOPS_16BIT = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0))
SIXTEEN_BIT = ("bfloat16", "float16")


def peak_flops(device_name: str | None, dtype: str, ranks: int = 1, user_tflops: float | None = None) -> float | None:
    """FLOP/s the `ranks` devices can do at most in `dtype`: the user's figure (model.peak_tflops) per device, else
    the table's for a 16-bit dtype on a device it names; None when neither (a CPU, an unknown GPU, fp32)."""
    if user_tflops is not None:
        return user_tflops * 1e12 * ranks
    if device_name is None or dtype not in SIXTEEN_BIT:
        return None
    tflops = next((v for k, v in PEAK_TFLOPS_16BIT if k in device_name), None)
    return None if tflops is None else tflops * 1e12 * ranks


def matmul_params(config) -> int | None:
    """Weights a token meets in matmuls, from a decoder's Hugging Face config (Llama, Qwen, Mistral, SmolLM shapes:
    q/k/v/o projections, a gated MLP, the lm_head); None when the config lacks these fields."""
    try:
        d, layers, inter = config.hidden_size, config.num_hidden_layers, config.intermediate_size
        heads, vocab = config.num_attention_heads, config.vocab_size
    except AttributeError:
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    attention = d * heads * head_dim * 2 + d * kv * head_dim * 2  # q and o; k and v
    mlp = 3 * d * inter  # gate, up, down
    return layers * (attention + mlp) + d * vocab


@dataclass(frozen=True)
class StepFlops:
    update: float  # the update's forward + backward, all iterations
    total: float  # the whole step: generation, reference, update


def step_flops(
    n: int, n_trainable: int, full: bool, tokens: int, iterations: int = 1, reference: bool = False
) -> StepFlops:
    """The model FLOPs of one step over `tokens` (prompt + completion tokens of every row), by the module docstring's
    formula: `full` a full fine-tune (6N a token), else LoRA over a frozen base (4N + 6 n_trainable)."""
    per_token = 6 * n if full else 4 * n + 6 * n_trainable
    update = per_token * tokens * iterations
    return StepFlops(update=update, total=update + 2 * n * tokens * (1 + int(reference)))


# ── memory: packing and gradient checkpointing when the spec says "auto" ────────────────────────────────────────

# bytes of activations a token keeps per layer for the backward, in elements of hidden size (Korthikanti et al. 2022:
# 34 x hidden bytes in 16-bit with fused attention, i.e. 17 elements); with checkpointing only the layer's input
ACTIVATION_ELEMENTS = 17
HEADROOM = 0.5  # share of the free memory the update's activations may take before checkpointing is chosen


@dataclass(frozen=True)
class MemoryPlan:
    pack: bool
    checkpointing: bool
    reason: str


def memory_plan(
    device_type: str,
    free_bytes: int | None,
    rows_per_micro: int,
    tokens_per_row: int,
    hidden: int,
    layers: int,
    dtype_bytes: int,
    pack: bool | str = "auto",
    checkpointing: bool | str = "auto",
) -> MemoryPlan:
    """grpo.pack_sequences and model.gradient_checkpointing, each the spec's when it is a bool, chosen when "auto":

    - off a GPU "auto" is off, as the defaults (a CPU run behaves as it did);
    - packing, on a GPU, whenever a micro-batch has more than one row: pads then cost positions through every linear
      layer and packing removes them at no cost in exactness (trainer/packing.py; the trainer falls back to the
      padded forward if the model's attention fails the packing check);
    - checkpointing, on a GPU, when the micro-batch's activations (rows x tokens x layers x hidden x 17 elements,
      an upper bound: every row at the longest prompt + max_tokens) would take more than HEADROOM of the memory
      free after the model loaded; it costs a recomputed forward (about a third more update compute)."""
    gpu = device_type == "cuda"
    chose_pack = pack if isinstance(pack, bool) else gpu and rows_per_micro > 1
    activations = rows_per_micro * tokens_per_row * layers * hidden * ACTIVATION_ELEMENTS * dtype_bytes
    if isinstance(checkpointing, bool):
        chose_ckpt, why = checkpointing, "as the spec says"
    elif not gpu or free_bytes is None:
        chose_ckpt, why = False, "off a GPU: off"
    else:
        chose_ckpt = activations > HEADROOM * free_bytes
        why = f"activations ~{activations / 2**30:.1f} GiB against {free_bytes / 2**30:.1f} GiB free"
    return MemoryPlan(pack=chose_pack, checkpointing=chose_ckpt, reason=why)
