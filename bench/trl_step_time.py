"""Seconds per GRPO step: Ballast's trainer against TRL's `GRPOTrainer`, same model, task and settings, one run.

Both frameworks train the offline tiny arithmetic model (the shipped one, `trainer/assets/tiny-arith`,
as the tests use it) on the same `arith` prompts with the same reward, and one *step* is the same work
on both sides: 8 prompts x 8 completions = 64 completions sampled in-process with the HF model (TRL:
`generate`; Ballast: its HF engine's own sampling loop, the same transformers logits processors), rewarded,
group-normalised, and ONE optimizer step on them. The settings, and how each side is told:

    setting                 Ballast (TrainerConfig)                 TRL 1.16 (GRPOConfig)
    64 completions / step   grpo.prompts_per_step 8,                per_device_train_batch_size 64, num_generations 8,
                            grpo.num_generations 8,                 gradient_accumulation_steps 1, so steps_per_generation 1
                            optim.gradient_accumulation_steps 1     and generation_batch_size 64: one generate, one update
    length                  rollout.max_tokens 64                   max_completion_length 64
    sampling                temperature 1, top_p 1, top_k off;      the same; use_vllm False (transformers generate)
                            rollout.engine hf
    LoRA                    r 16, alpha 32, dropout 0, q k v o gate up down: the same peft LoraConfig on both
    KL                      beta 0.04, k3; reference = the base model with the adapter disabled, on both
    loss                    dapo, epsilon 0.2, num_iterations 1, scale_rewards group, on both
    optimizer               AdamW lr 1e-4, betas (0.9, 0.99), wd 0, constant schedule, grad clip 1.0, on both
    precision               fp32                                    bf16 False, gradient_checkpointing False (TRL's
                                                                    defaults are True for both)
    reward                  trainer.rewards.exact_answer on the decoded completion (special tokens skipped), on both
    dataset                 arith_examples(512, seed 0)             the same, as [{"role": "user", "content": prompt}]
                                                                    with the sums in an "answer" column
    logging, eval, saving   no eval, no checkpoint, health gate off logging_strategy/save_strategy/eval_strategy 'no',
                                                                    report_to 'none'

Old-policy logprobs cost no extra forward pass on either side: Ballast's HF engine takes them while it
samples (its own loop with a static KV cache, trainer/engines/hf.py), TRL skips them when generation and optimisation are aligned (it uses the detached current
logprobs). So both do per step: one generate, one no-grad reference forward, one forward + backward.

Modes. `natural`: generation stops at eos, and the tiny model stops after ~21 tokens (the longest of a batch ~35), so the mean
completion length of each side is printed next to its time. `fixed64`: eos is suppressed until 64
tokens (TRL: generation_kwargs min_new_tokens=64; Ballast: rollout.min_tokens=64), so both generate
exactly 64 tokens.

Timing. N warm-up steps, then M timed steps for each framework. A TRL step is timed by a
`TrainerCallback` from on_step_begin to on_step_end (generation, rewards, reference, forward, backward,
optimizer step); a Ballast step is the wall time of `GRPOTrainer.train_step` (what `train()` runs per
step, minus writing metrics.jsonl and checkpoints). `--order interleaved` (default) runs the two in
one process alternately, T B T B ..., Ballast's step being run from the TRL callback right after a
TRL step's timer stops, so load from other processes on a shared machine falls on both alike;
`--order sequential` runs all of Ballast's steps, then all of TRL's. Where the time goes is printed for
both: Ballast's own time/* metrics, and for TRL wrappers around its generate, reward, and no-grad /
grad logprob calls. The target: Ballast's mean step at most half of TRL's.

Threads. On CPU the default is ONE torch thread (--threads to change): with torch's default of one
per core, any other process on the cores makes OpenMP's workers wait on each other, and single
generate calls measured 1-15 s instead of 0.25 s, at random. One thread measures the work itself.

    python bench/trl_step_time.py                          # CPU (or cuda if available), both modes, ~1.5 min on 2 cores
    python bench/trl_step_time.py --device cuda --steps 10
    python bench/trl_step_time.py --modes natural --warmup 1 --steps 3 --order sequential

A benchmark, not a test: the numbers are wall-clock on whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# ── the settings both frameworks share: one home ──────────────────────────────────────────────────────


@dataclass(frozen=True)
class Settings:
    prompts_per_step: int = 8
    num_generations: int = 8
    max_tokens: int = 64
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    beta: float = 0.04
    loss_type: str = "dapo"
    epsilon: float = 0.2
    scale_rewards: str = "group"
    temperature: float = 1.0
    learning_rate: float = 1e-4
    adam_betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = 1.0
    num_prompts: int = 512  # arith training prompts (data seed 0, as Ballast's default data section)
    seed: int = 0
    dtype: str = "float32"  # weights and compute of both (bench/gpu_step.py runs bfloat16)
    compile_decode: str = "auto"  # Ballast's rollout.compile_decode (auto: compiled on CUDA)
    merged_decode: str = "auto"  # Ballast's rollout.merged_decode (auto: on CUDA where the copy fits)
    target_ratio: float = 0.5  # the goal: Ballast's step <= this x TRL's

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations


MODES = {
    "natural": "eos allowed (the model stops when it wants)",
    "fixed64": "eos suppressed: every completion is 64 tokens",
}


@dataclass
class StepRecord:
    seconds: float
    tokens: int  # completion tokens generated in the step
    parts: dict[str, float] = field(default_factory=dict)  # rollout / reward / logprobs / update / other


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ── Ballast ───────────────────────────────────────────────────────────────────────────────────────────


def ballast_config(s: Settings, model_path: Path, device: torch.device, mode: str, total_steps: int):
    """Ballast's TrainerConfig for these settings (the table in the module docstring)."""
    from trainer.config import (
        CheckpointConfig,
        DataConfig,
        EvalConfig,
        GRPOConfig,
        HealthConfig,
        LoraConfig,
        ModelConfig,
        OptimConfig,
        RewardConfig,
        RolloutConfig,
        TrainerConfig,
    )

    return TrainerConfig(
        model=ModelConfig(name_or_path=str(model_path), device=str(device), dtype=s.dtype),
        lora=LoraConfig(r=s.lora_r, alpha=s.lora_alpha, dropout=s.lora_dropout, target_modules=list(s.target_modules)),
        data=DataConfig(source="arith", num_prompts=s.num_prompts, seed=s.seed),
        rewards=[RewardConfig(name="exact_answer")],
        grpo=GRPOConfig(
            num_generations=s.num_generations,
            prompts_per_step=s.prompts_per_step,
            beta=s.beta,
            loss_type=s.loss_type,
            epsilon=s.epsilon,
            scale_rewards=s.scale_rewards,
            num_iterations=1,
        ),
        rollout=RolloutConfig(
            engine="hf",
            temperature=s.temperature,
            max_tokens=s.max_tokens,
            seed=s.seed,
            compile_decode=s.compile_decode,
            merged_decode=s.merged_decode,
            min_tokens=s.max_tokens if mode == "fixed64" else 0,
        ),
        optim=OptimConfig(
            steps=total_steps,
            learning_rate=s.learning_rate,
            adam_beta1=s.adam_betas[0],
            adam_beta2=s.adam_betas[1],
            weight_decay=0.0,
            schedule="constant",
            max_grad_norm=s.max_grad_norm,
            seed=s.seed,
        ),
        checkpoint=CheckpointConfig(every=total_steps + 1),
        health=HealthConfig(enabled=False),  # fixed64 would trip clipped_ratio_max: every completion hits max
        eval=EvalConfig(every=0),
    )


class BallastRunner:
    def __init__(self, s: Settings, model_path: Path, device: torch.device, mode: str, total_steps: int, workdir: Path):
        from trainer.loop import GRPOTrainer

        cfg = ballast_config(s, model_path, device, mode, total_steps)
        self.trainer = GRPOTrainer(cfg, workdir / "ballast", progress=False)
        self.device, self.step = device, 0
        self.records: list[StepRecord] = []
        self.rewards: list[float] = []

    def run_step(self) -> None:
        self.step += 1
        sync(self.device)
        t0 = time.perf_counter()
        m = self.trainer.train_step(self.step)
        sync(self.device)
        seconds = time.perf_counter() - t0
        parts = {
            "rollout": m["time/rollout"],
            "reward": m["time/reward"],
            "logprobs": m["time/logprobs"],
            "update": m["time/update"],
        }
        parts["other"] = seconds - sum(parts.values())
        tokens = round(
            m["completions/mean_length"]
            * self.trainer.cfg.grpo.prompts_per_step
            * self.trainer.cfg.grpo.num_generations
        )
        self.records.append(StepRecord(seconds, tokens, parts))
        self.rewards.append(m["reward"])


# ── TRL ───────────────────────────────────────────────────────────────────────────────────────────────


def trl_dataset(s: Settings):
    from datasets import Dataset

    from trainer.data import arith_examples

    rows = [
        {"prompt": [{"role": "user", "content": e.prompt}], "answer": e.answer}
        for e in arith_examples(s.num_prompts, s.seed)
    ]
    return Dataset.from_list(rows)


TRL_QUIET = dict(  # no logging, saving, eval, progress bars or loader workers: a timed step is the step alone
    logging_strategy="no",
    save_strategy="no",
    eval_strategy="no",
    report_to="none",
    disable_tqdm=True,
    log_completions=False,
    dataloader_num_workers=0,
)


def check_one_generation_per_step(args, completions: int) -> None:
    """TRL's GRPOConfig must sample `completions` completions once per optimizer step, as Ballast's step does."""
    if args.steps_per_generation != 1 or args.generation_batch_size != completions:
        raise RuntimeError(
            f"TRL would not do one generation of {completions} completions per optimizer step "
            f"(steps_per_generation={args.steps_per_generation}, "
            f"generation_batch_size={args.generation_batch_size}); check GRPOConfig's batch semantics"
        )


class TRLRunner:
    """TRL's GRPOTrainer plus the instruments: a step timer (callback), the completion lengths (seen by the
    reward function) and wall time of TRL's own stages (wrappers on the trainer instance's methods)."""

    def __init__(
        self,
        s: Settings,
        model_path: Path,
        device: torch.device,
        mode: str,
        total_steps: int,
        workdir: Path,
        between_steps=None,
    ):
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        from trainer.model import load_tokenizer
        from trainer.rewards import exact_answer

        runner = self
        self.device, self.records, self.rewards = device, [], []
        self._lengths: list[int] = []
        self._parts: dict[str, float] = {}

        def exact_answer_reward(prompts, completions, completion_ids, answer, **kwargs):
            runner._lengths.extend(len(ids) for ids in completion_ids)
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            values = exact_answer(texts, answer, prompts)
            runner.rewards.append(sum(values) / len(values))
            return values

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                runner._lengths, runner._parts = [], {}
                sync(device)
                runner._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                sync(device)
                seconds = time.perf_counter() - runner._t0
                p = runner._parts
                parts = {
                    "rollout": p.get("generate", 0.0),
                    "reward": p.get("reward", 0.0),
                    "logprobs": p.get("logprobs_nograd", 0.0),
                    "update": seconds - p.get("prepare", 0.0),
                }
                parts["other"] = seconds - sum(parts.values())
                if len(runner._lengths) != s.completions_per_step:
                    raise RuntimeError(
                        f"TRL step {state.global_step} scored {len(runner._lengths)} completions, expected "
                        f"{s.completions_per_step}: the step is not the same work as Ballast's"
                    )
                runner.records.append(StepRecord(seconds, sum(runner._lengths), parts))
                if between_steps is not None:
                    between_steps()

        generation_kwargs = {"min_new_tokens": s.max_tokens} if mode == "fixed64" else None
        args = GRPOConfig(
            output_dir=str(workdir / "trl"),
            max_steps=total_steps,
            seed=s.seed,
            per_device_train_batch_size=s.completions_per_step,
            num_generations=s.num_generations,
            gradient_accumulation_steps=1,
            max_completion_length=s.max_tokens,
            temperature=s.temperature,
            top_p=1.0,
            top_k=0,
            generation_kwargs=generation_kwargs,
            use_vllm=False,
            beta=s.beta,
            loss_type=s.loss_type,
            epsilon=s.epsilon,
            scale_rewards=s.scale_rewards,
            num_iterations=1,
            learning_rate=s.learning_rate,
            adam_beta1=s.adam_betas[0],
            adam_beta2=s.adam_betas[1],
            weight_decay=0.0,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_grad_norm=s.max_grad_norm,
            optim="adamw_torch",
            bf16=s.dtype == "bfloat16",
            fp16=False,
            gradient_checkpointing=False,
            use_cpu=device.type == "cpu",
            **TRL_QUIET,
        )
        check_one_generation_per_step(args, s.completions_per_step)
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, s.dtype))
        self.trainer = GRPOTrainer(
            model=model,
            reward_funcs=[exact_answer_reward],
            args=args,
            train_dataset=trl_dataset(s),
            processing_class=load_tokenizer(model_path),
            callbacks=[StepTimer()],
            peft_config=LoraConfig(
                r=s.lora_r,
                lora_alpha=s.lora_alpha,
                lora_dropout=s.lora_dropout,
                target_modules=list(s.target_modules),
                task_type="CAUSAL_LM",
            ),
        )
        from transformers import PrinterCallback, ProgressCallback

        for quiet in (PrinterCallback, ProgressCallback):  # no end-of-training metrics dict on stdout
            self.trainer.remove_callback(quiet)
        self._instrument()

    def _instrument(self) -> None:
        """Time TRL's stages by shadowing the instance's methods (it calls them through self)."""
        t = self.trainer

        def timed(fn, name, classify=None):
            def wrapper(*args, **kwargs):
                key = classify() if classify else name
                sync(self.device)
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    sync(self.device)
                    self._parts[key] = self._parts.get(key, 0.0) + time.perf_counter() - start

            return wrapper

        t._generate_and_score_completions = timed(t._generate_and_score_completions, "prepare")
        t._generate_single_turn = timed(t._generate_single_turn, "generate")
        t._calculate_rewards = timed(t._calculate_rewards, "reward")
        t._get_per_token_logps_and_entropies = timed(
            t._get_per_token_logps_and_entropies,
            None,
            classify=lambda: "logprobs_grad" if torch.is_grad_enabled() else "logprobs_nograd",
        )

    def run_all(self) -> None:
        self.trainer.train()


# ── the run ───────────────────────────────────────────────────────────────────────────────────────────


def run_mode(
    s: Settings, model_path: Path, device: torch.device, mode: str, warmup: int, steps: int, order: str
) -> tuple[BallastRunner, TRLRunner]:
    total = warmup + steps
    with tempfile.TemporaryDirectory(prefix="ballast-bench-trl-") as tmp:
        ballast = BallastRunner(s, model_path, device, mode, total, Path(tmp))
        if order == "interleaved":
            trl = TRLRunner(s, model_path, device, mode, total, Path(tmp), between_steps=ballast.run_step)
            trl.run_all()
        else:
            for _ in range(total):
                ballast.run_step()
            trl = TRLRunner(s, model_path, device, mode, total, Path(tmp))
            trl.run_all()
    if len(ballast.records) != total or len(trl.records) != total:
        raise RuntimeError(
            f"expected {total} steps from each framework, got Ballast {len(ballast.records)}, TRL {len(trl.records)}"
        )
    return ballast, trl


def summarise(records: list[StepRecord], s: Settings) -> dict:
    secs = [r.seconds for r in records]
    tokens = [r.tokens for r in records]
    parts = {k: statistics.mean(r.parts[k] for r in records) for k in records[0].parts}
    return {
        "steps": len(records),
        "mean": statistics.mean(secs),
        "median": statistics.median(secs),
        "length": sum(tokens) / (len(records) * s.completions_per_step),
        "tokens_per_s": sum(tokens) / sum(secs),
        "parts": parts,
    }


def print_mode(mode: str, warmup: int, order: str, s: Settings, ballast: BallastRunner, trl: TRLRunner) -> float:
    rows = {"ballast": summarise(ballast.records[warmup:], s), "trl": summarise(trl.records[warmup:], s)}
    print(f"\nmode {mode}: {MODES[mode]}; {warmup} warm-up step(s) excluded, {order}")
    header = f"{'framework':<10} {'steps timed':>11} {'mean s/step':>12} {'median s/step':>14} {'mean compl. len':>16} {'tokens/s':>9}"
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        print(
            f"{name:<10} {r['steps']:>11} {r['mean']:>12.3f} {r['median']:>14.3f} {r['length']:>16.1f} {r['tokens_per_s']:>9.0f}"
        )
    ratio = rows["ballast"]["mean"] / rows["trl"]["mean"]
    ratio_median = rows["ballast"]["median"] / rows["trl"]["median"]
    met = "MET" if ratio <= s.target_ratio else "NOT MET"
    print(
        f"ratio Ballast/TRL: {ratio:.2f} (mean), {ratio_median:.2f} (median); speed-up x{1 / ratio:.2f}; "
        f"target Ballast <= {s.target_ratio:.2f} x TRL: {met}"
    )
    print(
        "where the time goes (mean s/step): rollout = generate; logprobs = no-grad reference forward; "
        "update = forward + backward + optimizer step; other = tokenising, decoding, advantages, metrics"
    )
    part_header = f"{'framework':<10} " + " ".join(f"{k:>9}" for k in rows["ballast"]["parts"])
    print(part_header)
    for name, r in rows.items():
        print(f"{name:<10} " + " ".join(f"{v:>9.3f}" for v in r["parts"].values()))
    print(
        f"mean reward per step (sanity, not a comparison): Ballast {statistics.mean(ballast.rewards):.3f}, "
        f"TRL {statistics.mean(trl.rewards):.3f}"
    )
    return ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:0'")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps per framework, not timed")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per framework")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--order", default="interleaved", choices=["interleaved", "sequential"])
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads; default 1 on CPU (see the docstring), torch's default on cuda",
    )
    ap.add_argument("--model", default=None, help="a tiny-arith model directory (default: the cached test model)")
    args = ap.parse_args()
    if args.warmup < 0 or args.steps < 1:
        raise SystemExit(f"--warmup {args.warmup} / --steps {args.steps}: give warm-up >= 0 and at least 1 timed step")
    from infra.extras import exit_unless_installed

    exit_unless_installed("bench", "bench/trl_step_time.py (TRL's GRPOTrainer beside Ballast's)")
    from trainer.model import resolve_device

    device = resolve_device(args.device)
    threads = args.threads or (1 if device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    import logging

    import peft
    import transformers
    import trl

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("trl").setLevel(logging.ERROR)

    if args.model:
        model_path = Path(args.model).absolute()
    else:
        from trainer.tiny import SHIPPED

        model_path = SHIPPED
    s = Settings()

    started = time.perf_counter()
    results = {mode: run_mode(s, model_path, device, mode, args.warmup, args.steps, args.order) for mode in args.modes}

    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(
        f"\nGRPO seconds per step, Ballast vs TRL GRPOTrainer — {s.prompts_per_step} prompts x {s.num_generations} "
        f"completions, max {s.max_tokens} new tokens, LoRA r {s.lora_r} alpha {s.lora_alpha:g}, beta {s.beta}, "
        f"loss {s.loss_type}, lr {s.learning_rate:g}, T {s.temperature:g}, fp32"
    )
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, peft {peft.__version__}; "
        f"device {device}{gpu}; {torch.get_num_threads()} torch threads on {os.cpu_count()} CPU cores; "
        f"model {model_path.name}"
    )
    if device.type == "cpu" and not args.threads:
        print(
            "1 torch thread by default on CPU: with torch's default (one per core) and another process on the cores, "
            "OpenMP oversubscription made single steps 5-50x slower at random (--threads to change)"
        )
    order = (
        "interleaved: T B T B ... in one process, each Ballast step run right after a TRL step's timer stops"
        if args.order == "interleaved"
        else "sequential: all Ballast steps, then all TRL steps"
    )
    for mode, (ballast, trl_run) in results.items():
        print_mode(mode, args.warmup, order, s, ballast, trl_run)
    print(f"\ntotal wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
