"""eval/mean_length counts the token ids the model generated — never the decoded text re-encoded, where an invalid
byte comes back as U+FFFD (three bytes, three tokens of a byte-level tokenizer) — so it can never exceed
eval.max_tokens. The tiny model sampled at a very high temperature emits near-uniform bytes, many of them invalid
UTF-8, which is what made the old count overshoot."""

from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.config import EvalConfig, RewardConfig
from trainer.data import Example
from trainer.evaluate import _generated_length, evaluate, generate
from trainer.rewards import RewardComputer

MAX_TOKENS = 6


def test_a_generated_length_stops_at_the_first_end_of_sequence_token_inclusive():
    assert _generated_length([5, 6, 2, 0, 0], stop={2}) == 3
    assert _generated_length([5, 6, 7, 8], stop={2}) == 4  # ran to max_tokens
    assert _generated_length([2, 2, 2], stop={2}) == 1


def test_eval_mean_length_never_exceeds_max_tokens_even_for_invalid_bytes(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    examples = [Example(prompt=f"{a}+{a + 3}", answer=str(2 * a + 3)) for a in range(12)]
    cfg = EvalConfig(max_tokens=MAX_TOKENS, temperature=50.0, batch_size=12)
    texts, lengths, _ = generate(model, tok, [e.prompt for e in examples], MAX_TOKENS, cfg.temperature, cfg.batch_size)
    re_encoded = [len(tok.encode(t, add_special_tokens=False)) for t in texts]
    assert max(re_encoded) > MAX_TOKENS  # the case the old count got wrong is really there
    metrics = evaluate(model, tok, examples, cfg, RewardComputer([RewardConfig(name="exact_answer")]))
    assert metrics["eval/mean_length"] <= MAX_TOKENS
    assert metrics["eval/mean_length"] == sum(lengths) / len(lengths)
