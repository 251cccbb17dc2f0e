"""Population-based GRPO (trainer/population.py): members exploit and explore as they train, over one base model.

One population run (2 members, 4 steps, ranked every 2) is the reference: each ranking's loser becomes an in-memory
copy of the winner, verified by the logprob fingerprint; a population killed mid-step and resumed equals it; the
winner's schedule, replayed as a plain run (GRPOTrainer with grpo.schedule), equals the winner's lineage step by step.
Exact equality where the arithmetic allows: the rollout correction is off (the engine's logprobs, which differ in the
last bits between a batch of several members' rows and one member's, then reach no metric but sampling/*; see
tests/test_concurrent_trials.py), so metrics other than timings and sampling/* and the adapters are bit-identical.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, tiny_spec
from tests.test_trainer import adapter_weights, deterministic, read_jsonl
from trainer.config import TrainerConfig
from trainer.loop import GRPOTrainer
from trainer.pbt import Knob, Policy
from trainer.population import Population, ancestry, member_configs, member_name, read_state

STEPS, READY, P = 4, 2, 2
POLICY = Policy(
    knobs=(
        Knob("grpo.beta", 1e-3, 0.2, log=True),
        Knob("optim.learning_rate", 3e-4, 1e-2, log=True),
        Knob("rollout.repetition_penalty", 1.0, 1.2),
    ),
    fixed={"lora.r": [4, 8]},
    quantile=0.5,
    seed=1,
)


def base_cfg(model) -> TrainerConfig:
    return TrainerConfig.model_validate(
        tiny_spec(model, optim={"steps": STEPS}, grpo={"rollout_correction": {"mode": "off"}})
    )


def run_population(root: Path, model: Path, resume: bool = False):
    population = Population(root, POLICY, ready=READY, objective="eval/reward", total=STEPS)
    if resume:
        population.resume()
    else:
        population.start(member_configs(base_cfg(model), POLICY, P, READY))
    result = population.run()
    population.close()
    return result


def same(got: dict, want: dict) -> bool:
    keep = lambda m: {k: v for k, v in deterministic(m).items() if not k.startswith("sampling/")}  # noqa: E731
    return keep(got) == keep(want)


@pytest.fixture(scope="module")
def straight(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("population")
    return root, run_population(root, tiny_model)


def test_each_ranking_the_loser_becomes_a_fingerprint_verified_copy_of_the_winner(straight):
    root, result = straight
    assert [(e["step"], e["reason"]) for e in result.events] == [(2, "exploit")]  # none after the last step
    event = result.events[0]
    assert event["fingerprint_diff"] <= 1e-5
    src, dst = member_name(event["source"]), member_name(event["member"])
    assert adapter_weights(root / dst, 2).keys() == adapter_weights(root / src, 2).keys()
    for k, v in adapter_weights(root / src, 2).items():
        assert torch.equal(adapter_weights(root / dst, 2)[k], v), k
    copy = result.members[event["member"]]
    assert copy["schedule"][-1] == {"step": 3, **{k.name.split(".")[1]: event["hparams"][k.name] for k in POLICY.knobs}}
    assert copy["cfg"]["lora"]["r"] == result.members[event["source"]]["cfg"]["lora"]["r"]


def test_each_members_step_metrics_carry_its_hyperparameters_in_force(straight):
    root, result = straight
    for m in result.members:
        rows = read_jsonl(root / m["name"] / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert rows[-1]["pbt/beta"] == m["hparams"]["grpo.beta"]
        assert all("eval/reward" in r for r in rows if r["step"] % READY == 0)


def test_a_population_killed_mid_step_and_resumed_equals_the_uninterrupted_one(straight, tiny_model, tmp_path):
    root, result = straight
    code = (
        "import sys; from pathlib import Path; from tests.test_population import run_population; "
        "run_population(Path(sys.argv[1]), Path(sys.argv[2]))"
    )
    env = {**os.environ, "BALLAST_FAULT": "kill-in-step:3", "PYTHONPATH": str(REPO)}
    killed = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(tiny_model)], env=env, cwd=REPO)
    assert killed.returncode == -9
    assert read_state(tmp_path)["step"] == 2
    resumed = run_population(tmp_path, tiny_model, resume=True)
    assert resumed.events == result.events and resumed.scores == result.scores and resumed.winner == result.winner
    for m in result.members:
        got, want = read_jsonl(tmp_path / m["name"] / "metrics.jsonl"), read_jsonl(root / m["name"] / "metrics.jsonl")
        assert len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
        for k, v in adapter_weights(root / m["name"], STEPS).items():
            assert torch.equal(adapter_weights(tmp_path / m["name"], STEPS)[k], v), k


def test_the_winners_schedule_replayed_as_a_plain_run_equals_its_lineage(straight, tmp_path):
    root, result = straight
    winner = result.members[result.winner]
    cfg = TrainerConfig.model_validate(
        {**winner["cfg"], "grpo": {**winner["cfg"]["grpo"], "schedule": winner["schedule"]}}
    )
    cfg.checkpoint.every = STEPS
    trainer = GRPOTrainer(cfg, tmp_path, progress=False)
    trainer.train()
    trainer.close()
    replay = read_jsonl(tmp_path / "metrics.jsonl")
    owners = ancestry(result.events, result.winner, STEPS)
    for row in replay:
        lineage = read_jsonl(root / member_name(owners[row["step"]]) / "metrics.jsonl")[row["step"] - 1]
        assert same(row, {k: v for k, v in lineage.items() if not k.startswith("pbt/")}), row["step"]
    for k, v in adapter_weights(root / winner["name"], STEPS).items():
        assert torch.equal(adapter_weights(tmp_path, STEPS)[k], v), k
    assert json.loads(json.dumps(trainer.schedule)) == winner["schedule"]
