"""What each `ballast` subcommand does (the parser is flows/cli.py). Part of the CLI, so imports are lazy: a
command imports what it needs when it runs, and a bad spec is refused before torch, transformers or Prefect load.
Each command validates its input, calls a flow or a stage, and prints what the user needs next."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from flows.errors import UserError

if TYPE_CHECKING:  # for annotations only: a command imports what it needs when it runs
    from tasks.spec import ExperimentSpec

REPO = Path(__file__).resolve().parent.parent


# ── the pipeline ───────────────────────────────────────────────────────────────────────────────────


def cmd_run(args) -> int:
    from tasks.spec import check_runnable, load_spec

    if args.resume:
        if args.dryrun:
            raise UserError(
                f"--dryrun checks a SPEC before a new run; run {args.resume} was checked when it started (resume it "
                f"with `ballast run --resume {args.resume}`)"
            )
        if args.set:
            raise UserError(
                f"--set cannot change run {args.resume} on --resume (it runs its own spec.yaml); resume it "
                f"as it is, or start a new run from it with --set fork.run_id={args.resume}"
            )
        args.resume, spec_path = _spec_file_of_run(args.resume, args.spec, args.project_dir)
        spec, overrides = str(spec_path), []
        resumed = load_spec(spec_path)
        _refuse_changed_resume(args, resumed)  # a changed spec or a corrupt checkpoint is refused even after the end
        _check_resume(resumed, spec_path.parent)
        finished = _finished(resumed, args.resume)
        if finished:
            print(finished)
            return 0
        _hold_run(spec_path.parent, f"`ballast run --resume {args.resume}`")  # not while it runs or syncs elsewhere
        check_runnable(resumed)
        project_dir = resumed.project_dir
    elif args.spec:
        checked = load_spec(args.spec, args.set)  # a bad spec fails here, in about a second
        _check_new_run(checked)  # the model, the device, the extras, the placement: one line, before Prefect
        if args.dryrun and checked.infra.compute == "skypilot":
            return _dryrun_compute(checked)
        _check_fork(checked)
        if args.dryrun:
            return _validated(checked, args.spec)
        project_dir, spec, overrides = checked.project_dir, str(Path(args.spec).resolve()), args.set
    else:
        raise UserError("give an experiment SPEC to run, or --resume RUN_ID to continue a run")
    return _run_pipeline(project_dir, spec, overrides, args.resume)


def _check_new_run(spec: ExperimentSpec) -> None:
    """What a new run is refused for before anything starts, after its spec (`ballast run`, `validate`): the model is
    here (or buildable), the device exists, the optional packages its features need are installed, and the placement
    is one the ranks or the node can use."""
    from tasks.spec import check_runnable

    check_runnable(spec)
    if spec.infra.compute != "here" or spec.infra.nproc_per_node * spec.infra.num_nodes > 1:
        _check_compute(spec)


def _check_compute(spec) -> None:
    """A placement the node could not use (infra.compute: skypilot with embedded stores, a refused accelerator
    string, spot without s3://): one line, exit 2, before anything is provisioned."""
    from infra.compute import ComputeError
    from tasks.remote import check_compute

    try:
        check_compute(spec)
    except ComputeError as e:
        raise UserError(str(e)) from None


def _dryrun_compute(spec) -> int:
    """`ballast run SPEC --dryrun`: the SkyPilot task of the run's stage node, validated by SkyPilot; nothing runs."""
    from infra.compute import ComputeError
    from tasks.remote import plan_skypilot
    from tasks.spec import tracking_uri

    if spec.infra.compute != "skypilot":
        raise UserError(
            f"--dryrun shows the SkyPilot task of a remote run; this spec has infra.compute: {spec.infra.compute} "
            "(set infra.compute: skypilot)"
        )
    try:
        plan = plan_skypilot(spec, tracking_uri(spec), "RUN_ID", Path(spec.project_dir) / "launch")
    except ComputeError as e:
        raise UserError(str(e)) from None
    kind = "managed job (spot, recovered by SkyPilot)" if plan.managed else "cluster (autodown after idle)"
    print(f"# {plan.name}: SkyPilot {kind}; RUN_ID is the MLflow run the flow opens. Accepted by SkyPilot's schema.")
    if plan.secret_names:
        print(f"# secrets, read from this environment at launch: {', '.join(plan.secret_names)}")
    print(plan.yaml(), end="")
    return 0


def _refuse_changed_resume(args, resumed: ExperimentSpec) -> None:
    """A resume runs the spec the run started with; a SPEC that differs from it is refused."""
    from tasks.spec import load_spec, spec_hash

    if args.spec and spec_hash(given := load_spec(args.spec)) != spec_hash(resumed):
        field = _first_difference(given.model_dump(mode="json"), resumed.model_dump(mode="json"))
        raise UserError(
            f"{args.spec} differs from the spec run {args.resume} started with ({field}); resume it with "
            f"`ballast run --resume {args.resume}`, or start a new run with fork.run_id: {args.resume}"
        )


def _first_difference(a, b, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = _first_difference(a.get(key), b.get(key), f"{prefix}{key}.")
            if found:
                return found
        return ""
    return "" if a == b else f"{prefix.rstrip('.')}: {b!r} in the run, {a!r} here"


def _check_resume(spec: ExperimentSpec, output_dir: Path) -> None:
    """The checkpoint the resume starts from is verified before Prefect or a model starts (CheckpointError: exit 2)."""
    from tasks.checkpoint import check_resumable

    check_resumable(spec, output_dir)


def _check_fork(spec: ExperimentSpec) -> None:
    """A fork source that does not exist is refused with one line, before Prefect starts (its verification, which
    loads the model, runs in the flow's fork stage)."""
    if spec.fork.run_id is None and spec.fork.checkpoint is None:
        return
    from tasks.spec import tracks_nothing_yet

    _check_local_fork_checkpoint(spec)
    if spec.fork.run_id and tracks_nothing_yet(spec):
        raise UserError(
            f"fork source fork.run_id={spec.fork.run_id}: project_dir {spec.project_dir} has no MLflow store "
            "(mlflow.db) yet, so no run to fork; set project_dir to the project the run was tracked in, or "
            "tracking.uri to its store"
        )
    from tasks.fork import ForkError, resolve_fork

    try:
        if spec.fork.run_id:  # a run's checkpoints are found through the tracking store
            from tasks.tracking import Tracking

            resolve_fork(spec, Tracking(spec).checkpoint_prefix)
        else:  # a checkpoint is found where it is: no tracking store opened (it made the project's mlflow.db)
            resolve_fork(spec, None)
    except ForkError:
        raise
    except (ValueError, FileNotFoundError) as e:  # the run id is not in the tracking store, the path is not there
        given = f"fork.run_id={spec.fork.run_id}" if spec.fork.run_id else f"fork.checkpoint={spec.fork.checkpoint}"
        raise UserError(f"fork source {given}: {e}") from None


def _check_local_fork_checkpoint(spec: ExperimentSpec) -> None:
    """A fork.checkpoint on this machine that is not there: one line at once, before torch or MLflow load."""
    given = spec.fork.checkpoint
    if given is not None and "://" not in str(given) and not Path(given).is_dir():
        raise UserError(
            f"fork source fork.checkpoint={given}: no such directory; give a checkpoint step directory "
            "(runs/RUN/checkpoints/step-NNNNNN) or an s3:// URI"
        )


def cmd_validate(args) -> int:
    """`ballast validate SPEC`: what `ballast run` would refuse before it starts — the spec, its data, its rewards
    (each user function called once on placeholder completions), the model's source and the device — refused the
    same way (one line, exit 2) in seconds, without torch; on success, what the run would do (exit 0). A fork
    source is checked too, which imports torch and reads the tracking store, and so is a placement on ranks or a
    node (tasks/remote.py's checks, without torch)."""
    from tasks.spec import load_spec

    if _is_sweep_file(args.spec):
        return _validate_sweep(args.spec, args.set)
    spec = load_spec(args.spec, args.set)
    _check_new_run(spec)
    _check_fork(spec)
    return _validated(spec, args.spec)


def _is_sweep_file(path: str) -> bool:
    """A YAML mapping with a `space:` and no `model:`: a sweep file (examples/sweep.yaml), not an experiment."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False  # load_spec says what is wrong with it
    return isinstance(data, dict) and "space" in data and "model" not in data


def _validate_sweep(path: str, sets: list[str]) -> int:
    """`ballast validate SWEEP.yaml`: what `ballast sweep` would refuse before its first trial — the sweep file, its
    space against the spec, and its base spec (with overrides and --set) as `ballast run` would check it."""
    import yaml

    from sweeps.space import load_sweep, trial_spec
    from tasks.spec import describe_run

    if "pbt" in (yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}):
        return _validate_population(path, sets)
    sweep = load_sweep(path, sets)
    spec = trial_spec(sweep, {})
    _check_new_run(spec)
    _check_fork(spec)
    resumes = _check_stored_study(sweep)  # an existing study the file no longer matches: refused, as the run would
    space = ", ".join(f"{k}{' (log)' if p.log else ''}" for k, p in sweep.space.items())
    objectives = ", ".join(f"{o.direction} {o.metric}" for o in sweep.objectives)
    print(f"{path}: valid sweep — the sweep file, its space and its base spec checked; nothing was run")
    print(f"  study     {sweep.study}: {sweep.trials} trials, {objectives}, against the base model's score")
    print(f"  space     {space}")
    if resumes:
        print(f"  resumes   {resumes}")
    for line in describe_run(spec):
        print(f"  {line}")
    return 0


def _validate_population(path: str, sets: list[str]) -> int:
    """`ballast validate POPULATION.yaml`: what `ballast pbt` would refuse before its first step."""
    from sweeps.population import load_population
    from tasks.spec import describe_run

    pop = load_population(path, sets)
    spec = pop.spec()
    _check_new_run(spec)  # the model is here, the device exists, as `ballast pbt` refuses
    _check_fork(spec)
    p = pop.pbt
    print(f"{path}: valid population — the file, its space, its pbt section and its base spec checked; nothing was run")
    print(
        f"  population {pop.name}: {p.population} members, ranked every {p.ready} steps on {pop.objective}; bottom "
        f"{p.quantile:g} copies the top, knobs x{' or x'.join(f'{f:g}' for f in p.perturb)} or resampled "
        f"(p {p.resample_probability:g})"
    )
    print(f"  split      {pop.split().describe()}")
    for line in describe_run(spec):
        print(f"  {line}")
    return 0


def _check_stored_study(sweep) -> str | None:
    """The study `ballast sweep` would resume, if it exists: its stored definition must match the file (what
    open_study refuses at start). The line saying which study it resumes, or None for a new one."""
    from sweeps.stored import check_definition, storage_url, stored_definition

    url = storage_url(sweep)
    try:
        stored = stored_definition(sweep, url)
    except Exception as e:  # a storage that is down is the run's to refuse; validate says it could not look
        print(f"warning: could not read the study storage ({type(e).__name__}); a resumed study "
              "is checked when the sweep starts")  # fmt: skip
        return None
    if stored is None:
        return None
    check_definition(sweep, stored)
    where = url.split("@")[-1] if "@" in url else url  # no user name, no password
    return f"study {sweep.study_name} in {where}: the file matches the definition it was created with"


def _validated(spec: ExperimentSpec, path: str) -> int:
    """The few lines that say what a checked spec will run (validate, run --dryrun)."""
    from tasks.spec import describe_run

    print(f"{path}: valid — spec, data, rewards, model and device checked; nothing was run")
    for line in describe_run(spec):
        print(f"  {line}")
    return 0


def cmd_quickstart(args) -> int:
    from flows import runtime
    from tasks.spec import load_spec
    from tasks.train import ensure_base_model

    path = REPO / "examples" / "quickstart.yaml"
    spec = load_spec(path, args.set)
    runtime.prestart(spec.project_dir)
    ensure_base_model(spec)  # the first run copies the shipped tiny model while Prefect's server starts
    return _run_pipeline(spec.project_dir, str(path), args.set, None)


def _run_pipeline(project_dir: str, spec: str, overrides: list[str], resume_run_id: str | None) -> int:
    from flows import runtime

    checked = _check_tracking(spec, overrides)  # a service that is down: one line, before Prefect's flow starts
    runtime.prestart(project_dir)
    _check_store(checked)
    from flows.pipeline import run_pipeline  # torch, transformers, MLflow: imported while the server starts
    from flows.trials.interrupts import signal_crashes_unsaid
    from tasks.results import RunInterrupted

    runtime.wait_until_started()
    try:
        with signal_crashes_unsaid():
            result = run_pipeline(spec, overrides, resume_run_id)
    except RunInterrupted as stop:  # SIGTERM or Ctrl-C: one line with the run and how to resume it
        print(stop, file=sys.stderr)
        return stop.exit_code
    _print_result(result, project_dir)
    return 0 if result.status == "finished" else 3


def _check_tracking(spec_path: str, overrides: list[str]) -> ExperimentSpec:
    """The spec, once its http(s) tracking server answered: standard library only, seconds before any import."""
    from infra.mlflow_server import TrackingUnavailable, check_tracking
    from tasks.spec import load_spec

    spec = load_spec(spec_path, overrides)
    try:
        check_tracking(spec.tracking.uri or "", spec.tracking)
    except TrackingUnavailable as e:
        raise UserError(str(e), 1) from None
    return spec


def _check_store(spec: ExperimentSpec) -> None:
    """The spec's artifact store can be written (a short check: StoreUnavailable exits 1, a bad bucket or
    credentials 2)."""
    from infra.store import BucketNotFound, StoreUnavailable
    from tasks.checkpoint import reachable_store
    from tasks.spec import store_uri

    try:
        reachable_store(store_uri(spec))
    except (StoreUnavailable, BucketNotFound, PermissionError) as e:
        raise UserError(f"storage.uri {store_uri(spec)}: {e}", 1 if isinstance(e, StoreUnavailable) else 2) from None


def _spec_file_of_run(given: str, spec_path: str | None, project_dir: str) -> tuple[str, Path]:
    """(the run's full id, its spec.yaml) for `--resume` given a run id, a run name or the short id in a name."""
    from tasks.spec import load_spec, tracks_nothing_yet
    from tasks.tracking import Tracking

    probe = (
        load_spec(spec_path) if spec_path else load_spec({"model": {"name_or_path": "-"}, "project_dir": project_dir})
    )
    if tracks_nothing_yet(probe):
        raise UserError(
            f"--resume {given}: project_dir {probe.project_dir} has no MLflow store (mlflow.db), so no run to resume; "
            "give --project-dir the project the run was tracked in"
        )
    try:
        tracking = Tracking(probe)
        run_id = tracking.resolve_run_id(given)
        out = tracking.output_dir_of(run_id)
    except ValueError as e:  # not in this tracking store
        raise UserError(f"--resume {given}: {e}") from None
    if out is None or not (out / "spec.yaml").exists():
        raise UserError(f"run {run_id} has no output directory with a spec.yaml on this machine; cannot resume it here")
    return run_id, out / "spec.yaml"


def _hold_run(run_dir: Path, what: str) -> None:
    """This process records the run from here on, or one line naming the live process that does (trainer/records.py)."""
    from tasks.metrics_sink import RunBusy, hold

    try:
        hold(run_dir, what)
    except RunBusy as e:
        raise UserError(str(e)) from None


def _finished(spec: ExperimentSpec, run_id: str) -> str | None:
    """What to say instead of resuming a run that already finished (None: it did not)."""
    from tasks.tracking import Tracking

    tags = Tracking(spec).tags(run_id)
    if tags.get("ballast.status") not in ("finished", "collapsed", "probe_failed", "pruned"):
        return None
    report = Path(tags.get("ballast.output_dir", "")) / "report.html"
    return (
        f"run {run_id} already ended ({tags['ballast.status'].replace('_', ' ')}); nothing to resume. Its report: "
        f"{report}. To train further, start a new run from it: ballast run SPEC --set fork.run_id={run_id}"
    )


def _print_result(result, project_dir: str) -> None:
    from rich.console import Console

    c = Console(soft_wrap=True, highlight=False)  # paths and commands stay whole, for copying
    c.rule(f"[bold]Ballast run {result.run_name or result.run_id}: {result.status}")
    for line in result.lines():
        c.print(line)
    c.print(f"wall time: {result.seconds:.0f} s (trainer {result.trainer_seconds:.0f} s)")
    for name, path in result.reports.items():
        c.print(f"{name + ' report:':<14} {path}")
    c.print(f"checkpoint:    {result.final_checkpoint}")
    c.print(f"run id:        {result.run_id}")
    c.print(f"MLflow run:    {result.mlflow_url}")
    from flows import runtime

    if runtime.embedded():  # the embedded stores: their UIs are not running yet
        c.print(f"the UIs:       ballast ui --project-dir {shlex.quote(project_dir)}   (MLflow :5000, Prefect :4200)")


def cmd_train(args) -> int:
    from tasks.spec import check_runnable, check_trainable_alone, dump_spec, load_spec

    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps {args.steps}: give the run's total number of steps, 1 or more")
    spec = load_spec(args.spec, args.set + ([f"optim.steps={args.steps}"] if args.steps is not None else []))
    check_runnable(spec, here=True)  # the trainer alone runs on this machine, whatever infra.compute says
    check_trainable_alone(spec)  # fork.run_id: no tracking store here to find the run in
    if not args.resume:
        _check_local_fork_checkpoint(spec)  # before the run directory's checks load torch
    nproc = getattr(args, "nproc", 1)
    if nproc != 1:
        from tasks.ranks import check_ranks

        check_ranks(spec, nproc)  # too many ranks, a world size not dividing the batch, fsdp2 unshardable: one line
    # every refusal comes before the first write: a refused command leaves the run directory as it was
    out, resuming = _train_dir(spec, args)
    fork_from = None if resuming else _train_fork(spec)  # a missing or altered fork.checkpoint: before any model
    if nproc > 1:  # every rank runs this command on the spec as checked (rank 0 records; trainer/distributed.py)
        from tasks.ranks import launch

        out.mkdir(parents=True, exist_ok=True)
        (out / "spec.yaml").write_text(dump_spec(spec))
        flags = ["--resume"] * args.resume + ["--quiet"] * args.quiet
        return launch(nproc, ["-m", "flows.cli", "train", str(out / "spec.yaml"), "--output", str(out), *flags])
    from tasks.fork import verify_fork
    from tasks.train import train_alone

    source = None if resuming else verify_fork(spec, fork_from)  # the fingerprint: the model loads here
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.yaml").write_text(dump_spec(spec))
    result, resumed_from = train_alone(spec, out, args.resume, progress=not args.quiet, source=source)
    if result.interrupted:  # SIGTERM or Ctrl-C: stopped after a step, checkpoint saved there
        from tasks.results import RunInterrupted

        stop = RunInterrupted(
            result.interrupted,
            result.last_step,
            result.last_checkpoint,
            run=f"run {out}",
            resume=f"ballast train {out / 'spec.yaml'} --output {out} --resume",
        )
        print(stop, file=sys.stderr)
        return stop.exit_code
    if os.environ.get("RANK", "0") != "0":  # one of --nproc ranks: rank 0 speaks for the run
        return 3 if result.stopped else 0
    if resumed_from:
        print(f"resumed from {resumed_from}")
    print(
        f"{'stopped: ' + result.stopped if result.stopped else 'done'} at step {result.last_step}; "
        f"metrics: {out / 'metrics.jsonl'}; last checkpoint: {result.last_checkpoint}"
    )
    return 3 if result.stopped else 0


def _train_dir(spec: ExperimentSpec, args) -> tuple[Path, Path | None]:
    """(`ballast train`'s run directory, the checkpoint --resume continues from), refused before anything is
    written: a directory holding checkpoints without --resume, and --resume with no checkpoint to continue (a fresh
    start under --resume would hide a wrong --output; Hugging Face's Trainer refuses it the same way)."""
    from tasks.checkpoint import (
        check_resumable,
        list_checkpoints,  # the checkpoint format's one home is trainer/checkpoint.py
    )

    out = Path(args.output or Path(spec.project_dir) / "runs" / spec.name)
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out}: is a file; give the run's directory (it is made if missing)")
    if not args.resume:
        if list_checkpoints(out / "checkpoints"):
            raise UserError(
                f"{out} already holds checkpoints; pass --resume to continue that run, or --output a new directory"
            )
        return out, None
    resuming = check_resumable(spec, out)
    if resuming is None:
        raise UserError(
            f"--resume: no checkpoint to continue from in {out / 'checkpoints'}; give --output the directory of "
            "the run to continue, or leave out --resume to start a new run there"
        )
    return out, resuming


def _train_fork(spec: ExperimentSpec):
    """`ballast train`'s fork source, found and its files verified against its manifest before a rank or a model
    starts (one line, exit 2); its fingerprint, which needs the model, is verified when it loads (verify_fork)."""
    from tasks.fork import resolve_fork
    from tasks.train import fork_alone

    if spec.fork.checkpoint is None:  # (fork.run_id was refused by check_trainable_alone)
        return fork_alone(spec)  # the base model: nothing loads
    try:
        return resolve_fork(spec, None)
    except FileNotFoundError as e:
        raise UserError(f"fork source fork.checkpoint={spec.fork.checkpoint}: {e}") from None


def cmd_sync(args) -> int:
    """Send what a pipeline run could not: the step metrics MLflow lacks (kept while it was away, or written and not
    yet sent when the run was killed) up to the newest checkpoint, the samples tables, checkpoints not uploaded."""
    from tasks.spec import load_spec

    run_dir = Path(args.project_dir).resolve() / "runs" / args.run_id
    if not (run_dir / "spec.yaml").is_file():
        raise UserError(
            f"{args.run_id}: no run directory with a spec.yaml at {run_dir}; give --project-dir, the "
            "project folder the run was made in"
        )
    _hold_run(run_dir, f"`ballast sync {args.run_id}`")
    spec = load_spec(run_dir / "spec.yaml")
    from tasks.checkpoint import checkpoint_prefix, list_checkpoints, reachable_store, resume_command, sync_checkpoints
    from tasks.record import sync_run
    from tasks.spec import store_uri
    from tasks.tracking import Tracking

    tracking = Tracking(spec)
    sent = sync_run(tracking, spec, args.run_id, run_dir)
    print(f"metrics: {sent} sent to {tracking.uri}" if sent else "metrics: none missing")
    if list_checkpoints(run_dir / "checkpoints"):
        store, prefix = reachable_store(store_uri(spec)), checkpoint_prefix(args.run_id)
        stored = sync_checkpoints(
            store, prefix, run_dir / "checkpoints", spec.checkpoint.keep_last, args.run_id, args.project_dir
        )
        print(f"checkpoints: {', '.join(Path(u).name for u in stored.uris.values())} in {store.child_uri(prefix)}")
    status = tracking.tags(args.run_id).get("ballast.status")
    if status != "finished":
        print(f"run {args.run_id} is {status}: `{resume_command(args.run_id, args.project_dir)}` finishes it")
    return 0


# ── probe and compare ──────────────────────────────────────────────────────────────────────────────


def cmd_probe(args) -> int:
    _check_target(args.checkpoint)  # a mistyped path: one line before torch loads
    _check_output_files(args, "json", "html")
    cfg, model_cfg, lora_cfg, spec = _probe_settings(args)
    from tasks.probe import base_model_of, probe_checkpoint
    from tasks.results import ProbeError

    cache = (
        Path(args.cache_dir) if args.cache_dir else Path(spec.project_dir if spec else ".ballast") / "cache" / "probe"
    )
    try:
        if model_cfg is None and args.device:  # the manifest's base model, on the device asked for
            model_cfg = base_model_of(args.checkpoint, cache, device=args.device)
        report = probe_checkpoint(
            args.checkpoint,
            cfg,
            model_cfg,
            cache,
            lora_cfg=lora_cfg,
            data=spec.data if spec else None,
            rewards=spec.rewards if spec else None,
            baseline_cache=cache.parent / "probe-baseline",
        )
    except ProbeError as e:
        print(f"probe FAILED: {e}")
        return 1
    for line in report.summary_lines():
        print(line)
    if args.json:
        print(f"report: {report.write_json(args.json)}")
    if args.html:
        print(f"page:   {report.write_html(args.html)}")
    return 0 if report.passed else 1


def _probe_settings(args):
    """(ProbeConfig, ModelConfig | None, LoraConfig | None, spec | None) from --spec and the flags."""
    from pydantic import ValidationError

    from tasks.spec import ModelConfig, ProbeConfig, load_spec

    spec = load_spec(args.spec, args.set) if args.spec else None
    cfg = spec.probe.model_copy() if spec else ProbeConfig()
    flags = {
        "prompts_file": args.prompts,
        "n": args.n,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "expected_length": args.expected_length,
        "max_malformed_rate": args.max_malformed_rate,
        "parity_tolerance": args.parity_tolerance,
        "seed": args.seed,
    }
    if args.format_tag is not None:
        flags["format_tag"] = False if args.format_tag.lower() in ("", "none", "false") else args.format_tag
    try:
        for name, value in flags.items():
            if value is not None:
                setattr(cfg, name, value)
    except ValidationError as e:
        err = e.errors()[0]
        flag = {"prompts_file": "prompts"}.get(str(err["loc"][0]), str(err["loc"][0])).replace("_", "-")
        raise UserError(f"--{flag}: {err['msg'].removeprefix('Value error, ')} (got {err.get('input')!r})") from None
    if args.prompts:  # read now, not after the checkpoint and the model have loaded
        from tasks.spec import load_probe_prompts

        try:
            load_probe_prompts(args.prompts)
        except (ValueError, FileNotFoundError) as e:
            raise UserError(f"--prompts {args.prompts}: {e}") from None
    if args.device:
        from tasks.spec import check_device

        check_device(args.device, "--device")
    model_cfg = spec.model if spec else None
    update = {}
    if args.base:
        update.update(name_or_path=args.base, build_if_missing=None)
    if args.device:
        update["device"] = args.device
    if update and model_cfg is not None:
        model_cfg = model_cfg.model_copy(update=update)
    elif update and args.base:
        model_cfg = ModelConfig(name_or_path=args.base, device=args.device or "auto")
    return cfg, model_cfg, (spec.lora if spec else None), spec


def _check_output_files(args, *flags: str) -> None:
    """A file flag (--json, --html) that names a folder was found by the write, after the work: refused first."""
    for flag in flags:
        out = getattr(args, flag, None)
        if out and Path(out).expanduser().is_dir():
            raise UserError(f"--{flag} {out}: is a folder; give a file to write, e.g. {Path(out) / ('report.' + flag)}")


def _check_target(target: str) -> None:
    if not target.startswith("s3://") and not Path(target).expanduser().exists():
        raise UserError(
            f"{target}: no such checkpoint directory; give a checkpoint path (…/checkpoints/step-NNNNNN) "
            "or an s3:// URI"
        )


def _check_compare_args(args) -> None:
    """`ballast compare`'s arguments, before anything loads: a typo in A or B is found before A is probed."""
    if not 0 < args.alpha < 1:
        raise UserError(f"--alpha {args.alpha}: give a significance level between 0 and 1, e.g. 0.01")
    _check_compare_tracking(args)  # a tracking server that is down: one line before torch and MLflow are imported
    _check_output_files(args, "json", "html")
    if args.plots and Path(args.plots).expanduser().is_file():
        raise UserError(f"--plots {args.plots}: is a file; give a folder to write the plots into")
    for name, target in (("A", args.a), ("B", args.b)):
        named = target.startswith("s3://") or re.fullmatch(r"[0-9a-f]{32}", target)
        if not (named or Path(target).expanduser().exists()):
            raise UserError(
                f"{name}: {target!r} is neither an existing probe report, checkpoint or run directory, an s3:// URI, "
                "nor an MLflow run id (32 hex characters); check the path"
            )


def cmd_compare(args) -> int:
    _check_compare_args(args)
    from tasks.compare import compare, format_differences, plot_comparison, resolve_target, write_comparison_html
    from tasks.results import ProbeError

    probe_cfg = model_cfg = lora_cfg = None
    tracking = args.tracking_uri
    if args.spec:
        from tasks.spec import load_spec, tracking_uri

        spec = load_spec(args.spec, args.set)
        probe_cfg, model_cfg, lora_cfg = spec.probe, spec.model, spec.lora
        tracking = tracking or tracking_uri(spec)
    sides = []
    for name, target in (("A", args.a), ("B", args.b)):
        try:
            sides.append(
                resolve_target(
                    target,
                    probe_cfg=probe_cfg,
                    model_cfg=model_cfg,
                    lora_cfg=lora_cfg,
                    cache_dir=Path(args.cache_dir) if args.cache_dir else None,
                    tracking_uri=tracking,
                )
            )
        except ProbeError as e:  # a checkpoint that cannot be probed: a failure, not a bad argument
            raise UserError(f"{name}: {e}", 1) from None
        except (FileNotFoundError, ValueError) as e:
            raise UserError(f"{name}: {e}") from None
    (report_a, history_a), (report_b, history_b) = sides
    result = compare(report_a, report_b, alpha=args.alpha, labels=(args.label_a or "A", args.label_b or "B"))
    result.a.source, result.b.source = args.a, args.b
    print(result.summary)
    if warning := format_differences(result):
        print(warning, file=sys.stderr)
    plots = []
    if args.plots or args.html:
        plots = plot_comparison(result, Path(args.plots or Path(args.html).with_suffix("")), history_a, history_b)
        if args.plots:
            print(f"plots:  {', '.join(str(p) for p in plots)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1))
        print(f"result: {args.json}")
    if args.html:
        write_comparison_html(result, args.html, plots, {"A": args.a, "B": args.b})
        print(f"page:   {args.html}")
    return 1 if result.regression else 0


def _check_compare_tracking(args) -> None:
    """When a side is a run id (not a path or s3:// URI) on an http(s) tracking server, that server must answer."""
    from infra.mlflow_server import TrackingUnavailable, check_tracking
    from tasks.spec import TrackingConfig, load_spec

    cfg = load_spec(args.spec, args.set).tracking if args.spec else TrackingConfig()
    uri = args.tracking_uri or cfg.uri or ""
    if any(not x.startswith("s3://") and not Path(x).expanduser().exists() for x in (args.a, args.b)):
        try:
            check_tracking(uri, cfg)
        except TrackingUnavailable as e:
            raise UserError(str(e), 1) from None


# ── regression and sweeps ──────────────────────────────────────────────────────────────────────────


def cmd_regress(args) -> int:
    if len(args.ref) != 2:
        raise UserError(
            f"give exactly two refs: --ref A --ref B (A the reference, B the candidate); got {args.ref or 'none'}"
        )
    if not 0 < args.alpha < 1:  # before both refs train
        raise UserError(f"--alpha {args.alpha}: give a significance level between 0 and 1, e.g. 0.01")
    if args.runs < 1:
        raise UserError(f"--runs {args.runs}: give 1 or more runs per ref")
    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps {args.steps}: give 1 or more steps")
    from flows import runtime
    from tasks.regression import repo_root, resolve_commit
    from tasks.spec import load_spec

    spec = load_spec(args.spec, args.set)  # a bad spec fails here, before any worktree exists
    try:
        root = repo_root(args.repo)
        for ref in args.ref:
            resolve_commit(root, ref)
    except ValueError as e:
        raise UserError(str(e)) from None
    runtime.prestart(spec.project_dir)
    from flows.regression import ballast_regression

    runtime.wait_until_started()
    result = ballast_regression(
        str(Path(args.spec).resolve()),
        list(args.ref),
        runs=args.runs,
        steps=args.steps,
        repo=str(root),
        overrides=list(args.set),
        alpha=args.alpha,
        work_dir=args.work_dir,
    )
    print(result.summary)
    print(f"report: {result.html}")
    print(f"MLflow run: {result.run_id}")
    return 1 if result.regression else 0


def cmd_sweep(args) -> int:
    from flows import runtime
    from sweeps.space import base_spec, load_sweep

    if args.delete is not None:
        return _delete_sweep(args)
    if not args.file:
        raise UserError("give a sweep file (ballast sweep FILE) or a study to delete (ballast sweep --delete STUDY)")
    if args.trials is not None and args.trials < 1:
        raise UserError(f"--trials {args.trials}: give 1 or more (the study's total of finished trials)")
    if args.workers < 0:
        raise UserError(f"--workers {args.workers}: give 0 (create the study only), 1, or more")
    if args.timeout is not None and args.timeout <= 0:
        raise UserError(f"--timeout {args.timeout:g}: give a number of seconds above 0")
    _check_storage_flag(args.storage)
    if args.cont and args.promote is None:
        raise UserError("--continue goes with --promote: ballast sweep FILE --promote --continue")
    if args.promote is not None:
        return _promote(args)
    sweep = load_sweep(args.file, args.set)  # a bad sweep file or --set fails here, before any study or run exists
    if args.workers and base_spec(sweep).get("infra", {}).get("compute", "here") != "here":
        _check_worker_nodes(sweep, args.storage)
    _check_storage_opens(sweep, args.storage)
    runtime.prestart(base_spec(sweep).get("project_dir", ".ballast"))
    from flows.sweep import ballast_sweep
    from flows.trials.interrupts import interrupts_said_once

    runtime.wait_until_started()  # a flow that starts before the ephemeral server answers finds no API
    with interrupts_said_once(_sweep_again(args)):
        result = ballast_sweep.with_options(flow_run_name=sweep.study_name)(  # the flow run named after the study
            str(Path(args.file).resolve()),
            trials=args.trials,
            workers=args.workers,
            storage=args.storage,
            overrides=list(args.set),
            timeout_s=args.timeout,
        )
    if result is None:  # --workers 0: the study was created, the join command printed
        return 0
    for line in result.lines():
        print(line)
    if not result.done:
        return 1
    return 0 if result.n_complete else 3  # every trial pruned or failed: the sweep found nothing, as a collapsed run


def _sweep_again(args) -> str:
    """The command that continues this sweep: the one typed, with the flags that say where its study is and how it
    runs (a line without --storage would start a new study in the project folder's SQLite file)."""
    flags = [x for s in args.set for x in ("--set", s)]
    for flag, value in (("--storage", args.storage), ("--trials", args.trials), ("--timeout", args.timeout)):
        if value is not None:
            flags += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    if args.workers != 1:
        flags += ["--workers", str(args.workers)]
    return shlex.join(["ballast", "sweep", args.file, *flags])


def cmd_pbt(args) -> int:
    from flows import runtime
    from sweeps.population import load_population

    pop = load_population(args.file, args.set)  # a bad file or --set fails here, before any model or run exists
    pop.refuse_a_second_start(args.resume)
    _check_new_run(pop.spec())  # the model is here (or buildable), the device exists: before any MLflow run opens
    runtime.prestart(pop.spec().project_dir)
    from flows.pbt import ballast_pbt

    runtime.wait_until_started()
    again = shlex.join(["ballast", "pbt", args.file, *[x for s in args.set for x in ("--set", s)], "--resume"])
    summary = ballast_pbt(str(Path(args.file).resolve()), overrides=list(args.set), resume=args.resume)
    if summary.interrupted:
        print(
            f"population interrupted ({summary.interrupted}) at step {summary.step}; saved — continue it with: {again}"
        )
        return 130
    for line in summary.lines():
        print(line)
    return 0 if summary.winner else 3


def _promote(args) -> int:
    """`ballast sweep FILE --promote [TRIAL] [--continue]`: the winner's full run (flows/promote.py); --set changes
    that run, not the study."""
    from flows import runtime
    from flows.promote import pick_trial, promoted_spec
    from sweeps.space import SweepError, load_sweep
    from sweeps.study import join_study, make_storage, redact_url, study_storage

    named = load_sweep(args.file, list(args.set), searching=False)  # --set project_dir=...: its study is there
    url = study_storage(named, args.storage)
    try:
        study, sweep = join_study(named.study_name, make_storage(url))
    except SweepError as e:
        raise SweepError(
            f"--promote: {e} (looked in {redact_url(url)}; give --storage, or the --set project_dir the sweep ran with)"
        ) from None
    promoted_spec(sweep, study, pick_trial(study, args.promote), args.cont, list(args.set))  # refused here, in seconds
    runtime.prestart(sweep.base.get("project_dir", ".ballast"))
    from flows.promote import promote

    runtime.wait_until_started()
    result = promote(study, sweep, args.promote, args.cont, list(args.set))
    _print_result(result, sweep.base.get("project_dir", ".ballast"))
    return 0 if result.status == "finished" else 3


def _delete_sweep(args) -> int:
    """`ballast sweep --delete STUDY`: the study and its MLflow records, both (flows/sweep.py `delete_sweep`)."""
    from flows.sweep import delete_sweep
    from sweeps.space import load_sweep
    from sweeps.study import default_storage, study_storage

    _check_storage_flag(args.storage)
    if args.storage:
        url = args.storage
    elif args.file:
        url = study_storage(load_sweep(args.file, args.set, searching=False), None)
    else:
        url = default_storage(".ballast")
    print(delete_sweep(args.delete, url))
    return 0


def _check_worker_nodes(sweep, storage: str | None) -> None:
    """Workers on provisioned nodes: a placement or study storage the nodes could not use (SQLite or a loopback
    database for SkyPilot nodes), one line, exit 2, before any study exists or anything is provisioned."""
    from infra.compute import ComputeError
    from sweeps.space import base_spec
    from sweeps.study import check_worker_placement
    from tasks.spec import validate_spec

    try:
        check_worker_placement(validate_spec(base_spec(sweep), "sweep base spec"), storage or sweep.storage)
    except ComputeError as e:
        raise UserError(str(e)) from None


def _check_storage_opens(sweep, storage: str | None) -> None:
    """The study storage opened once before the flow starts: a database that does not answer or a URL it cannot
    read is refused in one line (SweepError, exit 2), not as the failed flow's logged traceback after the server
    started."""
    from sweeps.study import make_storage, study_storage

    make_storage(study_storage(sweep, storage)).remove_session()


def _check_storage_flag(url: str | None) -> None:
    from sweeps.space import STORAGE_PASSWORD
    from tasks.spec import uri_has_password

    if url and uri_has_password(url):
        raise UserError(f"--storage: {STORAGE_PASSWORD}")


def _check_sqlite_file(url: str | None) -> None:
    """A worker joins a study that exists: a SQLite storage must name a database file that is there."""
    if not url or not url.startswith("sqlite:"):
        return
    from sqlalchemy.engine import make_url

    database = make_url(url).database
    if not database or database == ":memory:" or not Path(database).expanduser().is_file():
        raise UserError(
            f"--storage {url}: no such SQLite database; a worker joins a study that exists — give the storage "
            "`ballast sweep` printed when it created the study"
        )


def cmd_sweep_worker(args) -> int:
    from flows import runtime
    from sweeps.space import base_spec
    from sweeps.study import join_study, make_storage

    _check_storage_flag(args.storage)
    _check_sqlite_file(args.storage)  # Optuna would create an empty database there
    _, sweep = join_study(args.study, make_storage(args.storage), worker=args.worker)  # a bad study name fails early
    runtime.prestart(base_spec(sweep).get("project_dir", ".ballast"))  # nothing to start when spawned by a sweep
    from flows.sweep import ballast_sweep_worker
    from flows.trials.interrupts import interrupts_said_once

    runtime.wait_until_started()
    again = ["ballast", "sweep-worker", "--study", args.study] + (["--storage", args.storage] if args.storage else [])
    with interrupts_said_once(shlex.join(again)):
        result = ballast_sweep_worker(
            args.study, args.storage, trials=args.trials, worker=args.worker, summary=not args.no_summary
        )
    if result is not None:
        for line in result.lines():
            print(line)
    return 0


# ── infrastructure and tools ───────────────────────────────────────────────────────────────────────


def cmd_vllm_env(args) -> int:
    from infra.vllm_env import VLLMEnvError, create_vllm_env

    try:
        python = create_vllm_env(args.path, "gpu" if args.gpu else "cpu" if args.cpu else "auto")
    except VLLMEnvError as e:
        raise UserError(str(e), 1) from None
    print(python)
    print(
        f"set it in the spec:  rollout: {{engine: vllm, vllm_python: {python}}}  "
        f"(or --set rollout.vllm_python={python})"
    )
    return 0


def cmd_launch(args) -> int:
    from infra.skypilot import LaunchError, launch, plan_launch, sky_launch_command, write_task_yaml
    from tasks.spec import dump_spec, load_spec

    if args.idle_minutes is not None and args.idle_minutes < 0:
        raise UserError(f"--idle-minutes {args.idle_minutes}: give 0 or more (leave it out for no autostop)")
    spec = load_spec(args.spec, args.set)
    out_dir = Path(spec.project_dir) / "launch"
    try:
        plan, _ = plan_launch(spec, REPO, dump_spec=dump_spec, cluster=args.cluster)
        out_dir.mkdir(parents=True, exist_ok=True)
        spec_file = out_dir / f"{plan.name}.spec.yaml"
        spec_file.write_text(plan.spec_yaml)
        task_yaml = Path(args.yaml) if args.yaml else out_dir / f"{plan.name}.sky.yaml"
        write_task_yaml(plan, spec_file, task_yaml)
    except LaunchError as e:
        raise UserError(str(e)) from None
    resources = ", ".join(f"{k}={v}" for k, v in plan.resources.items()) or "SkyPilot's default"
    print(f"cluster {plan.name}: {plan.num_nodes} node(s), {resources}")
    print(f"runs:   {plan.run}   (spec: {spec_file})")
    if plan.secret_names:
        print(f"secrets from this environment: {', '.join(plan.secret_names)}")
    for note in plan.notes:
        print(f"note:   {note}")
    print(f"task:   {task_yaml}")
    if args.dryrun:
        by_hand = sky_launch_command(plan, task_yaml, args.down, args.idle_minutes)
        print(f"dry run: nothing launched. By hand:  {by_hand}")
        return 0
    try:
        job_id = launch(plan, spec_file, down=args.down, idle_minutes_to_autostop=args.idle_minutes)
    except LaunchError as e:
        raise UserError(str(e), 1) from None
    except Exception as e:  # SkyPilot's own errors: no cloud enabled, quota, capacity, ...
        raise UserError(
            f"SkyPilot could not launch {plan.name}: {type(e).__name__}: {str(e).strip().splitlines()[0]} "
            "(run `sky check` to see which clouds or Kubernetes contexts are enabled)",
            1,
        ) from None
    print(
        f"job {job_id} on {plan.name}: `sky logs {plan.name} {job_id}` follows it, `sky down {plan.name}` ends the "
        "cluster"
    )
    return 0


UI_ENV = {  # MLflow's job runner serves GenAI evaluation jobs (3 more processes); Prefect's telemetry stays off
    "mlflow": {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    "prefect": {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
}
UI_READY_TIMEOUT_S = 300
MLFLOW_MODE_HINT = (  # MLflow 3.17's UI ignores mlflow.experimentKind: one mode for every experiment, per browser
    "         MLflow opens every experiment in its GenAI mode (an Overview of traces) unless told: click "
    "'Model training' at its top left once (this browser keeps it), or open the MLflow links Ballast prints"
)


def ui_commands(project: Path, host: str, mlflow_port: int, prefect_port: int) -> dict[str, tuple[dict, list[str]]]:
    """{ui: (extra environment, argv)}: MLflow with one worker (a UI for one person; the default four take minutes
    to start on two cores) and Prefect's server without its background services (nothing to schedule here). The
    Prefect UI is told where its API is (it assumes port 4200 otherwise)."""
    shown = _shown_host(host)
    mlflow = [
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{project / 'mlflow.db'}",
        "--host",
        host,
        "--port",
        str(mlflow_port),
        "--workers",
        "1",
        "--uvicorn-opts",
        "--log-level warning",
    ]
    prefect = ["prefect", "server", "start", "--host", host, "--port", str(prefect_port), "--no-services"]
    prefect_env = {
        **UI_ENV["prefect"],
        "PREFECT_HOME": str(project / "prefect"),
        "PREFECT_UI_API_URL": os.environ.get("PREFECT_UI_API_URL", f"http://{shown}:{prefect_port}/api"),
    }
    return {"mlflow": (UI_ENV["mlflow"], mlflow), "prefect": (prefect_env, prefect)}


def _shown_host(host: str) -> str:
    """The address to print and to open: this machine for a wildcard bind."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def cmd_ui(args) -> int:
    project = Path(args.project_dir).resolve()
    if not (project / "mlflow.db").exists():
        raise UserError(
            f"--project-dir {args.project_dir}: no mlflow.db there; give the project folder a run used "
            "(project_dir in its spec, default .ballast)"
        )
    for port, flag in ((args.mlflow_port, "--mlflow-port"), (args.prefect_port, "--prefect-port")):
        _refuse_taken_port(args.host, port, flag)
    commands = ui_commands(project, args.host, args.mlflow_port, args.prefect_port)
    shown = _shown_host(args.host)
    urls = {
        "mlflow": f"http://{shown}:{args.mlflow_port}/#/experiments?workflowType=machine_learning",
        "prefect": f"http://{shown}:{args.prefect_port}/runs",
    }
    health = {
        "mlflow": f"http://{shown}:{args.mlflow_port}/health",
        "prefect": f"http://{shown}:{args.prefect_port}/api/health",
    }
    for name, (env, argv) in commands.items():  # what runs, as a command that can be pasted into a shell
        print(f"{name:<8} {' '.join(f'{k}={shlex.quote(v)}' for k, v in env.items())} {shlex.join(argv)}")
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops both UIs, as Ctrl-C does
    from flows.runtime import spawn_in_own_session, stop_sessions

    procs = {  # in sessions of their own: a terminal's Ctrl-C reaches this process, which stops them in order
        name: spawn_in_own_session(
            [sys.executable, "-m", *argv],
            env={**os.environ, **env},
            stdout=subprocess.DEVNULL if name == "prefect" else None,  # Prefect's banner says `config set`
        )
        for name, (env, argv) in commands.items()
    }
    try:
        return _serve(procs, health, urls)
    except KeyboardInterrupt:
        return 0
    finally:
        stop_sessions(list(procs.values()))  # both at once; SIGKILL to what still runs after 10 s


def _refuse_taken_port(host: str, port: int, flag: str) -> None:
    """A UI port something else listens on is refused before anything starts: its health check would answer, and the
    printed address would show that other server's runs. So are a host that is not this machine's and a port only
    root may serve on, each named as what it is."""
    import errno
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:  # socket.gaierror (a name that does not resolve) among them
            if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
                raise UserError(
                    f"--host {host}: not a name or address of this machine ({e.strerror}); give one of its "
                    "interfaces: 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
                ) from None
            if e.errno == errno.EACCES:
                raise UserError(
                    f"{flag} {port}: serving on a port below 1024 needs root ({e.strerror}); choose a port from 1024 "
                    f"up with {flag} N"
                ) from None
            raise UserError(
                f"{flag} {port}: the port is in use on {_shown_host(host)} ({e.strerror}; another `ballast ui` or "
                f"server?); stop it, or choose a free port with {flag} N"
            ) from None


def _serve(procs: dict, health: dict[str, str], urls: dict[str, str]) -> int:
    """Wait for each UI to answer and print its address; then run until they exit (0) — 1 when one never started."""
    for name, proc in procs.items():
        seconds = _wait_ready(health[name], proc)
        if seconds is not None:
            print(f"{name:<8} ready in {seconds:.0f} s: {urls[name]}")
            if name == "mlflow":
                print(MLFLOW_MODE_HINT)
        elif proc.poll() is None:
            print(f"{name:<8} not answering {health[name]} after {UI_READY_TIMEOUT_S} s; still waiting")
        else:
            print(f"{name:<8} exited with status {proc.returncode} before it accepted connections (see above)")
            return 1
    print("Ctrl-C stops both.")
    for proc in procs.values():
        proc.wait()
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _wait_ready(url: str, proc, timeout: float = UI_READY_TIMEOUT_S) -> float | None:
    """Seconds until `url` answers 200; None when the process exits first or `timeout` passes."""
    import time
    import urllib.request

    start = time.monotonic()
    while time.monotonic() - start < timeout and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            time.sleep(0.5)
    return None


def cmd_metrics(args) -> int:
    from tasks.spec import METRICS  # the glossary alone: no torch, MLflow or Prefect to import

    width = max(map(len, METRICS))
    for name, meaning in METRICS.items():
        print(f"{name:<{width}}  {meaning}")
    return 0


def cmd_spec_schema(args) -> int:
    from tasks.spec import ExperimentSpec, spec_reference

    if not args.json:
        for line in spec_reference():
            print(line)
        return 0
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",  # the dialect pydantic writes
        **ExperimentSpec.model_json_schema(),
    }
    print(json.dumps(schema, indent=1))
    return 0
