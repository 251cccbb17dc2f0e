"""Train stage: the embedded trainer, with its callbacks bound to MLflow (step metrics, batched on a
background thread) and to the artifact store (each checkpoint uploaded as it is saved). A failed upload
does not stop training — the checkpoint stage retries it — but it is recorded."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainer.loop import Callbacks, GRPOTrainer


class LineageCallbacks(Callbacks):
    def __init__(self, sink, store=None, prefix: str | None = None, extra: list[Callbacks] = ()):
        self.sink, self.store, self.prefix, self.extra = sink, store, prefix, list(extra)
        self.uploaded: dict[int, str] = {}
        self.upload_errors: list[str] = []

    def on_step(self, step, metrics):
        if self.sink is not None:
            self.sink.log(step, metrics)
        for cb in self.extra:
            cb.on_step(step, metrics)

    def on_checkpoint(self, step, path, manifest):
        if self.store is not None:
            try:
                self.uploaded[step] = self.store.put_dir(path, f"{self.prefix}/{Path(path).name}")
            except Exception as e:  # the checkpoint stage retries; training goes on
                self.upload_errors.append(f"step {step}: {e}")
        for cb in self.extra:
            cb.on_checkpoint(step, path, manifest)

    def should_stop(self, step, metrics):
        for cb in self.extra:
            reason = cb.should_stop(step, metrics)
            if reason:
                return reason
        return None


@dataclass
class TrainOutcome:
    output_dir: Path
    last_step: int
    stopped: str | None
    last_checkpoint: Path | None
    history: list[dict] = field(default_factory=list)
    trainer_seconds: float = 0.0
    upload_errors: list[str] = field(default_factory=list)
    eval_start: dict | None = None


def run_training(spec, output_dir: Path, callbacks: LineageCallbacks, fork_source=None, resume: bool = False,
                 progress: bool = True) -> TrainOutcome:
    import json

    lineage = {}
    if fork_source is not None and fork_source.local_dir is not None:
        lineage = {"parent_run_id": fork_source.parent_run_id, "parent_step": fork_source.parent_step,
                   "fork_checkpoint": fork_source.checkpoint_uri}
    trainer = GRPOTrainer(spec.trainer_config(), output_dir, callbacks=[callbacks],
                          init_adapter=fork_source.adapter_dir if fork_source else None, lineage=lineage, progress=progress)
    try:
        if resume:
            trainer.resume()
        earlier = []
        metrics_file = Path(output_dir) / "metrics.jsonl"
        if metrics_file.exists():
            earlier = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
        result = trainer.train(spec.optim.steps)
    finally:
        trainer.close()
    eval_start = result.eval_start or next((m for m in earlier if m["step"] == 0), None)
    history = [m for m in earlier if m["step"] > 0] + result.history if resume else result.history
    return TrainOutcome(Path(output_dir), result.last_step, result.stopped, result.last_checkpoint, history,
                        sum(m.get("step_time", 0.0) for m in result.history), list(callbacks.upload_errors), eval_start)
