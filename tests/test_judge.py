"""The judge reward (trainer/judge.py): what it sends, how it parses, retries, caches and reports, against
a local fault-injecting server (tests/judge_server.py); then against a real OpenAI-compatible server — vLLM
from .ballast/vllm-venv serving the tiny quickstart model, with an API key — and end to end: `ballast run`
on examples/quickstart-judge.yaml records judge/* metrics in MLflow and leaves the key nowhere.

The tiny model is a poor judge; guided JSON (the json_schema response_format) makes its answers valid, so
the plumbing is real. Its context is 256 tokens, so the example judges groups of 4 with a short prompt.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

from tests.conftest import REPO, VLLM_STARTUP_TIMEOUT_S
from tests.judge_server import USAGE, JudgeServer
from trainer.config import RewardConfig
from trainer.engines.base import Completion
from trainer.judge import CACHE_FILE, JudgeError, JudgeReward, score_schema
from trainer.metrics import describe
from trainer.rewards import RewardComputer

KEY_ENV = "BALLAST_TEST_JUDGE_KEY"


@pytest.fixture
def server():
    s = JudgeServer()
    yield s
    s.close()


def judge(server, **kwargs) -> JudgeReward:
    """A judge on the fault server; fast retries unless a test says otherwise."""
    kwargs = {"base_url": server.url, "model": "judge-test", "backoff_s": 0.01, **kwargs}
    return JudgeReward(**kwargs)


def score(j: JudgeReward, completions, prompts, answers=None) -> list[float]:
    return j(completions=completions, answers=answers or ["0"] * len(completions), prompts=prompts)


def user_message(request: dict) -> str:
    return request["body"]["messages"][-1]["content"]


# ------------------------------------------------------------------------------------------ what is sent


def test_each_group_goes_in_one_request_with_a_json_schema_for_its_size(server):
    j = judge(server, group_size=3)
    score(j, ["a", "bb", "ccc", "dddd", "e", "ff"], ["p"] * 3 + ["q"] * 3)

    assert len(server.requests) == 2
    requests = sorted(server.requests, key=user_message)  # groups are judged in parallel
    for request, texts in zip(requests, (["a", "bb", "ccc"], ["dddd", "e", "ff"])):
        assert request["path"] == "/v1/chat/completions"
        assert user_message(request).splitlines()[-3:] == [f"[{i}] {t}" for i, t in enumerate(texts, 1)]
        fmt = request["body"]["response_format"]
        assert fmt["type"] == "json_schema" and fmt["json_schema"]["schema"] == score_schema(3)
    assert score_schema(3)["required"] == ["1", "2", "3"]


def test_scores_are_the_judges_answer_over_ten_in_completion_order(server):
    j = judge(server, group_size=4)
    # the fault server scores each response by its length (at most 10)
    assert score(j, ["a", "abcde", "", "x" * 30], ["p"] * 4) == [0.1, 0.5, 0.0, 1.0]


def test_a_run_of_one_prompt_longer_than_the_group_size_is_split(server):
    j = judge(server, group_size=2)
    score(j, ["a", "b", "c", "d"], ["p"] * 4)
    assert [len(r["body"]["response_format"]["json_schema"]["schema"]["required"]) for r in server.requests] == [2, 2]


def test_eval_batches_with_one_completion_per_prompt_are_judged_one_by_one(server):
    j = judge(server, group_size=8)
    assert score(j, ["ab", "abc", "abcd"], ["1+1", "2+2", "3+3"]) == [0.2, 0.3, 0.4]
    assert sorted(user_message(r).splitlines()[1] for r in server.requests) == ["Task: 1+1", "Task: 2+2", "Task: 3+3"]


def test_logprobs_token_ids_and_internal_fields_never_leave(server):
    completions = [
        Completion(
            prompt_ids=[31337, 4242],
            token_ids=[777001, 777002],
            logprobs=[-0.123456789, -2.5],
            finish_reason="stop",
            text="<output>81</output>",
        ),
        {
            "message": {"role": "assistant", "content": "<output>80</output>"},
            "finish_reason": "length",
            "logprobs": {"content": [{"token": "8", "logprob": -0.987654321}]},
            "token_ids": [555001],
            "internal_state": "do-not-send",
        },
    ]
    j = judge(server, group_size=2)
    assert score(j, completions, ["23+58", "23+58"]) == [1.0, 1.0]

    (request,) = server.requests
    raw = request["raw"].decode()
    for leak in (
        "31337",
        "777001",
        "0.123456789",
        "-2.5",
        "0.987654321",
        "555001",
        "logprob",
        "token_ids",
        "do-not-send",
        "finish_reason",
        "length",
    ):
        assert leak not in raw, leak
    assert set(request["body"]) == {"model", "messages", "temperature", "max_tokens", "response_format"}
    assert user_message(request).splitlines()[1:] == [
        "Task: 23+58",
        "[1] <output>81</output>",
        "[2] <output>80</output>",
    ]


def test_the_reference_answer_is_sent_only_when_asked(server):
    score(judge(server), ["a"], ["1+1"], answers=["2"])
    score(judge(server, include_reference=True), ["a"], ["1+1"], answers=["2"])
    assert "Reference answer" not in user_message(server.requests[0])
    assert "Reference answer: 2" in user_message(server.requests[1]).splitlines()


def test_the_key_is_read_from_the_environment_at_each_request_and_kept_nowhere(server, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-first-0000")
    j = judge(server, api_key_env=KEY_ENV)
    score(j, ["a"], ["p1"])
    monkeypatch.setenv(KEY_ENV, "sk-second-1111")
    score(j, ["a"], ["p2"])

    assert [r["headers"]["Authorization"] for r in server.requests] == ["Bearer sk-first-0000", "Bearer sk-second-1111"]
    held = repr(vars(j)) + repr(vars(j.cfg)) + repr(j.cache.entries)
    assert "sk-first" not in held and "sk-second" not in held


def test_no_authorization_header_without_api_key_env(server):
    score(judge(server), ["a"], ["p"])
    assert "Authorization" not in server.requests[0]["headers"]


# ------------------------------------------------------------------------------------------ faults


def test_http_500_is_retried_after_the_backoff(server):
    server.script.append(("status", 500))
    j = judge(server, backoff_s=0.3)
    assert score(j, ["abc"], ["p"]) == [0.3]
    first, second = server.requests
    assert second["t"] - first["t"] >= 0.3
    m = j.metrics()
    assert (m["judge/requests"], m["judge/retries"], m["judge/failures"]) == (2.0, 1.0, 1.0)


def test_backoff_doubles_between_retries(server):
    server.script.extend([("status", 503), ("status", 503), ("status", 503)])
    j = judge(server, backoff_s=0.2, max_retries=3)
    assert score(j, ["ab"], ["p"]) == [0.2]
    t = [r["t"] for r in server.requests]
    assert [t[1] - t[0] >= 0.2, t[2] - t[1] >= 0.4, t[3] - t[2] >= 0.8] == [True, True, True]


def test_a_429_retry_after_is_honoured(server):
    server.script.append(("status", 429, "slow down", {"Retry-After": "1"}))
    j = judge(server, backoff_s=0.01)
    assert score(j, ["ab"], ["p"]) == [0.2]
    assert server.requests[1]["t"] - server.requests[0]["t"] >= 1.0


def test_a_request_past_timeout_s_is_abandoned_and_retried(server):
    server.script.append(("slow", 3))
    j = judge(server, timeout_s=0.5)
    assert score(j, ["abcd"], ["p"]) == [0.4]
    m = j.metrics()
    assert (m["judge/requests"], m["judge/failures"]) == (2.0, 1.0)
    assert 0.5 <= m["judge/latency_max"] < 3


def test_an_answer_trickling_in_past_timeout_s_is_cut_off(server):
    server.script.append(("trickle", 0.05))  # a whole answer would take ~10 s; each byte comes well within the timeout
    j = judge(server, timeout_s=1.0)
    assert score(j, ["abcd"], ["p"]) == [0.4]
    assert j.metrics()["judge/failures"] == 1.0
    assert j.metrics()["judge/latency_max"] < 5


def test_a_malformed_answer_is_retried(server):
    server.script.extend(["malformed", "not_chat"])
    j = judge(server)
    assert score(j, ["abcdefg"], ["p"]) == [0.7]
    assert j.metrics()["judge/failures"] == 2.0


def test_connection_errors_are_retried_then_fail_the_step(server):
    url = server.url
    server.close()
    j = JudgeReward(base_url=url, model="m", max_retries=2, backoff_s=0.01)
    with pytest.raises(JudgeError, match=r"every attempt failed, the last with: connection error .*max_retries=2"):
        score(j, ["a"], ["p"])


def test_malformed_every_time_fails_the_step_with_on_failure_fail(server):
    server.default = "malformed"
    j = judge(server, max_retries=2, group_size=2)
    with pytest.raises(JudgeError) as e:
        score(j, ["a", "b"], ["p", "p"])
    message = str(e.value)
    assert "\n" not in message and "malformed answer, not JSON" in message and "on_failure: zero" in message
    assert len(server.requests) == 3


def test_on_failure_zero_scores_only_the_failed_group_zero_and_counts_it(server):
    server.default = "malformed"
    server.script.append("ok")  # the first request answers; every later one is malformed
    j = judge(server, group_size=2, max_retries=1, on_failure="zero", concurrency=1)
    assert score(j, ["abc", "abcdef", "x", "y"], ["p", "p", "q", "q"]) == [0.3, 0.6, 0.0, 0.0]
    m = j.metrics()
    assert (m["judge/groups"], m["judge/groups_zeroed"], m["judge/failures"]) == (2.0, 1.0, 2.0)


def test_a_4xx_fails_at_once_whatever_on_failure_says_and_names_the_variable(server, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-wrong-key-5678")
    server.default = ("status", 401, "invalid key sk-wrong-key-5678")  # a server that echoes the key
    j = judge(server, api_key_env=KEY_ENV, on_failure="zero")
    with pytest.raises(JudgeError, match=rf"HTTP 401.*check that \${KEY_ENV} holds a valid key") as e:
        score(j, ["a"], ["p"])
    assert "sk-wrong-key-5678" not in str(e.value) and "***" in str(e.value)
    assert len(server.requests) == 1


def test_concurrency_bounds_the_requests_in_flight(server):
    server.default = ("slow", 1.0)  # long enough that the requests overlap even on a loaded machine
    j = judge(server, concurrency=2)
    assert score(j, list("abcdef"), list("123456")) == [0.1] * 6
    assert len(server.requests) == 6 and server.max_in_flight == 2


def test_a_hanging_server_cannot_hold_a_step_past_step_timeout_s(server):
    server.default = "hang"
    j = judge(server, timeout_s=60, step_timeout_s=1.0)
    outcome = {}

    def call():
        try:
            score(j, ["a", "b"], ["p", "q"])
        except JudgeError as e:
            outcome["error"] = str(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "the judge call still blocks 30 s after a 1 s step deadline"
    assert "no answer within step_timeout_s=1.0" in outcome["error"]


def test_step_timeout_with_on_failure_zero_zeroes_the_unanswered_groups(server):
    server.script.extend(["ok", "hang"])
    j = judge(server, timeout_s=60, step_timeout_s=1.0, on_failure="zero", concurrency=1)
    assert score(j, ["ab", "cd"], ["p", "q"]) == [0.2, 0.0]
    assert j.metrics()["judge/groups_zeroed"] == 1.0


# ------------------------------------------------------------------------------------------ cache


def test_a_resumed_run_finds_its_groups_in_the_cache_and_sends_nothing(server, tmp_path):
    first = judge(server, group_size=2, output_dir=tmp_path)
    scores = score(first, ["a", "abc", "ab", "abcd"], ["p", "p", "q", "q"])
    assert len(server.requests) == 2 and (tmp_path / CACHE_FILE).is_file()

    resumed = judge(server, group_size=2, output_dir=tmp_path)  # a new process on the same run directory
    assert score(resumed, ["a", "abc", "ab", "abcd"], ["p", "p", "q", "q"]) == scores
    assert len(server.requests) == 2
    m = resumed.metrics()
    assert (m["judge/cache_hits"], m["judge/requests"], m["judge/tokens_in"]) == (2.0, 0.0, 0.0)


def test_the_cache_key_covers_rubric_model_prompt_and_completions(server, tmp_path):
    score(judge(server, output_dir=tmp_path), ["a"], ["p"])
    score(judge(server, output_dir=tmp_path, rubric="Shorter is better."), ["a"], ["p"])
    score(judge(server, output_dir=tmp_path, model="other-judge"), ["a"], ["p"])
    score(judge(server, output_dir=tmp_path), ["a"], ["p2"])
    score(judge(server, output_dir=tmp_path), ["b"], ["p"])
    assert len(server.requests) == 5
    score(judge(server, output_dir=tmp_path), ["a"], ["p"])
    assert len(server.requests) == 5


def test_a_torn_last_cache_line_is_skipped_and_the_cache_still_grows(server, tmp_path):
    score(judge(server, output_dir=tmp_path), ["a"], ["p"])
    with open(tmp_path / CACHE_FILE, "a") as f:
        f.write('{"key": "abc", "sco')  # a run killed mid-write
    j = judge(server, output_dir=tmp_path)
    score(j, ["a"], ["p"])
    score(j, ["b"], ["p"])
    assert j.metrics()["judge/requests"] == 1.0
    assert len(judge(server, output_dir=tmp_path).cache.entries) == 2


def test_cache_false_asks_every_time(server, tmp_path):
    j = judge(server, output_dir=tmp_path, cache=False)
    score(j, ["a"], ["p"])
    score(j, ["a"], ["p"])
    assert len(server.requests) == 2 and not (tmp_path / CACHE_FILE).exists()


# ------------------------------------------------------------------------------------------ metrics


def test_tokens_and_cost_come_from_the_endpoints_usage_and_the_prices(server):
    j = judge(server, price_in_per_1k=0.5, price_out_per_1k=2.0)
    score(j, ["a", "b"], ["p", "q"])
    m = j.metrics()
    assert m["judge/tokens_in"] == 2.0 * USAGE["prompt_tokens"]
    assert m["judge/tokens_out"] == 2.0 * USAGE["completion_tokens"]
    assert m["judge/cost"] == pytest.approx((200 * 0.5 + 40 * 2.0) / 1000)


def test_no_cost_metric_without_a_price(server):
    j = judge(server)
    score(j, ["a"], ["p"])
    assert "judge/cost" not in j.metrics()


def test_every_judge_metric_is_documented(server):
    j = judge(server, price_in_per_1k=1.0)
    score(j, ["a"], ["p"])
    assert sorted(j.metrics()) == sorted(n for n in j.metrics() if n.startswith("judge/"))
    for name in j.metrics():
        assert describe(name)


def test_ballast_metrics_lists_the_judge_metrics():
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "metrics"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    listed = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert {
        "judge/latency_mean",
        "judge/latency_max",
        "judge/tokens_in",
        "judge/tokens_out",
        "judge/cost",
        "judge/retries",
        "judge/failures",
        "judge/groups_zeroed",
        "judge/cache_hits",
    } <= listed


def test_reward_computer_passes_the_group_size_and_collects_the_judges_metrics(server, tmp_path):
    rc = RewardComputer(
        [RewardConfig(name="judge", kwargs={"base_url": server.url, "model": "m"}), RewardConfig(name="exact_answer")],
        group_size=2,
        output_dir=tmp_path,
    )
    total, parts = rc(
        ["<output>2</output>", "2", "<output>5</output>", "55"], ["2", "2", "4", "4"], ["1+1", "1+1", "2+2", "2+2"]
    )
    assert parts["judge"] == [1.0, 0.1, 1.0, 0.2] and parts["exact_answer"] == [1.0, 0.0, 0.0, 0.0]
    assert total == [2.0, 0.1, 1.0, 0.2]
    assert len(server.requests) == 2 and rc.step_metrics["judge/groups"] == 2.0
    assert (tmp_path / CACHE_FILE).is_file()


def test_a_resumed_training_run_takes_its_repeated_step_from_the_cache(server, tiny_model, tmp_path):
    """Killed after step 2 was judged but before its checkpoint: the resumed run samples step 2 again, exactly,
    and the judge answers it from the run directory's cache without a request."""
    import shutil

    from tests.conftest import tiny_spec
    from trainer.config import TrainerConfig
    from trainer.loop import GRPOTrainer

    spec = tiny_spec(
        tiny_model,
        rewards=[{"name": "exact_answer"}, {"name": "judge", "kwargs": {"base_url": server.url, "model": "m"}}],
        optim={"steps": 2},
        checkpoint={"every": 1, "keep_last": 5},
    )
    cfg = TrainerConfig.model_validate(spec)
    first = GRPOTrainer(cfg, tmp_path, progress=False)
    history = first.train(2).history
    first.close()
    assert [m["judge/requests"] for m in history] == [2.0, 2.0] and len(server.requests) == 4
    shutil.rmtree(tmp_path / "checkpoints" / "step-000002")

    resumed = GRPOTrainer(cfg, tmp_path, progress=False)
    assert resumed.resume().name == "step-000001"
    (step2,) = resumed.train(2).history
    resumed.close()
    assert (step2["judge/cache_hits"], step2["judge/requests"]) == (2.0, 0.0) and len(server.requests) == 4
    assert step2["rewards/judge/mean"] == history[1]["rewards/judge/mean"]


# ------------------------------------------------------------------------------------------ validation


def resolve_error(**kwargs) -> str:
    with pytest.raises(ValueError) as e:
        RewardComputer([RewardConfig(name="judge", kwargs=kwargs)])
    assert "\n" not in str(e.value)
    return str(e.value)


def test_kwargs_are_checked_when_the_rewards_are_resolved():
    assert resolve_error(base_url="http://127.0.0.1:1/v1") == (
        "rewards[0].kwargs: judge: kwarg 'model' is required (e.g. base_url: http://127.0.0.1:8000/v1, model: NAME)"
    )
    assert "kwarg 'on_failure': Input should be 'fail' or 'zero'" in resolve_error(
        base_url="http://x/v1", model="m", on_failure="skip"
    )
    assert "kwarg 'base_url': must start with http:// or https://" in resolve_error(
        base_url="localhost:8000", model="m"
    )
    assert "unknown kwarg 'timeout'" in resolve_error(base_url="http://x/v1", model="m", timeout=3)


def test_a_key_given_as_a_kwarg_is_refused_and_not_echoed():
    message = resolve_error(base_url="http://x/v1", model="m", api_key="sk-live-abcdef123456")
    assert "kwarg 'api_key' would put a secret in the spec" in message and "sk-live" not in message


def test_a_key_given_as_api_key_env_is_refused_and_not_echoed():
    for value in ("sk-live-abcdef123456", "abcdefghij0123456789abcdef"):
        message = resolve_error(base_url="http://x/v1", model="m", api_key_env=value)
        assert "must be the NAME of the environment variable" in message and value not in message


def test_an_unset_key_variable_is_refused_before_any_request(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert f"the environment variable {KEY_ENV} is not set" in resolve_error(
        base_url="http://x/v1", model="m", api_key_env=KEY_ENV
    )


def test_the_spec_refuses_a_key_in_reward_kwargs_without_echoing_it():
    from tasks.spec import SpecError, load_spec

    base = {"model": {"name_or_path": "any-model"}}
    for kwargs, expected in (
        ({"api_key": "sk-live-abcdef123456"}, "rewards.0.kwargs.api_key' looks like a secret"),
        ({"api_key_env": "sk-live-abcdef123456"}, "rewards.0.kwargs.api_key_env' must name an environment variable"),
    ):
        with pytest.raises(SpecError) as e:
            load_spec(
                {**base, "rewards": [{"name": "judge", "kwargs": {"base_url": "http://x/v1", "model": "m", **kwargs}}]}
            )
        assert expected in str(e.value) and "sk-live" not in str(e.value)


# ------------------------------------------------------------------------------------------ a real server: vLLM

EXAMPLE = REPO / "examples" / "quickstart-judge.yaml"
STARTUP_TIMEOUT_S = VLLM_STARTUP_TIMEOUT_S


def example_judge_kwargs() -> dict:
    """The judge kwargs of examples/quickstart-judge.yaml: what the tiny model can read in its 256 tokens."""
    import yaml

    (entry,) = [r for r in yaml.safe_load(EXAMPLE.read_text())["rewards"] if r["name"] == "judge"]
    return dict(entry["kwargs"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_judge(vllm_python, tiny_model, tmp_path_factory):
    """vLLM (its own venv) serving the tiny model as the example's header starts it — an OpenAI-compatible judge
    named as the example names it, that requires an API key: yields (base_url, served model name, key)."""
    python = vllm_python
    key, port, model = f"sk-ballast-test-{uuid.uuid4().hex}", free_port(), example_judge_kwargs()["model"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_API_KEY=key, CUDA_VISIBLE_DEVICES="", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    log = tmp_path_factory.mktemp("judge-vllm") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                str(python),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(tiny_model),
                "--served-model-name",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                "float32",
                "--structured-outputs-config",  # compact JSON: a tiny judge's free whitespace ran out its max_tokens
                '{"backend": "xgrammar", "disable_any_whitespace": true}',
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the vLLM judge server did not come up: {log.read_text()[-3000:]}", pytrace=False)
            time.sleep(2)
        yield f"http://127.0.0.1:{port}/v1", model, key
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


QUICKSTART_GROUPS = [
    ("23+58", ["<output>81</output>", "<output>71</output>", "<output>81</output>", "<output>8"]),
    ("7+5", ["<output>12</output>", "<output>13</output>", "12", "<output>12</output>"]),
]


def test_vllm_judges_every_completion_of_each_group_with_guided_json(vllm_judge, monkeypatch):
    url, model, key = vllm_judge
    monkeypatch.setenv(KEY_ENV, key)
    j = JudgeReward(**{**example_judge_kwargs(), "base_url": url, "model": model, "api_key_env": KEY_ENV}, group_size=4)
    prompts = [p for p, texts in QUICKSTART_GROUPS for _ in texts]
    scores = j(completions=[t for _, texts in QUICKSTART_GROUPS for t in texts], answers=["0"] * 8, prompts=prompts)

    assert len(scores) == 8 and all(round(s * 10) == pytest.approx(s * 10) and 0 <= s <= 1 for s in scores)
    m = j.metrics()
    assert (m["judge/groups"], m["judge/requests"], m["judge/failures"], m["judge/groups_zeroed"]) == (2, 2, 0, 0)
    assert 150 < m["judge/tokens_in"] / 2 < 256 and m["judge/tokens_out"] > 0  # the server's own usage count
    assert m["judge/cost"] == pytest.approx((m["judge/tokens_in"] * 0.00015 + m["judge/tokens_out"] * 0.0006) / 1000)


def test_vllm_refuses_a_wrong_key_and_the_step_fails_naming_the_variable(vllm_judge, monkeypatch):
    url, model, key = vllm_judge
    monkeypatch.setenv(KEY_ENV, "sk-not-the-key-0000")
    j = JudgeReward(**{**example_judge_kwargs(), "base_url": url, "model": model, "api_key_env": KEY_ENV})
    with pytest.raises(JudgeError, match=rf"HTTP 401.*check that \${KEY_ENV} holds a valid key") as e:
        j(completions=["<output>81</output>"], answers=["81"], prompts=["23+58"])
    assert "sk-not-the-key" not in str(e.value) and key not in str(e.value)


def test_quickstart_judge_runs_end_to_end_with_judge_metrics_in_mlflow_and_the_key_nowhere(
    vllm_judge, tiny_model, tmp_path
):
    """examples/quickstart-judge.yaml through `ballast run`, its judge pointed at the test's vLLM server."""
    import yaml
    from mlflow.tracking import MlflowClient

    url, _, key = vllm_judge
    spec = yaml.safe_load(EXAMPLE.read_text())
    (entry,) = [r for r in spec["rewards"] if r["name"] == "judge"]
    entry["kwargs"]["base_url"] = url  # the test's port; everything else as the example has it
    path = tmp_path / "quickstart-judge.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    project = tmp_path / "project"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env[entry["kwargs"]["api_key_env"]] = key
    # the probe's verdict on a 2-step run is not what this test is about (the judge's scores steer training a little
    # differently from run to run): probe.max_malformed_rate=1 keeps it from failing the run
    sets = [
        f"model.name_or_path={tiny_model}",
        f"project_dir={project}",
        "optim.steps=2",
        "data.num_eval_prompts=4",
        "probe.max_malformed_rate=1.0",
    ]
    args = [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(path), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("ballast").experiment_id])
    (run,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    history = {
        name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        for name in (
            "judge/groups",
            "judge/requests",
            "judge/failures",
            "judge/groups_zeroed",
            "judge/tokens_in",
            "judge/tokens_out",
            "judge/cost",
            "judge/latency_mean",
        )
    }
    assert [step for step, _ in history["judge/groups"]] == [1, 2]
    assert [v for _, v in history["judge/groups"]] == [spec["grpo"]["prompts_per_step"]] * 2
    assert [v for _, v in history["judge/requests"]] == [spec["grpo"]["prompts_per_step"]] * 2
    assert [v for _, v in history["judge/failures"] + history["judge/groups_zeroed"]] == [0, 0, 0, 0]
    assert all(
        v > 0
        for name in ("judge/tokens_in", "judge/tokens_out", "judge/cost", "judge/latency_mean")
        for _, v in history[name]
    )
    cache = project / "runs" / run.info.run_id / CACHE_FILE
    assert len(cache.read_text().splitlines()) >= 2 * spec["grpo"]["prompts_per_step"]

    secret = key.encode()
    assert key not in proc.stdout + proc.stderr
    leaks = [p for p in project.rglob("*") if p.is_file() and secret in p.read_bytes()]
    assert leaks == [], f"the judge's key was written to {leaks}"
