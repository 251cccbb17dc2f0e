"""Decode ms per token step through peft against the merged copy of the layers (rollout.merged_decode,
trainer/engines/merged.py), side by side in one run: the same engine code, the same prompts and seeds, only the
forward differs. Also the matmuls a token step launches (from the model's structure) and whether both draw the same
tokens.

Each row is a fresh HFEngine over one policy (LoRA r 16 on every linear layer, lora_B perturbed as after training),
one untimed call first (a compile with --compile), then the best of --repeats calls of --rows rows x --tokens tokens
(eos suppressed, so every call decodes every token), prefill included.

    python bench/merged_decode.py                                   # the tiny model, CPU, eager
    python bench/merged_decode.py --model smollm2 --rows 16         # SmolLM2-135M (converted on first use)
    python bench/merged_decode.py --device cuda --compile --rows 64 --tokens 256 --dtype bfloat16 --model PATH

A benchmark, not a test: wall-clock on whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def model_path(name: str) -> Path:
    if name == "tiny":
        from trainer.tiny import SHIPPED

        return SHIPPED
    if name == "smollm2":
        from tests.real_model_fixtures import smollm2_model_path

        return smollm2_model_path()
    return Path(name)


def policy(path: Path, device: str, dtype: str):
    import torch

    from trainer.config import LoraConfig, ModelConfig
    from trainer.model import load_policy

    model, tokenizer = load_policy(
        ModelConfig(name_or_path=str(path), device=device, dtype=dtype), LoraConfig(r=16, alpha=32)
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=generator) * 0.02).to(p))
    return model.eval(), tokenizer


def matmuls_per_step(model, merged: bool) -> int:
    """Matmuls one token step launches: per layer 4 merged (qkv, o, gate-up, down) or, through peft, three per
    adapted linear (base, A, B) and one per plain one; plus the head."""
    import torch
    from peft.tuners.lora import LoraLayer

    from trainer.engines.merged import _inner

    layers = _inner(model).layers
    if merged:
        return 4 * len(layers) + 1
    count = 1
    for name, m in layers.named_modules():
        if isinstance(m, LoraLayer):
            count += 3
        elif isinstance(m, torch.nn.Linear) and "base_layer" not in name and "lora_" not in name:
            count += 1
    return count


def measure(model, tokenizer, args, merged: str) -> dict:
    import torch

    from trainer.data import arith_examples, render_prompt
    from trainer.engines.base import SamplingParams
    from trainer.engines.hf import HFEngine

    n = 8 if args.rows >= 8 else args.rows
    prompts = [render_prompt(tokenizer, e.prompt) for e in arith_examples(args.rows // n, seed=1)]
    params = SamplingParams(
        n=n, max_tokens=args.tokens, min_tokens=args.tokens, seed=0, seeds=list(range(len(prompts)))
    )
    engine = HFEngine(
        model, tokenizer, args.device, compile_decode="always" if args.compile else "never", merged_decode=merged
    )

    def call():
        out = engine.generate(prompts, params)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return out

    started = time.perf_counter()
    first = call()
    first_s = time.perf_counter() - started
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return {
        "ms": 1000 * min(times) / args.tokens,
        "first_s": first_s,
        "tokens": [c.token_ids for g in first for c in g],
        "merged": engine.merged is not None,
        "why": engine.merged_why,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, smollm2 or a model directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="compile the decode step (CUDA graphs on a GPU)")
    args = ap.parse_args()
    import torch

    model, tokenizer = policy(model_path(args.model), args.device, args.dtype)
    results = {mode: measure(model, tokenizer, args, mode) for mode in ("never", "always")}
    peft, merged = results["never"], results["always"]
    if not merged["merged"]:
        sys.exit(f"the merged decode did not run: {merged['why']}")
    same = sum(a == b for a, b in zip(peft["tokens"], merged["tokens"]))
    print(
        f"{args.model} on {args.device} ({args.dtype}, torch threads {torch.get_num_threads()}), {args.rows} rows x "
        f"{args.tokens} tokens, {'compiled' if args.compile else 'eager'} decode, best of {args.repeats}\n"
    )
    print("| forward | matmuls a token step | ms per token step | first call s | rows with the same tokens |")
    print("|---|---|---|---|---|")
    for name, r, is_merged in (("peft", peft, False), ("merged", merged, True)):
        print(
            f"| {name} | {matmuls_per_step(model, is_merged)} | {r['ms']:.2f} | {r['first_s']:.1f} | "
            f"{same} of {len(peft['tokens'])} |"
        )
    print(f"\nmerged / peft: x{merged['ms'] / peft['ms']:.2f} the time per token step")


if __name__ == "__main__":
    main()
