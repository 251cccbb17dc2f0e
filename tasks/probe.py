"""The artifact probe: reload a saved checkpoint in a fresh model, sample fixed prompts, and say whether what
comes out is healthy — compared with what the model it started from writes on the same prompts. `probe_checkpoint()`
runs the steps below and returns a `ProbeReport` (tasks/results.py).

1. **Fetch and verify** the artifact (local path or s3://): every file's sha256 (`Checkpoint.open`).
2. **Identity checks** from the manifest: the base model it was trained on (config and weights sha256) against
   the one the probe loads; the saved adapter config (r, alpha, target modules) against the run's LoRA settings.
3. **Fresh load** of base + adapter (or the full model) *from the artifact*, never a trainer's memory; its
   `tokenizer/` compared with the base model's (vocabulary, special tokens, chat template, rendered prompts).
4. **Parity**: the manifest's fingerprint sequence teacher-forced through the reloaded model must reproduce the
   logprobs recorded at save time within `probe.parity_tolerance` (catches a rescaled or doubled adapter, a
   changed alpha, another base model).
5. **Sample and classify** the checkpoint and its **baseline** — the fork's parent checkpoint for a forked run,
   else the base model (for a LoRA checkpoint: the same model with its adapter disabled) — on the same prompts
   with the same settings and seed; every completion classified by trainer.health.classify, the detectors of the
   trainer's collapse metrics. The baseline's completions are cached under `baseline_cache`, keyed by its identity
   (weights hashes, or the parent's file hashes), the rendered prompts and the sampling settings, so a pipeline
   pays for them once.

What fits the model probed: prompts are the experiment's held-out prompts (`data:`; its training prompts when it
has no held-out set), the first `probe.num_prompts`, rendered exactly as training renders them (system prompt,
template), or `probe.prompts_file`; the data section and rewards are the ones the checkpoint was trained with
(state/trainer_state.json) unless given. With `data.environment` each sample is an episode of the environment
(trainer/episodes.py, the HF engine at the probe's settings), classified by the model's last turn.
The format check applies only when the rewards require a tag
(`probe.format_tag` overrides). `too_long` fires beyond `probe.length_factor` x the baseline's median length on the
same prompt (`probe.expected_length`, or a prompt file's, overrides). The verdict is relative: it fails when the
malformed rate exceeds the baseline's by more than `probe.max_malformed_increase` with one-sided Fisher exact
p < `probe.significance`, or is above the absolute cap `probe.max_malformed_rate`, or any check failed. An artifact
that cannot be loaded at all raises `ProbeError` naming why.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from pydantic import ValidationError
from scipy.stats import binomtest, fisher_exact
from transformers import AutoTokenizer

from tasks.checkpoint import fetch_checkpoint
from tasks.results import CI_LEVEL, Baseline, Check, ProbeError, ProbeReport, ProbeSample, PromptResult
from tasks.spec import ProbeConfig, load_probe_prompts
from trainer.checkpoint import Checkpoint, CheckpointError, fault_point
from trainer.config import DataConfig, LoraConfig, ModelConfig, RewardConfig
from trainer.data import load_datasets, render_prompt
from trainer.engines.base import SamplingParams
from trainer.engines.hf import HFEngine
from trainer.health import REASONS, classify, reason_code
from trainer.model import compare_fingerprint, ensure_model, load_policy, load_tokenizer, model_identity
from trainer.rewards import REGISTRY

DEFAULT_CACHE = Path(".ballast") / "cache" / "probe"
DEFAULT_BASELINE_CACHE = Path(".ballast") / "cache" / "probe-baseline"
BASELINE_CACHE_VERSION = 1  # bump when what a cached baseline holds, or how it is sampled, changes
SHOW_DIFFS = 3  # examples quoted in a tokenizer-mismatch message


# ── probe prompts ──────────────────────────────────────────────────────────────────────────────────


def held_out_prompts(data: DataConfig, k: int) -> tuple[list[dict], str]:
    """The first `k` held-out prompts of the data section (its training prompts when it has no held-out set), and
    where they came from in words."""
    train, held_out = load_datasets(data)
    examples, which = (held_out, "held-out") if held_out else (train, "training (the data has no held-out set)")
    chosen = examples[:k]
    source = f"the first {len(chosen)} {which} prompts of data.source {data.source!r}"
    return [{"prompt": e.prompt, "answer": e.answer, "expected_length": None} for e in chosen], source


def choose_prompts(cfg: ProbeConfig, data: DataConfig | None) -> tuple[list[dict], str]:
    """(prompts, where they came from): probe.prompts_file, else the experiment's held-out prompts."""
    if cfg.prompts_file:
        return load_probe_prompts(cfg.prompts_file), str(cfg.prompts_file)
    if data is None:
        raise ProbeError(
            "no probe prompts: the checkpoint does not record the data it was trained on; give "
            "probe.prompts_file (ballast probe --prompts) or the experiment's spec (--spec)"
        )
    try:
        return held_out_prompts(data, cfg.num_prompts)
    except (OSError, ValueError) as e:
        raise ProbeError(
            f"the probe's default prompts are the experiment's held-out prompts, which cannot be read "
            f"here ({e}); give probe.prompts_file (ballast probe --prompts)"
        ) from None


# ── what the experiment asks of an answer ──────────────────────────────────────────────────────────


def reward_tag(rewards: list[RewardConfig] | None) -> str | None:
    """The tag the first reward that requires one asks for: a `tag` kwarg, or the default `tag` parameter of a
    built-in (exact_answer, tag_answer, format); None when no reward requires a tag."""
    for reward in rewards or []:
        if "tag" in reward.kwargs:
            return str(reward.kwargs["tag"])
        fn = REGISTRY.get(reward.name)
        parameter = _signature_parameter(fn, "tag") if fn is not None else None
        if parameter is not None:
            return parameter
    return None


def _signature_parameter(fn, name: str) -> str | None:
    try:
        parameter = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return None
    return parameter.default if parameter is not None and isinstance(parameter.default, str) else None


def format_tag_for(cfg: ProbeConfig, rewards: list[RewardConfig] | None) -> str | None:
    """The tag completions must hold: probe.format_tag when given (False: none), else the rewards' tag."""
    if cfg.format_tag is False:
        return None
    return cfg.format_tag if cfg.format_tag is not None else reward_tag(rewards)


def trained_sections(checkpoint: Checkpoint) -> tuple[DataConfig | None, list[RewardConfig] | None]:
    """The data section and rewards the checkpoint was trained with (its trainer state); None for what it lacks."""
    try:
        config = checkpoint.trainer_state().get("config") or {}
    except (OSError, ValueError):
        return None, None
    try:
        data = DataConfig.model_validate(config["data"]) if "data" in config else None
    except ValidationError:
        data = None
    try:
        rewards = [RewardConfig.model_validate(r) for r in config["rewards"]] if "rewards" in config else None
    except ValidationError:
        rewards = None
    return data, rewards


# ── statistics ─────────────────────────────────────────────────────────────────────────────────────


def wilson_interval(k: int, n: int, level: float = CI_LEVEL) -> list[float]:
    """[lo, hi] Wilson score interval of a binomial proportion k/n; [0, 1] when n is 0."""
    if n == 0:
        return [0.0, 1.0]
    ci = binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
    return [max(0.0, float(ci.low)), min(1.0, float(ci.high))]


def excess_p_value(bad: int, n: int, base_bad: int, base_n: int) -> float:
    """One-sided Fisher exact p-value of "the checkpoint is malformed more often than its baseline"."""
    _, p = fisher_exact([[bad, n - bad], [base_bad, base_n - base_bad]], alternative="greater")
    return float(p)


# ── the checks ─────────────────────────────────────────────────────────────────────────────────────


def _check_base_model(manifest: dict, model_cfg: ModelConfig, now: dict) -> Check:
    """`now`: model_identity(model_cfg), the base model the probe loads."""
    saved = manifest.get("base_model") or {}
    if not saved:
        return Check(True, "the manifest records no base model; not checked")
    compared = False
    for key in ("config_sha256", "weights_sha256"):
        if key in saved and key in now:
            compared = True
            if saved[key] != now[key]:
                return Check(
                    False,
                    f"wrong base model: the checkpoint was trained on {saved.get('name_or_path')!r} "
                    f"({key} {_short(saved[key])}) but the probe loaded {model_cfg.name_or_path!r} "
                    f"({key} {_short(now[key])}); point model.name_or_path (or --base) at the base "
                    "model the run trained on",
                )
    if not compared and saved.get("name_or_path") != model_cfg.name_or_path:
        return Check(
            False,
            f"wrong base model: the checkpoint was trained on {saved.get('name_or_path')!r} but the "
            f"probe loaded {model_cfg.name_or_path!r}; point model.name_or_path (or --base) at the "
            "base model the run trained on",
        )
    return Check(
        True,
        f"trained on {saved.get('name_or_path')!r}; loaded {model_cfg.name_or_path!r}"
        + (" (same hashes)" if compared else ""),
    )


def _short(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {str(v)[:12]}" for k, v in sorted(value.items())) + "}"
    return str(value)[:16]


def _check_adapter_config(checkpoint: Checkpoint) -> Check:
    trained = checkpoint.lora
    try:
        saved = checkpoint.adapter_config() if trained else None
    except CheckpointError as e:
        return Check(False, f"{e}; the adapter config was corrupted — restore it from the run")
    if saved is None:
        return Check(True, "no LoRA settings in the manifest or no adapter_config.json; not checked")
    problems = []
    if saved.get("r") != trained.get("r"):
        problems.append(f"r={saved.get('r')} but the run trained with lora.r={trained.get('r')}")
    if (
        saved.get("lora_alpha") is not None
        and trained.get("alpha") is not None
        and float(saved["lora_alpha"]) != float(trained["alpha"])
    ):
        problems.append(f"lora_alpha={saved['lora_alpha']:g} but the run trained with lora.alpha={trained['alpha']:g}")
    targets_saved, targets_trained = saved.get("target_modules"), trained.get("target_modules")
    if (
        isinstance(targets_saved, list)
        and isinstance(targets_trained, list)
        and set(targets_saved) != set(targets_trained)
    ):
        problems.append(f"target_modules={sorted(targets_saved)} but the run trained with {sorted(targets_trained)}")
    if problems:
        scale_note = ""
        try:
            was = float(trained["alpha"]) / float(trained["r"])
            now = float(saved["lora_alpha"]) / float(saved["r"])
            if was != now:
                scale_note = f" (the adapter's scale alpha/r is {now:g} instead of {was:g}, {now / was:g}x)"
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            pass
        return Check(
            False,
            "adapter config differs from the training config in the manifest: "
            + "; ".join(problems)
            + scale_note
            + " — the adapter was saved or edited with the wrong LoRA settings; restore "
            "adapter_config.json from the run or fix the code that writes it",
        )
    return Check(True, f"r={saved.get('r')}, lora_alpha={saved.get('lora_alpha')} as trained")


def _load_tokenizer_dir(path: Path):
    """The checkpoint's saved tokenizer, set up like trainer.model.load_tokenizer (left padding, a pad token)."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _check_tokenizer(saved, base, prompts: list[dict], data: DataConfig | None) -> Check:
    """Does the checkpoint's tokenizer/ encode like the base model's? Differences, most telling first."""
    diffs = []
    v_saved, v_base = saved.get_vocab(), base.get_vocab()
    if v_saved != v_base:
        changed = sorted(t for t in set(v_saved) | set(v_base) if v_saved.get(t) != v_base.get(t))
        examples = ", ".join(f"{t!r}: {v_saved.get(t)} vs {v_base.get(t)}" for t in changed[:SHOW_DIFFS])
        diffs.append(f"vocabulary: {len(changed)} tokens map to other ids ({examples})")
    for name in ("bos_token", "eos_token", "pad_token"):
        a, b = getattr(saved, name, None), getattr(base, name, None)
        if a != b:
            diffs.append(f"{name} {a!r} vs {b!r}")
    if getattr(saved, "chat_template", None) != getattr(base, "chat_template", None):
        diffs.append("chat_template differs")
    if not diffs:
        for p in prompts:
            try:
                a, b = render_prompt(saved, p["prompt"], data), render_prompt(base, p["prompt"], data)
            except Exception as e:  # a template that cannot render is itself a mismatch worth naming
                diffs.append(f"rendering prompt {p['prompt']!r} failed: {e}")
                break
            if a != b:
                diffs.append(f"prompt {p['prompt']!r} renders to different token ids")
                break
    if diffs:
        return Check(
            False,
            "tokenizer mismatch: the checkpoint's tokenizer/ differs from the base model's ("
            + "; ".join(diffs)
            + "); a model served with the base tokenizer will see other token ids than it "
            "was trained on — find which tokenizer the run trained with and serve (and re-save) that one",
        )
    return Check(True, "the checkpoint's tokenizer/ matches the base model's")


# ── the probe ──────────────────────────────────────────────────────────────────────────────────────


def model_config_from_manifest(manifest: dict, device: str = "auto") -> ModelConfig:
    """The base model a checkpoint was trained on, as a ModelConfig (for probing without a spec)."""
    name = (manifest.get("base_model") or {}).get("name_or_path")
    if not name:
        raise ProbeError(
            "the checkpoint's manifest does not name its base model; give the base model (--base or a --spec)"
        )
    return ModelConfig(name_or_path=name, device=device)


def base_model_of(checkpoint_uri: str, cache_dir: Path, device: str = "auto") -> ModelConfig:
    """The base model a checkpoint's manifest names, on `device`."""
    return model_config_from_manifest(_open(checkpoint_uri, cache_dir).manifest, device=device)


def run_probe_args(spec, run_cache: Path) -> dict:
    """probe_checkpoint's arguments for a pipeline run's checkpoints: the spec's probe, model and LoRA settings, the
    run's cache (`run_cache`, under the project's cache/<run id>) and the base-model baseline cached beside it for every
    run of that base model. One home for the flow's process and a node's (tasks/remote.py)."""
    return dict(
        cfg=spec.probe,
        model_cfg=spec.model,
        cache_dir=run_cache / "probe",
        lora_cfg=spec.lora,
        baseline_cache=run_cache.parent / "probe-baseline",
    )


def probe_checkpoint(
    checkpoint_uri: str,
    cfg: ProbeConfig,
    model_cfg: ModelConfig | None = None,
    cache_dir: Path | None = None,
    lora_cfg: LoraConfig | None = None,
    *,
    data: DataConfig | None = None,
    rewards: list[RewardConfig] | None = None,
    baseline_cache: Path | None = None,
) -> ProbeReport:
    """Probe the checkpoint at `checkpoint_uri` (local path or s3://) with ProbeConfig `cfg` (see the module
    docstring). `model_cfg` is the base model to load (default: the one the manifest names); `data` and `rewards`
    default to those the checkpoint was trained with; `baseline_cache` is where baselines are kept."""
    started = time.perf_counter()
    cache_dir = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE
    checkpoint = _open(checkpoint_uri, cache_dir)
    fault_point("hold-in-probe", checkpoint.step)  # the signal tests' way to land a signal in the probe
    trained_data, trained_rewards = trained_sections(checkpoint)
    data, rewards = data or trained_data, rewards if rewards is not None else trained_rewards
    prompts, prompt_source = choose_prompts(cfg, data)
    model_cfg = model_cfg or model_config_from_manifest(checkpoint.manifest)
    artifact = _load_checked(checkpoint, checkpoint_uri, model_cfg, lora_cfg or LoraConfig(), prompts, data, cfg)
    tag = format_tag_for(cfg, rewards)
    settings = _settings(cfg, tag, prompt_source, data, artifact.device)
    baseline_cache = Path(baseline_cache) if baseline_cache is not None else DEFAULT_BASELINE_CACHE
    sampled = _sample_and_classify(artifact, prompts, data, tag, cfg, cache_dir, baseline_cache)
    return _report(checkpoint_uri, artifact, sampled, settings, cfg, time.perf_counter() - started)


@dataclass
class _Artifact:
    """The checkpoint loaded into a fresh model, and what the checks before sampling found."""

    checkpoint: Checkpoint
    model: object  # None once released (`release`)
    tokenizer: object
    device: torch.device
    model_cfg: ModelConfig
    lora_cfg: LoraConfig
    identity: dict  # model_identity(model_cfg): the base model loaded here
    checks: dict[str, Check]  # base_model, adapter_config, tokenizer, parity
    parity_diff: float | None

    def release(self) -> None:
        """Drop the model (the baseline and the checkpoint have been sampled; classification needs no model)."""
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


@dataclass
class _Sampled:
    """The checkpoint's completions classified, and its baseline's summary (None without `compare_to_base`)."""

    samples: list[ProbeSample]
    per_prompt: list[PromptResult]
    baseline: Baseline | None


def _load_checked(
    checkpoint: Checkpoint,
    uri: str,
    model_cfg: ModelConfig,
    lora_cfg: LoraConfig,
    prompts: list[dict],
    data: DataConfig | None,
    cfg: ProbeConfig,
) -> _Artifact:
    """Steps 2-4 of the module docstring: identity checks, the fresh load, the tokenizer check, parity."""
    identity = model_identity(model_cfg)
    checks = {
        "base_model": _check_base_model(checkpoint.manifest, model_cfg, identity),
        "adapter_config": _check_adapter_config(checkpoint),
    }
    model, tokenizer, checks["tokenizer"] = _load_fresh(checkpoint, uri, model_cfg, lora_cfg, checks, prompts, data)
    device = next(model.parameters()).device
    checks["parity"], parity_diff = _check_parity(
        model, tokenizer, device, checkpoint.fingerprint, cfg.parity_tolerance
    )
    return _Artifact(checkpoint, model, tokenizer, device, model_cfg, lora_cfg, identity, checks, parity_diff)


def _sample_and_classify(
    artifact: _Artifact,
    prompts: list[dict],
    data: DataConfig | None,
    tag: str | None,
    cfg: ProbeConfig,
    cache_dir: Path,
    baseline_cache: Path,
) -> _Sampled:
    """Step 5: the checkpoint and its baseline sampled on the same rendered prompts, every completion classified."""
    rendered = [render_prompt(artifact.tokenizer, p["prompt"], data) for p in prompts]
    episodes = _episodes(artifact.tokenizer, prompts, data, cfg)
    groups = _sample(artifact.model, artifact.tokenizer, artifact.device, rendered, cfg, episodes)
    baseline = _baseline(artifact, rendered, cfg, cache_dir, baseline_cache, episodes) if cfg.compare_to_base else None
    artifact.release()
    expected = _expected_lengths(prompts, cfg, baseline.groups if baseline else None)
    samples, per_prompt = _classify(prompts, groups, expected, tag, cfg)
    summary = _baseline_summary(baseline, prompts, expected, tag, cfg, samples) if baseline else None
    return _Sampled(samples, per_prompt, summary)


def _settings(cfg: ProbeConfig, tag: str | None, prompt_source: str, data: DataConfig | None, device) -> dict:
    """What the probe ran with, as the report records it."""
    return {
        "n": cfg.n,
        "temperature": cfg.temperature,
        "max_tokens": cfg.max_tokens,
        "seed": cfg.seed,
        "format_tag": tag,
        "expected_length": cfg.expected_length,
        "length_factor": cfg.length_factor,
        "max_malformed_rate": cfg.max_malformed_rate,
        "max_malformed_increase": cfg.max_malformed_increase,
        "significance": cfg.significance,
        "prompts": prompt_source,
        "system_prompt": data.system_prompt if data else None,
        "prompt_template": data.prompt_template if data else None,
        "engine": "hf",
        "device": str(device),
    }


def _open(checkpoint_uri: str, cache_dir: Path) -> Checkpoint:
    try:
        return fetch_checkpoint(str(checkpoint_uri), cache_dir)
    except CheckpointError as e:
        raise ProbeError(
            f"cannot probe {checkpoint_uri}: {e}. A checkpoint saved mid-write or altered afterwards "
            "cannot be trusted; probe an earlier complete checkpoint"
        ) from None


def _load_fresh(
    checkpoint: Checkpoint,
    uri: str,
    model_cfg: ModelConfig,
    lora_cfg: LoraConfig,
    checks: dict,
    prompts: list[dict],
    data: DataConfig | None,
):
    """(model, tokenizer, tokenizer check): the artifact loaded into a new model, on a base model that exists here."""
    try:
        base_tokenizer = load_tokenizer(ensure_model(model_cfg))
    except (OSError, ValueError) as e:
        raise ProbeError(
            f"cannot probe {uri}: its base model cannot be loaded here ({e}); give the base model "
            "the run trained on with --base or model.name_or_path"
        ) from None
    try:
        model, _ = checkpoint.load_policy(model_cfg, lora_cfg)
    except Exception as e:
        cause = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:400]}"
        if "safetensor" in type(e).__name__.lower() or "header" in str(e).lower():
            raise ProbeError(
                f"cannot load {uri}: its weights file is unreadable ({cause}); it was written only "
                "partly (saved mid-write, with a manifest computed over the partial file) or corrupted — "
                "probe an earlier complete checkpoint and fix the saver"
            ) from e
        hints = [c.detail for c in (checks["adapter_config"], checks["base_model"]) if not c.ok]
        raise ProbeError(
            f"cannot load {uri} onto base model {model_cfg.name_or_path!r} ({cause}): the saved weights "
            "do not fit their adapter config or the base model"
            + "".join(f"; {h}" for h in hints)
            + ("" if hints else "; check the base model and adapter/adapter_config.json")
        ) from e
    if not checkpoint.tokenizer_dir.is_dir():
        return model, base_tokenizer, Check(True, "the checkpoint has no tokenizer/; sampled with the base model's")
    try:
        tokenizer = _load_tokenizer_dir(checkpoint.tokenizer_dir)
    except Exception as e:
        raise ProbeError(
            f"cannot load the tokenizer saved in {uri}/tokenizer: {type(e).__name__}: {e}; "
            "the checkpoint's tokenizer files are corrupt — restore them from the run"
        ) from e
    return model, tokenizer, _check_tokenizer(tokenizer, base_tokenizer, prompts, data)


def _check_parity(model, tokenizer, device, fingerprint: dict | None, tolerance: float) -> tuple[Check, float | None]:
    """Teacher-forced logprobs of the reloaded artifact against those recorded at save time."""
    if not fingerprint:
        return Check(
            False,
            "parity not checked: the manifest has no logprob fingerprint (written by an older or "
            "foreign saver), so nothing proves the reloaded artifact is the model that was trained; "
            "re-save it with Ballast",
        ), None
    try:
        diff = compare_fingerprint(model, tokenizer, device, fingerprint)
    except (IndexError, RuntimeError, ValueError) as e:  # e.g. token ids beyond a wrong base model's vocabulary
        return Check(
            False,
            f"parity failed: the reloaded artifact cannot be teacher-forced on the manifest's "
            f"fingerprint ({type(e).__name__}: {str(e).strip()[:200]}): it is not the model that was "
            "saved — check the base model",
        ), None
    if diff <= tolerance:
        return Check(True, f"max |logprob diff| {diff:.3g} <= {tolerance:g}"), diff
    return Check(
        False,
        f"parity failed: the reloaded artifact's teacher-forced logprobs on the manifest's fingerprint "
        f"differ from those recorded at save time by up to {diff:.3g} (tolerance {tolerance:g}): the "
        "model loaded from the artifact is not the model that was saved — adapter weights rescaled, "
        "adapter applied twice or merged, LoRA alpha/r changed, or another base model; do not ship "
        "it, find the step that changed the weights between training and saving",
    ), diff


# ── sampling, the baseline, classification ─────────────────────────────────────────────────────────


@dataclass
class Generated:
    """One sampled completion, as much of it as classification needs (and a cached baseline keeps)."""

    text: str
    token_ids: list[int]
    finish_reason: str


def _episodes(tokenizer, prompts: list[dict], data: DataConfig | None, cfg: ProbeConfig):
    """(the episode runner, the prompts as examples) when the data has an environment: the probe then runs its
    episodes (trainer/episodes.py); None otherwise."""
    if data is None or data.environment is None:
        return None
    from trainer.data import Example
    from trainer.episodes import EpisodeRunner

    examples = [Example(p["prompt"], p["answer"] if p["answer"] is not None else "") for p in prompts]
    return EpisodeRunner.from_config(data, tokenizer, cfg.max_tokens), examples


def _sample(
    model, tokenizer, device, rendered: list[list[int]], cfg: ProbeConfig, episodes=None
) -> list[list[Generated]]:
    """Every rendered prompt sampled cfg.n times in one seeded batch; with `episodes` (`_episodes`) each sample is an
    episode of the environment, classified by the model's last turn (its text, and the tokens it sampled)."""
    params = SamplingParams(n=cfg.n, max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=cfg.seed)
    engine = HFEngine(model, tokenizer, device)
    if episodes is None:
        groups = engine.generate(rendered, params)
        return [[Generated(c.text, list(c.token_ids), c.finish_reason) for c in group] for group in groups]
    runner, examples = episodes
    groups = runner.run(engine, examples, params, [f"probe prompt {i}" for i in range(len(examples))])
    return [[Generated(c.text, _last_turn(c), c.finish_reason) for c in group] for group in groups]


def _last_turn(c) -> list[int]:
    """The tokens of an episode's last turn of the model (after its last inserted token)."""
    inserted = [i for i, m in enumerate(c.loss_mask) if not m]
    return list(c.token_ids[inserted[-1] + 1 :] if inserted else c.token_ids)


@dataclass
class _Baseline:
    who: str  # 'base model <name>' | 'fork parent <uri> (step N)'
    groups: list[list[Generated]]
    cached: bool
    note: str | None


def _baseline(
    artifact: _Artifact,
    rendered: list[list[int]],
    cfg: ProbeConfig,
    cache_dir: Path,
    baseline_cache: Path,
    episodes=None,
) -> _Baseline:
    """The starting point's completions on the same prompts with the same settings: the fork's parent checkpoint,
    else the base model; from the cache when it holds them, else sampled and cached."""
    parent, note = None, None
    parent_uri = (artifact.checkpoint.manifest.get("lineage") or {}).get("fork_checkpoint")
    if parent_uri:
        try:
            parent = fetch_checkpoint(str(parent_uri), cache_dir)
        except (CheckpointError, OSError, ValueError) as e:
            note = f"the fork's parent {parent_uri} could not be read ({e}); compared with the base model instead"
    if parent is not None:
        who = f"fork parent {parent_uri} (step {parent.step})"
        whose = {"base": artifact.identity, "parent_files": _digest(parent.manifest.get("files"))}
    else:
        who, whose = f"base model {artifact.model_cfg.name_or_path}", {"base": artifact.identity}
    settings = {
        "n": cfg.n,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "seed": cfg.seed,
        "device": artifact.device.type,
        "dtype": str(next(artifact.model.parameters()).dtype),
        "engine": "hf",
        **({"environment": episodes[0].env.name} if episodes else {}),
    }
    key = _digest({"version": BASELINE_CACHE_VERSION, "model": whose, "prompts": rendered, "settings": settings})
    path = baseline_cache / f"{key[:32]}.json"
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
            return _Baseline(who, [[Generated(**g) for g in group] for group in stored["groups"]], True, note)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # an unreadable cache entry is sampled again and replaced
    groups = _sample_baseline(artifact, parent, rendered, cfg, episodes)
    baseline_cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(
        json.dumps(
            {
                "who": who,
                "model": whose,
                "settings": settings,
                "groups": [[asdict(g) for g in group] for group in groups],
            }
        )
    )
    os.replace(tmp, path)
    return _Baseline(who, groups, False, note)


def _sample_baseline(
    artifact: _Artifact, parent: Checkpoint | None, rendered: list[list[int]], cfg: ProbeConfig, episodes=None
) -> list[list[Generated]]:
    model, tokenizer, device = artifact.model, artifact.tokenizer, artifact.device
    if parent is None and artifact.checkpoint.adapter_dir is not None and hasattr(model, "disable_adapter"):
        with model.disable_adapter():  # the base model itself, without a second load
            return _sample(model, tokenizer, device, rendered, cfg, episodes)
    model_cfg, lora_cfg = artifact.model_cfg, artifact.lora_cfg
    if parent is not None:
        start, _ = parent.load_policy(model_cfg, lora_cfg)
    else:
        start, _ = load_policy(model_cfg, lora_cfg.model_copy(update={"enabled": False}), trainable=False)
    try:
        return _sample(start, tokenizer, device, rendered, cfg, episodes)
    finally:
        del start


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _expected_lengths(prompts: list[dict], cfg: ProbeConfig, base_groups) -> list[int | None]:
    """Per prompt, the characters a normal answer takes ('too_long' beyond length_factor x): the prompt file's
    expected_length, else probe.expected_length, else the baseline's median length on that prompt."""
    out = []
    for i, p in enumerate(prompts):
        median = statistics.median(len(g.text) for g in base_groups[i]) if base_groups else None
        out.append(
            p["expected_length"] or cfg.expected_length or (max(1, round(median)) if median is not None else None)
        )
    return out


def _classify(
    prompts: list[dict], groups: list[list[Generated]], expected: list[int | None], tag: str | None, cfg: ProbeConfig
) -> tuple[list[ProbeSample], list[PromptResult]]:
    samples, per_prompt = [], []
    for i, (p, group) in enumerate(zip(prompts, groups)):
        counts: Counter = Counter()
        mine = []
        for j, g in enumerate(group):
            reasons = classify(
                g.text,
                g.token_ids,
                g.finish_reason,
                cfg.max_tokens,
                format_tag=tag,
                expected_length=expected[i],
                length_factor=cfg.length_factor,
            )
            counts.update(reason_code(r) for r in reasons)
            mine.append(
                ProbeSample(i, p["prompt"], j, g.text, reasons, bool(reasons), len(g.token_ids), g.finish_reason)
            )
        bad = sum(s.malformed for s in mine)
        samples += mine
        per_prompt.append(
            PromptResult(
                i,
                p["prompt"],
                p["answer"],
                expected[i],
                len(group),
                bad,
                bad / len(group),
                {r: counts.get(r, 0) for r in REASONS},
                sum(len(g.token_ids) for g in group) / len(group),
            )
        )
    return samples, per_prompt


def _baseline_summary(
    baseline: _Baseline, prompts, expected, tag, cfg: ProbeConfig, samples: list[ProbeSample]
) -> Baseline:
    base_samples, base_prompts = _classify(prompts, baseline.groups, expected, tag, cfg)
    n, bad = len(base_samples), sum(s.malformed for s in base_samples)
    ours = sum(s.malformed for s in samples)
    return Baseline(
        model=baseline.who,
        n_samples=n,
        n_malformed=bad,
        malformed_rate=bad / n,
        malformed_ci=wilson_interval(bad, n),
        reason_counts={r: sum(p.reason_counts[r] for p in base_prompts) for r in REASONS},
        per_prompt_malformed=[p.n_malformed for p in base_prompts],
        per_prompt_mean_tokens=[p.mean_tokens for p in base_prompts],
        p_value=excess_p_value(ours, len(samples), bad, n),
        cached=baseline.cached,
        note=baseline.note,
        samples=base_samples,
    )


def _report(
    uri: str, artifact: _Artifact, sampled: _Sampled, settings: dict, cfg: ProbeConfig, seconds: float
) -> ProbeReport:
    checkpoint, checks, samples, per_prompt = artifact.checkpoint, artifact.checks, sampled.samples, sampled.per_prompt
    n, bad = len(samples), sum(s.malformed for s in samples)
    rate, ci = bad / n, wilson_interval(bad, n)
    reason_counts = {r: sum(p.reason_counts[r] for p in per_prompt) for r in REASONS}
    failures = _failures(checks, bad, n, ci, reason_counts, sampled.baseline, cfg)
    return ProbeReport(
        checkpoint=str(uri),
        local_path=str(checkpoint.path),
        step=checkpoint.step,
        base_model=artifact.model_cfg.name_or_path,
        trained_on=checkpoint.base_model.get("name_or_path"),
        code_ref=checkpoint.code_ref,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        seconds=round(seconds, 3),
        n_prompts=len(per_prompt),
        n_samples=n,
        n_malformed=bad,
        malformed_rate=rate,
        malformed_ci=ci,
        reason_counts=reason_counts,
        parity_ok=checks["parity"].ok,
        parity_max_diff=artifact.parity_diff,
        parity_tolerance=cfg.parity_tolerance,
        checks=checks,
        failures=failures,
        per_prompt=per_prompt,
        samples=samples,
        settings=settings,
        baseline=sampled.baseline,
    )


def _failures(
    checks: dict, bad: int, n: int, ci: list[float], reason_counts: dict, baseline: Baseline | None, cfg: ProbeConfig
) -> list[str]:
    """Why the probe fails: the checks that did not pass, the absolute cap, the significant excess over the
    baseline; [] when it passes."""
    rate = bad / n
    common = ", ".join(f"{r} {k}" for r, k in sorted(reason_counts.items(), key=lambda kv: -kv[1]) if k) or "none"
    versus = f" vs {baseline.malformed_rate:.1%} for the {baseline.model}" if baseline else ""
    failures = [c.detail for c in checks.values() if not c.ok]
    if rate > cfg.max_malformed_rate:
        base_too = (
            f"; the {baseline.model} is at {baseline.malformed_rate:.1%} itself, so the probe's settings may "
            "not fit this model (raise probe.max_tokens, or probe.max_malformed_rate)"
            if baseline and baseline.malformed_rate > cfg.max_malformed_rate
            else ""
        )
        failures.append(
            f"malformed rate {bad}/{n} = {rate:.1%} (95% CI {ci[0]:.1%}-{ci[1]:.1%}){versus} exceeds "
            f"probe.max_malformed_rate={cfg.max_malformed_rate:g}; reasons: {common}{base_too}; read the "
            "samples in the report"
        )
    if baseline and rate - baseline.malformed_rate > cfg.max_malformed_increase and baseline.p_value < cfg.significance:
        failures.append(
            f"malformed rate {rate:.1%}{versus}: {rate - baseline.malformed_rate:+.1%}, more than "
            f"probe.max_malformed_increase={cfg.max_malformed_increase:g} (one-sided Fisher exact "
            f"p={baseline.p_value:.2g} < probe.significance={cfg.significance:g}); reasons: {common}; "
            "training made the model write malformed text its starting point did not — read the samples "
            "in the report"
        )
    return failures
