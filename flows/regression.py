"""Regression runs: the same experiment on two code refs of a training codebase, every final artifact
probed, the two sides compared, one MLflow comparison run that says regression or not.

    ballast regress SPEC --ref A --ref B [--runs K] [--steps N] [--repo PATH] [--set K=V]...

A is the reference (e.g. the last good ref), B the candidate. What happens, in order:

1. The spec is read and validated *here* and written, with its paths made absolute, to the work
   directory; both refs train from that one file (same fork source, seeds and data). The base model is
   built here if it is missing, so both refs load the same files. Only the fields the spec sets are
   written, so an older ref whose schema lacks a newer field still reads it.
2. Each ref is checked out as a git worktree (detached) of the repository — this one by default,
   `--repo` for another checkout of a compatible codebase.
3. Each ref trains the spec K times, *with its own code*: `python -m flows.cli train SPEC --output DIR
   --quiet` in a subprocess whose working directory and PYTHONPATH are the worktree. Run k of both
   refs uses the same seeds (`optim.seed + k`, `rollout.seed + k`), so A's run k and B's run k differ
   only by the code. The manifest's code_ref of each final checkpoint must be the ref's commit —
   proof that the ref's code, not this checkout's, wrote it.
4. Every final checkpoint is probed with *this* checkout's probe (tasks/probe.py), so both sides are
   judged by the same detectors; an artifact that cannot be loaded at all counts as a failed probe
   that fails parity.
5. The reports are pooled per ref and compared (tasks/compare.py: one-sided Fisher's exact test on
   malformed counts, and parity), with the training curves side by side.
6. One MLflow run records it: tags `ballast.kind=regression`, `ballast.verdict`, `ballast.summary`;
   params the refs, commits, runs, steps; metrics both malformed rates with their intervals and the
   p-value; artifacts both pooled reports, every probe report, comparison.json, the plots and
   comparison.html.

Worktrees are removed at the end; run outputs and reports stay in the work directory
(`<project_dir>/regressions/<time>-<A>-<B>` by default). Exit status of `ballast regress`: 0 no
regression, 1 regression (or a ref whose training failed: the message names it and its log), 2 bad
arguments (a ref that does not exist, not exactly two refs, an invalid spec).
`prefect.yaml` schedules this flow nightly (deployment `ballast-regression`).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from flows.cli import UserError, command

REPO_ROOT = Path(__file__).resolve().parent.parent
STDERR_TAIL = 3000  # characters of a failed training's stderr quoted in the error


class RegressionError(RuntimeError):
    """A regression run that could not be carried out (a ref that does not train, a run that saved nothing)."""


# ── git ────────────────────────────────────────────────────────────────────────────────────────────

def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RegressionError(f"git {' '.join(args)} in {repo} failed: {proc.stderr.strip()[:500]}")
    return proc.stdout.strip()


def repo_root(repo: str | Path | None) -> Path:
    """The top of the git repository at `repo` (default: the checkout this code runs from)."""
    where = Path(repo).expanduser().resolve() if repo else REPO_ROOT
    proc = subprocess.run(["git", "-C", str(where), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"--repo {where} is not inside a git repository ({proc.stderr.strip()[:200]}); "
                        "give the path of a git checkout of the training codebase", 2)
    return Path(proc.stdout.strip())


def resolve_commit(repo: Path, ref: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
                          capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise UserError(f"--ref {ref!r} is not a commit, branch or tag of {repo}; check `git -C {repo} log --oneline`", 2)
    return proc.stdout.strip()


def _label(ref: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", ref)[:40] or "ref"


def add_worktree(repo: Path, commit: str, path: Path) -> Path:
    if path.exists():
        raise RegressionError(f"worktree path {path} exists; choose a new --work-dir")
    _git(repo, "worktree", "add", "--detach", str(path), commit)
    return path


def remove_worktree(repo: Path, path: Path) -> None:
    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(path)], capture_output=True, text=True)
    subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True, text=True)


# ── the spec both refs train ───────────────────────────────────────────────────────────────────────

def _absolute(value: str, base: Path) -> str:
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def resolved_spec(spec_path: str | Path, overrides: list[str], out: Path):
    """(validated spec, path of the spec file both refs train from): the user's fields only, overrides applied,
    filesystem paths made absolute against the current directory."""
    import yaml

    from tasks.spec import load_spec, set_path

    spec = load_spec(spec_path, overrides)  # validated by this checkout's schema; errors name the field
    data = yaml.safe_load(Path(spec_path).read_text()) or {}
    for item in overrides:
        set_path(data, item)
    cwd = Path.cwd()
    model = data.setdefault("model", {})
    if model.get("build_if_missing") or Path(model["name_or_path"]).expanduser().exists():
        model["name_or_path"] = _absolute(model["name_or_path"], cwd)
    data["project_dir"] = _absolute(data.get("project_dir", spec.project_dir), cwd)
    d = data.get("data") or {}
    if d.get("source") not in (None, "arith"):
        d["source"] = _absolute(d["source"], cwd)
    if d.get("eval_path"):
        d["eval_path"] = _absolute(d["eval_path"], cwd)
    probe = data.get("probe") or {}
    if probe.get("prompts_file"):
        probe["prompts_file"] = _absolute(probe["prompts_file"], cwd)
    fork = data.get("fork") or {}
    if fork.get("checkpoint") and not str(fork["checkpoint"]).startswith("s3://"):
        fork["checkpoint"] = _absolute(fork["checkpoint"], cwd)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_spec(out), out


# ── one training run at one ref, and its probe ─────────────────────────────────────────────────────

def train_at_ref(worktree: Path, commit: str, spec_file: Path, out_dir: Path, run_index: int, spec,
                 steps: int | None = None) -> dict:
    """Train the spec with the code in `worktree` (a subprocess); {checkpoint, metrics, seconds, returncode}."""
    from trainer.checkpoint import MANIFEST, list_checkpoints

    cmd = [sys.executable, "-m", "flows.cli", "train", str(spec_file), "--output", str(out_dir), "--quiet",
           "--set", f"optim.seed={spec.optim.seed + run_index}", "--set", f"rollout.seed={spec.rollout.seed + run_index}"]
    if steps:
        cmd += ["--steps", str(steps)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(worktree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
               TOKENIZERS_PARALLELISM="false")
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=worktree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    (out_dir / "train.log").parent.mkdir(parents=True, exist_ok=True)
    (out_dir / "train.log").write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    if proc.returncode not in (0, 3):  # 3: the health gate stopped the run; its last checkpoint is still probed
        raise RegressionError(f"training at commit {commit[:12]} (run {run_index}) exited {proc.returncode}; "
                              f"log: {out_dir / 'train.log'}\n{proc.stderr[-STDERR_TAIL:]}")
    found = list_checkpoints(out_dir / "checkpoints")
    if not found:
        raise RegressionError(f"training at commit {commit[:12]} (run {run_index}) saved no checkpoint; log: {out_dir / 'train.log'}")
    checkpoint = found[-1][1]
    manifest = json.loads((checkpoint / MANIFEST).read_text()) if (checkpoint / MANIFEST).is_file() else {}
    ran = (manifest.get("code_ref") or {}).get("commit")
    if ran and ran != "unknown" and ran != commit:
        raise RegressionError(f"the run for commit {commit[:12]} was written by code at commit {ran[:12]}: the worktree's code "
                              "was shadowed (an installed copy of the package, or PYTHONPATH); install Ballast in editable "
                              "mode from one checkout only, or run from a clean environment")
    return {"checkpoint": str(checkpoint), "metrics": str(out_dir / "metrics.jsonl"), "seconds": seconds,
            "returncode": proc.returncode}


def probe_or_error(checkpoint: str, spec, cache_dir: Path) -> dict:
    """This checkout's probe of one artifact; an artifact that cannot be loaded becomes a failed entry."""
    from tasks.probe import ProbeError, probe_checkpoint
    try:
        return probe_checkpoint(checkpoint, spec.probe, spec.model, cache_dir, lora_cfg=spec.lora)
    except ProbeError as e:
        return {"checkpoint": checkpoint, "error": str(e), "passed": False, "parity_ok": False, "n_samples": 0,
                "n_malformed": 0, "failures": [str(e)], "reason_counts": {}}


# ── the whole regression run ───────────────────────────────────────────────────────────────────────

def run_regression(spec_path: str, refs: list[str], runs: int = 1, steps: int | None = None, repo: str | None = None,
                   overrides: list[str] = (), alpha: float = 0.01, work_dir: str | None = None, task=None) -> dict:
    """The regression flow's body (see the module docstring). `task(fn, name)` wraps a step as a Prefect task
    (identity when None). Returns {verdict, summary, p_value, regression, run_id, work_dir, comparison, html, ...}."""
    from tasks.compare import compare, plot_comparison, pool_reports, read_history, write_comparison_html
    from tasks.spec import load_spec
    from trainer.model import ensure_model

    task = task or (lambda fn, name: fn)
    if len(refs) != 2:
        raise UserError(f"give exactly two refs (--ref A --ref B); got {len(refs)}: {refs}", 2)
    if runs < 1:
        raise UserError(f"--runs {runs}: give 1 or more runs per ref", 2)
    root = repo_root(repo)
    commits = [resolve_commit(root, r) for r in refs]
    project_dir = load_spec(spec_path, list(overrides)).project_dir  # a bad spec fails here, naming the field
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = Path(work_dir).expanduser().resolve() if work_dir else \
        Path(project_dir).resolve() / "regressions" / f"{stamp}-{_label(refs[0])}-{_label(refs[1])}"
    work.mkdir(parents=True, exist_ok=True)
    spec, spec_file = resolved_spec(spec_path, list(overrides), work / "spec.yaml")
    ensure_model(spec.model)

    sides = []
    for side, (ref, commit) in zip("ab", zip(refs, commits)):
        sides.append({"side": side, "ref": ref, "commit": commit, "worktree": work / "worktrees" / f"{side}-{_label(ref)}"})
    t_train, t_probe = task(train_at_ref, "train-at-ref"), task(probe_or_error, "artifact-probe")
    try:
        for s in sides:
            add_worktree(root, s["commit"], s["worktree"])
        for s in sides:
            s["runs"] = [t_train(s["worktree"], s["commit"], spec_file, work / "runs" / f"{s['side']}-{k}", k, spec, steps)
                         for k in range(runs)]
    finally:
        for s in sides:
            if s["worktree"].exists():
                remove_worktree(root, s["worktree"])

    probes = work / "probes"
    probes.mkdir(exist_ok=True)
    for s in sides:
        s["reports"] = []
        for k, r in enumerate(s["runs"]):
            report = t_probe(r["checkpoint"], spec, work / "cache")
            (probes / f"{s['side']}-{k}.json").write_text(json.dumps(report, indent=1))
            s["reports"].append(report)
        s["pooled"] = pool_reports(s["reports"], label=s["ref"])
        s["pooled"].update(ref=s["ref"], commit=s["commit"])
        (work / f"pooled_{s['side']}.json").write_text(json.dumps(s["pooled"], indent=1))

    a, b = sides
    result = compare(a["pooled"], b["pooled"], alpha=alpha, labels=(a["ref"], b["ref"]))
    result["refs"] = {"a": {"ref": a["ref"], "commit": a["commit"]}, "b": {"ref": b["ref"], "commit": b["commit"]}}
    result.update(runs=runs, steps=steps, spec=str(spec_file), repo=str(root))
    (work / "comparison.json").write_text(json.dumps(result, indent=1))
    histories = [[h for h in (read_history(Path(r["metrics"])) for r in s["runs"]) if h] for s in sides]
    plots = plot_comparison(result, work / "plots", histories[0], histories[1])
    extra = {"A": f"{a['ref']} ({a['commit'][:12]})", "B": f"{b['ref']} ({b['commit'][:12]})", "runs per ref": runs,
             "steps": steps or spec.optim.steps, "repository": str(root)}
    html_path = write_comparison_html(result, work / "comparison.html", plots, extra)
    run_id = task(record_comparison, "record-comparison")(spec, result, work, plots)
    return {"verdict": result["verdict"], "regression": result["regression"], "summary": result["summary"],
            "p_value": result["p_value"], "run_id": run_id, "work_dir": str(work),
            "comparison": str(work / "comparison.json"), "html": str(html_path),
            "malformed": {s["side"]: [s["pooled"]["n_malformed"], s["pooled"]["n_samples"]] for s in sides}}


def record_comparison(spec, result: dict, work: Path, plots: list[Path]) -> str:
    """One MLflow run for the comparison; returns its id."""
    from tasks import lineage
    from tasks.spec import spec_hash

    client = lineage.setup(spec)
    experiment_id = client.get_experiment_by_name(spec.tracking.experiment).experiment_id
    a, b = result["refs"]["a"], result["refs"]["b"]
    run = client.create_run(experiment_id, tags={"mlflow.runName": f"regression {a['ref']} vs {b['ref']}"})
    run_id = run.info.run_id
    try:
        lineage.set_tags(client, run_id, {
            "kind": "regression", "verdict": result["verdict"], "summary": result["summary"], "status": result["verdict"],
            "ref_a": a["ref"], "ref_b": b["ref"], "commit_a": a["commit"], "commit_b": b["commit"],
            "spec_hash": spec_hash(spec), "base_model": spec.model.name_or_path, "work_dir": str(work)})
        lineage.log_params(client, run_id, {
            "ref_a": a["ref"], "ref_b": b["ref"], "commit_a": a["commit"], "commit_b": b["commit"], "runs": str(result["runs"]),
            "steps": str(result["steps"] or spec.optim.steps), "alpha": str(result["alpha"]), "repo": result["repo"],
            "probe.n": str(spec.probe.n), "probe.temperature": str(spec.probe.temperature),
            "probe.max_tokens": str(spec.probe.max_tokens)})
        metrics = {"p_value": result["p_value"], "regression": float(result["regression"])}
        for side in ("a", "b"):
            s = result[side]
            metrics.update({f"malformed_rate_{side}": s["malformed_rate"], f"malformed_ci_low_{side}": s["malformed_ci"][0],
                            f"malformed_ci_high_{side}": s["malformed_ci"][1], f"n_malformed_{side}": s["n_malformed"],
                            f"n_samples_{side}": s["n_samples"], f"parity_failed_{side}": s["n_parity_failed"]})
        for k, v in metrics.items():
            client.log_metric(run_id, k, float(v))
        for name in ("pooled_a.json", "pooled_b.json", "comparison.json", "comparison.html", "spec.yaml"):
            client.log_artifact(run_id, str(work / name))
        client.log_artifacts(run_id, str(work / "probes"), "probes")
        for p in plots:
            client.log_artifact(run_id, str(p), "plots")
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
    return run_id


# ── Prefect ────────────────────────────────────────────────────────────────────────────────────────

def regression_flow():
    """The `ballast-regression` Prefect flow (built on call, so importing this module does not import Prefect)."""
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    def as_task(fn, name):
        return task(fn, name=name, cache_policy=NO_CACHE, persist_result=False)

    @flow(name="ballast-regression", persist_result=False, log_prints=True)
    def ballast_regression(spec: str, refs: list[str], runs: int = 1, steps: int | None = None, repo: str | None = None,
                           overrides: list[str] | None = None, alpha: float = 0.01, work_dir: str | None = None) -> dict:
        summary = run_regression(spec, refs, runs=runs, steps=steps, repo=repo, overrides=overrides or [], alpha=alpha,
                                 work_dir=work_dir, task=as_task)
        print(summary["summary"])
        return summary
    return ballast_regression


# ── CLI ────────────────────────────────────────────────────────────────────────────────────────────

def cmd_regress(args) -> int:
    from flows.pipeline import configure_prefect
    from tasks.spec import load_spec

    if len(args.ref) != 2:
        raise UserError(f"give exactly two refs: --ref A --ref B (A the reference, B the candidate); got {args.ref or 'none'}", 2)
    if args.runs < 1:
        raise UserError(f"--runs {args.runs}: give 1 or more runs per ref", 2)
    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps {args.steps}: give 1 or more steps", 2)
    spec = load_spec(args.spec, args.set)  # a bad spec fails here, before any worktree exists (exit 2)
    root = repo_root(args.repo)
    for ref in args.ref:
        resolve_commit(root, ref)
    configure_prefect(spec.project_dir)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # a busy machine starts it slowly
    summary = regression_flow()(str(Path(args.spec).resolve()), list(args.ref), runs=args.runs, steps=args.steps,
                                repo=str(root), overrides=list(args.set), alpha=args.alpha, work_dir=args.work_dir)
    print(summary["summary"])
    print(f"report: {summary['html']}")
    print(f"MLflow run: {summary['run_id']}")
    return 1 if summary["regression"] else 0


@command("regress", "train one spec on two code refs, probe every final artifact, compare (exit 1 on a regression)")
def _p_regress(p):
    p.add_argument("spec", help="experiment YAML, trained unchanged on both refs")
    p.add_argument("--ref", action="append", default=[], metavar="REF",
                   help="a commit, branch or tag; give two: the reference A, then the candidate B")
    p.add_argument("--runs", type=int, default=1, help="training runs per ref (seeds +0..K-1, the same on both refs)")
    p.add_argument("--steps", type=int, help="training steps per run (overrides optim.steps)")
    p.add_argument("--repo", help="git checkout of the training codebase (default: this repository)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field, on both refs")
    p.add_argument("--alpha", type=float, default=0.01, help="significance level of the one-sided Fisher exact test")
    p.add_argument("--work-dir", help="where worktrees, runs and reports go (default <project_dir>/regressions/<time>-<A>-<B>)")
    return cmd_regress
