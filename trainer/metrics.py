"""Every metric a step reports: its name, what it means, and how it is computed from the step's tensors.
The table is the documentation (`ballast metrics` prints it); tests/test_metrics_names.py checks that a real
step reports exactly these names.

Names follow TRL's GRPOTrainer where TRL has one, with TRL's meaning, so dashboards read the same. A step
is one batch of rollouts (prompts_per_step × num_generations completions) and the num_iterations optimizer
updates made on it; values the updates produce are computed over the whole batch for each update and
averaged over the updates. "Loss tokens" are the completion tokens that count in the loss (truncated
completions with mask_truncated_completions and dropped zero-std groups left out); a mean over none is NaN.
The functions below take whole-batch tensors, never one micro-batch's, so no value depends on
optim.gradient_accumulation_steps. They only call methods of the tensors they are given: importing this
file does not import torch, so `ballast metrics` and sweep-file checks stay fast.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from trainer.config import RolloutCorrectionConfig
    from trainer.distributed import World
    from trainer.loss import Correction, LossTerms

METRICS: dict[str, str] = {
    "step": "Step number, counting from 1; a resumed run continues the count.",
    "num_tokens": "Prompt and completion tokens of all steps so far (TRL's), cumulative over a resumed run.",
    "reward": "Mean total (weighted) reward of the step's completions.",
    "reward_std": "Standard deviation (unbiased) of the total reward over all the step's completions (TRL's).",
    "rewards/<fn>/mean": "Mean of one reward function's (unweighted) score.",
    "rewards/<fn>/std": "Standard deviation (unbiased) of one reward function's score over the step's completions.",
    "frac_reward_zero_std": "Share of completions whose advantage was scaled by a zero reward std (TRL's): with "
    "scale_rewards group or none, those in groups whose rewards are all equal; with batch, "
    "1 when all the step's rewards are equal, else 0.",
    "completions/mean_length": "Mean completion length in tokens.",
    "completions/min_length": "Shortest completion, tokens.",
    "completions/max_length": "Longest completion, tokens.",
    "completions/clipped_ratio": "Share of completions that hit rollout.max_tokens (truncated).",
    "completions/mean_terminated_length": "Mean length of completions that ended with an end token or stop string "
    "(0 when none did).",
    "completions/min_terminated_length": "Shortest of those (0 when none).",
    "completions/max_terminated_length": "Longest of those (0 when none).",
    "kl": "Mean per-token KL(policy || reference) over loss tokens, k3 estimator (as TRL's 'kl'); absent when "
    "beta = 0 (no reference model).",
    "kl/k1": "Mean of log pi - log pi_ref (unbiased, can be negative per token).",
    "kl/k2": "Mean of (log pi - log pi_ref)^2 / 2.",
    "kl/k3": "Mean of exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1 (unbiased, non-negative).",
    "entropy": "Mean per-token entropy of the policy at the sampling temperature over loss tokens, before the "
    "step's first update.",
    "clip_ratio/low_mean": "Share of loss tokens (of sequences, with importance_sampling_level: sequence) whose ratio "
    "fell below 1 - epsilon with negative advantage (clipped). loss_type gmpo: log-ratio below -gmpo_epsilon (TRL's "
    "GMPO); cispo and sapo: 0 (no lower clip; sapo's gate is soft).",
    "clip_ratio/low_min": "Smallest per-completion share of tokens clipped low (the sequence's own flag at "
    "sequence level).",
    "clip_ratio/high_mean": "Share of loss tokens (or sequences) whose ratio rose above 1 + epsilon_high with positive "
    "advantage (clipped). loss_type gmpo: log-ratio above gmpo_epsilon_high; cispo: ratio above cispo_max_ratio, "
    "its IS weight capped (TRL's cispo_clip_ratio); sapo: 0.",
    "clip_ratio/high_max": "Largest per-completion share of tokens clipped high.",
    "clip_ratio/region_mean": "Share of loss tokens (or sequences) clipped either way.",
    "policy_ratio/mean": "Mean pi_theta / pi_old over loss tokens, the ratio that is clipped; pi_old is the trainer's "
    "own, so it is exactly 1 on the first update of a batch.",
    "loss": "The GRPO loss of the whole batch (mean over the step's updates).",
    "grad_norm": "Gradient norm before clipping (mean over the step's updates).",
    "learning_rate": "Learning rate of the step's last update.",
    "step_time": "Wall seconds of the whole step.",
    "tokens_per_second": "Completion tokens trained on per wall second of the step (generated in it when synchronous).",
    "time/rollout": "Seconds the step spent getting its batch: the weight sync, then generating it or (with "
    "rollout.max_off_policy_steps) waiting for the one generated ahead.",
    "time/generate": "Seconds the engine took to generate the step's batch, wherever that time fell (with "
    "rollout.max_off_policy_steps, mostly while an earlier step trained).",
    "time/reward": "Seconds scoring completions.",
    "time/logprobs": "Seconds computing reference logprobs outside the update.",
    "time/update": "Seconds in forward, backward and optimizer steps.",
    # model FLOPs utilisation (trainer/perf.py gives the formula); only where the device's peak is known (a GPU of
    # trainer/perf.py's table in bf16/fp16, or model.peak_tflops): absent on CPU. TRL logs no MFU; the perf/ prefix
    # is verl's and prime-rl's.
    "perf/mfu_update": "Model FLOPs utilisation of the update (forward + backward): its FLOPs (6N a token for a full "
    "fine-tune, 4N + 6N_lora over a frozen base; N the base's matmul weights) over time/update x the devices' peak.",
    "perf/mfu_wall": "Model FLOPs utilisation of the whole step: generation (2N a token), reference (2N, beta > 0) and "
    "update FLOPs over step_time x the devices' peak.",
    "sampling/frac_logprobs_valid": "Share of completion tokens for which the rollout engine gave a finite logprob. "
    "Below 1 the sampling metrics cover only those tokens, and a step with "
    "grpo.rollout_correction mode tis or mis fails.",
    "sampling/sampling_logp_difference/mean": "Mean |engine logprob - trainer logprob (pi_old)| of the sampled tokens "
    "(TRL's name). Near 0 when the engine samples the trainer's weights; NaN "
    "when the engine gives no logprobs.",
    "sampling/sampling_logp_difference/max": "Max of the same. Large values mean a stale or double-applied adapter, "
    "mismatched precision, or rollouts from an older policy.",
    "sampling/importance_sampling_ratio/min": "Smallest rollout-correction weight pi_old / pi_engine over loss tokens "
    "(over sequences at level sequence), after the bounds of "
    "grpo.rollout_correction (TRL's name; mis-masked ones count as 0). "
    "With mode off: the ratio itself, not applied.",
    "sampling/importance_sampling_ratio/mean": "Mean of the same weights.",
    "sampling/importance_sampling_ratio/max": "Largest of the same weights.",
    "sampling/truncated_fraction": "Share of loss tokens whose weight tis moved to a bound (0 unless mode tis).",
    "sampling/masked_fraction": "Share of loss tokens that mis left out of the loss (0 unless mode mis).",
    "sampling/staleness/mean": "Mean over the step's completions of the policy versions (finished steps) between "
    "the weights that sampled each and pi_old, the weights it trains (0: synchronous; at "
    "most rollout.max_off_policy_steps).",
    "sampling/staleness/max": "The largest of the same.",
    "health/ngram_repetition": "Mean share of repeated 3-grams within each completion (repetition collapse).",
    "health/unique_token_ratio": "Mean distinct/total tokens within each completion.",
    "health/garbage_ratio": "Share of completions classified as non-text garbage.",
    # reward hacking (trainer/health.py); NaN where there is nothing to read yet, and NaN is not sent to MLflow
    "hacking/length_reward_corr": "Correlation of completion length (tokens) and total reward within the step's "
    "groups, pooled (each value minus its group's mean, all groups together, so a group "
    "weighs by its spread); near 1: the reward pays length. NaN when no group has spread "
    "in both.",
    "hacking/length_reward_corr_trend": "Change of hacking/length_reward_corr across the last health.trend_window "
    "steps (a least-squares line through the steps that have one; NaN below 3): "
    "rising, the reward is coming to pay length.",
    "hacking/group_diversity": "How little the completions of a prompt share, mean over groups: distinct token 3-grams "
    "of the group over the sum of each completion's own, rescaled so 0 = all the same text "
    "and 1 = no 3-gram shared.",
    "hacking/correctness_rise": "Change of the correctness reward's mean (eval.reward, or the first correctness "
    "reward) across the last health.trend_window steps, from a least-squares line; "
    "negative: correctness falls. NaN without a correctness reward or before the window "
    "is full.",
    "hacking/other_reward_rise": "The same change for the other paying reward component that rose most (one with a "
    "negative weight counts as rising when it falls), in its own units. NaN without such "
    "a component or before the window is full.",
    "hacking/train_reward_rise": "Change of the mean training reward (over the steps since the previous eval point) "
    "across the last health.divergence_window eval points; NaN except at eval steps "
    "(eval.every; without it, always) and before that many eval points.",
    "hacking/eval_rise": "Change of the held-out score (eval/accuracy, or eval/reward without a correctness reward) "
    "across the same eval points; NaN where hacking/train_reward_rise is.",
    "advantages/frac_masked": "Share of completions left out of the loss (truncated with mask_truncated_completions, "
    "or zero-std groups dropped).",
    "advantages/frac_zero_std_groups": "Share of groups whose rewards are all equal (no learning signal), whatever "
    "scale_rewards is.",
    "eval/reward": "Mean reward of the held-out set, decoded as a standalone user would (logged every eval.every "
    "steps).",
    "eval/accuracy": "Share of held-out prompts whose exact_answer reward is 1.",
    "eval/mean_length": "Mean completion length in tokens on the held-out set.",
    "eval/reward_stderr": "Standard error of eval/reward: the per-prompt rewards' standard deviation over sqrt(n).",
    "eval/accuracy_stderr": "Standard error of eval/accuracy: sqrt(p(1-p)/n) over the n held-out prompts.",
    # the judge reward (trainer/judge.py), when rewards has one: its last training batch's scoring, per step
    "judge/groups": "Groups (the completions of one prompt) the judge scored, from the cache or the endpoint.",
    "judge/requests": "HTTP requests sent to the judge endpoint, retries included.",
    "judge/retries": "Requests that were retries after a failed attempt.",
    "judge/failures": "Failed attempts: timeouts, connection errors, HTTP 408/429/5xx, malformed answers.",
    "judge/groups_zeroed": "Groups scored 0 after the retries failed (on_failure: zero); with on_failure: fail the "
    "step fails instead.",
    "judge/cache_hits": "Groups answered from the judge cache (no request; a resumed run's repeated steps).",
    "judge/latency_mean": "Mean wall seconds of a judge request (failed attempts included); 0 without requests.",
    "judge/latency_max": "Longest judge request, seconds.",
    "judge/tokens_in": "Prompt tokens the judge endpoint reported (usage.prompt_tokens), summed.",
    "judge/tokens_out": "Completion tokens the judge endpoint reported (usage.completion_tokens), summed.",
    "judge/cost": "Price of the step's judge tokens (price_in_per_1k, price_out_per_1k); only when a price is set.",
}

PER_REWARD = ("mean", "std")  # rewards/<fn>/<stat>


def describe(name: str) -> str:
    if name in METRICS:
        return METRICS[name]
    head, _, stat = name.rpartition("/")
    if head.startswith("rewards/") and stat in PER_REWARD:
        return METRICS[f"rewards/<fn>/{stat}"]
    raise KeyError(f"undocumented metric {name!r}; add it to trainer/metrics.py")


# ---------------------------------------------------------------------------------------------------
# How each is computed. Inputs are the step's: completions [B], tokens [B, T] with masks [B, T]. The lists are the
# global batch's (World.gather); the tensors are this process's rows, and a `Tally` reduces their parts over the
# world's ranks before it divides, so one process and N ranks compute each value by the same line.


def _std(values: Sequence[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0  # unbiased, as TRL's nanstd


class Tally:
    """The parts of a step's tensor metrics on this process's rows — a mean's numerator and denominator, a min's or a
    max's value and count — reduced over the world's ranks (`World.sums/mins/maxes`, the identity for one process)
    and only then divided: a mean is sum(numerators) / sum(denominators), NaN over none (or `empty`); a min or max
    over no values is NaN. Values come out in the order they were added."""

    def __init__(self):
        self._parts: dict[str, tuple] = {}  # name -> ("mean", numerator, denominator, empty) | ("min"|"max", value, n)

    def mean(self, name: str, numerator, denominator, empty: float = math.nan) -> Tally:
        self._parts[name] = ("mean", numerator, denominator, empty)
        return self

    def masked_mean(self, name: str, values: Tensor, mask: Tensor) -> Tally:
        return self.mean(name, (values * mask).sum(), mask.sum())

    def min(self, name: str, values: Tensor | Sequence[float]) -> Tally:
        n = _count(values)
        self._parts[name] = ("min", (values.min() if hasattr(values, "numel") else min(values)) if n else None, n)
        return self

    def max(self, name: str, values: Tensor | Sequence[float]) -> Tally:
        n = _count(values)
        self._parts[name] = ("max", (values.max() if hasattr(values, "numel") else max(values)) if n else None, n)
        return self

    def values(self, world: World | None = None) -> dict[str, float]:
        """The global batch's value of each metric: this process's parts reduced over `world`'s ranks."""
        world = world or _one_process()
        means = [p for p in self._parts.values() if p[0] == "mean"]
        extremes = [p for p in self._parts.values() if p[0] != "mean"]
        sums = iter(world.sums([x for _, num, den, _ in means for x in (num, den)] + [n for _, _, n in extremes]))
        mins = iter(world.mins([v for kind, v, _ in extremes if kind == "min"]))
        maxes = iter(world.maxes([v for kind, v, _ in extremes if kind == "max"]))
        out = {}
        for name, (kind, *_, empty) in self._parts.items():
            if kind == "mean":
                num, den = next(sums), next(sums)
                out[name] = float(num / den) if den > 0 else empty
        for name, (kind, *_) in self._parts.items():
            if kind != "mean":
                value, n = next(mins if kind == "min" else maxes), next(sums)
                out[name] = float(value) if n > 0 else math.nan
        return {name: out[name] for name in self._parts}


def _count(values) -> int:
    return values.numel() if hasattr(values, "numel") else len(values)


def _one_process() -> World:
    from trainer.distributed import World  # torch, loaded only once a tensor metric is computed

    return World()


def reward_metrics(
    total: Sequence[float], parts: dict[str, Sequence[float]], frac_reward_zero_std: float, frac_zero_std_groups: float
) -> dict[str, float]:
    m = {"reward": float(sum(total) / len(total)), "reward_std": _std(total)}
    for name, values in parts.items():
        m[f"rewards/{name}/mean"] = float(sum(values) / len(values))
        m[f"rewards/{name}/std"] = _std(values)
    m["frac_reward_zero_std"] = frac_reward_zero_std
    m["advantages/frac_zero_std_groups"] = frac_zero_std_groups
    return m


def completion_metrics(lengths: Sequence[int], finish_reasons: Sequence[str]) -> dict[str, float]:
    terminated = [n for n, r in zip(lengths, finish_reasons) if r == "stop"] or [0]
    return {
        "completions/mean_length": float(sum(lengths) / len(lengths)),
        "completions/min_length": float(min(lengths)),
        "completions/max_length": float(max(lengths)),
        "completions/clipped_ratio": sum(r == "length" for r in finish_reasons) / len(finish_reasons),
        "completions/mean_terminated_length": float(sum(terminated) / len(terminated)),
        "completions/min_terminated_length": float(min(terminated)),
        "completions/max_terminated_length": float(max(terminated)),
    }


def update_metrics(terms: LossTerms, loss_mask: Tensor, level: str, world: World | None = None) -> dict[str, float]:
    """clip_ratio/*, policy_ratio/mean and kl/* of one update over the whole batch (TRL's definitions)."""
    mask = loss_mask.float()
    per_seq = mask.sum(dim=1)
    has = per_seq > 0
    t = Tally()
    flags = {"low": terms.clipped_low, "high": terms.clipped_high, "region": terms.clipped_low | terms.clipped_high}
    shares = {key: (f.float() * mask).sum(dim=1)[has] / per_seq[has] for key, f in flags.items()}  # per completion
    for key, f in flags.items():
        if level == "sequence":  # one flag per sequence
            t.mean(f"clip_ratio/{key}_mean", shares[key].sum(), shares[key].numel())
        else:
            t.masked_mean(f"clip_ratio/{key}_mean", f.float(), mask)
    t.min("clip_ratio/low_min", shares["low"]).max("clip_ratio/high_max", shares["high"])
    t.masked_mean("policy_ratio/mean", terms.ratio, mask)
    if terms.kl is not None:
        for name in ("k1", "k2", "k3"):
            t.masked_mean(f"kl/{name}", terms.kl[name], mask)
    m = t.values(world)
    if terms.kl is not None:
        m["kl"] = m["kl/k3"]
    return m  # beta = 0: no reference, so no KL is measured and none is reported (as TRL), never a false 0


def entropy_metric(entropy: Tensor, loss_mask: Tensor, world: World | None = None) -> dict[str, float]:
    return Tally().masked_mean("entropy", entropy, loss_mask.float()).values(world)


def sampling_metrics(
    old_logprobs: Tensor,
    engine_logprobs: Tensor,
    token_mask: Tensor,
    loss_mask: Tensor,
    corr: Correction,
    cfg: RolloutCorrectionConfig,
    staleness: Sequence[int],
    world: World | None = None,
) -> dict[str, float]:
    """Engine vs trainer: the logprob difference over every completion token the engine gave a logprob for;
    the correction `corr` (loss.rollout_correction over loss_mask): weights, truncated and masked shares over
    loss tokens; `staleness`, each completion's versions behind pi_old."""
    valid = engine_logprobs.isfinite() & token_mask.bool()
    diff = (old_logprobs - engine_logprobs).abs()[valid]
    t = Tally().mean("sampling/frac_logprobs_valid", float(valid.sum()), float(token_mask.sum()), empty=0.0)
    t.mean("sampling/sampling_logp_difference/mean", diff.sum(), diff.numel())
    t.max("sampling/sampling_logp_difference/max", diff)
    t.mean("sampling/staleness/mean", sum(staleness), len(staleness)).max("sampling/staleness/max", staleness)
    scored = loss_mask.bool() & valid
    weights = corr.ratio if cfg.mode == "off" else corr.weight
    weights = weights[:, 0][scored.any(dim=1)] if cfg.level == "sequence" else weights[scored]
    t.min("sampling/importance_sampling_ratio/min", weights)
    t.mean("sampling/importance_sampling_ratio/mean", weights.sum(), weights.numel())
    t.max("sampling/importance_sampling_ratio/max", weights)
    t.masked_mean("sampling/truncated_fraction", corr.truncated.float(), loss_mask.float())
    t.masked_mean("sampling/masked_fraction", corr.masked.float(), loss_mask.float())
    return t.values(world)


def perf_metrics(update_flops: float, step_flops: float, update_s: float, step_s: float, peak: float | None):
    """perf/mfu_update and perf/mfu_wall: FLOPs over seconds x `peak` FLOP/s; none without a peak (CPU, unknown)."""
    if peak is None or update_s <= 0 or step_s <= 0:
        return {}
    return {"perf/mfu_update": update_flops / (update_s * peak), "perf/mfu_wall": step_flops / (step_s * peak)}


def mean_over_updates(per_update: list[dict[str, float]]) -> dict[str, float]:
    """Average each value over the step's updates (NaN only if every update's is NaN)."""
    out: dict[str, float] = {}
    for name in per_update[0]:
        values = [u[name] for u in per_update if not math.isnan(u[name])]
        out[name] = sum(values) / len(values) if values else math.nan
    return out
