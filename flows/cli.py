"""The `ballast` command.

  ballast quickstart                       the whole pipeline on examples/quickstart.yaml, nothing to configure
  ballast run SPEC [--set K=V]... [--resume RUN_ID]   the pipeline: fork → train → checkpoint → probe → eval
  ballast train SPEC [--set K=V]... [--output DIR] [--steps N] [--resume]   the trainer alone
  ballast probe CHECKPOINT [...]           reload a saved artifact and probe it for malformed output
  ballast compare A B                      malformed rates of two probe reports / checkpoints / runs, Fisher's exact test
  ballast regress SPEC --ref A --ref B     the same experiment on two code refs, probed and compared
  ballast sweep FILE [--trials N] [--workers K] [--storage URL]   an Optuna sweep of pipeline runs
  ballast sweep-worker --study NAME --storage URL               join a sweep from another machine
  ballast vllm-env [--path DIR] [--gpu|--cpu]   create the separate vLLM environment
  ballast launch SPEC [--dryrun]           the pipeline on a GPU node provisioned with SkyPilot
  ballast ui                               the MLflow and Prefect UIs on the embedded stores
  ballast metrics                          every metric name and its meaning

Errors in what the user gave (a spec field, a missing file, a corrupt checkpoint) print one line
naming the input and the fix and exit non-zero (2 for a bad spec); nothing already saved is touched.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


class UserError(Exception):
    """An error in what the user gave; printed as one line, exit status `code`."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------------------------------ train

def cmd_train(args) -> int:
    from tasks.spec import dump_spec, load_spec
    from trainer.loop import GRPOTrainer

    spec = load_spec(args.spec, args.set)
    if args.steps:
        spec.optim.steps = args.steps
    out = Path(args.output or Path(spec.project_dir) / "runs" / spec.name)
    if not args.resume and (out / "checkpoints").exists() and any((out / "checkpoints").glob("step-*")):
        raise UserError(f"{out} already holds checkpoints; pass --resume to continue that run, or --output a new directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.yaml").write_text(dump_spec(spec))
    trainer = GRPOTrainer(spec.trainer_config(), out, progress=not args.quiet)
    try:
        if args.resume:
            path = trainer.resume()
            print(f"resumed from {path}" if path else f"no checkpoint in {out}/checkpoints; starting at step 1")
        result = trainer.train(spec.optim.steps)
    finally:
        trainer.close()
    print(f"{'stopped: ' + result.stopped if result.stopped else 'done'} at step {result.last_step}; "
          f"metrics: {out / 'metrics.jsonl'}; last checkpoint: {result.last_checkpoint}")
    return 3 if result.stopped else 0


def cmd_metrics(args) -> int:
    from trainer.metrics import METRICS
    width = max(map(len, METRICS))
    for name, meaning in METRICS.items():
        print(f"{name:<{width}}  {meaning}")
    return 0


def cmd_spec_schema(args) -> int:
    from tasks.spec import ExperimentSpec
    print(json.dumps(ExperimentSpec.model_json_schema(), indent=1))
    return 0


# ------------------------------------------------------------------------------------------ parser

COMMANDS: dict[str, tuple] = {}


def command(name: str, help: str):
    def wrap(build):
        COMMANDS[name] = (build, help)
        return build
    return wrap


def _spec_args(p) -> None:
    p.add_argument("spec", help="experiment YAML (see examples/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field, e.g. grpo.beta=0.1")


@command("train", "run the GRPO trainer alone")
def _p_train(p):
    _spec_args(p)
    p.add_argument("--output", help="run directory (default <project_dir>/runs/<name>)")
    p.add_argument("--steps", type=int, help="total steps (overrides optim.steps; counts steps already done)")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --output")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return cmd_train


@command("metrics", "list every metric name and its meaning")
def _p_metrics(p):
    return cmd_metrics


@command("spec-schema", "print the experiment spec's JSON schema")
def _p_schema(p):
    return cmd_spec_schema


def build_parser() -> argparse.ArgumentParser:
    _register_optional_commands()
    parser = argparse.ArgumentParser(prog="ballast", description="GRPO fine-tuning experiments you can trust.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (build, help) in COMMANDS.items():
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=build(p))
    return parser


def _register_optional_commands() -> None:
    """Commands defined next to the flows they run register themselves on import."""
    import importlib
    for module in ("flows.pipeline", "flows.regression", "flows.sweep", "flows.probe_cli", "flows.vllm_env", "flows.launch"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise


LIGHT_COMMANDS = {"metrics", "spec-schema", "launch", "vllm-env", "ui"}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # ours are the rich bars; theirs clutter stderr
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    import logging
    for noisy in ("mlflow", "alembic", "httpx", "botocore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    from tasks.spec import SpecError
    if args.command not in LIGHT_COMMANDS:  # these never load a model: no need to import transformers (~2 s)
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    try:
        return args.func(args) or 0
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # CheckpointError is a ValueError
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; saved checkpoints are kept — continue with --resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # `python -m flows.cli` runs this file as __main__; commands register on the importable module
    from flows.cli import main as _main
    sys.exit(_main())
