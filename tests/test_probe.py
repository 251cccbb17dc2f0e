"""The artifact probe on real saved checkpoints: a healthy quickstart checkpoint passes; checkpoints
broken the ways the field has seen each fail, by parity, by malformed outputs or by an identity
check, with a reason a person can act on.

The broken variants are made from one real checkpoint (a short quickstart training run). Where the
scenario is "buggy code saved it that way", the manifest's hashes are re-written after the change,
so it is parity, the outputs or the identity checks that catch it — not the hash check.
"""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tasks.probe import (
    ProbeError,
    format_tag_for,
    load_probe_prompts,
    model_config_from_manifest,
    probe_checkpoint,
    wilson_interval,
)
from tasks.results import REPORT_KIND, ProbeReport
from tasks.spec import ProbeConfig, load_spec
from tests.conftest import REPO
from trainer.checkpoint import MANIFEST, list_checkpoints, sha256_file
from trainer.health import REASONS, classify, reason_code

SMALL_PROBE = ProbeConfig(n=4, temperature=0.7, max_tokens=32, expected_length=20)
REPORT_FIELDS = {
    "schema_version",
    "checkpoint",
    "step",
    "base_model",
    "n_prompts",
    "n_samples",
    "n_malformed",
    "malformed_rate",
    "malformed_ci",
    "reason_counts",
    "parity_ok",
    "parity_max_diff",
    "parity_tolerance",
    "passed",
    "failures",
    "per_prompt",
    "samples",
    "settings",
}


# ── fixtures: one real quickstart checkpoint, and variants of it ──────────────────────────────────


@pytest.fixture(scope="module")
def quickstart(tiny_model, tmp_path_factory):
    """The quickstart spec on the tiny model, trained briefly (4 steps, smaller batch)."""
    from trainer.loop import GRPOTrainer

    root = tmp_path_factory.mktemp("probe-quickstart")
    spec = load_spec(
        REPO / "examples" / "quickstart.yaml",
        [
            f"model.name_or_path={tiny_model}",
            f"project_dir={root}",
            "optim.steps=4",
            "checkpoint.every=4",
            "grpo.num_generations=4",
            "grpo.prompts_per_step=4",
            "eval.every=0",
        ],
    )
    trainer = GRPOTrainer(spec.trainer_config(), root / "run", progress=False)
    trainer.train()
    trainer.close()
    return spec, list_checkpoints(root / "run" / "checkpoints")[-1][1]


@pytest.fixture(scope="module")
def healthy_report(quickstart, tmp_path_factory):
    spec, ckpt = quickstart
    return probe_checkpoint(
        str(ckpt), spec.probe, spec.model, tmp_path_factory.mktemp("cache"), lora_cfg=spec.lora
    ).to_dict()


@pytest.fixture(scope="module")
def wrong_base(tmp_path_factory):
    """A second tiny model of the same architecture, another seed, barely warmed up."""
    from trainer.tiny import build_tiny_arith

    return build_tiny_arith(tmp_path_factory.mktemp("wrong-base") / "model", seed=1, warmup_steps=1, progress=False)


def rehash(ckpt: Path) -> None:
    """Re-write the manifest's sha256s: the checkpoint is then what buggy code would have saved."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"] = {
        str(p.relative_to(ckpt)): sha256_file(p) for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name != MANIFEST
    }
    (ckpt / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def variant(quickstart, tmp_path, change, saved_that_way=True) -> Path:
    _, ckpt = quickstart
    out = tmp_path / "step-000004"
    shutil.copytree(ckpt, out)
    change(out)
    if saved_that_way:
        rehash(out)
    return out


def probe(quickstart, ckpt, tmp_path, model_cfg=None, cfg=SMALL_PROBE) -> dict:
    spec, _ = quickstart
    return probe_checkpoint(str(ckpt), cfg, model_cfg or spec.model, tmp_path / "cache", lora_cfg=spec.lora).to_dict()


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def scale_lora_b(factor: float):
    def change(ckpt: Path) -> None:
        path = ckpt / "adapter" / "adapter_model.safetensors"
        weights = load_file(str(path))
        save_file({k: v * factor if "lora_B" in k else v for k, v in weights.items()}, str(path))

    return change


# ── a healthy checkpoint ───────────────────────────────────────────────────────────────────────────


def test_healthy_quickstart_checkpoint_passes(healthy_report):
    r = healthy_report
    assert r["passed"], r["failures"]
    assert r["failures"] == []
    assert r["parity_ok"] and r["parity_max_diff"] <= r["parity_tolerance"]
    assert r["malformed_rate"] <= r["settings"]["max_malformed_rate"]
    assert all(c["ok"] for c in r["checks"].values())


def test_report_has_the_documented_fields_and_counts(healthy_report, quickstart):
    spec, ckpt = quickstart
    r = healthy_report
    assert REPORT_FIELDS <= set(r)
    assert r["schema_version"] == 1 and r["kind"] == REPORT_KIND
    assert r["checkpoint"] == str(ckpt) and r["step"] == 4
    n_prompts = spec.probe.num_prompts  # the first held-out prompts of the experiment's data
    assert r["n_prompts"] == n_prompts and r["n_samples"] == n_prompts * spec.probe.n == len(r["samples"])
    assert r["n_malformed"] == sum(s["malformed"] for s in r["samples"])
    assert r["malformed_ci"] == wilson_interval(r["n_malformed"], r["n_samples"])
    assert set(r["reason_counts"]) == set(REASONS)
    assert [p["n_samples"] for p in r["per_prompt"]] == [spec.probe.n] * n_prompts
    assert r["settings"]["temperature"] == 0.7 and r["settings"]["max_tokens"] == 48
    sample = r["samples"][0]
    assert set(sample) >= {"prompt", "text", "reasons", "n_tokens", "finish_reason"}
    json.dumps(r, allow_nan=False)  # strict JSON


def test_probe_reads_the_checkpoint_from_s3(quickstart, s3_bucket, tmp_path):
    from infra.store import open_store

    spec, ckpt = quickstart
    uri = open_store(f"s3://{s3_bucket}/runs").put_dir(ckpt, "run-1/step-000004")
    r = probe_checkpoint(uri, SMALL_PROBE, spec.model, tmp_path / "cache", lora_cfg=spec.lora).to_dict()
    assert r["checkpoint"] == uri and r["passed"], r["failures"]


def test_probe_without_a_model_config_loads_the_manifests_base(quickstart, tmp_path):
    spec, ckpt = quickstart
    r = probe_checkpoint(str(ckpt), SMALL_PROBE, None, tmp_path / "cache").to_dict()
    assert r["base_model"] == spec.model.name_or_path and r["passed"]


def test_full_fine_tuning_checkpoint_passes(tiny_model, tmp_path):
    from trainer.loop import GRPOTrainer

    spec = load_spec(
        REPO / "examples" / "quickstart.yaml",
        [
            f"model.name_or_path={tiny_model}",
            f"project_dir={tmp_path}",
            "lora.enabled=false",
            "optim.steps=2",
            "optim.learning_rate=1e-5",
            "checkpoint.every=2",
            "grpo.num_generations=4",
            "grpo.prompts_per_step=2",
            "eval.every=0",
        ],
    )
    trainer = GRPOTrainer(spec.trainer_config(), tmp_path / "run", progress=False)
    trainer.train()
    trainer.close()
    ckpt = list_checkpoints(tmp_path / "run" / "checkpoints")[-1][1]
    assert (ckpt / "model").is_dir()
    r = probe_checkpoint(str(ckpt), SMALL_PROBE, spec.model, tmp_path / "cache", lora_cfg=spec.lora).to_dict()
    assert r["parity_ok"] and r["passed"], r["failures"]


# ── broken the ways the field has seen ─────────────────────────────────────────────────────────────


def test_adapter_weights_scaled_up_fail_parity_and_outputs(quickstart, tmp_path):
    r = probe(quickstart, variant(quickstart, tmp_path, scale_lora_b(256.0)), tmp_path)
    assert not r["passed"]
    assert not r["parity_ok"] and r["parity_max_diff"] > 1.0
    assert r["malformed_rate"] > 0.5
    assert any(f.startswith("parity failed") and "rescaled" in f for f in r["failures"])
    assert any(f.startswith("malformed rate") for f in r["failures"])


def test_lora_alpha_changed_in_adapter_config_fails_with_both_values(quickstart, tmp_path):
    r = probe(
        quickstart,
        variant(quickstart, tmp_path, lambda c: edit_json(c / "adapter" / "adapter_config.json", lora_alpha=256)),
        tmp_path,
    )
    assert not r["passed"] and not r["parity_ok"]
    assert not r["checks"]["adapter_config"]["ok"]
    message = next(f for f in r["failures"] if f.startswith("adapter config"))
    assert "lora_alpha=256 but the run trained with lora.alpha=32" in message and "8x" in message


def test_lora_rank_changed_in_adapter_config_cannot_load_and_says_why(quickstart, tmp_path):
    ckpt = variant(quickstart, tmp_path, lambda c: edit_json(c / "adapter" / "adapter_config.json", r=8))
    with pytest.raises(ProbeError, match=r"r=8 but the run trained with lora.r=16"):
        probe(quickstart, ckpt, tmp_path)


def test_adapter_applied_twice_fails_parity(quickstart, tmp_path):
    """Buggy save path: the adapter merged into the base and applied again on top; the fingerprint the
    trainer recorded is that model's, the artifact holds the adapter once."""
    from peft import PeftModel

    from trainer.model import load_policy, logprob_fingerprint

    spec, _ = quickstart

    def applied_twice(ckpt: Path) -> None:
        model, tokenizer = load_policy(spec.model, spec.lora, adapter_path=str(ckpt / "adapter"), trainable=False)
        twice = PeftModel.from_pretrained(model.merge_and_unload(), str(ckpt / "adapter"))
        edit_json(ckpt / MANIFEST, fingerprint=logprob_fingerprint(twice, tokenizer, "cpu"))

    r = probe(quickstart, variant(quickstart, tmp_path, applied_twice), tmp_path)
    assert not r["passed"] and not r["parity_ok"]
    assert r["parity_max_diff"] > 10 * r["parity_tolerance"]
    assert any("applied twice" in f for f in r["failures"])


def test_wrong_base_model_fails_naming_both_models(quickstart, wrong_base, tmp_path):
    spec, ckpt = quickstart
    r = probe(quickstart, ckpt, tmp_path, model_cfg=spec.model.model_copy(update={"name_or_path": str(wrong_base)}))
    assert not r["passed"] and not r["parity_ok"] and not r["checks"]["base_model"]["ok"]
    message = next(f for f in r["failures"] if f.startswith("wrong base model"))
    assert spec.model.name_or_path in message and str(wrong_base) in message
    assert r["malformed_rate"] > 0.5  # and what it says is no longer the trained model's


def test_tokenizer_with_other_token_ids_fails(quickstart, tmp_path):
    def shift_digit_ids(ckpt: Path) -> None:
        path = ckpt / "tokenizer" / "tokenizer.json"
        tok = json.loads(path.read_text())
        vocab = tok["model"]["vocab"]
        digits = [t for t in vocab if len(t) == 1 and t in "0123456789"]
        ids = [vocab[t] for t in digits]
        vocab.update(zip(digits, ids[1:] + ids[:1]))
        path.write_text(json.dumps(tok))

    r = probe(quickstart, variant(quickstart, tmp_path, shift_digit_ids), tmp_path)
    assert not r["passed"] and not r["checks"]["tokenizer"]["ok"]
    message = next(f for f in r["failures"] if f.startswith("tokenizer mismatch"))
    assert "vocabulary: 10 tokens map to other ids" in message


def test_tokenizer_with_another_chat_template_fails(quickstart, tmp_path):
    def other_template(ckpt: Path) -> None:
        template = ckpt / "tokenizer" / "chat_template.jinja"
        template.write_text(template.read_text().replace("<|assistant|>", "Assistant: "))

    r = probe(quickstart, variant(quickstart, tmp_path, other_template), tmp_path)
    assert not r["passed"]
    assert "chat_template differs" in r["checks"]["tokenizer"]["detail"]


def test_checkpoint_without_manifest_is_incomplete(quickstart, tmp_path):
    ckpt = variant(quickstart, tmp_path, lambda c: (c / MANIFEST).unlink(), saved_that_way=False)
    with pytest.raises(ProbeError, match="has no manifest.json: it is incomplete"):
        probe(quickstart, ckpt, tmp_path)


def truncate_adapter(ckpt: Path) -> None:
    path = ckpt / "adapter" / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:4000])


def test_checkpoint_with_a_truncated_file_fails_its_hash(quickstart, tmp_path):
    ckpt = variant(quickstart, tmp_path, truncate_adapter, saved_that_way=False)
    with pytest.raises(ProbeError, match="adapter_model.safetensors does not match its sha256"):
        probe(quickstart, ckpt, tmp_path)


def test_checkpoint_saved_mid_write_with_matching_hashes_is_unreadable(quickstart, tmp_path):
    ckpt = variant(quickstart, tmp_path, truncate_adapter)
    with pytest.raises(ProbeError, match="unreadable.*saved mid-write"):
        probe(quickstart, ckpt, tmp_path)


def test_manifest_without_fingerprint_fails_parity_as_unchecked(quickstart, tmp_path):
    def drop_fingerprint(ckpt: Path) -> None:
        manifest = json.loads((ckpt / MANIFEST).read_text())
        del manifest["fingerprint"]
        (ckpt / MANIFEST).write_text(json.dumps(manifest))

    r = probe(quickstart, variant(quickstart, tmp_path, drop_fingerprint), tmp_path)
    assert not r["parity_ok"] and r["parity_max_diff"] is None
    assert any(f.startswith("parity not checked") for f in r["failures"])


# ── settings and prompts ───────────────────────────────────────────────────────────────────────────


def test_threshold_decides_pass_on_the_malformed_rate(quickstart, tmp_path):
    """The same healthy checkpoint fails when every sample is made malformed by a too-small max_tokens."""
    cfg = SMALL_PROBE.model_copy(update={"max_tokens": 3})
    r = probe(quickstart, quickstart[1], tmp_path, cfg=cfg)
    assert r["parity_ok"] and r["malformed_rate"] == 1.0 and not r["passed"]
    assert r["reason_counts"]["length_cap"] == r["n_samples"]
    assert r["failures"] == [f for f in r["failures"] if f.startswith("malformed rate")]


def test_a_comparison_of_two_real_reports_probed_differently_names_the_difference(quickstart, tmp_path):
    """The same checkpoint probed with a 3-token cap reads as a regression against itself probed normally: the
    comparison says the two were not probed alike (max_tokens 32 vs 3), and says nothing when they were."""
    from tasks.compare import compare, format_differences

    normal = probe(quickstart, quickstart[1], tmp_path)
    capped = probe(quickstart, quickstart[1], tmp_path, cfg=SMALL_PROBE.model_copy(update={"max_tokens": 3}))
    result = compare(normal, capped)
    assert result.regression and result.differences == ["max_tokens: A 32 vs B 3"]
    assert format_differences(result).startswith("warning: A and B were not probed alike (max_tokens: A 32 vs B 3)")
    alike = compare(normal, probe(quickstart, quickstart[1], tmp_path / "again"))
    assert alike.differences == [] and format_differences(alike) is None


def test_a_spec_names_its_own_prompt_file(quickstart, tmp_path):
    prompts = tmp_path / "mine.txt"
    prompts.write_text("1+1\n\n2+2\n")
    cfg = SMALL_PROBE.model_copy(update={"prompts_file": str(prompts), "n": 2})
    r = probe(quickstart, quickstart[1], tmp_path, cfg=cfg)
    assert [p["prompt"] for p in r["per_prompt"]] == ["1+1", "2+2"] and r["n_samples"] == 4


def test_default_prompts_are_the_experiments_held_out_prompts_rendered_as_in_training(healthy_report, quickstart):
    from trainer.data import load_datasets

    spec, _ = quickstart
    _, held_out = load_datasets(spec.data)
    assert [p["prompt"] for p in healthy_report["per_prompt"]] == [e.prompt for e in held_out[: spec.probe.num_prompts]]
    assert "held-out" in healthy_report["settings"]["prompts"]


def test_the_verdict_is_read_against_the_base_model_on_the_same_prompts(healthy_report, quickstart):
    report = ProbeReport.from_dict(healthy_report)
    base = healthy_report["baseline"]
    assert base["model"].startswith("base model") and base["n_samples"] == healthy_report["n_samples"]
    assert {s["prompt"] for s in base["samples"]} == {s["prompt"] for s in healthy_report["samples"]}
    assert report.versus() == (
        f"{healthy_report['malformed_rate']:.1%} malformed vs {base['malformed_rate']:.1%} for the {base['model']}"
    )
    assert report.versus() in "\n".join(report.summary_lines())


def test_the_baseline_is_sampled_once_and_then_read_from_its_cache(quickstart, tmp_path):
    spec, ckpt = quickstart
    cfg = SMALL_PROBE.model_copy(update={"n": 2})
    runs = [
        probe_checkpoint(
            str(ckpt), cfg, spec.model, tmp_path / "cache", lora_cfg=spec.lora, baseline_cache=tmp_path / "base"
        ).to_dict()
        for _ in range(2)
    ]
    assert [r["baseline"]["cached"] for r in runs] == [False, True]
    assert runs[0]["baseline"]["samples"] == runs[1]["baseline"]["samples"]


def test_the_format_check_applies_only_when_the_rewards_ask_for_a_tag(quickstart):
    from trainer.config import RewardConfig

    spec, _ = quickstart
    assert format_tag_for(ProbeConfig(), spec.rewards) == "output"  # the quickstart's exact_answer reads <output>
    assert format_tag_for(ProbeConfig(), [RewardConfig(name="numeric_answer")]) is None
    assert format_tag_for(ProbeConfig(format_tag="answer"), [RewardConfig(name="numeric_answer")]) == "answer"
    assert format_tag_for(ProbeConfig(format_tag=False), spec.rewards) is None


def test_prompt_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"answer": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*'prompt'"):
        load_probe_prompts(bad)
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text('{"prompt": "ok", "expected": 3}\n')
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['expected'\]"):
        load_probe_prompts(unknown)
    with pytest.raises(FileNotFoundError, match="probe.prompts_file"):
        load_probe_prompts(tmp_path / "missing.jsonl")


# ── the classifier, as the probe uses it ───────────────────────────────────────────────────────────

FINE = {
    "short answer": "<output>7</output>",
    "code that belongs in the answer": (
        "<output>\ndef add(a, b):\n    return {'sum': a + b, 'parts': [a, b]}\n</output>"
    ),
    "answer with a short explanation": "20 + 50 = 70 and 3 + 8 = 11, so <output>81</output>",
}
MALFORMED = {
    "repetition_loop": ("<output>81</output> 81 81 81 81 81 81 81", "stop"),
    "length_cap": ("<output>8", "length"),
    "format_missing": ("81", "stop"),
    "garbage": ("<output>\x01\x02\x03\ufffd\ufffd\ufffd81</output>", "stop"),
    "too_long": ("<output>81</output> " + "and that is the answer I computed carefully. " * 3, "stop"),
}


@pytest.mark.parametrize("name", FINE)
def test_odd_looking_but_fine_completions_have_no_reason(name):
    assert classify(FINE[name], [0] * 10, "stop", 48, format_tag="output", expected_length=None) == []


@pytest.mark.parametrize("reason", MALFORMED)
def test_each_kind_of_malformed_completion_is_named(reason):
    text, finish = MALFORMED[reason]
    reasons = classify(text, [0] * 48, finish, 48, format_tag="output", expected_length=20)
    assert reason in [reason_code(r) for r in reasons]


# ── the page ───────────────────────────────────────────────────────────────────────────────────────


def test_html_page_shows_verdict_counts_and_escaped_samples(healthy_report, tmp_path):
    page = ProbeReport.from_dict(healthy_report).write_html(tmp_path / "probe.html").read_text()
    assert "PASSED" in page and "Wilson interval" in page and "Per prompt" in page
    assert "&lt;output&gt;" in page and "<output>" not in page.split("<body>", 1)[1]
    assert page.count("<tr class=") >= healthy_report["n_samples"]


def test_model_config_from_manifest_names_the_base(quickstart):
    spec, ckpt = quickstart
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert model_config_from_manifest(manifest, device="cpu").name_or_path == spec.model.name_or_path
    with pytest.raises(ProbeError, match="--base"):
        model_config_from_manifest({})


# ── the command ────────────────────────────────────────────────────────────────────────────────────


def test_cli_probe_passes_with_exit_0_and_writes_json_and_html(quickstart, tmp_path, capsys):
    from flows.cli import main

    _, ckpt = quickstart
    rc = main(
        [
            "probe",
            str(ckpt),
            "--n",
            "2",
            "--max-tokens",
            "32",
            "--json",
            str(tmp_path / "r.json"),
            "--html",
            str(tmp_path / "r.html"),
            "--cache-dir",
            str(tmp_path / "cache"),
        ]
    )
    assert rc == 0
    assert "probe PASSED" in capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] and report["n_samples"] == 2 * report["n_prompts"]
    assert (tmp_path / "r.html").read_text().startswith("<!doctype html>")


def test_cli_probe_fails_with_exit_1_and_the_reason(quickstart, tmp_path, capsys):
    from flows.cli import main

    broken = variant(quickstart, tmp_path, scale_lora_b(256.0))
    assert main(["probe", str(broken), "--n", "2", "--max-tokens", "32", "--cache-dir", str(tmp_path / "cache")]) == 1
    out = capsys.readouterr().out
    assert "probe FAILED" in out and "FAILURE: parity failed" in out
    incomplete = tmp_path / "incomplete"
    shutil.copytree(quickstart[1], incomplete)
    (incomplete / MANIFEST).unlink()
    assert main(["probe", str(incomplete)]) == 1
    assert "it is incomplete" in capsys.readouterr().out


def test_cli_probe_bad_arguments_exit_2(quickstart, tmp_path, capsys):
    from flows.cli import main

    assert main(["probe", str(tmp_path / "nowhere")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    assert main(["probe", str(quickstart[1]), "--n", "0"]) == 2
    assert "--n:" in capsys.readouterr().err
    assert main(["probe", str(quickstart[1]), "--prompts", str(tmp_path / "none.jsonl")]) == 2
    assert main(["probe", str(quickstart[1]), "--format-tag", "<bad>"]) == 2
