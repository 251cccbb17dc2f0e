"""trainer/model.py: the offline tiny model loads like any Hugging Face model; LoRA policies, adapters,
identity and fingerprints behave; bad paths fail with the fix in the message.

The model is built once for the module with a short warm-up (these tests check mechanics, not accuracy;
the full recipe's accuracy is recorded in each build's ballast_build.json); the shipped tiny model
(trainer/assets/tiny-arith) is checked against today's recipe and copied where a spec asks for it.
"""

import json
from dataclasses import asdict

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import perturb_lora
from trainer.config import LoraConfig, ModelConfig
from trainer.data import render_prompt
from trainer.model import (
    compare_fingerprint,
    ensure_model,
    load_policy,
    load_tokenizer,
    logprob_fingerprint,
    model_identity,
    resolve_device,
)
from trainer.tiny import BUILD_RECORD, RECIPE, SHIPPED, build_tiny_arith

CPU = torch.device("cpu")
LORA = LoraConfig(r=4, alpha=8)


@pytest.fixture(scope="module")
def built_tiny(tmp_path_factory):
    """A fresh build (a model build: integration, tests/conftest.py)."""
    return build_tiny_arith(tmp_path_factory.mktemp("tiny") / "model", seed=0, warmup_steps=30, progress=False)


@pytest.fixture
def tiny():
    return SHIPPED


def model_cfg(path) -> ModelConfig:
    return ModelConfig(name_or_path=str(path), device="cpu")


def logits(model, tokenizer) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([render_prompt(tokenizer, "23+58")])).logits


# ── the built directory is an ordinary Hugging Face model ──────────────────────────────────────────


def test_build_writes_a_hugging_face_directory_and_its_record(built_tiny):
    names = {p.name for p in built_tiny.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        BUILD_RECORD,
    } <= names
    record = json.loads((built_tiny / BUILD_RECORD).read_text())
    assert record["seed"] == 0 and record["max_warmup_steps"] == 30 and 1 <= record["warmup_steps_done"] <= 30
    assert record["held_out_prompts"] == 64
    assert {"accuracy", "format_rate"} <= set(record["greedy"])
    assert {"accuracy", "format_rate"} <= set(record["sampled_t1"])


def test_loads_through_auto_classes_with_llama_head_dim_64(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert model.config.model_type == "llama"
    assert model.config.head_dim == 64 == model.config.hidden_size // model.config.num_attention_heads
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_tokenizer_pads_left_and_has_pad_bos_eos(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    assert tokenizer.padding_side == "left"
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<pad>", "<s>", "</s>")
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3
    batch = tokenizer(["1+1", "10+10"], padding=True)
    assert batch["attention_mask"][0][:2] == [0, 0] and batch["input_ids"][0][0] == tokenizer.pad_token_id


def test_chat_template_renders_user_turn_generation_prompt_and_eos(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    user = [{"role": "user", "content": "23+58"}]
    rendered = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    assert rendered == "<s><|user|>23+58<|assistant|>"
    turn = user + [{"role": "assistant", "content": "<output>81</output>"}]
    assert tokenizer.apply_chat_template(turn, tokenize=False) == "<s><|user|>23+58<|assistant|><output>81</output></s>"
    ids = render_prompt(tokenizer, "23+58")
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 1 + 1 + len("23+58") + 1


def test_decode_round_trips_ascii_byte_for_byte(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    for text in ["12+7=19 <output>19</output>", "  spaces\tand\nnewlines  ", "".join(map(chr, range(32, 127)))]:
        ids = tokenizer.encode(text)
        assert len(ids) == len(text.encode())
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


# ── policies and adapters ──────────────────────────────────────────────────────────────────────────


def test_lora_policy_trains_only_lora_weights(tiny):
    model, tokenizer = load_policy(model_cfg(tiny), LORA)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert tokenizer.padding_side == "left" and next(model.parameters()).device == CPU


def test_frozen_policy_has_no_trainable_weights_and_is_in_eval_mode(tiny):
    model, _ = load_policy(model_cfg(tiny), LORA, trainable=False)
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_full_fine_tuning_policy_trains_every_weight(tiny):
    model, _ = load_policy(model_cfg(tiny), LoraConfig(enabled=False))
    assert all(p.requires_grad for p in model.parameters())


def test_saved_adapter_reloads_with_identical_logits(tiny, tmp_path):
    model, tokenizer = load_policy(model_cfg(tiny), LORA)
    perturb_lora(model, seed=1)
    model.save_pretrained(tmp_path / "adapter")
    reloaded, _ = load_policy(model_cfg(tiny), LORA, adapter_path=str(tmp_path / "adapter"), trainable=False)
    model.eval()
    assert torch.equal(logits(model, tokenizer), logits(reloaded, tokenizer))


def test_adapter_dir_without_adapter_config_is_refused_by_name(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"adapter_path='.*empty-adapter' holds no adapter_config.json"):
        load_policy(model_cfg(tiny), LORA, adapter_path=str(tmp_path / "empty-adapter"))


# ── identity and fingerprint ───────────────────────────────────────────────────────────────────────


def test_fingerprint_is_stable_across_reloads(tiny):
    model, tokenizer = load_policy(model_cfg(tiny), LORA)
    fingerprint = logprob_fingerprint(model, tokenizer, CPU)
    assert len(fingerprint["token_ids"]) == 32 and len(fingerprint["logprobs"]) == 31
    assert fingerprint["token_ids"][0] == tokenizer.bos_token_id
    reloaded, reloaded_tokenizer = load_policy(model_cfg(tiny), LORA, trainable=False)
    assert logprob_fingerprint(reloaded, reloaded_tokenizer, CPU)["token_ids"] == fingerprint["token_ids"]
    assert compare_fingerprint(reloaded, reloaded_tokenizer, CPU, fingerprint) <= 1e-6
    assert model.training, "the fingerprint leaves the model's train/eval mode as it found it"


def test_fingerprint_changes_when_the_adapter_changes(tiny):
    model, tokenizer = load_policy(model_cfg(tiny), LORA)
    fingerprint = logprob_fingerprint(model, tokenizer, CPU)
    perturb_lora(model, seed=2)
    assert compare_fingerprint(model, tokenizer, CPU, fingerprint) > 1e-3


def test_model_identity_hashes_config_and_weights(tiny):
    identity = model_identity(model_cfg(tiny))
    assert identity["name_or_path"] == str(tiny)
    assert len(identity["config_sha256"]) == 16 and list(identity["weights_sha256"]) == ["model.safetensors"]
    assert model_identity(model_cfg(tiny)) == identity
    assert model_identity(ModelConfig(name_or_path="org/some-hub-model")) == {"name_or_path": "org/some-hub-model"}


# ── building: deterministic, atomic, on demand ─────────────────────────────────────────────────────


@pytest.mark.integration  # three model builds
def test_build_is_deterministic_for_a_seed_and_differs_across_seeds(tmp_path):
    a, b, c = (
        build_tiny_arith(tmp_path / name, seed=seed, warmup_steps=2, progress=False)
        for name, seed in [("a", 0), ("b", 0), ("c", 1)]
    )
    hashes = [model_identity(model_cfg(p))["weights_sha256"] for p in (a, b, c)]
    assert hashes[0] == hashes[1] != hashes[2]


def test_build_is_atomic_and_leaves_no_temporary_directory(built_tiny):
    assert [p.name for p in built_tiny.parent.iterdir()] == ["model"]


def test_build_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="exists and is not an empty directory"):
        build_tiny_arith(tmp_path / "taken", warmup_steps=1, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_the_shipped_tiny_model_was_built_by_todays_recipe():
    """A change to the recipe needs `python scripts/build_tiny_model.py` (and the rebuilt files committed)."""
    record = json.loads((SHIPPED / BUILD_RECORD).read_text())
    assert record["recipe"] == asdict(RECIPE) and record["seed"] == 0


def test_ensure_model_copies_the_shipped_model_once_when_missing(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr("trainer.tiny.build_tiny_arith", lambda path, **kwargs: built.append(path))
    cfg = ModelConfig(name_or_path=str(tmp_path / "m"), build_if_missing="tiny-arith")
    assert ensure_model(cfg) == cfg.name_or_path
    copied = tmp_path / "m"
    assert {p.name: p.read_bytes() for p in copied.iterdir()} == {p.name: p.read_bytes() for p in SHIPPED.iterdir()}
    (copied / "marker").write_text("kept")
    assert ensure_model(cfg) == cfg.name_or_path and (copied / "marker").read_text() == "kept"
    assert built == [] and sorted(p.name for p in tmp_path.iterdir()) == ["m"]


@pytest.mark.integration  # a model build
def test_ensure_model_builds_only_when_missing_and_nothing_is_shipped(tmp_path, monkeypatch):
    built = []

    def short_build(path, **kwargs):
        built.append(path)
        return build_tiny_arith(path, warmup_steps=1, progress=False)

    monkeypatch.setattr("trainer.tiny.build_tiny_arith", short_build)
    monkeypatch.setattr("trainer.tiny.SHIPPED", tmp_path / "not-shipped")
    cfg = ModelConfig(name_or_path=str(tmp_path / "m"), build_if_missing="tiny-arith")
    assert ensure_model(cfg) == cfg.name_or_path and (tmp_path / "m" / "config.json").is_file()
    assert ensure_model(cfg) == cfg.name_or_path and len(built) == 1
    assert ensure_model(ModelConfig(name_or_path=str(tmp_path / "other"))) == str(tmp_path / "other")
    assert len(built) == 1 and not (tmp_path / "other").exists()


# ── errors and devices ─────────────────────────────────────────────────────────────────────────────


def test_missing_path_is_a_value_error_that_says_how_to_fix_it(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(
        ValueError,
        match=r"model.name_or_path='.*no-such-model' is neither a local directory .*"
        r"build_if_missing: tiny-arith or point to a downloaded model directory",
    ):
        load_policy(model_cfg(missing), LORA)
    with pytest.raises(ValueError, match="is neither a local directory"):
        load_tokenizer(missing)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is a directory without config.json"):
        load_tokenizer(tmp_path)


def test_resolve_device():
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="model.device='gpu0' is not a device"):
        resolve_device("gpu0")


def test_a_tiny_model_from_an_earlier_recipe_is_used_with_a_warning_saying_how_to_rebuild(tiny, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(tiny, old)
    record = json.loads((old / BUILD_RECORD).read_text())
    record["recipe"]["target_argmax_accuracy"] = 0.25
    (old / BUILD_RECORD).write_text(json.dumps(record))
    cfg = ModelConfig(name_or_path=str(old), build_if_missing="tiny-arith", device="cpu")
    with pytest.warns(UserWarning, match="built by an earlier recipe .* delete the directory and run again"):
        assert ensure_model(cfg) == str(old)


# ── the knobs real-model users expect ──────────────────────────────────────────────────────────────

LLAMA_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def test_dtype_auto_is_float32_on_cpu_and_an_explicit_dtype_is_what_loads(tiny):
    auto, _ = load_policy(model_cfg(tiny), LORA, trainable=False)
    bf16, _ = load_policy(ModelConfig(name_or_path=str(tiny), device="cpu", dtype="bfloat16"), LORA, trainable=False)
    assert next(auto.parameters()).dtype == torch.float32
    assert next(bf16.get_base_model().parameters()).dtype == torch.bfloat16


def test_attention_implementation_is_sdpa_by_default_and_eager_on_request(tiny):
    sdpa, _ = load_policy(model_cfg(tiny), LoraConfig(enabled=False), trainable=False)
    eager, _ = load_policy(
        ModelConfig(name_or_path=str(tiny), device="cpu", attn_implementation="eager"),
        LoraConfig(enabled=False),
        trainable=False,
    )
    assert (sdpa.config._attn_implementation, eager.config._attn_implementation) == ("sdpa", "eager")
    with torch.no_grad():
        ids = torch.tensor([render_prompt(AutoTokenizer.from_pretrained(tiny), "23+58")])
        torch.testing.assert_close(sdpa(input_ids=ids).logits, eager(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_an_attention_implementation_that_cannot_run_is_refused_naming_the_field(tiny):
    cfg = ModelConfig(name_or_path=str(tiny), device="cpu", attn_implementation="no_such_attention")
    with pytest.raises(
        ValueError,
        match=r"^model.attn_implementation='no_such_attention' cannot be used here .*"
        r"use sdpa \(the default\) or eager$",
    ):
        load_policy(cfg, LORA)


def test_gradient_checkpointing_applies_to_a_trainable_policy_only(tiny):
    cfg = ModelConfig(name_or_path=str(tiny), device="cpu", gradient_checkpointing=True)
    trainable, _ = load_policy(cfg, LORA)
    frozen, _ = load_policy(cfg, LORA, trainable=False)
    plain, _ = load_policy(model_cfg(tiny), LORA)
    assert trainable.is_gradient_checkpointing and not frozen.is_gradient_checkpointing
    assert not plain.is_gradient_checkpointing


def test_torch_threads_sets_the_intra_op_thread_count(tiny):
    before = torch.get_num_threads()
    try:
        load_policy(ModelConfig(name_or_path=str(tiny), device="cpu", torch_threads=1), LORA, trainable=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_lora_targets_every_linear_layer_but_the_output_layer_by_default(tiny, tmp_path):
    model, _ = load_policy(model_cfg(tiny), LORA)
    assert LoraConfig().target_modules == "all-linear"
    assert sorted(model.peft_config["default"].target_modules) == LLAMA_LINEAR
    model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(saved["target_modules"]) == LLAMA_LINEAR  # short names, as vLLM and every peft read them
    assert not any("lm_head" in name for name, _ in model.named_parameters() if "lora_" in name)


def test_a_target_module_the_model_lacks_is_refused_naming_lora_target_modules(tiny):
    with pytest.raises(
        ValueError,
        match=r"^lora.target_modules: 'qkv_proj' not in this LlamaForCausalLM; its linear "
        r"layers are down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj",
    ):
        load_policy(model_cfg(tiny), LoraConfig(target_modules=["q_proj", "qkv_proj"]))


def test_model_device_cuda_on_a_machine_without_cuda_is_refused_naming_the_field():
    if torch.cuda.is_available():
        assert resolve_device("cuda") == torch.device("cuda")
        return
    with pytest.raises(
        ValueError,
        match=r"^model.device='cuda' but this machine has no CUDA GPU .* set model.device: "
        r"auto \(or cpu\)$",
    ):
        resolve_device("cuda")


def test_a_wrong_device_fails_before_a_missing_model_is_built(tmp_path):
    if torch.cuda.is_available():
        return  # every device name below exists on this machine
    cfg = ModelConfig(name_or_path=str(tmp_path / "never-built"), build_if_missing="tiny-arith", device="cuda:0")
    with pytest.raises(ValueError, match="model.device='cuda:0'"):
        ensure_model(cfg)
    assert not (tmp_path / "never-built").exists()


def test_a_full_fine_tune_saved_with_its_tokenizer_reloads_as_the_same_policy(tiny, tmp_path):
    model, tokenizer = load_policy(model_cfg(tiny), LoraConfig(enabled=False))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(1.5)  # a trained model differs from its base
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")  # what a full fine-tune's checkpoint holds
    reloaded, reloaded_tokenizer = load_policy(
        model_cfg(tmp_path / "model"), LoraConfig(enabled=False), trainable=False
    )
    model.eval()
    assert torch.equal(logits(model, tokenizer), logits(reloaded, reloaded_tokenizer))
    assert render_prompt(reloaded_tokenizer, "23+58") == render_prompt(tokenizer, "23+58")
    assert (reloaded_tokenizer.eos_token, reloaded_tokenizer.pad_token, reloaded_tokenizer.padding_side) == (
        "</s>",
        "<pad>",
        "left",
    )


# ── a float32 adapter over a bf16 base ─────────────────────────────────────────────────────────────


def _training_forward(model, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of the tensors the training forward keeps for its backward (parameters not counted, a storage
    counted once), and the completion logprobs; runs the backward."""
    from trainer.logprobs import completion_logprobs

    kept: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, _ = completion_logprobs(model, ids, torch.ones_like(ids), ids.shape[1] - 8)
    logprobs.sum().backward()
    return sum(kept.values()), logprobs.detach()


def test_a_float32_adapter_over_a_bf16_base_computes_in_bf16_and_keeps_no_float32_copies(built_tiny):
    tiny = built_tiny  # the bound on bf16 rounding away from peft's was measured on this build
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    cfg = ModelConfig(name_or_path=str(tiny), device="cpu", dtype="bfloat16")
    lora = LoraConfig(r=4, alpha=8, dropout=0.0)
    ours, _ = load_policy(cfg, lora)
    perturb_lora(ours, seed=2)
    peft_default, _ = load_policy(cfg, lora)  # peft's own arithmetic: every adapted layer's input cast to fp32
    del peft_default.get_decoder().forward
    for module in peft_default.modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = True
    bf16_adapter, _ = load_policy(cfg, lora)  # the floor: the adapter itself cast to bf16
    for other in (peft_default, bf16_adapter):
        set_peft_model_state_dict(other, get_peft_model_state_dict(ours))
    for name, param in bf16_adapter.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(torch.bfloat16)

    ids = torch.randint(0, ours.config.vocab_size, (4, 40), generator=torch.Generator().manual_seed(0))
    (kept, logprobs), (kept_peft, logprobs_peft), (kept_bf16, logprobs_bf16) = (
        _training_forward(m, ids) for m in (ours, peft_default, bf16_adapter)
    )
    adapter = [p for name, p in ours.named_parameters() if "lora_" in name]
    assert {p.dtype for p in adapter} == {p.grad.dtype for p in adapter} == {torch.float32}  # full-precision state
    assert all(p.grad.abs().sum() > 0 for p in adapter)
    assert kept == kept_bf16 < 0.85 * kept_peft  # no float32 copy of any layer input is kept
    torch.testing.assert_close(logprobs, logprobs_bf16, rtol=0, atol=0)  # bf16 matmuls over the rounded weights
    torch.testing.assert_close(logprobs, logprobs_peft, rtol=0, atol=0.1)  # and bf16 rounding away from peft's
    fp32, _ = load_policy(model_cfg(tiny), lora)  # a float32 base is left as it is
    assert "forward" not in vars(fp32.get_decoder())
