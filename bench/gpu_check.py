"""The GPU check of issue 32: one table of where Ballast stands on one GPU against the hardware and against TRL.

Run through `bench/gpu_check.sh` (which sets the environment up and calls this). Everything it needs beside the
GPU image's torch, transformers, peft and accelerate travels in `.ballast/gpu-assets/` (built by
`bench/gpu_assets.py` on a machine with network): the missing packages as wheels, installed with pip `--no-index
--no-deps --target` into a scratch directory (only those the machine lacks), and SmolLM2's tokenizer. The model
is bench/gpu_step.py's random Llama (hidden 1024, 24 layers, SmolLM2's 49,152-token vocabulary: 497M parameters),
built on the spot in bf16. The settings are bench/gpu_step.py's: 8 prompts x 8 completions of exactly 256 tokens
(eos suppressed), LoRA r 16 on the seven projections, beta 0.04, one optimizer step per step.

Sections, each in its own child process (so each peak memory is its own and one failure leaves the rest), in
this order, under one time budget (--budget-s, default 470 s: a measurement that would not fit is skipped, the
last decode measurements and TRL first):

1. **ballast**: GRPO steps (1 warm-up, where the compile falls, + 3 timed): s/step, rollout and update seconds,
   peak GPU memory (torch max allocated), update MFU = 4N x rows x (prompt + completion tokens) / (update s x the
   GPU's dense bf16 peak), N the parameters in matmuls (LoRA weight gradients neglected); wall MFU counts 8N
   (generation 2N, reference 2N, forward + backward 4N). Then one more step, untimed, with torch's allocation
   history on (`torch.cuda.memory._record_memory_history`): the tensors alive at its peak, summed by where they
   were allocated (the innermost frame outside torch <- the innermost frame in this repository), the largest
   twelve as table rows — the trace of the peak that bench/README.md's 4.7 GiB above TRL lacked. Then the decode alone, ms per token step at 64 and 256
   rows x 256 tokens (whole generate call / tokens, prefill included), on the trainer's own engine (on a GPU by
   default its compiled step over the merged copy of the layers, trainer/engines/merged.py, with the draw inside
   the step, trainer/engines/fused.py) and on one over the same model through peft's forward instead (the
   trainer's decode before the merge), in the order 64 default, 256 default, 64 peft, 256 peft; against
   the HBM bound: the matmul weights' bytes / the memory bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s, from the
   device name), and weights + the static KV cache the attention reads each step.
2. **trials**: concurrent LoRA trials (trainer/multi.py) at N = 1, 2, 4, each 4 trials of 2 steps (4 prompts x 8
   completions of 32 tokens) + an eval of 8 prompts: trials per hour and peak GPU memory, N = 1 being one trial at
   a time over the same shared model, the trials' rows under their adapters by row slices, decoded eagerly
   (rollout.compile_decode: never). Then N = 4 again with the adapters stacked and a per-row slot
   (trainer/engines/stacked.py) in the compiled decode with the draw inside it (compile_decode auto, fused_sampling):
   one compile, so it runs only with Plan.trial_stacked_s (90 s) of the budget left; it goes before TRL, whose
   figure bench/README.md already has (TRL is skipped first). `--sections trials` measures it alone.
3. **trl**: TRL's GRPOTrainer at the same settings (1 warm-up + 1 timed step): s/step and peak memory.

The table goes to stdout and, when $OUT is set, to $OUT/gpu_check.txt; each child's raw result is printed as a
JSON line as it ends, so a later failure loses nothing.

    bash bench/gpu_check.sh                 # on the GPU (at most ~8 min)
    bash bench/gpu_check.sh --cpu-smoke     # every section with a 2-layer model on CPU, to check the script (~2 min)
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / ".ballast" / "gpu-assets"
SITE = Path(tempfile.gettempdir()) / "ballast-gpu-site"  # where the carried wheels are installed
HBM_TBPS = {"H200": 4.8, "H100 PCIe": 2.0, "H100 NVL": 3.9, "H100": 3.35, "A100": 2.0}  # first match wins
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0}  # dense, no sparsity
TRIAL_VARIANTS = [(1e-3, 16, 0.02), (3e-3, 8, 0.1), (3e-4, 4, 0.005), (1e-2, 16, 0.05)]  # lr, LoRA r, beta


@dataclass(frozen=True)
class Plan:
    """The sizes of every section: the GPU's, or the CPU smoke run's."""

    device: str = "cuda"
    dtype: str = "bfloat16"
    prompts: int = 8
    generations: int = 8
    max_tokens: int = 256
    warmup: int = 1
    steps: int = 3
    decode_rows: tuple[int, ...] = (64, 256)
    decode_repeats: int = 2
    trial_slots: tuple[int, ...] = (1, 2, 4)
    trial_stacked: tuple[int, ...] = (4,)  # N run again with stacked LoRA in the compiled, fused decode
    trial_stacked_s: float = 90.0  # a stacked run compiles anew: skipped with less time left in the section
    trials: int = 4
    trial_steps: int = 2
    trial_prompts: int = 4
    trial_tokens: int = 32
    trial_eval_prompts: int = 8
    trl_warmup: int = 1
    trl_steps: int = 1
    budget_s: float = 470.0
    # seconds each section needs (H100 figures of bench/README.md plus margin): a section is skipped with less left
    estimate_s: tuple[tuple[str, float], ...] = (("ballast", 150.0), ("trials", 90.0), ("trl", 85.0))
    # seconds a section leaves to the later ones: the ballast section's last decode measurements go first
    reserve_s: tuple[tuple[str, float], ...] = (("ballast", 175.0),)
    decode_large_s: float = 90.0  # a decode measurement after the first compiles anew: skipped with less time left
    trace_s: float = 120.0  # the memory trace (one more step with allocation history on): skipped with less left


SMOKE = Plan(
    device="cpu",
    dtype="float32",
    prompts=2,
    generations=4,
    max_tokens=8,
    steps=1,
    decode_rows=(8, 16),
    decode_repeats=1,
    trial_steps=1,
    trial_prompts=2,
    trial_tokens=4,
    trial_eval_prompts=2,
    trl_steps=1,
    budget_s=115.0,
    estimate_s=(("ballast", 20.0), ("trials", 20.0), ("trl", 20.0)),
    reserve_s=(("ballast", 40.0),),
    trial_stacked_s=20.0,
    decode_large_s=60.0,
)


# ── setup: the carried wheels, the model ─────────────────────────────────────────────────────────────


def install_assets(assets: Path) -> list[str]:
    """pip-install the carried wheels whose distribution is missing here or older than the wheel (then the wheel,
    first on the path, shadows it: typing-extensions for pydantic, say); returns their names."""
    from packaging.version import Version

    def wanted(wheel: Path) -> bool:
        name, version = wheel.name.split("-")[:2]
        try:
            return Version(importlib.metadata.version(name.replace("_", "-"))) < Version(version)
        except importlib.metadata.PackageNotFoundError:
            return True

    missing = [w for w in sorted((assets / "wheels").glob("*.whl")) if wanted(w)]
    if missing:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        cmd += ["--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, missing)]
        subprocess.run(cmd, check=True)
    return [w.name.split("-")[0] for w in missing]


def use_site() -> None:
    """The installed wheels and the repository on the path of this process and of every child."""
    paths = [str(SITE), str(REPO), str(REPO / "bench")]
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])


def build_model(plan: Plan, tokenizer: Path, path: Path) -> dict:
    import torch
    from gpu_step import MODEL_SHAPE, SMOKE_SHAPE, build_random_llama, mean_prompt_tokens
    from trl_step_time import Settings

    shape = SMOKE_SHAPE if plan.device == "cpu" else MODEL_SHAPE
    info = build_random_llama(path, tokenizer, 0, shape, plan.device)
    info["prompt_tokens"] = mean_prompt_tokens(path, Settings())
    info["layers"], info["kv_heads"] = shape["num_hidden_layers"], shape["num_key_value_heads"]
    info["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    if plan.device == "cuda":
        torch.cuda.empty_cache()
    return info


def versions() -> str:
    names = ("torch", "transformers", "peft", "accelerate", "trl", "datasets")

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "missing"

    return ", ".join(f"{n} {version(n)}" for n in names)


# ── children: one process per section ────────────────────────────────────────────────────────────────


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_gib(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def settings(plan: Plan, **changes):
    from trl_step_time import Settings

    fields = dict(prompts_per_step=plan.prompts, num_generations=plan.generations, max_tokens=plan.max_tokens)
    merged = "always" if plan.device == "cpu" else "auto"  # the smoke run decodes merged as a GPU does
    return Settings(**(fields | {"dtype": plan.dtype, "merged_decode": merged} | changes))


def child_ballast(plan: Plan, model: Path, deadline: float, out: dict, save) -> None:
    """GRPO steps, then the decode alone on the trainer's own engine."""
    import torch
    from trl_step_time import BallastRunner

    device = torch.device(plan.device)
    reset_peak(device)
    with tempfile.TemporaryDirectory(prefix="ballast-gpu-check-") as tmp:
        runner = BallastRunner(settings(plan), model, device, "fixed64", plan.warmup + plan.steps, Path(tmp))
        for _ in range(plan.warmup + plan.steps):
            runner.run_step()
            out["records"] = [asdict(r) for r in runner.records]
            save()
        out["peak_gib"] = peak_gib(device)
        save()
        if device.type == "cuda" and time.time() + plan.trace_s < deadline:
            try:
                out["trace"] = trace_step(runner, device)
            except Exception as e:  # the decode measurements still run
                out["trace"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            save()
        out["decode"] = {}
        engines = {"default": runner.trainer.engine, "peft": peft_engine(runner.trainer, device)}
        small, large = plan.decode_rows
        order = [(small, "default"), (large, "default"), (small, "peft"), (large, "peft")]
        for i, (rows, kind) in enumerate(order):
            key = f"{rows} {kind}"
            if i and time.time() + plan.decode_large_s > deadline:  # a new shape or engine: a compile
                out["decode"][key] = {"skipped": "time budget"}
                continue
            try:
                out["decode"][key] = decode_ms(engines[kind], plan, rows, device)
            except Exception as e:  # the other measurements still run
                out["decode"][key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            save()


def trace_step(runner, device, top: int = 12) -> dict:
    """One more step (not timed, not in the records) with torch's allocation history on: the tensors alive at the
    step's peak, summed by where they were allocated (`peak_sites`)."""
    import torch

    sync(device)
    records = list(runner.records)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        runner.run_step()
        sync(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        runner.records[:] = records
    traced = peak_sites(snapshot["device_traces"][device.index or 0], top)
    traced.update(before_gib=before / 2**30, peak_gib=torch.cuda.max_memory_allocated(device) / 2**30)
    return traced


def peak_sites(events: list[dict], top: int) -> dict:
    """From a CUDA allocation trace (torch.cuda.memory._snapshot()["device_traces"][i]): the bytes allocated within
    the trace and alive at its highest point, by site (the innermost frame outside torch, and the innermost frame
    in this repository), the `top` largest: {"traced_peak_gib", "sites": [[site, GiB], ...]}."""
    freed = {"free_completed", "free"}
    current = best = best_at = 0
    sizes: dict[int, int] = {}
    for i, e in enumerate(events):  # first pass: when the peak falls
        if e["action"] == "alloc":
            sizes[e["addr"]] = e["size"]
            current += e["size"]
            if current > best:
                best, best_at = current, i
        elif e["action"] in freed and e["addr"] in sizes:
            current -= sizes.pop(e["addr"])
    live: dict[int, tuple[int, str]] = {}
    for e in events[: best_at + 1]:  # second pass: what is alive then
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _site(e.get("frames") or []))
        elif e["action"] in freed:
            live.pop(e["addr"], None)
    by_site: dict[str, int] = {}
    for size, site in live.values():
        by_site[site] = by_site.get(site, 0) + size
    ranked = sorted(by_site.items(), key=lambda kv: -kv[1])[:top]
    return {"traced_peak_gib": best / 2**30, "sites": [[site, size / 2**30] for site, size in ranked]}


def _site(frames: list[dict]) -> str:
    """'<innermost frame outside torch> <- <innermost frame in this repository>' (frames innermost first)."""

    def where(f: dict) -> str:
        return f"{Path(f['filename']).name}:{f['line']} {f['name']}"

    outside = next((f for f in frames if "/torch/" not in f["filename"]), None)
    ours = next((f for f in frames if str(REPO) in f["filename"]), None)
    parts = [where(f) for f in (outside, ours) if f is not None]
    if len(parts) == 2 and parts[0] == parts[1]:
        parts = parts[:1]
    return " <- ".join(parts) or "(no Python frame)"


def peft_engine(trainer, device):
    """An engine over the trainer's model as the trainer's own was before the merged decode: compiled, the draw
    inside the step (engines/fused.py), through peft's forward (merged_decode never)."""
    from trainer.engines.hf import HFEngine

    return HFEngine(
        trainer.model, trainer.tokenizer, device, compile_decode="always", fused_sampling=True, merged_decode="never"
    )


def decode_ms(engine, plan: Plan, rows: int, device) -> dict:
    """ms per token step of `engine` on `rows` rows (prompts x generations), per-prompt seeds as in a step; the
    first call (a compile or a graph capture for a new shape) untimed."""
    from trainer.data import arith_examples, render_prompt
    from trainer.engines.base import SamplingParams

    n_prompts = rows // plan.generations
    prompts = [render_prompt(engine.tokenizer, e.prompt) for e in arith_examples(n_prompts, seed=1)]
    params = SamplingParams(
        n=plan.generations,
        max_tokens=plan.max_tokens,
        min_tokens=plan.max_tokens,
        seed=0,
        seeds=list(range(n_prompts)),
    )
    reset_peak(device)
    started = time.perf_counter()
    engine.generate(prompts, params)
    sync(device)
    first = time.perf_counter() - started
    times = []
    for _ in range(plan.decode_repeats):
        started = time.perf_counter()
        engine.generate(prompts, params)
        sync(device)
        times.append(time.perf_counter() - started)
    width = max(map(len, prompts))
    return {
        "ms": 1000 * min(times) / plan.max_tokens,
        "first_s": first,
        "width": width,
        "peak_gib": peak_gib(device),
        "path": ("fused" if engine.fused_sampling else "compiled" if engine.decoder is not None else "eager")
        + (", merged" if engine.merged is not None else ", peft"),
    }


def child_trials(plan: Plan, model: Path, deadline: float, out: dict, save) -> None:
    """N trials at a time over one shared model, for each N of plan.trial_slots (row slices per trial, eager
    decode), then each N of plan.trial_stacked with stacked LoRA in the compiled, fused decode (time allowing)."""
    import torch

    device = torch.device(plan.device)
    for slots in plan.trial_slots:
        out[str(slots)] = trial_run(plan, model, slots, device, stacked=False)
        save()
    for slots in plan.trial_stacked:
        key = f"{slots} stacked"
        if time.time() + plan.trial_stacked_s > deadline:
            out[key] = {"skipped": "time budget"}
        else:
            out[key] = trial_run(plan, model, slots, device, stacked=True)
        save()


def trial_run(plan: Plan, model: Path, slots: int, device, stacked: bool) -> dict:
    """plan.trials trials, `slots` at a time: wall seconds, peak memory, each trial's eval reward. stacked: the
    adapters stacked with a per-row slot (trainer/engines/stacked.py), decoded by the compiled step with the draw
    inside it (rollout.compile_decode: auto, fused_sampling); else row slices per trial, eager."""
    import torch

    from trainer.multi import ConcurrentTrials, TrialJob

    with tempfile.TemporaryDirectory(prefix="ballast-gpu-trials-") as tmp:
        gc.collect()  # the last row's model and trainers are gone before this row's peak counts
        if device.type == "cuda":
            torch.cuda.empty_cache()
        reset_peak(device)
        cfgs = trial_configs(plan, model, compile_decode="auto" if stacked else "never")
        jobs = (TrialJob(f"t{i}", cfg, Path(tmp) / f"t{i}") for i, cfg in enumerate(cfgs))
        evals = []
        started = time.perf_counter()
        runner = ConcurrentTrials(slots=slots, max_lora_rank=16, stacked_lora=stacked, fused_sampling=stacked)
        with runner:
            runner.run(jobs, on_end=lambda outcome, t, evals=evals: evals.append(ended(outcome, t)))
        sync(device)
        wall = time.perf_counter() - started
    return {"wall_s": wall, "trials": plan.trials, "peak_gib": peak_gib(device), "eval": evals, "stacked": stacked}


def ended(outcome, trainer) -> float | None:
    if outcome.error is not None:
        raise outcome.error
    return trainer.evaluate(trainer.step).get("eval/reward")


def trial_configs(plan: Plan, model: Path, compile_decode: str = "never") -> list:
    import torch
    from trl_step_time import ballast_config

    from trainer.config import TrainerConfig

    s = settings(
        plan,
        prompts_per_step=plan.trial_prompts,
        max_tokens=plan.trial_tokens,
        compile_decode=compile_decode,
        num_prompts=64,
    )
    base = ballast_config(s, model, torch.device(plan.device), "fixed64", plan.trial_steps).model_dump()
    base["data"]["num_eval_prompts"] = plan.trial_eval_prompts
    base["eval"]["max_tokens"] = plan.trial_tokens
    cfgs = []
    for i in range(plan.trials):
        lr, rank, beta = TRIAL_VARIANTS[i % len(TRIAL_VARIANTS)]
        cfg = json.loads(json.dumps(base))
        cfg["optim"]["learning_rate"], cfg["grpo"]["beta"] = lr, beta
        cfg["lora"]["r"], cfg["lora"]["alpha"] = rank, 2 * rank
        cfgs.append(TrainerConfig.model_validate(cfg))
    return cfgs


def child_trl(plan: Plan, model: Path, deadline: float, out: dict, save) -> None:
    import torch
    from trl_step_time import TRLRunner

    device = torch.device(plan.device)
    reset_peak(device)
    with tempfile.TemporaryDirectory(prefix="ballast-gpu-trl-") as tmp:
        runner = TRLRunner(settings(plan), model, device, "fixed64", plan.trl_warmup + plan.trl_steps, Path(tmp))
        runner.run_all()
    out["records"] = [asdict(r) for r in runner.records]
    out["peak_gib"] = peak_gib(device)


CHILDREN = {"ballast": child_ballast, "trials": child_trials, "trl": child_trl}


def run_child(name: str, plan: Plan, model: Path, deadline: float, smoke: bool) -> dict:
    """The section in a child process, stopped at the deadline; what it saved by then is its result."""
    result_path = Path(tempfile.mkstemp(prefix=f"gpu-check-{name}-", suffix=".json")[1])
    cmd = [sys.executable, __file__, "--child", name, "--model-dir", str(model), "--result", str(result_path)]
    cmd += ["--deadline", str(deadline)] + ["--cpu-smoke"] * smoke
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=max(deadline - time.time(), 1.0) + 15)
        error = f"exit status {proc.returncode}" if proc.returncode else None
    except subprocess.TimeoutExpired:
        error = "stopped at the time budget"
    result = json.loads(result_path.read_text() or "{}")
    result_path.unlink(missing_ok=True)
    if error:
        result["error"] = result.get("error") or error
    result["section_s"] = time.perf_counter() - started
    print(f"[{name}: {result['section_s']:.0f} s] {json.dumps(result)}", flush=True)
    return result


def child_main(args, plan: Plan) -> None:
    import logging
    import traceback
    import warnings

    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("trl").setLevel(logging.ERROR)
    if plan.device == "cpu":
        import torch

        torch.set_num_threads(1)  # the smoke run on a shared machine: one thread measures the work, not the waiting
    out: dict = {}
    path = Path(args.result)

    def save() -> None:
        path.write_text(json.dumps(out))

    try:
        CHILDREN[args.child](plan, Path(args.model_dir), args.deadline, out, save)
    except BaseException as e:  # the result says why; the parent goes on with the next section
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    save()


# ── the table ─────────────────────────────────────────────────────────────────────────────────────────


def by_name(table: dict[str, float], name: str) -> float | None:
    return next((v for k, v in table.items() if k in name), None)


def step_figures(result: dict, warmup: int) -> dict | None:
    records = result.get("records", [])[warmup:]
    if not records:
        return None
    mean = lambda key: statistics.mean(r["parts"][key] for r in records)
    return {
        "s": statistics.mean(r["seconds"] for r in records),
        "rollout": mean("rollout"),
        "update": mean("update"),
        "warmup": [r["seconds"] for r in result["records"][:warmup]],
    }


def table(plan: Plan, gpu: str, info: dict, results: dict) -> list[str]:
    bw, peak = by_name(HBM_TBPS, gpu), by_name(PEAK_BF16_TFLOPS, gpu)
    rows = plan.prompts * plan.generations
    seq = info["prompt_tokens"] + plan.max_tokens
    n = info["matmul_params"]
    lines = [
        f"Ballast GPU check (issue 32): {gpu}; {info['versions']}",
        f"random Llama {info['params'] / 1e6:.0f}M parameters ({n / 1e6:.0f}M in matmuls), {plan.dtype}; "
        f"{plan.prompts} prompts x {plan.generations} completions of {plan.max_tokens} tokens (prompts "
        f"{info['prompt_tokens']:.0f} tokens); LoRA r 16; HBM {bw or '?'} TB/s; bf16 peak {peak or '?'} TFLOP/s",
        "",
        "| section | measure | value | against | target | status |",
        "|---|---|---|---|---|---|",
    ]

    def add(*cells) -> None:
        if plan.device == "cpu":  # a smoke run checks the script: the targets are a GPU's
            cells = cells[:4] + ("", "")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")

    for name, result in results.items():
        if "skipped" in result or ("error" in result and len(result) <= 2):
            add(
                name,
                "-",
                "SKIPPED" if "skipped" in result else "FAILED",
                result.get("skipped") or result["error"],
                "-",
                "-",
            )
    ballast, trl = results.get("ballast", {}), results.get("trl", {})
    decode_rows(plan, info, ballast, bw, add)
    b, t = step_figures(ballast, plan.warmup), step_figures(trl, plan.trl_warmup)
    if b:
        against = f"TRL {t['s']:.2f} s (x{b['s'] / t['s']:.2f})" if t else "TRL: no result"
        add(
            "step",
            "Ballast s/step (rollout + update)",
            f"{b['s']:.3f} ({b['rollout']:.3f} + {b['update']:.3f})",
            against,
            "<= 1.0 s",
            status(b["s"] <= 1.0),
        )
        add("step", "Ballast warm-up step (compile)", f"{b['warmup'][0]:.1f} s" if b["warmup"] else "-", "", "", "")
    elif ballast.get("error"):
        add("step", "Ballast", "FAILED", ballast["error"], "", "")
    if t:
        add(
            "step",
            "TRL GRPOTrainer s/step (rollout + update)",
            f"{t['s']:.3f} ({t['rollout']:.3f} + {t['update']:.3f})",
            f"warm-up {t['warmup'][0]:.1f} s" if t["warmup"] else "",
            "",
            "",
        )
    elif trl.get("error"):
        add("step", "TRL GRPOTrainer", "FAILED", trl["error"], "", "")
    bp, tp = ballast.get("peak_gib"), trl.get("peak_gib")
    if bp is not None or tp is not None:
        value = f"{bp:.1f}" if bp is not None else "no result"
        against = f"TRL {tp:.1f}" if tp is not None else "TRL: no result"
        add(
            "memory",
            "Ballast peak GiB of a step (max allocated)",
            value,
            against,
            "<= TRL",
            status(None not in (bp, tp) and bp <= tp),
        )
    trace_rows(ballast.get("trace"), add)
    if b and peak:
        update_mfu = 4 * n * rows * seq / (b["update"] * peak * 1e12)
        wall_mfu = 8 * n * rows * seq / (b["s"] * peak * 1e12)
        add(
            "update",
            "Ballast MFU fwd+bwd (4N x tokens / update s)",
            f"{update_mfu:.1%}",
            "",
            ">= 20 %",
            status(update_mfu >= 0.2),
        )
        add("step", "Ballast wall MFU (8N x tokens / step s)", f"{wall_mfu:.1%}", "", "", "")
    trial_rows(plan, results.get("trials", {}), add)
    return lines


def decode_rows(plan: Plan, info: dict, ballast: dict, bw: float | None, add) -> None:
    weights = 2 * info["matmul_params"]  # bf16 bytes read per token step
    per_position = 2 * info["layers"] * info["kv_heads"] * info["head_dim"] * 2  # K and V, bf16
    targets = {plan.decode_rows[0]: 1.5, plan.decode_rows[-1]: 2.5}
    for key, d in ballast.get("decode", {}).items():
        rows, kind = key.split()
        if "ms" not in d:
            why = ("SKIPPED", d["skipped"]) if "skipped" in d else ("FAILED", d.get("error", "-"))
            add("decode", f"ms per token step, {rows} rows, {kind} engine", *why, "", "")
            continue
        cache = -(-(d["width"] + plan.max_tokens) // 64) * 64  # the static cache every step's attention reads
        against = "no HBM figure for this device"
        if bw:
            w_ms = weights / (bw * 1e12) * 1e3
            kv_ms = (weights + int(rows) * cache * per_position) / (bw * 1e12) * 1e3
            against = f"weights {w_ms:.2f} ms (x{d['ms'] / w_ms:.1f}); weights + KV {kv_ms:.2f} ms"
        target = targets.get(int(rows)) if plan.device == "cuda" else None
        add(
            "decode",
            f"ms per token step, {rows} rows x {plan.max_tokens}, {d['path']} decode",
            f"{d['ms']:.2f}",
            against,
            f"<= {target} ms" if target else "",
            status(d["ms"] <= target) if target else "",
        )


def trace_rows(trace: dict | None, add) -> None:
    """The traced step: its peak, and the largest sites of what was alive then (allocated within the step)."""
    if not trace:
        return
    if "error" in trace:
        add("memory", "traced step", "FAILED", trace["error"], "", "")
        return
    add(
        "memory",
        "traced step: peak GiB (held before it + allocated within it at its peak)",
        f"{trace['peak_gib']:.1f}",
        f"{trace['before_gib']:.1f} + {trace['traced_peak_gib']:.1f}",
        "",
        "",
    )
    for site, gib in trace["sites"]:
        add("memory", f"at the peak: {site}", f"{gib:.2f} GiB", "", "", "")


def trial_rows(plan: Plan, trials: dict, add) -> None:
    """N = 1, 2, 4 (row slices, eager decode), then stacked LoRA in the compiled, fused decode, each against N = 1."""
    base = trials.get(str(plan.trial_slots[0]))
    runs = [(str(n), f"N = {n}") for n in plan.trial_slots]
    runs += [(f"{n} stacked", f"N = {n}, stacked LoRA (compiled + fused decode on a GPU)") for n in plan.trial_stacked]
    last_plain = str(plan.trial_slots[-1]) if len(plan.trial_slots) > 1 else None
    for key, label in runs:
        r = trials.get(key)
        if not r or not base:
            continue
        if "wall_s" not in r:
            add("trials", label, "SKIPPED", r.get("skipped", "-"), "", "")
            continue
        tph = 3600 * r["trials"] / r["wall_s"]
        base_tph = 3600 * base["trials"] / base["wall_s"]
        memory = f"{r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else "- GiB"
        ratio_mem = r["peak_gib"] / base["peak_gib"] if r["peak_gib"] and base["peak_gib"] else None
        against = (
            f"x{tph / base_tph:.2f} trials/h, x{ratio_mem:.2f} memory of N = 1"
            if ratio_mem
            else f"x{tph / base_tph:.2f} trials/h of N = 1"
        )
        judged = key == last_plain or key.endswith("stacked")
        met = ratio_mem is not None and tph / base_tph >= 3 and ratio_mem <= 1.5
        add(
            "trials",
            f"{label}: trials/hour, peak ({r['trials']} trials x {plan.trial_steps} steps)",
            f"{tph:.0f}, {memory}",
            against,
            ">= 3x at <= 1.5x memory" if judged else "",
            status(met) if judged else "",
        )
    if "error" in trials and base:
        add("trials", "error", "FAILED", trials["error"], "", "")


def status(met: bool) -> str:
    return "MET" if met else "NOT MET"


# ── main ──────────────────────────────────────────────────────────────────────────────────────────────


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="every section with a 2-layer model on CPU (~2 min)")
    ap.add_argument("--assets", type=Path, default=ASSETS, help="wheels/ and smollm2-tokenizer/ (bench/gpu_assets.py)")
    ap.add_argument("--budget-s", type=float, help="the whole check's time limit (default 450 s; smoke 110 s)")
    ap.add_argument("--sections", nargs="+", default=list(CHILDREN), choices=list(CHILDREN))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    plan = SMOKE if args.cpu_smoke else Plan()
    if args.child:
        return child_main(args, plan)
    started = time.time()
    deadline = started + (args.budget_s or plan.budget_s)
    tokenizer = args.assets / "smollm2-tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        print(
            f"error: --assets {args.assets}: no smollm2-tokenizer/tokenizer.json; run python bench/gpu_assets.py on a machine with network and carry .ballast/gpu-assets",
            file=sys.stderr,
        )
        sys.exit(2)
    installed = install_assets(args.assets)
    use_site()
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print(
            "error: no CUDA GPU here; run bash bench/gpu_check.sh --cpu-smoke to check the script on CPU",
            file=sys.stderr,
        )
        sys.exit(2)
    gpu = torch.cuda.get_device_name(0) if plan.device == "cuda" else "CPU (smoke run)"
    print(f"{gpu}; installed from {args.assets}: {', '.join(installed) or 'nothing (all present)'}", flush=True)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="ballast-gpu-check-model-") as tmp:
        model = Path(tmp) / "random-llama"
        info = build_model(plan, tokenizer, model)
        info["versions"] = versions()
        print(f"model built in {time.time() - started:.0f} s: {json.dumps(info)}", flush=True)
        estimates = dict(plan.estimate_s)
        for name in args.sections:
            left = deadline - time.time()
            if left < estimates[name]:
                results[name] = {
                    "skipped": f"{max(left, 0):.0f} s of the budget left, the section needs ~{estimates[name]:.0f} s"
                }
                continue
            section_deadline = deadline - dict(plan.reserve_s).get(name, 0.0)
            results[name] = run_child(name, plan, model, section_deadline, args.cpu_smoke)
    lines = table(plan, gpu, info, results) + ["", f"total {time.time() - started:.0f} s"]
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
