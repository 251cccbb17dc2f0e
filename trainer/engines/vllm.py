"""Rollouts from a vLLM server in its own process and environment (engines/vllm_server.py), over its
OpenAI-compatible API: adapter versions pushed, proved served, then sampled.

The adapter lifecycle. vLLM's prefix cache keys cached KV blocks by adapter; overwriting an adapter
directory and reloading it under the same name (load_inplace) keeps serving prompt states computed with
the *old* weights (logprob errors up to 0.93 seen in the field, 3.3 in tests/test_vllm.py). So every
`sync_weights(model, step)` writes the peft adapter to a NEW directory WORKDIR/adapters/v{step:06d}/
(temporary sibling, then rename), loads it under a NEW name `ballast-<engine id>-v{step:06d}`, then unloads
the previous version. (tests/vllm_faults.py reproduces the field bug on purpose.)

Trust the server only after it proves itself: after every push, before its rollouts are used,
`check_served_policy` asks the server which adapters it serves and samples a few tokens after a fixed
canary prompt, whose logprobs the trainer recomputes (rollout.policy_check*); a stale or missing adapter,
a server that stops answering or answers too slowly fails the step within rollout.policy_check_timeout_s
with one line naming which (`ServedPolicyError`).

Logprobs are the policy's at the sampling temperature (engines/base.py): the server runs with
`--logprobs-mode processed_logprobs`, which is exactly log_softmax(logits / T) for plain sampling; with
penalties or truncation (`logprobs_are_policy`) the engine returns none. Token ids are the trainer's: prompts
go as id lists, the server returns the ids it sampled and echoes the prompt (checked), and the trainer's
tokenizer decodes. `serve_checkpoint` starts a fresh server on a saved artifact (the probe path).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import distributed
from ..config import RolloutConfig
from ..logprobs import completion_logprobs
from ..model import load_tokenizer, resolve_dtype
from .base import Completion, SamplingParams
from .vllm_server import (
    SHARED_GPU_MEMORY_UTILIZATION,
    ServerNotAnswering,
    ServerRefused,
    ServerTooSlow,
    VLLMError,
    VLLMServer,
    resolve_vllm_python,
    server_device,
    shares_trainer_gpu,
)

ARTIFACT_LORA_NAME = "ballast-artifact"
FINISH_REASONS = {"stop": "stop", "length": "length"}
CANARY_TEXT = "Ballast canary: the served policy is the policy just trained. 12+34=<output>46</output> "
CANARY_SEED = 0
FP32_TOLERANCE = 1e-3  # canary logprobs, server and trainer both float32 (measured: ~1e-5)
HALF_TOLERANCE = 0.1  # either side in bfloat16/float16 (a bf16 server vs an fp32 trainer: ~7e-2 seen)
UNLOAD_TIMEOUT_S = 30.0  # unloading our adapter from a shared server at close
WAIT_MARGIN_S = 60.0  # torchrun's ranks wait for rank 0's server start or push this much past its own timeout


class ServedPolicyError(VLLMError):
    """The server did not prove it serves the weights just pushed; the message names what was wrong."""


@dataclass
class ServedPolicy:
    """What the last weight sync proved: the version served, and what it cost."""

    version: str
    sync_s: float  # adapter saved and loaded, old version unloaded, check done
    check_s: float  # of which the check (version listing, canary on both sides)
    max_logprob_diff: float  # canary tokens, |server - trainer|; NaN when rollout.policy_check is off
    tolerance: float


def default_tolerance(server_dtype: str, trainer_dtype: str) -> float:
    return FP32_TOLERANCE if server_dtype == trainer_dtype == "float32" else HALF_TOLERANCE


def canary_prompt(tokenizer, length: int) -> list[int]:
    """CANARY_TEXT's tokens repeated to `length`: fixed, so its KV blocks sit in a prefix cache from one sync to
    the next, where states computed with an earlier version would show."""
    ids = tokenizer.encode(CANARY_TEXT, add_special_tokens=False)
    return (ids * (length // len(ids) + 1))[:length]


# ── which logprobs ─────────────────────────────────────────────────────────────────────────────────


def logprobs_are_policy(params: SamplingParams) -> bool:
    """True when vLLM's processed logprobs are the policy at the sampling temperature (no penalties, no
    truncation); otherwise the engine returns no logprobs (see the module docstring)."""
    return (
        params.top_k == 0
        and params.top_p >= 1.0
        and params.min_p == 0.0
        and params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and params.min_tokens == 0
    )


def _distorting_settings(params: SamplingParams) -> str:
    defaults = SamplingParams(n=1, max_tokens=1)
    names = ["top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens"]
    return ", ".join(f"rollout.{n}={getattr(params, n)}" for n in names if getattr(params, n) != getattr(defaults, n))


# ── the engine ─────────────────────────────────────────────────────────────────────────────────────


class VLLMEngine:
    name = "vllm"
    overlaps_training = True  # the server samples while the trainer updates (rollout.max_off_policy_steps)

    def __init__(
        self,
        server: VLLMServer,
        tokenizer,
        workdir: str | Path,
        *,
        owns_server: bool = True,
        served_model: str | None = None,
        rollout: RolloutConfig | None = None,
        server_dtype: str = "float32",
        trainer_dtype: str = "float32",
    ):
        self.server, self.tokenizer = server, tokenizer
        self.workdir = Path(workdir).absolute()
        self.adapter_root = self.workdir / "adapters"
        self.owns_server = owns_server
        self.rollout = rollout or RolloutConfig()
        self.tolerance = self.rollout.policy_check_tolerance or default_tolerance(server_dtype, trainer_dtype)
        self.engine_id = uuid.uuid4().hex[:6]  # several engines may share one server
        self.base_model = server.base_model_name()
        self.served_model = served_model or self.base_model  # what requests name: the current adapter or the base
        self.adapter: tuple[str, Path] | None = None  # (lora name, directory) this engine loaded
        self.last_sync: ServedPolicy | None = None
        self._closed = False

    @classmethod
    def from_config(cls, cfg, tokenizer, workdir: str | Path) -> VLLMEngine:
        """Start (or, with rollout.vllm_url, connect to) the server the TrainerConfig describes. Under torchrun the
        ranks share one server: rank 0 starts it or connects, the others connect to the address it hands them, and
        rank 0 alone pushes each adapter version (`sync_weights`); every rank samples its own prompts."""
        check_config(cfg)
        workdir = Path(workdir)
        if not distributed.world().distributed:
            return cls._serving(cfg, tokenizer, workdir)
        engine = None

        def serve() -> str:
            nonlocal engine
            engine = cls._serving(cfg, tokenizer, workdir)
            return engine.server.url

        url = distributed.from_main(serve, cfg.rollout.vllm_startup_timeout_s + WAIT_MARGIN_S)
        if engine is None:  # a rank other than 0: the same server, never its owner
            engine = cls.on_server(cfg, tokenizer, workdir, url)
        return engine

    @classmethod
    def _serving(cls, cfg, tokenizer, workdir: Path) -> VLLMEngine:
        if cfg.rollout.vllm_url:
            return cls.on_server(cfg, tokenizer, workdir, cfg.rollout.vllm_url)
        server = start_server(cfg, workdir / "server.log")
        try:
            return cls(server, tokenizer, workdir, owns_server=True, rollout=cfg.rollout, **engine_dtypes(cfg))
        except BaseException:
            server.close()
            raise

    @classmethod
    def on_server(cls, cfg, tokenizer, workdir: str | Path, url: str) -> VLLMEngine:
        """An engine of its own (its own adapter versions, names and checks) on a server it does not own: the
        user's (rollout.vllm_url), or the one that concurrent trials share (trainer/multi.py)."""
        r = cfg.rollout
        server = VLLMServer.connect(url, r.vllm_startup_timeout_s, request_timeout_s=r.vllm_request_timeout_s)
        return cls(server, tokenizer, Path(workdir), owns_server=False, rollout=r, **engine_dtypes(cfg))

    # ---------------------------------------------------------------- weights: one adapter version at a time
    def sync_weights(self, model, step: int) -> ServedPolicy:
        """Push the trainer's adapter as a new version (new directory, new name), drop the old one, and — with
        rollout.policy_check — prove the server serves it. Everything after the adapter is written must finish
        within rollout.policy_check_timeout_s; any failure raises ServedPolicyError naming what was wrong.

        Under torchrun every rank calls it with the whole weights (FSDP2's gathered: trainer/loop.py): rank 0 pushes
        and checks, and the other ranks then sample the version it names."""
        if not distributed.world().distributed:
            return self._push(model, step)
        timeout = self.rollout.policy_check_timeout_s + WAIT_MARGIN_S
        self.last_sync = distributed.from_main(lambda: self._push(model, step), timeout)
        self.served_model = self.last_sync.version  # the adapter's name on the server
        return self.last_sync

    def _push(self, model, step: int) -> ServedPolicy:
        started = time.perf_counter()
        path = self._write_adapter(model, step)
        deadline = time.monotonic() + self.rollout.policy_check_timeout_s
        try:
            name = self._load(path, deadline)
            previous, self.adapter, self.served_model = self.adapter, (name, path), name
            if previous is not None and previous[0] != name:
                self._unload(previous, deadline)
            checked = time.perf_counter()
            diff = self.check_served_policy(model, step, deadline) if self.rollout.policy_check else math.nan
        except ServerNotAnswering as e:
            raise ServedPolicyError(
                f"step {step}: server not answering after the weight sync: {e}; restart the "
                "server (or let the trainer start its own) and resume the run"
            ) from None
        except ServerTooSlow as e:
            raise ServedPolicyError(
                f"step {step}: server too slow: the weight sync and served-policy check did not "
                f"finish within rollout.policy_check_timeout_s={self.rollout.policy_check_timeout_s:g} "
                f"s: {e}; raise the timeout if the server is only busy"
            ) from None
        now = time.perf_counter()
        self.last_sync = ServedPolicy(name, now - started, now - checked, diff, self.tolerance)
        return self.last_sync

    def _write_adapter(self, model, step: int) -> Path:
        version = f"v{step:06d}"
        path = self.adapter_root / version
        if path.exists():  # the same step pushed twice (never in a run): still a fresh version
            path = self.adapter_root / f"{version}-{uuid.uuid4().hex[:4]}"
        _save_adapter(model, path)
        return path

    def _load(self, path: Path, deadline: float) -> str:
        """Load the adapter at `path` under a new name; returns the name."""
        name = f"ballast-{self.engine_id}-{path.name}"
        self.server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, _remaining(deadline))
        return name

    def _unload(self, adapter: tuple[str, Path], deadline: float | None = None) -> None:
        name, path = adapter
        self.server.post("/v1/unload_lora_adapter", {"lora_name": name}, _remaining(deadline))
        shutil.rmtree(path, ignore_errors=True)

    def check_served_policy(self, model, step: int, deadline: float) -> float:
        """Prove the server serves the adapter just loaded; returns the largest canary logprob difference.

        1. Version: the server's /v1/models lists the new adapter name (which carries the step) with the
           directory just written; else 'missing adapter' or 'stale adapter'.
        2. Canary: the server samples rollout.policy_check_tokens tokens (seeded, T = 1, plain sampling) after
           canary_prompt(); the trainer teacher-forces the same tokens with its own logprob code, and every
           |server - trainer| must be within the tolerance (by dtype, or rollout.policy_check_tolerance),
           else 'stale adapter'. Sampling, not prompt_logprobs: vLLM skips the prefix cache for requests with
           prompt_logprobs, and a prefix cache holding an earlier version's states is one way to be stale."""
        name = self.adapter[0]
        models = self._listed_version(step, deadline)
        prompt, tokens, served = self._sample_canary(models, step, deadline)
        ours = _trainer_logprobs(model, prompt, tokens)
        diff = max(abs(a - b) for a, b in zip(served, ours))
        if not diff <= self.tolerance:
            raise ServedPolicyError(
                f"step {step}: stale adapter: after loading {name} the server's logprobs of the canary differ from the "
                f"trainer's by up to {diff:.3g} (tolerance {self.tolerance:g}): it samples from other weights than "
                "those just trained — an adapter reloaded in place under its old name (stale prefix cache), another "
                "base model, or another dtype (rollout.vllm_dtype; rollout.policy_check_tolerance)"
            )
        return diff

    def _listed_version(self, step: int, deadline: float) -> dict[str, dict]:
        """Check 1: /v1/models lists the new adapter from the directory just written; returns what it lists."""
        name, path = self.adapter
        models = {m["id"]: m for m in self.server.get("/v1/models", _remaining(deadline))["data"]}
        if name not in models:
            raise ServedPolicyError(
                f"step {step}: missing adapter: the server does not list {name} after loading it "
                f"(it lists {sorted(models)}); it dropped or never kept the new version — another "
                "client unloading it, a restart, or too few --max-loras/--max-cpu-loras"
            )
        root = models[name].get("root")
        if root is not None and Path(root) != path:
            raise ServedPolicyError(
                f"step {step}: stale adapter: the server serves {name} from {root}, not from {path} "
                "where this version was written"
            )
        return models

    def _sample_canary(
        self, models: dict[str, dict], step: int, deadline: float
    ) -> tuple[list[int], list[int], list[float]]:
        """Check 2's sample: the server's seeded tokens after canary_prompt() and their logprobs under the adapter."""
        name = self.adapter[0]
        length = self.rollout.policy_check_prompt_tokens
        context = [int(m["max_model_len"]) for m in models.values() if m.get("max_model_len")]  # the base lists it
        if context:  # the canary and its tokens must fit the served context
            length = min(length, min(context) - self.rollout.policy_check_tokens)
        prompt = canary_prompt(self.tokenizer, length)
        body = {
            "model": name,
            "prompt": [prompt],
            "n": 1,
            "max_tokens": self.rollout.policy_check_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "seed": CANARY_SEED,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        try:
            choice = self.server.post("/v1/completions", body, _remaining(deadline))["choices"][0]
        except ServerRefused as e:
            if e.status_code == 404:
                raise ServedPolicyError(
                    f"step {step}: missing adapter: the server lists {name} but does not sample from it: {e}"
                ) from None
            raise
        _, tokens, served, _ = _parse_choice(choice, prompt)
        return prompt, tokens, served

    def loaded_adapters(self) -> list[str]:
        """The LoRA names the server currently serves (all engines' on a shared server)."""
        return [m["id"] for m in self.server.get("/v1/models")["data"] if m.get("parent")]

    # ---------------------------------------------------------------- rollouts
    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Completion]]:
        prompts = [[int(t) for t in p] for p in prompts]
        exact = logprobs_are_policy(params)
        body = {
            "model": self.served_model,
            "prompt": prompts,
            "n": params.n,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "min_p": params.min_p,
            "repetition_penalty": params.repetition_penalty,
            "frequency_penalty": params.frequency_penalty,
            "presence_penalty": params.presence_penalty,
            "seed": params.seed,
            "stop": list(params.stop),
            "min_tokens": params.min_tokens,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        choices = sorted(self.server.post("/v1/completions", body)["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * params.n:
            raise VLLMError(f"asked the vLLM server for {len(prompts)} x {params.n} completions and got {len(choices)}")
        rows = [_parse_choice(c, prompts[c["index"] // params.n]) for c in choices]
        results: list[list[Completion]] = []
        for i, (prompt, ids, logprobs, finish) in enumerate(rows):
            if i % params.n == 0:
                results.append([])
            results[-1].append(
                Completion(
                    prompt_ids=prompt,
                    token_ids=ids,
                    logprobs=logprobs if exact else None,
                    finish_reason=finish,
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                )
            )
        return results

    # ---------------------------------------------------------------- shutdown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if not self.owns_server and self.adapter is not None:
                try:
                    self.server.post("/v1/unload_lora_adapter", {"lora_name": self.adapter[0]}, UNLOAD_TIMEOUT_S)
                except VLLMError:
                    pass
        finally:
            self.server.close()
            if self.adapter is not None:
                shutil.rmtree(self.adapter_root, ignore_errors=True)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_config(cfg) -> None:
    """Refuse, before any server starts, a TrainerConfig the vLLM engine cannot serve."""
    if not cfg.lora.enabled:
        raise ValueError(
            "rollout.engine: vllm pushes each new LoRA adapter to the server; with lora.enabled: false "
            "(full fine-tuning) there is no adapter to push: use rollout.engine: hf"
        )
    params = SamplingParams.from_rollout(cfg.rollout, n=1, seed=0)
    if not logprobs_are_policy(params) and cfg.grpo.rollout_correction.mode != "off":
        raise ValueError(
            f"{_distorting_settings(params)} with rollout.engine: vllm: vLLM then reports the logprobs of the "
            "penalised, truncated distribution it sampled from, not the policy's that the rollout correction "
            "needs; set grpo.rollout_correction.mode: off (pi_old is the trainer's either way; the "
            "engine-vs-trainer mismatch is then neither corrected nor measured), or drop those sampling settings"
        )


def engine_dtypes(cfg) -> dict[str, str]:
    """The server's and the trainer's dtypes, which set the served-policy check's tolerance."""
    trainer_dtype = resolve_dtype(cfg.model)
    return {"server_dtype": cfg.rollout.vllm_dtype or trainer_dtype, "trainer_dtype": trainer_dtype}


def start_server(cfg, log_path: Path, max_loras: int = 1, max_lora_rank: int | None = None) -> VLLMServer:
    """A vLLM server of the TrainerConfig's base model, serving up to `max_loras` of its LoRA adapters in one batch
    (concurrent trials: one each), of rank up to `max_lora_rank` (default lora.r)."""
    r = cfg.rollout
    device, visible = server_device(r.device, cfg.model.device)
    model = cfg.model.name_or_path
    if Path(model).expanduser().is_dir():
        model = str(Path(model).expanduser().absolute())
    return VLLMServer.start(
        resolve_vllm_python(r.vllm_python),
        model,
        log_path=log_path,
        dtype=engine_dtypes(cfg)["server_dtype"],
        device=device,
        visible_devices=visible,
        max_lora_rank=max_lora_rank or cfg.lora.r,
        max_loras=max_loras,
        port=r.vllm_port,
        startup_timeout_s=r.vllm_startup_timeout_s,
        extra_args=r.vllm_extra_args,
        request_timeout_s=r.vllm_request_timeout_s,
        gpu_memory_utilization=SHARED_GPU_MEMORY_UTILIZATION
        if shares_trainer_gpu(r.device, cfg.model.device)
        else None,
    )


def _remaining(deadline: float | None) -> float | None:
    """Seconds left before `deadline` (time.monotonic), for a request's timeout; None: the server's default."""
    return None if deadline is None else deadline - time.monotonic()


@torch.no_grad()
def _trainer_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """The trainer's logprobs of `tokens` after `prompt` at T = 1, by the code that computes them in training."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens], device=device)
    was_training = model.training
    model.eval()
    try:
        logprobs, _ = completion_logprobs(model, ids, torch.ones_like(ids), len(tokens), temperature=1.0)
    finally:
        model.train(was_training)
    return logprobs[0].tolist()


def _parse_choice(choice: dict, prompt: list[int]) -> tuple[list[int], list[int], list[float], str]:
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and list(echoed) != prompt:
        raise VLLMError(
            f"the vLLM server sampled from prompt ids {list(echoed)[:12]}... instead of the {prompt[:12]}... "
            "it was sent; the trainer would train on tokens the engine never saw"
        )
    lp = choice.get("logprobs") or {}
    tokens = [int(t.split(":", 1)[1]) for t in lp.get("tokens") or []]
    ids = list(choice["token_ids"]) if choice.get("token_ids") is not None else tokens
    logprobs = lp.get("token_logprobs")
    if tokens != ids or logprobs is None or len(logprobs) != len(ids) or any(x is None for x in logprobs):
        raise VLLMError(
            "the vLLM server returned no per-token logprobs matching its token ids; it must support "
            "logprobs with return_tokens_as_token_ids and return_token_ids (vLLM >= 0.10)"
        )
    finish = FINISH_REASONS.get(choice.get("finish_reason"))
    if finish is None:
        raise VLLMError(
            f"the vLLM server ended a completion with finish_reason={choice.get('finish_reason')!r} "
            "(expected 'stop' or 'length'); see its log"
        )
    return prompt, ids, [float(x) for x in logprobs], finish


def _save_adapter(model, path: Path, overwrite: bool = False) -> None:
    """The peft adapter, written to a temporary sibling and renamed into place."""
    if not hasattr(model, "peft_config"):
        raise ValueError("the vLLM engine pushes LoRA adapters; the trainer's model has none (lora.enabled: false)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    adapter = model.active_adapter  # one of several when trials share the base model (trainer/multi.py)
    # the weights as the parameters hold them: whole under torchrun's FSDP2 too (trainer/loop.py gathers them around
    # the sync), where state_dict() would hand peft the shards
    weights = {name: p.detach() for name, p in model.named_parameters()}
    model.save_pretrained(str(tmp), selected_adapters=[adapter], state_dict=weights)
    if adapter != "default":  # peft writes a named adapter into a folder of that name: served as a lone one
        shutil.move(str(tmp / adapter), str(tmp.with_name(tmp.name + "-named")))
        shutil.rmtree(tmp)
        os.rename(tmp.with_name(tmp.name + "-named"), tmp)
    if overwrite:
        shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)


# ── the artifact probe through vLLM ────────────────────────────────────────────────────────────────


@contextmanager
def serve_checkpoint(
    base_model: str | Path,
    adapter_dir: str | Path | None,
    workdir: str | Path,
    *,
    python: str | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    tokenizer=None,
    startup_timeout_s: float = 240.0,
    extra_args: Sequence[str] = (),
) -> Iterator[VLLMEngine]:
    """A fresh vLLM server that loads the saved artifact from disk — base model plus the adapter directory of a
    checkpoint (`step-N/adapter`), or a full model directory as base_model with adapter_dir=None — never the
    trainer's in-memory weights. Yields a VLLMEngine whose generate() samples the artifact (with its logprobs);
    the server is stopped on leaving the block. device: 'cpu', 'cuda', 'cuda:1', ..."""
    base = Path(base_model).expanduser()
    base_model = str(base.absolute()) if base.is_dir() else str(base_model)
    lora_modules, rank = None, None
    if adapter_dir is not None:
        adapter_dir = Path(adapter_dir).expanduser().absolute()
        config = adapter_dir / "adapter_config.json"
        if not config.is_file():
            raise FileNotFoundError(
                f"{adapter_dir} holds no adapter_config.json; pass a checkpoint's adapter/ directory"
            )
        rank = int(json.loads(config.read_text())["r"])
        lora_modules = {ARTIFACT_LORA_NAME: str(adapter_dir)}
    kind, visible = server_device(device, device)
    if tokenizer is None:
        tokenizer = load_tokenizer(base_model)
    server = VLLMServer.start(
        resolve_vllm_python(python),
        base_model,
        log_path=Path(workdir) / "server.log",
        dtype=dtype,
        device=kind,
        visible_devices=visible,
        max_lora_rank=rank,
        lora_modules=lora_modules,
        startup_timeout_s=startup_timeout_s,
        extra_args=extra_args,
    )
    try:
        engine = VLLMEngine(
            server, tokenizer, workdir, owns_server=True, served_model=ARTIFACT_LORA_NAME if lora_modules else None
        )
    except BaseException:
        server.close()
        raise
    with engine:
        yield engine
