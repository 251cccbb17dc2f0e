"""Build the tiny model shipped in trainer/assets/tiny-arith/ — run once, when trainer/tiny.py's recipe changes.

The build (trainer/tiny.py: a byte-level tokenizer, a 0.5M-parameter Llama, a seeded supervised warm-up on
additions) gives the same bytes for a seed on the same torch build and thread count, but not across CPUs: the
warm-up's float sums round differently on other kernels. So the model is built here once and shipped as files
(~2 MB: model.safetensors, the tokenizer's files, ballast_build.json), and the tests and the quickstart load those
same bits on every machine. A test (tests/test_model.py) checks that the shipped model was built by today's
recipe.

    python scripts/build_tiny_model.py            # rebuild trainer/assets/tiny-arith/ (~1-2 min on 2 cores)
    python scripts/build_tiny_model.py OUT_DIR    # build elsewhere, e.g. to compare with the shipped one
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainer.tiny import BUILD_RECORD, SHIPPED, build_tiny_arith  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print("usage: python scripts/build_tiny_model.py [OUT_DIR]  (default: trainer/assets/tiny-arith)")
        return 2
    target = Path(argv[0]).absolute() if argv else SHIPPED
    with tempfile.TemporaryDirectory(dir=target.parent if target.parent.exists() else None) as tmp:
        built = build_tiny_arith(Path(tmp) / "model")
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(str(built), target)
    for file in target.iterdir():
        file.chmod(0o644)  # safetensors writes 0600; shipped files are readable by all
    print(json.dumps(json.loads((target / BUILD_RECORD).read_text()), indent=2))
    print(f"built {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
