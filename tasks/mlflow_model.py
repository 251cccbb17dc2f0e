"""A pipeline run's final checkpoint as an MLflow model: `mlflow.pyfunc.load_model(uri).predict(["12+7="])` gives the
completions, decoded as the held-out eval decodes them (trainer/evaluate.py, greedy by default).

The model is a pyfunc "from code" (this file; no pickled object): its artifacts are the checkpoint's weights
(adapter/ or model/, tokenizer/ when saved) with the checkpoint's manifest, and `ballast_model.json` — the spec's
model, lora and prompt-rendering fields and the eval's max_tokens. `load_context` opens the checkpoint through
trainer/checkpoint.py (the one home of the format: the copied files are checked against the manifest's hashes) and
loads the base model it names plus the adapter, so the base model (`base_model` in the model's metadata: a Hugging
Face name or a path) must be reachable where the model is loaded. The trainer package travels with the model
(`code_paths`), so loading needs torch, transformers and peft, not Ballast.

Input: a list of prompts, or a DataFrame of one column of them (named `prompt` where it has more). Params:
`max_tokens`, `temperature`.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
from mlflow.pyfunc import PythonModel

CONFIG = "ballast_model.json"


class CheckpointModel(PythonModel):
    """Base model + the run's adapter (or its full fine-tuned model), loaded from the logged checkpoint."""

    def load_context(self, context) -> None:
        from trainer.checkpoint import Checkpoint, verify_files
        from trainer.config import DataConfig, LoraConfig, ModelConfig

        config = json.loads(Path(context.artifacts["config"]).read_text())
        checkpoint = Checkpoint.open(context.artifacts["checkpoint"], verify=False)  # the optimizer state stays behind
        files = checkpoint.manifest.get("files", {})
        verify_files(checkpoint.path, {k: v for k, v in files.items() if (checkpoint.path / k).parent.is_dir()})
        model_cfg, lora_cfg = ModelConfig(**config["model"]), LoraConfig(**config["lora"])
        self.model, self.tokenizer = checkpoint.load_policy(model_cfg, lora_cfg)
        self.render = DataConfig.model_construct(**config["render"])  # system prompt and template, as in training
        self.max_tokens = config["max_tokens"]

    def predict(self, context, model_input, params: dict | None = None) -> list[str]:
        from trainer.evaluate import generate

        if hasattr(model_input, "columns"):  # a DataFrame: its prompt column, or its first
            column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
            prompts = [str(p) for p in model_input[column]]
        else:
            prompts = [model_input] if isinstance(model_input, str) else [str(p) for p in model_input]
        params = params or {}
        texts, _, _ = generate(
            self.model,
            self.tokenizer,
            prompts,
            max_tokens=int(params.get("max_tokens") or self.max_tokens),
            temperature=float(params.get("temperature") or 0.0),
            data=self.render,
        )
        return texts


mlflow.models.set_model(CheckpointModel())
