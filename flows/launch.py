"""`ballast launch`: the pipeline on a GPU node that SkyPilot provisions (infra/skypilot.py says what goes there).

    ballast launch SPEC [--set K=V]... [--cluster NAME] [--dryrun] [--yaml OUT] [--down] [--idle-minutes N]

`--dryrun` validates the spec and the SkyPilot task, writes both (the resolved spec and the task YAML,
under <project_dir>/launch/ unless --yaml says where), prints the plan and the `sky launch` command, and
contacts nothing. Without it the cluster is provisioned (or reused) and the run's log streams here.
"""
from __future__ import annotations

from pathlib import Path

from flows.cli import UserError, command

REPO = Path(__file__).resolve().parent.parent


def cmd_launch(args) -> int:
    from infra.skypilot import LaunchError, launch, plan_launch, sky_launch_command, write_task_yaml
    from tasks.spec import dump_spec, load_spec

    spec = load_spec(args.spec, args.set)
    try:
        plan, resolved = plan_launch(spec, REPO, dump_spec=dump_spec, cluster=args.cluster)
    except LaunchError as e:
        raise UserError(str(e), 2) from None
    out_dir = Path(spec.project_dir) / "launch"
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_file = out_dir / f"{plan.name}.spec.yaml"
    spec_file.write_text(plan.spec_yaml)
    task_yaml = Path(args.yaml) if args.yaml else out_dir / f"{plan.name}.sky.yaml"
    try:
        write_task_yaml(plan, spec_file, task_yaml)
    except LaunchError as e:
        raise UserError(str(e), 2) from None
    resources = ", ".join(f"{k}={v}" for k, v in plan.resources.items()) or "SkyPilot's default"
    print(f"cluster {plan.name}: {plan.num_nodes} node(s), {resources}")
    print(f"runs:   {plan.run}   (spec: {spec_file})")
    if plan.secret_names:
        print(f"secrets from this environment: {', '.join(plan.secret_names)}")
    for note in plan.notes:
        print(f"note:   {note}")
    print(f"task:   {task_yaml}")
    if args.dryrun:
        print(f"dry run: nothing launched. By hand:  {sky_launch_command(plan, task_yaml, args.down)}")
        return 0
    try:
        job_id = launch(plan, spec_file, down=args.down, idle_minutes_to_autostop=args.idle_minutes)
    except LaunchError as e:
        raise UserError(str(e)) from None
    except Exception as e:  # SkyPilot's own errors: no cloud enabled, quota, capacity, ...
        raise UserError(f"SkyPilot could not launch {plan.name}: {type(e).__name__}: {str(e).strip().splitlines()[0]} "
                        "(run `sky check` to see which clouds or Kubernetes contexts are enabled)") from None
    print(f"job {job_id} on {plan.name}: `sky logs {plan.name} {job_id}` follows it, `sky down {plan.name}` ends the cluster")
    return 0


@command("launch", "run the pipeline on a GPU node provisioned with SkyPilot")
def _p_launch(p):
    p.add_argument("spec", help="experiment YAML; its infra: section says what to provision")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--cluster", help="SkyPilot cluster name (default ballast-<spec name>); an existing one is reused")
    p.add_argument("--dryrun", action="store_true", help="validate and write the task; launch nothing")
    p.add_argument("--yaml", help="where to write the SkyPilot task YAML (default <project_dir>/launch/<cluster>.sky.yaml)")
    p.add_argument("--down", action="store_true", help="tear the cluster down when the run ends")
    p.add_argument("--idle-minutes", type=int, default=None, help="stop the cluster after this many idle minutes")
    return cmd_launch
