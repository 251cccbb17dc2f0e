"""Rollouts that overlap training against synchronous ones, with the vLLM engine: seconds per step, generated
tokens per second and the reward reached, side by side in one run.

Each configuration — rollout.max_off_policy_steps k = 0 (synchronous), 1 and 2 — trains examples/quickstart.yaml
as it is (8 prompts x 8 completions, max_tokens 24, LoRA r 16, fp32, 60 steps) from the same seeds in a fresh
trainer, against one vLLM server started once for all of them (its start-up timed apart; each trainer pushes
and checks its own adapter versions, rollout.vllm_url). With k >= 1 the server samples the next batches on a
background thread while the trainer computes (trainer/rollouts.py). In-training eval is off so that no step
carries it; the held-out eval (the spec's eval section: 128 prompts, sampled at T = 1) runs after the last step,
outside the timing, and once before training for the baseline. Steps are run one by one (`train_step`); the
health gate is asked after each, and the first step it would have stopped is shown, not acted on, so every
configuration runs the same number of steps.

Rows: seconds per step (mean of steps 2..N: step 1 holds one-off warm-up) and the whole run's wall time;
generated (completion) tokens per second of wall time; where a step's time goes (the wait for its batch, the
engine's own time per batch, wherever it fell; the update); the engine-vs-trainer logprob difference and the
staleness; the training reward (mean of the last 10 steps) and held-out reward and accuracy after training; the
ratio of seconds per step, synchronous / this.

    python bench/overlap.py                                   # CPU, quickstart, k = 0 1 2
    python bench/overlap.py --steps 20 --ks 0 1 --model trainer/assets/tiny-arith
    python bench/overlap.py --set model.torch_threads=1       # the trainer on one core, the server on the rest
    python bench/overlap.py --split-cores --ks 0 1            # trainer and server each pinned to half the cores

--split-cores is the CPU picture of the split the design recommends on GPUs (trainer on GPU 0, vLLM on GPU 1):
the server is started pinned to the second half of the cores (its OpenMP threads bound there with
VLLM_CPU_OMP_THREADS_BIND), then this process, the trainer, pins itself to the first half with as many torch
threads; without it both share every core, and overlapping them only interleaves their work.

The vLLM environment is rollout.vllm_python / --vllm-python, else .ballast/vllm-venv (`ballast vllm-env`).
Wall-clock on whatever else the machine is doing: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tasks.spec import load_spec  # noqa: E402
from trainer.engines.vllm_server import VLLMServer, resolve_vllm_python  # noqa: E402
from trainer.loop import GRPOTrainer  # noqa: E402
from trainer.model import ensure_model  # noqa: E402

LAST = 10  # steps whose training reward is averaged as "the reward reached"


def config(args, k: int, url: str):
    sets = [
        "rollout.engine=vllm",
        f"rollout.vllm_url={url}",
        f"rollout.max_off_policy_steps={k}",
        f"optim.steps={args.steps}",
        "eval.every=0",
        "eval.on_start=false",
        f"checkpoint.every={args.steps + 1}",
    ]
    if args.model:
        sets.append(f"model.name_or_path={Path(args.model).absolute()}")
    return load_spec(args.spec, sets + list(args.set)).trainer_config()


def run(args, k: int, url: str, workdir: Path, baseline: dict) -> dict:
    cfg = config(args, k, url)
    trainer = GRPOTrainer(cfg, workdir / f"k{k}", progress=False)
    history, gate = [], None
    try:
        if not baseline:
            baseline.update(trainer.evaluate())
        started = time.perf_counter()
        for step in range(1, args.steps + 1):
            history.append(trainer.train_step(step))
            if trainer.gate.update(step, history[-1]) and gate is None:
                gate = step
        wall = time.perf_counter() - started
        final = trainer.evaluate()
    finally:
        trainer.close()
    batch = cfg.grpo.prompts_per_step * cfg.grpo.num_generations
    tokens = sum(m["completions/mean_length"] * batch for m in history)
    steady = history[1:] or history
    mean = lambda name: statistics.fmean(m[name] for m in steady)  # noqa: E731
    return {
        "s / step (steps 2..N)": mean("step_time"),
        "s / step, step 1": history[0]["step_time"],
        "wall s (all steps)": wall,
        "generated tokens / s": tokens / wall,
        "  wait for the batch s / step": mean("time/rollout"),
        "  engine s / batch": mean("time/generate"),
        "  update s / step": mean("time/update"),
        "staleness (max)": max(m["sampling/staleness/max"] for m in history),
        "logprob diff mean (mean)": statistics.fmean(m["sampling/sampling_logp_difference/mean"] for m in history),
        "logprob diff max (max)": max(m["sampling/sampling_logp_difference/max"] for m in history),
        "IS weight mean (mean)": statistics.fmean(m["sampling/importance_sampling_ratio/mean"] for m in history),
        f"train reward (last {LAST} steps)": statistics.fmean(m["reward"] for m in history[-LAST:]),
        "eval/reward after": final.get("eval/reward"),
        "eval/accuracy after": final.get("eval/accuracy"),
        "health gate would stop at step": gate,
    }


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and (math.isnan(value) or (value != 0 and abs(value) < 1e-2)):
        return f"{value:.2e}"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default=str(REPO / "examples" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2], help="rollout.max_off_policy_steps values")
    parser.add_argument("--model", help="model.name_or_path (default: the spec's, built if missing)")
    parser.add_argument("--vllm-python", help="rollout.vllm_python")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more spec overrides")
    parser.add_argument(
        "--split-cores",
        action="store_true",
        help="the server on the second half of the cores, the trainer on the first",
    )
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cores = sorted(os.sched_getaffinity(0))
    trainer_cores, server_cores = cores[: len(cores) // 2], cores[len(cores) // 2 :]
    if args.split_cores:
        if not trainer_cores:
            raise SystemExit("--split-cores needs at least 2 cores")
        args.set.append(f"model.torch_threads={len(trainer_cores)}")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, server_cores))

    cfg = config(args, 0, "http://127.0.0.1:1")
    ensure_model(cfg.model)
    with tempfile.TemporaryDirectory(prefix="ballast-bench-overlap-") as tmp:
        if args.split_cores:
            os.sched_setaffinity(0, server_cores)  # the server's processes inherit this
        started = time.perf_counter()
        server = VLLMServer.start(
            resolve_vllm_python(args.vllm_python or cfg.rollout.vllm_python),
            str(Path(cfg.model.name_or_path).absolute()),
            log_path=Path(tmp) / "server.log",
            dtype=cfg.rollout.vllm_dtype or "float32",
            max_lora_rank=cfg.lora.r,
            startup_timeout_s=cfg.rollout.vllm_startup_timeout_s,
            extra_args=cfg.rollout.vllm_extra_args,
        )
        server_s = time.perf_counter() - started
        if args.split_cores:
            os.sched_setaffinity(0, trainer_cores)
        baseline: dict = {}
        try:
            results = {f"k={k}": run(args, k, server.url, Path(tmp), baseline) for k in args.ks}
        finally:
            server.close()

    first = next(iter(results.values()))
    for r in results.values():
        r["s / step, first / this"] = first["s / step (steps 2..N)"] / r["s / step (steps 2..N)"]
    print(
        f"\nOverlapped vs synchronous rollouts, vLLM engine: {Path(args.spec).name}, {args.steps} steps each, "
        f"{os.cpu_count()} CPU cores"
        f"{f' (trainer on {trainer_cores}, server on {server_cores})' if args.split_cores else ' shared'}, "
        f"one server for all (started in {server_s:.1f} s); "
        f"overrides: {' '.join(args.set) or 'none'}"
    )
    print(
        f"held-out before training: eval/reward {fmt(baseline.get('eval/reward'))}, "
        f"eval/accuracy {fmt(baseline.get('eval/accuracy'))}"
    )
    width = max(map(len, first))
    header = f"{'rollout.max_off_policy_steps':<{width}} " + " ".join(f"{name:>10}" for name in results)
    print(header)
    print("-" * len(header))
    for key in first:
        print(f"{key:<{width}} " + " ".join(f"{fmt(r[key]):>10}" for r in results.values()))


if __name__ == "__main__":
    main()
