"""The merged decode (trainer/engines/merged.py, rollout.merged_decode): the LoRA adapter merged into a copy of the
layers, q/k/v and gate/up fused, over its own static cache.

In fp32 on CPU: its logits over a left-padded batch, prefill and the decode steps after it, equal peft's forward
through the model within 1e-5 or what this CPU's fp32 rounding allows where that is more (`bound`), on the tiny
Llama and on a Qwen2 with q/k/v biases and grouped KV heads; the engine samples the same tokens with it as without;
the copy follows an optimizer step and `disable_adapter`; models it cannot reproduce decode through the model and
it says why; compiled (inductor, CPU's half of the CUDA graph) it draws what the eager loop draws; and the trainer
passes rollout.merged_decode, auto meaning CUDA only.
"""

import copy

import pytest
import torch

from tests.conftest import perturb_lora
from trainer.config import LoraConfig, ModelConfig, TrainerConfig
from trainer.data import arith_examples, render_prompt
from trainer.engines.base import SamplingParams
from trainer.engines.hf import HFEngine
from trainer.engines.merged import MergedDecoder
from trainer.model import load_policy

LOGITS = 1e-5  # merged vs peft forward, fp32: the same products summed in another order


@pytest.fixture(scope="module")
def policy(tiny_model):
    model, tokenizer = load_policy(ModelConfig(name_or_path=str(tiny_model), device="cpu"), LoraConfig(r=8, alpha=16))
    perturb_lora(model, seed=3, scale=0.2)
    model.eval()
    return model, tokenizer


def qwen2_policy():
    """A random two-layer Qwen2 (q/k/v biases, 4 query heads over 2 KV heads) with LoRA on every linear layer."""
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    base = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5)  # biases away from zero, so a dropped one shows
    model = get_peft_model(base, PeftLora(r=4, lora_alpha=8, target_modules="all-linear"))
    perturb_lora(model, seed=4, scale=0.2)
    return model.eval()


def padded(rows: list[list[int]], extra: int):
    """(input_ids, attention mask over prompt + `extra` cache slots, position ids) for left-padded rows."""
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width + extra, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) : width] = 1
    positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


@torch.no_grad()
def forward_both(model, merged, rows: list[list[int]], steps: int):
    """Prefill and `steps` greedy decode steps through the model (transformers' StaticCache) and through the merged
    decoder, fed the same tokens: [(model logits, merged logits, real query positions)] per call."""
    from transformers import StaticCache

    ids, mask, positions = padded(rows, steps)
    width = ids.shape[1]
    theirs = StaticCache(config=model.config, max_cache_len=mask.shape[1])
    ours = merged.new_cache(len(rows), mask.shape[1], ids.device)
    calls, real = [], mask[:, :width].bool()
    tokens, where = ids, torch.arange(width)
    step_mask = mask.clone()
    for t in range(steps + 1):
        kwargs = dict(attention_mask=step_mask, position_ids=positions, use_cache=True, cache_position=where)
        a = model(input_ids=tokens, past_key_values=theirs, **kwargs).logits
        b = merged(input_ids=tokens, past_key_values=ours, **kwargs).logits
        calls.append((a, b, real))
        if t == steps:
            break
        tokens = a[:, -1].argmax(-1, keepdim=True)
        where = torch.tensor([width + t])
        step_mask[:, width + t] = 1
        positions = positions[:, -1:] + 1
        real = torch.ones(len(rows), 1, dtype=torch.bool)
    return calls


def bound(model, rows) -> float:
    """1e-5, or twice the model's own fp32 rounding on these rows (its largest distance from fp64) where that is
    more: both forwards are fp32 evaluations of one function, each within about that error of the exact value."""
    exact = copy.deepcopy(model).double()
    ids, mask, positions = padded(rows, 0)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        b = exact(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    return max(LOGITS, 2 * (a[real].double() - b[real]).abs().max().item())


def largest_gap(calls) -> float:
    return max((a - b)[real].abs().max().item() for a, b, real in calls)


ROWS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19]]  # left padding of 3, 6 and 0


def test_merged_logits_equal_peft_forward_on_a_padded_batch_prefill_and_decode(policy):
    model, _ = policy
    rows = [[1, *r] for r in ROWS]
    merged, why = MergedDecoder.build(model)
    assert why == ""
    calls = forward_both(model, merged.ready(), rows, steps=6)
    assert len(calls) == 7
    assert largest_gap(calls) <= bound(model, rows)
    assert calls[0][0].abs().max() > 1  # logits of some size: the bound is not met by zeros


def test_merged_logits_equal_peft_forward_on_qwen2_with_biases_and_grouped_kv_heads():
    model = qwen2_policy()
    merged, why = MergedDecoder.build(model)
    assert why == ""
    assert merged.layers[0].qkv_bias is not None and merged.layers[0].o_bias is None  # Qwen2: q/k/v bias, o without
    calls = forward_both(model, merged.ready(), ROWS, steps=4)
    assert largest_gap(calls) <= bound(model, ROWS)


def test_the_engine_samples_the_same_tokens_merged_as_through_peft(policy):
    model, tokenizer = policy
    prompts = [render_prompt(tokenizer, e.prompt) for e in arith_examples(4, seed=2)]
    params = SamplingParams(n=4, max_tokens=24, seed=7, seeds=[11, 12, 13, 14])
    merged = HFEngine(model, tokenizer, "cpu", merged_decode="always")
    ours = [c for g in merged.generate(prompts, params) for c in g]
    theirs = [c for g in HFEngine(model, tokenizer, "cpu", merged_decode="never").generate(prompts, params) for c in g]
    assert merged.merged is not None  # it decoded merged
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert [c.finish_reason for c in ours] == [c.finish_reason for c in theirs]
    # a logprob is z_label - logsumexp(z): within twice the logits' gap. A flat 1e-5 failed at 1.0014e-5 in the
    # whole suite (one torch thread per worker, another summation order than alone)
    gap = max(abs(x - y) for a, b in zip(ours, theirs) for x, y in zip(a.logprobs, b.logprobs))
    assert gap <= 2 * bound(model, prompts)


def test_the_copy_follows_an_optimizer_step_and_disable_adapter(tiny_model):
    model, _ = load_policy(ModelConfig(name_or_path=str(tiny_model), device="cpu"), LoraConfig(r=8, alpha=16))
    perturb_lora(model, seed=8, scale=0.2)
    merged, _ = MergedDecoder.build(model)
    rows = [[1, *r] for r in ROWS]
    before = forward_both(model, merged.ready(), rows, steps=0)[0][1]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    ids, mask, _ = padded(rows, 0)
    model(input_ids=ids, attention_mask=mask).logits.square().mean().backward()
    optimizer.step()
    model.eval()
    weight = merged.layers[0].qkv
    calls = forward_both(model, merged.ready(), rows, steps=1)
    assert merged.layers[0].qkv.data_ptr() == weight.data_ptr()  # refreshed in place: a graph's address holds
    assert (calls[0][1] - before).abs().max() > 1e-3  # the step moved the logits, and the copy with them
    assert largest_gap(calls) <= bound(model, rows)
    with model.disable_adapter():
        calls = forward_both(model, merged.ready(), rows, steps=1)
    assert largest_gap(calls) <= bound(model, rows)  # the base alone, as the model computes it without its adapter


def test_a_model_it_cannot_reproduce_decodes_through_the_model_and_says_why(tiny_model):
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from trainer.model import load_tokenizer

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    assert MergedDecoder.build(gpt2) == (None, "model type 'gpt2' (merged decode reproduces llama, mistral, qwen2)")
    tokenizer = load_tokenizer(tiny_model)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    dora = get_peft_model(base, PeftLora(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"]))
    decoder, why = MergedDecoder.build(dora)
    assert decoder is None and why.startswith("a DoRA or other LoRA variant at ")
    engine = HFEngine(dora, tokenizer, "cpu", merged_decode="always")
    prompts = [render_prompt(tokenizer, e.prompt) for e in arith_examples(2, seed=1)]
    params = SamplingParams(n=2, max_tokens=8, seed=1)
    with pytest.warns(UserWarning, match="rollout.merged_decode: a DoRA or other LoRA variant at"):
        ours = engine.generate(prompts, params)
    theirs = HFEngine(dora, tokenizer, "cpu", merged_decode="never").generate(prompts, params)
    assert [[c.token_ids for c in g] for g in ours] == [[c.token_ids for c in g] for g in theirs]


def test_the_compiled_merged_step_draws_what_the_eager_loop_draws(policy):
    import torch._dynamo

    model, tokenizer = policy
    torch._dynamo.reset()
    prompts = [render_prompt(tokenizer, e.prompt) for e in arith_examples(3, seed=5)]
    params = SamplingParams(n=4, max_tokens=32, seed=9, seeds=[1, 2, 3])
    compiled = HFEngine(model, tokenizer, "cpu", compile_decode="always", merged_decode="always")
    ours = [c for g in compiled.generate(prompts, params) for c in g]
    theirs = [c for g in HFEngine(model, tokenizer, "cpu", merged_decode="always").generate(prompts, params) for c in g]
    assert compiled.merged is not None and list(compiled.decoder.caches)[0][0] == id(compiled.merged)
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert max(abs(x - y) for a, b in zip(ours, theirs) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_the_trainer_passes_rollout_merged_decode_and_auto_means_cuda_only(tiny_model, tmp_path, policy):
    from tests.conftest import tiny_spec
    from trainer.loop import GRPOTrainer

    assert TrainerConfig.model_validate(tiny_spec(tiny_model)).rollout.merged_decode == "auto"
    cfg = TrainerConfig.model_validate(tiny_spec(tiny_model, rollout={"merged_decode": "always"}))
    assert GRPOTrainer(cfg, tmp_path, progress=False).engine.merged_decode == "always"
    model, tokenizer = policy
    engine = HFEngine(model, tokenizer, "cpu", merged_decode="auto")
    engine.generate([render_prompt(tokenizer, "1+1=")], SamplingParams(n=1, max_tokens=2, seed=0))
    assert engine.merged is None and engine.merged_why == "auto decodes merged on CUDA only"


def test_merged_and_fused_the_compiled_step_reports_the_trainers_logprobs(policy):
    """The GPU's configuration (compiled decode, the draw inside the step, merged weights): the logprobs the engine
    reports are the trainer's teacher-forced ones through peft."""
    import torch._dynamo

    from trainer.logprobs import completion_logprobs

    model, tokenizer = policy
    torch._dynamo.reset()
    engine = HFEngine(model, tokenizer, "cpu", compile_decode="always", fused_sampling=True, merged_decode="always")
    prompts = [render_prompt(tokenizer, e.prompt) for e in arith_examples(3, seed=6)]
    groups = engine.generate(prompts, SamplingParams(n=4, max_tokens=24, seed=0, seeds=[4, 5, 6]))
    assert engine.merged is not None and engine.decoder.fused_fn is not None
    for prompt, group in zip(prompts, groups):
        for completion in group:
            ids = torch.tensor([prompt + completion.token_ids])
            with torch.no_grad():
                trainer_lp, _ = completion_logprobs(model, ids, torch.ones_like(ids), len(completion.token_ids))
            assert (torch.tensor(completion.logprobs) - trainer_lp[0]).abs().max() <= 1e-5
