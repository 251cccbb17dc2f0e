"""Every metric a step reports: its name, and what it means. This table is the documentation
(`ballast metrics` prints it); `tests/test_trainer.py` checks that a step reports exactly these names.

Names follow TRL's GRPOTrainer where TRL has one, so dashboards read the same. A step is one batch of
rollouts (prompts_per_step × num_generations completions) and the num_iterations optimizer updates
made on it; values that the updates produce are averaged over them. Token-level values are means
over completion tokens that count in the loss; `rewards/<fn>/mean` appears once per reward function.
"""
from __future__ import annotations

METRICS: dict[str, str] = {
    "step": "Step number, counting from 1; a resumed run continues the count.",
    "reward": "Mean total (weighted) reward of the step's completions.",
    "reward_std": "Mean over groups of the reward's standard deviation within the group.",
    "rewards/<fn>/mean": "Mean of one reward function's (unweighted) score.",
    "frac_reward_zero_std": "Share of groups whose completions all got the same reward (no learning signal).",
    "completions/mean_length": "Mean completion length in tokens.",
    "completions/min_length": "Shortest completion, tokens.",
    "completions/max_length": "Longest completion, tokens.",
    "completions/clipped_ratio": "Share of completions that hit rollout.max_tokens (truncated).",
    "completions/mean_terminated_length": "Mean length of completions that ended with an end token or stop string.",
    "kl": "Mean per-token KL(policy || reference), k3 estimator (as TRL's 'kl'); 0 when beta = 0.",
    "kl/k1": "Mean of log pi - log pi_ref (unbiased, can be negative per token).",
    "kl/k2": "Mean of (log pi - log pi_ref)^2 / 2.",
    "kl/k3": "Mean of exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1 (unbiased, non-negative).",
    "entropy": "Mean per-token entropy of the policy at the sampling temperature.",
    "clip_ratio/low_mean": "Share of tokens whose ratio fell below 1 - epsilon with negative advantage (clipped).",
    "clip_ratio/high_mean": "Share of tokens whose ratio rose above 1 + epsilon_high with positive advantage (clipped).",
    "clip_ratio/region_mean": "Share of tokens clipped either way.",
    "loss": "The GRPO loss of the step (mean over its updates).",
    "grad_norm": "Gradient norm before clipping (mean over the step's updates).",
    "learning_rate": "Learning rate of the step's last update.",
    "step_time": "Wall seconds of the whole step.",
    "tokens_per_second": "Completion tokens generated per wall second of the step.",
    "time/rollout": "Seconds generating completions (including weight sync).",
    "time/reward": "Seconds scoring completions.",
    "time/logprobs": "Seconds computing old and reference logprobs outside the update.",
    "time/update": "Seconds in forward, backward and optimizer steps.",
    "is/frac_old_logprobs_valid": "Share of completion tokens that had a finite old (behaviour) logprob. Below 1 means importance sampling is partly off.",
    "is/mean_importance_ratio": "Mean pi_theta / pi_old over tokens (1 on the first update of an on-policy batch).",
    "is/clip_fraction": "Share of tokens whose ratio was clipped (same as clip_ratio/region_mean).",
    "rollout/logprob_diff_mean": "Mean |engine logprob - trainer logprob| of the sampled tokens before the update. Near 0 when the engine samples the trainer's weights. NaN when the engine returns no logprobs (vLLM with penalties or truncation, with grpo.old_logprobs: recompute).",
    "rollout/logprob_diff_max": "Max of the same. Large values mean a stale or double-applied adapter, or mismatched precision.",
    "health/ngram_repetition": "Mean share of repeated 3-grams within each completion (repetition collapse).",
    "health/unique_token_ratio": "Mean distinct/total tokens within each completion.",
    "health/garbage_ratio": "Share of completions classified as non-text garbage.",
    "advantages/frac_masked": "Share of completions left out of the loss (truncated with mask_truncated_completions, or zero-std groups dropped).",
    "eval/reward": "Mean reward of the held-out set, decoded as a standalone user would (logged every eval.every steps).",
    "eval/accuracy": "Share of held-out prompts whose exact_answer reward is 1.",
    "eval/mean_length": "Mean completion length in tokens on the held-out set.",
}


def describe(name: str) -> str:
    if name in METRICS:
        return METRICS[name]
    if name.startswith("rewards/") and name.endswith("/mean"):
        return METRICS["rewards/<fn>/mean"]
    raise KeyError(f"undocumented metric {name!r}; add it to trainer/metrics.py")
