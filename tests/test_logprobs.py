"""trainer/logprobs.py: chunked logprobs equal the naive full log-softmax, shapes are checked, and the
KL estimators estimate KL(p || q)."""

import math

import pytest
import torch

from trainer.logprobs import completion_logprobs, kl_estimators, logprobs_from_hidden, selective_log_softmax


def naive_logprobs(logits, labels):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------------
# selective_log_softmax


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1024])
def test_selective_log_softmax_2d_equals_naive_for_any_chunk_size(chunk_size):
    torch.manual_seed(0)
    logits = torch.randn(10, 50) * 3
    labels = torch.randint(0, 50, (10,))
    got = selective_log_softmax(logits, labels, chunk_size=chunk_size)
    assert got.dtype == torch.float32 and got.shape == (10,)
    torch.testing.assert_close(got, naive_logprobs(logits, labels), rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 1024])
def test_selective_log_softmax_3d_equals_naive_for_any_chunk_size(chunk_size):
    torch.manual_seed(1)
    logits = (torch.randn(2, 5, 40) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 40, (2, 5))
    got = selective_log_softmax(logits, labels, chunk_size=chunk_size)
    assert got.dtype == torch.float32 and got.shape == (2, 5)
    torch.testing.assert_close(got, naive_logprobs(logits, labels), rtol=0, atol=1e-5)


def test_selective_log_softmax_rejects_logits_and_labels_of_different_length():
    logits = torch.randn(2, 5, 40)
    labels = torch.randint(0, 40, (2, 4))
    with pytest.raises(ValueError, match=r"\(2, 5, 40\).*\(2, 4\)"):
        selective_log_softmax(logits, labels)


def test_selective_log_softmax_rejects_labels_outside_the_vocabulary():
    with pytest.raises(ValueError, match="-100"):
        selective_log_softmax(torch.randn(3, 40), torch.tensor([1, -100, 2]))


# ---------------------------------------------------------------------------------------------------
# logprobs_from_hidden


def _hidden_inputs(seed=2):
    torch.manual_seed(seed)
    hidden = torch.randn(2, 6, 16)
    weight = torch.randn(70, 16)
    bias = torch.randn(70)
    labels = torch.randint(0, 70, (2, 6))
    return hidden, weight, bias, labels


@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
def test_logprobs_from_hidden_equals_naive_with_temperature_and_bias(chunk_size):
    hidden, weight, bias, labels = _hidden_inputs()
    temperature = 0.7
    got, entropy = logprobs_from_hidden(
        hidden, weight, labels, temperature=temperature, chunk_size=chunk_size, lm_head_bias=bias
    )
    expected = naive_logprobs((hidden @ weight.T + bias) / temperature, labels)
    assert entropy is None
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_logprobs_from_hidden_entropy_equals_naive_entropy():
    hidden, weight, _, labels = _hidden_inputs()
    _, entropy = logprobs_from_hidden(hidden, weight, labels, temperature=1.3, chunk_size=4, with_entropy=True)
    log_p = torch.log_softmax(hidden @ weight.T / 1.3, dim=-1)
    expected = -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(entropy, expected, rtol=0, atol=1e-5)


def test_logprobs_from_hidden_gradient_equals_naive_gradient():
    hidden, weight, _, labels = _hidden_inputs()
    hidden_a = hidden.clone().requires_grad_()
    logprobs, entropy = logprobs_from_hidden(hidden_a, weight, labels, chunk_size=5, with_entropy=True)
    (logprobs.sum() + entropy.sum()).backward()

    hidden_b = hidden.clone().requires_grad_()
    log_p = torch.log_softmax(hidden_b @ weight.T, dim=-1)
    naive = log_p.gather(-1, labels.unsqueeze(-1)).sum() - (log_p.exp() * log_p).sum()
    naive.backward()
    torch.testing.assert_close(hidden_a.grad, hidden_b.grad, rtol=0, atol=1e-5)


def test_entropy_treats_a_minus_infinity_logit_as_zero_probability_with_finite_value_and_gradient():
    hidden, weight, _, labels = _hidden_inputs()
    masked_bias = torch.zeros(70)
    masked_bias[::3] = float("-inf")  # a third of the vocabulary masked out, as a logits processor does
    labels = labels - labels % 3 + 1  # labels among the tokens left
    hidden = hidden.clone().requires_grad_()
    logprobs, entropy = logprobs_from_hidden(
        hidden, weight, labels, chunk_size=5, with_entropy=True, lm_head_bias=masked_bias
    )
    (logprobs.sum() + entropy.sum()).backward()

    kept = torch.log_softmax((hidden.detach() @ weight.T)[..., masked_bias == 0], dim=-1)
    torch.testing.assert_close(entropy.detach(), -(kept.exp() * kept).sum(-1), rtol=0, atol=1e-5)
    assert torch.isfinite(hidden.grad).all()


def test_no_vocabulary_sized_tensor_is_kept_for_backward():
    hidden, weight, _, labels = _hidden_inputs()
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_()  # full fine-tuning: the output layer trains too
    saved_shapes = []

    def pack(tensor):
        saved_shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, entropy = logprobs_from_hidden(hidden, weight, labels, chunk_size=4, with_entropy=True)
    (logprobs.sum() + entropy.sum()).backward()
    vocab_size = weight.shape[0]
    assert saved_shapes, "the chunks' inputs are saved for the recomputation"
    assert [s for s in saved_shapes if vocab_size in s and s != tuple(weight.shape)] == []
    assert hidden.grad is not None and weight.grad is not None


def test_logprobs_from_hidden_rejects_hidden_and_labels_of_different_length():
    hidden, weight, _, labels = _hidden_inputs()
    with pytest.raises(ValueError, match=r"\(2, 6, 16\).*\(2, 5\)"):
        logprobs_from_hidden(hidden, weight, labels[:, :5])


# ---------------------------------------------------------------------------------------------------
# completion_logprobs on a tiny Llama, plain and with LoRA


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_llama_lora():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
    )
    model = get_peft_model(
        LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    with torch.no_grad():  # LoRA's B starts at zero; make the adapter change the outputs
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return model.eval()


def _left_padded_batch():
    """Two prompts (3 and 5 tokens, left-padded to 5) each followed by a 4-token completion."""
    torch.manual_seed(3)
    input_ids = torch.randint(1, 300, (2, 9))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    input_ids[0, :2] = 0
    attention_mask[0, :2] = 0
    return input_ids, attention_mask


def _naive_completion_logprobs(model, input_ids, attention_mask, completion_len, temperature):
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    length = input_ids.shape[1]
    logits = logits[:, length - completion_len - 1 : length - 1] / temperature
    return naive_logprobs(logits, input_ids[:, length - completion_len :])


@pytest.mark.parametrize("which", ["plain", "lora"])
def test_completion_logprobs_equals_naive_model_logits_with_left_padding(which, tiny_llama, tiny_llama_lora):
    model = tiny_llama if which == "plain" else tiny_llama_lora
    input_ids, attention_mask = _left_padded_batch()
    with torch.no_grad():
        got, entropy = completion_logprobs(
            model, input_ids, attention_mask, completion_len=4, temperature=0.8, chunk_size=3, with_entropy=True
        )
        expected = _naive_completion_logprobs(model, input_ids, attention_mask, 4, 0.8)
    assert got.shape == (2, 4) and entropy.shape == (2, 4)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("which", ["plain", "lora"])
def test_completion_logprobs_never_calls_the_lm_head_on_the_whole_sequence(
    which, tiny_llama, tiny_llama_lora, monkeypatch
):
    model = tiny_llama if which == "plain" else tiny_llama_lora
    input_ids, attention_mask = _left_padded_batch()

    def full_logits(*args, **kwargs):
        raise AssertionError("lm_head was called: full logits were built")

    monkeypatch.setattr(model.get_output_embeddings(), "forward", full_logits)
    with torch.no_grad():
        logprobs, _ = completion_logprobs(model, input_ids, attention_mask, completion_len=4)
    assert torch.isfinite(logprobs).all()


def test_completion_logprobs_lora_adapter_changes_the_result(tiny_llama_lora):
    input_ids, attention_mask = _left_padded_batch()
    with torch.no_grad():
        with_adapter, _ = completion_logprobs(tiny_llama_lora, input_ids, attention_mask, completion_len=4)
        with tiny_llama_lora.disable_adapter():
            without_adapter, _ = completion_logprobs(tiny_llama_lora, input_ids, attention_mask, completion_len=4)
    assert (with_adapter - without_adapter).abs().max() > 1e-2


def test_completion_logprobs_of_a_left_padded_row_equal_those_of_the_unpadded_row():
    # GPT-2 has absolute position embeddings (RoPE models like Llama barely notice an offset), so this
    # fails unless positions are derived from the attention mask.
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=1, n_head=2)).eval()
    input_ids, attention_mask = _left_padded_batch()
    with torch.no_grad():
        padded, _ = completion_logprobs(model, input_ids, attention_mask, completion_len=4)
        alone, _ = completion_logprobs(model, input_ids[:1, 2:], attention_mask[:1, 2:], completion_len=4)
    torch.testing.assert_close(padded[:1], alone, rtol=0, atol=1e-4)


def test_completion_logprobs_rejects_a_completion_with_no_prompt_before_it(tiny_llama):
    input_ids, attention_mask = _left_padded_batch()
    with pytest.raises(ValueError, match="completion_len=9"):
        completion_logprobs(tiny_llama, input_ids, attention_mask, completion_len=9)


# ---------------------------------------------------------------------------------------------------
# KL estimators against the exact KL(p || q) of two known categoricals


def _sampled_estimators(p, q, num_samples=200_000):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(p, num_samples, replacement=True, generator=generator)
    return kl_estimators(p.log()[tokens], q.log()[tokens])


def _exact_kl(p, q):
    return float((p * (p.log() - q.log())).sum())


def test_kl_estimators_are_the_three_schulman_formulas():
    logp, ref_logp = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    est = kl_estimators(logp, ref_logp)
    torch.testing.assert_close(est["k1"], torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(est["k2"], torch.tensor([0.125, 0.5]))
    torch.testing.assert_close(est["k3"], torch.tensor([math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]))


def test_k1_and_k3_are_unbiased_estimates_of_kl_and_k3_is_never_negative():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)
    exact = _exact_kl(p, q)  # 0.2764
    est = _sampled_estimators(p, q)
    assert abs(est["k1"].mean().item() - exact) < 0.01
    assert abs(est["k3"].mean().item() - exact) < 0.01
    assert (est["k3"] >= 0).all()
    assert (est["k1"] < 0).any()  # k1 is unbiased but individual samples go negative


def test_k2_is_close_to_kl_for_nearby_distributions():
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10], dtype=torch.float64)
    q = torch.tensor([0.28, 0.26, 0.21, 0.14, 0.11], dtype=torch.float64)
    exact = _exact_kl(p, q)  # ~2.3e-3
    est = _sampled_estimators(p, q)
    assert abs(est["k2"].mean().item() - exact) < 0.05 * exact
