"""What runs that share one base model in one process must agree on — concurrent sweep trials and a population's
members (trainer/multi.py trains them): LoRA adapters, sampled by the hf or vLLM engine one completion per prompt
each step, decoded one way. Free of torch, so a sweep or population file is refused before anything loads."""

from __future__ import annotations

from .config import InputError, TrainerConfig


def check_concurrent(
    cfg: TrainerConfig,
    first: TrainerConfig | None,
    name: str,
    who: str = "concurrent trials",
    fix: str = " or set sweep.concurrent_trials: 1",
) -> None:
    """Refuse, naming the field and the fix, a trial that cannot share the base model with the others (`who` share
    it: concurrent trials, a population's members; `fix` the way out besides the field's)."""
    if not cfg.lora.enabled:
        raise InputError(f"trial {name}: lora.enabled is false; {who} train LoRA adapters — enable lora{fix}")
    if cfg.rollout.engine not in ("hf", "vllm"):
        raise InputError(
            f"trial {name}: rollout.engine is {cfg.rollout.engine!r}; {who} sample with the hf or the "
            f"vllm engine — set rollout.engine: hf{fix}"
        )
    if getattr(cfg.data, "environment", None) is not None:
        raise InputError(
            f"trial {name}: data.environment is set; {who} sample one completion per prompt, not "
            f"multi-turn episodes — remove data.environment{fix}"
        )
    if cfg.rollout.max_off_policy_steps:
        raise InputError(
            f"trial {name}: rollout.max_off_policy_steps is {cfg.rollout.max_off_policy_steps}; {who} "
            f"sample each step synchronously — set rollout.max_off_policy_steps: 0{fix}"
        )
    if first is None:
        return
    for key in DECODE_FIELDS:  # one engine decodes every trial's rows
        mine, theirs = getattr(cfg.rollout, key), getattr(first.rollout, key)
        if mine != theirs:
            raise InputError(
                f"trial {name}: rollout.{key} is {mine!r} but the running trials' is {theirs!r}; the trials decode "
                f"in one batch one way — do not search over rollout.{key},{fix}"
            )
    mine, theirs = _server_fields(cfg), _server_fields(first)
    if cfg.rollout.engine == "vllm" and mine != theirs:
        key = next(k for k in mine if mine[k] != theirs[k])
        raise InputError(
            f"trial {name}: rollout.{key} is {mine[key]!r} but the running trials' vLLM server has {theirs[key]!r}; "
            f"concurrent trials share one server — do not search over rollout.{key},{fix}"
        )
    if cfg.model != first.model:
        mine, theirs = cfg.model.model_dump(), first.model.model_dump()
        key = next(k for k in mine if mine[k] != theirs[k])
        raise InputError(
            f"trial {name}: model.{key} is {mine[key]!r} but the running trials' is {theirs[key]!r}; concurrent "
            f"trials share one base model — do not search over the model section,{fix}"
        )


DECODE_FIELDS = ("concurrent_adapters", "compile_decode", "fused_sampling")  # the shared HF engine's settings


def _server_fields(cfg: TrainerConfig) -> dict:
    """The rollout settings that start or reach a vLLM server: one for all concurrent trials."""
    return {k: v for k, v in cfg.rollout.model_dump().items() if k.startswith("vllm_") or k == "device"}
