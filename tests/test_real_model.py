"""Logprobs and gradients on a real model (SmolLM2-135M-Instruct: 30 layers, 49k vocabulary, tied embeddings),
where a chunking or checkpointing mistake would show: the trainer's chunked logprobs equal the model's own logits,
and chunk size and gradient checkpointing change memory, never values or gradients.

The batch is two left-padded chat prompts with 12-token completions; the LoRA adapter is perturbed so that it
changes the outputs (peft starts B at zero).
"""

import pytest
import torch

from trainer.config import LoraConfig, ModelConfig
from trainer.data import render_prompt
from trainer.logprobs import completion_logprobs
from trainer.model import load_policy

COMPLETION = 12
LLAMA_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def policy(path, gradient_checkpointing=False):
    torch.manual_seed(0)  # peft draws lora_A from the global RNG: the same adapter for every call
    model, tokenizer = load_policy(
        ModelConfig(name_or_path=str(path), device="cpu", gradient_checkpointing=gradient_checkpointing),
        LoraConfig(r=8, alpha=16),
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    return model, tokenizer


@pytest.fixture(scope="module")
def batch(smollm2):
    _, tokenizer = policy(smollm2)
    prompts = [render_prompt(tokenizer, "What is 17 + 25?"), render_prompt(tokenizer, "Name a colour.")]
    generator = torch.Generator().manual_seed(1)
    completions = torch.randint(100, 40000, (2, COMPLETION), generator=generator)
    width = max(map(len, prompts))
    input_ids = torch.full((2, width + COMPLETION), tokenizer.pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) : width] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    input_ids[:, width:] = completions
    return input_ids, attention_mask


def lora_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def assert_same_gradients(a: dict, b: dict) -> None:
    """Equal up to fp32 summation order through 30 layers: every element within 1e-3 of its tensor's largest
    gradient (measured: 2.4e-4 at worst); a misaligned token or a lost chunk is off by order 1."""
    assert a.keys() == b.keys() and len(a) == 2 * 7 * 30
    for name in a:
        assert float((a[name] - b[name]).abs().max()) <= 1e-3 * float(b[name].abs().max()), name


def test_lora_wraps_every_llama_projection_of_smollm2(smollm2):
    model, _ = policy(smollm2)
    assert sorted(model.peft_config["default"].target_modules) == LLAMA_LINEAR
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 8 * 30 * (  # r x layers x (in + out)
        (576 + 576) * 2 + (576 + 192) * 2 + (576 + 1536) * 2 + (1536 + 576)
    )


def test_completion_logprobs_equal_the_models_own_log_softmax(smollm2, batch):
    model, _ = policy(smollm2)
    model.eval()
    input_ids, attention_mask = batch
    with torch.no_grad():
        got, _ = completion_logprobs(model, input_ids, attention_mask, COMPLETION, temperature=0.7)
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits
        expected = (
            torch.log_softmax(logits[:, -COMPLETION - 1 : -1].float() / 0.7, -1)
            .gather(-1, input_ids[:, -COMPLETION:, None])
            .squeeze(-1)
        )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_chunked_logprobs_and_their_gradients_equal_one_chunk(smollm2, batch):
    model, _ = policy(smollm2)
    input_ids, attention_mask = batch
    results = []
    for chunk_size in (5, 10_000):
        model.zero_grad(set_to_none=True)
        logprobs, entropy = completion_logprobs(
            model, input_ids, attention_mask, COMPLETION, chunk_size=chunk_size, with_entropy=True
        )
        logprobs.sum().backward()
        results.append((logprobs.detach(), entropy.detach(), lora_grads(model)))
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = results
    torch.testing.assert_close(lp_a, lp_b, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent_a, ent_b, rtol=1e-6, atol=1e-4)
    assert_same_gradients(grads_a, grads_b)


def test_gradient_checkpointing_changes_no_gradient(smollm2, batch):
    input_ids, attention_mask = batch
    grads = []
    for checkpointing in (False, True):
        model, _ = policy(smollm2, gradient_checkpointing=checkpointing)
        logprobs, _ = completion_logprobs(model, input_ids, attention_mask, COMPLETION)
        logprobs.sum().backward()
        grads.append(lora_grads(model))
    assert_same_gradients(grads[0], grads[1])
