"""Concurrent LoRA trials (trainer/multi.py): a trial run alongside others equals the same trial run alone.

Proven as resume is proven (tests/test_trainer.py): three trials with different rank, learning rate, beta, dropout,
sampling settings and length run two at a time over one base model — their rollouts sampled in one engine call, each
row under its own adapter; the third takes the slot the first leaves — and each alone. The prompts, the sampled
completions and their rewards are bit-identical; the metrics (timings aside) and final adapters are bit-identical
for a trial whose loss does not read the engine's logprobs, and within TOLERANCE (below: why) for the others.
A pruned trial leaves and the next takes its slot; the others are unmoved.
"""

import json
import math
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import perturb_lora, tiny_spec
from tests.test_trainer import adapter_weights, deterministic, read_jsonl
from trainer.config import InputError, LoraConfig, ModelConfig, TrainerConfig
from trainer.data import render_prompt
from trainer.engines.base import SamplingParams
from trainer.loop import Callbacks, GRPOTrainer
from trainer.multi import ConcurrentTrials, SharedPolicy, TrialJob, check_concurrent

# Where the arithmetic does not allow bit-identity. The base model's matmuls and attention over all the trials'
# rows are not bit-identical, row by row, to the same over one trial's rows (CPU kernels depend on the number of
# rows: a 6-row and a 12-row matmul round differently), so the engine's logprobs differ in the last bits (~3e-6
# measured). The sampled tokens do not move; the rollout correction's weight pi_old / pi_engine (~1 +- 3e-6) does,
# and with it the loss and gradient in the 7th digit (metrics within ~2e-7 measured). Adam divides each update by
# the gradient's size, so a weight whose gradient is near zero moves by a share of a step that turns on those
# digits: up to 2.6e-5 measured, against updates of up to lr = 2e-3 a step.
TOLERANCE = {"metric_rel": 1e-4, "metric_abs": 1e-5, "adapter_abs": 1e-4}

# Three trials of one sweep: what differs is what a sweep searches over.
TRIALS = {
    "a": dict(
        lora={"r": 4, "alpha": 8},
        optim={"steps": 3, "learning_rate": 1e-3},
        grpo={"beta": 0.04, "rollout_correction": {"mode": "off"}},  # no engine logprobs in its loss: bit-identical
    ),
    "b": dict(
        lora={"r": 8, "alpha": 16, "dropout": 0.1},  # dropout draws from the trial's own RNG
        optim={"steps": 4, "learning_rate": 3e-3},
        grpo={"beta": 0.0},
    ),
    "c": dict(
        lora={"r": 16, "alpha": 16},
        optim={"steps": 2, "learning_rate": 2e-3},
        grpo={"beta": 0.1},
        rollout={"temperature": 0.8, "repetition_penalty": 1.2},  # its own sampling settings, in the same call
    ),
}


def trial_cfg(tiny_model, name: str) -> TrainerConfig:
    sections = {k: dict(v) for k, v in TRIALS[name].items()}
    sections["grpo"] = {"num_generations": 4, "prompts_per_step": 2, **sections["grpo"]}
    sections["checkpoint"] = {"every": 1, "keep_last": 5}
    sections["rollout"] = {"max_tokens": 24, **sections.get("rollout", {})}
    return TrainerConfig.model_validate(tiny_spec(tiny_model, **sections))


@pytest.fixture(scope="module")
def alone(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """Each trial run alone, the ordinary way."""
    runs = {}
    for name in TRIALS:
        runs[name] = tmp_path_factory.mktemp(f"alone-{name}")
        trainer = GRPOTrainer(trial_cfg(tiny_model, name), runs[name], progress=False)
        trainer.train()
        trainer.close()
    return runs


class PruneAt(Callbacks):
    def __init__(self, step: int):
        self.step = step

    def should_stop(self, step, metrics):
        return "pruned" if step == self.step else None


def run_together(tiny_model, root: Path, callbacks: dict | None = None):
    """a, b, c two at a time; returns ({name: outcome}, [names running at each on_end])."""
    jobs = (
        TrialJob(name, trial_cfg(tiny_model, name), root / name, callbacks=(callbacks or {}).get(name, ()))
        for name in TRIALS
    )
    outcomes = ConcurrentTrials(slots=2).run(jobs)
    return {o.job.name: o for o in outcomes}, [o.job.name for o in outcomes]


@pytest.fixture(scope="module")
def together(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("together")
    return root, *run_together(tiny_model, root)


def assert_same_run(run: Path, lone: Path, steps: int, exact: bool) -> None:
    """Bit-identical: the prompts, the sampled completions and their rewards; with the rollout correction off
    (`exact`), every metric but the engine-vs-trainer comparisons (sampling/*) and the adapter too. Otherwise the
    metrics and the adapter within TOLERANCE: the engine's logprobs reach them through the correction's weight."""
    assert read_jsonl(run / "prompts.jsonl") == read_jsonl(lone / "prompts.jsonl")[:steps]
    assert read_jsonl(run / "samples.jsonl") == [s for s in read_jsonl(lone / "samples.jsonl") if s["step"] <= steps]
    got, want = read_jsonl(run / "metrics.jsonl"), read_jsonl(lone / "metrics.jsonl")[:steps]
    assert [m["step"] for m in got] == list(range(1, steps + 1))
    for g, w in zip(got, want):
        g, w = deterministic(g), deterministic(w)
        assert g.keys() == w.keys()
        for k in g:
            if exact and not k.startswith("sampling/"):
                assert g[k] == w[k], (g["step"], k)
            elif isinstance(w[k], float):
                assert math.isclose(g[k], w[k], rel_tol=TOLERANCE["metric_rel"], abs_tol=TOLERANCE["metric_abs"]), (
                    g["step"],
                    k,
                    g[k],
                    w[k],
                )
            else:
                assert g[k] == w[k], (g["step"], k)
    a, b = adapter_weights(run, steps), adapter_weights(lone, steps)
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            assert float((a[k] - b[k]).abs().max()) <= TOLERANCE["adapter_abs"], k
    config = f"checkpoints/step-{steps:06d}/adapter/adapter_config.json"
    assert json.loads((run / config).read_text()) == json.loads((lone / config).read_text())


def test_a_trial_run_alongside_others_equals_the_same_trial_run_alone(together, alone):
    root, outcomes, order = together
    assert order == ["a", "b", "c"]  # a (3 steps) leaves first; c takes its slot, its step 1 sampled with b's step 4
    for name, sections in TRIALS.items():
        outcome = outcomes[name]
        assert outcome.error is None
        assert outcome.result.last_step == sections["optim"]["steps"]
        assert_same_run(root / name, alone[name], sections["optim"]["steps"], exact=name == "a")
    # the trials really are different ones: each its own rank and learning rate
    for name, rank, lr in (("a", 4, 1e-3), ("b", 8, 3e-3), ("c", 16, 2e-3)):
        steps = TRIALS[name]["optim"]["steps"]
        lora_a = [w for k, w in adapter_weights(root / name, steps).items() if "lora_A" in k]
        assert {w.shape[0] for w in lora_a} == {rank}
        assert read_jsonl(root / name / "metrics.jsonl")[-1]["learning_rate"] == lr


def test_a_pruned_trial_leaves_its_slot_and_the_others_are_unmoved(tiny_model, tmp_path, alone):
    outcomes, order = run_together(tiny_model, tmp_path, callbacks={"a": [PruneAt(1)]})
    assert order == ["a", "c", "b"]
    assert outcomes["a"].result.stopped == "pruned"
    assert outcomes["a"].result.last_step == 1
    assert_same_run(tmp_path / "a", alone["a"], 1, exact=True)  # its one step is still a lone run's first
    for name in ("b", "c"):
        assert_same_run(tmp_path / name, alone[name], TRIALS[name]["optim"]["steps"], exact=False)


def test_a_trial_whose_rows_fail_to_sample_ends_failed_and_the_others_are_unmoved(tiny_model, tmp_path, alone):
    """Its adapter's weights are NaN (a trial started from a broken adapter), so its rows in the shared rollout call
    fail to sample. That trial alone ends failed at its first step; the call is sampled again a trial at a time, and
    the trials beside it train as they would alone. (One trial's failure in the shared call ended every trial.)"""
    broken = tmp_path / "broken-adapter"
    shutil.copytree(alone["a"] / "checkpoints" / "step-000001" / "adapter", broken)
    weights = load_file(broken / "adapter_model.safetensors")
    save_file({k: torch.full_like(v, math.nan) for k, v in weights.items()}, broken / "adapter_model.safetensors")
    jobs = [
        TrialJob(name, trial_cfg(tiny_model, name), tmp_path / name, init_adapter=broken if name == "a" else None)
        for name in TRIALS
    ]
    outcomes = {o.job.name: o for o in ConcurrentTrials(slots=2).run(jobs)}
    assert list(outcomes) == ["a", "c", "b"]  # a leaves at its first step and c takes its slot
    assert outcomes["a"].result.stopped == "failed: RuntimeError" and outcomes["a"].result.last_step == 0
    assert "probability tensor contains" in str(outcomes["a"].error)
    for name in ("b", "c"):
        assert outcomes[name].error is None and outcomes[name].result.stopped is None
        assert_same_run(tmp_path / name, alone[name], TRIALS[name]["optim"]["steps"], exact=False)


class SignalAfterRecording(Callbacks):
    """Sends this process SIGINT from inside a step's record (after the loop read its stop reason): the moment a
    Ctrl-C lands between one round's last record and the next round."""

    def __init__(self, step: int):
        self.step = step

    def on_step(self, step, metrics):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGINT)


def test_a_signal_after_a_rounds_last_record_stops_every_running_trial_at_its_next_step_and_starts_none(
    tiny_model, tmp_path
):
    """Ctrl-C landing after the last running trial recorded its step (so no trial saw it then): every running trial
    still ends — its next step finished and checkpointed, its outcome given to on_end as interrupted — and no waiting
    trial starts. (It once left the loop with the trials un-ended: a sweep then waited forever on trials it held.)"""
    ended = []
    jobs = (
        TrialJob(
            name, trial_cfg(tiny_model, name), tmp_path / name, callbacks=[SignalAfterRecording(1)] * (name == "b")
        )
        for name in TRIALS
    )
    outcomes = ConcurrentTrials(slots=2).run(jobs, on_end=lambda outcome, trainer: ended.append(outcome.job.name))
    assert ended == [o.job.name for o in outcomes] == ["a", "b"]  # c never started
    for o in outcomes:
        assert o.error is None
        assert (o.result.last_step, o.result.stopped, o.result.interrupted) == (2, "interrupted: SIGINT", "SIGINT")
        assert o.result.last_checkpoint.name == "step-000002"
    assert not (tmp_path / "c").exists()


def test_a_trial_with_another_base_model_is_refused_naming_the_field(tiny_model):
    first, other = trial_cfg(tiny_model, "a"), trial_cfg(tiny_model, "b")
    other.model.dtype = "bfloat16"
    with pytest.raises(InputError, match=r"trial b: model.dtype is 'bfloat16' .* sweep.concurrent_trials: 1"):
        check_concurrent(other, first, "b")
    offline = trial_cfg(tiny_model, "a")
    offline.rollout.engine = "offline"
    with pytest.raises(InputError, match=r"rollout.engine is 'offline'; .*hf or the vllm engine"):
        check_concurrent(offline, None, "a")
    with pytest.raises(InputError, match=r"trial b: rollout.concurrent_adapters is 'stacked' but the running"):
        check_concurrent(stacked_cfg(tiny_model, "b"), first, "b")
    unfused = trial_cfg(tiny_model, "b")
    unfused.rollout.fused_sampling = "never"
    with pytest.raises(InputError, match=r"trial b: rollout.fused_sampling is 'never' but the running trials' is"):
        check_concurrent(unfused, first, "b")
    served, other_server = trial_cfg(tiny_model, "a"), trial_cfg(tiny_model, "b")
    for cfg in (served, other_server):
        cfg.rollout.engine = "vllm"
    check_concurrent(other_server, served, "b")  # one vLLM server serves both
    other_server.rollout.vllm_dtype = "bfloat16"
    with pytest.raises(InputError, match=r"trial b: rollout.vllm_dtype is 'bfloat16' .* share one server"):
        check_concurrent(other_server, served, "b")


def test_one_engine_call_samples_each_trials_rows_as_its_adapter_alone_would(tiny_model):
    shared = SharedPolicy(ModelConfig(name_or_path=str(tiny_model), device="cpu"))
    for name, rank in (("x", 4), ("y", 8)):
        model, tokenizer = shared.add(name, LoraConfig(r=rank, alpha=2 * rank))
    perturb_lora(model, seed=3, scale=0.3)  # adapters that differ from the base and from each other
    prompts = [render_prompt(tokenizer, q) for q in ("12+34", "7+58", "40+41")]
    x = SamplingParams(n=3, max_tokens=16, seeds=[11, 12])
    y = SamplingParams(n=2, max_tokens=16, temperature=0.7, repetition_penalty=1.3, seeds=[21, 22, 23])
    together = shared.engine.generate_many([(prompts[:2], x, ["x", "x"]), (prompts, y, ["y", "y", "y"])])
    alone = []
    for name, these, params in (("x", prompts[:2], x), ("y", prompts, y)):
        model.set_adapter(name)
        alone.append(shared.engine.generate(these, params))
    tokens = [[[c.token_ids for c in group] for group in request] for request in together]
    assert tokens == [[[c.token_ids for c in group] for group in request] for request in alone]
    for c, lone in zip(flat(together), flat(alone)):
        assert c.finish_reason == lone.finish_reason
        assert max(abs(a - b) for a, b in zip(c.logprobs, lone.logprobs)) <= 1e-5  # see TOLERANCE
    other = shared.engine.generate_many([(prompts[:2], x, ["y", "y"])])[0]  # the adapter matters
    assert [c.token_ids for c in flat([other])] != [c.token_ids for c in flat(together[:1])]


def flat(requests):
    return [c for request in requests for group in request for c in group]


def stacked_cfg(tiny_model, name: str) -> TrainerConfig:
    cfg = trial_cfg(tiny_model, name)
    cfg.rollout.concurrent_adapters = "stacked"
    return cfg


def test_trials_decoded_with_stacked_adapters_equal_the_same_trials_alone(tiny_model, tmp_path, alone):
    """rollout.concurrent_adapters: stacked — every trial's rows in one forward, the adapters stacked with a per-row
    slot (trainer/engines/stacked.py) and refreshed from the trials' weights after each of their optimizer steps. A
    row's LoRA sum runs over every slot (zeros but its own), so the engine's logprobs may move in the last bits: the
    tokens, samples and rewards are bit-identical, the rest within TOLERANCE (a lone run ignores the field)."""
    jobs = (TrialJob(name, stacked_cfg(tiny_model, name), tmp_path / name) for name in TRIALS)
    with ConcurrentTrials(slots=2) as runner:
        outcomes = {o.job.name: o for o in runner.run(jobs)}
        assert runner.shared.engine.stacked is not None and runner.shared.engine.stacked.slots == 2
    for name, sections in TRIALS.items():
        assert outcomes[name].error is None
        assert_same_run(tmp_path / name, alone[name], sections["optim"]["steps"], exact=name == "a")
