"""trainer/packing.py: the training forward over packed rows (grpo.pack_sequences) gives the padded forward's
logprobs, entropies and gradients, in fewer rows; the bins never overfill; a model that attends across packed
sequences is caught by the start-up check."""

import pytest
import torch

from tests.conftest import perturb_lora, tiny_spec
from trainer.config import LoraConfig, ModelConfig
from trainer.logprobs import check_packing, completion_logprobs
from trainer.model import load_policy
from trainer.packing import first_fit_decreasing, pack


def ragged_batch(vocab: int, prompt_lens, completion_lens, seed: int = 0):
    """Left-padded prompts + right-padded completions, as the trainer builds them (trainer/loop.py:_padded_batch)."""
    g = torch.Generator().manual_seed(seed)
    Lp, Tc = max(prompt_lens), max(completion_lens)
    ids = torch.zeros(len(prompt_lens), Lp + Tc, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, t) in enumerate(zip(prompt_lens, completion_lens)):
        ids[i, Lp - p : Lp + t] = torch.randint(0, vocab, (p + t,), generator=g)
        mask[i, Lp - p : Lp + t] = 1
    completion_mask = mask[:, Lp:].bool()
    return ids, mask, Tc, completion_mask


@pytest.fixture(scope="module")
def policy(tiny_model):
    model, _ = load_policy(ModelConfig(name_or_path=str(tiny_model), device="cpu"), LoraConfig(r=4, alpha=8))
    perturb_lora(model, seed=3)
    return model


def test_first_fit_decreasing_fills_bins_without_overfilling_them():
    lengths = [9, 3, 7, 2, 5, 1, 8]
    bins = first_fit_decreasing(lengths, capacity=10)
    assert sorted(r for b in bins for r in b) == list(range(len(lengths)))  # every row once
    assert all(sum(lengths[r] for r in b) <= 10 for b in bins)
    assert len(bins) == 4  # 35 tokens need at least 4 bins of 10
    with pytest.raises(ValueError, match="more than a bin"):
        first_fit_decreasing([11], capacity=10)


def test_packing_lays_each_row_end_to_end_with_positions_restarting(policy):
    ids, mask, Tc, _ = ragged_batch(50, [2, 6, 2, 3], [2, 1, 6, 2])  # 4, 7, 8, 5 real tokens in rows of 12
    plan = pack(ids, mask, Tc)
    assert plan.input_ids.shape == (2, 12)  # two full bins instead of four padded rows
    for b in range(ids.shape[0]):
        real = ids[b][mask[b].bool()]
        (k,) = {int(plan.bin_of[b, j]) for j in range(Tc) if plan.real[b, j]}
        row = plan.input_ids[k].tolist()
        start = next(i for i in range(len(row)) if row[i : i + len(real)] == real.tolist())
        assert plan.position_ids[k, start : start + len(real)].tolist() == list(range(len(real)))
    assert plan.real.equal(mask[:, -Tc:].bool())


@pytest.mark.parametrize("with_entropy", [False, True])
def test_packed_logprobs_entropies_and_gradients_equal_the_padded_ones(policy, with_entropy):
    vocab = policy.config.vocab_size
    ids, mask, Tc, completion_mask = ragged_batch(vocab, [7, 12, 4, 9, 5, 11], [10, 3, 14, 1, 8, 6], seed=1)
    results = {}
    for packed in (False, True):
        policy.zero_grad()
        lp, ent = completion_logprobs(policy, ids, mask, Tc, temperature=0.7, with_entropy=with_entropy, packed=packed)
        loss = (lp * completion_mask).sum() + (0 if ent is None else (ent * completion_mask).sum())
        loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results[packed] = (lp[completion_mask], None if ent is None else ent[completion_mask], grads)
    (lp0, ent0, g0), (lp1, ent1, g1) = results[False], results[True]
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
    if with_entropy:
        torch.testing.assert_close(ent1, ent0, rtol=0, atol=1e-5)
    assert g0.keys() == g1.keys() and g0
    for name in g0:  # equal to fp32 rounding: the sums run in another order
        assert float((g1[name] - g0[name]).norm()) <= 1e-4 * float(g0[name].norm()) + 1e-8, name


def test_the_start_up_check_passes_a_model_that_respects_packing_and_catches_one_that_does_not(policy):
    assert check_packing(policy, policy.config.vocab_size, torch.device("cpu")) < 1e-5
    with_dropout, _ = load_policy(
        ModelConfig(name_or_path=str(policy.get_base_model().name_or_path), device="cpu"),
        LoraConfig(r=4, alpha=8, dropout=0.5),
    )
    perturb_lora(with_dropout, seed=4)
    assert with_dropout.training
    assert check_packing(with_dropout, with_dropout.config.vocab_size, torch.device("cpu")) < 1e-5  # dropout off
    assert with_dropout.training  # and back on
    leaky, _ = load_policy(
        ModelConfig(name_or_path=str(policy.get_base_model().name_or_path), device="cpu"), LoraConfig(enabled=False)
    )
    import transformers.masking_utils as masking_utils

    real = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None  # attention crosses the packed rows
    try:
        assert check_packing(leaky, leaky.config.vocab_size, torch.device("cpu")) > 1e-3
    finally:
        masking_utils.find_packed_sequence_indices = real


def test_a_packed_run_trains_as_the_padded_one(tiny_model, tmp_path):
    """Three steps with the reference forward, two micro-batches and two passes per batch: the same rollouts, the
    same losses, KL and gradient norms to rounding, and the same adapter after."""
    from safetensors.torch import load_file

    from trainer.config import TrainerConfig
    from trainer.loop import GRPOTrainer

    histories, adapters = {}, {}
    for packed in (False, True):
        spec = tiny_spec(
            tiny_model,
            grpo={
                "num_generations": 4,
                "prompts_per_step": 2,
                "beta": 0.04,
                "num_iterations": 2,
                "pack_sequences": packed,
            },
            optim={"steps": 3, "learning_rate": 3e-3, "gradient_accumulation_steps": 2},
            checkpoint={"every": 3},
        )
        result = GRPOTrainer(TrainerConfig.model_validate(spec), tmp_path / str(packed), progress=False).train(3)
        histories[packed] = result.history
        adapters[packed] = load_file(str(result.last_checkpoint / "adapter" / "adapter_model.safetensors"))
    for padded, packed in zip(histories[False], histories[True]):
        assert packed["completions/mean_length"] == padded["completions/mean_length"]  # the same rollouts
        assert packed["reward"] == padded["reward"]
        for key in ("loss", "kl", "grad_norm", "policy_ratio/mean"):
            assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    for name, weight in adapters[False].items():  # Adam divides by sqrt(v): an entry whose gradient is ~0 moves apart
        assert float((adapters[True][name] - weight).norm()) <= 1e-4 * float(weight.norm()), name


def test_pack_sequences_is_refused_for_a_model_that_attends_across_sequences(tiny_model, tmp_path):
    import transformers.masking_utils as masking_utils

    from trainer.config import InputError, TrainerConfig
    from trainer.loop import GRPOTrainer

    cfg = TrainerConfig.model_validate(tiny_spec(tiny_model, grpo={"pack_sequences": True}))
    real = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        with pytest.raises(InputError, match=r"grpo.pack_sequences: LlamaForCausalLM does not keep packed sequences"):
            GRPOTrainer(cfg, tmp_path / "run", progress=False)
    finally:
        masking_utils.find_packed_sequence_indices = real
