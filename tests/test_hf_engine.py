"""The HF engine's compiled decode step (rollout.compile_decode), on CPU: torch.compile's inductor builds the
same one-token step there (without CUDA graphs), so what this file shows — same tokens as the eager loop, one
compile reused across calls with other prompt widths, compiled only where asked — is the CPU half of what
bench/gpu_step.py checks on a GPU. Each compile takes ~40 s on 2 cores, so the module compiles once.
"""

import pytest
import torch

from tests.conftest import perturb_lora
from trainer.config import LoraConfig, ModelConfig, TrainerConfig
from trainer.data import arith_examples, render_prompt
from trainer.engines.base import SamplingParams
from trainer.engines.hf import CACHE_LEN_BUCKET, HFEngine
from trainer.model import load_policy


@pytest.fixture(scope="module")
def policy(tiny_model):
    """The tiny model with a LoRA adapter whose weights differ from zero, as after some training."""
    model, tokenizer = load_policy(ModelConfig(name_or_path=str(tiny_model), device="cpu"), LoraConfig(r=4, alpha=8))
    perturb_lora(model, seed=1, scale=0.02)
    return model, tokenizer


@pytest.fixture(scope="module")
def compiled(policy):
    """A compiled engine and the number of graphs dynamo compiled for it over two calls whose prompts have
    different widths within one cache-length bucket (the second call's prompts end with " ok")."""
    import torch._dynamo

    model, tokenizer = policy
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # count this engine's graphs alone, whatever compiled before in the process
    engine = HFEngine(model, tokenizer, "cpu", compile_decode="always")
    calls = []
    for n, seed, suffix in ((4, 3, ""), (4, 4, " ok")):  # same rows, as every step of a run
        prompts = [render_prompt(tokenizer, e.prompt + suffix) for e in arith_examples(n, seed=seed)]
        params = SamplingParams(n=4, max_tokens=40, seed=seed)
        calls.append((prompts, params, engine.generate(prompts, params)))
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return engine, calls, frames


def test_compiled_decode_draws_the_same_tokens_as_the_eager_loop(policy, compiled):
    model, tokenizer = policy
    eager = HFEngine(model, tokenizer, "cpu", compile_decode="never")
    _, calls, _ = compiled
    for prompts, params, groups in calls:
        ours = [c for g in groups for c in g]
        theirs = [c for g in eager.generate(prompts, params) for c in g]
        assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
        assert [c.finish_reason for c in ours] == [c.finish_reason for c in theirs]
        assert max(abs(x - y) for a, b in zip(ours, theirs) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_one_compiled_graph_serves_calls_with_other_prompt_widths(compiled):
    engine, calls, frames = compiled
    widths = {max(map(len, prompts)) for prompts, _, _ in calls}
    assert len(widths) == 2  # the two calls really had different prompt widths
    assert frames == 1  # and compiled once: the cache length is bucketed
    (cache_len,) = {length for length, _ in engine.decoder.caches.values()}
    assert cache_len % CACHE_LEN_BUCKET == 0 and cache_len >= max(widths) + 40


def test_the_decoder_keeps_one_cache_per_row_count_grown_to_its_longest_call_and_two_row_counts_at_most(policy):
    """A run whose prompt widths vary used to keep a cache, and a graph, per width bucket for the rest of the run."""
    from trainer.engines.hf import MAX_KEPT_CACHES, CompiledDecoder

    model, _ = policy
    decoder, cpu = CompiledDecoder(), torch.device("cpu")
    first, length = decoder.cache(model, 8, 70, cpu)
    assert length == 2 * CACHE_LEN_BUCKET
    assert decoder.cache(model, 8, 30, cpu) == (first, length)  # shorter: the same cache, at the same address
    grown, longer = decoder.cache(model, 8, 200, cpu)
    assert grown is not first and longer == 4 * CACHE_LEN_BUCKET and len(decoder.caches) == 1  # replaced, not added
    assert decoder.cache(model, 8, 70, cpu) == (grown, longer)  # and it serves the short calls from then on
    for rows in (16, 4):
        decoder.cache(model, rows, 70, cpu)
    assert len(decoder.caches) == MAX_KEPT_CACHES == 2
    assert {rows for _, rows, _ in decoder.caches} == {16, 4}  # the least recently used (8 rows) went first


def test_a_call_decoding_over_a_cache_grown_by_a_longer_one_draws_what_the_eager_loop_draws(policy):
    """The decode step compiled, a wide call first: the narrow call after it runs over the wide call's cache (its
    mask hiding the positions it does not reach) and draws the eager loop's tokens and logprobs."""
    model, tokenizer = policy
    compiled = HFEngine(model, tokenizer, "cpu", compile_decode="always")
    eager = HFEngine(model, tokenizer, "cpu", compile_decode="never")
    examples = arith_examples(4, seed=5)
    params = SamplingParams(n=4, max_tokens=12, seed=3)  # 16 rows, as the fixture's calls: no other row count
    compiled.generate([render_prompt(tokenizer, e.prompt * 40) for e in examples], params)  # a wider bucket
    ((length, _),) = compiled.decoder.caches.values()
    narrow = [render_prompt(tokenizer, e.prompt) for e in examples]
    width = max(map(len, narrow))
    assert length > compiled.decoder.cache_len(width + params.max_tokens)  # really a longer cache than it needs
    ours = [c for g in compiled.generate(narrow, params) for c in g]
    theirs = [c for g in eager.generate(narrow, params) for c in g]
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert max(abs(x - y) for a, b in zip(ours, theirs) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert len(compiled.decoder.caches) == 1


def test_compile_decode_auto_compiles_on_cuda_only(policy):
    model, tokenizer = policy
    assert HFEngine(model, tokenizer, "cpu", compile_decode="auto").decoder is None
    assert HFEngine(model, tokenizer, "cpu", compile_decode="always").decoder is not None
    assert HFEngine(model, tokenizer, "cuda", compile_decode="auto").decoder is not None  # built lazily: no GPU needed


def test_the_trainer_passes_rollout_compile_decode_to_its_engine(tiny_model, tmp_path):
    from tests.conftest import tiny_spec
    from trainer.loop import GRPOTrainer

    cfg = TrainerConfig.model_validate(tiny_spec(tiny_model, rollout={"compile_decode": "always"}))
    assert GRPOTrainer(cfg, tmp_path, progress=False).engine.decoder is not None


def test_in_bf16_with_a_float32_adapter_the_compiled_engine_samples_what_the_trainer_scores(tiny_model):
    """model.dtype bfloat16 keeps the adapter in float32 and runs the decoder under autocast (trainer/model.py):
    the compiled step traces through it, and the engine's logprobs are the trainer's to bf16 precision."""
    from trainer.logprobs import completion_logprobs

    model, tokenizer = load_policy(
        ModelConfig(name_or_path=str(tiny_model), device="cpu", dtype="bfloat16"), LoraConfig(r=4, alpha=8)
    )
    perturb_lora(model, seed=1, scale=0.02)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    torch._dynamo.reset()
    prompt = render_prompt(tokenizer, arith_examples(1, seed=5)[0].prompt)
    (group,) = HFEngine(model, tokenizer, "cpu", compile_decode="always").generate(
        [prompt], SamplingParams(n=4, max_tokens=16, seed=5, min_tokens=16)
    )
    for completion in group:
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            trainer_lp, _ = completion_logprobs(model, ids, torch.ones_like(ids), len(completion.token_ids))
        torch.testing.assert_close(torch.tensor(completion.logprobs), trainer_lp[0], rtol=0, atol=0.05)
