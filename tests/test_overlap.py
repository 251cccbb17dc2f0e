"""Rollouts that overlap training (rollout.max_off_policy_steps: k; trainer/rollouts.py).

The batch of step s is sampled by the policy after step s-1-k — checked against the weights themselves,
with the HF engine (in the trainer's thread) and with a real vLLM server (on a background thread, each
batch's logprobs matched to the trainer's logprobs under every earlier version) — `sampling/staleness/*`
says so per step, a batch beyond the limit is never trained on, generation really runs while the trainer
updates, offline trajectories read ahead train exactly as read in step, and a run with vLLM and k = 1
resumes exactly after SIGKILL. The kill-and-resume tests of tests/test_trainer.py run with k = 0, 1, 2.
"""

import json
import math
import threading
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from tests import test_offline
from tests.conftest import VLLM_STARTUP_TIMEOUT_S, tiny_spec
from tests.test_trainer import assert_same_as_straight, cli, deterministic, read_jsonl, spec_file, trainer_for
from trainer.checkpoint import list_checkpoints
from trainer.config import TrainerConfig
from trainer.logprobs import completion_logprobs
from trainer.loop import Callbacks, GRPOTrainer
from trainer.rollouts import RolloutBatch, StaleRolloutError, sampling_version

SECTIONS = dict(optim={"steps": 6, "learning_rate": 3e-3}, checkpoint={"every": 3, "keep_last": 5})
G = 4
STARTUP_TIMEOUT_S = VLLM_STARTUP_TIMEOUT_S
SAME_WEIGHTS = 1e-4  # engine vs trainer logprob under the same weights (fp32: ~1e-5 measured)


def snapshot(t: GRPOTrainer) -> dict:
    return {n: p.detach().clone() for n, p in t.named_params}


@torch.no_grad()
def largest_diff_under(t: GRPOTrainer, weights: dict, batch: RolloutBatch) -> float:
    """max |engine logprob - the trainer's logprob with `weights` loaded| over the batch's tokens."""
    now = snapshot(t)
    for n, p in t.named_params:
        p.data.copy_(weights[n])
    try:
        worst = 0.0
        for c in batch.completions:
            ids = torch.tensor([c.prompt_ids + c.token_ids])
            ours, _ = completion_logprobs(t.model, ids, torch.ones_like(ids), len(c.token_ids), temperature=1.0)
            worst = max(worst, float((ours[0] - torch.tensor(c.logprobs)).abs().max()))
        return worst
    finally:
        for n, p in t.named_params:
            p.data.copy_(now[n])


def ahead(t: GRPOTrainer) -> list[RolloutBatch]:
    """The batches made and not yet trained on, as a checkpoint would save them."""
    return [RolloutBatch.from_json(b) for b in t.rollouts.state_dict()["batches"]]


def assert_sampled_by_schedule(t: GRPOTrainer, weights: dict[int, dict], k: int) -> None:
    batches = ahead(t)
    assert batches, "no batch is made ahead"
    for batch in batches:
        version = sampling_version(batch.step, k)
        assert batch.versions == [version] * len(batch.completions)
        diffs = {v: largest_diff_under(t, w, batch) for v, w in weights.items()}
        assert diffs[version] < SAME_WEIGHTS, (batch.step, diffs)
        assert all(d > 10 * SAME_WEIGHTS for v, d in diffs.items() if v != version), (batch.step, diffs)


# ------------------------------------------------------------------------------------------ the schedule


@pytest.mark.parametrize("k, expected", [(0, [0, 1, 2, 3, 4]), (1, [0, 0, 1, 2, 3]), (3, [0, 0, 0, 0, 1])])
def test_the_batch_of_step_s_is_sampled_by_the_policy_after_step_s_minus_1_minus_k(k, expected):
    assert [sampling_version(s, k) for s in range(1, 6)] == expected


def test_a_negative_limit_is_refused_naming_the_field(tiny_model):
    with pytest.raises(ValidationError, match="rollout.max_off_policy_steps"):
        TrainerConfig.model_validate(tiny_spec(tiny_model, rollout={"max_off_policy_steps": -1}))


@pytest.fixture(scope="module")
def hf_ahead(tiny_model, tmp_path_factory):
    """k = 2 with the HF engine: three steps, the trainable weights after each (version v = after step v)."""
    t = trainer_for(tiny_model, tmp_path_factory.mktemp("hf-ahead"), **SECTIONS, rollout={"max_off_policy_steps": 2})
    weights, history = {0: snapshot(t)}, []
    for step in (1, 2, 3):
        history.append(t.train_step(step))
        weights[step] = snapshot(t)
    yield t, weights, history
    t.close()


def test_hf_batches_made_ahead_are_sampled_by_the_weights_k_steps_back(hf_ahead):
    """After step 3 with k = 2, the batches of steps 4 and 5 are ready: sampled by versions 1 and 2, and their
    logprobs are those of exactly those weights (no other version's)."""
    t, weights, _ = hf_ahead
    assert [b.step for b in ahead(t)] == [4, 5]
    assert_sampled_by_schedule(t, weights, k=2)


def test_staleness_reports_the_versions_between_sampler_and_trained_weights(hf_ahead):
    _, _, history = hf_ahead
    assert [m["sampling/staleness/mean"] for m in history] == [0.0, 1.0, 2.0]
    assert [m["sampling/staleness/max"] for m in history] == [0.0, 1.0, 2.0]


def test_the_trainers_old_policy_is_its_own_so_off_policy_batches_show_as_a_logprob_difference(hf_ahead):
    """Step 1's batch was sampled by the weights it trains (difference ~0); step 3's by the weights two steps back."""
    _, _, history = hf_ahead
    assert history[0]["sampling/sampling_logp_difference/max"] < SAME_WEIGHTS
    assert history[2]["sampling/sampling_logp_difference/max"] > 10 * SAME_WEIGHTS
    assert history[2]["policy_ratio/mean"] == 1.0


def test_a_batch_beyond_the_limit_is_never_trained_on(tiny_model, tmp_path):
    t = trainer_for(tiny_model, tmp_path, **SECTIONS, rollout={"max_off_policy_steps": 1})
    try:
        t.train(2)
        state = t.rollouts.state_dict()
        assert [b["step"] for b in state["batches"]] == [3]
        state["batches"][0]["versions"] = [0] * len(state["batches"][0]["versions"])  # 2 versions behind step 3
        t.rollouts.load_state_dict(state)
        with pytest.raises(
            StaleRolloutError,
            match=r"^step 3: its rollouts were sampled 2 policy versions ago "
            r"\(version 0\), beyond rollout.max_off_policy_steps=1",
        ):
            t.train(3)
    finally:
        t.close()
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


# ------------------------------------------------------------------------------------------ offline: read ahead


# completions of 6 prompts sampled from the tiny model, with logprobs, as an outside service would write them
trajectories = test_offline.trajectories


def offline_trainer(tiny_model, path: Path, out: Path, k: int, callbacks=()) -> GRPOTrainer:
    spec = tiny_spec(
        tiny_model,
        data={"source": str(path)},
        rollout={"engine": "offline", "max_tokens": 24, "max_off_policy_steps": k},
        grpo={"num_generations": G, "prompts_per_step": 2, "beta": 0.04},
        optim={"steps": 4, "learning_rate": 1e-3},
        checkpoint={"every": 100},
    )
    return GRPOTrainer(TrainerConfig.model_validate(spec), out, callbacks=callbacks, progress=False)


def test_offline_batches_read_ahead_train_exactly_as_batches_read_in_step(tiny_model, trajectories, tmp_path):
    """A trajectory file's completions do not depend on the policy: reading them k steps ahead on the background
    thread changes nothing but the staleness reported."""
    runs = {}
    for k in (0, 2):
        t = offline_trainer(tiny_model, trajectories, tmp_path / f"k{k}", k)
        runs[k] = t.train(4).history
        t.close()
    assert [m["sampling/staleness/max"] for m in runs[2]] == [0.0, 1.0, 2.0, 2.0]
    drop = ("sampling/staleness/mean", "sampling/staleness/max")
    for a, b in zip(runs[0], runs[2]):
        assert {n: v for n, v in deterministic(a).items() if n not in drop} == {
            n: v for n, v in deterministic(b).items() if n not in drop
        }


class TrainingFinished(Callbacks):
    def __init__(self):
        self.steps: dict[int, threading.Event] = {}

    def event(self, step: int) -> threading.Event:
        return self.steps.setdefault(step, threading.Event())

    def on_step(self, step, metrics):
        self.event(step).set()


class WaitsForTheTrainer:
    """The real offline engine, whose generate() for the batch of step b >= 2 first waits (at most 30 s) until
    step b-1 has finished training, and records whether it saw that and on which thread it ran. In the trainer's
    own thread that wait could never end: step b-1 cannot finish while its thread is here."""

    overlaps_training = True

    def __init__(self, engine, finished: TrainingFinished):
        self.engine, self.finished, self.name = engine, finished, engine.name
        self.seen: dict[int, tuple[bool, str]] = {}

    def generate(self, prompts, params):
        step = params.seed  # rollout.seed is 0: rollout_seed(0, step) is the step
        if step >= 2:
            self.seen[step] = (self.finished.event(step - 1).wait(30), threading.current_thread().name)
        return self.engine.generate(prompts, params)

    def sync_weights(self, model, step):
        return self.engine.sync_weights(model, step)

    def close(self):
        self.engine.close()


def test_the_next_batch_is_generated_while_the_trainer_updates(tiny_model, trajectories, tmp_path):
    finished = TrainingFinished()
    t = offline_trainer(tiny_model, trajectories, tmp_path, k=1, callbacks=[finished])
    engine = WaitsForTheTrainer(t.engine, finished)
    t.engine = engine
    try:
        t.train(4)
    finally:
        t.close()
    assert engine.seen == {2: (True, "ballast-rollouts"), 3: (True, "ballast-rollouts"), 4: (True, "ballast-rollouts")}


# ------------------------------------------------------------------------------------------ vLLM


@pytest.fixture(scope="module")
def vllm_url(vllm_python, tiny_model, tmp_path_factory):
    """One server for the module (base model, runtime LoRA loading), reached by every run through rollout.vllm_url."""
    from trainer.engines.vllm_server import VLLMServer

    server = VLLMServer.start(
        vllm_python,
        str(tiny_model),
        log_path=tmp_path_factory.mktemp("vllm") / "server.log",
        max_lora_rank=8,
        startup_timeout_s=STARTUP_TIMEOUT_S,
        extra_args=["--block-size", "32"],
    )
    yield server.url
    server.close()


def vllm_sections(url: str, k: int) -> dict:
    return dict(SECTIONS, rollout={"engine": "vllm", "vllm_url": url, "max_off_policy_steps": k})


def test_vllm_batches_made_ahead_on_the_background_are_sampled_by_the_adapter_k_versions_back(
    tiny_model, vllm_url, tmp_path
):
    """k = 1: while step s trains, the server samples step s+1's batch with the adapter pushed at the start of
    step s (version s-1); its logprobs match those weights and no other version's."""
    t = trainer_for(tiny_model, tmp_path, **vllm_sections(vllm_url, 1))
    try:
        weights, history = {0: snapshot(t)}, []
        for step in (1, 2, 3):
            history.append(t.train_step(step))
            weights[step] = snapshot(t)
        assert [b.step for b in ahead(t)] == [4]
        assert_sampled_by_schedule(t, weights, k=1)
    finally:
        t.close()
    assert [m["sampling/staleness/max"] for m in history] == [0.0, 1.0, 1.0]
    assert all(math.isfinite(m["loss"]) for m in history)


@pytest.fixture(scope="module")
def vllm_straight_run(tiny_model, vllm_url, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm-straight")
    t = trainer_for(tiny_model, out, **vllm_sections(vllm_url, 1))
    t.train(6)
    t.close()
    return out


def test_vllm_k1_resume_after_sigkill_equals_uninterrupted_run(tiny_model, vllm_url, vllm_straight_run, tmp_path):
    spec = spec_file(tiny_model, tmp_path / "spec.yaml", **vllm_sections(vllm_url, 1))
    run = tmp_path / "run"
    killed = cli(
        "train", str(spec), "--output", str(run), "--quiet", env={"BALLAST_FAULT": "kill-in-step:5"}, check=False
    )
    assert killed.returncode == -9
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [3]
    saved = json.loads((run / "checkpoints" / "step-000003" / "state" / "trainer_state.json").read_text())
    assert [b["step"] for b in saved["rollouts"]["batches"]] == [4]  # in flight at the checkpoint, saved with it
    cli("train", str(spec), "--output", str(run), "--quiet", "--resume")
    assert_same_as_straight(run, vllm_straight_run)
