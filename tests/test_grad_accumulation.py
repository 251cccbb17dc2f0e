"""A real GRPOTrainer step on the tiny model gives the same gradients and the same logged loss whether its batch
is one micro-batch or split into 2 or 4 (optim.gradient_accumulation_steps), for every loss_type, with truncated
completions masked and a zero-std group dropped. Two optimizer passes (num_iterations: 2), so pi_old kept from the
first pass is checked too. The split-invariance of the loss function itself is in tests/test_loss.py."""

import pytest
import torch

from tests.conftest import tiny_spec
from trainer.config import TrainerConfig
from trainer.loop import GRPOTrainer

SPLITS = (1, 2, 4)


def one_step(tiny_model, out, loss_type: str, parts: int, seed: int = 0) -> tuple[list[list[torch.Tensor]], dict]:
    """Gradients at each optimizer step of step 1 (read by a pre-step hook), and the step's metrics. At
    max_tokens 20 some completions are truncated (masked) and the exact-answer reward leaves a group all equal
    (dropped); rollouts are seeded by step, so every split trains on the same completions."""
    spec = tiny_spec(
        tiny_model,
        rewards=[{"name": "exact_answer"}],
        grpo={
            "num_generations": 4,
            "prompts_per_step": 4,
            "beta": 0.04,
            "loss_type": loss_type,
            "num_iterations": 2,
            "mask_truncated_completions": True,
            "drop_zero_std_groups": True,
        },
        rollout={"max_tokens": 20, "seed": seed},
        optim={"steps": 1, "gradient_accumulation_steps": parts, "learning_rate": 1e-3},
    )
    trainer = GRPOTrainer(TrainerConfig.model_validate(spec), out, progress=False)
    grads: list[list[torch.Tensor]] = []
    trainer.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: grads.append([p.grad.detach().clone() for p in trainer.params])
    )
    metrics = trainer.train_step(1)
    trainer.close()
    return grads, metrics


def has_both_masks(m: dict) -> bool:
    """The batch really has rows out of the loss of both kinds (truncated, zero-std group), and rows in it."""
    return (
        m["completions/clipped_ratio"] > 0
        and m["advantages/frac_zero_std_groups"] > 0
        and m["advantages/frac_masked"] < 1
    )


@pytest.fixture(scope="module")
def seed(tiny_model, tmp_path_factory) -> int:
    """The first rollout seed whose step-1 batch has both kinds of masked rows. Found, not fixed: the tiny model is
    built on the machine that runs the tests, and what it samples differs with the CPU's kernels (a seed that gave
    such a batch on one machine gave no zero-std group on another)."""
    for candidate in range(32):
        _, metrics = one_step(tiny_model, tmp_path_factory.mktemp(f"seed-{candidate}"), "grpo", 1, candidate)
        if has_both_masks(metrics):
            return candidate
    pytest.fail("no rollout seed in 0..31 samples a batch with a truncated completion and a zero-std group")


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo", "sapo", "gmpo"])
def test_gradient_and_logged_loss_do_not_depend_on_gradient_accumulation_steps(tiny_model, tmp_path, loss_type, seed):
    runs = {parts: one_step(tiny_model, tmp_path / str(parts), loss_type, parts, seed) for parts in SPLITS}
    whole_grads, whole = runs[1]
    # the batch really has rows out of the loss of both kinds, and rows in it
    assert whole["completions/clipped_ratio"] > 0 and whole["advantages/frac_zero_std_groups"] > 0
    assert 0 < whole["advantages/frac_masked"] < 1
    assert len(whole_grads) == 2 and any(g.abs().sum() > 0 for update in whole_grads for g in update)
    for parts in SPLITS[1:]:
        grads, metrics = runs[parts]
        for update in range(2):
            for got, want in zip(grads[update], whole_grads[update]):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
        assert metrics["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
        assert metrics["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
        assert metrics["policy_ratio/mean"] == pytest.approx(whole["policy_ratio/mean"], rel=1e-6)
        assert metrics["entropy"] == pytest.approx(whole["entropy"], rel=1e-6)
