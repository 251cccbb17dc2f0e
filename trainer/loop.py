"""The GRPO step and the run: prompts → rollouts → rewards → advantages → update → metrics → checkpoint.

Reads top to bottom in the order the data flows. The choices, on purpose:

- A *step* is one batch of rollouts (prompts_per_step × num_generations completions) and the
  `num_iterations` optimizer updates made on it; `optim.steps` counts steps, `metrics.jsonl` has
  one line per step (and, with `eval.on_start`, a line for step 0 holding only the eval/* metrics of
  the model before training, as TRL's eval_on_start logs them).
- Rollouts of step k are seeded from (rollout.seed, k), so a resumed run samples exactly what an
  uninterrupted run would; the prompt sampler's position is part of the checkpoint. With
  rollout.max_off_policy_steps: k they are sampled up to k steps ahead, by older weights on a fixed schedule,
  while the trainer updates (trainer/rollouts.py); batches in flight at a checkpoint are saved with it.
- pi_old is the trainer's: its logprobs of the sampled tokens from the first update's own forward,
  detached (no extra forward), kept for later passes (num_iterations). The engine's logprobs are
  compared with them every step (`sampling/sampling_logp_difference/*`: a stale or double-applied
  adapter shows at once) and become the rollout-correction weight pi_old / pi_engine
  (`grpo.rollout_correction`, TIS by default). A step whose correction needs engine logprobs and gets
  none fails, naming the engine, instead of silently training as if it had sampled the trainer's policy.
- The loss normalisers are the whole batch's, fixed before the micro-batch loop, so a step's loss and
  gradient do not depend on optim.gradient_accumulation_steps.
- The reference for the KL term is the base model (LoRA adapter disabled; a frozen copy for full
  fine-tuning) or, with `kl_ref_step_lag: k`, the policy k steps back (snapshots of the trainable
  weights, saved in the checkpoint so a resume is exact).
- The trainer knows nothing of Prefect, MLflow or Optuna: it reports through `Callbacks`.
- One global batch, whatever the world size: under torchrun (`ballast train --nproc N`, trainer/distributed.py)
  each rank samples and scores whole groups of the step's prompts, advantages and loss normalisers are the global
  batch's, gradients are summed over ranks (DDP or FSDP2) and metrics reduced over the global batch; only rank 0
  writes metrics, samples and checkpoints (the plain checkpoint one process writes, the weights gathered whole).
  The step asks `self.world` (trainer/distributed.py's `World`, the identity for one process) for each of these, so
  it reads the same for one process and for N ranks, with no branch on the world size.
- A step is `train_on` (given its rollouts) then `record_step` (log, ask the gate and callbacks, checkpoint):
  concurrent trials over one base model (trainer/multi.py) call the same two with rollouts sampled together.
- SIGTERM (preemption) and SIGINT (Ctrl-C) during the loop stop it at a safe point (`SafePoint`): the step in
  progress finishes, a checkpoint is saved there, and `RunResult.interrupted` names the signal.
"""

from __future__ import annotations

import copy
import math
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import torch
from torch import Tensor
from transformers import set_seed

from . import checkpoint as ckpt
from . import distributed as dd
from .advantages import AdvantageResult, compute_advantages
from .callbacks import Callbacks
from .config import InputError, TrainerConfig
from .data import PromptSampler, data_fingerprint, load_datasets, render_prompt, reward_columns
from .episodes import add_environment_reward, conversation_text, episode_metrics
from .evaluate import evaluate_with_samples
from .health import HealthGate, batch_health, hacking_signals
from .logprobs import check_packing, completion_logprobs
from .loss import BatchTotals, LossTerms, grpo_loss, rollout_correction
from .metrics import (
    completion_metrics,
    entropy_metric,
    mean_over_updates,
    perf_metrics,
    reward_metrics,
    sampling_metrics,
    update_metrics,
)
from .model import (
    adapter_parameters,
    ensure_model,
    load_policy,
    logprob_fingerprint,
    model_identity,
    resolve_device,
)
from .perf import MemoryPlan, matmul_params, memory_plan, peak_flops, step_flops
from .records import append_rows, keep_rows
from .resume import RECORDS, config_hash, refuse_changed_config, resumable_view
from .rewards import RewardComputer
from .rollouts import RolloutBatch, RolloutProducer
from .samples import EVAL_SAMPLES_FILE, SAMPLES_FILE, sample_rows


class TrainingError(RuntimeError):
    """A step that cannot go on without silently training the wrong thing."""


@dataclass
class RunResult:
    last_step: int
    stopped: str | None
    last_checkpoint: Path | None
    history: list[dict] = field(default_factory=list)
    eval_start: dict | None = None  # eval/* before the first step (eval.on_start), logged as step 0
    interrupted: str | None = None  # the signal that stopped the run at a safe point (SafePoint)


class GRPOTrainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        output_dir: str | Path,
        callbacks: Sequence[Callbacks] = (),
        init_adapter: str | Path | None = None,
        lineage: dict | None = None,
        progress: bool = True,
        engine=None,
        shared=None,
        adapter: str = "default",
    ):
        """shared: a base model other trials train on too (trainer/multi.py's SharedPolicy); this trial's LoRA adapter
        is added to it under the name `adapter`, and the caller makes it the active one before each use."""
        # its own copy: a schedule (grpo.schedule, or a population's) sets beta, the learning rate and the repetition
        # penalty step by step on it; the checkpoint records the spec as given (`_spec_view`), so a resume compares it
        self.cfg, self.out = cfg.model_copy(deep=True), Path(output_dir)
        self._spec_view, self._config_hash = resumable_view(cfg), config_hash(cfg)
        self.schedule: list[dict] = [seg.model_dump(exclude_none=True) for seg in cfg.grpo.schedule]
        self.callbacks, self.lineage, self.progress = list(callbacks), dict(lineage or {}), progress
        self.ckpt_root = self.out / "checkpoints"
        self.out.mkdir(parents=True, exist_ok=True)
        set_seed(cfg.optim.seed)  # Python's random, numpy, torch (and CUDA)
        self.world = dd.init(resolve_device(cfg.model.device))  # torchrun's ranks (trainer/distributed.py); or one
        self.device = resolve_device(cfg.model.device)
        self.adapter = adapter
        self._load_policy(init_adapter, shared)
        self.optimizer, self.scheduler = self._optimizer()

        # ---------------------------------------------------------------- data, rewards, health, engine
        self.train_set, self.eval_set = load_datasets(cfg.data)
        self.sampler = PromptSampler(len(self.train_set), cfg.data.seed)
        self._prompt_cache: dict[int, list[int]] = {}
        self.memory = self._choose_memory()  # grpo.pack_sequences / model.gradient_checkpointing when "auto"
        self.flops = self._flops_per_step()  # for perf/mfu_* (trainer/perf.py); None where no peak is known
        self.rewards = RewardComputer(cfg.rewards, group_size=cfg.grpo.num_generations, output_dir=self.out)
        self.gate = HealthGate(
            cfg.health,
            correctness=self.rewards.accuracy_name(cfg.eval.reward),
            weights=dict(zip(self.rewards.names, self.rewards.weights)),
        )
        episodes = None
        if cfg.data.environment is not None:  # multi-turn episodes with tools (trainer/episodes.py)
            from .episodes import EpisodeRunner

            episodes = (EpisodeRunner.from_config(cfg.data, self.tokenizer, cfg.rollout.max_tokens), self.train_set)
        self.rollouts = RolloutProducer(cfg, engine or self._make_engine(), self.sampler, self._prompt, episodes)
        self.step = 0
        self.num_tokens = 0  # prompt + completion tokens of all steps so far (TRL's num_tokens)
        self.last_prompt_indices: list[int] = []

    def _load_policy(self, init_adapter: str | Path | None, shared) -> None:
        """The policy (its own, or an adapter on a shared base), its trainable parameters, the KL reference and the
        policy wrapped for the world's ranks."""
        cfg, g = self.cfg, self.cfg.grpo
        ensure_model(cfg.model)
        if shared is None:
            self.model, self.tokenizer = load_policy(
                cfg.model, cfg.lora, adapter_path=str(init_adapter) if init_adapter else None
            )
            self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        else:  # right after set_seed, as load_policy would create it: the same initial adapter as a lone run's
            self.model, self.tokenizer = shared.add(self.adapter, cfg.lora, init_adapter)
            self.named_params = adapter_parameters(self.model, self.adapter)
        self.model.train()
        if g.pack_sequences is True:  # "auto" is settled, and checked, once the data is loaded (_choose_memory)
            _check_packing(self.model, self.device)
        self.ref_model = None
        if g.beta > 0 and not cfg.lora.enabled and g.kl_ref_step_lag is None:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.lagged: deque = deque(maxlen=(g.kl_ref_step_lag or 0) + 1)
        self.wrapped = self.world.wrap(self.model, cfg.model.parallel)  # the logprob forward, replicated or sharded
        if self.world.distributed:  # FSDP2 replaced the parameters with sharded ones
            self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]

    def _choose_memory(self) -> MemoryPlan:
        """Settle grpo.pack_sequences and model.gradient_checkpointing when "auto" (trainer/perf.py memory_plan: on a
        GPU, from the micro-batch and the memory free now; off one, off) in this trainer's copy of the spec; packing
        chosen so falls back to the padded forward for a model that fails the packing check."""
        cfg, g = self.cfg, self.cfg.grpo
        rows = cfg.grpo.prompts_per_step * g.num_generations
        micro = -(-rows // (self.world.size * cfg.optim.gradient_accumulation_steps))
        prompt = max((len(self._prompt(i)) for i in range(min(len(self.train_set), 64))), default=0)
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        config = self._base_model().config
        plan = memory_plan(
            self.device.type,
            free,
            micro,
            prompt + cfg.rollout.max_tokens,
            config.hidden_size,
            config.num_hidden_layers,
            self.model.get_input_embeddings().weight.element_size(),
            pack=g.pack_sequences,
            checkpointing=cfg.model.gradient_checkpointing,
        )
        if g.pack_sequences == "auto" and plan.pack:
            try:
                _check_packing(self.model, self.device)
            except InputError:
                plan = MemoryPlan(False, plan.checkpointing, plan.reason + "; packing failed its check: padded")
        if cfg.model.gradient_checkpointing == "auto" and plan.checkpointing:
            self._base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        g.pack_sequences, cfg.model.gradient_checkpointing = plan.pack, plan.checkpointing
        return plan

    def _base_model(self):
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def _flops_per_step(self) -> tuple[int, int, float] | None:
        """(N, the trainable parameters, the devices' peak FLOP/s) for perf/mfu_*, or None without a known peak."""
        cfg = self.cfg
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        dtype = str(self.model.get_input_embeddings().weight.dtype).removeprefix("torch.")
        peak = peak_flops(name, dtype, self.world.size, cfg.model.peak_tflops)
        n = matmul_params(self._base_model().config)
        if peak is None or n is None:
            return None
        return n, sum(p.numel() for p in self.params), peak  # a sharded parameter's numel is the whole one's

    def _optimizer(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        """AdamW over the trainable parameters, and the learning-rate schedule over all the run's updates."""
        o = self.cfg.optim
        optimizer = torch.optim.AdamW(
            self.params, lr=o.learning_rate, betas=(o.adam_beta1, o.adam_beta2), weight_decay=o.weight_decay
        )
        total_updates = o.steps * self.cfg.grpo.num_iterations
        return optimizer, torch.optim.lr_scheduler.LambdaLR(
            optimizer, _lr_lambda(o.schedule, o.warmup_steps, total_updates)
        )

    @property
    def engine(self):
        """The rollout engine (the producer's); assign another before the first step to sample with it."""
        return self.rollouts.engine

    @engine.setter
    def engine(self, engine) -> None:
        self.rollouts.engine = engine

    def _make_engine(self):
        if self.cfg.rollout.engine == "hf":
            from .engines.hf import HFEngine

            rollout = self.cfg.rollout
            return HFEngine(
                self.model,
                self.tokenizer,
                self.device,
                compile_decode=rollout.compile_decode,
                fused_sampling=rollout.fused_sampling != "never",  # with a compiled decode: auto and always
                merged_decode=rollout.merged_decode,
            )
        if self.cfg.rollout.engine == "offline":
            from .engines.offline import OfflineEngine

            return OfflineEngine(
                self.cfg.data.source,
                self.tokenizer,
                lambda tokenizer, prompt: render_prompt(tokenizer, prompt, self.cfg.data),
            )
        from .engines.vllm import VLLMEngine

        return VLLMEngine.from_config(self.cfg, self.tokenizer, self.out / "vllm")

    # -------------------------------------------------------------------- resume
    def resume(self) -> Path | None:
        """Load the newest valid checkpoint under output_dir, if any; returns its path."""
        checkpoint = ckpt.latest_checkpoint(self.ckpt_root)
        if checkpoint is None:  # nothing saved: the run starts again at step 0, and its records with it
            self._truncate_records(-1)
            return None
        state = checkpoint.training_state()
        refuse_changed_config(state.trainer.get("config", {}), self._spec_view, checkpoint.path)
        self._load_weights_and_optimizer(checkpoint, state.optimizer)
        self.scheduler.load_state_dict(state.scheduler)
        self.sampler.load_state_dict(state.trainer["sampler"])
        self.rollouts.load_state_dict(state.trainer.get("rollouts"))
        self.gate.load_state_dict(state.trainer["health_gate"])
        self.lagged.clear()
        self.lagged.extend(state.lagged)
        ckpt.restore_rng(state.rng)
        self.step = state.trainer["step"]
        self.schedule = state.trainer.get("schedule", self.schedule)
        self.num_tokens = state.trainer.get("num_tokens", 0)
        self._truncate_records(self.step)
        return checkpoint.path

    def _truncate_records(self, last_step: int) -> None:
        """The run's records (metrics, prompts, samples) cut back to the steps up to `last_step`."""
        if self.world.main:  # only rank 0 writes the run's records
            for name in RECORDS:
                keep_rows(self.out / name, lambda row: row["step"] <= last_step)

    def _load_weights_and_optimizer(self, checkpoint: ckpt.Checkpoint, optim_state: dict) -> None:
        """A checkpoint saved by any world size (its optimizer state by position, or by name from a sharded run) into
        this one: a sharded policy takes the whole weights and state and keeps its shards."""
        from . import dist_checkpoint

        names = dist_checkpoint.trainable_names(self.wrapped)
        if not (self.world.distributed and self.cfg.model.parallel == "fsdp2"):
            checkpoint.load_weights_into(self.model, self.adapter)
            self.optimizer.load_state_dict(dist_checkpoint.optimizer_by_position(optim_state, names))
            return
        from safetensors.torch import load_file

        saved: dict = {}
        for f in (
            [checkpoint.adapter_dir / "adapter_model.safetensors"]
            if checkpoint.adapter_dir
            else sorted(checkpoint.model_dir.glob("*.safetensors"))
        ):
            saved.update(load_file(str(f)))
        plain = [n.removeprefix("policy.") for n in names]  # peft saves the adapter's weights without its name
        weights = {n: saved[k] for n in plain if (k := n.replace(f".{self.adapter}.", ".")) in saved}
        dist_checkpoint.load_whole(self.wrapped, self.optimizer, weights, optim_state)

    # -------------------------------------------------------------------- one step
    def hyperparameters_at(self, step: int) -> dict[str, float]:
        """beta, learning_rate (the peak) and repetition_penalty in force at `step`: the spec's, then each schedule
        segment's values from its step on."""
        hp = {
            "beta": self._spec_view["grpo"]["beta"],
            "learning_rate": self._spec_view["optim"]["learning_rate"],
            "repetition_penalty": self._spec_view["rollout"]["repetition_penalty"],
        }
        for segment in self.schedule:
            if segment["step"] <= step:
                hp.update({k: v for k, v in segment.items() if k != "step" and v is not None})
        return hp

    def begin_step(self, step: int) -> None:
        """Set the schedule's values for `step` before its rollouts are drawn (nothing to do without a schedule). The
        learning rate is the scheduler's base: optim.schedule's warm-up and decay multiply it as before."""
        if not self.schedule:
            return
        hp = self.hyperparameters_at(step)
        self.cfg.grpo.beta, self.cfg.rollout.repetition_penalty = hp["beta"], hp["repetition_penalty"]
        self.scheduler.base_lrs = [hp["learning_rate"]] * len(self.optimizer.param_groups)
        for group, shape in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group["initial_lr"] = hp["learning_rate"]
            group["lr"] = hp["learning_rate"] * shape(self.scheduler.last_epoch)

    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.begin_step(step)
        # 1-2. prompts and rollouts: this step's batch, sampled now or (max_off_policy_steps) up to k steps ago
        with self.world.full_weights(self.wrapped):  # each rank samples its own prompts, without collectives
            sampled = self.rollouts.take(step, self.model)
        return self.train_on(step, sampled, t0)

    def train_on(self, step: int, sampled: RolloutBatch, t0: float) -> dict[str, float]:
        """Steps 3-8 on `step`'s rollouts (sampled by this trainer's producer, or with other trials' in one engine
        call: trainer/multi.py); `t0` is when the step began. Each rank holds whole groups of the global batch;
        `self.world` says how the ranks share the step (for one process, every sharing is the identity)."""
        g, world, completions = self.cfg.grpo, self.world, sampled.completions
        if g.kl_ref_step_lag:
            self.lagged.append({n: p.detach().to("cpu", copy=True) for n, p in self.named_params})
        laps = _Laps(t0, "time/rollout")
        ckpt.fault_point("kill-in-step", step)
        ckpt.fault_point("hold-in-step", step)
        self.last_prompt_indices = world.gather(sampled.prompt_indices)  # the global batch's, in rank order

        # 3. rewards
        scored = self._score(step, [self.train_set[i] for i in sampled.prompt_indices], completions)
        laps("time/reward")

        # 4. advantages over the global batch (scale_rewards: batch is the global batch's), then this rank's rows
        adv_all = compute_advantages(
            torch.tensor(world.gather(scored.total), dtype=torch.float32),
            g.num_generations,
            g.scale_rewards,
            truncated=torch.tensor(world.gather([c.finish_reason == "length" for c in completions])),
            mask_truncated=g.mask_truncated_completions,
            drop_zero_std_groups=g.drop_zero_std_groups,
        )

        # 5. batch tensors, and the global batch's loss normalisers, fixed before the micro-batch loop
        batch = self._batch(step, completions, world.local_rows(adv_all, len(completions)))
        self.num_tokens += int(world.sum(sum(len(c.prompt_ids) + len(c.token_ids) for c in completions)))

        # 6. reference logprobs
        ref_logprobs = self._reference_logprobs(batch) if g.beta > 0 else None
        laps("time/logprobs")

        # 7. updates. pi_old is the trainer's: the first pass's own forward, detached, kept for later passes
        per_update = [self._update(step, batch, ref_logprobs, first=it == 0) for it in range(g.num_iterations)]
        laps("time/update")

        # 8. metrics of the global batch (trainer/metrics.py says what each means), and the step's samples
        self._append_rows(self.out / SAMPLES_FILE, scored.sample_rows)
        m = self._step_metrics(step, sampled, scored, adv_all, batch, per_update, laps)
        if self.cfg.eval.every and step % self.cfg.eval.every == 0:
            m.update(self.evaluate(step))
        m.update(self.gate.observe(step, m))  # trends over steps and eval points
        return m

    def _score(self, step: int, examples: list, completions: list) -> _Scored:
        """The rewards of this rank's completions (and their sample rows, written by rank 0)."""
        G = self.cfg.grpo.num_generations
        texts = [c.text for c in completions]
        answers = [e.answer for e in examples for _ in range(G)]
        prompts = [e.prompt for e in examples for _ in range(G)]
        total, parts = self.rewards(texts, answers, prompts, **reward_columns(examples, G))
        total, parts = add_environment_reward(total, parts, completions)  # an environment's own, when it has one
        rows = sample_rows(  # written with the step's metrics (step 8)
            step,
            prompts,
            answers,
            texts,
            [c.finish_reason for c in completions],
            [len(c.token_ids) for c in completions],
            total,
            parts,
            self.cfg.rollout.log_samples,
            [conversation_text(c) for c in completions],
        )
        return _Scored(total, parts, rows)

    def _batch(self, step: int, completions: list, adv: AdvantageResult) -> _StepBatch:
        """This rank's rows as tensors on the trainer's device: left-padded prompts, right-padded completions."""
        padded = _padded_batch(completions, self.tokenizer.pad_token_id)
        token_mask = padded["completion_mask"].to(self.device)  # every sampled completion token (not inserted ones)
        loss_mask = token_mask * adv.loss_mask_seq.float().to(self.device).unsqueeze(1)  # those in the loss
        engine_logprobs = padded["engine_logprobs"].to(self.device)
        self._check_engine_logprobs(step, engine_logprobs, token_mask)
        return _StepBatch(
            ids=padded["input_ids"].to(self.device),
            attn=padded["attention_mask"].to(self.device),
            completion_len=padded["completion_len"],
            token_mask=token_mask,
            loss_mask=loss_mask,
            engine_logprobs=engine_logprobs,
            advantages=adv.advantages.to(self.device),
            totals=self.world.reduce_totals(BatchTotals.of(loss_mask)),
            micro=_micro_slices(len(completions), self.cfg.optim.gradient_accumulation_steps),
            old_logprobs=torch.zeros_like(engine_logprobs),
            entropy=torch.zeros_like(engine_logprobs),
            weight=torch.ones_like(engine_logprobs),
        )

    def _check_engine_logprobs(self, step: int, engine_logprobs: Tensor, token_mask: Tensor) -> None:
        """A rollout correction needs the engine's logprob of every sampled token."""
        missing = int((~torch.isfinite(engine_logprobs) & token_mask.bool()).sum())
        mode = self.cfg.grpo.rollout_correction.mode
        if missing and mode != "off":
            raise TrainingError(
                f"step {step}: the '{self.engine.name}' rollout engine returned no logprobs for {missing} of "
                f"{int(token_mask.sum())} completion tokens, and grpo.rollout_correction.mode: {mode} "
                "weights each token by pi_old / pi_engine: without them the step would silently train as if the engine "
                "had sampled the trainer's policy; fix the engine (or the trajectory file), or set "
                "grpo.rollout_correction.mode: off to train without the correction"
            )

    def _reference_logprobs(self, b: _StepBatch) -> Tensor:
        with torch.no_grad(), self._reference():
            model = self.ref_model if self.ref_model is not None else self.model
            return torch.cat([self._logprobs(model, b.ids[s], b.attn[s], b.completion_len)[0] for s in b.micro])

    def _update(self, step: int, b: _StepBatch, ref_logprobs: Tensor | None, first: bool) -> dict[str, float]:
        """One optimizer update on the whole batch, micro-batch by micro-batch (each backward its exact share of the
        global batch's loss). The first also fills in pi_old, the entropy and the rollout-correction weights from its
        own forward (detached: the optimizer steps only after every micro-batch). Returns the update's metrics."""
        g, world = self.cfg.grpo, self.world
        loss_sum, terms = 0.0, []
        for k, s in enumerate(b.micro):
            with world.accumulating(self.wrapped, last=k == len(b.micro) - 1):  # ranks' gradients summed once
                lp, ent = self._logprobs(self.model, b.ids[s], b.attn[s], b.completion_len, with_entropy=first)
                if first:
                    b.old_logprobs[s], b.entropy[s] = lp.detach().float(), ent.detach().float()
                    corr = rollout_correction(
                        b.old_logprobs[s], b.engine_logprobs[s], b.loss_mask[s], g.rollout_correction
                    )
                    b.weight[s] = corr.weight
                loss, part = grpo_loss(
                    lp,
                    b.old_logprobs[s],
                    b.advantages[s],
                    b.loss_mask[s],
                    g,
                    correction=b.weight[s],
                    totals=b.totals,
                    ref_logprobs=None if ref_logprobs is None else ref_logprobs[s],
                    max_completion_length=self.cfg.rollout.max_tokens,
                )
                loss.backward()
            loss_sum += float(loss.detach())
            terms.append(part)
        grad_norm = world.clip_grad_norm(self.params, self.cfg.optim.max_grad_norm)  # of the global gradient
        if not torch.isfinite(grad_norm):
            raise TrainingError(
                f"step {step}: gradient norm is {float(grad_norm)}; lower optim.learning_rate or check rewards "
                "for extreme values"
            )
        m = {"loss": world.sum(loss_sum), "grad_norm": float(grad_norm)}
        m.update(update_metrics(LossTerms.cat(terms), b.loss_mask, g.importance_sampling_level, world))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return m

    def _step_metrics(
        self,
        step: int,
        sampled: RolloutBatch,
        scored: _Scored,
        adv_all: AdvantageResult,
        b: _StepBatch,
        per_update: list[dict[str, float]],
        laps: _Laps,
    ) -> dict[str, float]:
        """The step's metrics, of the global batch: the lists gathered from every rank, the tensors' parts reduced."""
        world, G, correction = self.world, self.cfg.grpo.num_generations, self.cfg.grpo.rollout_correction
        every = world.gather(sampled.completions)  # for the metrics that read whole groups
        total, parts = world.gather(scored.total), {name: world.gather(v) for name, v in scored.parts.items()}
        lengths = [len(c.token_ids) for c in every]
        m: dict[str, float] = {"step": step, "num_tokens": float(self.num_tokens)}
        m.update(reward_metrics(total, parts, adv_all.frac_reward_zero_std, adv_all.frac_zero_std_groups))
        m.update(self.rewards.step_metrics)  # judge/* and other reward objects' metrics
        m.update(completion_metrics(lengths, [c.finish_reason for c in every]))
        m.update(mean_over_updates(per_update))
        m.update(entropy_metric(b.entropy, b.loss_mask, world))
        corr = rollout_correction(b.old_logprobs, b.engine_logprobs, b.loss_mask, correction)  # as applied
        staleness = sampled.versions_behind(step - 1)  # per completion: versions between its sampler and pi_old
        m.update(
            sampling_metrics(
                b.old_logprobs, b.engine_logprobs, b.token_mask, b.loss_mask, corr, correction, staleness, world
            )
        )
        m.update(batch_health([c.text for c in every], [c.token_ids for c in every]))
        m.update(hacking_signals([c.token_ids for c in every], total, G))
        m.update(episode_metrics(every))  # turns, tool calls and errors, budgets, drift (multi-turn episodes)
        m["advantages/frac_masked"] = 1.0 - float(adv_all.loss_mask_seq.float().mean())
        m["learning_rate"] = self.scheduler.get_last_lr()[0]
        m["time/generate"] = sampled.generate_s
        m.update(laps.seconds)
        m["step_time"] = time.perf_counter() - laps.t0
        m["tokens_per_second"] = sum(lengths) / m["step_time"]
        if self.flops is not None:  # perf/mfu_* where the device's peak is known (trainer/perf.py)
            n, trainable, peak = self.flops
            tokens = sum(len(c.prompt_ids) + len(c.token_ids) for c in every)
            g = self.cfg.grpo
            f = step_flops(n, trainable, not self.cfg.lora.enabled, tokens, g.num_iterations, reference=g.beta > 0)
            m.update(perf_metrics(f.update, f.total, m["time/update"], m["step_time"], peak))
        return m

    def evaluate(self, step: int = 0) -> dict[str, float]:
        """The held-out metrics; eval.log_samples of the completions go to eval_samples.jsonl, marked with `step`."""
        with self.world.full_weights(self.wrapped):  # every rank evaluates the same held-out set the same way
            metrics, rows = evaluate_with_samples(
                self.model, self.tokenizer, self.eval_set, self.cfg.eval, self.rewards, self.cfg.data, step
            )
        if self.world.main:
            append_rows(self.out / EVAL_SAMPLES_FILE, rows)
        return metrics

    # -------------------------------------------------------------------- the run
    def train(self, total_steps: int | None = None) -> RunResult:
        total = total_steps or self.cfg.optim.steps
        history, stopped, last_ckpt = [], None, None
        eval_start = self.evaluate_on_start()
        bar = _progress(self.progress)
        with bar, SafePoint() as safe_point:
            task = bar.add_task("GRPO", total=total, completed=self.step, info="")
            for step in range(self.step + 1, total + 1):
                m = self.train_step(step)
                history.append(m)
                stopped, saved = self.record_step(step, m, total, safe_point.stop_reason)
                last_ckpt = saved or last_ckpt
                bar.update(
                    task,
                    completed=step,
                    info=_bar_info(m),
                )
                if stopped:
                    break
        return RunResult(
            self.step,
            stopped,
            last_ckpt or _latest_path(self.ckpt_root),
            history,
            eval_start,
            interrupted=safe_point.received,
        )

    def evaluate_on_start(self) -> dict | None:
        """eval.on_start: the eval/* metrics before the first step, logged as step 0 (None when not asked for)."""
        if not (self.step == 0 and self.cfg.eval.on_start and self.eval_set):
            return None
        eval_start = {"step": 0, **self.evaluate()}
        if self.world.main:  # only rank 0 records
            append_rows(self.out / "metrics.jsonl", [eval_start])
            for cb in self.callbacks:
                cb.on_step(0, eval_start)
        return eval_start

    def record_step(
        self, step: int, m: dict, total: int, interrupted: str | None = None
    ) -> tuple[str | None, Path | None]:
        """After step `step` of `total`: log its metrics, ask the health gate and the callbacks whether to stop, and
        checkpoint when it is time (or the run stops). Returns (why it stops or None, the checkpoint saved or None)."""
        stopped = self.log_step(step, m, interrupted)
        saved = None
        if step % self.cfg.checkpoint.every == 0 or step == total or stopped:
            saved = self.save()
        return stopped, saved

    def log_step(self, step: int, m: dict, interrupted: str | None = None) -> str | None:
        """Step `step` done: its metrics logged, the health gate and the callbacks asked; why the run stops, or None."""
        self.step = step
        stopped = self.gate.update(step, m)  # the same global metrics on every rank: the same answer
        if self.world.main:  # only rank 0 records and asks the callbacks; its answer is every rank's
            append_rows(self.out / "metrics.jsonl", [m])
            append_rows(self.out / "prompts.jsonl", [{"step": step, "prompt_indices": self.last_prompt_indices}])
            for cb in self.callbacks:
                cb.on_step(step, m)
            for cb in self.callbacks:
                stopped = stopped or cb.should_stop(step, m)
        return self.world.broadcast(stopped or interrupted)

    def save(self) -> Path:
        if self.world.distributed:
            return self._save_ranks()
        return self._save(self.optimizer, self.model, self.rollouts.state_dict())

    def _save_ranks(self) -> Path:
        """Rank 0 writes the checkpoint one process writes, from the whole weights (FSDP2's gathered) and, for FSDP2,
        the optimizer's whole state keyed by parameter name; every rank calls it and gets its path."""
        from . import dist_checkpoint

        model, optimizer = self.model, self.optimizer
        in_flight = self.rollouts.state_dict()  # the global batches sampled ahead (each rank holds its shard)
        if self.cfg.model.parallel == "fsdp2":
            model = _SavedWith(self.model, dist_checkpoint.full_trainable_state(self.wrapped))
            optimizer = _StateOf(dist_checkpoint.full_optimizer_state(self.wrapped, self.optimizer))
        with self.world.full_weights(self.wrapped):
            path = self._save(optimizer, model, in_flight) if self.world.main else None
        return self.world.broadcast(path)

    def _save(self, optimizer, model, in_flight: dict) -> Path:
        """in_flight: the producer's state (batches sampled ahead, max_off_policy_steps; the sampler is past them)."""
        trainer_state = {
            "step": self.step,
            "rollouts": in_flight,
            "sampler": self.sampler.state_dict(),
            "health_gate": self.gate.state_dict(),
            "num_tokens": self.num_tokens,
            "config": self._spec_view,
            "schedule": self.schedule,
        }
        fingerprint = logprob_fingerprint(self.model, self.tokenizer, self.device)
        extra = {
            "base_model": model_identity(self.cfg.model),
            "code_ref": ckpt.code_ref(),
            "lineage": self.lineage,
            "config_hash": self._config_hash,
            "fingerprint": fingerprint,
            "data_fingerprint": data_fingerprint(self.train_set),
            "lora": self._lora_as_trained(),
        }
        checkpoint = ckpt.save_checkpoint(
            self.ckpt_root,
            self.step,
            model=model,
            tokenizer=self.tokenizer,
            optimizer=optimizer,
            scheduler=self.scheduler,
            trainer_state=trainer_state,
            manifest_extra=extra,
            lagged=list(self.lagged),
            keep_last=self.cfg.checkpoint.keep_last,
            adapter=self.adapter,
        )
        for cb in self.callbacks:
            cb.on_checkpoint(checkpoint)
        return checkpoint.path

    def _lora_as_trained(self) -> dict | None:
        """The LoRA settings with the target modules peft actually wrapped ('all-linear' resolved to names)."""
        if not self.cfg.lora.enabled:
            return None
        return {
            **self.cfg.lora.model_dump(),
            "target_modules": sorted(self.model.peft_config[self.adapter].target_modules),
        }

    def close(self) -> None:
        self.rollouts.close()
        self.engine.close()
        dd.close()

    def _append_rows(self, path: Path, rows: list[dict]) -> None:
        """Samples of the global batch, written by rank 0 in rank order."""
        rows = self.world.gather(rows)
        if self.world.main:
            append_rows(path, rows)

    # -------------------------------------------------------------------- helpers
    def _prompt(self, index: int) -> list[int]:
        if index not in self._prompt_cache:
            self._prompt_cache[index] = render_prompt(self.tokenizer, self.train_set[index].prompt, self.cfg.data)
        return self._prompt_cache[index]

    def _logprobs(self, model, ids, attn, completion_len, with_entropy=False) -> tuple[Tensor, Tensor]:
        """Logprobs (and, when asked, entropies; else zeros) of the completion tokens at the sampling temperature."""
        options = dict(
            temperature=self.cfg.rollout.temperature,
            chunk_size=self.cfg.grpo.chunk_rows(self.device.type),
            with_entropy=with_entropy,
            packed=self.cfg.grpo.pack_sequences,
        )
        if model is self.model:  # through the wrapper, whose forward DDP's and FSDP2's hooks see (distributed.py)
            lp, ent = self.wrapped(ids, attn, completion_len, **options)
        else:
            lp, ent = completion_logprobs(model, ids, attn, completion_len, **options)
        return lp, (ent if ent is not None else torch.zeros_like(lp))

    @contextmanager
    def _reference(self):
        """Make the policy model compute reference logprobs for the duration of the block."""
        if self.ref_model is not None:
            yield
        elif self.cfg.grpo.kl_ref_step_lag:
            snapshot = self.lagged[0]
            backup = {n: p.detach().clone() for n, p in self.named_params}
            for n, p in self.named_params:
                p.data.copy_(snapshot[n].to(p.device))
            try:
                yield
            finally:
                for n, p in self.named_params:
                    p.data.copy_(backup[n])
        else:
            with self.model.disable_adapter():
                yield


# ------------------------------------------------------------------------ SIGTERM / SIGINT: stop at a safe point


class SafePoint:
    """While the training loop runs, SIGTERM (spot preemption, Kubernetes, SkyPilot) and SIGINT (Ctrl-C) ask for a
    stop at the next safe point: the step in progress finishes, the loop stops and saves a checkpoint there. A second
    signal goes to the handler that was there before (Python's KeyboardInterrupt, Prefect's TerminationSignal, the
    default's exit): stop at once. Only the main thread receives signals; elsewhere nothing is installed."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None  # the name of the first signal, e.g. "SIGTERM"
        self._previous: dict = {}

    @property
    def stop_reason(self) -> str | None:
        return f"interrupted: {self.received}" if self.received else None

    def __enter__(self) -> SafePoint:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            ckpt.SIGNALLED.set()
            os.write(
                2,
                f"\n{self.received}: finishing this step, then saving a checkpoint (again to stop at once)\n".encode(),
            )
            return
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


# ------------------------------------------------------------------------ plain helpers


@dataclass
class _Scored:
    """The rewards of this rank's completions, and their rows for samples.jsonl."""

    total: list[float]  # the weighted total of each completion
    parts: dict[str, list[float]]  # each reward function's (unweighted) score
    sample_rows: list[dict]


@dataclass
class _StepBatch:
    """This rank's rows of the step's batch on the trainer's device; the first update fills in pi_old, the entropy and
    the rollout-correction weights."""

    ids: Annotated[Tensor, "batch prompt+completion"]  # left-padded prompt, right-padded completion
    attn: Annotated[Tensor, "batch prompt+completion"]
    completion_len: int  # T, the completion columns
    token_mask: Annotated[Tensor, "batch completion"]  # every sampled completion token (not inserted ones)
    loss_mask: Annotated[Tensor, "batch completion"]  # those that count in the loss
    engine_logprobs: Annotated[Tensor, "batch completion"]  # the rollout engine's (NaN where it gave none)
    advantages: Annotated[Tensor, "batch"]
    totals: BatchTotals  # the global batch's loss normalisers
    micro: list[slice]  # the micro-batches (optim.gradient_accumulation_steps)
    old_logprobs: Annotated[Tensor, "batch completion"]  # pi_old
    entropy: Annotated[Tensor, "batch completion"]
    weight: Annotated[Tensor, "batch completion"]  # the rollout correction, as applied


class _Laps:
    """Wall seconds of the step's phases: each call ends one (its seconds since the previous call, or since `t0`)."""

    def __init__(self, t0: float, first: str):
        self.t0 = self._last = t0
        self.seconds: dict[str, float] = {}
        self(first)

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name], self._last = now - self._last, now


def _padded_batch(completions, pad_id: int) -> dict:
    Lp = max(len(c.prompt_ids) for c in completions)
    Tc = max(1, max(len(c.token_ids) for c in completions))
    B = len(completions)
    input_ids = torch.full((B, Lp + Tc), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, Lp + Tc), dtype=torch.long)
    completion_mask = torch.zeros((B, Tc))
    engine_logprobs = torch.full((B, Tc), float("nan"))
    for i, c in enumerate(completions):
        p, t = c.prompt_ids, c.token_ids
        input_ids[i, Lp - len(p) : Lp] = torch.tensor(p)
        attention_mask[i, Lp - len(p) : Lp + len(t)] = 1
        if t:
            input_ids[i, Lp : Lp + len(t)] = torch.tensor(t)
            completion_mask[i, : len(t)] = 1 if c.loss_mask is None else torch.tensor(c.loss_mask, dtype=torch.float32)
            if c.logprobs is not None:
                engine_logprobs[i, : len(t)] = torch.tensor(c.logprobs, dtype=torch.float32)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "completion_mask": completion_mask,
        "engine_logprobs": engine_logprobs,
        "completion_len": Tc,
    }


def _check_packing(model, device: torch.device) -> None:
    """grpo.pack_sequences is refused for a model whose attention lets packed sequences see each other."""
    difference = check_packing(model, model.config.vocab_size, device)
    tolerance = 1e-4 if model.get_input_embeddings().weight.dtype == torch.float32 else 5e-2
    if not difference <= tolerance:
        name = type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__
        raise InputError(
            f"grpo.pack_sequences: {name} does not keep packed sequences apart (packed and padded logprobs "
            f"differ by {difference:.2g}, more than {tolerance:g}); set grpo.pack_sequences: false"
        )


@dataclass
class _StateOf:
    """An optimizer's state already in hand (gathered on rank 0), saved as the optimizer's."""

    state: dict

    def state_dict(self) -> dict:
        return self.state


class _SavedWith:
    """A sharded policy as trainer/checkpoint.py saves it: save_pretrained writes `state` (its whole trainable weights,
    gathered), everything else is the policy's."""

    def __init__(self, policy, state: dict):
        self._policy, self._state = policy, state

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def save_pretrained(self, *args, **kwargs):
        return self._policy.save_pretrained(*args, state_dict=self._state, **kwargs)


def _micro_slices(n: int, parts: int) -> list[slice]:
    size = n // parts
    return [slice(i * size, (i + 1) * size) for i in range(parts)]


def _lr_lambda(schedule: str, warmup: int, total: int):
    """transformers.get_scheduler's constant/linear/cosine shapes, but warm-up reaches 1/warmup at the first update:
    transformers' warm-up starts at 0, so the first step's rollouts (minutes each on a CPU) would train nothing."""

    def f(i: int) -> float:
        if warmup and i < warmup:
            return (i + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (i - warmup) / max(1, total - warmup))
        return 1.0 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))

    return f


def _latest_path(root: Path) -> Path | None:
    checkpoint = ckpt.latest_checkpoint(root)
    return checkpoint.path if checkpoint else None


def _progress(enabled: bool):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        disable=not enabled,
        transient=False,
    )


def _bar_info(m: dict) -> str:
    """The progress bar's step summary: reward, KL (when there is a reference) and length."""
    kl = f"  kl {m['kl']:.4f}" if "kl" in m else ""
    return f"reward {m['reward']:.3f}{kl}  len {m['completions/mean_length']:.1f}"
