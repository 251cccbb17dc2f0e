"""Concurrent LoRA trials: N trials in one process over one frozen base model, each its own adapter.

A sweep's trials differ in their LoRA, GRPO and optimizer settings, not in the base model; run alone, each loads
the same base model and samples its rollouts in a batch too small to fill the machine. Here they share both. The
choices, on purpose:

- **Each trial is a GRPOTrainer** built over the shared model (`shared=`, `adapter=`): its own peft adapter (its
  own rank, alpha, dropout, targets), optimizer, scheduler, prompt sampler, rewards, health gate, callbacks and
  output directory, and the very step code a lone run executes (`GRPOTrainer.train_on`, `record_step`). Nothing
  of a step is written twice.
- **Its own RNG.** The global RNG (Python, NumPy, torch) is a trial's own: its state is saved when the trial leaves
  the model and restored when it comes back, so LoRA initialisation, dropout and anything else drawing from it see
  the stream a lone run sees. The adapter is created right after the trial's `set_seed`, as `load_policy` creates
  a lone run's, so the initial adapters are equal.
- **One rollout call.** Each round, every running trial draws its step's prompts (its sampler, its per-prompt
  seeds: trainer/rollouts.py) and all are sampled in ONE HF engine call (`HFEngine.generate_many`), each row under
  its trial's adapter (peft's per-row `adapter_names`) and drawn with its trial's settings (temperature,
  repetition penalty, top-p …) from its prompt's own seeded generator, so it does not depend on the other rows.
  Trials with different rollout.max_tokens are sampled in one call per value (the KV cache is as long as a lone
  run's). With `stacked_lora` the adapters are stacked with a per-row slot (engines/stacked.py: two dense matmuls a
  layer, no Python per row), so the rows decode inside the compiled step, refreshed from the trials' weights before
  each call; else each trial's LoRA matmul runs on its own rows, outside it.
- **Or one vLLM server.** With rollout.engine: vllm the trials share one server (started with the first such trial,
  `--max-loras` = slots, `--max-lora-rank` the largest rank a trial may take; or the user's, rollout.vllm_url), each
  trial a VLLMEngine of its own on it: its adapter versions under its own names, its served-policy check. Each
  round every trial pushes its adapter (proved served), then all trials' requests go at once, so the server's
  continuous batching samples them in one batch, each row under its trial's adapter (vLLM's multi-LoRA).
- **Updates one trial at a time**: its adapter active (peft's `set_adapter`: only it in the forward, only its
  weights trainable), its loss, backward and optimizer step. The KL reference is the base model with adapters
  disabled: one for all.
- **Slots.** A trial that finishes, collapses (its health gate), is pruned (a callback's `should_stop`) or fails
  (its step, or its part of the round's rollouts: a shared call that fails is sampled again a trial at a time to
  find whose rows fail, which draws the same tokens) leaves at the end of its step: `on_end` is called with its
  adapter still active (evaluate it, record it), its adapter is deleted, and the next job takes the slot before the
  next round. The others go on.
- **Equal to a lone run, to a step's rounding**: tests/test_concurrent_trials.py runs trials together and each
  alone: the same prompts, sampled tokens and rewards; with the rollout correction off, per-step metrics (timings
  aside) and adapters bit-identical on CPU in float32 (the adapter's matmuls run on the trial's own rows); with it on,
  within that test's TOLERANCE, because the base model's matmuls over all the trials' rows round differently in the
  last bits from the same over one trial's rows (CPU kernels depend on the number of rows) and the correction's
  weight carries those bits into the update. Over a long run they can grow: a draw whose two best tokens were that
  close goes the other way, and from there the trial is another sample of the same run (README, concurrent trials:
  a drifting trial of examples/sweep.yaml collapsed at step 29 concurrent, 16 alone).
- **Limits**: the HF or vLLM engine; rollout.max_off_policy_steps: 0; no data.environment (multi-turn episodes);
  LoRA trials only; every trial's `model` section equal (one base model), and its vLLM server settings.
  A concurrent trial is not resumed from a checkpoint mid-trial: its checkpoints are a lone run's, so
  `ballast train --resume` can finish one alone.

    runner = ConcurrentTrials(slots=4)
    outcomes = runner.run(TrialJob(f"trial{i}", cfg_i, out / f"trial{i}") for i, cfg_i in enumerate(cfgs))
"""

from __future__ import annotations

import random
import re
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel, get_peft_model

from .config import InputError, LoraConfig, ModelConfig, TrainerConfig
from .engines.hf import HFEngine
from .loop import Callbacks, GRPOTrainer, RunResult, SafePoint, _latest_path
from .model import adapter_in_base_dtype, load_policy, lora_target_modules, peft_lora_config, resolve_device
from .rollouts import RolloutBatch
from .sharing import check_concurrent

# A peft adapter name is a module key (no dots) and is cut out of the weights' names when saved: trial_<k> cannot
# be mistaken for part of a module's name (peft warns about a name like 'a', which is in 'lora_').
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-]+")


# ------------------------------------------------------------------------ the shared base model


class SharedPolicy:
    """One frozen base model, its tokenizer, the HF engine that samples it, and one named LoRA adapter per trial."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        compile_decode: str = "never",
        stacked_lora: bool = False,
        fused_sampling: bool = False,
        slots: int = 1,
        max_lora_rank: int | None = None,
    ):
        """stacked_lora, fused_sampling: the HF engine's (engines/hf.py), its stacked adapters sized for `slots`
        trials of rank up to `max_lora_rank` (more are made room for, at the cost of a new compile)."""
        self.model_cfg = model_cfg
        self.device = resolve_device(model_cfg.device)
        self.base, self.tokenizer = load_policy(model_cfg, LoraConfig(enabled=False))
        self.all_linear = lora_target_modules(self.base, "all-linear")  # resolved before any adapter wraps a layer
        self.model = None  # the PeftModel, once the first adapter is added
        self.engine = HFEngine(
            self.base,
            self.tokenizer,
            self.device,
            compile_decode=compile_decode,
            fused_sampling=fused_sampling,
            stacked_lora=stacked_lora,
            lora_slots=slots,
            lora_rank=max_lora_rank or 0,
        )
        self.vllm_server = None  # the vLLM server this process started for the trials (rollout.engine: vllm)
        self.vllm_rank = 0  # the largest LoRA rank it serves

    def vllm_engine(self, cfg: TrainerConfig, workdir: Path, max_loras: int, max_lora_rank: int | None):
        """A VLLMEngine of the trial's own on the server every vllm trial shares: the user's (rollout.vllm_url) or
        one started now, by the first, serving `max_loras` adapters in one batch."""
        from .engines.vllm import VLLMEngine, check_config, start_server
        from .engines.vllm_server import lora_rank_bucket

        check_config(cfg)
        if cfg.rollout.vllm_url:
            return VLLMEngine.on_server(cfg, self.tokenizer, workdir, cfg.rollout.vllm_url)
        if self.vllm_server is None:
            self.vllm_rank = lora_rank_bucket(max(max_lora_rank or 0, cfg.lora.r))
            self.vllm_server = start_server(cfg, workdir.parent / "vllm-server.log", max_loras, self.vllm_rank)
        elif cfg.lora.r > self.vllm_rank:
            raise InputError(
                f"lora.r is {cfg.lora.r} but the vLLM server the trials share serves ranks up to {self.vllm_rank}; "
                "give ConcurrentTrials the largest rank a trial takes (max_lora_rank)"
            )
        return VLLMEngine.on_server(cfg, self.tokenizer, workdir, self.vllm_server.url)

    def close(self) -> None:
        if self.vllm_server is not None:
            self.vllm_server.close()
            self.vllm_server = None

    def add(self, name: str, lora_cfg: LoraConfig, init_adapter: str | Path | None = None) -> tuple:
        """(model, tokenizer) with a new adapter `name` (from `lora_cfg`, or loaded from `init_adapter`), active."""
        if not ADAPTER_NAME.fullmatch(name):
            raise ValueError(f"adapter name {name!r}: use letters, digits, '-' and '_' only")
        if self.model is not None and name in self.model.peft_config:
            raise ValueError(f"adapter name {name!r} is taken; give each adapter its own name")
        if init_adapter is not None:
            if self.model is None:
                self.model = PeftModel.from_pretrained(
                    self.base, str(init_adapter), adapter_name=name, is_trainable=True
                )
            else:
                self.model.load_adapter(str(init_adapter), adapter_name=name, is_trainable=True)
        else:
            targets = (
                self.all_linear
                if lora_cfg.target_modules == "all-linear"
                else lora_target_modules(self.base, lora_cfg.target_modules)
            )
            config = peft_lora_config(lora_cfg, targets)
            if self.model is None:
                self.model = get_peft_model(self.base, config, adapter_name=name)
            else:
                self.model.add_adapter(name, config)
        if len(self.model.peft_config) == 1:  # the first adapter, or the first after all had left
            adapter_in_base_dtype(self.model, self.device)
            self.engine.sync_weights(self.model, 0)
        self.model.set_adapter(name)
        return self.model, self.tokenizer

    def remove(self, name: str) -> None:
        if self.model is not None and name in self.model.peft_config:
            with warnings.catch_warnings():  # "Adapter ... was active which is now deleted": the next is set anyway
                warnings.simplefilter("ignore", UserWarning)
                self.model.delete_adapter(name)


# ------------------------------------------------------------------------ trials and their outcomes


@dataclass
class TrialJob:
    name: str  # for the caller: the outcome names its job
    cfg: TrainerConfig
    output_dir: Path
    callbacks: Sequence[Callbacks] = ()
    init_adapter: str | Path | None = None
    lineage: dict | None = None


@dataclass
class TrialOutcome:
    job: TrialJob
    result: RunResult | None  # None when the trial failed before its first step
    error: BaseException | None = None  # what ended a failed trial (the others go on)


@dataclass
class _Trial:
    job: TrialJob
    adapter: str  # its adapter's name in the shared model: trial_<k>, k counting the trials started
    trainer: GRPOTrainer
    rng: tuple
    history: list[dict] = field(default_factory=list)
    eval_start: dict | None = None
    last_checkpoint: Path | None = None


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.random.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    python, numpy_state, torch_state, cuda = state
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.random.set_rng_state(torch_state)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


# ------------------------------------------------------------------------ the runner


class ConcurrentTrials:
    """Runs jobs `slots` at a time over one shared base model; a job is pulled from `jobs` when a slot is free.
    max_lora_rank: the largest lora.r a trial may ask for (a vLLM server is started for it; default: the first
    vllm trial's). stacked_lora (or the first trial's rollout.concurrent_adapters: stacked): the HF engine decodes the
    trials' rows with their adapters stacked and a per-row slot (engines/stacked.py), so they run inside the compiled
    decode step (rollout.compile_decode), with fused_sampling the draw too (engines/fused.py); default: row slices per
    trial, outside it. `close()` stops the vLLM server it
    started, if any."""

    def __init__(
        self, slots: int, max_lora_rank: int | None = None, stacked_lora: bool = False, fused_sampling: bool = False
    ):
        if slots < 1:
            raise InputError(f"sweep.concurrent_trials is {slots}; set it to 1 or more")
        self.slots, self.max_lora_rank = slots, max_lora_rank
        self.stacked_lora, self.fused_sampling = stacked_lora, fused_sampling
        self.shared: SharedPolicy | None = None
        self.first: TrainerConfig | None = None  # the first trial's settings: what the others must share
        self.started = 0

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()

    def __enter__(self) -> ConcurrentTrials:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(
        self,
        jobs: Iterable[TrialJob],
        on_end: Callable[[TrialOutcome, GRPOTrainer | None], None] | None = None,
    ) -> list[TrialOutcome]:
        """Train every job; `on_end(outcome, trainer)` is called as each ends, its adapter still active (trainer is
        None for a trial that failed to start). Returns the outcomes in the order the trials ended."""
        pending, running, outcomes = iter(jobs), [], []
        with SafePoint() as safe_point:
            self._fill(pending, running, outcomes, on_end)
            while running:
                t0 = time.perf_counter()
                batches = self._sample(running)
                for trial in list(running):
                    batch = batches[trial.adapter]
                    if isinstance(batch, Exception):  # its rollouts failed: it ends, the others step
                        ended = {"stopped": f"failed: {type(batch).__name__}", "error": batch}
                    else:
                        ended = self._train_step(trial, batch, t0, safe_point)
                    if ended is not None:
                        self._end(trial, running, outcomes, on_end, **ended)
                if not safe_point.received:  # after a signal no trial starts; each running one stops at its next
                    self._fill(pending, running, outcomes, on_end)  # step's end (record_step), checkpoint saved
        return outcomes

    def _train_step(self, trial: _Trial, batch, t0: float, safe_point: SafePoint) -> dict | None:
        """One step of one trial on its sampled batch; how it ended (`_end`'s arguments), or None while it goes on."""
        step, total = trial.trainer.step + 1, trial.job.cfg.optim.steps
        try:
            with self._active(trial):
                m = trial.trainer.train_on(step, batch, t0)
                trial.history.append(m)
                stopped, saved = trial.trainer.record_step(step, m, total, safe_point.stop_reason)
                trial.last_checkpoint = saved or trial.last_checkpoint
        except Exception as e:  # noqa: BLE001 — this trial failed; the others go on
            return {"stopped": f"failed: {type(e).__name__}", "error": e}
        if stopped or step >= total:
            return {"stopped": stopped, "interrupted": safe_point.received}
        return None

    def _fill(self, pending, running: list, outcomes: list, on_end) -> None:
        """Start trials from `pending` while a slot is free; a trial that fails to start ends at once."""
        while len(running) < self.slots:
            job = next(pending, None)
            if job is None:
                return
            try:
                running.append(self._start(job))
            except InputError:
                raise  # the spec is wrong for every trial: the user fixes it
            except Exception as e:  # noqa: BLE001 — this trial failed to start; the others go on
                if self.shared is not None:
                    self.shared.remove(f"trial_{self.started - 1}")
                outcome = TrialOutcome(job, None, e)
                outcomes.append(outcome)
                if on_end is not None:
                    on_end(outcome, None)

    def _end(self, trial: _Trial, running: list, outcomes: list, on_end, stopped=None, interrupted=None, error=None):
        """A trial's end: its outcome to `on_end` (its adapter active), then its engine and adapter released."""
        t = trial.trainer
        result = RunResult(
            t.step,
            stopped,
            trial.last_checkpoint or _latest_path(t.ckpt_root),
            trial.history,
            trial.eval_start,
            interrupted=interrupted,
        )
        outcome = TrialOutcome(trial.job, result, error)
        try:
            if on_end is not None:
                with self._active(trial):
                    on_end(outcome, t)
        finally:
            self._release(trial)
            running.remove(trial)
            outcomes.append(outcome)

    def _release(self, trial: _Trial) -> None:
        """A trial's rollouts stopped, its engine closed (its adapter leaves the shared vLLM server) and its adapter
        removed from the base model; the other trials' stay."""
        trial.trainer.rollouts.close()
        if trial.trainer.engine is not self.shared.engine:
            trial.trainer.engine.close()
        self.shared.remove(trial.adapter)

    # ------------------------------------------------------------------ pieces

    def _start(self, job: TrialJob) -> _Trial:
        check_concurrent(job.cfg, self.first, job.name)
        self.first = self.first or job.cfg
        if self.shared is None:
            self.shared = SharedPolicy(
                job.cfg.model,
                compile_decode=job.cfg.rollout.compile_decode,
                stacked_lora=self.stacked_lora or job.cfg.rollout.concurrent_adapters == "stacked",
                fused_sampling=self.fused_sampling or job.cfg.rollout.fused_sampling != "never",
                slots=self.slots,
                max_lora_rank=self.max_lora_rank,
            )
        adapter, self.started = f"trial_{self.started}", self.started + 1
        engine = self.shared.engine
        try:
            if job.cfg.rollout.engine == "vllm":
                engine = self.shared.vllm_engine(job.cfg, Path(job.output_dir) / "vllm", self.slots, self.max_lora_rank)
            trainer = GRPOTrainer(
                job.cfg,
                job.output_dir,
                callbacks=job.callbacks,
                init_adapter=job.init_adapter,
                lineage=job.lineage,
                progress=False,
                engine=engine,
                shared=self.shared,
                adapter=adapter,
            )
            trial = _Trial(job, adapter, trainer, rng=_rng_state())
            with self._active(trial):
                trial.eval_start = trainer.evaluate_on_start()
        except BaseException:
            self.shared.remove(adapter)  # the others' adapters stay
            if engine is not self.shared.engine:
                engine.close()
            raise
        return trial

    @contextmanager
    def _active(self, trial: _Trial):
        """The model and the global RNG as `trial` alone would have them, for the duration of the block."""
        self.shared.model.set_adapter(trial.adapter)
        _set_rng_state(trial.rng)
        try:
            yield
        finally:
            trial.rng = _rng_state()

    def _sample(self, running: list[_Trial]) -> dict[str, RolloutBatch | Exception]:
        """Every running trial's batch for its next step, in one engine call per rollout.max_tokens (the KV cache's
        length is the call's: a lone run's, so); each trial's rows drawn with its own settings and seeds. A trial
        whose part fails (its schedule, prompts, adapter push or rows) gets its exception instead of a batch, and
        the others their batches: a shared call that fails is sampled again a trial at a time, which draws the same
        tokens (each prompt's rows come from its own generator), to find whose rows fail. Bad input (InputError)
        is every trial's and is raised."""
        calls: dict[int, list[tuple]] = {}
        served: list[tuple] = []
        batches: dict[str, RolloutBatch | Exception] = {}
        for trial in running:
            step = trial.trainer.step + 1
            request = _own(self._request, trial, step)
            if isinstance(request, Exception):
                batches[trial.adapter] = request
                continue
            member = (trial, step, *request)
            if trial.trainer.engine is self.shared.engine:
                calls.setdefault(request[2].max_tokens, []).append(member)
            else:
                served.append(member)
        if served:
            batches.update(self._sample_served(served))
        for members in calls.values():
            together = _own(self._sample_shared, members)
            if not isinstance(together, Exception):
                batches.update(together)
            elif len(members) == 1:
                batches[members[0][0].adapter] = together
            else:  # whose rows failed: each trial's alone
                for member in members:
                    alone = _own(self._sample_shared, [member])
                    batches.update(alone if isinstance(alone, dict) else {member[0].adapter: alone})
        return batches

    @staticmethod
    def _request(trial: _Trial, step: int) -> tuple:
        trial.trainer.begin_step(step)  # its schedule's values for the step (grpo.schedule, a population's)
        return trial.trainer.rollouts.request(step)

    def _sample_shared(self, members: list[tuple]) -> dict[str, RolloutBatch]:
        """The batches of trials on the shared HF engine with one rollout.max_tokens, in one engine call."""
        started = time.perf_counter()
        requests = [(prompts, params, [trial.adapter] * len(prompts)) for trial, _, _, prompts, params in members]
        if len(members) == 1:  # one adapter: the plain forward, not peft's per-row one (a gather per layer)
            self.shared.model.set_adapter(members[0][0].adapter)
            requests = [(prompts, params, None) for prompts, params, _ in requests]
        completions = self.shared.engine.generate_many(requests)
        return _batches(members, completions, time.perf_counter() - started)

    def _sample_served(self, members: list[tuple]) -> dict[str, RolloutBatch | Exception]:
        """The vllm trials' batches: each pushes its adapter (and proves it served), then all requests go to the shared
        server at once, so its scheduler batches the trials' rows together (up to --max-loras adapters a batch). A
        trial whose push or requests fail gets its exception."""
        batches: dict[str, RolloutBatch | Exception] = {}
        pushed = []
        for member in members:
            trial, step = member[0], member[1]
            with self._active(trial):  # version step - 1, as a lone run pushes
                pushing = _own(trial.trainer.engine.sync_weights, self.shared.model, step)
            if isinstance(pushing, Exception):  # its adapter is not served; the others go on
                batches[trial.adapter] = pushing
            else:
                pushed.append(member)
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, len(pushed)), thread_name_prefix="ballast-trial-rollouts") as pool:
            futures = [
                pool.submit(trial.trainer.engine.generate, prompts, params) for trial, _, _, prompts, params in pushed
            ]
            groups = [(member, _own(future.result)) for member, future in zip(pushed, futures)]
        generate_s = time.perf_counter() - started
        batches.update({m[0].adapter: g for m, g in groups if isinstance(g, Exception)})
        done = [(m, g) for m, g in groups if not isinstance(g, Exception)]
        batches.update(_batches([m for m, _ in done], [g for _, g in done], generate_s))
        return batches


def _own(fn: Callable, *args):
    """fn(*args), or the exception it raised: one trial's failure, which ends that trial alone. Bad input
    (InputError) is every trial's: raised."""
    try:
        return fn(*args)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 — this trial failed; the others go on
        return e


def _batches(members: list[tuple], groups: list, generate_s: float) -> dict[str, RolloutBatch]:
    """Each trial's RolloutBatch from its groups of completions, sampled by the version before its step."""
    batches = {}
    for (trial, step, indices, _, _), trial_groups in zip(members, groups):
        flat = [c for group in trial_groups for c in group]
        batches[trial.adapter] = RolloutBatch(step, indices, flat, [step - 1] * len(flat), generate_s)
    return batches
