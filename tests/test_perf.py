"""trainer/perf.py: the FLOPs of a step, the device's peak, the MFU metrics, and the choice of packing and gradient
checkpointing when the spec says "auto" — on constructed numbers, and on a real step on CPU (no peak: no metric)."""

import math
from types import SimpleNamespace

import pytest

from tests.conftest import tiny_spec
from trainer.config import TrainerConfig
from trainer.loop import GRPOTrainer
from trainer.metrics import perf_metrics
from trainer.perf import matmul_params, memory_plan, peak_flops, step_flops

LLAMA_497M = SimpleNamespace(  # bench/gpu_step.py's random Llama
    hidden_size=1024,
    num_hidden_layers=24,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=49152,
)


def test_matmul_params_count_the_projections_the_mlp_and_the_lm_head():
    d, kv_dim = 1024, 4 * 64
    per_layer = 2 * d * d + 2 * d * kv_dim + 3 * d * 2816
    assert matmul_params(LLAMA_497M) == 24 * per_layer + d * 49152
    assert matmul_params(SimpleNamespace(hidden_size=8)) is None  # not a decoder config it knows


def test_a_lora_update_counts_4n_over_its_frozen_base_and_a_full_one_6n():
    lora = step_flops(n=1000, n_trainable=10, full=False, tokens=7, iterations=2, reference=True)
    assert lora.update == (4 * 1000 + 6 * 10) * 7 * 2
    assert lora.total == lora.update + 2 * 1000 * 7 * 2  # generation and the reference forward
    full = step_flops(n=1000, n_trainable=1000, full=True, tokens=7)
    assert full.update == 6 * 1000 * 7 and full.total == full.update + 2 * 1000 * 7


def test_the_peak_is_the_tables_in_16_bit_the_users_if_set_and_none_elsewhere():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "float16") == 756e12
    assert peak_flops("NVIDIA H200", "bfloat16", ranks=2) == 2 * 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16") == 312e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "float32") is None  # fp32: no tensor-core figure claimed
    assert peak_flops("NVIDIA L4", "bfloat16") is None
    assert peak_flops(None, "float32") is None  # CPU
    assert peak_flops(None, "float32", ranks=2, user_tflops=1.5) == 3e12


def test_mfu_is_flops_over_seconds_times_peak_and_absent_without_a_peak():
    m = perf_metrics(update_flops=2e12, step_flops=6e12, update_s=0.5, step_s=2.0, peak=10e12)
    assert m == {"perf/mfu_update": pytest.approx(0.4), "perf/mfu_wall": pytest.approx(0.3)}
    assert perf_metrics(2e12, 6e12, 0.5, 2.0, None) == {}


GiB = 2**30


def test_auto_is_off_on_cpu_as_the_defaults_and_the_spec_wins_when_it_says():
    plan = memory_plan("cpu", None, rows_per_micro=64, tokens_per_row=300, hidden=1024, layers=24, dtype_bytes=4)
    assert (plan.pack, plan.checkpointing) == (False, False)
    told = memory_plan("cpu", None, 64, 300, 1024, 24, 4, pack=True, checkpointing=True)
    assert (told.pack, told.checkpointing) == (True, True)


def test_auto_on_a_gpu_packs_several_rows_and_checkpoints_when_activations_crowd_the_free_memory():
    # 64 rows x 300 tokens x 24 layers x 1024 x 17 elements x 2 bytes = 14.9 GiB of activations
    roomy = memory_plan("cuda", 70 * GiB, rows_per_micro=64, tokens_per_row=300, hidden=1024, layers=24, dtype_bytes=2)
    assert roomy.pack and not roomy.checkpointing
    tight = memory_plan("cuda", 20 * GiB, rows_per_micro=64, tokens_per_row=300, hidden=1024, layers=24, dtype_bytes=2)
    assert tight.checkpointing and "14.9 GiB" in tight.reason
    one_row = memory_plan("cuda", 70 * GiB, rows_per_micro=1, tokens_per_row=300, hidden=1024, layers=24, dtype_bytes=2)
    assert not one_row.pack  # one row a micro-batch has no padding to remove


def test_a_cpu_step_logs_no_mfu_unless_the_spec_gives_a_peak_and_auto_settles_to_off(tiny_model, tmp_path):
    spec = tiny_spec(tiny_model, optim={"steps": 1}, grpo={"pack_sequences": "auto"})
    spec["model"]["gradient_checkpointing"] = "auto"
    trainer = GRPOTrainer(TrainerConfig.model_validate(spec), tmp_path / "plain", progress=False)
    assert trainer.cfg.grpo.pack_sequences is False and trainer.cfg.model.gradient_checkpointing is False
    assert not any(k.startswith("perf/") for k in trainer.train(1).history[0])
    trainer.close()
    spec["model"]["peak_tflops"] = 0.5
    trainer = GRPOTrainer(TrainerConfig.model_validate(spec), tmp_path / "peak", progress=False)
    m = trainer.train(1).history[0]
    trainer.close()
    assert 0 < m["perf/mfu_update"] < 1 and 0 < m["perf/mfu_wall"] < m["perf/mfu_update"]
    n = matmul_params(trainer.model.get_base_model().config)
    assert n == 2 * (4 * 128 * 128 + 3 * 128 * 384) + 128 * 261  # the tiny model
    assert math.isfinite(m["perf/mfu_wall"])
