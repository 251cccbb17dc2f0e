"""The compiled-step sampler (trainer/engines/fused.py) against the eager loop's, the reference: transformers'
logits processors in generate's order and a multinomial draw (trainer/engines/hf.py). Same processed
distribution to float32 rounding, Gumbel-max draws that follow it (chi-square), the same logprobs, and a row's
draws fixed by its prompt seed, its index and the step whatever else is in the batch."""

from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from trainer.engines.base import SamplingParams
from trainer.engines.fused import RowSampling, gumbel_noise, processed_scores, sample_rows
from trainer.engines.hf import _processors

VOCAB, EOS = 12, 3
SETTINGS = {
    "plain": SamplingParams(n=1, max_tokens=8),
    "temperature": SamplingParams(n=1, max_tokens=8, temperature=0.7),
    "top_k": SamplingParams(n=1, max_tokens=8, top_k=4, temperature=1.3),
    "top_p": SamplingParams(n=1, max_tokens=8, top_p=0.8, temperature=0.9),
    "min_p": SamplingParams(n=1, max_tokens=8, min_p=0.1),
    "repetition_penalty": SamplingParams(n=1, max_tokens=8, repetition_penalty=1.5),
    "all": SamplingParams(n=1, max_tokens=8, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.2, temperature=0.8),
    "min_tokens": SamplingParams(n=1, max_tokens=8, min_tokens=5, top_p=0.95),
}


def eager_probs(logits: torch.Tensor, sequence: torch.Tensor, params: SamplingParams, step: int) -> torch.Tensor:
    """What the eager loop draws from at this step (engines/hf.py `sample`)."""
    before, after = _processors(params, [EOS])
    scores = before(sequence, logits.clone()) if before else logits
    if step < params.min_tokens:
        scores = scores.index_fill(-1, torch.tensor([EOS]), float("-inf"))
    scores = after(sequence, scores) if after else scores
    return torch.softmax(scores, dim=-1)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of the counts under the probabilities (renormalised in float64: float32 sums are off by 1e-7)."""
    probs = probs.double() / probs.double().sum()
    return chisquare(counts.double().numpy(), (probs * counts.sum()).numpy()).pvalue


def case(seed: int = 0, rows: int = 1):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=generator) * 2
    sequence = torch.randint(0, VOCAB, (rows, 5), generator=generator)
    seen = torch.zeros(rows, VOCAB, dtype=torch.bool).scatter(1, sequence, True)
    return logits, sequence, seen


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("step", [0, 7])
def test_the_processed_distribution_is_the_eager_processors(name, step):
    params = SETTINGS[name]
    logits, sequence, seen = case(seed=step, rows=4)
    rows = RowSampling.from_params([(4, replace(params, n=4))], "cpu")
    fused = torch.softmax(processed_scores(logits, rows, seen, torch.tensor([EOS]), torch.tensor(step)), dim=-1)
    torch.testing.assert_close(fused, eager_probs(logits, sequence, params, step), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["plain", "top_p", "all"])
def test_gumbel_max_draws_follow_the_eager_distribution(name):
    """20,000 draws of one row at one set of logits, each at its own step: the counts against the eager probs."""
    params, draws = SETTINGS[name], 20_000
    logits, sequence, seen = case(seed=3)
    expected = eager_probs(logits, sequence, params, 10)[0]
    rows = RowSampling.from_params([(draws, replace(params, n=draws))], "cpu")
    # every row the same logits, its own index: 20,000 independent draws (the noise hashes the index)
    step = torch.tensor(10)
    tokens, _ = sample_rows(logits.expand(draws, -1), rows, seen.expand(draws, -1), torch.tensor([EOS]), step)
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    kept = expected > 0
    assert counts[~kept].sum() == 0  # never a token the processors remove
    assert chi_square_p(counts[kept], expected[kept]) > 1e-3


def test_draws_over_steps_follow_the_distribution():
    params, steps = SETTINGS["temperature"], 5_000
    logits, sequence, seen = case(seed=5)
    expected = eager_probs(logits, sequence, params, 0)[0].double()
    rows = RowSampling.from_params([(1, params)], "cpu")
    tokens = [sample_rows(logits, rows, seen, torch.tensor([EOS]), torch.tensor(t))[0] for t in range(steps)]
    counts = torch.bincount(torch.cat(tokens), minlength=VOCAB).double()
    assert chi_square_p(counts, expected) > 1e-3


@pytest.mark.parametrize("name", ["plain", "temperature", "repetition_penalty", "min_tokens"])
def test_without_top_k_top_p_or_min_p_the_sort_can_be_skipped(name):
    params = replace(SETTINGS[name], top_p=1.0)
    logits, _, seen = case(seed=11, rows=4)
    rows = RowSampling.from_params([(4, replace(params, n=4))], "cpu")
    eos, step = torch.tensor([EOS]), torch.tensor(1)
    full = processed_scores(logits, rows, seen, eos, step)
    torch.testing.assert_close(processed_scores(logits, rows, seen, eos, step, truncate=False), full)


def test_logprobs_are_the_policy_at_the_sampling_temperature():
    params = SETTINGS["all"]
    logits, _, seen = case(seed=7, rows=8)
    rows = RowSampling.from_params([(8, replace(params, n=8))], "cpu")
    tokens, logprobs = sample_rows(logits, rows, seen, torch.tensor([EOS]), torch.tensor(2))
    reference = torch.log_softmax(logits / params.temperature, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    assert (logprobs - reference).abs().max() <= 1e-5


def test_a_rows_draws_depend_on_its_seed_index_and_step_only():
    """Prompt seed 11's two rows draw the same tokens alone and beside another request's rows."""
    mine = SamplingParams(n=2, max_tokens=8, seeds=[11], top_p=0.9)
    other = SamplingParams(n=3, max_tokens=8, seeds=[4], temperature=0.5)
    logits, _, seen = case(seed=9, rows=5)
    eos = torch.tensor([EOS])
    for step in range(6):
        alone = RowSampling.from_params([(2, mine)], "cpu")
        together = RowSampling.from_params([(3, other), (2, mine)], "cpu")
        a, _ = sample_rows(logits[3:], alone, seen[3:], eos, torch.tensor(step))
        b, _ = sample_rows(logits, together, seen, eos, torch.tensor(step))
        assert torch.equal(a, b[3:])


def test_the_noise_is_a_pure_function_of_its_counters():
    seed, index = torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0])
    ids = torch.arange(50)
    first = gumbel_noise(seed, index, torch.tensor(3), ids)
    assert torch.equal(first, gumbel_noise(seed, index, torch.tensor(3), ids))
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])
    assert not torch.equal(first, gumbel_noise(seed, index, torch.tensor(4), ids))
