"""Seconds per GRPO step with the HF engine (in-process sampling) against the vLLM engine (a server in
its own process and venv, a new LoRA version pushed every step), on the quickstart settings.

Both runs use examples/quickstart.yaml unchanged (8 prompts x 8 completions, max_tokens 24, LoRA r 16,
fp32), the same seeds and the same number of steps, each in a fresh trainer and output directory. The
vLLM server's start-up is timed separately and is not part of any step; step 1 is shown apart from the
steady-state mean of steps 2..N (it holds one-off warm-up costs on both sides). The engine-vs-trainer
logprob differences (`sampling/sampling_logp_difference/*`) are printed for both engines, and for vLLM what
the weight sync costs per step: the adapter pushed and loaded, and of that the served-policy check
(the version listed, the canary sampled by the server and recomputed by the trainer; engines/vllm.py).

    python bench/engines.py                              # CPU, 6 steps each (~3 min on 2 cores)
    python bench/engines.py --device cuda                # trainer and vLLM on the same GPU
    python bench/engines.py --device cuda --rollout-device cuda:1     # the split: trainer GPU 0, vLLM GPU 1
    python bench/engines.py --model trainer/assets/tiny-arith --steps 10 --set grpo.prompts_per_step=16

The vLLM environment comes from rollout.vllm_python / --vllm-python, else .ballast/vllm-venv
(`ballast vllm-env`). Timings are wall-clock on whatever else the machine is doing: a benchmark, not a test.
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
from trainer.loop import GRPOTrainer  # noqa: E402


def run_engine(engine: str, args, workdir: Path) -> dict:
    sets = [
        f"rollout.engine={engine}",
        f"model.device={args.device}",
        f"optim.steps={args.steps}",
        "eval.every=0",
        f"checkpoint.every={args.steps + 1}",
    ] + list(args.set)
    if args.model:
        sets.append(f"model.name_or_path={Path(args.model).absolute()}")
    if engine == "vllm":
        if args.vllm_python:
            sets.append(f"rollout.vllm_python={args.vllm_python}")
        if args.rollout_device:
            sets.append(f"rollout.device={args.rollout_device}")
    cfg = load_spec(args.spec, sets).trainer_config()
    started = time.perf_counter()
    trainer = GRPOTrainer(cfg, workdir / engine, progress=False)
    setup_s = time.perf_counter() - started
    syncs = []  # what each step's weight sync proved and cost (vLLM only)
    try:
        history = []
        for step in range(1, args.steps + 1):
            history.append(trainer.train_step(step))
            syncs.append(getattr(trainer.engine, "last_sync", None))
        server_s = getattr(getattr(trainer.engine, "server", None), "startup_s", None)
    finally:
        trainer.close()
    steady_syncs = [s for s in syncs[1:] or syncs if s is not None]
    steady = history[1:] or history
    diffs_mean = [m["sampling/sampling_logp_difference/mean"] for m in history]
    diffs_max = [m["sampling/sampling_logp_difference/max"] for m in history]
    return {
        "setup (model + engine start) s": setup_s,
        "  of which vLLM server start s": server_s,
        "step 1 s": history[0]["step_time"],
        "mean step s (steps 2..N)": statistics.mean(m["step_time"] for m in steady),
        "  rollout s": statistics.mean(m["time/rollout"] for m in steady),
        "    of which weight sync s": statistics.mean(s.sync_s for s in steady_syncs) if steady_syncs else None,
        "      of which policy check s": statistics.mean(s.check_s for s in steady_syncs) if steady_syncs else None,
        "  logprobs (ref) s": statistics.mean(m["time/logprobs"] for m in steady),
        "  update s": statistics.mean(m["time/update"] for m in steady),
        "canary logprob diff (max)": max(s.max_logprob_diff for s in syncs) if steady_syncs else None,
        "completion tokens / s": statistics.mean(m["tokens_per_second"] for m in steady),
        "mean completion length": statistics.mean(m["completions/mean_length"] for m in history),
        "reward (mean over steps)": statistics.mean(m["reward"] for m in history),
        "logprob diff mean (mean)": statistics.mean(diffs_mean),
        "logprob diff max (max)": max(diffs_max),
    }


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and (value != 0 and (abs(value) < 1e-2 or math.isnan(value))):
        return f"{value:.2e}"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default=str(REPO / "examples" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cpu", help="the trainer's device (model.device): cpu, cuda, cuda:0")
    parser.add_argument("--rollout-device", help="the vLLM server's device (rollout.device); default: the trainer's")
    parser.add_argument("--model", help="model.name_or_path (default: the spec's, built if missing)")
    parser.add_argument("--vllm-python", help="rollout.vllm_python")
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more spec overrides")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    with tempfile.TemporaryDirectory(prefix="ballast-bench-engines-") as tmp:
        results = {engine: run_engine(engine, args, Path(tmp)) for engine in args.engines}

    import torch

    where = f"trainer {args.device}" + (f", vLLM {args.rollout_device}" if args.rollout_device else "")
    gpu = f" ({torch.cuda.get_device_name(0)})" if args.device.startswith("cuda") and torch.cuda.is_available() else ""
    print(
        f"\nGRPO seconds per step, HF vs vLLM engine: {Path(args.spec).name}, {args.steps} steps each, {where}{gpu}, "
        f"{os.cpu_count()} CPU cores; overrides: {' '.join(args.set) or 'none'}"
    )
    width = max(map(len, next(iter(results.values()))))
    header = f"{'':<{width}} " + " ".join(f"{engine:>12}" for engine in results)
    print(header)
    print("-" * len(header))
    for key in next(iter(results.values())):
        print(f"{key:<{width}} " + " ".join(f"{fmt(r[key]):>12}" for r in results.values()))


if __name__ == "__main__":
    main()
