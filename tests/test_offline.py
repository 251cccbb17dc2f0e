"""Trajectories generated elsewhere (rollout.engine: offline): logprobs are read from every shape tools
write — never silently as NaN, the bug that turned importance sampling into REINFORCE — and a GRPO run
on a trajectory file uses them as its old policy."""

import json
import math
from pathlib import Path

import pytest

from tests.conftest import tiny_spec
from trainer.config import TrainerConfig
from trainer.engines.offline import TrajectoryError, read_logprobs
from trainer.loop import GRPOTrainer, TrainingError

# ── the shapes ──────────────────────────────────────────────────────────────────────────────────────

LPS = [-0.25, -1.5, -0.0]


@pytest.mark.parametrize(
    "shape, value, ids",
    [
        ("floats", LPS, None),
        ("openai chat content", [{"token": "4", "logprob": x, "bytes": [52], "top_logprobs": []} for x in LPS], None),
        ("openai chat logprobs", {"content": [{"token": "4", "logprob": x} for x in LPS], "refusal": None}, None),
        ("openai completions", {"tokens": ["a", "b", "c"], "token_logprobs": LPS, "top_logprobs": None}, None),
        ("vllm, one candidate each", [{"52": {"logprob": x, "rank": 1, "decoded_token": "4"}} for x in LPS], None),
        (
            "vllm, several candidates",
            [{"52": {"logprob": x, "rank": 1}, "53": {"logprob": -9.0, "rank": 2}} for x in LPS],
            [52, 52, 52],
        ),
        ("vllm, int keys and bare floats", [{52: x, 7: -9.0} for x in LPS], [52, 52, 52]),
    ],
)
def test_every_supported_shape_reads_the_same_floats(shape, value, ids):
    assert read_logprobs(value, ids) == LPS


@pytest.mark.parametrize(
    "value, message",
    [
        ([{"token": "4"}, {"token": "5"}], "logprobs[0] is a dict with keys ['token'] and no 'logprob'"),
        ([-0.1, None], "logprobs[1] is None, not a number; a missing logprob must not become ratio 1 (REINFORCE)"),
        ([-0.1, float("nan")], "logprobs[1] is nan: a logprob must be finite and <= 0"),
        ([0.7], "logprobs[0] is 0.7: a logprob must be finite and <= 0"),
        ({"top_logprobs": []}, "logprobs is a dict with keys ['top_logprobs']; expected a list of floats"),
        ("-0.1,-0.2", "logprobs is a str; expected"),
    ],
)
def test_unreadable_logprobs_fail_naming_where_and_why(value, message):
    with pytest.raises(TrajectoryError) as e:
        read_logprobs(value)
    assert message in str(e.value)


def test_vllm_logprobs_of_other_tokens_are_refused():
    with pytest.raises(TrajectoryError, match=r"logprobs\[0\] has no entry for the sampled token 52"):
        read_logprobs([{"53": {"logprob": -0.1}}], [52])


# ── a GRPO run on a trajectory file ─────────────────────────────────────────────────────────────────

G = 4


@pytest.fixture(scope="module")
def trajectories(tiny_model, tmp_path_factory):
    """Completions sampled from the tiny model (as an outside inference service would), written with their
    logprobs in OpenAI's chat shape: a list of per-token dicts."""
    from trainer.config import LoraConfig, ModelConfig
    from trainer.data import arith_examples, render_prompt
    from trainer.engines.base import SamplingParams
    from trainer.engines.hf import HFEngine
    from trainer.model import load_policy

    model, tokenizer = load_policy(ModelConfig(name_or_path=str(tiny_model), device="cpu"), LoraConfig(r=8, alpha=16))
    examples = arith_examples(6, seed=7)
    groups = HFEngine(model, tokenizer, "cpu").generate(
        [render_prompt(tokenizer, e.prompt) for e in examples], SamplingParams(n=G, max_tokens=24, seed=1)
    )
    path = tmp_path_factory.mktemp("traj") / "trajectories.jsonl"
    with open(path, "w") as f:
        for e, group in zip(examples, groups):
            completions = [
                {
                    "token_ids": c.token_ids,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "logprobs": [
                        {"token": tokenizer.decode([t]), "logprob": lp} for t, lp in zip(c.token_ids, c.logprobs)
                    ],
                }
                for c in group
            ]
            f.write(json.dumps({"prompt": e.prompt, "answer": e.answer, "completions": completions}) + "\n")
    return path


def rewrite(src, dst, change):
    rows = [json.loads(line) for line in src.read_text().splitlines()]
    for row in rows:
        change(row)
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dst


def offline_trainer(tiny_model, path, out, **grpo):
    spec = tiny_spec(
        tiny_model,
        data={"source": str(path)},
        rollout={"engine": "offline", "max_tokens": 24},
        grpo={"num_generations": G, "prompts_per_step": 2, "beta": 0.04, **grpo},
        optim={"steps": 2, "learning_rate": 1e-3},
        checkpoint={"every": 100},
    )
    return GRPOTrainer(TrainerConfig.model_validate(spec), out, progress=False)


def test_a_run_on_trajectories_uses_their_logprobs_as_the_old_policy(tiny_model, trajectories, tmp_path):
    t = offline_trainer(tiny_model, trajectories, tmp_path)
    result = t.train(2)
    first = result.history[0]
    assert first["sampling/frac_logprobs_valid"] == 1.0
    # sampled from the same weights the run starts from: read right, they equal the trainer's own logprobs
    assert first["sampling/sampling_logp_difference/max"] < 1e-4
    assert math.isfinite(first["loss"]) and result.last_step == 2


def test_logprobs_that_belong_to_another_policy_show_in_the_ratio(tiny_model, trajectories, tmp_path):
    def older_policy(row):
        for c in row["completions"]:
            for entry in c["logprobs"]:
                entry["logprob"] -= 0.3

    path = rewrite(trajectories, tmp_path / "shifted.jsonl", older_policy)
    m = offline_trainer(tiny_model, path, tmp_path / "run").train(1).history[0]
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(0.3, abs=1e-4)
    # pi_old is the trainer's, so the clipped ratio starts at 1; the difference is the correction weight
    assert m["policy_ratio/mean"] == 1.0
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(math.exp(0.3), rel=1e-3)


def test_a_policy_beyond_the_bounds_is_truncated_by_tis_and_left_out_by_mis(tiny_model, trajectories, tmp_path):
    """Logprobs 1 nat below the run's policy on every token: pi_old / pi_engine = e = 2.72, above the bound 2.
    TIS caps every weight at 2; MIS leaves every token out of the loss, so the step's loss and gradient are 0."""

    def far_older_policy(row):
        for c in row["completions"]:
            for entry in c["logprobs"]:
                entry["logprob"] -= 1.0

    path = rewrite(trajectories, tmp_path / "far.jsonl", far_older_policy)
    tis = offline_trainer(tiny_model, path, tmp_path / "tis").train(1).history[0]
    assert tis["sampling/truncated_fraction"] == 1.0 and tis["sampling/masked_fraction"] == 0.0
    assert tis["sampling/importance_sampling_ratio/min"] == tis["sampling/importance_sampling_ratio/max"] == 2.0
    assert tis["grad_norm"] > 0
    mis = offline_trainer(tiny_model, path, tmp_path / "mis", rollout_correction={"mode": "mis"}).train(1).history[0]
    assert mis["sampling/masked_fraction"] == 1.0 and mis["sampling/importance_sampling_ratio/max"] == 0.0
    assert mis["loss"] == 0.0 and mis["grad_norm"] == 0.0


def test_trajectories_without_logprobs_fail_loudly_or_train_uncorrected(tiny_model, trajectories, tmp_path):
    def strip(row):
        for c in row["completions"]:
            del c["logprobs"]

    path = rewrite(trajectories, tmp_path / "bare.jsonl", strip)
    with pytest.raises(TrainingError, match="'offline' rollout engine returned no logprobs.*correction.mode: off"):
        offline_trainer(tiny_model, path, tmp_path / "a").train(1)
    m = offline_trainer(tiny_model, path, tmp_path / "b", rollout_correction={"mode": "off"}).train(1).history[0]
    assert m["sampling/frac_logprobs_valid"] == 0.0 and math.isnan(m["sampling/sampling_logp_difference/max"])


def test_a_plain_dict_without_logprob_is_refused_naming_the_line(tiny_model, trajectories, tmp_path):
    def plain(row):
        for c in row["completions"]:
            c["logprobs"] = [{"token": e["token"]} for e in c["logprobs"]]

    path = rewrite(trajectories, tmp_path / "plain.jsonl", plain)
    with pytest.raises(
        TrajectoryError,
        match=r"plain.jsonl:1 completions\[0\]\.logprobs\[0\] is a dict with keys \['token'\] and no 'logprob'",
    ):
        offline_trainer(tiny_model, path, tmp_path / "run")


def test_a_group_of_another_size_is_refused_with_the_fix(tiny_model, trajectories, tmp_path):
    with pytest.raises(
        TrajectoryError, match=r"trajectories.jsonl:\d+ has 4 completions but grpo.num_generations is 8"
    ):
        t = offline_trainer(tiny_model, trajectories, tmp_path, num_generations=8)
        t.train(1)


def test_offline_needs_a_trajectory_file_as_data_source():
    from tasks.spec import SpecError, load_spec

    with pytest.raises(SpecError, match="rollout.engine: offline reads its completions from data.source"):
        load_spec({"model": {"name_or_path": "m"}, "rollout": {"engine": "offline"}})


# ── multi-turn episodes: ART trajectories and OpenAI chat logs with tool calls ─────────────────────

EPISODES = Path(__file__).parent / "offline_episodes.jsonl"
# tests/offline_episodes.jsonl was tokenised with conftest.TOOL_TEMPLATE (two prompts, two episodes each: ART
# Choices with logprob tokens as 'token_id:N' and as strings, ART Choices with vLLM's token_ids and prompt_token_ids,
# OpenAI chat logs with a tool call and with a user follow-up).


def episodes_engine(tool_model, path=EPISODES):
    from transformers import AutoTokenizer

    from trainer.data import render_prompt
    from trainer.engines.offline import OfflineEngine

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    return OfflineEngine(path, tokenizer, render_prompt), tokenizer


def turns(tokenizer, *pieces):
    """Token ids and loss mask of alternating (sampled, inserted, sampled, ...) text pieces."""
    ids, mask = [], []
    for k, piece in enumerate(pieces):
        piece_ids = tokenizer.encode(piece, add_special_tokens=False)
        ids += piece_ids
        mask += [1 - k % 2] * len(piece_ids)
    return ids, mask


def test_an_episode_is_its_sampled_turns_with_the_inserted_messages_between_and_only_sampled_tokens_carry_loss(
    tool_model,
):
    engine, tokenizer = episodes_engine(tool_model)
    rows = [json.loads(line) for line in EPISODES.read_text().splitlines()]
    (art, vllm_ids), (chat_log, follow_up) = (group for _, group in engine.groups.values())
    prompt = tokenizer.encode(
        "<s>Tools: add\nYou add numbers with the add tool.\n<|user|>23+58<|assistant|>", add_special_tokens=False
    )
    assert art.prompt_ids == prompt and vllm_ids.prompt_ids == prompt
    call = '<call>add({{"a":{},"b":{}}})</call></s>'.format
    tool = "\n<|user|>[tool] {}<|assistant|>".format
    output = "<output>{}</output></s>".format
    expected = {
        "art": (art, turns(tokenizer, call(23, 58), tool(81), output(81))),
        "vllm": (vllm_ids, turns(tokenizer, call(23, 85), tool(108), output(108))),
        "chat log": (chat_log, turns(tokenizer, call(12, 30), tool(42), output(42))),
        "follow-up": (follow_up, turns(tokenizer, output(41), "\n<|user|>Check again.<|assistant|>", output(43))),
    }
    for name, (c, (ids, mask)) in expected.items():
        assert c.token_ids == ids, name
        assert c.loss_mask == mask, name
        sampled = [lp for lp, m in zip(c.logprobs, mask) if m]
        assert all(math.isnan(lp) for lp, m in zip(c.logprobs, mask) if not m), name
        assert len(sampled) == sum(mask) and all(math.isfinite(lp) for lp in sampled), name
        assert c.finish_reason == "stop"
    # the logprobs are the file's, in order, whatever shape named the tokens
    file_turns = [item for item in rows[0]["completions"][0]["messages_and_choices"] if "message" in item]
    want = [e["logprob"] for turn in file_turns for e in turn["logprobs"]["content"]]
    assert [lp for lp, m in zip(art.logprobs, art.loss_mask) if m] == want
    assert art.text == "<output>81</output>" and follow_up.text == "<output>43</output>"
    assert chat_log.prompt_ids == tokenizer.encode(
        "<s>Tools: add\n<|user|>12+30<|assistant|>", add_special_tokens=False
    )


def test_the_trainer_puts_loss_only_on_sampled_tokens_and_a_step_runs(tool_model, tmp_path):
    from trainer.loop import _padded_batch

    engine, tokenizer = episodes_engine(tool_model)
    completions = [c for _, group in engine.groups.values() for c in group]
    batch = _padded_batch(completions, tokenizer.pad_token_id)
    for row, c in enumerate(completions):  # the loss positions are exactly the sampled ones; padding none
        mask = batch["completion_mask"][row]
        assert mask[: len(c.token_ids)].tolist() == c.loss_mask and mask[len(c.token_ids) :].sum() == 0
        lp = batch["engine_logprobs"][row, : len(c.token_ids)]
        assert lp.isfinite().tolist() == [bool(m) for m in c.loss_mask]
    # a step with the default rollout correction (tis), which fails a step if any loss token lacks a logprob
    t = offline_trainer(tool_model, EPISODES, tmp_path, num_generations=2, prompts_per_step=2)
    first = t.train(1).history[0]
    assert first["sampling/frac_logprobs_valid"] == 1.0
    assert math.isfinite(first["loss"]) and first["grad_norm"] > 0
    assert first["completions/mean_length"] == sum(len(c.token_ids) for c in completions) / len(completions)


def rewrite_episode(tmp_path, change, name="changed.jsonl"):
    """EPISODES with `change` applied to line 1's first episode (ART-shaped)."""
    return rewrite(EPISODES, tmp_path / name, lambda row: change(row["completions"][0]) if row["answer"] == "81" else 0)


def _choices(episode):
    return [item for item in episode["messages_and_choices"] if "message" in item]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda e: [c.pop("logprobs") for c in _choices(e)],
            r"changed.jsonl:1 completions\[0\]\.messages_and_choices\[2\] has neither token_ids nor per-token "
            r"logprobs: the tokens the model sampled are unknown",
        ),
        (
            lambda e: _choices(e)[1]["logprobs"]["content"][3].update(logprob=None),
            r"changed.jsonl:1 completions\[0\]\.messages_and_choices\[4\]\.logprobs\.content\[3\]\.logprob is None, "
            r"not a number",
        ),
        (
            lambda e: [c.update(token_ids=c.pop("logprobs") and [65]) for c in _choices(e)[1:]],
            r"changed.jsonl:1 completions\[0\]\.messages_and_choices\[4\] has no logprobs but "
            r"messages_and_choices\[2\], the model's first turn, has them",
        ),
        (
            lambda e: _choices(e)[1]["logprobs"]["content"][0].update(token="<ou", bytes=None),
            r"messages_and_choices\[4\]\.logprobs\.content\[0\]\.token is '<ou', which no token of the run's "
            r"tokenizer decodes to",
        ),
        (
            lambda e: e["messages_and_choices"].append({"role": "assistant", "content": "done"}),
            r"messages_and_choices\[5\] is an assistant message without logprobs or token_ids after the model's "
            r"first turn: it would get no loss",
        ),
    ],
    ids=["no logprobs or ids", "a None logprob", "mixed", "unknown token string", "unsampled assistant"],
)
def test_an_episode_that_cannot_be_trained_token_exact_is_refused_naming_the_line_and_the_turn(
    tool_model, tmp_path, change, message
):
    with pytest.raises(TrajectoryError, match=message) as e:
        episodes_engine(tool_model, rewrite_episode(tmp_path, change))
    assert "\n" not in str(e.value)


def test_prompt_token_ids_that_do_not_extend_the_episode_are_refused(tool_model, tmp_path):
    def rerendered(row):
        if row["answer"] == "81":
            row["completions"][1]["messages_and_choices"][4]["prompt_token_ids"][3] = 5  # not the prompt turn 1 had

    with pytest.raises(TrajectoryError, match=r"completions\[1\]\.messages_and_choices\[4\]\.prompt_token_ids do not"):
        episodes_engine(tool_model, rewrite(EPISODES, tmp_path / "x.jsonl", rerendered))
