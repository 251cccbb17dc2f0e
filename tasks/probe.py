"""The artifact probe: reload a saved checkpoint in a fresh engine, sample fixed prompts, and say
whether what comes out is healthy — before anyone ships it.

    ballast probe CHECKPOINT [--prompts FILE] [--n 6] [--temperature 0.7] [--max-tokens 512] ...

`probe_checkpoint()` is a plain function (flows/pipeline.py wraps it in a Prefect task). Step by step:

1. **Fetch and verify.** The artifact (local path or s3://) is fetched (tasks.store.fetch) and its
   manifest verified: every file's sha256 (trainer.checkpoint.verify_checkpoint).
2. **Identity checks, from the manifest.** The base model it was trained on (config and weights
   sha256) against the base the probe loads; the saved `adapter/adapter_config.json` (r, lora_alpha,
   target modules) against the LoRA settings the run trained with (manifest "lora").
3. **Fresh load.** Base model + adapter are loaded *from the artifact* into a new model
   (trainer.model.load_policy) and a new HF engine — never the trainer's in-memory weights. The
   tokenizer is the checkpoint's own `tokenizer/` (what the run trained with), compared with the
   base model's tokenizer: vocabulary, special tokens, chat template, and the rendered prompts.
4. **Parity.** The manifest's fingerprint sequence is teacher-forced through the reloaded model;
   the max |logprob difference| to the values recorded at save time must be within
   `probe.parity_tolerance`. This catches a rescaled adapter, an adapter applied twice, a changed
   LoRA alpha, a different base model — whatever makes "the model saved" differ from "the model
   reloaded".
5. **Sampling and classification.** Each probe prompt is rendered with the chat template (as in
   training), sampled `n` times at `temperature` / `max_tokens` / `seed` in one batch, and every
   completion is classified by trainer.health.classify — the same detectors as the trainer's
   collapse metrics: repetition_loop, length_cap, format_missing (`format_tag`), garbage, too_long.

**Pass or fail.** `passed` is true when there is no entry in `failures`: the identity checks hold,
parity holds, and `malformed_rate <= probe.max_malformed_rate` (the point estimate; the Wilson
interval is reported beside it). Each failure is one sentence that names what is wrong and what to do.

**An artifact that cannot be loaded at all** — missing, incomplete (saved mid-write), altered after
saving, or weights that do not fit their adapter config — raises `ProbeError` with the reason, since
there is nothing to sample: `ballast probe` prints it and exits 1; in the pipeline the probe stage
fails with it. A missing local path raises FileNotFoundError.

**Probe prompts** live in files: `.jsonl` with {"prompt": ..., optional "answer" (a reference
completion), optional "expected_length" (characters)}, or `.txt` with one prompt per line. The
shipped default (`tasks/probe_prompts/default.jsonl`) fits the quickstart's arithmetic model and its
`<output>` format; a real model should point `probe.prompts_file` to prompts of its own task.
The expected length of a prompt's answer (for too_long) is its "expected_length", else
`probe.expected_length`, else the length of its "answer", else unchecked; too_long fires beyond
`probe.length_factor` (3) times it.

**The report** (JSON, `schema_version` 1; keys are stable, new keys may be added):

    schema_version      1
    kind                "ballast-probe-report"
    checkpoint          the URI probed;  local_path: where it was read from
    step                the checkpoint's step (manifest)
    base_model          the base model loaded (name_or_path);  trained_on: the manifest's base model
    code_ref            {"commit", "dirty"} of the code that saved the checkpoint (manifest)
    created_at, seconds when the probe ran and how long it took
    n_prompts, n_samples, n_malformed      counts; a sample is malformed when it has any reason
    malformed_rate      n_malformed / n_samples
    malformed_ci        [lo, hi]: Wilson score interval at ci_level (0.95)
    reason_counts       {reason code: samples with that reason}, every code of trainer.health.REASONS
    parity_ok           the reloaded artifact reproduces its save-time logprobs within tolerance
    parity_max_diff     max |logprob difference| (null when the manifest has no fingerprint)
    parity_tolerance    the tolerance used
    checks              {"base_model" | "adapter_config" | "tokenizer" | "parity": {"ok", "detail"}}
    passed              no failures
    failures            human-actionable sentences, one per failed check
    per_prompt          [{index, prompt, answer, expected_length, n_samples, n_malformed,
                          malformed_rate, reason_counts, mean_tokens}]
    samples             [{prompt_index, prompt, sample, text, reasons, malformed, n_tokens, finish_reason}]
    settings            {n, temperature, max_tokens, format_tag, expected_length, length_factor,
                         max_malformed_rate, seed, prompts_file, engine, device}

`write_probe_html()` renders the same report as one self-contained HTML page.
"""
from __future__ import annotations

import html
import json
import time
from collections import Counter
from pathlib import Path
from typing import Optional

from trainer.checkpoint import CheckpointError, verify_checkpoint
from trainer.config import LoraConfig, ModelConfig
from trainer.health import REASONS, classify, reason_code

SCHEMA_VERSION = 1
REPORT_KIND = "ballast-probe-report"
CI_LEVEL = 0.95
DEFAULT_PROMPTS = Path(__file__).resolve().parent / "probe_prompts" / "default.jsonl"
DEFAULT_CACHE = Path(".ballast") / "cache" / "probe"
SHOW_DIFFS = 3  # examples quoted in a tokenizer-mismatch message


class ProbeError(ValueError):
    """The artifact cannot be probed at all (missing, incomplete, altered, unloadable); the message says why and what to do."""


# ── probe prompts ──────────────────────────────────────────────────────────────────────────────────

def load_probe_prompts(path: str | Path | None = None) -> list[dict]:
    """Probe prompts from a .jsonl ({"prompt", optional "answer", optional "expected_length"}) or a
    .txt (one prompt per line) file; the shipped default set when `path` is None."""
    path = Path(path).expanduser() if path is not None else DEFAULT_PROMPTS
    if not path.is_file():
        raise FileNotFoundError(f"probe prompts file {path} does not exist; set probe.prompts_file (or --prompts) to a "
                                ".jsonl or .txt file, or leave it unset for the default set")
    prompts: list[dict] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".txt":
        prompts = [{"prompt": line.rstrip("\n")} for line in lines if line.strip()]
    elif path.suffix == ".jsonl":
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e}); each line must be an object with a 'prompt'") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
                raise ValueError(f"{path}:{lineno}: each line must be a JSON object with a non-empty 'prompt' string")
            unknown = set(row) - {"prompt", "answer", "expected_length"}
            if unknown:
                raise ValueError(f"{path}:{lineno}: unknown field(s) {sorted(unknown)}; allowed: prompt, answer, expected_length")
            expected = row.get("expected_length")
            if expected is not None and (not isinstance(expected, int) or expected < 1):
                raise ValueError(f"{path}:{lineno}: expected_length must be a positive integer (characters), got {expected!r}")
            prompts.append({"prompt": row["prompt"], "answer": row.get("answer"), "expected_length": expected})
    else:
        raise ValueError(f"probe prompts file {path} must be .jsonl or .txt")
    if not prompts:
        raise ValueError(f"probe prompts file {path} holds no prompts")
    for p in prompts:
        p.setdefault("answer", None)
        p.setdefault("expected_length", None)
    return prompts


# ── statistics ─────────────────────────────────────────────────────────────────────────────────────

def wilson_interval(k: int, n: int, level: float = CI_LEVEL) -> list[float]:
    """[lo, hi] Wilson score interval of a binomial proportion k/n; [0, 1] when n is 0."""
    if n == 0:
        return [0.0, 1.0]
    from scipy.stats import binomtest
    ci = binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
    return [max(0.0, float(ci.low)), min(1.0, float(ci.high))]


# ── the checks ─────────────────────────────────────────────────────────────────────────────────────

def _check_base_model(manifest: dict, model_cfg: ModelConfig) -> tuple[bool, str]:
    from trainer.model import model_identity

    saved = manifest.get("base_model") or {}
    if not saved:
        return True, "the manifest records no base model; not checked"
    now = model_identity(model_cfg)
    compared = False
    for key in ("config_sha256", "weights_sha256"):
        if key in saved and key in now:
            compared = True
            if saved[key] != now[key]:
                return False, (f"wrong base model: the checkpoint was trained on {saved.get('name_or_path')!r} ({key} "
                               f"{_short(saved[key])}) but the probe loaded {model_cfg.name_or_path!r} ({key} {_short(now[key])}); "
                               "point model.name_or_path (or --base) at the base model the run trained on")
    if not compared and saved.get("name_or_path") != model_cfg.name_or_path:
        return False, (f"wrong base model: the checkpoint was trained on {saved.get('name_or_path')!r} but the probe loaded "
                       f"{model_cfg.name_or_path!r}; point model.name_or_path (or --base) at the base model the run trained on")
    return True, f"trained on {saved.get('name_or_path')!r}; loaded {model_cfg.name_or_path!r}" + (" (same hashes)" if compared else "")


def _short(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {str(v)[:12]}" for k, v in sorted(value.items())) + "}"
    return str(value)[:16]


def _check_adapter_config(local: Path, manifest: dict) -> tuple[bool, str]:
    trained = manifest.get("lora")
    path = local / "adapter" / "adapter_config.json"
    if not trained or not path.is_file():
        return True, "no LoRA settings in the manifest or no adapter_config.json; not checked"
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        return False, f"adapter/adapter_config.json is not valid JSON ({e}); the adapter config was corrupted — restore it from the run"
    problems = []
    if saved.get("r") != trained.get("r"):
        problems.append(f"r={saved.get('r')} but the run trained with lora.r={trained.get('r')}")
    if saved.get("lora_alpha") is not None and trained.get("alpha") is not None and float(saved["lora_alpha"]) != float(trained["alpha"]):
        problems.append(f"lora_alpha={saved['lora_alpha']:g} but the run trained with lora.alpha={trained['alpha']:g}")
    targets_saved, targets_trained = saved.get("target_modules"), trained.get("target_modules")
    if isinstance(targets_saved, list) and targets_trained and set(targets_saved) != set(targets_trained):
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
        return False, ("adapter config differs from the training config in the manifest: " + "; ".join(problems) + scale_note +
                       " — the adapter was saved or edited with the wrong LoRA settings; restore adapter_config.json "
                       "from the run or fix the code that writes it")
    return True, f"r={saved.get('r')}, lora_alpha={saved.get('lora_alpha')} as trained"


def _load_tokenizer_dir(path: Path):
    """The checkpoint's saved tokenizer, set up like trainer.model.load_tokenizer (left padding, a pad token)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _check_tokenizer(saved, base, prompts: list[dict]) -> tuple[bool, str]:
    """Does the checkpoint's tokenizer/ encode like the base model's? Differences, most telling first."""
    from trainer.data import render_prompt

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
                a, b = render_prompt(saved, p["prompt"]), render_prompt(base, p["prompt"])
            except Exception as e:  # a template that cannot render is itself a mismatch worth naming
                diffs.append(f"rendering prompt {p['prompt']!r} failed: {e}")
                break
            if a != b:
                diffs.append(f"prompt {p['prompt']!r} renders to different token ids")
                break
    if diffs:
        return False, ("tokenizer mismatch: the checkpoint's tokenizer/ differs from the base model's (" + "; ".join(diffs) +
                       "); a model served with the base tokenizer will see other token ids than it was trained on — "
                       "find which tokenizer the run trained with and serve (and re-save) that one")
    return True, "the checkpoint's tokenizer/ matches the base model's"


def _load_full_model(model_dir: Path, model_cfg: ModelConfig):
    """(model, base tokenizer) of a full fine-tuning checkpoint: its weights, the base model's tokenizer, frozen."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.model import ensure_model, load_tokenizer, resolve_device

    tokenizer = load_tokenizer(ensure_model(model_cfg))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, model_cfg.dtype),
                                                 trust_remote_code=model_cfg.trust_remote_code)
    model.to(resolve_device(model_cfg.device)).eval().requires_grad_(False)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


# ── the probe ──────────────────────────────────────────────────────────────────────────────────────

def model_config_from_manifest(manifest: dict, device: str = "auto") -> ModelConfig:
    """The base model a checkpoint was trained on, as a ModelConfig (for probing without a spec)."""
    name = (manifest.get("base_model") or {}).get("name_or_path")
    if not name:
        raise ProbeError("the checkpoint's manifest does not name its base model; give the base model (--base or a --spec)")
    return ModelConfig(name_or_path=name, device=device)


def probe_checkpoint(checkpoint_uri: str, cfg, model_cfg: Optional[ModelConfig] = None, cache_dir: Path | None = None,
                     lora_cfg: Optional[LoraConfig] = None, engine: str = "hf") -> dict:
    """Probe the checkpoint at `checkpoint_uri` (local path or s3://) with ProbeConfig `cfg`; returns the report
    (see the module docstring). `model_cfg` is the base model to load (default: the one the manifest names).
    Raises ProbeError when the artifact cannot be loaded at all."""
    import torch

    from tasks.store import fetch
    from trainer.data import render_prompt
    from trainer.engines.base import SamplingParams
    from trainer.engines.hf import HFEngine
    from trainer.model import compare_fingerprint, ensure_model, load_policy, load_tokenizer

    if engine != "hf":
        raise ValueError(f"engine={engine!r}: the probe samples with the 'hf' engine (a fresh in-process model); use engine='hf'")
    started = time.perf_counter()
    prompts = load_probe_prompts(cfg.prompts_file)
    local = fetch(str(checkpoint_uri), Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE)

    # 1. the manifest and every file's hash
    try:
        manifest = verify_checkpoint(local)
    except CheckpointError as e:
        raise ProbeError(f"cannot probe {checkpoint_uri}: {e}. A checkpoint saved mid-write or altered afterwards cannot be "
                         "trusted; probe an earlier complete checkpoint") from None
    if model_cfg is None:
        model_cfg = model_config_from_manifest(manifest)
    lora_cfg = lora_cfg or LoraConfig()
    full_model = manifest.get("weights") == "model"

    # 2. identity checks from the manifest
    checks: dict[str, dict] = {}
    ok, detail = _check_base_model(manifest, model_cfg)
    checks["base_model"] = {"ok": ok, "detail": detail}
    ok, detail = _check_adapter_config(local, manifest)
    checks["adapter_config"] = {"ok": ok, "detail": detail}

    # 3. a fresh model from the artifact, on a base model that exists here
    try:
        load_tokenizer(ensure_model(model_cfg))
    except (OSError, ValueError) as e:
        raise ProbeError(f"cannot probe {checkpoint_uri}: its base model cannot be loaded here ({e}); give the base model "
                         "the run trained on with --base or model.name_or_path") from None
    try:
        if full_model:
            model, base_tokenizer = _load_full_model(local / "model", model_cfg)
        else:
            model, base_tokenizer = load_policy(model_cfg, lora_cfg.model_copy(update={"enabled": True}),
                                                adapter_path=str(local / "adapter"), trainable=False)
    except Exception as e:
        cause = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:400]}"
        if "safetensor" in type(e).__name__.lower() or "header" in str(e).lower():
            raise ProbeError(f"cannot load {checkpoint_uri}: its weights file is unreadable ({cause}); it was written only "
                             "partly (saved mid-write, with a manifest computed over the partial file) or corrupted — "
                             "probe an earlier complete checkpoint and fix the saver") from e
        hints = [c["detail"] for c in (checks["adapter_config"], checks["base_model"]) if not c["ok"]]
        raise ProbeError(f"cannot load {checkpoint_uri} onto base model {model_cfg.name_or_path!r} ({cause}): the saved weights "
                         "do not fit their adapter config or the base model" + "".join(f"; {h}" for h in hints) +
                         ("" if hints else "; check the base model and adapter/adapter_config.json")) from e
    device = next(model.parameters()).device
    tokenizer = base_tokenizer
    if (local / "tokenizer").is_dir():
        try:
            tokenizer = _load_tokenizer_dir(local / "tokenizer")
        except Exception as e:
            raise ProbeError(f"cannot load the tokenizer saved in {checkpoint_uri}/tokenizer: {type(e).__name__}: {e}; "
                             "the checkpoint's tokenizer files are corrupt — restore them from the run") from e
        ok, detail = _check_tokenizer(tokenizer, base_tokenizer, prompts)
    else:
        ok, detail = True, "the checkpoint has no tokenizer/; sampled with the base model's tokenizer"
    checks["tokenizer"] = {"ok": ok, "detail": detail}

    # 4. parity: teacher-forced logprobs of the reloaded artifact vs those recorded at save time
    fingerprint = manifest.get("fingerprint")
    parity_diff: Optional[float] = None
    parity_ok = False
    if not fingerprint:
        detail = ("parity not checked: the manifest has no logprob fingerprint (written by an older or foreign saver), so "
                  "nothing proves the reloaded artifact is the model that was trained; re-save it with Ballast")
    else:
        try:
            parity_diff = compare_fingerprint(model, tokenizer, device, fingerprint)
        except (IndexError, RuntimeError, ValueError) as e:  # e.g. token ids beyond a wrong base model's vocabulary
            detail = (f"parity failed: the reloaded artifact cannot be teacher-forced on the manifest's fingerprint "
                      f"({type(e).__name__}: {str(e).strip()[:200]}): it is not the model that was saved — check the base model")
        else:
            parity_ok = parity_diff <= cfg.parity_tolerance
            detail = (f"max |logprob diff| {parity_diff:.3g} <= {cfg.parity_tolerance:g}" if parity_ok else
                      f"parity failed: the reloaded artifact's teacher-forced logprobs on the manifest's fingerprint differ "
                      f"from those recorded at save time by up to {parity_diff:.3g} (tolerance {cfg.parity_tolerance:g}): "
                      "the model loaded from the artifact is not the model that was saved — adapter weights rescaled, "
                      "adapter applied twice or merged, LoRA alpha/r changed, or another base model; do not ship it, "
                      "find the step that changed the weights between training and saving")
    checks["parity"] = {"ok": parity_ok, "detail": detail}

    # 5. sample every prompt n times in one batch, classify every completion
    params = SamplingParams(n=cfg.n, max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=cfg.seed)
    prompt_ids = [render_prompt(tokenizer, p["prompt"]) for p in prompts]
    groups = HFEngine(model, tokenizer, device).generate(prompt_ids, params)
    samples, per_prompt = [], []
    for i, (p, group) in enumerate(zip(prompts, groups)):
        expected = p["expected_length"] or cfg.expected_length or (len(p["answer"]) if p["answer"] else None)
        counts: Counter = Counter()
        n_bad = 0
        for j, c in enumerate(group):
            reasons = classify(c.text, c.token_ids, c.finish_reason, cfg.max_tokens, format_tag=cfg.format_tag,
                               expected_length=expected, length_factor=cfg.length_factor)
            counts.update(reason_code(r) for r in reasons)
            n_bad += bool(reasons)
            samples.append({"prompt_index": i, "prompt": p["prompt"], "sample": j, "text": c.text, "reasons": reasons,
                            "malformed": bool(reasons), "n_tokens": len(c.token_ids), "finish_reason": c.finish_reason})
        per_prompt.append({"index": i, "prompt": p["prompt"], "answer": p["answer"], "expected_length": expected,
                           "n_samples": len(group), "n_malformed": n_bad, "malformed_rate": n_bad / len(group),
                           "reason_counts": {r: counts.get(r, 0) for r in REASONS},
                           "mean_tokens": sum(len(c.token_ids) for c in group) / len(group)})
    del model, groups
    if device.type == "cuda":
        torch.cuda.empty_cache()

    n = len(samples)
    n_bad = sum(s["malformed"] for s in samples)
    rate = n_bad / n
    ci = wilson_interval(n_bad, n)
    reason_counts = {r: sum(pp["reason_counts"][r] for pp in per_prompt) for r in REASONS}

    failures = [c["detail"] for name, c in checks.items() if not c["ok"]]
    if rate > cfg.max_malformed_rate:
        common = ", ".join(f"{r} {k}" for r, k in sorted(reason_counts.items(), key=lambda kv: -kv[1]) if k)
        failures.append(f"malformed rate {n_bad}/{n} = {rate:.1%} (95% CI {ci[0]:.1%}-{ci[1]:.1%}) exceeds "
                        f"probe.max_malformed_rate={cfg.max_malformed_rate:g}; reasons: {common}; read the samples in the report")

    return {
        "schema_version": SCHEMA_VERSION,
        "kind": REPORT_KIND,
        "checkpoint": str(checkpoint_uri),
        "local_path": str(local),
        "step": manifest.get("step"),
        "base_model": model_cfg.name_or_path,
        "trained_on": (manifest.get("base_model") or {}).get("name_or_path"),
        "code_ref": manifest.get("code_ref"),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.perf_counter() - started, 3),
        "n_prompts": len(prompts),
        "n_samples": n,
        "n_malformed": n_bad,
        "malformed_rate": rate,
        "malformed_ci": ci,
        "ci_level": CI_LEVEL,
        "reason_counts": reason_counts,
        "parity_ok": parity_ok,
        "parity_max_diff": parity_diff,
        "parity_tolerance": cfg.parity_tolerance,
        "checks": checks,
        "passed": not failures,
        "failures": failures,
        "per_prompt": per_prompt,
        "samples": samples,
        "settings": {"n": cfg.n, "temperature": cfg.temperature, "max_tokens": cfg.max_tokens, "format_tag": cfg.format_tag,
                     "expected_length": cfg.expected_length, "length_factor": cfg.length_factor,
                     "max_malformed_rate": cfg.max_malformed_rate, "seed": cfg.seed,
                     "prompts_file": str(cfg.prompts_file or DEFAULT_PROMPTS), "engine": engine, "device": str(device)},
    }


# ── reading a report ───────────────────────────────────────────────────────────────────────────────

def summary_lines(report: dict) -> list[str]:
    """A few lines for a terminal: verdict, totals, reasons, per prompt, failures."""
    lo, hi = report["malformed_ci"]
    diff = report.get("parity_max_diff")
    lines = [
        f"probe {'PASSED' if report['passed'] else 'FAILED'}: {report['checkpoint']} (step {report.get('step')})",
        f"  malformed {report['n_malformed']}/{report['n_samples']} = {report['malformed_rate']:.1%} "
        f"(95% CI {lo:.1%}-{hi:.1%}; threshold {report['settings']['max_malformed_rate']:g})",
        f"  parity {'ok' if report['parity_ok'] else 'FAILED'}: max |logprob diff| "
        f"{'n/a' if diff is None else f'{diff:.3g}'} (tolerance {report['parity_tolerance']:g})",
        "  reasons: " + (", ".join(f"{r} {k}" for r, k in report["reason_counts"].items() if k) or "none"),
    ]
    for p in report["per_prompt"]:
        lines.append(f"  prompt {p['index']}: {p['n_malformed']}/{p['n_samples']} malformed  {p['prompt'][:60]!r}")
    lines += [f"  FAILURE: {f}" for f in report["failures"]]
    return lines


def write_probe_html(report: dict, path: str | Path) -> Path:
    """One self-contained, readable HTML page: verdict banner, totals, interval, reasons, per prompt, every sample."""
    e = lambda x: html.escape(str(x))  # noqa: E731
    lo, hi = report["malformed_ci"]
    passed = report["passed"]
    diff = report.get("parity_max_diff")
    banner = (f"<div class='banner {'pass' if passed else 'fail'}'>{'PASSED' if passed else 'FAILED'} — "
              f"{report['n_malformed']} of {report['n_samples']} samples malformed ({report['malformed_rate']:.1%}), "
              f"parity {'ok' if report['parity_ok'] else 'FAILED'}</div>")
    failures = "".join(f"<li>{e(f)}</li>" for f in report["failures"])
    totals = {
        "checkpoint": report["checkpoint"], "step": report.get("step"), "base model": report["base_model"],
        "trained on": report.get("trained_on"), "code ref": json.dumps(report.get("code_ref")),
        "samples": f"{report['n_samples']} ({report['n_prompts']} prompts x {report['settings']['n']})",
        "malformed": f"{report['n_malformed']} = {report['malformed_rate']:.1%}",
        f"{report.get('ci_level', CI_LEVEL):.0%} Wilson interval": f"{lo:.1%} – {hi:.1%}",
        "threshold": f"{report['settings']['max_malformed_rate']:g}",
        "parity": f"{'ok' if report['parity_ok'] else 'FAILED'}: max |logprob diff| {'n/a' if diff is None else f'{diff:.3g}'} "
                  f"(tolerance {report['parity_tolerance']:g})",
        "settings": ", ".join(f"{k}={v}" for k, v in report["settings"].items()),
        "probed": f"{report.get('created_at')} in {report.get('seconds')} s",
    }
    totals_html = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in totals.items())
    checks_html = "".join(f"<tr class='{'ok' if c['ok'] else 'bad'}'><th>{e(name)}</th><td>{'ok' if c['ok'] else 'FAILED'}</td>"
                          f"<td>{e(c['detail'])}</td></tr>" for name, c in report.get("checks", {}).items())
    reasons_html = "".join(f"<tr><th>{e(r)}</th><td>{k}</td></tr>" for r, k in report["reason_counts"].items())
    head = "".join(f"<th>{e(r)}</th>" for r in report["reason_counts"])
    prompt_rows = "".join(
        f"<tr><td>{p['index']}</td><td><code>{e(p['prompt'])}</code></td><td>{p['n_malformed']}/{p['n_samples']}</td>"
        f"<td>{p['mean_tokens']:.1f}</td>" + "".join(f"<td>{p['reason_counts'].get(r, 0)}</td>" for r in report["reason_counts"])
        + "</tr>" for p in report["per_prompt"])
    sample_rows = "".join(
        f"<tr class='{'bad' if s['malformed'] else 'ok'}'><td>{s['prompt_index']}.{s['sample']}</td>"
        f"<td><code>{e(s['prompt'])}</code></td><td><pre>{e(s['text'])}</pre></td>"
        f"<td>{'<br>'.join(e(r) for r in s['reasons']) or 'ok'}</td><td>{s['n_tokens']}</td><td>{e(s['finish_reason'])}</td></tr>"
        for s in report["samples"])
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Probe {e(report['checkpoint'])}</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;max-width:1300px}}
table{{border-collapse:collapse;margin:0.5em 0 1.5em}} th,td{{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}}
.banner{{font-size:1.3em;font-weight:bold;padding:0.6em 1em;border-radius:6px;color:#fff}}
.pass{{background:#2e7d32}} .fail{{background:#c62828}}
tr.bad td{{background:#fdecea}} pre{{white-space:pre-wrap;word-break:break-all;margin:0;max-width:700px}}
</style></head><body>
<h1>Artifact probe</h1>
{banner}
{f"<h2>Failures</h2><ul>{failures}</ul>" if failures else ""}
<h2>Totals</h2><table>{totals_html}</table>
<h2>Checks</h2><table>{checks_html}</table>
<h2>Reasons</h2><table>{reasons_html}</table>
<h2>Per prompt</h2><table><tr><th>#</th><th>prompt</th><th>malformed</th><th>mean tokens</th>{head}</tr>{prompt_rows}</table>
<h2>Samples</h2><table><tr><th>#</th><th>prompt</th><th>completion</th><th>reasons</th><th>tokens</th><th>finish</th></tr>{sample_rows}</table>
</body></html>
"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
