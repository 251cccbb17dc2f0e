"""SkyPilot: run a Ballast pipeline on a GPU node provisioned for it (Kubernetes or a cloud).

    ballast launch SPEC [--set K=V]... [--cluster NAME] [--dryrun] [--yaml OUT] [--down]

What goes to the node, and why:

- **The code** is this checkout (`workdir`, synced by SkyPilot, which skips what `.gitignore` names),
  installed there by `scripts/install.sh` — the same install a newcomer runs; on a node with
  `nvidia-smi` it keeps or installs a CUDA build of torch. With `rollout.engine: vllm` the setup also
  creates the separate vLLM environment (`scripts/vllm_env.sh --gpu`).
- **The spec** is the one validated here, overrides applied, written to a file and mounted at
  `~/.ballast-launch/<cluster>.yaml`: the node runs exactly what `--dryrun` showed, not a re-read of a
  file that may have changed.
- **The GPU split.** With two or more GPUs (`infra.accelerators: H200:2`), `rollout.engine: vllm`
  and no devices set, the trainer gets `cuda:0` and the vLLM server `cuda:1` (DESIGN: trainer on
  GPU 0, inference on GPU 1). Devices the spec sets are left alone.
- **Secrets** never travel in the spec or the task YAML. `infra.env` names environment variables
  (`HF_TOKEN`, `AWS_ACCESS_KEY_ID`, ...); their values are read from this machine's environment at
  launch and handed to SkyPilot as `secrets` (which it redacts in its own logs). The YAML that
  `--yaml` writes lists the names only, for `sky launch --secret NAME` by hand.
- **Where results go.** The node's embedded stores (`.ballast/` MLflow SQLite, local artifacts)
  vanish with the node. `launch` says so when `tracking.uri` or `storage.uri` is unset: set them to a
  team MLflow server (or PostgreSQL) and `s3://…` to keep the lineage and the checkpoints.

This module builds and launches; it imports SkyPilot lazily (the `cloud` extra) and knows nothing
of Prefect or MLflow. Launching needs SkyPilot configured for a cloud or Kubernetes (`sky check`);
`--dryrun` needs neither: it validates the task against SkyPilot's own schema and stops.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.extras import require_extra

REMOTE_SPEC_DIR = "~/.ballast-launch"
ACCELERATORS_RE = re.compile(r"^[A-Za-z0-9][\w\-]*(:\d+(\.\d+)?)?$")  # 'H200', 'H200:2', 'A100-80GB:8', 'tpu-v5e:0.5'


class LaunchError(ValueError):
    """A launch that cannot be built as asked; the message names the field and the fix."""


@dataclass
class LaunchPlan:
    """Everything `launch` hands to SkyPilot, in plain values (what --dryrun prints)."""

    name: str
    workdir: str
    setup: str
    run: str
    spec_yaml: str  # the resolved spec the node runs
    resources: dict[str, Any]
    num_nodes: int = 1
    secret_names: list[str] = field(default_factory=list)
    envs: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def task_config(self, spec_file: str | Path, with_secret_values: bool = False) -> dict[str, Any]:
        """The SkyPilot task as a YAML-able dict. Secret values only with `with_secret_values` (for the
        in-process launch); otherwise names with no value, which `sky launch --secret NAME` fills."""
        secrets = {name: (os.environ[name] if with_secret_values else None) for name in self.secret_names}
        config: dict[str, Any] = {
            "name": self.name,
            "workdir": self.workdir,
            "num_nodes": self.num_nodes,
            "resources": self.resources,
            "setup": self.setup,
            "run": self.run,
            "file_mounts": {f"{REMOTE_SPEC_DIR}/{self.name}.yaml": str(Path(spec_file).absolute())},
        }
        if self.envs:
            config["envs"] = dict(self.envs)
        if secrets:
            config["secrets"] = secrets
        return config


def accelerator_count(accelerators: str | None) -> float:
    if not accelerators:
        return 0
    _, _, count = accelerators.partition(":")
    return float(count) if count else 1


def plan_launch(spec, repo_root: Path, *, dump_spec, cluster: str | None = None) -> tuple[LaunchPlan, Any]:
    """(plan, the spec the node will run). `dump_spec` turns a spec into YAML (tasks/spec.py's), passed in so
    that infra/ does not import tasks/. Refused (MissingExtra) where SkyPilot is not installed: the plan is
    validated by its schema."""
    require_extra("cloud", "ballast launch")
    infra = spec.infra
    if infra.accelerators and not ACCELERATORS_RE.match(infra.accelerators):
        raise LaunchError(
            f"infra.accelerators={infra.accelerators!r} is not NAME or NAME:COUNT (e.g. 'H200:2', 'A100-80GB:8')"
        )
    missing = [name for name in infra.env if name not in os.environ]
    if missing:
        raise LaunchError(
            f"infra.env names {missing[0]!r}, which is not set in this environment; export it before "
            "launching (its value is read at launch and passed to the node as a SkyPilot secret)"
        )
    spec, notes = _node_spec(spec)
    setup = ["set -e", "bash scripts/install.sh"]
    if spec.rollout.engine == "vllm" and not spec.rollout.vllm_url:
        setup.append("bash scripts/vllm_env.sh --gpu")
    name = cluster or _cluster_name(spec.name)
    plan = LaunchPlan(
        name=name,
        workdir=str(Path(repo_root).absolute()),
        setup="\n".join(setup),
        run=f"python3 -m flows.cli run {REMOTE_SPEC_DIR}/{name}.yaml",
        spec_yaml=dump_spec(spec),
        resources=_resources(infra),
        num_nodes=infra.num_nodes,
        secret_names=list(infra.env),
        envs={"PYTHONUNBUFFERED": "1"},
        notes=notes,
    )
    return plan, spec


def _node_spec(spec) -> tuple[Any, list[str]]:
    """(a copy of the spec as the node runs it, notes for the user): with two GPUs and vLLM, the trainer on cuda:0
    and the server on cuda:1; notes on a CPU device on a GPU node and on stores the node would lose."""
    notes: list[str] = []
    spec, infra = spec.model_copy(deep=True), spec.infra
    gpus = accelerator_count(infra.accelerators)
    if (
        spec.rollout.engine == "vllm"
        and gpus >= 2
        and spec.rollout.device is None
        and spec.model.device in ("auto", "cuda")
    ):
        spec.model.device, spec.rollout.device = "cuda:0", "cuda:1"
        notes.append("two GPUs and rollout.engine: vllm: trainer on cuda:0, vLLM server on cuda:1")
    elif spec.rollout.engine == "vllm" and gpus < 2 and infra.accelerators:
        notes.append(f"{infra.accelerators}: the vLLM server shares the trainer's GPU (capped at 30 % of its memory)")
    if spec.model.device == "cpu" and gpus:
        notes.append(
            f"model.device is 'cpu' but the node has {infra.accelerators}; set model.device: auto to train on the GPU"
        )
    if not spec.tracking.uri:
        notes.append(
            "tracking.uri is unset: MLflow lives in the node's .ballast/mlflow.db and is lost when the node goes; "
            "set tracking.uri to a team MLflow server or postgresql://… to keep the lineage"
        )
    if not spec.storage.uri or not str(spec.storage.uri).startswith("s3://"):
        notes.append("storage.uri is not s3://…: checkpoints stay on the node's disk and are lost when it goes")
    return spec, notes


def _resources(infra) -> dict[str, Any]:
    """The spec's infra section as SkyPilot's `resources:` (accelerators, infra, cpus, memory, use_spot)."""
    resources: dict[str, Any] = {}
    if infra.accelerators:
        resources["accelerators"] = infra.accelerators
    for key in ("cloud", "cpus", "memory"):
        value = getattr(infra, key)
        if value:
            resources["infra" if key == "cloud" else key] = str(value)
    if infra.use_spot:
        resources["use_spot"] = True
    return resources


def _cluster_name(name: str) -> str:
    """SkyPilot cluster names: lower case letters, digits and dashes, starting with a letter."""
    slug = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-") or "run"
    return ("ballast-" + slug)[:40].rstrip("-")


def to_sky_task(config: dict[str, Any]):
    """A sky.Task from the config, through SkyPilot's own schema validation (an invalid field fails here)."""
    import sky

    try:
        return sky.Task.from_yaml_config(dict(config))
    except Exception as e:  # SkyPilot raises ValueError / jsonschema errors with its own wording
        raise LaunchError(f"SkyPilot refused the task: {str(e).strip().splitlines()[0]}") from None


def write_task_yaml(plan: LaunchPlan, spec_file: Path, out: Path) -> Path:
    """The task as a YAML file for `sky launch` by hand: secret names only, never values."""
    import yaml

    config = plan.task_config(spec_file)
    to_sky_task(config)  # validated before anyone runs it
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def sky_launch_command(plan: LaunchPlan, task_yaml: Path, down: bool, idle_minutes: int | None = None) -> str:
    """The `sky launch` line that does by hand what `launch` does (the secrets' values from the environment)."""
    parts = ["sky", "launch", "-c", plan.name, str(task_yaml)]
    for name in plan.secret_names:
        parts += ["--secret", name]
    if down:
        parts.append("--down")
    if idle_minutes is not None:
        parts += ["--idle-minutes-to-autostop", str(idle_minutes)]
    return shlex.join(parts)


def launch(
    plan: LaunchPlan, spec_file: Path, *, down: bool = False, idle_minutes_to_autostop: int | None = None
) -> int:
    """Provision (or reuse) the cluster, run the pipeline on it and stream its log. Returns the job's id."""
    import sky

    task = to_sky_task(plan.task_config(spec_file, with_secret_values=True))
    request = sky.launch(task, cluster_name=plan.name, down=down, idle_minutes_to_autostop=idle_minutes_to_autostop)
    job_id, _handle = sky.stream_and_get(request)
    return job_id
