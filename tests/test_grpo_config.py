"""The grpo section refuses combinations that would silently train something else, with one line naming the
fields and the fix (through tasks.spec.validate_spec, the path `ballast` takes before any model is loaded)."""

import pytest

from tasks.spec import SpecError, load_spec, validate_spec
from trainer.config import GRPOConfig


def spec(**grpo) -> dict:
    return {"model": {"name_or_path": "unused"}, "grpo": grpo}


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo"])
def test_sequence_level_ratio_with_a_token_summing_loss_is_refused_naming_both_fields_and_the_fix(loss_type):
    with pytest.raises(SpecError) as e:
        validate_spec(spec(importance_sampling_level="sequence", loss_type=loss_type))
    assert str(e.value) == (
        f"spec: grpo.importance_sampling_level: sequence with grpo.loss_type: {loss_type} weights each sequence by "
        f"its length ({loss_type} sums the tokens that share the sequence's ratio); set grpo.loss_type: grpo "
        f"(GSPO's setup) or grpo.importance_sampling_level: token"
    )


def test_sequence_level_ratio_with_the_grpo_loss_is_gspo_and_accepted():
    assert validate_spec(spec(importance_sampling_level="sequence", loss_type="grpo")).grpo.loss_type == "grpo"


@pytest.mark.parametrize("field", ["old_logprobs", "require_old_logprobs"])
def test_removed_old_logprobs_fields_say_what_replaced_them(field):
    with pytest.raises(
        SpecError,
        match=rf"^spec: grpo.{field} was removed: pi_old is now always the trainer's own "
        r"logprobs, .*grpo.rollout_correction",
    ):
        validate_spec(spec(**{field: "engine" if field == "old_logprobs" else True}))


def test_correction_bounds_must_be_ordered():
    with pytest.raises(SpecError, match=r"grpo.rollout_correction.low=1 must be below grpo.rollout_correction.high=1"):
        validate_spec(spec(rollout_correction={"low": 1.0, "high": 1.0}))


@pytest.mark.parametrize(
    "bounds, field",
    [
        ({"high": float("inf")}, "high"),
        ({"high": 0.5}, "high"),
        ({"low": float("nan")}, "low"),
        ({"mode": "clip"}, "mode"),
    ],
)
def test_correction_fields_refuse_infinite_out_of_range_or_unknown_values(bounds, field):
    with pytest.raises(SpecError, match=rf"field 'grpo.rollout_correction.{field}'"):
        validate_spec(spec(rollout_correction=bounds))


def test_default_correction_is_token_level_tis_capped_at_2():
    c = GRPOConfig().rollout_correction
    assert (c.mode, c.level, c.low, c.high) == ("tis", "token", 0.0, 2.0)


def test_mode_off_written_bare_in_yaml_or_set_on_the_command_line_means_off(tmp_path):
    """YAML 1.1 reads a bare `off` as false; the spec still means mode off."""
    path = tmp_path / "spec.yaml"
    path.write_text("model: {name_or_path: unused}\ngrpo:\n  rollout_correction:\n    mode: off\n")
    assert load_spec(path).grpo.rollout_correction.mode == "off"
    path.write_text("model: {name_or_path: unused}\n")
    assert load_spec(path, ["grpo.rollout_correction.mode=off"]).grpo.rollout_correction.mode == "off"
    with pytest.raises(SpecError, match="field 'grpo.rollout_correction.mode'"):
        load_spec(path, ["grpo.rollout_correction.mode=on"])  # YAML's true: no mode is called that


def test_logprob_chunk_rows_default_to_128_on_cpu_and_1024_on_a_gpu_and_a_set_value_wins():
    default = validate_spec(spec()).grpo
    assert (default.chunk_rows("cpu"), default.chunk_rows("cuda")) == (128, 1024)
    assert validate_spec(spec(logprob_chunk_size=256)).grpo.chunk_rows("cuda") == 256
    with pytest.raises(SpecError, match="logprob_chunk_size"):
        validate_spec(spec(logprob_chunk_size=0))
