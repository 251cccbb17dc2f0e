"""The whole experiment spec: the trainer's sections plus fork, probe, tracking, storage and infra.

One pydantic schema, loaded from YAML, with `--set key.path=value` overrides (the value is parsed as
YAML, so `--set grpo.beta=0.1` is a float and `--set lora.enabled=false` a bool). Unknown or invalid
fields are refused with one line naming the field: `SpecError` (the CLI exits with status 2).
Secrets never belong in a spec: fields whose names look like credentials are refused, and
`flat_params` (what lineage logs as MLflow params) redacts anything that slips through.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import Field, ValidationError

from trainer.config import Section, TrainerConfig


class SpecError(ValueError):
    """A spec that cannot be run; the message names the field and the fix."""


class ForkConfig(Section):
    """Where the run starts: the base model alone (all None), a run's checkpoint, or a checkpoint URI."""
    run_id: Optional[str] = Field(None, description="MLflow run id of the pipeline run to fork from.")
    step: Optional[int] = Field(None, ge=1, description="Step of that run's checkpoint; default its newest.")
    checkpoint: Optional[str] = Field(None, description="Checkpoint directory: local path or s3://bucket/key.")
    verify_tolerance: float = Field(1e-4, gt=0, description="Max |logprob difference| against the source's fingerprint.")


class ProbeConfig(Section):
    enabled: bool = True
    prompts_file: Optional[str] = Field(None, description="Probe prompts (.jsonl or .txt); default: the shipped generic set.")
    n: int = Field(6, ge=1, description="Samples per probe prompt.")
    temperature: float = Field(0.7, gt=0)
    max_tokens: int = Field(64, ge=1)
    format_tag: Optional[str] = Field("output", description="Completions must be wrapped in <tag>...</tag>; None disables the check.")
    expected_length: Optional[int] = Field(None, ge=1, description="Characters a good answer takes ('too_long' beyond length_factor x), "
                                                                  "for prompts without their own expected_length; unset: the length of a prompt's answer.")
    length_factor: float = Field(3.0, gt=1, description="'too_long' fires beyond this many times the expected length.")
    max_malformed_rate: float = Field(0.25, ge=0, le=1, description="The probe fails above this malformed rate.")
    parity_tolerance: float = Field(1e-3, gt=0, description="Max |logprob difference| between the reloaded artifact and save time.")
    every_checkpoint: bool = Field(False, description="Probe every saved checkpoint, not only the final one.")
    seed: int = 0


class TrackingConfig(Section):
    uri: Optional[str] = Field(None, description="MLflow tracking URI; default sqlite under the project folder. "
                                                 "postgresql://... for a team server.")
    experiment: str = "ballast"
    log_every: int = Field(1, ge=1, description="Log every this many steps' metrics to MLflow (eval steps always); metrics.jsonl "
                                                 "has every step. Sent from a background thread in batches, every ~2 s.")


class StorageConfig(Section):
    uri: Optional[str] = Field(None, description="Artifact store root: a local directory (default <project>/artifacts) or s3://bucket/prefix.")


class InfraConfig(Section):
    """SkyPilot resources for `ballast launch` (infra/skypilot.py); unused when running on this machine."""
    accelerators: Optional[str] = Field(None, description="e.g. 'H200:2' (with rollout.engine: vllm, trainer on GPU 0, vLLM on GPU 1).")
    cloud: Optional[str] = Field(None, description="SkyPilot infra: 'k8s', 'aws', 'gcp', 'aws/us-east-1', ...; default: the cheapest enabled.")
    cpus: Optional[str] = Field(None, description="e.g. '8', '16+'.")
    memory: Optional[str] = Field(None, description="GB, e.g. '64+'.")
    num_nodes: int = Field(1, ge=1)
    use_spot: bool = False
    env: list[str] = Field(default_factory=list, description="Names of environment variables (HF_TOKEN, AWS_ACCESS_KEY_ID, ...) whose "
                                                          "values are read at launch and passed to the node as SkyPilot secrets; never stored.")


class ExperimentSpec(TrainerConfig):
    name: str = Field("experiment", description="Run name in MLflow and Prefect.")
    project_dir: str = Field(".ballast", description="Where embedded stores live: MLflow SQLite, artifacts, run outputs.")
    fork: ForkConfig = Field(default_factory=ForkConfig)
    probe: ProbeConfig = Field(default_factory=ProbeConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    infra: InfraConfig = Field(default_factory=InfraConfig)

    def trainer_config(self) -> TrainerConfig:
        return TrainerConfig(**{k: getattr(self, k) for k in TrainerConfig.model_fields})


SECRET_WORDS = ("token", "password", "secret", "api_key", "apikey", "access_key", "secret_key", "private_key", "credentials")


def looks_secret(key: str) -> bool:
    """True for keys like `api_key`, `hf_token`, `aws_secret_access_key` (not `max_tokens`)."""
    k = key.lower().rsplit(".", 1)[-1]
    return k in SECRET_WORDS or any(k.endswith("_" + w) for w in SECRET_WORDS)


def load_spec(source: str | Path | dict, overrides: list[str] = ()) -> ExperimentSpec:
    """Read a YAML file (or a dict), apply `key.path=value` overrides, validate."""
    if isinstance(source, dict):
        data, where = json.loads(json.dumps(source)), "spec"
    else:
        path = Path(source)
        if not path.is_file():
            raise SpecError(f"spec file {path} does not exist; pass the path of an experiment YAML (see examples/)")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise SpecError(f"spec file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise SpecError(f"spec file {path} must hold a mapping of sections (model:, grpo:, ...)")
        where = str(path)
    for item in overrides:
        set_path(data, item)
    return validate_spec(data, where)


def validate_spec(data: dict, where: str = "spec") -> ExperimentSpec:
    _refuse_secrets(data, where)
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            msg = f"unknown field '{field}'; check the spelling against the spec reference (ballast spec-schema)"
        elif err["type"] == "missing":
            msg = f"field '{field}' is required"
        elif err["type"] == "value_error" and not err["loc"]:  # a check across sections: its message names the fields
            msg = err["msg"].removeprefix("Value error, ")
        else:
            msg = f"field '{field}': {err['msg']} (got {err.get('input')!r})"
        more = f" (+{len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise SpecError(f"{where}: {msg}{more}") from None


def set_path(data: dict, item: str) -> None:
    if "=" not in item:
        raise SpecError(f"--set {item!r}: expected key.path=value, e.g. --set grpo.beta=0.1")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.strip().split(".")
    for p in parts[:-1]:
        if not isinstance(node.get(p, {}), dict):
            raise SpecError(f"--set {key}: '{p}' is not a section")
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def _refuse_secrets(data: Any, where: str, prefix: str = "") -> None:
    if isinstance(data, dict):
        for k, v in data.items():
            name = f"{prefix}{k}"
            if looks_secret(str(k)) and isinstance(v, str) and v:
                raise SpecError(f"{where}: field '{name}' looks like a secret; secrets never go in a spec (it is logged to "
                                "MLflow) — put it in an environment variable and name the variable instead")
            _refuse_secrets(v, where, name + ".")


def spec_hash(spec: ExperimentSpec) -> str:
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:16]


def flat_params(spec: ExperimentSpec) -> dict[str, str]:
    """The spec flattened to dotted keys (MLflow params), with secret-looking values redacted."""
    out: dict[str, str] = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            key = prefix.rstrip(".")
            value = json.dumps(node) if isinstance(node, (list, dict)) else str(node)
            if looks_secret(key):
                value = "***"
            out[key] = value[:500]
    walk(spec.model_dump(mode="json"), "")
    return out


def dump_spec(spec: ExperimentSpec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
