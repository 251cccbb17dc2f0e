"""The whole experiment spec: the trainer's sections plus fork, probe, tracking, storage and infra.

One pydantic schema, loaded from YAML, with `--set key.path=value` overrides (the value is parsed as
YAML, so `--set grpo.beta=0.1` is a float and `--set lora.enabled=false` a bool). Unknown or invalid
fields are refused with one line naming the field: `SpecError` (the CLI exits with status 2).
Secrets never belong in a spec: fields whose names look like credentials, and URIs with a password
(`https://user:pass@...`), are refused; `flat_params` (what lineage logs as MLflow params) redacts
anything that slips through. A YAML file is read strictly (`read_yaml_mapping`, shared with sweep files):
a key given twice, bytes that are not UTF-8, and `.inf`/`.nan` values are refused, never half-read.
"""

from __future__ import annotations

import hashlib
import json
import re
import typing
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import Field, ValidationError, field_validator

from infra.extras import require_extra
from trainer.config import InputError, ModelConfig, Section, TrainerConfig, is_variable_name  # noqa: F401  (ModelConfig: --base)
from trainer.data import SOURCES, check_data, jsonl_rows, locate_data_file
from trainer.engines.offline import check_trajectories
from trainer.environment import check_environment
from trainer.health import tag_pattern
from trainer.locate import check_device, check_model_source, vllm_python  # check_device: probe --device
from trainer.metrics import METRICS  # noqa: F401  (the glossary `ballast metrics` prints; imports no torch)
from trainer.rewards import check_rewards


class SpecError(InputError):
    """A spec that cannot be run; the message names the field and the fix."""


class ForkConfig(Section):
    """Where the run starts: the base model alone (all None), a run's checkpoint, or a checkpoint URI."""

    run_id: str | None = Field(None, description="MLflow run id of the pipeline run to fork from.")
    step: int | None = Field(None, ge=1, description="Step of that run's checkpoint; default its newest.")
    checkpoint: str | None = Field(None, description="Checkpoint directory: local path or s3://bucket/key.")
    verify_tolerance: float = Field(
        1e-4, gt=0, description="Max |logprob difference| against the source's fingerprint."
    )


class ProbeConfig(Section):
    """The artifact probe (tasks/probe.py): a checkpoint's malformed rate, read against its starting point's."""

    enabled: bool = Field(True, description="Probe the final checkpoint after training (False: skip the stage).")
    prompts_file: str | None = Field(
        None,
        description="Probe prompts (.jsonl or .txt); default: the experiment's "
        "held-out prompts, rendered as training renders them.",
    )
    num_prompts: int = Field(
        8, ge=1, description="Held-out prompts probed (the first ones) when prompts_file is unset."
    )
    n: int = Field(6, ge=1, description="Samples per probe prompt.")
    temperature: float = Field(0.7, gt=0, description="Sampling temperature of the probe.")
    max_tokens: int = Field(64, ge=1, description="Longest probe completion, in tokens (length_cap beyond).")
    format_tag: str | Literal[False] | None = Field(
        None,
        description="Completions must hold <tag>...</tag>. Unset: the tag the experiment's rewards require "
        "(exact_answer, tag_answer, format, or a reward's `tag` kwarg), no check when they require "
        "none; false: never check.",
    )
    expected_length: int | None = Field(
        None,
        ge=1,
        description="Characters a good answer takes ('too_long' beyond "
        "length_factor x), for prompts without their own; unset: the baseline's "
        "median length on the same prompt.",
    )
    length_factor: float = Field(3.0, gt=1, description="'too_long' fires beyond this many times the expected length.")
    compare_to_base: bool = Field(
        True,
        description="Also probe the starting point — the fork's parent, else the base "
        "model — on the same prompts with the same settings (cached), and read the verdict "
        "and the length limits against it.",
    )
    max_malformed_increase: float = Field(
        0.1,
        ge=0,
        le=1,
        description="The probe fails when its malformed rate "
        "exceeds the baseline's by more than this, significantly (significance).",
    )
    significance: float = Field(
        0.05, gt=0, lt=1, description="Level of the one-sided Fisher exact test of that increase."
    )
    max_malformed_rate: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Absolute cap: the probe fails above this malformed rate, whatever the baseline's.",
    )
    parity_tolerance: float = Field(
        1e-3, gt=0, description="Max |logprob difference| between the reloaded artifact and save time."
    )
    every_checkpoint: bool = Field(False, description="Probe every saved checkpoint, not only the final one.")
    seed: int = Field(0, description="Probe sampling seed (the same samples for the same artifact).")

    @field_validator("format_tag")
    @classmethod
    def _tag_name(cls, tag):
        if isinstance(tag, str):
            tag_pattern(tag)  # raises ValueError naming the tag and the allowed characters
        return tag


def load_probe_prompts(path: str | Path) -> list[dict]:
    """Probe prompts from a .jsonl ({"prompt", optional "answer", optional "expected_length"}) or a
    .txt (one prompt per line) file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"probe prompts file {path} does not exist; set probe.prompts_file (or --prompts) to a "
            ".jsonl or .txt file, or leave it unset for the experiment's held-out prompts"
        )
    prompts: list[dict] = []
    if path.suffix == ".txt":
        lines = path.read_text(encoding="utf-8").splitlines()
        prompts = [{"prompt": line.rstrip("\n")} for line in lines if line.strip()]
    elif path.suffix == ".jsonl":
        for where, row in jsonl_rows(path, "an object with a 'prompt'"):
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
                raise ValueError(f"{where}: each line must be a JSON object with a non-empty 'prompt' string")
            unknown = set(row) - {"prompt", "answer", "expected_length"}
            if unknown:
                allowed = "prompt, answer, expected_length"
                raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {allowed}")
            expected = row.get("expected_length")
            if expected is not None and (not isinstance(expected, int) or expected < 1):
                raise ValueError(f"{where}: expected_length must be a positive integer (characters), got {expected!r}")
            prompts.append({"prompt": row["prompt"], "answer": row.get("answer"), "expected_length": expected})
    else:
        raise ValueError(f"probe prompts file {path} must be .jsonl or .txt")
    if not prompts:
        raise ValueError(f"probe prompts file {path} holds no prompts")
    for p in prompts:
        p.setdefault("answer", None)
        p.setdefault("expected_length", None)
    return prompts


# what MLflow's tracking stores accept (a database URI may name its driver: postgresql+psycopg2://)
TRACKING_SCHEMES = ("", "file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")


class TrackingConfig(Section):
    uri: str | None = Field(
        None,
        description="MLflow tracking URI; default sqlite under the project folder. postgresql://... for a team server.",
    )

    experiment: str = Field("ballast", description="MLflow experiment the runs go to (created on first use).")
    register_as: str | None = Field(
        None,
        description="Register a finished run's final checkpoint (logged as the MLflow model 'model' of every run) "
        "in MLflow's model registry under this name, as a new version.",
    )
    log_every: int = Field(
        1,
        ge=1,
        description="Log every this many steps' metrics to MLflow (eval steps always); metrics.jsonl "
        "has every step. Sent from a background thread in batches, every ~2 s.",
    )
    ui_url: str | None = Field(
        None,
        description="The MLflow UI that printed and page links point at; default: the "
        "tracking server for an http(s) tracking.uri, else http://127.0.0.1:5000 "
        "(where `ballast ui` serves the embedded store).",
    )
    start_timeout_s: float = Field(
        10.0,
        gt=0,
        le=300,
        description="An http(s) tracking server must answer /health "
        "within this many seconds at start, or the run fails before anything is created.",
    )
    request_timeout_s: int = Field(
        10,
        ge=1,
        le=600,
        description="Whole seconds one request to an http(s) tracking "
        "server may take (MLFLOW_HTTP_REQUEST_TIMEOUT; MLflow's default is 120).",
    )
    request_retries: int = Field(
        2,
        ge=0,
        le=10,
        description="Retries of a failed request to the tracking server "
        "(MLFLOW_HTTP_REQUEST_MAX_RETRIES; MLflow's default of 7 waits over four minutes "
        "for a server that is not there). Step metrics that still fail wait on disk.",
    )
    request_backoff_s: int = Field(
        1,
        ge=0,
        le=120,
        description="Backoff factor between those retries, whole "
        "seconds (MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR: waits of 0, 2x, 4x ... seconds).",
    )

    @field_validator("uri")
    @classmethod
    def _tracking_scheme(cls, uri):
        # an unknown scheme passed validate and failed inside the flow, after its process had started, exit 1
        scheme = urlsplit(uri).scheme.lower() if isinstance(uri, str) else ""
        if scheme.split("+")[0].removesuffix("-uc") not in TRACKING_SCHEMES:
            raise ValueError(
                f"{uri!r} has the scheme {scheme!r}, which MLflow does not track to; give sqlite:///path/mlflow.db, "
                "postgresql://user@host/db, http(s)://server, a local folder, or leave it unset for the project's store"
            )
        return uri


class StorageConfig(Section):
    uri: str | None = Field(
        None, description="Artifact store root: a local directory (default <project>/artifacts) or s3://bucket/prefix."
    )

    @field_validator("uri")
    @classmethod
    def _store_scheme(cls, uri):
        if not isinstance(uri, str):
            return uri
        parsed = urlsplit(uri)
        if parsed.scheme.lower() not in ("", "file", "s3") or (parsed.scheme == "s3" and not parsed.netloc):
            raise ValueError(
                f"{uri!r} is not an artifact store Ballast opens; give a local folder, file:///path or "
                "s3://bucket/prefix (set AWS_ENDPOINT_URL_S3 for MinIO or another S3-compatible server)"
            )
        return uri


class InfraConfig(Section):
    """Where the GPU stages run (infra/compute.py): `compute: here` (default) trains in the flow's own process;
    `local` and `skypilot` run the train stage as a separate process on a provisioned node — this machine or a
    SkyPilot cluster / managed job (`use_spot`) — provision → train → teardown, preemption recovered from the store.
    The resources are SkyPilot's; `ballast launch` reads them too."""

    compute: Literal["here", "local", "skypilot"] = Field(
        "here",
        description="here: train in the flow's process (the default); local: a provisioned stage process on this "
        "machine (the same path as skypilot, for tests and debugging); skypilot: a SkyPilot node.",
    )
    accelerators: str | None = Field(
        None, description="e.g. 'H200:2' (with rollout.engine: vllm, trainer on GPU 0, vLLM on GPU 1)."
    )
    cloud: str | None = Field(
        None, description="SkyPilot infra: 'k8s', 'aws', 'gcp', 'aws/us-east-1', ...; default: the cheapest enabled."
    )
    cpus: str | None = Field(None, description="e.g. '8', '16+'.")
    memory: str | None = Field(None, description="GB, e.g. '64+'.")
    num_nodes: int = Field(
        1, ge=1, description="Nodes SkyPilot provisions; the train stage runs nproc_per_node ranks on each (torchrun)."
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        description="Trainer ranks (torchrun processes) per node in the train stage, with model.parallel: ddp or "
        "fsdp2; more than 1 needs infra.compute: local or skypilot (on this machine alone: ballast train --nproc).",
    )
    use_spot: bool = Field(
        False, description="Spot (preemptible) instances; a preempted run resumes from its checkpoints."
    )
    env: list[str] = Field(
        default_factory=list,
        description="Names of environment variables (HF_TOKEN, AWS_ACCESS_KEY_ID, ...) whose "
        "values are read at launch and passed to the node as SkyPilot secrets; never stored.",
    )
    disk_size: int | None = Field(None, ge=1, description="Node disk in GB (SkyPilot's default: 256).")
    max_restarts: int = Field(
        3,
        ge=0,
        le=100,
        description="How many times a preempted train stage is relaunched (resuming from the store's newest "
        "checkpoint) before the run fails; SkyPilot managed jobs (use_spot) recover preemptions themselves.",
    )
    autostop_minutes: int = Field(
        30,
        ge=1,
        description="SkyPilot autostop/autodown backstop: a cluster idle this long is torn down even if the "
        "flow that provisioned it died.",
    )


NAME_BYTES = 200  # a run's name, in UTF-8 bytes: a directory name (255 at most) with room for a trial's suffix


class ExperimentSpec(TrainerConfig):
    name: str = Field("experiment", description="Run name in MLflow and Prefect.")
    project_dir: str = Field(
        ".ballast", description="Where embedded stores live: MLflow SQLite, artifacts, run outputs."
    )
    fork: ForkConfig = Field(
        default_factory=ForkConfig, description="Where the run starts: the base model or a verified checkpoint."
    )
    probe: ProbeConfig = Field(default_factory=ProbeConfig, description="The artifact probe of saved checkpoints.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow: where runs are recorded.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Where checkpoints are stored.")
    infra: InfraConfig = Field(
        default_factory=InfraConfig, description="Where the GPU stages run: here, a local stage process, SkyPilot."
    )

    @field_validator("name")
    @classmethod
    def _one_path_part(cls, name: str) -> str:
        # `ballast train` writes to <project_dir>/runs/<name>: '..' or 'a/b' would write somewhere else
        if not name.strip() or name in (".", "..") or any(c in name for c in "/\\"):
            raise ValueError(
                "a run's name is one directory name (not empty, '.' or '..', no '/' or '\\'); e.g. quickstart-lr3e-4"
            )
        if not name.isprintable():  # a tab, newline or control character: a directory name no one can type
            bad = next(c for c in name if not c.isprintable())
            raise ValueError(f"a run's name is printable text; {bad!r} at position {name.index(bad)} is not")
        if len(name.encode()) > NAME_BYTES:  # the file system's limit is 255, and the run directory adds to it
            raise ValueError(f"a run's name is a directory name of at most {NAME_BYTES} bytes; shorten it")
        return name

    def trainer_config(self) -> TrainerConfig:
        return TrainerConfig(**{k: getattr(self, k) for k in TrainerConfig.model_fields})


SECRET_WORDS = (
    "token",
    "password",
    "secret",
    "api_key",
    "apikey",
    "access_key",
    "secret_key",
    "private_key",
    "credentials",
)


def looks_secret(key: str) -> bool:
    """True for keys like `api_key`, `hf_token`, `aws_secret_access_key` (not `max_tokens`)."""
    k = key.lower().rsplit(".", 1)[-1]
    return k in SECRET_WORDS or any(k.endswith("_" + w) for w in SECRET_WORDS)


def load_spec(source: str | Path | dict, overrides: list[str] = ()) -> ExperimentSpec:
    """Read a YAML file (or a dict), apply `key.path=value` overrides, validate."""
    if isinstance(source, dict):
        data, where = json.loads(json.dumps(source)), "spec"
    else:
        data = read_yaml_mapping(
            source, "spec file", "an experiment YAML (see examples/)", "a mapping of sections (model:, grpo:, ...)"
        )
        where = str(source)
    for item in overrides:
        set_path(data, item)
    try:
        return validate_spec(data, where, spec_dir=None if isinstance(source, dict) else Path(source).parent)
    except SpecError as e:
        raise _blame_override(e, where, overrides) from None


def _blame_override(error: SpecError, where: str, overrides) -> SpecError:
    """A problem in a field a --set gave is the --set's, not the spec file's: the message names the --set."""
    message = str(error)
    named = re.search(r"field '([^']+)'", message)
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if named and (named.group(1) == key or named.group(1).startswith(key + ".")):
            return SpecError(f"--set {item}: " + message.removeprefix(f"{where}: "))
        if re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", message):  # a check across fields names it
            return SpecError(f"{message} (given with --set {item})")
    return error


def validate_spec(data: dict, where: str = "spec", spec_dir: Path | None = None) -> ExperimentSpec:
    """The spec, its data files (a relative path is looked up in `spec_dir`, then the working directory, and
    stored absolute) and its reward functions (imported from `spec_dir` or the working directory, each user
    function called once on placeholder completions for the first prompts of the data) checked — all before torch
    or a model loads; any problem is a SpecError naming the field or file:line."""
    _refuse_nul(data, where)
    _refuse_secrets(data, where)
    try:
        spec = ExperimentSpec.model_validate(data)
    except ValidationError as e:
        hint = "check the spelling against the spec reference (ballast spec-schema)"
        raise SpecError(f"{where}: {describe_validation_error(e, hint, ExperimentSpec)}") from None
    try:
        if spec.data.source not in SOURCES:
            spec.data.source = locate_data_file(spec.data.source, "data.source", spec_dir)
        if spec.data.eval_path is not None:
            spec.data.eval_path = locate_data_file(spec.data.eval_path, "data.eval_path", spec_dir)
        examples = check_data(spec.data)
        if spec.probe.prompts_file is not None:  # read after training, and by `ballast probe --spec`
            try:
                spec.probe.prompts_file = locate_data_file(spec.probe.prompts_file, "probe.prompts_file", spec_dir)
            except FileNotFoundError:
                pass  # load_probe_prompts names the field and what it takes
            load_probe_prompts(spec.probe.prompts_file)
        if spec.rollout.engine == "offline":
            check_trajectories(spec.data.source, spec.grpo.rollout_correction.mode, spec.grpo.num_generations)
        check_rewards(spec.rewards, spec.eval.reward, spec_dir, examples, spec.grpo.num_generations)
        if spec.data.environment is not None:
            if spec.rollout.engine == "offline":
                raise ValueError(
                    "data.environment runs live episodes and rollout.engine: offline reads finished ones from "
                    "data.source; leave data.environment unset, or set rollout.engine: hf or vllm"
                )
            check_environment(spec.data, spec_dir, examples)
    except (ValueError, FileNotFoundError) as e:
        raise SpecError(f"{where}: {e}") from None
    return spec


def check_runnable(spec: ExperimentSpec, here: bool = False) -> None:
    """What a command that loads the model checks after the spec, still without torch: the model can be found (or
    built) here, offline, the device exists (trainer/locate.py), and what the spec's features need is installed — the
    `cloud` extra for infra.compute: skypilot, vLLM's environment for rollout.engine: vllm (infra/extras.py). A
    SpecError naming the field. With infra.compute: skypilot the model loads on the node, which has its own devices,
    downloads and vLLM environment, unless `here`: the command trains on this machine whatever infra says
    (`ballast train`)."""
    try:
        if spec.infra.compute == "skypilot" and not here:
            require_extra("cloud", "infra.compute: skypilot")
            return
        check_device(spec.model.device)
        check_model_source(spec.model)
        if spec.rollout.engine == "vllm" and not spec.rollout.vllm_url:
            vllm_python(spec.rollout.vllm_python)
    except InputError as e:
        raise SpecError(str(e)) from None


def check_trainable_alone(spec: ExperimentSpec) -> None:
    """`ballast train` runs the trainer with no tracking store, so a fork named by an MLflow run id cannot be found:
    refused with the spec, before torch loads (a fork.checkpoint is what it takes)."""
    if spec.fork.run_id:
        raise SpecError(
            f"fork.run_id={spec.fork.run_id}: `ballast train` has no tracking store to find a run's "
            "checkpoints in; give fork.checkpoint (a checkpoint directory or s3:// URI), or use ballast run"
        )


def describe_run(spec: ExperimentSpec) -> list[str]:
    """What a checked spec will run, in a few lines (`ballast validate`, `ballast run --dryrun`): the model and where
    it comes from, the data, the rewards and what eval/accuracy reads, the training batch."""
    from trainer.config import reward_component_names
    from trainer.data import load_datasets
    from trainer.locate import in_hf_cache
    from trainer.rewards import RewardComputer

    m = spec.model
    if (Path(m.name_or_path).expanduser() / "config.json").is_file():
        source = "a local model directory"
    elif m.build_if_missing or m.gguf_file:
        source = f"built on first use from {m.build_if_missing or m.gguf_file}"
    else:
        source = "in the Hugging Face cache" if in_hf_cache(m.name_or_path) else "to be downloaded (HF_HUB_OFFLINE=0)"
    train, held_out = load_datasets(spec.data)
    columns = list(dict.fromkeys(k for e in train for k in e.columns))
    names = reward_component_names(spec.rewards)
    accuracy = RewardComputer(spec.rewards, group_size=spec.grpo.num_generations).accuracy_name(spec.eval.reward)
    g = spec.grpo
    return [
        f"model     {m.name_or_path} ({source}), device {m.device}",
        f"data      {spec.data.source}: {len(train)} training prompts, {len(held_out)} held out"
        + (f"; columns for the rewards: {', '.join(columns)}" if columns else ""),
        f"rewards   {', '.join(f'{n} x{r.weight:g}' for n, r in zip(names, spec.rewards))}; eval/accuracy reads "
        f"{accuracy or 'none (eval/reward is the score)'}",
        f"training  {spec.optim.steps} steps of {g.prompts_per_step} prompts x {g.num_generations} completions",
    ] + ([_describe_environment(spec.data)] if spec.data.environment else [])


def _describe_environment(data) -> str:
    from trainer.environment import load_environment

    env = load_environment(data.environment)
    budget = f", {data.max_episode_tokens} tokens" if data.max_episode_tokens else ""
    tools = ", ".join(env.tools) or "none"
    return f"episodes  {data.environment}: up to {data.max_turns} turns{budget}; tools: {tools}"


# ── YAML files and validation errors, read the same way for specs and sweep files (sweeps/space.py) ─────


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is refused: PyYAML keeps the last one, so a
    second `optim:` section would silently replace the first."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                lines = f"lines {seen[key] + 1} and {key_node.start_mark.line + 1}"
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key '{key}' appears twice ({lines}): the second would silently replace the first; "
                    "merge them into one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def read_yaml_mapping(path: str | Path, what: str, pass_hint: str, shape: str, error: type = SpecError) -> dict:
    """The mapping a YAML file holds; `error` (naming the file and the fix) when it is missing, not UTF-8 text, not
    valid YAML, has a key twice, or is not a mapping. `what` names the file ("spec file"), `pass_hint` what to pass
    instead, `shape` what it must hold."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {path} does not exist; pass the path of {pass_hint}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(
            f"{what} {path} is not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}); save it as UTF-8 "
            f"YAML, {shape}"
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise error(f"{what} {path} is not valid YAML: {at}{problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise error(f"{what} {path} must hold {shape}; it holds a YAML {type(data).__name__}")
    return data


def describe_validation_error(e: ValidationError, unknown_hint: str, model: type | None = None) -> str:
    """A pydantic error as one line: the first problem with its dotted field, and how many more there are. With the
    `model` validated, an unknown field gets the nearest known one as "did you mean"."""
    err = e.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or "(top level)"
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        near = did_you_mean(str(err["loc"][-1]), _fields_at(model, err["loc"][:-1])) if model else None
        prefix = ".".join(str(p) for p in err["loc"][:-1])
        msg = f"unknown field '{field}'; " + (
            f"did you mean '{prefix + '.' if prefix else ''}{near}'?" if near else unknown_hint
        )
    elif err["type"] == "missing":
        msg = f"field '{field}' is required"
    elif err["type"] == "value_error" and (not err["loc"] or message.startswith(f"{field}.")):
        msg = message  # a check across fields: its message names them
    else:
        msg = f"field '{field}': {message}"
        value = err.get("input")
        if not isinstance(value, (dict, list)):
            shown = repr(value)
            msg += f" (got {shown[:80] + '...' if len(shown) > 80 else shown})"
        if err["type"] == "string_type" and isinstance(value, (bool, int, float)):  # YAML's off, no, yes, 1.10
            kind = "a boolean" if isinstance(value, bool) else "a number"
            key = err["loc"][-1]
            msg += f'; YAML reads that bare word as {kind}: quote it ({key}: "..." in a file, --set \'{key}="..."\')'
    more = f" (+{len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return msg.replace("\n", " ") + more


def did_you_mean(name: str, known) -> str | None:
    """The known name closest to a misspelt one, if any is close."""
    import difflib

    found = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return found[0] if found else None


def _section_model(annotation) -> type | None:
    """The spec section an annotation holds: the section itself, a list of it, or a member of a union."""
    import typing

    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_model(arg)
        if found is not None:
            return found
    return None


def _fields_at(model: type, loc: tuple) -> list[str]:
    """The field names of the section at `loc` (e.g. ('grpo',), ('rewards', 0)) of a pydantic model."""
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        model = _section_model(field.annotation) if field is not None else None
        if model is None:
            return []
    return list(model.model_fields)


def spec_reference(model: type = ExperimentSpec, prefix: str = "") -> list[str]:
    """Every field of the spec as readable lines, section by section: name, type, default, meaning (`ballast
    spec-schema`; `--json` gives the JSON schema)."""
    from pydantic_core import PydanticUndefined

    lines: list[str] = []
    fields = [(name, field, _section_model(field.annotation)) for name, field in model.model_fields.items()]
    leaves = [(name, field) for name, field, section in fields if section is None]
    if leaves:
        lines.append(f"[{prefix.rstrip('.') or 'top level'}]")
        for name, field in leaves:
            if field.default_factory is not None:
                default = f"default {field.default_factory()!r}"
            else:
                default = "required" if field.default is PydanticUndefined else f"default {field.default!r}"
            lines.append(f"  {prefix}{name}: {_type_name(field.annotation)}, {default}")
            lines.append(f"      {' '.join((field.description or '').split())}")
        lines.append("")
    for name, field, section in fields:
        if section is None:
            continue
        many = "[]" if typing.get_origin(field.annotation) is list else ""
        if many:  # a list of sections (rewards): what the list is, and what it holds when not given
            lines.append(f"[{prefix}{name}{many}]  {' '.join((field.description or '').split())}")
            default = [item.model_dump(exclude_defaults=True) for item in field.default_factory()]
            lines.append(f"      default when not given: {default}")
            sub = spec_reference(section, f"{prefix}{name}{many}.")
            lines += sub[1:]  # its fields, under the heading above
        else:
            lines += spec_reference(section, f"{prefix}{name}.")
    return lines


def _type_name(annotation) -> str:
    """int, str | None, Literal['a', 'b'] | None: as a reader writes a type."""
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "").replace("NoneType", "None")
    return re.sub(r"^Optional\[(.*)\]$", r"\1 | None", text)


def parse_set(item: str) -> tuple[str, Any]:
    """`--set key.path=value`: the dotted key and the value read as YAML (a string when it is not YAML)."""
    if "=" not in item:
        raise SpecError(f"--set {item!r}: expected key.path=value, e.g. --set grpo.beta=0.1")
    key, raw = item.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError:
        return key.strip(), raw


def set_path(data: dict, item: str) -> None:
    key, value = parse_set(item)
    node = data
    parts = key.strip().split(".")
    for p in parts[:-1]:
        if not isinstance(node.get(p, {}), dict):
            raise SpecError(f"--set {key}: '{p}' is not a section")
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def _fields(data: Any, prefix: str = "") -> typing.Iterator[tuple[str, Any, Any]]:
    """(dotted name, key, value) of every field of a spec's raw data, depth first (list items by their index)."""
    items = enumerate(data) if isinstance(data, list) else data.items() if isinstance(data, dict) else ()
    for k, v in items:
        yield f"{prefix}{k}", k, v
        yield from _fields(v, f"{prefix}{k}.")


def _refuse_secrets(data: Any, where: str) -> None:
    for name, k, v in _fields(data):
        if looks_secret(str(k)) and isinstance(v, str) and v:
            raise SpecError(
                f"{where}: field '{name}' looks like a secret; secrets never go in a spec (it is logged to "
                "MLflow) — put it in an environment variable and name the variable instead"
            )
        if isinstance(v, str) and uri_has_password(v):
            raise SpecError(
                f"{where}: field '{name}' holds a password inside its URI (user:***@host); it would be "
                "logged to MLflow — give the credential through the service's environment variables "
                "(AWS_*, MLFLOW_TRACKING_PASSWORD, PGPASSWORD) or ~/.pgpass, and the URI without it"
            )
        if str(k).endswith("_env") and isinstance(v, str) and not is_variable_name(v):
            raise SpecError(
                f"{where}: field '{name}' must name an environment variable (e.g. OPENAI_API_KEY); the "
                "value given is not a name and is not shown, as it may be the key itself"
            )


def _refuse_nul(data: Any, where: str) -> None:
    """A NUL character fits no path, name or URI (the OS refuses it, MLflow and Prefect cut at it): refused by field."""
    for name, _, v in _fields(data):
        at = v.find("\x00") if isinstance(v, str) else -1
        if at >= 0:
            raise SpecError(
                f"{where}: field '{name}' holds a NUL character (\\0) at position {at}; remove it (a stray escape "
                "in the YAML or the --set value)"
            )


def uri_has_password(value: str) -> bool:
    """True for 'scheme://user:secret@host/...' (a URI with a password part)."""
    if "://" not in value or "@" not in value:
        return False
    try:
        return bool(urlsplit(value.strip()).password)
    except ValueError:
        return False


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


# ── where a spec's runs are tracked and stored (no MLflow: the CLI checks a store before anything heavy loads) ─────


def tracking_uri(spec: ExperimentSpec) -> str:
    """The MLflow tracking URI: tracking.uri, or the project's embedded store (project_dir/mlflow.db)."""
    if spec.tracking.uri:
        return spec.tracking.uri
    db = Path(spec.project_dir).resolve() / "mlflow.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"


def tracks_nothing_yet(spec: ExperimentSpec) -> bool:
    """No tracking.uri and no embedded store (project_dir/mlflow.db): no run was ever tracked in this project, so a run
    id cannot be in it — said at once, without opening (and so creating) an empty store there."""
    return not spec.tracking.uri and not (Path(spec.project_dir) / "mlflow.db").is_file()


def default_tracking_uri() -> str:
    """The embedded store of the default project folder (.ballast/ under the working directory)."""
    return f"sqlite:///{Path('.ballast').resolve() / 'mlflow.db'}"


def store_uri(spec: ExperimentSpec) -> str:
    """The artifact store: storage.uri, or project_dir/artifacts."""
    return spec.storage.uri or str(Path(spec.project_dir).resolve() / "artifacts")
