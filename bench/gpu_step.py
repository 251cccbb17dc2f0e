"""GPU: seconds per GRPO step, Ballast against TRL's GRPOTrainer at equal settings, on a randomly initialised
Llama of about 0.5B parameters built on the spot (a GPU machine reaches no model hub).

The model: LlamaConfig with hidden 1024, 24 layers, 16 heads (8 KV heads), MLP 4352, untied embeddings, and
the vocabulary of the tokenizer given with --tokenizer (default .ballast/gpu-assets/smollm2-tokenizer, 49,152
tokens: 497M parameters), random weights from a seed, saved in bf16 to a temporary directory that both
frameworks load. A random model almost never samples its end token, so every completion is --max-tokens long
on both sides (eos is also suppressed until then, the `fixed64` mode of bench/trl_step_time.py).

The step is bench/trl_step_time.py's, with its settings table (8 prompts x 8 completions, LoRA r 16 on the seven
projections, beta 0.04 against the adapter-disabled base, loss dapo, lr 1e-4, one optimizer step per step),
except: bf16 on both sides (Ballast model.dtype bfloat16; TRL bf16=True on the bf16 model), longer
completions (--max-tokens, default 256), and each framework in its own process, one after the other, so the
peak GPU memory is each one's own. Ballast decodes with its compiled one-token step (rollout.compile_decode:
auto); `ballast-eager` is the same trainer with compile_decode: never; TRL calls `generate` (dynamic cache,
its default). Warm-up steps (the compile falls in them) are excluded from the means.

Columns: seconds per step; completion tokens per second of step; tokens per second of rollout (decoding
alone); MFU = model FLOPs of the step / (step seconds x the GPU's dense bf16 peak), with the same FLOP count
for every framework: 2N per token for generation (prompt and completion), 2N for the reference forward and 4N
for the policy's forward and backward (input gradients only: LoRA's weight gradients are negligible), N =
parameters in matmuls (lm_head included, embedding lookup not); peak GPU memory (torch max allocated).

Before the steps, checks print a line each (--checks): the compiled decode draws the same tokens as the eager
one in fp32 on the GPU (the trained tiny model given by --tiny; the random model with a random LoRA adapter),
and decoding speed alone: `model.generate` token by token, Ballast's eager static-cache loop, its compiled loop.
Each part runs in its own process and prints its result as a JSON line when it ends.

    python bench/gpu_step.py --tiny trainer/assets/tiny-arith
    python bench/gpu_step.py --steps 5 --warmup 2 --max-tokens 256 --frameworks ballast trl
    python bench/gpu_step.py --checks parity-random decode --frameworks ballast trl

Needs trl and datasets beside torch/transformers/peft. A benchmark, not a test: the numbers are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from trl_step_time import BallastRunner, Settings, TRLRunner, sync  # noqa: E402

MODEL_SHAPE = dict(
    hidden_size=1024,
    intermediate_size=4352,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
SMOKE_SHAPE = dict(
    MODEL_SHAPE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)  # --smoke: the whole script on CPU in a minute, to check it runs
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}  # dense, no sparsity
DEFAULT_TOKENIZER = REPO / ".ballast" / "gpu-assets" / "smollm2-tokenizer"
PARITY_ROWS, PARITY_TOKENS = 64, 64


# ── the model ─────────────────────────────────────────────────────────────────────────────────────────


def build_random_llama(path: Path, tokenizer_dir: Path, seed: int, shape: dict, device: str) -> dict:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    params = sum(p.numel() for p in model.parameters())
    matmul = (
        params
        - model.get_input_embeddings().weight.numel()
        - sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    )
    del model
    return {"params": params, "matmul_params": matmul}


def mean_prompt_tokens(model_path: Path, s: Settings) -> float:
    from trainer.data import arith_examples, render_prompt
    from trainer.model import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    return statistics.mean(len(render_prompt(tokenizer, e.prompt)) for e in arith_examples(s.num_prompts, s.seed))


# ── children: one process per measurement ─────────────────────────────────────────────────────────────


def child_parity(model_path: Path, device: str, out: dict) -> None:
    """Compiled vs eager decode in fp32 on the GPU: the same tokens for the same seed."""
    from trainer.config import LoraConfig, ModelConfig
    from trainer.data import arith_examples, render_prompt
    from trainer.engines.base import SamplingParams
    from trainer.engines.hf import HFEngine
    from trainer.model import load_policy

    model, tokenizer = load_policy(
        ModelConfig(name_or_path=str(model_path), device=device, dtype="float32"), LoraConfig(r=16, alpha=32)
    )
    with torch.no_grad():
        gen = torch.Generator(device=device).manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
    prompts = [render_prompt(tokenizer, e.prompt) for e in arith_examples(PARITY_ROWS // 8, seed=0)]
    eager, compiled = HFEngine(model, tokenizer, device, "never"), HFEngine(model, tokenizer, device, "always")
    same = total = 0
    worst = 0.0
    for seed in (1, 2):
        params = SamplingParams(n=8, max_tokens=PARITY_TOKENS, seed=seed)
        a = [c for g in eager.generate(prompts, params) for c in g]
        b = [c for g in compiled.generate(prompts, params) for c in g]
        same += sum(x.token_ids == y.token_ids for x, y in zip(a, b))
        total += len(a)
        worst = max([worst] + [abs(p - q) for x, y in zip(a, b) for p, q in zip(x.logprobs, y.logprobs)])
    out.update(rows_identical=same, rows=total, max_logprob_diff=worst)


def child_decode(model_path: Path, args, out: dict) -> None:
    """Decoding alone, bf16: generate (dynamic cache, what TRL calls), Ballast's eager loop, its compiled loop."""
    from trainer.config import LoraConfig, ModelConfig
    from trainer.data import arith_examples, render_prompt
    from trainer.engines.base import SamplingParams
    from trainer.engines.hf import HFEngine, _eos_ids
    from trainer.model import load_policy

    model, tokenizer = load_policy(
        ModelConfig(name_or_path=str(model_path), device=args.device, dtype="bfloat16"), LoraConfig(r=16, alpha=32)
    )
    prompts = [render_prompt(tokenizer, e.prompt) for e in arith_examples(args.prompts, seed=0)]
    params = SamplingParams(n=args.generations, max_tokens=args.max_tokens, seed=0, min_tokens=args.max_tokens)
    rows = args.prompts * args.generations

    def timed(fn, repeats: int) -> float:
        fn()  # warm-up (and the compile)
        sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync(device)
        return (time.perf_counter() - start) / repeats

    width = max(map(len, prompts))
    ids = torch.full((rows, width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate([p for p in prompts for _ in range(args.generations)]):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    device = torch.device(args.device)
    ids, mask = ids.to(device), mask.to(device)
    model.eval()

    def with_generate():
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=None,
                top_p=1.0,
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=_eos_ids(model, tokenizer),
            )

    seconds = {
        "generate (dynamic cache)": timed(with_generate, 2),
        "ballast eager loop": timed(lambda: HFEngine(model, tokenizer, device, "never").generate(prompts, params), 2),
    }
    compiled = HFEngine(model, tokenizer, device, "always")
    seconds["ballast compiled loop"] = timed(lambda: compiled.generate(prompts, params), 3)
    out.update({name: rows * args.max_tokens / s for name, s in seconds.items()})


def child_steps(framework: str, model_path: Path, args, out: dict) -> None:
    s = Settings(
        prompts_per_step=args.prompts,
        num_generations=args.generations,
        max_tokens=args.max_tokens,
        dtype="bfloat16",
        compile_decode="never" if framework == "ballast-eager" else "auto",
    )
    device, total = torch.device(args.device), args.warmup + args.steps
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ballast-gpu-step-") as tmp:
        if framework.startswith("ballast"):
            runner = BallastRunner(s, model_path, device, "fixed64", total, Path(tmp))
            for _ in range(total):
                runner.run_step()
        else:
            runner = TRLRunner(s, model_path, device, "fixed64", total, Path(tmp))
            runner.run_all()
    records = runner.records
    if len(records) != total:
        raise RuntimeError(f"{framework}: expected {total} steps, got {len(records)}")
    timed = records[args.warmup :]
    out.update(
        warmup_s=[r.seconds for r in records[: args.warmup]],
        seconds=[r.seconds for r in timed],
        tokens=[r.tokens for r in timed],
        rollout_s=[r.parts["rollout"] for r in timed],
        parts={k: statistics.mean(r.parts[k] for r in timed) for k in timed[0].parts},
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"),
        wall_s=time.perf_counter() - started,
    )


def run_child(kind: str, model_path: Path, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = Path(f.name)
    cmd = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--model-dir",
        str(model_path),
        "--result",
        str(result_path),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--max-tokens",
        str(args.max_tokens),
        "--prompts",
        str(args.prompts),
        "--generations",
        str(args.generations),
        "--device",
        args.device,
    ]
    started = time.perf_counter()
    proc = subprocess.run(cmd)
    result = json.loads(result_path.read_text() or "{}") if result_path.exists() else {}
    result_path.unlink(missing_ok=True)
    if proc.returncode != 0:
        result["error"] = f"exit status {proc.returncode}"
    print(
        f"[{kind}: {time.perf_counter() - started:.0f} s] {json.dumps(result)}", flush=True
    )  # kept if a later part dies
    return result


# ── the table ─────────────────────────────────────────────────────────────────────────────────────────


def peak_tflops(name: str, given: float | None) -> float | None:
    if given:
        return given
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def print_tables(args, gpu: str, info: dict, parity: dict, decode: dict, steps: dict) -> None:
    rows = args.prompts * args.generations
    seq = info["prompt_tokens"] + args.max_tokens
    flops = rows * seq * 8 * info["matmul_params"]  # 2N gen + 2N reference + 4N forward/backward, per token
    peak = peak_tflops(gpu, args.peak_tflops)
    print(
        f"\nGPU GRPO step, Ballast vs TRL GRPOTrainer: {gpu}; random Llama {info['params'] / 1e6:.0f}M parameters "
        f"({info['matmul_params'] / 1e6:.0f}M in matmuls), bf16; {args.prompts} prompts x {args.generations} "
        f"completions "
        f"of {args.max_tokens} tokens (prompts {info['prompt_tokens']:.0f} tokens on average); LoRA r 16; "
        f"{args.warmup} warm-up + {args.steps} timed steps each; {flops / 1e12:.1f} TFLOP per step; "
        f"peak {peak or '?'} TFLOP/s"
    )
    print(f"torch {torch.__version__}, {info['versions']}")
    for name, p in parity.items():
        if "error" in p:
            print(f"compiled vs eager decode, fp32, {name}: FAILED ({p['error']})")
        else:
            print(
                f"compiled vs eager decode, fp32, {name} model: {p['rows_identical']}/{p['rows']} completions "
                f"token for token identical; max logprob difference {p['max_logprob_diff']:.1e}"
            )
    if decode and "error" not in decode:
        base = decode["generate (dynamic cache)"]
        print(
            "decoding alone, bf16, tokens/s: " + "; ".join(f"{k} {v:,.0f} (x{v / base:.1f})" for k, v in decode.items())
        )
    header = (
        f"{'framework':<14} {'s/step mean':>11} {'median':>8} {'tokens/s':>9} {'rollout tok/s':>13} "
        f"{'MFU':>6} {'peak GiB':>9} {'warm-up s':>16} {'rollout s':>9} {'update s':>8} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    trl_mean = statistics.mean(steps["trl"]["seconds"]) if "seconds" in steps.get("trl", {}) else None
    for name, r in steps.items():
        if "seconds" not in r:
            print(f"{name:<14} FAILED ({r.get('error', 'no result')})")
            continue
        mean = statistics.mean(r["seconds"])
        mfu = f"{flops / mean / (peak * 1e12):.1%}" if peak else "-"
        ratio = f"{mean / trl_mean:.2f}" if trl_mean else "-"
        warm = "/".join(f"{x:.1f}" for x in r["warmup_s"])
        print(
            f"{name:<14} {mean:>11.3f} {statistics.median(r['seconds']):>8.3f} "
            f"{sum(r['tokens']) / sum(r['seconds']):>9,.0f} {sum(r['tokens']) / sum(r['rollout_s']):>13,.0f} "
            f"{mfu:>6} {r['peak_gib']:>9.1f} {warm:>16} {r['parts']['rollout']:>9.3f} {r['parts']['update']:>8.3f} "
            f"{ratio:>6}"
        )
    if trl_mean and "seconds" in steps.get("ballast", {}):
        ratio = statistics.mean(steps["ballast"]["seconds"]) / trl_mean
        print(
            f"Ballast/TRL step time {ratio:.2f} (speed-up x{1 / ratio:.2f}); target <= 0.50: "
            f"{'MET' if ratio <= 0.5 else 'NOT MET'}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--tokenizer", default=str(DEFAULT_TOKENIZER), help="a tokenizer directory (saved with save_pretrained)"
    )
    ap.add_argument("--tiny", help="also check compiled-vs-eager parity on this tiny-arith model directory")
    ap.add_argument(
        "--frameworks",
        nargs="+",
        default=["ballast", "trl", "ballast-eager"],
        choices=["ballast", "ballast-eager", "trl"],
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: by device name)")
    ap.add_argument(
        "--checks",
        nargs="*",
        default=["parity-tiny"],
        choices=["parity-tiny", "parity-random", "decode"],
        help="the lines before the table: compiled-vs-eager parity on the tiny model (needs --tiny) and on "
        "the random one, decoding speed alone (each a child process: 40 s, 77 s, 189 s on an H100)",
    )
    ap.add_argument("--smoke", action="store_true", help="a 2-layer model on CPU: checks that the script runs")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("trl").setLevel(logging.ERROR)

    if args.child:
        out: dict = {}
        try:
            model_path = Path(args.model_dir)
            if args.child.startswith("parity:"):
                child_parity(Path(args.child.split(":", 1)[1]), args.device, out)
            elif args.child == "decode":
                child_decode(model_path, args, out)
            else:
                child_steps(args.child, model_path, args, out)
        finally:
            Path(args.result).write_text(json.dumps(out))
        return

    if args.smoke:
        args.device = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("bench/gpu_step.py needs a CUDA GPU; on CPU run bench/trl_step_time.py")
    if not (Path(args.tokenizer) / "tokenizer.json").is_file():
        raise SystemExit(
            f"--tokenizer {args.tokenizer}: no tokenizer.json there; save a tokenizer with save_pretrained "
            "(see bench/README.md for the one the figures used)"
        )
    import peft

    try:
        import trl

        trl_version = trl.__version__
    except ImportError as e:  # the Ballast rows still run; the TRL row then fails with this reason
        trl_version = f"not importable ({e})"

    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (smoke run)"
    with tempfile.TemporaryDirectory(prefix="ballast-gpu-model-") as tmp:
        model_path = Path(tmp) / "random-llama"
        info = build_random_llama(
            model_path, Path(args.tokenizer), args.seed, SMOKE_SHAPE if args.smoke else MODEL_SHAPE, args.device
        )
        info["prompt_tokens"] = mean_prompt_tokens(model_path, Settings())
        info["versions"] = f"transformers {transformers.__version__}, peft {peft.__version__}, trl {trl_version}"
        parity, decode = {}, {}
        if "parity-tiny" in args.checks and args.tiny:
            parity["tiny-arith"] = run_child(f"parity:{Path(args.tiny).absolute()}", model_path, args)
        if "parity-random" in args.checks:
            parity["random Llama"] = run_child(f"parity:{model_path}", model_path, args)
        if "decode" in args.checks:
            decode = run_child("decode", model_path, args)
        steps = {name: run_child(name, model_path, args) for name in args.frameworks}
    print_tables(args, gpu, info, parity, decode, steps)


if __name__ == "__main__":
    main()
