"""Bad input, given as a user gives it — the `ballast` command in its own process: every row exits with status 2
and prints one line on stderr that names the input and says what to do, with no traceback (issue 11 §5).

Each row: what is wrong → the command → a fragment the line must hold. A row's spec is the tiny test spec
(tests/conftest.py) with one thing changed, or the raw bytes of a spec file. Rows found by the issue's audit
and by fuzzing the spec come first; grow the table with every case found. A spec typo is refused before torch
or transformers is imported (the last test), which is what keeps it under a couple of seconds.
"""

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import yaml

from tests.conftest import REPO, tiny_spec

CLI = "import sys; from flows.cli import main; sys.exit(main())"


@dataclass
class Case:
    id: str
    fragment: str  # the one stderr line must hold this
    change: Callable[[dict], None] | None = None  # edits the tiny spec (a dict) in place
    raw: str | bytes | None = None  # or: the spec file's whole content ({model} is the tiny model)
    args: tuple = ("train", "{spec}", "--quiet")  # the command; {spec} the spec file, {dir} the test's folder
    files: dict = field(default_factory=dict)  # more files in the test's folder: name -> text


def put(path: str, value) -> Callable[[dict], None]:
    """A change that sets the dotted spec field `path` (list items by index) to `value`."""

    def change(spec: dict) -> None:
        node, keys = spec, path.split(".")
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node.setdefault(k, {})
        node[int(keys[-1]) if isinstance(node, list) else keys[-1]] = value

    return change


def spec_text(model) -> str:
    return yaml.safe_dump(tiny_spec(model), sort_keys=False)


TRAJECTORY = {
    "prompt": "2+2",
    "answer": "4",
    "completions": [{"token_ids": [60, 52, 62], "logprobs": [-0.1, -0.2, -0.3]}] * 4,
}


def trajectory(**completion) -> str:
    return json.dumps({**TRAJECTORY, "completions": [{**TRAJECTORY["completions"][0], **completion}] * 4}) + "\n"


OFFLINE = [
    put("rollout.engine", "offline"),
    put("data.source", "{dir}/traj.jsonl"),
    put("data.eval_path", None),
    put("grpo.rollout_correction", {"mode": "off"}),
]


def offline(spec: dict) -> None:
    for change in OFFLINE:
        change(spec)


CASES = [
    Case(  # YAML 1.1 reads a bare off / no / yes as a boolean
        "a name YAML reads as a boolean",
        "field 'name': Input should be a valid string (got False); YAML reads that bare word as a boolean: quote it "
        '(name: "..." in a file, --set \'name="..."\')',
        raw="{spec}name: off\n",
    ),
    # ── found by the audit (issue 11 §5) ──────────────────────────────────────────────────────────
    Case(
        "trajectory token ids outside the vocabulary",
        "traj.jsonl:1 completions[0].token_ids holds 99999",
        offline,
        files={"traj.jsonl": trajectory(token_ids=[60, 99999, 62])},
    ),
    # found at validate, from the JSON alone, before the model loads (they were found once the engine read the file)
    *(
        Case(
            f"validate: trajectory {what}",
            fragment,
            offline,
            args=("validate", "{spec}"),
            files={"traj.jsonl": trajectory(**completion)},
        )  # fmt: skip
        for what, fragment, completion in [
            ("NaN logprob", "traj.jsonl:1 completions[0].logprobs[1] is nan", {"logprobs": [-0.1, float("nan"), -1]}),
            ("positive logprob", "completions[0].logprobs[0] is 0.5: a logprob must be", {"logprobs": [0.5] * 3}),
            ("fewer logprobs than tokens", "completions[0] has 3 tokens but 2 logprobs", {"logprobs": [-0.1, -0.2]}),
            ("a token id that is text", "completions[0].token_ids must be a list of whole", {"token_ids": ["a"]}),
            ("a negative token id", "completions[0].token_ids must be a list of whole numbers >=", {"token_ids": [-1]}),
            ("an unknown finish_reason", "completions[0].finish_reason is 'eos'", {"finish_reason": "eos"}),
        ]
    ),
    Case(
        "validate: trajectory groups of another size than grpo.num_generations",
        "traj.jsonl:1 has 3 completions but grpo.num_generations is 4",
        offline,
        args=("validate", "{spec}"),
        files={"traj.jsonl": json.dumps({**TRAJECTORY, "completions": TRAJECTORY["completions"][:3]}) + "\n"},
    ),
    Case(
        "validate: trajectory completion with no token ids and no text",
        "traj.jsonl:1 completions[0] has neither token_ids nor text",
        offline,
        args=("validate", "{spec}"),
        files={"traj.jsonl": json.dumps({**TRAJECTORY, "completions": [{"logprobs": [-0.1]}] * 4}) + "\n"},
    ),
    Case(
        "a JSONL line that is a list",
        "data.jsonl:2 is a JSON list",
        put("data.source", "{dir}/data.jsonl"),
        files={"data.jsonl": '{"prompt": "1+1", "answer": "2"}\n[1, 2]\n'},
    ),
    Case("model.device: cuda without CUDA", "model.device='cuda'", put("model.device", "cuda")),
    Case("lora.r: 1e20", "field 'lora.r'", put("lora.r", 1e20)),
    Case("LoRA target modules absent from the model", "lora.target_modules", put("lora.target_modules", ["qkv_proj"])),
    Case(
        "a reward module that calls sys.exit(0) on import",  # it ended validate and run silently with status 0
        "importing module 'exits_on_import' raised SystemExit: 0; fix the module",
        put("rewards", [{"name": "exact_answer"}, {"name": "exits_on_import:score"}]),
        files={"exits_on_import.py": "import sys\n\nsys.exit(0)\n"},
    ),
    Case(
        "a custom reward that calls sys.exit(0)",
        "reward 'score' (exits_on_call:score) raised SystemExit: 0",
        put("rewards", [{"name": "exact_answer"}, {"name": "exits_on_call:score"}]),
        files={"exits_on_call.py": "import sys\n\n\ndef score(completions, answers, prompts):\n    sys.exit(0)\n"},
    ),
    Case(
        "tracking.uri with a scheme MLflow does not know",  # it passed validate and failed in the flow, exit 1
        "field 'tracking.uri': 'postgress://db/ballast' has the scheme 'postgress'",
        put("tracking.uri", "postgress://db/ballast"),
    ),
    Case(
        "storage.uri on a store Ballast does not open",
        "field 'storage.uri': 'gs://bucket/runs' is not an artifact store Ballast opens",
        put("storage.uri", "gs://bucket/runs"),
    ),
    Case(  # it was read after training, in the probe stage
        "validate: probe.prompts_file that does not exist",
        "probe prompts file nope.jsonl does not exist; set probe.prompts_file",
        put("probe.prompts_file", "nope.jsonl"),
        args=("validate", "{spec}"),
    ),
    Case(
        "validate: probe.prompts_file with a line that is not a prompt",
        "probe.jsonl:1: each line must be a JSON object with a non-empty 'prompt' string",
        put("probe.prompts_file", "probe.jsonl"),
        args=("validate", "{spec}"),
        files={"probe.jsonl": '{"question": "2+2"}\n'},
    ),
    Case(
        "train --output naming a file",
        "is a file; give the run's directory",
        args=("train", "{spec}", "--output", "{dir}/taken", "--quiet"),
        files={"taken": "a file\n"},
    ),
    Case(  # found in the pipeline's train task: Prefect's tracebacks of the task and the flow came before the line
        "ballast run: a reward that returns NaN for sampled completions",
        "reward 'nan_for_sampled' returned nan for completion 0; reward functions must return finite floats",
        put("rewards", [{"name": "exact_answer"}, {"name": "tests.reward_fixtures:nan_for_sampled"}]),
        args=("run", "{spec}"),
    ),
    Case(
        "a custom reward that raises",
        "reward 'raises_on_call' (tests.reward_fixtures:raises_on_call) raised",
        put("rewards", [{"name": "exact_answer"}, {"name": "tests.reward_fixtures:raises_on_call"}]),
    ),
    Case(
        "a fork from a run id in a project that has tracked nothing",
        "fork.run_id=0123456789abcdef: project_dir",
        put("fork.run_id", "0123456789abcdef"),
        args=("run", "{spec}"),
    ),
    Case(
        "a fork from a run id the project's store does not hold",
        "fork.run_id=0123456789abcdef: MLflow run '0123456789abcdef' was not found in sqlite:///",
        put("fork.run_id", "0123456789abcdef"),
        args=("run", "{spec}"),
        files={"project/mlflow.db": ""},  # an empty SQLite file: MLflow makes it a store with no runs
    ),
    Case("a duplicate top-level section", "key 'optim' appears twice", raw="{spec}optim:\n  steps: 3\n"),
    Case(
        "a credential inside a URI",
        "field 'tracking.uri' holds a password",
        put("tracking.uri", "https://user:hunter2@mlflow.example.com"),
    ),
    Case(
        "an .inf learning rate",
        "field 'optim.learning_rate': Input should be a finite number",
        put("optim.learning_rate", float("inf")),
    ),
    Case(
        "a .nan reward weight",
        "field 'rewards.0.weight': Input should be a finite number",
        put("rewards.0.weight", float("nan")),
    ),
    Case(
        "rollout.min_tokens above rollout.max_tokens",
        "rollout.min_tokens=30 is above rollout.max_tokens=24",
        put("rollout.min_tokens", 30),
    ),
    Case(
        "more eval prompts than the source can make",
        "data.num_eval_prompts=500",
        lambda s: (put("data.max_digits", 1)(s), put("data.num_eval_prompts", 500)(s)),
    ),
    Case(
        "an unknown eval.reward",
        "eval.reward='accuracy' is not one of the experiment's rewards",
        put("eval.reward", "accuracy"),
    ),
    Case(
        "ballast train with fork.run_id",
        "fork.run_id=0123456789abcdef: `ballast train` has no tracking store",
        put("fork.run_id", "0123456789abcdef"),
    ),
    Case(
        "--steps -1",
        "--steps -1: give the run's total number of steps, 1 or more",
        args=("train", "{spec}", "--steps", "-1"),
    ),
    Case("a binary spec file", "is not UTF-8 text", raw=b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"),
    Case("a latin-1 spec file", "is not UTF-8 text (byte 0xe9", raw="name: caf\u00e9\n".encode("latin-1")),
    Case(
        "empty trajectory completions",
        "traj.jsonl:1 completions[0] is empty (no tokens)",
        offline,
        files={"traj.jsonl": json.dumps({**TRAJECTORY, "completions": [{"text": ""}] * 4}) + "\n"},
    ),
    Case("a spec typo", "unknown field 'optim.stepz'", put("optim.stepz", 3)),
    # ── found by fuzzing the spec and the commands ────────────────────────────────────────────────
    Case("a run name that is a path", "field 'name': a run's name is one directory name", put("name", "../../etc")),
    Case(
        "a credential inside an s3 URI",
        "field 'storage.uri' holds a password",
        put("storage.uri", "s3://AK:SK@bucket/x"),
    ),
    Case(
        "a secret-looking field",
        "field 'rewards.0.kwargs.api_key' looks like a secret",
        put("rewards.0.kwargs", {"api_key": "sk-123"}),
    ),
    Case("a whole number given as text", "field 'optim.steps'", put("optim.steps", "ten")),
    Case("a section given as a list", "field 'lora'", put("lora", [1, 2])),
    Case("rewards given as a mapping", "field 'rewards'", put("rewards", {"name": "exact_answer"})),
    Case("a fractional LoRA rank", "field 'lora.r'", put("lora.r", 1.5)),
    Case("a zero sampling temperature", "field 'rollout.temperature'", put("rollout.temperature", 0)),
    Case("an unknown built-in reward", "exactanswer", put("rewards", [{"name": "exactanswer"}])),
    Case("a reward module that does not exist", "no_such_module", put("rewards", [{"name": "no_such_module:f"}])),
    Case("a data file that does not exist", "missing.jsonl", put("data.source", "{dir}/missing.jsonl")),
    Case("a data source that is neither", "data.source='arithmetic'", put("data.source", "arithmetic")),
    Case(
        "a JSONL line without a prompt",
        "data.jsonl:1 has no 'prompt' field",
        put("data.source", "{dir}/data.jsonl"),
        files={"data.jsonl": '{"question": "1+1", "answer": "2"}\n'},
    ),
    Case(
        "a model directory that does not exist",
        "model.name_or_path='/nonexistent/model'",
        put("model.name_or_path", "/nonexistent/model"),
    ),
    Case("a device that does not exist", "model.device='tpu'", put("model.device", "tpu")),
    Case("a probe tag with a space", "field 'probe.format_tag'", put("probe.format_tag", "my tag")),
    Case("a spec that is a list", "must hold a mapping of sections", raw="- model\n- lora\n"),
    Case("a spec that is not YAML", "is not valid YAML: line 2", raw="model:\n\t name_or_path: x\n"),
    Case("an empty spec", "field 'model' is required", raw=""),
    Case("a spec file that does not exist", "spec file nope.yaml does not exist", args=("train", "nope.yaml")),
    Case("--steps 0", "--steps 0: give the run's total number of steps", args=("train", "{spec}", "--steps", "0")),
    Case(
        "--steps that is not a number",
        "argument --steps: invalid int value: 'ten'",
        args=("train", "{spec}", "--steps", "ten"),
    ),
    Case(
        "--set without '='",
        "--set 'optim.steps': expected key.path=value",
        args=("train", "{spec}", "--set", "optim.steps"),
    ),
    Case("--set into a value", "--set lora.r.x: 'r' is not a section", args=("train", "{spec}", "--set", "lora.r.x=1")),
    Case("an unknown command", "invalid choice: 'trian'", args=("trian",)),
    Case(
        "train into a run with checkpoints, without --resume",
        "already holds checkpoints; pass --resume",
        args=("train", "{spec}", "--output", "{dir}/run"),
        files={"run/checkpoints/step-000002/x": ""},
    ),
    Case(
        "a resume from a checkpoint without a manifest",
        "has no manifest.json",
        args=("train", "{spec}", "--output", "{dir}/run", "--resume"),
        files={"run/checkpoints/step-000002/x": ""},
    ),
    Case("run with neither SPEC nor --resume", "give an experiment SPEC to run", args=("run",)),
    Case(
        "run --resume with --set",
        "--set cannot change run abc on --resume",
        args=("run", "--resume", "abc", "--set", "optim.steps=9"),
    ),
    Case(
        "run --resume in a project that has tracked nothing",
        "has no MLflow store (mlflow.db), so no run to resume; give --project-dir the project",
        args=("run", "--resume", "abc", "--project-dir", "{dir}/p"),
    ),
    Case(
        "run --resume of a run the project's store does not hold",
        "--resume abc: MLflow run 'abc' was not found",
        args=("run", "--resume", "abc", "--project-dir", "{dir}/p"),
        files={"p/mlflow.db": ""},  # an empty SQLite database: MLflow makes its tables, and holds no run
    ),
    Case(
        "a fork checkpoint that does not exist",
        "fork source",
        put("fork.checkpoint", "{dir}/nowhere/step-000002"),
        args=("run", "{spec}"),
    ),
    Case("sweep --trials 0", "--trials 0: give 1 or more", args=("sweep", "{spec}", "--trials", "0")),
    Case(
        "a sweep storage URL with a password",
        "--storage: the Optuna storage URL holds a password",
        args=("sweep", "{spec}", "--storage", "postgresql://u:pw@127.0.0.1/db"),
    ),
    Case("a latin-1 sweep file", "sweep file", raw="study: caf\u00e9\n".encode("latin-1"), args=("sweep", "{spec}")),
    Case(
        "a sweep file with a duplicate key",
        "key 'space' appears twice",
        raw="space: {}\nspace: {}\n",
        args=("sweep", "{spec}"),
    ),
    Case("a probe of a checkpoint that does not exist", "no such checkpoint directory", args=("probe", "{dir}/nope")),
    Case(
        "compare --alpha 2",
        "--alpha 2.0: give a significance level between 0 and 1",
        args=("compare", "a.json", "b.json", "--alpha", "2"),
    ),
    Case(
        "compare with a B that is not there (before A is read or probed)",
        "B: '{dir}/step-00060' is neither an existing probe report, checkpoint or run directory",
        args=("compare", "{spec}", "{dir}/step-00060"),
    ),
    Case(
        "regress --alpha 5 (before either ref trains)",
        "--alpha 5.0: give a significance level between 0 and 1",
        args=("regress", "{spec}", "--ref", "HEAD", "--ref", "HEAD", "--alpha", "5"),
    ),
    # ── a researcher's own task, week one (issue 23 §7, §10) ──────────────────────────────────────────────────
    Case(
        "a custom reward that returns NaN",
        "rewards[1] (tests.reward_fixtures:nan_for_fourth): reward 'nan_for_fourth' returned nan for completion 3",
        put("rewards", [{"name": "exact_answer"}, {"name": "tests.reward_fixtures:nan_for_fourth"}]),
    ),
    Case(
        "a custom reward that returns NaN in the middle of training",
        "reward 'nan_from_third_call' returned nan for completion 0; reward functions must return finite floats",
        put("rewards", [{"name": "exact_answer"}, {"name": "tests.reward_fixtures:nan_from_third_call"}]),
    ),
    Case(
        "a custom reward that returns None",
        "reward 'returns_none' returned None (NoneType), not a list",
        put("rewards", [{"name": "exact_answer"}, {"name": "tests.reward_fixtures:returns_none"}]),
    ),
    Case(
        "a custom reward that returns a string",
        "reward 'returns_a_string' returned '1.0' (str), not a list",
        put("rewards", [{"name": "exact_answer"}, {"name": "tests.reward_fixtures:returns_a_string"}]),
    ),
    Case(
        "a custom reward that returns one value too few",
        "reward 'one_short' returned 7 values for 8 completions",
        put("rewards", [{"name": "exact_answer"}, {"name": "tests.reward_fixtures:one_short"}]),
    ),
    Case(
        "a misspelt reward kwarg that **kwargs would swallow",
        "rewards[0].kwargs.tolerence: 'tests.reward_fixtures:reads_kwargs' has no parameter 'tolerence'",
        put("rewards", [{"name": "tests.reward_fixtures:reads_kwargs", "kwargs": {"tolerence": 0.1}}]),
    ),
    Case(
        "a data column that is also a reward kwarg",
        "data column 'strict' and rewards[0].kwargs.strict both give",
        lambda s: (
            put("data.source", "{dir}/data.jsonl")(s),
            put("rewards", [{"name": "tests.reward_fixtures:capital_match", "kwargs": {"strict": True}}])(s),
        ),
        files={"data.jsonl": '{"prompt": "Capital of Peru?", "answer": "Lima", "strict": false}\n'},
    ),
    Case(
        "a typo in a reward's name, with eval.reward naming it right",
        "rewards[0].name='tests.reward_fixtures:starts_with_answr': module 'tests.reward_fixtures' has no attribute",
        lambda s: (
            put("rewards", [{"name": "tests.reward_fixtures:starts_with_answr"}])(s),
            put("eval.reward", "starts_with_answer")(s),
        ),
    ),
    Case(
        "a hub model name that is not in the cache, offline",
        "model.name_or_path='ballast-tests/no-such-model' is neither a local directory nor in the local Hugging Face",
        put("model.name_or_path", "ballast-tests/no-such-model"),
        args=("run", "{spec}"),
    ),
    Case(
        "a data file next to the spec that is not there",
        "data.source: data file 'missing.jsonl' is neither in the spec's folder",
        put("data.source", "missing.jsonl"),
    ),
    # ── the last bad inputs (issue 28 §3) ─────────────────────────────────────────────────────────────────
    Case("a NUL byte in the run name", "field 'name' holds a NUL character (\\0) at position 3", put("name", "run\0x")),
    Case(
        "a NUL byte in a path",
        "field 'data.source' holds a NUL character",
        put("data.source", "{dir}/data\x00.jsonl"),
        args=("validate", "{spec}"),
    ),
    Case("a tab in the run name", "a run's name is printable text; '\\t' at position 1", put("name", "a\tb")),
    Case("a run name longer than a directory name", "at most 200 bytes", put("name", "x" * 300)),
    Case(
        "ballast train from a fork checkpoint that does not exist",
        "fork source fork.checkpoint=",
        put("fork.checkpoint", "{dir}/nowhere/step-000002"),
    ),
    Case(
        "ballast train from a fork checkpoint without a manifest",
        "ckpt/step-000002 has no manifest.json",
        put("fork.checkpoint", "{dir}/ckpt/step-000002"),
        files={"ckpt/step-000002/adapter/adapter_model.safetensors": ""},
    ),
    Case(
        "trajectories without logprobs under the default rollout correction",
        "traj.jsonl:2 completions[0] has no logprobs, and grpo.rollout_correction.mode: tis weights each token",
        lambda s: (offline(s), put("grpo.rollout_correction", {"mode": "tis"})(s)),
        files={"traj.jsonl": trajectory() + trajectory(logprobs=None)},
    ),
    Case(
        "an episode without logprobs under the default rollout correction",
        "traj.jsonl:1 completions[0] has no logprobs",
        lambda s: (offline(s), put("grpo.rollout_correction", {"mode": "mis"})(s)),
        files={
            "traj.jsonl": json.dumps(
                {
                    **TRAJECTORY,
                    "completions": [
                        {"messages": [{"role": "user", "content": "2+2"}, {"role": "assistant", "token_ids": [60, 52]}]}
                    ]
                    * 4,
                }
            )
            + "\n"
        },
    ),
    Case(
        "train --resume with no checkpoint in --output",
        "--resume: no checkpoint to continue from in",
        args=("train", "{spec}", "--output", "{dir}/run", "--resume"),
        files={"run/metrics.jsonl": '{"step": 1}\n'},
    ),
    Case(
        "train --resume with no --output directory at all",
        "give --output the directory of the run to continue, or leave out --resume",
        args=("train", "{spec}", "--output", "{dir}/nowhere", "--resume"),
    ),
    Case(
        "rollout.engine: vllm without its environment",
        "rollout.vllm_python='/nonexistent/python' does not exist; create the environment with `ballast vllm-env`",
        put("rollout", {"engine": "vllm", "vllm_python": "/nonexistent/python", "max_tokens": 24}),
        args=("validate", "{spec}"),
    ),
]


def write_spec(case: Case, model, where) -> str:
    path = where / "spec.yaml"
    if case.raw is not None:
        raw = case.raw.replace("{spec}", spec_text(model)) if isinstance(case.raw, str) else case.raw
        path.write_bytes(raw.encode() if isinstance(raw, str) else raw)
    else:
        spec = tiny_spec(model, project_dir=str(where / "project"), probe={"enabled": False}, optim={"steps": 2})
        if case.change is not None:
            case.change(spec)
        text = yaml.safe_dump(spec, sort_keys=False, allow_unicode=True).replace("{dir}", str(where))
        path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_exits_2_with_one_line_naming_it(case, tiny_model, tmp_path):
    for name, text in case.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    spec = write_spec(case, tiny_model, tmp_path)
    args = [a.replace("{spec}", spec).replace("{dir}", str(tmp_path)) for a in case.args]
    proc = subprocess.run(
        [sys.executable, "-c", CLI, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert (proc.returncode, len(lines)) == (2, 1), proc.stderr[-3000:]
    assert lines[0].startswith("error: ") and case.fragment.replace("{dir}", str(tmp_path)) in lines[0], lines[0]


def test_ballast_train_starts_from_fork_checkpoint_not_from_the_base_model(tiny_model, tmp_path):
    """The other half of "ballast train ignored fork.checkpoint": a verified fork source, recorded in the lineage."""
    from flows.cli import main

    source = tmp_path / "source"
    spec = write_spec(Case("source", "", put("checkpoint.every", 1)), tiny_model, tmp_path)
    assert main(["train", spec, "--output", str(source), "--steps", "1", "--quiet"]) == 0
    fork_from = source / "checkpoints" / "step-000001"
    spec = write_spec(Case("fork", "", put("fork.checkpoint", str(fork_from))), tiny_model, tmp_path)
    assert main(["train", spec, "--output", str(tmp_path / "forked"), "--steps", "1", "--quiet"]) == 0
    manifest = json.loads((tmp_path / "forked" / "checkpoints" / "step-000001" / "manifest.json").read_text())
    assert manifest["lineage"]["fork_checkpoint"] == str(fork_from)


def test_a_spec_typo_is_refused_before_torch_or_transformers_is_imported(tiny_model, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(spec_text(tiny_model).replace("steps:", "stepz:"))
    probe = (
        "import sys; from flows.cli import main; rc = main(['train', sys.argv[1]]); "
        "print(rc, sorted(m for m in ('torch', 'transformers', 'peft', 'prefect', 'mlflow') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(spec)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.split("\n")[0] == "2 []", proc.stdout + proc.stderr
    assert "unknown field 'optim.stepz'" in proc.stderr
