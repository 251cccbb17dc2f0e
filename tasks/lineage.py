"""MLflow lineage: one run per pipeline run, the stages as nested runs, and what ties runs together.

Tags on the pipeline run (all under `ballast.`): `parent_run_id` and `parent_step` (what it was forked
from), `fork_checkpoint`, `code_commit` and `code_dirty`, `spec_hash`, `base_model`,
`data_fingerprint`, `output_dir`, `checkpoint_prefix` (where its checkpoints live in the artifact
store), `status` (running | finished | collapsed | probe_failed | failed) and `stop_reason`.
Params are the flattened spec (secrets redacted by tasks/spec.py). Step metrics go to the pipeline
run through a background thread in batches (`MetricsSink`), so logging never slows a step.
Artifacts: spec.yaml, checkpoints.json (URIs), probe reports, plots (PNG) and report.html.

The embedded default is SQLite under the project folder; `tracking.uri` points at a team server
(PostgreSQL backend) instead. `chain(run_id)` walks fork lineage back to the root.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

import mlflow
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

TAG = "ballast."


def tracking_uri(spec) -> str:
    if spec.tracking.uri:
        return spec.tracking.uri
    db = Path(spec.project_dir).resolve() / "mlflow.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"


def setup(spec) -> MlflowClient:
    """Point MLflow at the spec's tracking store and make sure the experiment exists (artifacts of the
    embedded store live under the project folder, not wherever the command was started)."""
    uri = tracking_uri(spec)
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    if client.get_experiment_by_name(spec.tracking.experiment) is None:
        location = None
        if uri.startswith("sqlite:"):
            location = (Path(spec.project_dir).resolve() / "mlruns").as_uri()
        client.create_experiment(spec.tracking.experiment, artifact_location=location)
    mlflow.set_experiment(spec.tracking.experiment)
    return client


class MetricsSink:
    """Queues step metrics and sends them with log_batch from a background thread, at most every
    `flush_seconds` (and at close). One log_batch per step cost ~17 ms of CPU on SQLite, taken from the
    training thread through the GIL; batched, MLflow sees the curves ~2 s late and training loses nothing.
    `every` (tracking.log_every) sends only every N-th step's metrics."""

    flush_seconds = 2.0

    def __init__(self, client: MlflowClient, run_id: str, every: int = 1):
        self.client, self.run_id, self.every = client, run_id, every
        self.q: queue.Queue = queue.Queue()
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step % self.every and not any(k.startswith("eval/") for k in metrics):
            return
        ts = int(time.time() * 1000)
        self.q.put([Metric(k, float(v), ts, step) for k, v in metrics.items()
                    if k != "step" and isinstance(v, (int, float)) and v == v])

    def _work(self) -> None:
        pending: list[Metric] = []
        last_flush = time.monotonic()
        while True:
            try:
                item = self.q.get(timeout=self.flush_seconds)
            except queue.Empty:
                item = []
            if item:
                pending += item
            due = time.monotonic() - last_flush >= self.flush_seconds
            if pending and (item is None or due):
                try:
                    for i in range(0, len(pending), 1000):
                        self.client.log_batch(self.run_id, metrics=pending[i:i + 1000])
                except Exception as e:  # keep training; report at close
                    self.error = e
                pending, last_flush = [], time.monotonic()
            if item is None:
                return

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=60)
        if self.error:
            raise RuntimeError(f"could not log metrics to MLflow run {self.run_id}: {self.error}")


def set_tags(client: MlflowClient, run_id: str, tags: dict) -> None:
    for k, v in tags.items():
        if v is not None:
            client.set_tag(run_id, k if k.startswith(TAG) or k.startswith("mlflow.") else TAG + k, str(v))


def log_params(client: MlflowClient, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param
    items = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(items), 100):
        client.log_batch(run_id, params=items[i:i + 100])


def find_run(client: MlflowClient, run_id: str):
    try:
        return client.get_run(run_id)
    except Exception:
        raise ValueError(f"MLflow run {run_id!r} was not found in {mlflow.get_tracking_uri()}; "
                         "check the run id (ballast ui lists runs) and tracking.uri") from None


def chain(client: MlflowClient, run_id: str) -> list[dict]:
    """[this run, its parent, its parent's parent, ...] as {run_id, parent_step, fork_checkpoint}."""
    out, seen = [], set()
    while run_id and run_id not in seen:
        seen.add(run_id)
        tags = find_run(client, run_id).data.tags
        out.append({"run_id": run_id, "parent_step": tags.get(TAG + "parent_step"),
                    "fork_checkpoint": tags.get(TAG + "fork_checkpoint")})
        run_id = tags.get(TAG + "parent_run_id")
    return out


# ---------------------------------------------------------------------------------- plots and report

PLOTS = {
    "reward": ["reward", "eval/reward", "eval/accuracy"],
    "kl": ["kl", "kl/k1", "kl/k2", "kl/k3"],
    "length": ["completions/mean_length", "completions/max_length", "completions/clipped_ratio"],
    "health": ["health/ngram_repetition", "health/unique_token_ratio", "health/garbage_ratio", "rollout/logprob_diff_max", "entropy"],
}


SMOOTH, SMOOTH_FROM = 5, 20  # rolling mean over 5 steps for curves of 20 points or more


def plot_history(history: list[dict], out_dir: Path) -> list[Path]:
    """One PNG per group of PLOTS; eval/* points (step 0 too, with eval.on_start) drawn as markers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, keys in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
        drawn = False
        for k in keys:
            pts = [(m["step"], m[k]) for m in history if k in m and m[k] == m[k]]
            if len(pts) >= SMOOTH_FROM:  # noisy per-step values: faint, with their rolling mean on top
                line, = ax.plot(*zip(*pts), alpha=0.3, linewidth=1)
                xs, ys = zip(*pts)
                means = [sum(ys[max(0, i - SMOOTH + 1):i + 1]) / len(ys[max(0, i - SMOOTH + 1):i + 1]) for i in range(len(ys))]
                ax.plot(xs, means, color=line.get_color(), label=f"{k} (mean of {SMOOTH})")
                drawn = True
            elif pts:
                ax.plot(*zip(*pts), marker=".", label=k)
                drawn = True
        ax.set_xlabel("step")
        ax.set_title(name)
        if drawn:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def html_report(title: str, summary: dict, plots: list[Path], probe: dict | None) -> str:
    import base64
    import html

    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in summary.items())
    imgs = "".join(f'<img alt="{p.stem}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">' for p in plots)
    probe_html = ""
    if probe:
        verdict = "PASSED" if probe.get("passed") else "FAILED"
        probe_html = (f"<h2>Artifact probe: {verdict}</h2><p>{probe.get('n_malformed')} of {probe.get('n_samples')} samples malformed "
                      f"(rate {probe.get('malformed_rate', 0):.3f}, 95% CI {probe.get('malformed_ci')}); parity ok: {probe.get('parity_ok')}</p>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
            "body{font-family:system-ui,sans-serif;margin:2em;max-width:1300px}table{border-collapse:collapse}"
            "th,td{border:1px solid #ccc;padding:4px 8px;text-align:left}img{margin:6px;border:1px solid #eee}</style></head>"
            f"<body><h1>{html.escape(title)}</h1><table>{rows}</table>{probe_html}<h2>Curves</h2>{imgs}</body></html>")
