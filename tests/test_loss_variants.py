"""The loss variants by name (grpo.loss_type cispo, sapo, gmpo; trainer/loss.py): each equals a direct transcription
of its paper's formula in float64 (loss and gradient, to float64 rounding), equals TRL's implementation on the same
inputs (trl.GRPOTrainer's cispo and sapo, trl.experimental.gmpo.GMPOTrainer), and refuses the fields it would
silently ignore. That a real step gives the same gradients whatever optim.gradient_accumulation_steps is, for these
as for every loss type, is in tests/test_grad_accumulation.py."""

import math
import typing

import pytest
import torch

from tasks.spec import SpecError, validate_spec
from trainer.config import GRPOConfig
from trainer.loss import POLICY_LOSSES, grpo_loss
from trainer.metrics import update_metrics

F64 = {"rtol": 1e-12, "atol": 1e-14}  # float64 rounding, over sums of a few dozen terms


def test_every_loss_type_the_config_accepts_is_a_registered_loss_and_no_other():
    assert set(POLICY_LOSSES) == set(typing.get_args(GRPOConfig.model_fields["loss_type"].annotation))


# ---------------------------------------------------------------------------------------------------
# One float64 batch: B = 4 sequences of 5, 3, 4 and 2 real tokens, advantages of both signs, log-ratios spread over
# [-0.9, 0.9] so that every clip boundary below is crossed both ways.
LENGTHS = (5, 3, 4, 2)
ADV = [1.3, -0.7, 0.4, -1.6]


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.1
    log_ratio = (torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1) * 0.9
    log_ratio[0, 1], log_ratio[1, 0], log_ratio[3, 1] = 0.85, -0.8, -0.6  # past every clip bound, both signs of A
    ref = old - torch.rand(B, T, generator=g, dtype=torch.float64) * 0.5
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    return old + log_ratio, old, torch.tensor(ADV, dtype=torch.float64), mask, ref


def ballast(cfg: GRPOConfig, with_ref: bool = False, seed: int = 0):
    """Loss, gradient w.r.t. the logprobs, and the update metrics of trainer/loss.py on batch(seed)."""
    lp, old, adv, mask, ref = batch(seed)
    lp = lp.clone().requires_grad_()
    loss, terms = grpo_loss(lp, old, adv, mask, cfg, ref_logprobs=ref if with_ref else None)
    loss.backward()
    return loss.detach(), lp.grad, update_metrics(terms, mask, cfg.importance_sampling_level)


def transcribed(objective, seed: int = 0):
    """-J and dJ/dlogprobs for J written term by term, as the paper prints it: objective(lp, old, A, lengths)."""
    lp, old, adv, _, _ = batch(seed)
    lp = lp.clone().requires_grad_()
    loss = -objective(lp, old, adv.tolist())
    loss.backward()
    return loss.detach(), lp.grad


# ---------------------------------------------------------------------------------------------------
# CISPO (MiniMax-M1): J = 1 / sum_i |o_i| * sum_i sum_t sg(clip(r_it, 1 - eps_low, 1 + eps_high)) A_i log pi(o_it),
# with no lower bound (eps_low large, as the paper sets it): sg(min(r, cap)).


def cispo_objective(cap):
    def J(lp, old, adv):
        total, count = 0.0, 0
        for i, n in enumerate(LENGTHS):
            for t in range(n):
                r = torch.exp(lp[i, t] - old[i, t]).detach()
                total = total + min(r.item(), cap) * adv[i] * lp[i, t]  # .item(): the stop-gradient
                count += 1
        return total / count

    return J


@pytest.mark.parametrize("cap", [5.0, 1.5, 1.0])
def test_cispo_is_reinforce_weighted_by_the_capped_stop_gradient_ratio(cap):
    loss, grad, stats = ballast(GRPOConfig(loss_type="cispo", beta=0.0, cispo_max_ratio=cap))
    want_loss, want_grad = transcribed(cispo_objective(cap))
    torch.testing.assert_close(loss, want_loss, **F64)
    torch.testing.assert_close(grad, want_grad, **F64)
    # in closed form: every real token's gradient is -min(r, cap) * A / N, capped ones included (not dropped, as
    # PPO's clip would), padding none
    lp, old, adv, mask, _ = batch()
    r = torch.exp(lp - old)
    torch.testing.assert_close(grad, -torch.clamp(r, max=cap) * adv[:, None] * mask / mask.sum(), **F64)
    capped = (r > cap) & (adv[:, None] > 0) & mask.bool()
    assert stats["clip_ratio/high_mean"] == pytest.approx(float(capped.sum() / mask.sum()))
    assert stats["clip_ratio/low_mean"] == 0.0
    if cap == 1.5:  # the cap bites on this batch, with a gradient still flowing through those tokens
        assert capped.any() and (grad[capped] != 0).all()


# ---------------------------------------------------------------------------------------------------
# SAPO: J = 1/G sum_i 1/|o_i| sum_t f(r_it) A_i, f(x) = sigmoid(tau (x - 1)) * 4 / tau, tau by the sign of A_i.


def sapo_objective(tau_pos, tau_neg):
    def J(lp, old, adv):
        total = 0.0
        for i, n in enumerate(LENGTHS):
            tau = tau_pos if adv[i] > 0 else tau_neg
            seq = 0.0
            for t in range(n):
                r = torch.exp(lp[i, t] - old[i, t])
                seq = seq + 1 / (1 + torch.exp(-tau * (r - 1))) * 4 / tau * adv[i]
            total = total + seq / n
        return total / len(LENGTHS)

    return J


@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_is_a_soft_sigmoid_gate_with_a_temperature_per_advantage_sign(tau_pos, tau_neg):
    cfg = GRPOConfig(loss_type="sapo", beta=0.0, sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg)
    loss, grad, stats = ballast(cfg)
    want_loss, want_grad = transcribed(sapo_objective(tau_pos, tau_neg))
    torch.testing.assert_close(loss, want_loss, **F64)
    torch.testing.assert_close(grad, want_grad, **F64)
    # in closed form: the policy gradient weighted by 4 s (1 - s) r, s = sigmoid(tau (r - 1)); no hard clip
    lp, old, adv, mask, _ = batch()
    r = torch.exp(lp - old)
    tau = torch.tensor([tau_pos if a > 0 else tau_neg for a in ADV], dtype=torch.float64)[:, None]
    s = torch.sigmoid(tau * (r - 1))
    want = -4 * s * (1 - s) * r * adv[:, None] * mask / mask.sum(dim=1, keepdim=True) / len(LENGTHS)
    torch.testing.assert_close(grad, want, **F64)
    assert stats["clip_ratio/region_mean"] == 0.0


def test_sapo_on_policy_is_exactly_the_policy_gradient():
    """At r = 1 the gate's weight 4 s (1 - s) is 1, whatever tau: SAPO starts each batch as plain GRPO would."""
    lp, _, adv, mask, _ = batch()
    grads = {}
    for cfg in (
        GRPOConfig(loss_type="grpo", beta=0.0),
        GRPOConfig(loss_type="sapo", beta=0.0, sapo_temperature_neg=7.0),
    ):
        x = lp.clone().requires_grad_()
        grpo_loss(x, lp, adv, mask, cfg)[0].backward()
        grads[cfg.loss_type] = x.grad
    torch.testing.assert_close(grads["sapo"], grads["grpo"], **F64)


# ---------------------------------------------------------------------------------------------------
# GMPO: J = 1/G sum_i (prod_t |min(r_it A_i, clip(r_it, e^-eps, e^eps_high) A_i)|)^(1/|o_i|) sgn(A_i), written with
# the product and the clip in ratio space, as the paper prints it (the implementation works in log space).


def gmpo_objective(eps, eps_high):
    def J(lp, old, adv):
        total = 0.0
        for i, n in enumerate(LENGTHS):
            product = 1.0
            for t in range(n):
                r = torch.exp(lp[i, t] - old[i, t])
                product = product * torch.abs(
                    torch.minimum(r * adv[i], torch.clamp(r, math.exp(-eps), math.exp(eps_high)) * adv[i])
                )
            total = total + product ** (1 / n) * math.copysign(1.0, adv[i])
        return total / len(LENGTHS)

    return J


@pytest.mark.parametrize("eps, eps_high", [(0.4, None), (0.2, 0.5)])
def test_gmpo_is_the_geometric_mean_of_the_clipped_token_terms(eps, eps_high):
    cfg = GRPOConfig(loss_type="gmpo", beta=0.0, gmpo_epsilon=eps, gmpo_epsilon_high=eps_high)
    loss, grad, stats = ballast(cfg)
    want_loss, want_grad = transcribed(gmpo_objective(eps, eps_high or eps))
    torch.testing.assert_close(loss, want_loss, **F64)
    torch.testing.assert_close(grad, want_grad, **F64)
    lp, old, adv, mask, _ = batch()
    log_r = lp - old
    high = (log_r > (eps_high or eps)) & (adv[:, None] > 0) & mask.bool()
    low = (log_r < -eps) & (adv[:, None] < 0) & mask.bool()
    assert high.any() and low.any()  # both bounds bite on this batch, and those tokens get no gradient
    assert (grad[high | low] == 0).all()
    assert stats["clip_ratio/high_mean"] == pytest.approx(float(high.sum() / mask.sum()))
    assert stats["clip_ratio/low_mean"] == pytest.approx(float(low.sum() / mask.sum()))


def test_gmpo_takes_the_rollout_correction_into_its_geometric_mean_and_drops_masked_tokens():
    """Token weights w multiply each token's ratio inside the geometric mean; a weight of 0 (mis) drops the token
    from it, so the sequence is the geometric mean of its other tokens."""
    lp, old, adv, mask, _ = batch()
    cfg = GRPOConfig(loss_type="gmpo", beta=0.0)
    w = torch.full_like(lp, 0.5)
    w[0, 1] = 0.0
    plain, _ = grpo_loss(lp, old, adv, mask, cfg)
    weighted, _ = grpo_loss(lp, old, adv, mask, cfg, correction=w)
    without = mask.clone()
    without[0, 1] = 0
    row0 = lambda m: grpo_loss(lp[:1], old[:1], adv[:1], m[:1], cfg)[0]  # noqa: E731 (one-row GMPO term)
    G = len(LENGTHS)
    # rows 1-3: every factor halved, so their terms halve; row 0: the geometric mean of its tokens but token 1, halved
    want = (plain * G - row0(mask)) / 2 + row0(without) / 2
    torch.testing.assert_close(weighted * G, want, **F64)


# ---------------------------------------------------------------------------------------------------
# Against TRL: its own _compute_loss on the same tensors (the model's forward replaced by these logprobs).


def trl_loss(trainer_cls, loss_type: str, beta: float, tmp_path, **args):
    """TRL's loss and gradient on batch(); TRL's aggregation averages over every row, so each row here has tokens."""
    from accelerate import Accelerator
    from trl import GRPOConfig as TRLConfig

    lp, old, adv, mask, ref = batch()
    lp = lp.clone().requires_grad_()
    config_cls = TRLConfig
    if trainer_cls.__name__ == "GMPOTrainer":
        from trl.experimental.gmpo import GMPOConfig as config_cls
    # use_bias_correction_kl (TRL 1.x's default: the KL term times the ratio, DeepSeek-V3.2) is a KL variant Ballast
    # does not have; off, TRL's KL is the plain k3 that Ballast's kl_estimator k3 puts in every loss type
    cfg = config_cls(
        output_dir=str(tmp_path),
        loss_type=loss_type,
        beta=beta,
        use_bias_correction_kl=False,
        report_to=[],
        use_cpu=True,
        **args,
    )

    class Fixed(trainer_cls):
        def __init__(self):  # the attributes trl's __init__ sets from cfg that _compute_loss reads
            from collections import defaultdict

            self.args, self.model, self.accelerator = cfg, torch.nn.Module(), Accelerator(cpu=True)
            self.loss_type, self.beta, self.importance_sampling_level = cfg.loss_type, cfg.beta, "token"
            self.epsilon_low = cfg.epsilon
            self.epsilon_high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
            self.top_entropy_quantile, self.off_policy_mask_threshold = cfg.top_entropy_quantile, None
            self.use_vllm, self.vllm_importance_sampling_correction = False, False
            self._entropy_bonus_enabled, self.aux_loss_enabled = False, False
            self.current_gradient_accumulation_steps, self.max_completion_length = 1, cfg.max_completion_length
            self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            return lp, torch.zeros_like(lp), None

    B = lp.shape[0]
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros_like(mask, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
    }
    if beta:
        inputs["ref_per_token_logps"] = ref
    loss = Fixed()._compute_loss(None, inputs)
    loss.backward()
    return loss.detach(), lp.grad


# TRL builds SAPO's tau with torch.where(A > 0, tau_pos, tau_neg) from two Python floats, a float32 tensor: with
# tau_neg = 1.05 (not a float32 number) its loss differs from the float64 one by ~1e-7 relative; with temperatures
# that float32 holds exactly the two agree to float64 rounding.
TRL_SAPO_DEFAULTS = {"rtol": 2e-7, "atol": 1e-9}


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize(
    "loss_type, ours, theirs, tol",
    [
        ("cispo", {"cispo_max_ratio": 1.5}, {"epsilon_high": 1.5}, F64),
        ("cispo", {"cispo_max_ratio": 5.0}, {"epsilon_high": 5.0}, F64),
        ("sapo", {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}, None, TRL_SAPO_DEFAULTS),
        ("sapo", {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 3.0}, None, F64),
    ],
)
def test_cispo_and_sapo_equal_trls_grpo_trainer_loss_and_gradient(tmp_path, loss_type, ours, theirs, tol, beta):
    from trl import GRPOTrainer

    theirs = ours if theirs is None else theirs  # TRL's sapo fields have Ballast's names
    loss, grad, _ = ballast(GRPOConfig(loss_type=loss_type, beta=beta, kl_estimator="k3", **ours), with_ref=beta > 0)
    want_loss, want_grad = trl_loss(GRPOTrainer, loss_type, beta, tmp_path, **theirs)
    torch.testing.assert_close(loss, want_loss, **tol)
    torch.testing.assert_close(grad, want_grad, **tol)


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("eps, eps_high", [(0.4, None), (0.2, 0.5)])
def test_gmpo_equals_trls_gmpo_trainer_loss_and_gradient(tmp_path, eps, eps_high, beta):
    from trl.experimental.gmpo import GMPOTrainer

    cfg = GRPOConfig(loss_type="gmpo", beta=beta, gmpo_epsilon=eps, gmpo_epsilon_high=eps_high)
    loss, grad, _ = ballast(cfg, with_ref=beta > 0)
    want_loss, want_grad = trl_loss(GMPOTrainer, "grpo", beta, tmp_path, epsilon=eps, epsilon_high=eps_high)
    torch.testing.assert_close(loss, want_loss, **F64)
    torch.testing.assert_close(grad, want_grad, **F64)


# ---------------------------------------------------------------------------------------------------
# The spec refuses what would silently do nothing, with one line naming the field and the fix.


def spec(**grpo) -> dict:
    return {"model": {"name_or_path": "unused"}, "grpo": grpo}


@pytest.mark.parametrize(
    "grpo, message",
    [
        (
            {"loss_type": "cispo", "epsilon_high": 5.0},
            "spec: grpo.epsilon_high=5 does nothing with grpo.loss_type: cispo (grpo.cispo_max_ratio caps its IS "
            "weight); remove it",
        ),
        (
            {"loss_type": "sapo", "epsilon": 0.3},
            "spec: grpo.epsilon=0.3 does nothing with grpo.loss_type: sapo (grpo.sapo_temperature_pos / _neg shape "
            "its soft gate); remove it",
        ),
        (
            {"loss_type": "dapo", "gmpo_epsilon": 0.3},
            "spec: grpo.gmpo_epsilon=0.3 does nothing with grpo.loss_type: dapo (it acts only with grpo.loss_type: "
            "gmpo); remove it",
        ),
        (
            {"loss_type": "gmpo", "importance_sampling_level": "sequence"},
            "spec: grpo.importance_sampling_level: sequence with grpo.loss_type: gmpo: GMPO already takes one ratio "
            "per sequence, the geometric mean of its clipped token ratios; set grpo.importance_sampling_level: token",
        ),
        (
            {"loss_type": "cispo", "importance_sampling_level": "sequence"},
            "spec: grpo.importance_sampling_level: sequence with grpo.loss_type: cispo weights each sequence by its "
            "length (cispo sums the tokens that share the sequence's ratio); set grpo.loss_type: grpo (GSPO's setup) "
            "or grpo.importance_sampling_level: token",
        ),
    ],
)
def test_a_field_the_loss_type_ignores_is_refused_in_one_line(grpo, message):
    with pytest.raises(SpecError) as e:
        validate_spec(spec(**grpo))
    assert str(e.value) == message


@pytest.mark.parametrize(
    "field, value, bound",
    [
        ("cispo_max_ratio", 0.5, "greater than or equal to 1"),
        ("sapo_temperature_neg", 0.0, "greater than 0"),
        ("gmpo_epsilon", -0.4, "greater than 0"),
    ],
)
def test_nonsense_variant_values_are_refused_naming_the_field(field, value, bound):
    loss_type = field.split("_")[0]
    with pytest.raises(SpecError) as e:
        validate_spec(spec(loss_type=loss_type, **{field: value}))
    assert str(e.value) == f"spec: field 'grpo.{field}': Input should be {bound} (got {value})"


def test_sequence_level_sapo_is_accepted_and_a_dumped_variant_config_reads_back():
    assert validate_spec(spec(loss_type="sapo", importance_sampling_level="sequence")).grpo.loss_type == "sapo"
    cfg = GRPOConfig(loss_type="cispo", cispo_max_ratio=4.0)
    assert GRPOConfig.model_validate(cfg.model_dump()) == cfg
