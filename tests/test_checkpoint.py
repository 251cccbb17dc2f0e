"""The checkpoint format's one home (trainer/checkpoint.py): step directory names, verification on open, and
loading the saved policy back — an adapter onto its base, or a full fine-tune's complete model directory."""

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import tiny_spec
from trainer.checkpoint import Checkpoint, CheckpointError, latest_checkpoint, parse_step_dir, step_dir_name
from trainer.config import TrainerConfig
from trainer.loop import GRPOTrainer
from trainer.model import compare_fingerprint


def trained(tiny_model, out, **sections) -> Checkpoint:
    cfg = TrainerConfig.model_validate(
        tiny_spec(tiny_model, optim={"steps": 1, "learning_rate": 1e-2}, checkpoint={"every": 1}, **sections)
    )
    trainer = GRPOTrainer(cfg, out, progress=False)
    trainer.train()
    trainer.close()
    return latest_checkpoint(out / "checkpoints")


@pytest.fixture(scope="module")
def adapter_checkpoint(tiny_model, tmp_path_factory) -> Checkpoint:
    return trained(tiny_model, tmp_path_factory.mktemp("adapter"))


@pytest.fixture(scope="module")
def full_checkpoint(tiny_model, tmp_path_factory) -> Checkpoint:
    return trained(tiny_model, tmp_path_factory.mktemp("full"), lora={"enabled": False}, grpo={"beta": 0.0})


def test_step_directories_are_named_and_parsed_one_way():
    assert step_dir_name(120) == "step-000120"
    assert parse_step_dir("step-000120") == 120
    assert parse_step_dir(step_dir_name(1_234_567)) == 1_234_567
    for other in ("step-12", ".tmp-step-000001-42", "step-000001.bak", "adapter"):
        assert parse_step_dir(other) is None


def test_open_reads_step_weights_kind_and_locations(adapter_checkpoint):
    c = Checkpoint.open(adapter_checkpoint.path)
    assert c.step == 1 and c.weights == "adapter"
    assert c.adapter_dir == c.path / "adapter" and c.model_dir is None
    assert (c.tokenizer_dir / "tokenizer_config.json").is_file()
    assert c.fingerprint["token_ids"] and c.base_model["name_or_path"]


def test_open_refuses_an_altered_file_naming_it(adapter_checkpoint, tmp_path):
    import shutil

    copy = tmp_path / adapter_checkpoint.path.name
    shutil.copytree(adapter_checkpoint.path, copy)
    state = copy / "state" / "trainer_state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "step": 99}))
    with pytest.raises(CheckpointError, match="state/trainer_state.json does not match its sha256"):
        Checkpoint.open(copy)
    assert Checkpoint.open(copy, verify=False).step == 1  # reading without verifying is explicit


def test_adapter_checkpoint_loads_back_to_the_saved_policy(adapter_checkpoint, tiny_model):
    from trainer.config import LoraConfig, ModelConfig

    model, tokenizer = adapter_checkpoint.load_policy(
        ModelConfig(name_or_path=str(tiny_model), device="cpu"), LoraConfig(r=8, alpha=16)
    )
    assert compare_fingerprint(model, tokenizer, "cpu", adapter_checkpoint.fingerprint) < 1e-5


def test_full_finetune_checkpoint_is_a_complete_model_directory(full_checkpoint):
    assert full_checkpoint.weights == "model" and full_checkpoint.adapter_dir is None
    model = AutoModelForCausalLM.from_pretrained(full_checkpoint.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(full_checkpoint.model_dir)
    assert tokenizer.chat_template and tokenizer.eos_token == "</s>"
    assert compare_fingerprint(model, tokenizer, "cpu", full_checkpoint.fingerprint) < 1e-5


def test_full_finetune_checkpoint_loads_through_the_checkpoint(full_checkpoint, tiny_model):
    from trainer.config import LoraConfig, ModelConfig

    model, tokenizer = full_checkpoint.load_policy(
        ModelConfig(name_or_path=str(tiny_model), device="cpu"), LoraConfig(enabled=False)
    )
    assert not hasattr(model, "peft_config")
    assert compare_fingerprint(model, tokenizer, "cpu", full_checkpoint.fingerprint) < 1e-5
