"""What the trainer tells the outside world, step by step: tasks/ binds it to MLflow and the artifact store, sweeps/
to Optuna. Its own module, free of torch, so that what implements it (the checkpoint uploader, the metrics sink, a
pruner) can be imported by a command that refuses bad input before any model loads."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .checkpoint import Checkpoint


class Callbacks:
    """What the trainer tells the outside world. tasks/ binds it to MLflow, sweeps/ to Optuna."""

    def on_step(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_checkpoint(self, checkpoint: Checkpoint) -> None: ...

    def should_stop(self, step: int, metrics: dict[str, float]) -> str | None:
        return None
