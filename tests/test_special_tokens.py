"""trainer/special_tokens.py: a model whose special tokens would break generation is refused at load, one that is
merely inconsistent is loaded with a warning naming the fix. Each broken model is a copy of the cached tiny model
with one file edited, as a hand-converted model comes."""

import json
import shutil
import warnings

import pytest
from transformers import AutoTokenizer, GenerationConfig

from trainer.config import LoraConfig, ModelConfig
from trainer.model import load_policy
from trainer.special_tokens import assistant_terminator, check_special_tokens, stop_token_ids

NO_LORA = LoraConfig(enabled=False)


def copy_of(tiny_model, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny_model, target)
    return target


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def load(path):
    return load_policy(ModelConfig(name_or_path=str(path), device="cpu"), NO_LORA, trainable=False)


def test_the_tiny_model_loads_without_a_warning(tiny_model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, tokenizer = load(tiny_model)
    assert assistant_terminator(tokenizer) == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("</s>")
    assert stop_token_ids(tokenizer, model.generation_config) == [tokenizer.eos_token_id]


def test_a_chat_template_whose_assistant_turn_ends_with_a_token_that_stops_nothing_is_refused(tiny_model, tmp_path):
    path = copy_of(tiny_model, tmp_path)
    template = (path / "chat_template.jinja").read_text().replace("{{ eos_token }}", "<|user|>")
    (path / "chat_template.jinja").write_text(template)
    with pytest.raises(
        ValueError,
        match=r"ends an assistant turn with '<\|user\|>' \(id 3\), which is not a stop "
        r"token .* add 3 to eos_token_id in its generation_config.json",
    ):
        load(path)


def test_a_generation_config_eos_id_outside_the_vocabulary_is_refused(tiny_model, tmp_path):
    path = copy_of(tiny_model, tmp_path)
    edit_json(path / "generation_config.json", eos_token_id=[2, 9999])
    with pytest.raises(
        ValueError,
        match=r"generation_config eos_token_id\[1\] is id 9999, outside its vocabulary of "
        r"261 embeddings",
    ):
        load(path)


def test_no_end_of_sequence_token_anywhere_is_refused(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="has no end-of-sequence token"):
        check_special_tokens(tokenizer, 261, GenerationConfig(), "the-model")


def test_an_eos_that_is_also_the_bos_and_not_a_generation_stop_token_warns_with_the_fix(tiny_model, tmp_path):
    path = copy_of(tiny_model, tmp_path)  # the SmolLM2-from-GGUF case: eos = bos = <|im_start|>
    edit_json(path / "tokenizer_config.json", eos_token="<s>")
    edit_json(path / "special_tokens_map.json", eos_token="<s>")
    with pytest.warns(UserWarning) as caught:
        load(path)
    messages = [str(w.message) for w in caught]
    assert any(
        "the tokenizer's eos_token '<s>' (id 1) is not among the generation config's eos ids ('</s>' (id 2)); "
        "set eos_token to '</s>' in its tokenizer_config.json" in m
        for m in messages
    )
    assert any("eos_token and bos_token are the same token '<s>' (id 1)" in m for m in messages)


def test_a_template_that_writes_no_special_token_after_an_answer_is_not_checked(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert assistant_terminator(tokenizer) is None
    assert check_special_tokens(tokenizer, 261, GenerationConfig(eos_token_id=2), "the-model") == []
