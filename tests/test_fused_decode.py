"""The HF engine with the draw inside the compiled step (HFEngine(fused_sampling=True), trainer/engines/fused.py), on
CPU, where torch.compile's inductor builds the same graph without CUDA graphs. The sampler itself is checked
against the eager processors in tests/test_fused_sampling.py; here, through the engine and the tiny model: the
logprobs it reports are the trainer's, a prompt samples the same tokens wherever it sits in the batch, and the
settings (min_tokens, repetition penalty) reach the draw. One compile for the module (~40 s on 2 cores)."""

import pytest
import torch

from tests.conftest import perturb_lora
from trainer.config import LoraConfig, ModelConfig
from trainer.data import arith_examples, render_prompt
from trainer.engines.base import SamplingParams
from trainer.engines.hf import HFEngine
from trainer.logprobs import completion_logprobs
from trainer.model import load_policy

N, TOKENS = 4, 24


@pytest.fixture(scope="module")
def fused(tiny_model):
    import torch._dynamo

    model, tokenizer = load_policy(ModelConfig(name_or_path=str(tiny_model), device="cpu"), LoraConfig(r=4, alpha=8))
    perturb_lora(model, seed=1, scale=0.02)
    torch._dynamo.reset()
    engine = HFEngine(model, tokenizer, "cpu", compile_decode="always", fused_sampling=True)
    prompts = [render_prompt(tokenizer, e.prompt) for e in arith_examples(3, seed=2)]
    params = SamplingParams(n=N, max_tokens=TOKENS, seed=0, seeds=[7, 8, 9])
    return engine, prompts, params, engine.generate(prompts, params)


def test_the_fused_engine_reports_the_trainers_logprobs(fused):
    engine, prompts, _, groups = fused
    for prompt, group in zip(prompts, groups):
        for completion in group:
            ids = torch.tensor([prompt + completion.token_ids])
            with torch.no_grad():
                trainer_lp, _ = completion_logprobs(engine.model, ids, torch.ones_like(ids), len(completion.token_ids))
            assert (torch.tensor(completion.logprobs) - trainer_lp[0]).abs().max() <= 1e-5


def test_a_prompt_samples_the_same_tokens_wherever_it_sits_in_the_batch(fused):
    engine, prompts, params, groups = fused
    again = engine.generate(prompts[::-1], SamplingParams(n=N, max_tokens=TOKENS, seed=0, seeds=[9, 8, 7]))
    assert [[c.token_ids for c in g] for g in again[::-1]] == [[c.token_ids for c in g] for g in groups]
    assert len({tuple(c.token_ids) for g in groups for c in g}) > 1  # rows of a prompt draw apart


def test_min_tokens_and_the_repetition_penalty_reach_the_compiled_draw(fused):
    engine, prompts, params, groups = fused
    eos = engine.tokenizer.eos_token_id
    distinct = {}
    for penalty in (1.0, 3.0):
        shaped = SamplingParams(
            n=N, max_tokens=TOKENS, seed=0, seeds=[7, 8, 9], min_tokens=TOKENS, repetition_penalty=penalty
        )
        completions = [c for group in engine.generate(prompts, shaped) for c in group]
        assert all(len(c.token_ids) == TOKENS and eos not in c.token_ids[:-1] for c in completions)
        distinct[penalty] = sum(len(set(c.token_ids)) for c in completions)
    assert distinct[3.0] > distinct[1.0]  # penalised rows repeat themselves less


def test_the_trainer_draws_inside_the_compiled_step_unless_told_not_to(tiny_model, tmp_path):
    from tests.conftest import tiny_spec
    from trainer.config import TrainerConfig
    from trainer.loop import GRPOTrainer

    def engine(**rollout):
        cfg = TrainerConfig.model_validate(tiny_spec(tiny_model, rollout=rollout))
        return GRPOTrainer(cfg, tmp_path / str(len(list(tmp_path.iterdir()))), progress=False).engine

    assert engine(compile_decode="always").fused_sampling  # auto: wherever the decode is compiled
    assert not engine(compile_decode="always", fused_sampling="never").fused_sampling
    assert not engine().fused_sampling  # CPU, compile_decode auto: not compiled, so not fused


def test_fused_sampling_always_without_a_compiled_decode_is_refused_naming_both_fields(tiny_model):
    from pydantic import ValidationError

    from tests.conftest import tiny_spec
    from trainer.config import TrainerConfig

    with pytest.raises(ValidationError, match="rollout.fused_sampling: always .* rollout.compile_decode is never"):
        TrainerConfig.model_validate(
            tiny_spec(tiny_model, rollout={"fused_sampling": "always", "compile_decode": "never"})
        )
