"""SIGKILL a pipeline run at random moments, resume each, and check that the record stays true.

    python bench/kill_resume.py                       # 20 kills of the tiny-model pipeline (Prefect, MLflow SQLite, S3)
    python bench/kill_resume.py --kills 5 --steps 9 --seed 1

One uninterrupted pipeline run is the reference. Then, `--kills` times: a fresh project, `ballast run` started and
SIGKILLed at a random moment between its first written step and its end (drawn from a seeded RNG), then
`ballast run --resume ID` until it finishes. Each resumed run is checked against the reference:

- every per-step metric in MLflow appears exactly once per step (the steps metrics.jsonl has a value for), with the
  reference's value (timings excepted);
- the artifact store (S3 on a moto server on loopback; the one stand-in) holds the final checkpoint;
- the final adapter is bit-identical to the reference's.

Prints a row per kill and a summary line; exits 1 if any check failed. tests/test_resume_records.py is the
deterministic version of one such kill (after MLflow took steps past the last checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CLI = "import sys; from flows.cli import main; sys.exit(main())"
TIMING = ("time/", "step_time", "tokens_per_second")


def ballast(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CLI, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def write_spec(where: Path, model: str, steps: int, bucket: str) -> Path:
    from tests.conftest import tiny_spec

    spec = tiny_spec(
        model,
        name="kill-resume",
        project_dir=str(where / "project"),
        optim={"steps": steps, "learning_rate": 3e-3},
        checkpoint={"every": 3, "keep_last": 3},
        probe={"enabled": False},
        storage={"uri": f"s3://{bucket}/{where.name}"},
    )
    path = where / "spec.yaml"
    where.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec))
    return path


def first_step_written(project: Path) -> bool:
    return any(p.read_text().strip() for p in (project / "runs").glob("*/metrics.jsonl"))


def kill_at_random(spec: Path, env: dict, rng: random.Random, window_s: float) -> tuple[float, int | None]:
    """Start the run, SIGKILL it at a random moment of its training window; (seconds after step 1, exit code)."""
    project = spec.parent / "project"
    proc = ballast(["run", str(spec)], env)
    while not first_step_written(project):
        if proc.poll() is not None:
            return 0.0, proc.returncode
        time.sleep(0.05)
    delay = rng.uniform(0.0, window_s)
    try:
        proc.wait(timeout=delay)
        return delay, proc.returncode  # finished before the moment came: the resume has nothing to replay
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return delay, -9


def checks(project: Path, reference: dict, steps: int, bucket: str, s3) -> dict[str, bool]:
    import torch
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    run_dir = next((project / "runs").iterdir())
    run_id = run_dir.name
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    local = {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    from tasks.record import HEADLINE, HEADLINE_KEYS

    copied = {HEADLINE + name: source for source, name in HEADLINE_KEYS.items()}  # `_headline/x` copies a metric
    per_step = [k for k in client.get_run(run_id).data.metrics if not copied.get(k, k).startswith(("eval/", "probe/"))]
    once, same = True, True
    for mlflow_key in per_step:
        key = copied.get(mlflow_key, mlflow_key)
        history = client.get_metric_history(run_id, mlflow_key)
        logged = sorted(s for s, m in local.items() if isinstance(m.get(key), (int, float)) and m[key] == m[key])
        counts = Counter(h.step for h in history)
        once &= sorted(counts) == logged and set(counts.values()) <= {1}
        if not key.startswith(TIMING):
            same &= all(
                abs(h.value - reference["metrics"][h.step][key]) <= 1e-6 * max(1, abs(h.value)) for h in history
            )
    prefix = f"{spec_prefix(project)}/runs/{run_id}/checkpoints/step-{steps:06d}/"
    stored = s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("KeyCount", 0) > 0
    final = f"step-{steps:06d}/adapter/adapter_model.safetensors"
    a, b = load_file(str(run_dir / "checkpoints" / final)), reference["adapter"]
    return {
        "metrics once": once,
        "reference values": same,
        "final in store": stored,
        "adapter identical": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
    }


def spec_prefix(project: Path) -> str:
    return project.parent.name


def reference_run(work: Path, model: str, steps: int, bucket: str, env: dict) -> tuple[dict, float]:
    from safetensors.torch import load_file

    spec = write_spec(work / "reference", model, steps, bucket)
    proc = ballast(["run", str(spec)], env)
    while not first_step_written(spec.parent / "project") and proc.poll() is None:
        time.sleep(0.05)
    started = time.monotonic()  # the window a kill can fall in: from the first written step to the run's end
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"the reference run failed:\n{err[-3000:]}")
    seconds = time.monotonic() - started
    run_dir = next((spec.parent / "project" / "runs").iterdir())
    metrics = {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    adapter = load_file(str(run_dir / "checkpoints" / f"step-{steps:06d}/adapter/adapter_model.safetensors"))
    return {"metrics": metrics, "adapter": adapter}, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default=str(REPO / ".ballast" / "bench" / "kill-resume"))
    args = parser.parse_args()

    import logging
    import shutil

    import boto3
    from moto.server import ThreadedMotoServer

    from flows.runtime import free_port
    from trainer.tiny import SHIPPED

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    aws = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_"))}, **aws}
    s3 = boto3.client(
        "s3",
        endpoint_url=aws["AWS_ENDPOINT_URL"],
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    bucket = "ballast-kill-resume"
    s3.create_bucket(Bucket=bucket)
    model = str(SHIPPED)
    try:
        reference, seconds = reference_run(work, model, args.steps, bucket, env)
        print(f"reference run: {seconds:.0f} s from its first step to its end; {args.kills} runs killed in that window")
        rng, failures = random.Random(args.seed), 0
        print(f"{'kill':>4} {'at s':>6} {'exit':>5} {'resume s':>9}  checks")
        for i in range(args.kills):
            spec = write_spec(work / f"kill-{i:02d}", model, args.steps, bucket)
            delay, code = kill_at_random(spec, env, rng, window_s=seconds)
            run_id = next((spec.parent / "project" / "runs").iterdir()).name
            started = time.monotonic()
            resumed = ballast(["run", "--resume", run_id, "--project-dir", str(spec.parent / "project")], env)
            _, err = resumed.communicate()
            took = time.monotonic() - started
            if resumed.returncode != 0:
                failures += 1
                print(f"{i:>4} {delay:>6.1f} {code!s:>5} {took:>9.0f}  RESUME FAILED: {err.strip().splitlines()[-1]}")
                continue
            result = checks(spec.parent / "project", reference, args.steps, bucket, s3)
            failures += not all(result.values())
            shown = ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in result.items())
            print(f"{i:>4} {delay:>6.1f} {code!s:>5} {took:>9.0f}  {shown}", flush=True)
        print(f"{args.kills - failures} of {args.kills} killed-and-resumed runs kept a true record")
        return 1 if failures else 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
