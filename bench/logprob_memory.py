"""Peak memory of per-token logprobs: the naive full-vocabulary fp32 log-softmax vs the chunked one.

    naive:    log_softmax((hidden @ W.T).float(), -1).gather(labels)      # B*T x V fp32, twice
    chunked:  trainer.logprobs.logprobs_from_hidden(hidden, W, labels)    # chunk_size x V fp32 at a time

Forward only (no autograd), at a Llama-3-sized vocabulary (128256) and hidden size 512, for a few
batch sizes and hidden dtypes. Each variant runs in a fresh child process so one cannot inherit the
other's allocator state. Peak is measured as:
  - CUDA available: torch.cuda.max_memory_allocated() minus the memory held before the call;
  - CPU: the child's peak RSS (getrusage ru_maxrss) minus its peak before the call (tracemalloc does
    not see torch's allocations). Inputs are created and a small warm-up call made before the baseline.
The parent also compares the two results (max abs difference of the logprobs).

    python bench/logprob_memory.py                      # the default table, bf16 (~1.5 min on 2 CPU cores)
    python bench/logprob_memory.py --tokens 2048 --dtypes float32 --chunk-size 512
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from trainer.logprobs import logprobs_from_hidden  # noqa: E402

VOCAB = 128256
HIDDEN = 512
BATCH = 8


def naive_logprobs(hidden, weight, labels):
    logits = hidden @ weight.T
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def chunked_logprobs(hidden, weight, labels, chunk_size):
    return logprobs_from_hidden(hidden, weight, labels, chunk_size=chunk_size)[0]


# ---------------------------------------------------------------------------------------------------
# child: one variant, one measurement


def _peak_mib_so_far(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_child(method: str, tokens: int, dtype_name: str, chunk_size: int, out_path: str) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator(device=device).manual_seed(0)
    seq_len = tokens // BATCH
    hidden = torch.randn(BATCH, seq_len, HIDDEN, generator=generator, device=device, dtype=dtype)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, device=device, dtype=dtype) * HIDDEN**-0.5
    labels = torch.randint(0, VOCAB, (BATCH, seq_len), generator=generator, device=device)

    def call(h, lab):
        if method == "naive":
            return naive_logprobs(h, weight, lab)
        return chunked_logprobs(h, weight, lab, chunk_size)

    with torch.no_grad():
        call(hidden[:1, :2], labels[:1, :2])  # warm-up: thread pools, kernels
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated() / 2**20 if device == "cuda" else _peak_mib_so_far(device)
        start = time.perf_counter()
        result = call(hidden, labels)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = _peak_mib_so_far(device) - baseline
    torch.save(result.cpu(), out_path)
    print(json.dumps({"peak_mib": peak, "seconds": seconds, "device": device}))


# ---------------------------------------------------------------------------------------------------
# parent: the table


def measure(method: str, tokens: int, dtype_name: str, chunk_size: int, out_path: str) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            method,
            "--tokens",
            str(tokens),
            "--dtypes",
            dtype_name,
            "--chunk-size",
            str(chunk_size),
            "--out",
            out_path,
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{method} tokens={tokens} {dtype_name} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8 * 256, 8 * 1024], help="B*T (B = 8)")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["bfloat16"],
        help="hidden/weight dtype; adding float32 costs ~2 more minutes on 2 CPU cores",
    )
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--child", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args.child, args.tokens[0], args.dtypes[0], args.chunk_size, args.out)
        return

    device = "cuda (max_memory_allocated)" if torch.cuda.is_available() else "cpu (peak RSS delta)"
    print(
        f"logprob memory: vocab {VOCAB}, hidden {HIDDEN}, batch {BATCH}, chunk_size {args.chunk_size}, "
        f"forward only, {device}"
    )
    header = (
        f"{'tokens':>7} {'vocab':>7} {'dtype':>9} {'naive peak MiB':>15} {'chunked peak MiB':>17} "
        f"{'ratio':>6} {'max abs diff':>13} {'naive s':>8} {'chunked s':>10}"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for dtype_name in args.dtypes:
            for tokens in args.tokens:
                paths = {m: os.path.join(tmp, f"{m}-{tokens}-{dtype_name}.pt") for m in ("naive", "chunked")}
                naive = measure("naive", tokens, dtype_name, args.chunk_size, paths["naive"])
                chunked = measure("chunked", tokens, dtype_name, args.chunk_size, paths["chunked"])
                diff = (torch.load(paths["naive"]) - torch.load(paths["chunked"])).abs().max().item()
                ratio = naive["peak_mib"] / max(chunked["peak_mib"], 1e-9)
                print(
                    f"{tokens:>7} {VOCAB:>7} {dtype_name:>9} {naive['peak_mib']:>15.0f} "
                    f"{chunked['peak_mib']:>17.0f} {ratio:>6.1f} {diff:>13.2e} {naive['seconds']:>8.2f} "
                    f"{chunked['seconds']:>10.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
