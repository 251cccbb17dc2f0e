"""Reward registry and built-ins: the spec's `rewards:` list becomes one callable that scores a batch.

A reward function is called with keyword arguments and returns one float per completion:

    fn(completions=[...], answers=[...], prompts=[...], **kwargs) -> list[float]

where `kwargs` are the spec's `rewards[i].kwargs`. Completions of the same prompt are contiguous
groups of G (grpo.num_generations), so a judge-style reward can score a group relative to itself.
Arguments are passed by name, so a TRL-style `fn(prompts, completions, **kwargs)` also works (it
finds the answers in kwargs['answers']).

Built-ins (`REGISTRY`):

    exact_answer        1.0 if the content of the first <tag>...</tag> (kwarg `tag`, default 'output'),
                        stripped, equals the stripped answer; else 0.0 (also when there is no tag pair).
    regex_answer        kwarg `pattern`, a regex with one group: 1.0 if the first match's group(1),
                        stripped, equals the stripped answer; else 0.0.
    format              kwarg `tag` (default 'output'): 1.0 for exactly one <tag>...</tag> pair with
                        non-empty content and nothing but whitespace outside it; 0.5 when such a pair
                        is there but other text (or another pair) is outside it; 0.0 otherwise,
                        including an empty pair.
    length_penalty      kwarg `target_chars` (> 0): -max(0, len - target) / target, clipped at -1.
    repetition_penalty  kwargs `n` (default 3) and `unit` ('words', default, or 'chars'):
                        -ngram_repetition(...) of health.py, in [-1, 0].

`resolve(cfg)` turns one RewardConfig into a callable with its kwargs bound — a built-in by name or
a user function by 'module:function' — and checks the kwargs fit the function's signature before any
rollout. `RewardComputer(cfgs)` scores a batch: the weighted sum of all components, plus each
component's raw (unweighted) values under its name: the built-in's name, the function's name for
'module:function', with '_<index in rewards>' appended to every name that occurs more than once.
A function that returns the wrong count, a non-number, NaN or inf fails the step with an error
naming the function and the completion.
"""
from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import math
import numbers
import re
from typing import Callable, Optional

from .config import RewardConfig
from .health import ngram_repetition, tag_pattern, tagged_content

RewardFn = Callable[..., list]

REGISTRY: dict[str, RewardFn] = {}


def register(name: str):
    """Decorator: make `fn` available as the built-in reward `name`."""
    def deco(fn):
        if name in REGISTRY:
            raise ValueError(f"reward {name!r} is already registered; pick another name")
        REGISTRY[name] = fn
        return fn
    return deco


# ---------------------------------------------------------------------------------------------
# Built-ins. Each checks its kwargs first, so resolve() can validate them with empty lists.

@register("exact_answer")
def exact_answer(completions, answers, prompts, *, tag: str = "output") -> list[float]:
    tag_pattern(tag)
    out = []
    for text, answer in zip(completions, answers):
        content = tagged_content(text, tag)
        out.append(1.0 if content is not None and content.strip() == answer.strip() else 0.0)
    return out


@register("regex_answer")
def regex_answer(completions, answers, prompts, *, pattern: str) -> list[float]:
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"regex_answer: pattern={pattern!r} is not a regular expression ({e})") from None
    if rx.groups < 1:
        raise ValueError(f"regex_answer: pattern={pattern!r} has no group; put the answer in one, e.g. r'answer: (\\S+)'")
    out = []
    for text, answer in zip(completions, answers):
        m = rx.search(text)
        got = m.group(1) if m else None
        out.append(1.0 if got is not None and got.strip() == answer.strip() else 0.0)
    return out


@register("format")
def format_reward(completions, answers, prompts, *, tag: str = "output") -> list[float]:
    rx = tag_pattern(tag)
    out = []
    for text in completions:
        m = rx.search(text)
        if m is None or not m.group(1).strip():
            out.append(0.0)
        elif (text[:m.start()] + text[m.end():]).strip():
            out.append(0.5)
        else:
            out.append(1.0)
    return out


@register("length_penalty")
def length_penalty(completions, answers, prompts, *, target_chars: int) -> list[float]:
    if not isinstance(target_chars, numbers.Real) or target_chars <= 0:
        raise ValueError(f"length_penalty: target_chars={target_chars!r} must be a number > 0")
    return [max(-1.0, -max(0, len(text) - target_chars) / target_chars) for text in completions]


@register("repetition_penalty")
def repetition_penalty(completions, answers, prompts, *, n: int = 3, unit: str = "words") -> list[float]:
    if unit not in ("words", "chars"):
        raise ValueError(f"repetition_penalty: unit={unit!r} must be 'words' or 'chars'")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"repetition_penalty: n={n!r} must be an integer >= 1")
    return [-ngram_repetition(text.split() if unit == "words" else text, n) for text in completions]


# ---------------------------------------------------------------------------------------------
# Resolving a spec entry

def _load_user_function(spec: str, where: str) -> Callable:
    module_name, _, attr_path = spec.partition(":")
    hint = f"give a built-in ({', '.join(REGISTRY)}) or an importable module:function"
    if not module_name or not attr_path:
        raise ValueError(f"{where}.name={spec!r}: expected 'module:function'; {hint}")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"{where}.name={spec!r}: module {module_name!r} not found; {hint}") from None
        raise ValueError(f"{where}.name={spec!r}: importing module {module_name!r} failed: {e}; "
                         "install what it imports") from e
    except Exception as e:
        raise ValueError(f"{where}.name={spec!r}: importing module {module_name!r} raised "
                         f"{type(e).__name__}: {e}; fix the module") from e
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{where}.name={spec!r}: module {module_name!r} has no attribute {attr_path!r}; {hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{where}.name={spec!r}: {attr_path!r} is a {type(obj).__name__}, not a function; {hint}")
    return obj


def resolve(cfg: RewardConfig, index: Optional[int] = None) -> Callable[..., list]:
    """The reward function `cfg.name` names, with `cfg.kwargs` bound; call it as
    fn(completions=..., answers=..., prompts=...). `index` (the position in the spec's rewards list)
    only makes error messages point at the right entry."""
    where = f"rewards[{index}]" if index is not None else "reward"
    name = cfg.name
    if name in REGISTRY:
        fn = REGISTRY[name]
    elif ":" in name:
        fn = _load_user_function(name, where)
    else:
        close = difflib.get_close_matches(name, REGISTRY, n=1)
        maybe = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"{where}.name={name!r} is not a built-in reward; {maybe}give a built-in "
                         f"({', '.join(REGISTRY)}) or an importable module:function")
    kwargs = dict(cfg.kwargs)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have none; they fail at the first call instead
        signature = None
    if signature is not None:
        try:
            signature.bind(completions=[], answers=[], prompts=[], **kwargs)
        except TypeError as e:
            raise ValueError(f"{where}: {name!r} cannot be called with kwargs={kwargs!r} ({e}); it takes "
                             f"{signature}: give {where}.kwargs only its keyword parameters, and name its "
                             "data parameters completions, answers, prompts (they are passed by name)") from None
    if name in REGISTRY:
        try:
            fn(completions=[], answers=[], prompts=[], **kwargs)  # built-ins validate their kwargs first
        except ValueError as e:
            raise ValueError(f"{where}.kwargs: {e}") from None
    return functools.partial(fn, **kwargs)


def component_names(cfgs: list[RewardConfig]) -> list[str]:
    """Metric names of the components: built-in name or function name, '_<index>' on duplicates."""
    bases = [c.name if c.name in REGISTRY else c.name.rpartition(":")[2].rpartition(".")[2] for c in cfgs]
    return [f"{b}_{i}" if bases.count(b) > 1 else b for i, b in enumerate(bases)]


# ---------------------------------------------------------------------------------------------
# Scoring a batch

class RewardComputer:
    """All the spec's rewards: `rc(completions, answers, prompts)` -> (weighted total per completion,
    {component name: raw values})."""

    def __init__(self, cfgs: list[RewardConfig]):
        if not cfgs:
            raise ValueError("rewards is empty; give at least one, e.g. rewards: [{name: exact_answer}]")
        self.names = component_names(cfgs)
        self.weights = [float(c.weight) for c in cfgs]
        self.fns = [resolve(c, i) for i, c in enumerate(cfgs)]

    def __call__(self, completions: list[str], answers: list[str],
                 prompts: list[str]) -> tuple[list[float], dict[str, list[float]]]:
        if not len(completions) == len(answers) == len(prompts):
            raise ValueError(f"rewards need one answer and one prompt per completion; got {len(completions)} "
                             f"completions, {len(answers)} answers, {len(prompts)} prompts")
        total = [0.0] * len(completions)
        per_component: dict[str, list[float]] = {}
        for name, weight, fn in zip(self.names, self.weights, self.fns):
            values = _checked(name, fn(completions=list(completions), answers=list(answers), prompts=list(prompts)),
                              len(completions))
            per_component[name] = values
            total = [t + weight * v for t, v in zip(total, values)]
        return total, per_component


def _checked(name: str, values, count: int) -> list[float]:
    try:
        got = len(values)
    except TypeError:
        raise ValueError(f"reward {name!r} returned a {type(values).__name__}, not a list; "
                         f"reward functions must return one float per completion ({count})") from None
    if got != count:
        raise ValueError(f"reward {name!r} returned {got} values for {count} completions; "
                         "reward functions must return one float per completion")
    out = []
    for i, v in enumerate(values):
        if not isinstance(v, numbers.Real):
            raise ValueError(f"reward {name!r} returned {v!r} ({type(v).__name__}) for completion {i}; reward "
                             "functions must return finite floats (0.0 for a completion they cannot score)")
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(f"reward {name!r} returned {v} for completion {i}; reward functions must return finite floats")
        out.append(v)
    return out
