"""The GRPO step and the run: prompts → rollouts → rewards → advantages → update → metrics → checkpoint.

Reads top to bottom in the order the data flows. The choices, on purpose:

- A *step* is one batch of rollouts (prompts_per_step × num_generations completions) and the
  `num_iterations` optimizer updates made on it; `optim.steps` counts steps, `metrics.jsonl` has
  one line per step (and, with `eval.on_start`, a line for step 0 holding only the eval/* metrics of
  the model before training, as TRL's eval_on_start logs them).
- Rollouts of step k are seeded from (rollout.seed, k), so a resumed run samples exactly what an
  uninterrupted run would; the prompt sampler's position is part of the checkpoint.
- Old (behaviour) logprobs come from the engine by default. If the engine gives none for some tokens
  the step fails (`grpo.require_old_logprobs`), because a ratio of 1 silently turns importance
  sampling into REINFORCE; `grpo.old_logprobs: recompute` recomputes them with the trainer instead.
  `is/frac_old_logprobs_valid` shows the share that was real either way.
- The trainer's logprobs of the sampled tokens before the first update are compared with the engine's
  every step (`rollout/logprob_diff_*`): a stale or double-applied adapter shows up at once.
- The reference for the KL term is the base model (LoRA adapter disabled; a frozen copy for full
  fine-tuning) or, with `kl_ref_step_lag: k`, the policy k steps back (snapshots of the trainable
  weights, saved in the checkpoint so a resume is exact).
- The trainer knows nothing of Prefect, MLflow or Optuna: it reports through `Callbacks`.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from . import checkpoint as ckpt
from .advantages import compute_advantages
from .config import TrainerConfig
from .data import PromptSampler, data_fingerprint, load_datasets, render_prompt
from .engines.base import SamplingParams
from .evaluate import evaluate
from .health import HealthGate, batch_health
from .logprobs import completion_logprobs
from .loss import grpo_loss
from .model import ensure_model, load_policy, logprob_fingerprint, model_identity, resolve_device
from .rewards import RewardComputer


class TrainingError(RuntimeError):
    """A step that cannot go on without silently training the wrong thing."""


class Callbacks:
    """What the trainer tells the outside world. tasks/ binds it to MLflow, sweeps/ to Optuna."""

    def on_step(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_checkpoint(self, step: int, path: Path, manifest: dict) -> None: ...

    def should_stop(self, step: int, metrics: dict[str, float]) -> str | None:
        return None


@dataclass
class RunResult:
    last_step: int
    stopped: str | None
    last_checkpoint: Path | None
    history: list[dict] = field(default_factory=list)
    eval_start: dict | None = None    # eval/* before the first step (eval.on_start), logged as step 0


def config_hash(cfg: TrainerConfig) -> str:
    return hashlib.sha256(json.dumps(_resumable_view(cfg), sort_keys=True).encode()).hexdigest()[:16]


def _resumable_view(cfg: TrainerConfig) -> dict:
    """The config minus what may change across a resume (the total step count)."""
    d = cfg.model_dump(mode="json")
    d["optim"].pop("steps", None)
    return d


class GRPOTrainer:
    def __init__(self, cfg: TrainerConfig, output_dir: str | Path, callbacks: Sequence[Callbacks] = (),
                 init_adapter: str | Path | None = None, lineage: dict | None = None, progress: bool = True, engine=None):
        self.cfg, self.out = cfg, Path(output_dir)
        self.callbacks, self.lineage, self.progress = list(callbacks), dict(lineage or {}), progress
        self.ckpt_root = self.out / "checkpoints"
        self.out.mkdir(parents=True, exist_ok=True)
        _seed_everything(cfg.optim.seed)

        # ---------------------------------------------------------------- model, reference, optimizer
        ensure_model(cfg.model)
        self.device = resolve_device(cfg.model.device)
        self.model, self.tokenizer = load_policy(cfg.model, cfg.lora, adapter_path=str(init_adapter) if init_adapter else None)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        g = cfg.grpo
        self.ref_model = None
        if g.beta > 0 and not cfg.lora.enabled and g.kl_ref_step_lag is None:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.lagged: deque = deque(maxlen=(g.kl_ref_step_lag or 0) + 1)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.params, lr=o.learning_rate, betas=(o.adam_beta1, o.adam_beta2), weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(o.schedule, o.warmup_steps, o.steps * g.num_iterations))

        # ---------------------------------------------------------------- data, rewards, health, engine
        self.train_set, self.eval_set = load_datasets(cfg.data)
        self.sampler = PromptSampler(len(self.train_set), cfg.data.seed)
        self._prompt_cache: dict[int, list[int]] = {}
        self.rewards = RewardComputer(cfg.rewards)
        self.gate = HealthGate(cfg.health)
        self.engine = engine or self._make_engine()
        self.step = 0
        self.last_prompt_indices: list[int] = []

    def _make_engine(self):
        if self.cfg.rollout.engine == "hf":
            from .engines.hf import HFEngine
            return HFEngine(self.model, self.tokenizer, self.device)
        if self.cfg.rollout.engine == "offline":
            from .engines.offline import OfflineEngine
            return OfflineEngine(self.cfg.data.source, self.tokenizer, render_prompt)
        from .engines.vllm import VLLMEngine
        return VLLMEngine.from_config(self.cfg, self.tokenizer, self.out / "vllm")

    # -------------------------------------------------------------------- resume
    def resume(self) -> Path | None:
        """Load the newest valid checkpoint under output_dir, if any; returns it."""
        path = ckpt.latest_checkpoint(self.ckpt_root)
        if path is None:
            return None
        manifest = ckpt.verify_checkpoint(path)
        state = ckpt.load_state(path)
        ts = state["trainer_state"]
        _refuse_changed_config(ts.get("config", {}), _resumable_view(self.cfg), path)
        _load_weights(self.model, path, manifest)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(ts["sampler"])
        self.gate.load_state_dict(ts["health_gate"])
        self.lagged.clear()
        self.lagged.extend(state["lagged"])
        ckpt.restore_rng(state["rng"])
        self.step = ts["step"]
        _truncate_metrics(self.out / "metrics.jsonl", self.step)
        _truncate_metrics(self.out / "prompts.jsonl", self.step)
        return path

    # -------------------------------------------------------------------- one step
    def train_step(self, step: int) -> dict[str, float]:
        cfg, g = self.cfg, self.cfg.grpo
        t0 = time.perf_counter()
        if g.kl_ref_step_lag:
            self.lagged.append({n: p.detach().to("cpu", copy=True) for n, p in self.named_params})

        # 1. prompts
        indices = self.sampler.next_batch(g.prompts_per_step)
        examples = [self.train_set[i] for i in indices]
        prompt_ids = [self._prompt(i) for i in indices]

        # 2. rollouts
        self.engine.sync_weights(self.model, step)
        params = SamplingParams.from_rollout(cfg.rollout, n=g.num_generations, seed=cfg.rollout.seed * 1_000_003 + step)
        completions = [c for group in self.engine.generate(prompt_ids, params) for c in group]
        t_rollout = time.perf_counter()
        ckpt.fault_point("kill-in-step", step)
        self.last_prompt_indices = indices

        # 3. rewards
        texts = [c.text for c in completions]
        answers = [e.answer for e in examples for _ in range(g.num_generations)]
        prompts = [e.prompt for e in examples for _ in range(g.num_generations)]
        total, parts = self.rewards(texts, answers, prompts)
        t_reward = time.perf_counter()

        # 4. advantages
        truncated = torch.tensor([c.finish_reason == "length" for c in completions])
        adv = compute_advantages(torch.tensor(total, dtype=torch.float32), g.num_generations, g.scale_rewards,
                                 truncated=truncated, mask_truncated=g.mask_truncated_completions,
                                 drop_zero_std_groups=g.drop_zero_std_groups)

        # 5. batch tensors: left-padded prompt, right-padded completion
        batch = _pack(completions, self.tokenizer.pad_token_id)
        token_mask = batch["completion_mask"]
        loss_mask = token_mask * adv.loss_mask_seq.float().unsqueeze(1)
        engine_lp = batch["engine_logprobs"]
        valid = torch.isfinite(engine_lp) & token_mask.bool()
        n_tokens = int(token_mask.sum())
        frac_valid = float(valid.sum()) / max(n_tokens, 1)
        if g.old_logprobs == "engine" and frac_valid < 1.0 and g.require_old_logprobs:
            missing = n_tokens - int(valid.sum())
            raise TrainingError(
                f"step {step}: the '{self.engine.name}' rollout engine returned no logprobs for {missing} of {n_tokens} "
                "completion tokens, so importance sampling would silently become REINFORCE; fix the engine, or set "
                "grpo.old_logprobs: recompute (or grpo.require_old_logprobs: false to accept ratio 1 for them)")

        ids, attn = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        Tc = batch["completion_len"]
        micro = _micro_slices(len(completions), cfg.optim.gradient_accumulation_steps)
        temp = cfg.rollout.temperature

        # 6. reference and (optionally) recomputed old logprobs
        ref_lp = None
        if g.beta > 0:
            with torch.no_grad(), self._reference():
                ref_lp = torch.cat([self._logprobs(self._ref_forward_model(), ids[s], attn[s], Tc, temp)[0] for s in micro])
        old_lp = engine_lp.to(self.device)
        if g.old_logprobs == "recompute":
            with torch.no_grad():
                old_lp = torch.cat([self._logprobs(self.model, ids[s], attn[s], Tc, temp)[0] for s in micro])
        t_logprobs = time.perf_counter()

        # 7. updates
        loss_mask, adv_t = loss_mask.to(self.device), adv.advantages.to(self.device)
        acc: dict[str, list[float]] = {}
        trainer_lp = torch.zeros_like(engine_lp)
        entropy = torch.zeros_like(engine_lp)
        for it in range(g.num_iterations):
            for s in micro:
                lp, ent = self._logprobs(self.model, ids[s], attn[s], Tc, temp, with_entropy=(it == 0))
                if it == 0:
                    trainer_lp[s], entropy[s] = lp.detach().float().cpu(), ent.detach().float().cpu()
                old = torch.where(torch.isfinite(old_lp[s]), old_lp[s], lp.detach())
                loss, stats = grpo_loss(lp, old, adv_t[s], loss_mask[s], g,
                                        ref_logprobs=None if ref_lp is None else ref_lp[s], max_completion_length=cfg.rollout.max_tokens)
                (loss / len(micro)).backward()
                stats["loss"] = float(loss.detach())
                for k, v in stats.items():
                    acc.setdefault(k, []).append(v)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.max_grad_norm)
            if not torch.isfinite(grad_norm):
                raise TrainingError(f"step {step}: gradient norm is {float(grad_norm)}; lower optim.learning_rate or check rewards for extreme values")
            acc.setdefault("grad_norm", []).append(float(grad_norm))
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        t_update = time.perf_counter()

        # 8. metrics
        m: dict[str, float] = {"step": step}
        m["reward"] = _mean(total)
        m["reward_std"] = float(adv.group_std.mean())
        for name, values in parts.items():
            m[f"rewards/{name}/mean"] = _mean(values)
        m["frac_reward_zero_std"] = float(adv.frac_zero_std)
        lengths = [len(c.token_ids) for c in completions]
        terminated = [n for n, c in zip(lengths, completions) if c.finish_reason == "stop"]
        m.update({"completions/mean_length": _mean(lengths), "completions/min_length": float(min(lengths)),
                  "completions/max_length": float(max(lengths)),
                  "completions/clipped_ratio": float(truncated.float().mean()),
                  "completions/mean_terminated_length": _mean(terminated) if terminated else 0.0})
        for k, v in acc.items():
            m[k] = _mean(v)
        if ref_lp is None:
            m.update({"kl": 0.0, "kl/k1": 0.0, "kl/k2": 0.0, "kl/k3": 0.0})
        m["entropy"] = float((entropy * token_mask).sum() / max(n_tokens, 1))
        diff = (engine_lp - trainer_lp).abs()[valid]
        m["rollout/logprob_diff_mean"] = float(diff.mean()) if diff.numel() else float("nan")
        m["rollout/logprob_diff_max"] = float(diff.max()) if diff.numel() else float("nan")
        m["is/frac_old_logprobs_valid"] = 1.0 if g.old_logprobs == "recompute" else frac_valid
        m.update(batch_health(texts, [c.token_ids for c in completions]))
        m["advantages/frac_masked"] = 1.0 - float(adv.loss_mask_seq.float().mean())
        m["learning_rate"] = self.scheduler.get_last_lr()[0]
        t_end = time.perf_counter()
        m.update({"time/rollout": t_rollout - t0, "time/reward": t_reward - t_rollout, "time/logprobs": t_logprobs - t_reward,
                  "time/update": t_update - t_logprobs, "step_time": t_end - t0, "tokens_per_second": sum(lengths) / (t_end - t0)})
        if cfg.eval.every and step % cfg.eval.every == 0:
            m.update(self.evaluate())
        return m

    def evaluate(self) -> dict[str, float]:
        return evaluate(self.model, self.tokenizer, self.eval_set, self.cfg.eval, self.rewards)

    # -------------------------------------------------------------------- the run
    def train(self, total_steps: int | None = None) -> RunResult:
        total = total_steps or self.cfg.optim.steps
        history, stopped, last_ckpt = [], None, None
        metrics_file = self.out / "metrics.jsonl"
        eval_start = None
        if self.step == 0 and self.cfg.eval.on_start and self.eval_set:
            eval_start = {"step": 0, **self.evaluate()}
            with open(metrics_file, "a") as f:
                f.write(json.dumps(eval_start) + "\n")
            for cb in self.callbacks:
                cb.on_step(0, eval_start)
        bar = _progress(self.progress)
        with bar:
            task = bar.add_task("GRPO", total=total, completed=self.step, info="")
            for step in range(self.step + 1, total + 1):
                m = self.train_step(step)
                self.step = step
                with open(metrics_file, "a") as f:
                    f.write(json.dumps(m) + "\n")
                with open(self.out / "prompts.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "prompt_indices": self.last_prompt_indices}) + "\n")
                history.append(m)
                for cb in self.callbacks:
                    cb.on_step(step, m)
                stopped = self.gate.update(step, m)
                for cb in self.callbacks:
                    stopped = stopped or cb.should_stop(step, m)
                if step % self.cfg.checkpoint.every == 0 or step == total or stopped:
                    last_ckpt = self.save()
                bar.update(task, completed=step, info=f"reward {m['reward']:.3f}  kl {m['kl']:.4f}  len {m['completions/mean_length']:.1f}")
                if stopped:
                    break
        return RunResult(self.step, stopped, last_ckpt or ckpt.latest_checkpoint(self.ckpt_root), history, eval_start)

    def save(self) -> Path:
        trainer_state = {"step": self.step, "sampler": self.sampler.state_dict(), "health_gate": self.gate.state_dict(),
                         "config": _resumable_view(self.cfg)}
        fingerprint = logprob_fingerprint(self.model, self.tokenizer, self.device)
        extra = {"base_model": model_identity(self.cfg.model), "code_ref": ckpt.code_ref(), "lineage": self.lineage,
                 "config_hash": config_hash(self.cfg), "fingerprint": fingerprint,
                 "data_fingerprint": data_fingerprint(self.train_set),
                 "lora": self.cfg.lora.model_dump() if self.cfg.lora.enabled else None}
        path = ckpt.save_checkpoint(self.ckpt_root, self.step, model=self.model, tokenizer=self.tokenizer,
                                    optimizer=self.optimizer, scheduler=self.scheduler, trainer_state=trainer_state,
                                    manifest_extra=extra, lagged=list(self.lagged), keep_last=self.cfg.checkpoint.keep_last)
        manifest = json.loads((path / ckpt.MANIFEST).read_text())
        for cb in self.callbacks:
            cb.on_checkpoint(self.step, path, manifest)
        return path

    def close(self) -> None:
        self.engine.close()

    # -------------------------------------------------------------------- helpers
    def _prompt(self, index: int) -> list[int]:
        if index not in self._prompt_cache:
            self._prompt_cache[index] = render_prompt(self.tokenizer, self.train_set[index].prompt)
        return self._prompt_cache[index]

    def _logprobs(self, model, ids, attn, completion_len, temperature, with_entropy=False):
        lp, ent = completion_logprobs(model, ids, attn, completion_len, temperature=temperature,
                                      chunk_size=self.cfg.grpo.logprob_chunk_size, with_entropy=with_entropy)
        return lp, (ent if ent is not None else torch.zeros_like(lp))

    def _ref_forward_model(self):
        return self.ref_model if self.ref_model is not None else self.model

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


# ------------------------------------------------------------------------ plain helpers

def _pack(completions, pad_id: int) -> dict:
    Lp = max(len(c.prompt_ids) for c in completions)
    Tc = max(1, max(len(c.token_ids) for c in completions))
    B = len(completions)
    input_ids = torch.full((B, Lp + Tc), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, Lp + Tc), dtype=torch.long)
    completion_mask = torch.zeros((B, Tc))
    engine_logprobs = torch.full((B, Tc), float("nan"))
    for i, c in enumerate(completions):
        p, t = c.prompt_ids, c.token_ids
        input_ids[i, Lp - len(p):Lp] = torch.tensor(p)
        attention_mask[i, Lp - len(p):Lp + len(t)] = 1
        if t:
            input_ids[i, Lp:Lp + len(t)] = torch.tensor(t)
            completion_mask[i, :len(t)] = 1
            if c.logprobs is not None:
                engine_logprobs[i, :len(t)] = torch.tensor(c.logprobs, dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask,
            "engine_logprobs": engine_logprobs, "completion_len": Tc}


def _micro_slices(n: int, parts: int) -> list[slice]:
    size = n // parts
    return [slice(i * size, (i + 1) * size) for i in range(parts)]


def _lr_lambda(schedule: str, warmup: int, total: int):
    def f(i: int) -> float:
        if warmup and i < warmup:
            return (i + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (i - warmup) / max(1, total - warmup))
        return 1.0 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return f


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else 0.0


def _load_weights(model, path: Path, manifest: dict) -> None:
    from safetensors.torch import load_file
    if manifest["weights"] == "adapter":
        from peft import set_peft_model_state_dict
        state = load_file(str(path / "adapter" / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(model, state)
        if getattr(result, "unexpected_keys", None):
            raise ckpt.CheckpointError(f"checkpoint {path}: adapter has unexpected weights {result.unexpected_keys[:3]}; "
                                       "it was saved with a different LoRA configuration")
    else:
        state = {}
        for f in sorted((path / "model").glob("*.safetensors")):
            state.update(load_file(str(f)))
        model.load_state_dict(state, strict=False)


def _refuse_changed_config(saved: dict, now: dict, path: Path) -> None:
    def first_diff(a, b, prefix=""):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                d = first_diff(a.get(k), b.get(k), f"{prefix}{k}.")
                if d:
                    return d
            return None
        return None if a == b else (prefix.rstrip("."), a, b)
    diff = first_diff(saved, now)
    if saved and diff:
        key, was, is_now = diff
        raise ckpt.CheckpointError(f"cannot resume from {path}: spec field {key} was {was!r} and is now {is_now!r}; "
                                   "resume with the spec the run started with (only optim.steps may change), or fork a new run")


def _truncate_metrics(path: Path, last_step: int) -> None:
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), TextColumn("{task.fields[info]}"), disable=not enabled, transient=False)
