"""Padded vs packed training forward (grpo.pack_sequences): seconds for the forward + backward of a GRPO batch's
completion logprobs, side by side in one run, on batches whose lengths vary as a GRPO batch's do.

Each batch: `--prompts` chat-rendered arithmetic prompts x `--generations` completions whose lengths are drawn
uniformly from [--min-tokens, --max-tokens] (what sampling at temperature 1 gives a model that sometimes stops
early), random completion tokens; left-padded prompts + right-padded completions as the trainer builds them.
The same batch goes through `completion_logprobs` padded and packed (with entropy, as the first pass of a step),
then a backward of the masked sum; the LoRA adapter (r 16, all linear layers) gets the gradients. Rows: positions
through the model (rows x width), seconds per forward + backward (median of --repeats after one warm-up), peak
GPU memory on a GPU, and the largest logprob difference between the two.

    python bench/packing.py --model trainer/assets/tiny-arith
    python bench/packing.py --model /path/to/smollm2 --max-tokens 256 --threads 2
    python bench/packing.py --model random-llama --dtype bfloat16 --min-tokens 32 --max-tokens 256   # a GPU

`--model random-llama` builds bench/gpu_step.py's random 0.5B Llama (seed 0) in a temporary directory.

A benchmark, not a test: wall-clock on whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from trainer.config import LoraConfig, ModelConfig  # noqa: E402
from trainer.data import arith_examples, render_prompt  # noqa: E402
from trainer.logprobs import completion_logprobs  # noqa: E402
from trainer.model import load_policy  # noqa: E402
from trainer.packing import pack  # noqa: E402


def batch(tokenizer, vocab: int, args) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed)
    prompts = [render_prompt(tokenizer, e.prompt) for e in arith_examples(args.prompts, seed=args.seed)]
    rows = [p for p in prompts for _ in range(args.generations)]
    lengths = torch.randint(args.min_tokens, args.max_tokens + 1, (len(rows),), generator=g).tolist()
    Lp, Tc = max(map(len, rows)), max(lengths)
    ids = torch.zeros(len(rows), Lp + Tc, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, t) in enumerate(zip(rows, lengths)):
        ids[i, Lp - len(p) : Lp] = torch.tensor(p)
        ids[i, Lp : Lp + t] = torch.randint(0, vocab, (t,), generator=g)
        mask[i, Lp - len(p) : Lp + t] = 1
    return ids, mask, Tc, mask[:, Lp:].bool()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model directory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model == "random-llama":
        sys.path.insert(0, str(REPO / "bench"))
        from gpu_step import DEFAULT_TOKENIZER, MODEL_SHAPE, build_random_llama

        tmp = tempfile.TemporaryDirectory(prefix="ballast-bench-packing-")
        args.model = str(Path(tmp.name) / "random-llama")
        build_random_llama(Path(args.model), DEFAULT_TOKENIZER, 0, MODEL_SHAPE, args.device)
    model, tokenizer = load_policy(
        ModelConfig(name_or_path=args.model, device=args.device, dtype=args.dtype),
        LoraConfig(r=16, alpha=32, target_modules="all-linear"),
    )
    device = torch.device(args.device)
    ids, mask, Tc, completion_mask = batch(tokenizer, model.config.vocab_size, args)
    ids, mask, completion_mask = ids.to(device), mask.to(device), completion_mask.to(device)
    plan = pack(ids, mask, Tc)

    def step(packed: bool) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        lp, ent = completion_logprobs(model, ids, mask, Tc, with_entropy=True, packed=packed)
        ((lp + 0.01 * ent) * completion_mask).sum().backward()
        return lp.detach()

    results = {}
    for name, packed in (("padded", False), ("packed", True)):
        step(packed)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            lp = step(packed)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        results[name] = (statistics.median(seconds), peak, lp)

    real = int(mask.sum())
    print(
        f"\nPadded vs packed training forward + backward: {Path(args.model).name}, {args.device}, "
        f"{next(model.parameters()).dtype}, {ids.shape[0]} rows ({args.prompts} prompts x {args.generations}), "
        f"completions of {args.min_tokens}-{args.max_tokens} tokens, {real} real tokens; median of {args.repeats}"
    )
    header = f"{'forward':<8} {'rows x width':>13} {'positions':>10} {'real share':>10} {'s':>8} {'peak GiB':>9}"
    print(header)
    print("-" * len(header))
    shapes = {"padded": tuple(ids.shape), "packed": tuple(plan.input_ids.shape)}
    for name, (s, peak, _) in results.items():
        rows, width = shapes[name]
        print(
            f"{name:<8} {f'{rows} x {width}':>13} {rows * width:>10,} {real / (rows * width):>10.0%} {s:>8.3f} "
            f"{'-' if peak is None else f'{peak:.2f}':>9}"
        )
    diff = float((results["padded"][2] - results["packed"][2])[completion_mask].abs().max())
    print(
        f"packed / padded time {results['packed'][0] / results['padded'][0]:.2f}; largest logprob difference {diff:.1e}"
    )


if __name__ == "__main__":
    main()
