"""Stacked LoRA with a per-row slot (trainer/engines/stacked.py): several adapters in one forward, as tensor code.

On the tiny model with three adapters of different ranks, alphas and targets, in fp32 on CPU: the stacked forward
equals peft's per-row forward (`adapter_names`) within 1e-5 whatever the rows' order, or within what this CPU's fp32
rounding allows where that is more (`logits_bound`); a refresh after an optimizer
step brings the stacked weights up to date in place (the tensors do not move, so a CUDA graph over them stays
valid); the HF engine's stacked path samples what peft's per-row path samples; and through the compiled decode with
the draw inside the step (fused_sampling), trials decoded together equal each trial decoded alone.
"""

import copy

import pytest
import torch

from tests.conftest import perturb_lora
from trainer.config import LoraConfig, ModelConfig
from trainer.data import render_prompt
from trainer.engines.base import SamplingParams
from trainer.engines.hf import HFEngine
from trainer.engines.stacked import StackedLora, stacked_for
from trainer.multi import SharedPolicy

LOGITS = 1e-5  # stacked vs peft per-row forward, fp32: the same products summed in another order (the figure)


def logprob_bound(temperature: float, logits: float) -> float:
    """What a bound on the logits allows a sampled token's logprob, log_softmax(logits / T)[token]: its logit and the
    logsumexp each move by at most logits / T."""
    return 2 * logits / temperature


ADAPTERS = {  # name: (rank, alpha, targets)
    "x": (2, 4, "all-linear"),
    "y": (8, 8, "all-linear"),
    "z": (4, 16, ["q_proj", "v_proj"]),  # adapts fewer layers: its slot is zeros in the others
}


@pytest.fixture(scope="module")
def shared(tiny_model):
    shared = SharedPolicy(ModelConfig(name_or_path=str(tiny_model), device="cpu"))
    for name, (rank, alpha, targets) in ADAPTERS.items():
        model, tokenizer = shared.add(name, LoraConfig(r=rank, alpha=alpha, target_modules=targets))
    perturb_lora(model, seed=5, scale=0.3)
    model.eval()
    return shared


@pytest.fixture(scope="module")
def logits_bound(shared) -> float:
    """How far the stacked forward may be from peft's per-row forward on this CPU: 1e-5, or twice peft's own fp32
    rounding error (its largest distance from the same forward in fp64) where that is more. Both are fp32 evaluations
    of one function that differ only in the order of sums, so each lands within about that error of the exact
    value, and the two within twice it. The error is the CPU's: ~4-6e-6 here on AVX-512, AVX2 and plain kernels
    (the stacked forward's own from 0.8x to 1.6x it over 54 seeds and row orders); on CI's CPU the two forwards
    differed by 1.0014e-5, which a flat 1e-5 refused."""
    names = ["x", "y", "z", "x", "y", "z"]
    ids, mask = batch(shared.tokenizer, 6)
    exact = copy.deepcopy(shared.model).double()
    with torch.no_grad():
        want = exact(input_ids=ids, attention_mask=mask, adapter_names=names).logits
        peft = shared.model(input_ids=ids, attention_mask=mask, adapter_names=names).logits
    rounding = (peft.double() - want).abs().max().item()
    assert 0 < rounding < 1e-4  # fp32 rounding of logits of ~10, not a different computation
    return max(LOGITS, 2 * rounding)


def batch(tokenizer, n: int):
    prompts = [render_prompt(tokenizer, q) for q in ("12+34", "7+58", "40+41", "3+3", "99+1", "5+60")][:n]
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    return ids, (ids != tokenizer.pad_token_id).long()


def stacked_logits(model, stack: StackedLora, names, ids, mask):
    with torch.no_grad(), stack.use(stack.row_slots(names, ids.device)):
        return model(input_ids=ids, attention_mask=mask).logits


def test_the_stacked_forward_equals_peft_per_row_forward_in_any_row_order(shared, logits_bound):
    model = shared.model
    ids, mask = batch(shared.tokenizer, 6)
    stack = stacked_for(None, model, list(ADAPTERS))
    assert stack.rank == 8 and stack.slots == 3
    for names in (["x", "y", "z", "x", "y", "z"], ["z", "z", "y", "x", "x", "y"], ["y"] * 6):
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask, adapter_names=names).logits
        got = stacked_logits(model, stack, names, ids, mask)
        assert (got - want).abs().max() <= logits_bound, names
    with torch.no_grad():  # the adapters matter: the stacked rows are not the base model's
        base = model(input_ids=ids, attention_mask=mask, adapter_names=["__base__"] * 6).logits
    assert (stacked_logits(model, stack, ["y"] * 6, ids, mask) - base).abs().max() > 1e-2


def test_a_refresh_after_an_optimizer_step_brings_the_stack_up_to_date_in_place(shared, logits_bound):
    model = shared.model
    ids, mask = batch(shared.tokenizer, 4)
    names = ["x", "y", "x", "y"]
    stack = stacked_for(None, model, ["x", "y"])
    addresses = [(s.a.data_ptr(), s.b.data_ptr(), s.scale.data_ptr()) for s in stack.stacks]
    model.set_adapter("y")  # one trial's update, as trainer/multi.py makes it
    model.train()
    params = [p for n, p in model.named_parameters() if ".y." in n or n.endswith(".y.weight")]
    assert params and all(p.requires_grad for p in params)
    optimizer = torch.optim.SGD(params, lr=0.05)
    model(input_ids=ids, attention_mask=mask).logits.pow(2).mean().backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, adapter_names=names).logits
    stale = stacked_logits(model, stack, names, ids, mask)
    assert (stale - want).abs().max() > 1e-4  # the step moved y; the stack still holds the old weights
    assert stacked_for(stack, model, ["x", "y"]) is stack  # the same stack, refreshed
    assert [(s.a.data_ptr(), s.b.data_ptr(), s.scale.data_ptr()) for s in stack.stacks] == addresses
    fresh = (stacked_logits(model, stack, names, ids, mask) - want).abs().max()
    assert fresh <= logits_bound


def test_a_new_adapter_takes_a_free_slot_and_the_others_keep_theirs(shared):
    model = shared.model
    stack = stacked_for(None, model, ["x", "y"], slots=3)
    assert stack.names == ["x", "y", None]
    assert stacked_for(stack, model, ["z", "y"]) is stack  # x left, z came: no new shapes
    assert stack.names == ["z", "y", None]
    assert stacked_for(stack, model, ["x", "y", "z"]) is stack and stack.names == ["z", "y", "x"]


def test_the_engines_stacked_path_samples_what_peft_per_row_path_samples(shared, logits_bound):
    prompts = [render_prompt(shared.tokenizer, q) for q in ("12+34", "7+58", "40+41")]
    x = SamplingParams(n=2, max_tokens=12, seeds=[11, 12, 13])
    z = SamplingParams(n=3, max_tokens=12, temperature=0.7, repetition_penalty=1.3, seeds=[21, 22])
    requests = [(prompts, x, ["x", "y", "x"]), (prompts[1:], z, ["z", "z"])]  # rows of one request differ too
    peft_rows = HFEngine(shared.model, shared.tokenizer, "cpu").generate_many(requests)
    stacked = HFEngine(shared.model, shared.tokenizer, "cpu", stacked_lora=True)
    got = stacked.generate_many(requests)
    assert stacked.stacked is not None and set(stacked.stacked.names) == {"x", "y", "z"}
    assert tokens(got) == tokens(peft_rows)
    assert max_logprob_difference(got, peft_rows) <= logprob_bound(min(x.temperature, z.temperature), logits_bound)


def test_trials_decoded_together_in_the_compiled_stacked_step_equal_each_alone(shared, logits_bound):
    """The fused, compiled decode (one graph per token, the draw inside it) with each row under its own adapter: the
    tokens of each trial's rows are those it samples alone under its adapter (peft's ordinary forward, the same
    compiled step), logprobs within what `logits_bound` on the logits allows. Two compiles (~2 min on 2 cores)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, tokenizer = shared.model, shared.tokenizer
    engine = HFEngine(model, tokenizer, "cpu", compile_decode="always", fused_sampling=True, stacked_lora=True)
    prompts = [render_prompt(tokenizer, q) for q in ("12+34", "7+58")]
    px = SamplingParams(n=2, max_tokens=10, seeds=[1, 2])
    py = SamplingParams(n=2, max_tokens=10, temperature=0.8, seeds=[3, 4])
    together = engine.generate_many([(prompts, px, ["x", "x"]), (prompts, py, ["y", "y"])])
    assert not counters["graph_break"]  # the stacked forward is inside the one compiled graph of the step
    alone = []
    for name, params in (("x", px), ("y", py)):
        model.set_adapter(name)
        alone.append(engine.generate(prompts, params))
    assert tokens(together) == tokens(alone)
    assert max_logprob_difference(together, alone) <= logprob_bound(min(px.temperature, py.temperature), logits_bound)
    assert len({tuple(t) for request in tokens(together) for group in request for t in group}) > 2


def tokens(requests):
    return [[[c.token_ids for c in group] for group in request] for request in requests]


def max_logprob_difference(a, b) -> float:
    flat = lambda rs: [c for r in rs for g in r for c in g]  # noqa: E731
    return max(max(abs(p - q) for p, q in zip(c.logprobs, d.logprobs)) for c, d in zip(flat(a), flat(b)))
