"""Regression stages: the same experiment on two code refs of a training codebase, every final artifact probed
by this checkout's probe, the two sides compared (flows/regression.py runs them in order).

1. The spec is validated *here* and written, paths made absolute, to the work directory; both refs train from
   that one file (same fork source, seeds and data). Only the fields the spec sets are written, so an older ref
   whose schema lacks a newer field still reads it.
2. Each ref is checked out as a detached git worktree of the repository (this one, or `--repo`).
3. Each ref trains the spec K times *with its own code* (`python -m flows.cli train` in a subprocess whose
   working directory and PYTHONPATH are the worktree); run k of both refs uses seeds +k. The manifest's code_ref
   of each final checkpoint must be the ref's commit — proof the ref's code wrote it.
4. Every final checkpoint is probed here, so both sides are judged by the same detectors; an artifact that cannot
   be loaded counts as a failed probe that fails parity.
5. The reports are pooled per ref and compared (tasks/compare.py: one-sided Fisher exact test, parity); the
   answer is a `RegressionResult`, written as comparison.json.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tasks.compare import Comparison, compare, plot_comparison, pool_reports, read_history, write_comparison_html
from tasks.probe import probe_checkpoint
from tasks.results import ProbeError, ProbeFailure
from tasks.spec import ExperimentSpec, load_spec, set_path
from trainer.checkpoint import Checkpoint, CheckpointError, list_checkpoints
from trainer.model import ensure_model

REPO_ROOT = Path(__file__).resolve().parent.parent
STDERR_TAIL = 3000  # characters of a failed training's stderr quoted in the error


class RegressionError(RuntimeError):
    """A regression run that could not be carried out (a ref that does not train, a run that saved nothing)."""


@dataclass
class Side:
    name: str  # "a" (the reference) or "b" (the candidate)
    ref: str
    commit: str
    worktree: Path
    runs: list[dict] = field(default_factory=list)  # {checkpoint, metrics, seconds, returncode} per run
    reports: list[dict] = field(default_factory=list)  # probe reports (JSON form) per run
    pooled: dict = field(default_factory=dict)


@dataclass
class RegressionPlan:
    spec: ExperimentSpec  # the validated spec both refs train
    spec_file: Path
    work: Path
    repo: Path
    sides: list[Side]
    runs: int
    steps: int | None


@dataclass
class RegressionResult:
    """What a regression run found: the comparison of the two refs' pooled probes, and where its outputs are."""

    comparison: Comparison  # A is side "a" (the reference), B side "b" (the candidate)
    refs: dict[str, dict[str, str]]  # {"a": {"ref", "commit"}, "b": {"ref", "commit"}}
    runs: int  # training runs per ref
    steps: int | None  # training steps per run (None: the spec's optim.steps)
    spec: str  # the spec file both refs trained
    repo: str
    work_dir: str
    plots: list[str] = field(default_factory=list)
    html: str | None = None  # comparison.html
    run_id: str | None = None  # the MLflow comparison run, once recorded (tasks/record.py: record_regression)

    @property
    def regression(self) -> bool:
        return self.comparison.regression

    @property
    def verdict(self) -> str:
        return self.comparison.verdict

    @property
    def summary(self) -> str:
        return self.comparison.summary

    def to_dict(self) -> dict:
        """comparison.json: the comparison's fields at the top level, then the refs and how they were trained."""
        return {
            **self.comparison.to_dict(),
            "refs": self.refs,
            "runs": self.runs,
            "steps": self.steps,
            "spec": self.spec,
            "repo": self.repo,
        }


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
        raise ValueError(
            f"--repo {where} is not inside a git repository ({proc.stderr.strip()[:200]}); "
            "give the path of a git checkout of the training codebase"
        )
    return Path(proc.stdout.strip())


def resolve_commit(repo: Path, ref: str) -> str:
    proc = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise ValueError(f"--ref {ref!r} is not a commit, branch or tag of {repo}; check `git -C {repo} log --oneline`")
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


def resolved_spec(spec_path: str | Path, overrides: list[str], out: Path) -> tuple[ExperimentSpec, Path]:
    """(validated spec, path of the spec file both refs train from): the user's fields only, overrides applied,
    filesystem paths made absolute against the current directory."""
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


def train_at_ref(
    worktree: Path,
    commit: str,
    spec_file: Path,
    out_dir: Path,
    run_index: int,
    spec: ExperimentSpec,
    steps: int | None = None,
) -> dict:
    """Train the spec with the code in `worktree` (a subprocess); {checkpoint, metrics, seconds, returncode}."""
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "train",
        str(spec_file),
        "--output",
        str(out_dir),
        "--quiet",
        "--set",
        f"optim.seed={spec.optim.seed + run_index}",
        "--set",
        f"rollout.seed={spec.rollout.seed + run_index}",
    ]
    if steps:
        cmd += ["--steps", str(steps)]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(worktree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
        TOKENIZERS_PARALLELISM="false",
    )
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=worktree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    (out_dir / "train.log").parent.mkdir(parents=True, exist_ok=True)
    (out_dir / "train.log").write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    if proc.returncode not in (0, 3):  # 3: the health gate stopped the run; its last checkpoint is still probed
        raise RegressionError(
            f"training at commit {commit[:12]} (run {run_index}) exited {proc.returncode}; "
            f"log: {out_dir / 'train.log'}\n{proc.stderr[-STDERR_TAIL:]}"
        )
    found = list_checkpoints(out_dir / "checkpoints")
    if not found:
        raise RegressionError(
            f"training at commit {commit[:12]} (run {run_index}) saved no checkpoint; log: {out_dir / 'train.log'}"
        )
    checkpoint = found[-1][1]
    _check_written_by(checkpoint, commit)
    return {
        "checkpoint": str(checkpoint),
        "metrics": str(out_dir / "metrics.jsonl"),
        "seconds": seconds,
        "returncode": proc.returncode,
    }


def _check_written_by(checkpoint: Path, commit: str) -> None:
    """The manifest's code_ref must be `commit`: proof that the ref's code, not another copy, wrote the checkpoint."""
    try:
        ran = (Checkpoint.open(checkpoint, verify=False).code_ref or {}).get("commit")
    except CheckpointError:  # incomplete: the probe says so, as a failed probe
        return
    if ran and ran != "unknown" and ran != commit:
        raise RegressionError(
            f"the run for commit {commit[:12]} was written by code at commit {ran[:12]}: the worktree's code "
            "was shadowed (an installed copy of the package, or PYTHONPATH); install Ballast in editable "
            "mode from one checkout only, or run from a clean environment"
        )


def probe_or_error(checkpoint: str, spec: ExperimentSpec, cache_dir: Path) -> dict:
    """This checkout's probe of one artifact, as JSON; an artifact that cannot be loaded becomes a failed entry."""
    try:
        return probe_checkpoint(checkpoint, spec.probe, spec.model, cache_dir, lora_cfg=spec.lora).to_dict()
    except ProbeError as e:
        return ProbeFailure(checkpoint, str(e)).to_dict()


# ── the plan, the worktrees, the comparison ────────────────────────────────────────────────────────


def plan_regression(
    spec_path: str,
    refs: list[str],
    runs: int = 1,
    steps: int | None = None,
    repo: str | None = None,
    overrides: list[str] = (),
    work_dir: str | None = None,
) -> RegressionPlan:
    """Validate the arguments and the spec, resolve the refs to commits, write the spec both refs train."""
    if len(refs) != 2:
        raise ValueError(f"give exactly two refs (--ref A --ref B); got {len(refs)}: {refs}")
    if runs < 1:
        raise ValueError(f"--runs {runs}: give 1 or more runs per ref")
    root = repo_root(repo)
    commits = [resolve_commit(root, r) for r in refs]
    project_dir = load_spec(spec_path, list(overrides)).project_dir  # a bad spec fails here, naming the field
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = (
        Path(work_dir).expanduser().resolve()
        if work_dir
        else Path(project_dir).resolve() / "regressions" / f"{stamp}-{_label(refs[0])}-{_label(refs[1])}"
    )
    work.mkdir(parents=True, exist_ok=True)
    spec, spec_file = resolved_spec(spec_path, list(overrides), work / "spec.yaml")
    ensure_model(spec.model)
    sides = [
        Side(name, ref, commit, work / "worktrees" / f"{name}-{_label(ref)}")
        for name, ref, commit in zip("ab", refs, commits)
    ]
    return RegressionPlan(spec, spec_file, work, root, sides, runs, steps)


@contextmanager
def worktrees(plan: RegressionPlan):
    """Each side's commit checked out as a worktree for the duration of the block."""
    try:
        for side in plan.sides:
            add_worktree(plan.repo, side.commit, side.worktree)
        yield plan.sides
    finally:
        for side in plan.sides:
            if side.worktree.exists():
                remove_worktree(plan.repo, side.worktree)


def compare_sides(plan: RegressionPlan, alpha: float) -> RegressionResult:
    """Pool each side's reports, compare A with B, write comparison.json, the plots and comparison.html."""
    (plan.work / "probes").mkdir(exist_ok=True)
    for side in plan.sides:
        for k, report in enumerate(side.reports):
            (plan.work / "probes" / f"{side.name}-{k}.json").write_text(json.dumps(report, indent=1))
        side.pooled = {**pool_reports(side.reports, label=side.ref), "ref": side.ref, "commit": side.commit}
        (plan.work / f"pooled_{side.name}.json").write_text(json.dumps(side.pooled, indent=1))
    a, b = plan.sides
    result = RegressionResult(
        comparison=compare(a.pooled, b.pooled, alpha=alpha, labels=(a.ref, b.ref)),
        refs={s.name: {"ref": s.ref, "commit": s.commit} for s in plan.sides},
        runs=plan.runs,
        steps=plan.steps,
        spec=str(plan.spec_file),
        repo=str(plan.repo),
        work_dir=str(plan.work),
    )
    (plan.work / "comparison.json").write_text(json.dumps(result.to_dict(), indent=1))
    histories = [[h for h in (read_history(Path(r["metrics"])) for r in s.runs) if h] for s in plan.sides]
    plots = plot_comparison(result.comparison, plan.work / "plots", histories[0], histories[1])
    result.plots = [str(p) for p in plots]
    extra = {
        "A": f"{a.ref} ({a.commit[:12]})",
        "B": f"{b.ref} ({b.commit[:12]})",
        "runs per ref": plan.runs,
        "steps": plan.steps or plan.spec.optim.steps,
        "repository": str(plan.repo),
    }
    result.html = str(write_comparison_html(result.comparison, plan.work / "comparison.html", plots, extra))
    return result
