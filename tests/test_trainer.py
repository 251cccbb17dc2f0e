"""The trainer as a user runs it: real tiny model, real HF generate, real checkpoints on disk.

Resume is exact (also after SIGKILL mid-step and mid-checkpoint-write), altered checkpoints are
refused, missing logprobs and NaN rewards fail loudly, a stale engine shows in the logprob-diff
metric and trips the gate, eval decodes exactly like a hand-written `generate`.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import REPO, perturb_lora, tiny_spec
from trainer.checkpoint import CheckpointError, list_checkpoints
from trainer.config import TrainerConfig
from trainer.engines.hf import HFEngine
from trainer.loop import GRPOTrainer, TrainingError
from trainer.metrics import describe

TIMING = ("time/", "step_time", "tokens_per_second")


def deterministic(m: dict) -> dict:
    """The metrics that must repeat exactly: no timings; NaN (a trend without enough steps yet) as the string 'nan'
    so that NaN equals NaN."""
    return {k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in m.items() if not k.startswith(TIMING)}


def trainer_for(model, out, progress=False, engine=None, **sections) -> GRPOTrainer:
    cfg = TrainerConfig.model_validate(tiny_spec(model, **sections))
    return GRPOTrainer(cfg, out, progress=progress, engine=engine)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def adapter_weights(run_dir: Path, step: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" / "adapter" / "adapter_model.safetensors"))


RESUME_SECTIONS = dict(optim={"steps": 6, "learning_rate": 3e-3}, checkpoint={"every": 3, "keep_last": 5})


@pytest.fixture(scope="module")
def straight_run(tiny_model, tmp_path_factory):
    """6 steps without interruption: the reference every resume must reproduce."""
    out = tmp_path_factory.mktemp("straight")
    t = trainer_for(tiny_model, out, **RESUME_SECTIONS)
    t.train(6)
    t.close()
    return out


def resume_sections(k: int) -> dict:
    """RESUME_SECTIONS with rollout.max_off_policy_steps: k (the HF engine keeps the schedule in the trainer's
    thread)."""
    return {**RESUME_SECTIONS, "rollout": {"max_off_policy_steps": k}}


@pytest.fixture(scope="module")
def straight_runs(straight_run, tiny_model, tmp_path_factory):
    """k -> 6 uninterrupted steps with rollout.max_off_policy_steps: k (k = 0: straight_run), made on first use."""
    runs = {0: straight_run}

    def get(k: int) -> Path:
        if k not in runs:
            runs[k] = tmp_path_factory.mktemp(f"straight-k{k}")
            t = trainer_for(tiny_model, runs[k], **resume_sections(k))
            t.train(6)
            t.close()
        return runs[k]

    return get


def spec_file(tiny_model, path: Path, **sections) -> Path:
    path.write_text(yaml.safe_dump(tiny_spec(tiny_model, **sections)))
    return path


def cli(*args, env=None, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=600,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"ballast {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def assert_same_as_straight(run: Path, straight: Path) -> None:
    got, want = read_jsonl(run / "metrics.jsonl"), read_jsonl(straight / "metrics.jsonl")
    assert [m["step"] for m in got] == [1, 2, 3, 4, 5, 6]
    for g, w in zip(got[3:], want[3:]):
        assert deterministic(g) == deterministic(w)
    a, b = adapter_weights(run, 6), adapter_weights(straight, 6)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert read_jsonl(run / "prompts.jsonl") == read_jsonl(straight / "prompts.jsonl")


# ------------------------------------------------------------------------------------------ metrics


def test_every_reported_metric_is_documented_and_trl_names_are_present(straight_run):
    m = read_jsonl(straight_run / "metrics.jsonl")[0]
    for name in m:
        describe(name)
    for name in (
        "reward",
        "reward_std",
        "rewards/exact_answer/mean",
        "frac_reward_zero_std",
        "completions/mean_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "completions/mean_terminated_length",
        "kl",
        "kl/k1",
        "kl/k2",
        "kl/k3",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "grad_norm",
        "learning_rate",
        "step_time",
        "tokens_per_second",
        "time/rollout",
        "time/update",
        "sampling/frac_logprobs_valid",
        "policy_ratio/mean",
        "sampling/sampling_logp_difference/mean",
        "sampling/sampling_logp_difference/max",
        "health/ngram_repetition",
        "health/unique_token_ratio",
        "health/garbage_ratio",
    ):
        assert name in m, name


def test_in_process_engine_logprobs_match_the_trainer(straight_run):
    for m in read_jsonl(straight_run / "metrics.jsonl"):
        assert m["sampling/frac_logprobs_valid"] == 1.0
        assert m["sampling/sampling_logp_difference/max"] < 1e-4


def test_policy_moves_away_from_reference(straight_run):
    kl = [m["kl"] for m in read_jsonl(straight_run / "metrics.jsonl")]
    assert kl[0] == pytest.approx(0.0, abs=1e-6)  # LoRA starts as the identity
    assert kl[-1] > 1e-5


# ------------------------------------------------------------------------------------------ resume


@pytest.mark.parametrize("k", [0, 1, 2])
def test_resume_in_process_equals_uninterrupted_run(tiny_model, straight_runs, tmp_path, k):
    t = trainer_for(tiny_model, tmp_path, **resume_sections(k))
    t.train(3)
    t.close()
    t = trainer_for(tiny_model, tmp_path, **resume_sections(k))
    assert t.resume().name == "step-000003"
    t.train(6)
    t.close()
    assert_same_as_straight(tmp_path, straight_runs(k))


@pytest.mark.parametrize("k", [0, 1, 2])  # rollout.max_off_policy_steps: batches sampled ahead are saved, then trained
@pytest.mark.parametrize("fault", ["kill-in-step:5", "kill-in-checkpoint:6"])
def test_resume_after_sigkill_equals_uninterrupted_run(tiny_model, straight_runs, tmp_path, fault, k):
    spec = spec_file(tiny_model, tmp_path / "spec.yaml", **resume_sections(k))
    run = tmp_path / "run"
    killed = cli("train", str(spec), "--output", str(run), "--quiet", env={"BALLAST_FAULT": fault}, check=False)
    assert killed.returncode == -9
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [3]
    resumed = cli("train", str(spec), "--output", str(run), "--quiet", "--resume")
    assert "resumed from" in resumed.stdout and "step-000003" in resumed.stdout
    assert not list(run.joinpath("checkpoints").glob(".tmp-*"))
    assert_same_as_straight(run, straight_runs(k))


def test_no_prompt_is_seen_twice_or_skipped_within_an_epoch(straight_run):
    seen = [i for row in read_jsonl(straight_run / "prompts.jsonl") for i in row["prompt_indices"]]
    assert len(seen) == 12 and len(set(seen)) == 12


def test_altered_checkpoint_is_refused_naming_the_file(tiny_model, straight_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(straight_run, run)
    weights = run / "checkpoints" / "step-000006" / "adapter" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    t = trainer_for(tiny_model, run, **RESUME_SECTIONS)
    with pytest.raises(CheckpointError, match="adapter/adapter_model.safetensors"):
        t.resume()


def test_cli_refuses_altered_checkpoint_with_one_line_and_exit_2(tiny_model, straight_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(straight_run, run)
    state = run / "checkpoints" / "step-000006" / "state" / "trainer_state.json"
    state.write_text(state.read_text().replace('"step": 6', '"step": 7'))
    spec = spec_file(tiny_model, tmp_path / "spec.yaml", **RESUME_SECTIONS)
    proc = cli("train", str(spec), "--output", str(run), "--quiet", "--resume", check=False)
    assert proc.returncode == 2  # a refused resume is a refused input (CheckpointError is an InputError)
    assert "state/trainer_state.json does not match its sha256" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_resume_refuses_a_changed_spec(tiny_model, straight_run, tmp_path):
    import shutil

    shutil.copytree(straight_run, tmp_path / "run")
    t = trainer_for(
        tiny_model, tmp_path / "run", optim={"steps": 8, "learning_rate": 1e-2}, checkpoint={"every": 3, "keep_last": 5}
    )
    with pytest.raises(CheckpointError, match="optim.learning_rate was 0.003 and is now 0.01"):
        t.resume()


# ------------------------------------------------------------------------------------------ loud failures


class DropLogprobs(HFEngine):
    """An engine that returns no logprobs, like trajectories stored without them."""

    def generate(self, prompts, params):
        groups = super().generate(prompts, params)
        for g in groups:
            for c in g:
                c.logprobs = None
        return groups


def test_missing_engine_logprobs_fail_loudly(tiny_model, tmp_path):
    """The default correction (tis) needs the engine's logprobs: without them the step fails, naming the engine and
    the fix, before any update, instead of silently training as if the engine had sampled the trainer's policy."""
    t = trainer_for(tiny_model, tmp_path)
    t.engine = DropLogprobs(t.model, t.tokenizer, t.device)
    with pytest.raises(
        TrainingError,
        match=r"the 'hf' rollout engine returned no logprobs for \d+ of \d+ completion "
        r"tokens, and grpo.rollout_correction.mode: tis .*silently train.*"
        r"set grpo.rollout_correction.mode: off",
    ):
        t.train(1)
    assert not list_checkpoints(tmp_path / "checkpoints")


def test_without_correction_missing_engine_logprobs_train_on_the_trainers_old_policy(tiny_model, tmp_path):
    t = trainer_for(
        tiny_model, tmp_path, grpo={"num_generations": 4, "prompts_per_step": 2, "rollout_correction": {"mode": "off"}}
    )
    t.engine = DropLogprobs(t.model, t.tokenizer, t.device)
    m = t.train(1).history[0]
    assert m["sampling/frac_logprobs_valid"] == 0.0  # visible: the engine gave none
    assert math.isnan(m["sampling/sampling_logp_difference/max"])
    assert m["policy_ratio/mean"] == 1.0  # pi_old is the trainer's own


def test_nan_reward_fails_naming_the_function(tiny_model, tmp_path):
    t = trainer_for(tiny_model, tmp_path, rewards=[{"name": "tests.reward_fixtures:nan_for_fourth"}])
    with pytest.raises(ValueError, match="nan_for_fourth.*returned nan for completion 3"):
        t.train(1)
    assert not list_checkpoints(tmp_path / "checkpoints")


class NeverSynced(HFEngine):
    """An engine whose weight pushes are lost: it keeps sampling from the weights it started with."""

    def sync_weights(self, model, step):
        pass


def test_stale_engine_weights_show_in_logprob_diff_and_trip_the_gate(tiny_model, tmp_path):
    """The engine samples from a copy of the policy that never receives updates (a stale adapter)."""
    import copy

    only_logprob_signal = {
        "clipped_ratio_max": 2,
        "ngram_repetition_max": 2,
        "garbage_ratio_max": 2,
        "kl_max": 1e9,
        "length_reward_corr_max": 2,
    }
    t = trainer_for(
        tiny_model,
        tmp_path,
        optim={"steps": 6, "learning_rate": 2e-2},
        health={"patience": 2, "logprob_diff_max": 0.05, **only_logprob_signal},
    )
    stale = copy.deepcopy(t.model)
    t.engine = NeverSynced(stale, t.tokenizer, t.device)
    result = t.train(6)
    diffs = [m["sampling/sampling_logp_difference/max"] for m in result.history]
    assert diffs[0] < 1e-4  # same weights at step 1
    assert result.stopped is not None and "sampling/sampling_logp_difference/max" in result.stopped
    assert "stale or double-applied adapter" in result.stopped
    assert result.last_step < 6


# ------------------------------------------------------------------------------------------ options


def test_lagged_reference_is_the_policy_k_steps_back(tiny_model, tmp_path):
    t = trainer_for(
        tiny_model,
        tmp_path,
        grpo={"num_generations": 4, "prompts_per_step": 2, "beta": 0.1, "kl_ref_step_lag": 2},
        optim={"steps": 4, "learning_rate": 1e-2},
        checkpoint={"every": 1, "keep_last": 10},
    )
    h = t.train(4).history
    assert h[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # step 1: policy and reference are both the initial weights
    assert h[3]["kl"] > 0
    # at step 4 the reference is the policy after step 1's update, i.e. the step-1 checkpoint's adapter
    saved = adapter_weights(tmp_path, 1)
    reference = {name.replace(".default", ""): w for name, w in t.lagged[0].items()}
    assert reference.keys() == saved.keys()
    for name in saved:
        assert torch.equal(reference[name], saved[name]), name


def test_full_finetuning_with_frozen_reference(tiny_model, tmp_path):
    t = trainer_for(tiny_model, tmp_path, lora={"enabled": False}, optim={"steps": 2, "learning_rate": 1e-3})
    result = t.train(2)
    assert result.history[1]["kl"] > 0
    assert (result.last_checkpoint / "model" / "model.safetensors").exists()


def test_gradient_accumulation_and_num_iterations(tiny_model, tmp_path):
    t = trainer_for(
        tiny_model,
        tmp_path,
        grpo={"num_generations": 4, "prompts_per_step": 2, "num_iterations": 2},
        optim={"steps": 1, "gradient_accumulation_steps": 2, "learning_rate": 1e-2},
    )
    m = t.train(1).history[0]
    assert m["policy_ratio/mean"] != 1.0  # the second pass sees a moved policy
    assert t.scheduler.last_epoch == 2


def test_eval_decodes_exactly_like_a_standalone_generate_call(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.evaluate import generate

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    prompts = ["12+7", "40+33", "5+98"]
    ours = generate(model, tok, prompts, max_tokens=16)[0]
    by_hand = []
    for p in prompts:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
        by_hand.append(tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    assert ours == by_hand


# ------------------------------------------------------------------------------------------ CLI


def test_cli_rejects_unknown_spec_field_with_one_line_and_exit_2(tiny_model, tmp_path):
    spec = spec_file(tiny_model, tmp_path / "spec.yaml")
    proc = cli("train", str(spec), "--set", "grpo.bta=0.1", "--output", str(tmp_path / "o"), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: --set grpo.bta=0.1: unknown field 'grpo.bta'; did you mean 'grpo.beta'?")


def test_cli_rejects_invalid_value_naming_field(tiny_model, tmp_path):
    spec = spec_file(tiny_model, tmp_path / "spec.yaml")
    proc = cli("train", str(spec), "--set", "grpo.loss_type=ppo", check=False)
    assert proc.returncode == 2 and "grpo.loss_type" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_cli_missing_spec_file(tmp_path):
    proc = cli("train", str(tmp_path / "nope.yaml"), check=False)
    assert proc.returncode == 2 and "nope.yaml does not exist" in proc.stderr


# ------------------------------------------------------------------------------------------ health gate


def test_default_health_gate_stops_a_run_that_collapses(tiny_model, tmp_path):
    """A learning rate far too high: completions degenerate and the default gate stops the run."""
    t = trainer_for(tiny_model, tmp_path, optim={"steps": 12, "learning_rate": 0.3}, checkpoint={"every": 100})
    result = t.train(12)
    assert result.stopped is not None and result.stopped.startswith("collapsed: ")
    assert result.last_step < 12
    assert (
        result.last_checkpoint is not None and result.last_checkpoint.name == f"step-{result.last_step:06d}"
    )  # kept for probing


def test_default_health_gate_lets_a_healthy_run_finish(straight_run):
    steps = [m["step"] for m in read_jsonl(straight_run / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]


# ------------------------------------------------------------------------------------------ the quickstart learns


def test_quickstart_raises_reward_and_held_out_accuracy_and_the_gate_lets_it_finish(tiny_model, tmp_path):
    """examples/quickstart.yaml as shipped (only the model path changed): the sampled reward of the last five
    steps is clearly above the first five, the held-out accuracy rises from its step-0 baseline, and the
    default health gate never fires on this healthy run."""
    from tasks.spec import load_spec

    spec = load_spec(
        REPO / "examples" / "quickstart.yaml", [f"model.name_or_path={tiny_model}", "model.build_if_missing=null"]
    )
    t = GRPOTrainer(spec.trainer_config(), tmp_path, progress=False)
    result = t.train()
    t.close()
    rewards = [m["reward"] for m in result.history]
    first5, last5 = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert result.stopped is None and result.last_step == spec.optim.steps
    assert last5 > first5 + 0.1, (first5, last5)
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert lines[0] == result.eval_start and set(lines[0]) == {
        "step",
        "eval/reward",
        "eval/accuracy",
        "eval/mean_length",
        "eval/reward_stderr",
        "eval/accuracy_stderr",
    }
    assert result.history[-1]["eval/accuracy"] > result.eval_start["eval/accuracy"] + 0.1


def test_eval_on_start_is_step_0_and_sampled_eval_leaves_the_run_unchanged(tiny_model, straight_run, tmp_path):
    """A sampled eval before training and every 2 steps (in a forked RNG) changes nothing of the run itself."""
    t = trainer_for(
        tiny_model,
        tmp_path,
        eval={"every": 2, "on_start": True, "temperature": 1.0, "max_tokens": 24},
        **RESUME_SECTIONS,
    )
    result = t.train(6)
    t.close()
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4, 5, 6]
    assert "reward" not in lines[0] and 0.0 <= lines[0]["eval/accuracy"] <= 1.0
    assert [m["step"] for m in result.history] == [1, 2, 3, 4, 5, 6] and "eval/accuracy" in result.history[1]
    straight = read_jsonl(straight_run / "metrics.jsonl")
    from_eval = ("eval/", "hacking/eval_rise", "hacking/train_reward_rise")  # the divergence alarm reads eval points
    assert not math.isnan(result.history[-1]["hacking/eval_rise"])
    for got, want in zip(result.history, straight):
        assert deterministic({k: v for k, v in got.items() if not k.startswith(from_eval)}) == deterministic(
            {k: v for k, v in want.items() if not k.startswith(from_eval)}
        )


# ------------------------------------------------------------------------------------------ the hf engine's own sampler


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"temperature": 0.7},
        {"repetition_penalty": 1.3, "top_k": 20, "top_p": 0.9, "min_p": 0.05},
        {"min_tokens": 30},
    ],
)
def test_hf_engine_samples_exactly_what_generate_samples(tiny_model, settings):
    """The engine's static-cache loop draws the same tokens as `model.generate` for the same seed and settings
    (same processors, same RNG use), and its per-token logprobs agree with generate's logits to 1e-5."""
    from trainer.config import LoraConfig, ModelConfig
    from trainer.data import arith_examples, render_prompt
    from trainer.engines import hf
    from trainer.engines.base import SamplingParams
    from trainer.model import load_policy

    model, tokenizer = load_policy(ModelConfig(name_or_path=str(tiny_model), device="cpu"), LoraConfig(r=4, alpha=8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
    engine = HFEngine(model, tokenizer, "cpu")
    prompts = [render_prompt(tokenizer, e.prompt) for e in arith_examples(4, seed=0)]
    params = SamplingParams(n=4, max_tokens=40, seed=3, **settings)
    ours = [c for group in engine.generate(prompts, params) for c in group]

    def with_generate(model, input_ids, attention_mask, params, eos_ids, pad_id, generators=None):
        return hf._sample_with_generate(model, tokenizer, input_ids, attention_mask, params, eos_ids)

    original, hf.sample = hf.sample, with_generate
    try:
        theirs = [c for group in engine.generate(prompts, params) for c in group]
    finally:
        hf.sample = original
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert [c.finish_reason for c in ours] == [c.finish_reason for c in theirs]
    for a, b in zip(ours, theirs):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert min(len(c.token_ids) for c in ours) >= settings.get("min_tokens", 1)


def test_without_a_reference_no_kl_is_reported_and_the_progress_bar_shows_none(tiny_model, tmp_path):
    """beta 0: no reference model, so no KL is measured — none is reported (as TRL), never a false 0."""
    t = trainer_for(
        tiny_model, tmp_path, progress=True, grpo={"num_generations": 4, "prompts_per_step": 2, "beta": 0.0}
    )
    m = t.train(1).history[0]
    t.close()
    assert not {"kl", "kl/k1", "kl/k2", "kl/k3"} & set(m)
    assert "kl" not in read_jsonl(tmp_path / "metrics.jsonl")[0]


@pytest.mark.parametrize("stop", [[], ["\n\n"]])
def test_seeded_per_prompt_a_prompt_samples_the_same_completions_whatever_shares_its_batch(tiny_model, stop):
    """SamplingParams.seeds: each prompt draws from a generator of its own, so the prompt at global position i samples
    the same tokens alone, in a rank's shard, or beside another trial's prompts — the static-cache loop and the
    stop-string path (model.generate, one prompt at a time) alike."""
    from trainer.config import LoraConfig, ModelConfig
    from trainer.data import arith_examples, render_prompt
    from trainer.engines.base import SamplingParams
    from trainer.model import load_policy
    from trainer.rollouts import prompt_seeds

    model, tokenizer = load_policy(ModelConfig(name_or_path=str(tiny_model), device="cpu"), LoraConfig(r=4, alpha=8))
    perturb_lora(model, seed=1, scale=0.02)
    engine = HFEngine(model, tokenizer, "cpu")
    prompts = [render_prompt(tokenizer, e.prompt) for e in arith_examples(4, seed=0)]
    seeds = prompt_seeds(0, 7, range(4))
    assert len(set(seeds)) == 4 and seeds == prompt_seeds(0, 7, range(4))

    def run(rows, row_seeds):
        params = SamplingParams(n=3, max_tokens=24, seed=99, seeds=row_seeds, stop=stop)
        return [c for group in engine.generate(rows, params) for c in group]

    together = run(prompts, seeds)
    halves = run(prompts[:2], seeds[:2]) + run(prompts[2:], seeds[2:])
    alone = run(prompts[3:], seeds[3:])
    assert [c.token_ids for c in halves] == [c.token_ids for c in together]
    assert [c.token_ids for c in alone] == [c.token_ids for c in together[9:]]
    for a, b in zip(halves, together):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert len({tuple(c.token_ids) for c in together}) > 3  # really sampled: the rows differ


def test_per_prompt_seeds_draw_the_same_tokens_in_the_static_cache_loop_and_in_generate(tiny_model):
    """The two sampling paths of the hf engine use a prompt's generator alike: seeded per prompt, the stop-string path
    (model.generate) draws what the static-cache loop draws."""
    from trainer.config import LoraConfig, ModelConfig
    from trainer.data import arith_examples, render_prompt
    from trainer.engines import hf
    from trainer.engines.base import SamplingParams
    from trainer.model import load_policy

    model, tokenizer = load_policy(ModelConfig(name_or_path=str(tiny_model), device="cpu"), LoraConfig(r=4, alpha=8))
    perturb_lora(model, seed=2, scale=0.02)
    prompts = [render_prompt(tokenizer, e.prompt) for e in arith_examples(3, seed=1)]
    params = SamplingParams(n=4, max_tokens=30, seed=0, seeds=[11, 12, 13])
    engine = HFEngine(model, tokenizer, "cpu")
    loop = [c for group in engine.generate(prompts, params) for c in group]
    engine.static_cache = False  # what a model without static-cache support, or a stop string, goes through
    with_generate = [c for group in engine.generate(prompts, params) for c in group]
    assert [c.token_ids for c in loop] == [c.token_ids for c in with_generate]
    for a, b in zip(loop, with_generate):
        # two decode paths (a static KV cache and generate's dynamic one): float32 attention in another order; under
        # 1e-5 on the shipped tiny model (an AMD EPYC); 1.1e-5 was seen on an AMX Xeon with a model built there
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert hf._generators(None, torch.device("cpu")) is None


def test_resume_accepts_a_checkpoint_written_before_a_field_existed_when_the_field_holds_its_default(tmp_path):
    """A checkpoint from an older Ballast lacks the fields added since (here the loss variants' knobs); left at their
    defaults they change nothing, so the resume goes on. A field that did change is still refused."""
    from trainer.resume import refuse_changed_config, resumable_view

    cfg = TrainerConfig.model_validate({"model": {"name_or_path": "m"}})
    older = resumable_view(cfg)
    del older["grpo"]["cispo_max_ratio"], older["grpo"]["sapo_temperature_pos"]
    refuse_changed_config(older, resumable_view(cfg), tmp_path)
    changed = resumable_view(cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"cispo_max_ratio": 9.0})}))
    with pytest.raises(CheckpointError, match="grpo.cispo_max_ratio was 5.0 and is now 9.0"):
        refuse_changed_config(older, changed, tmp_path)


def test_resume_accepts_another_layout_of_the_same_computation_and_refuses_another_computation(tmp_path):
    """model.parallel and model.torch_threads say how this machine lays the run out (a checkpoint is the whole
    trainable state, resharded on load), so a run started alone may continue on two ranks, and one of two ranks on
    one; the learning rate is the run's own and is refused, naming the one field that may change beside them."""
    from trainer.resume import refuse_changed_config, resumable_view

    cfg = TrainerConfig.model_validate({"model": {"name_or_path": "m"}})
    saved = resumable_view(cfg)
    for layout in ({"parallel": "fsdp2"}, {"parallel": "ddp", "torch_threads": 3}):
        refuse_changed_config(
            saved, resumable_view(cfg.model_copy(update={"model": cfg.model.model_copy(update=layout)})), tmp_path
        )
    faster = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"learning_rate": 1e-3})})
    refused = r"optim.learning_rate was 0.0001 and is now 0.001; .*only optim.steps, model.parallel"
    with pytest.raises(CheckpointError, match=refused):
        refuse_changed_config(saved, resumable_view(faster), tmp_path)
