"""Faults injected into the vLLM engine on purpose, for tests only: never train with these.

`ReloadedInPlace` is what the buggy field code did — one adapter directory overwritten at every sync and
reloaded in place under the same name — so vLLM's prefix cache, keyed by adapter, keeps serving prompt
states computed with an earlier version. `DroppedAdapter` loses each new version right after loading it,
as a server does when another client unloads it or it restarts.
"""

from __future__ import annotations

from pathlib import Path

from trainer.engines.vllm import VLLMEngine, _remaining, _save_adapter


class ReloadedInPlace(VLLMEngine):
    def _write_adapter(self, model, step: int) -> Path:
        path = self.adapter_root / "policy"
        _save_adapter(model, path, overwrite=True)
        return path

    def _load(self, path: Path, deadline: float) -> str:
        name = f"ballast-{self.engine_id}-policy"
        self.server.post(
            "/v1/load_lora_adapter",
            {"lora_name": name, "lora_path": str(path), "load_inplace": self.adapter is not None},
            _remaining(deadline),
        )
        return name


class DroppedAdapter(VLLMEngine):
    def _load(self, path: Path, deadline: float) -> str:
        name = super()._load(path, deadline)
        self.server.post("/v1/unload_lora_adapter", {"lora_name": name}, _remaining(deadline))
        return name
