"""Reward registry and built-ins: the spec's `rewards:` list becomes one callable that scores a batch.

A reward function is called with keyword arguments and returns one float per completion:

    fn(completions=[...], answers=[...], prompts=[...], **kwargs) -> list[float]

where `kwargs` are the spec's `rewards[i].kwargs` and the data's other columns (trainer/data.py), one value per
completion, as TRL passes a dataset's columns: a function gets the columns it names as parameters, or every
column when it takes **kwargs (built-ins take none). Answers and prompts likewise: `fn(completions, answers)` is
not given the prompts; `completions` it must take. A prompt is a string or, for chat rows, a list of messages; an
answer is a string or, for rows with several accepted answers, a list of them (the built-ins accept any one).
Completions of the same prompt are contiguous groups of G (grpo.num_generations), so a judge-style reward can
score a group relative to itself. Arguments are passed by name, so a TRL-style `fn(prompts, completions,
**kwargs)` also works (it finds the answers in kwargs['answers']).

What the spec gives a function is checked before any model loads. A spec kwarg must be a parameter of the
function: when the function takes **kwargs (to receive the columns), a kwarg it neither names as a parameter nor
mentions in its docstring is refused as a probable typo — **kwargs would swallow `tolerence: 0.1` silently, and a
function that reads an option from **kwargs can say so in its docstring. A column and a spec kwarg of the same
name are refused (one of them would be lost). Then `check_rewards` calls each user function once, on placeholder
completions for the first prompts of the data, and refuses one that raises or returns anything but one finite
number per completion (None, NaN, a string, the wrong count), naming the function and what it returned.

Built-ins (`REGISTRY`); the starred ones are *correctness* rewards (`correctness = True` on the function,
which a user function may set too): `eval.reward` defaults to the first of them in the rewards list.

  * numeric_answer      1.0 if the last number in the text (kwarg `pick: first` for the first) equals the
                        answer's number: commas, '$', '%', a trailing '.0' and words around it are ignored,
                        '-5' and '−5' are negative ('10-5' is not), compared within kwarg `tolerance` (0).
  * boxed_answer        1.0 if the content of the last \\boxed{...} equals the answer: as numbers when both
                        are one number, else as text with whitespace removed.
  * regex_answer        kwarg `pattern`, a regex with one group: 1.0 if the first match's group(1),
                        stripped, equals the stripped answer; else 0.0.
  * exact_answer        (alias tag_answer) 1.0 if the content of the first <tag>...</tag> (kwarg `tag`,
                        default 'output'), stripped, equals the stripped answer; else 0.0 (also with no pair).
    format              kwarg `tag` (default 'output'): 1.0 for exactly one <tag>...</tag> pair with
                        non-empty content and nothing but whitespace outside it; 0.5 when such a pair
                        is there but other text (or another pair) is outside it; 0.0 otherwise,
                        including an empty pair.
    length_penalty      kwarg `target_chars` (> 0): -max(0, len - target) / target, clipped at -1.
    repetition_penalty  kwargs `n` (default 3) and `unit` ('words', default, or 'chars'):
                        -ngram_repetition(...) of health.py, in [-1, 0].
    judge               an LLM behind an OpenAI-compatible endpoint scores each group relative to itself,
                        in [0, 1] (trainer/judge.py; kwargs: JudgeConfig in config.py).

`resolve(cfg)` turns one RewardConfig into a callable with its kwargs bound — a built-in by name or
a user function by 'module:function', imported with the spec's folder and the working directory on
sys.path — and checks the kwargs fit the function's signature before any rollout. `check_rewards`
resolves a whole list and the eval reward (by its metric name or its 'module:function'), and makes that trial
call, without torch: the spec validation calls it, so a typo costs milliseconds, not a model load.
`RewardComputer(cfgs)` scores a batch: the weighted sum of all components, plus each component's raw values
under its metric name (config.reward_component_names).
A wrong count, a non-number, NaN or inf fails the step naming the reward and the completion; a user
function that raises fails it with a RewardError naming the reward.

A built-in may be a class (the judge): `resolve` builds one object per run from the kwargs, passing
`group_size` (grpo.num_generations) and `output_dir` (the run's directory) when its constructor takes
them; a plain function gets `group_size` too when it has that parameter. A reward object may have a
`metrics()` method: `RewardComputer.step_metrics` holds what those returned for the last batch, and
the step adds them to its metrics.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import math
import numbers
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .config import InputError, RewardConfig, reward_component_names
from .health import ngram_repetition, tag_pattern, tagged_content
from .judge import JudgeReward

RewardFn = Callable[..., list]

REGISTRY: dict[str, RewardFn] = {}


class RewardError(InputError):
    """A reward that failed during a step (it raised, returned NaN, a count or type that is not one float per
    completion); the message names the reward and what to fix."""


def register(name: str, correctness: bool = False):
    """Decorator: make `fn` available as the built-in reward `name`; `correctness` marks a reward that
    says whether the answer is right (1.0) or not, which eval.reward may default to."""

    def deco(fn):
        if name in REGISTRY:
            raise ValueError(f"reward {name!r} is already registered; pick another name")
        if ":" in name:
            raise ValueError(f"reward name {name!r} has a ':', which marks 'module:function'; pick another name")
        if correctness or not hasattr(fn, "correctness"):
            fn.correctness = correctness
        REGISTRY[name] = fn
        return fn

    return deco


def is_correctness(fn) -> bool:
    """True for a reward marked `correctness = True` (a built-in's registry attribute, or a user function's)."""
    return getattr(getattr(fn, "func", fn), "correctness", False) is True


# ---------------------------------------------------------------------------------------------
# Built-ins. Each checks its kwargs first, so resolve() can validate them with empty lists.


def accepted(answer) -> list[str]:
    """The accepted answers of a row: its answer, or each of a list of them."""
    return [str(a) for a in answer] if isinstance(answer, (list, tuple)) else [str(answer)]


@register("tag_answer", correctness=True)
@register("exact_answer", correctness=True)
def exact_answer(completions, answers, prompts, *, tag: str = "output") -> list[float]:
    tag_pattern(tag)
    out = []
    for text, answer in zip(completions, answers):
        content = tagged_content(text, tag)
        out.append(1.0 if content is not None and content.strip() in [a.strip() for a in accepted(answer)] else 0.0)
    return out


@register("regex_answer", correctness=True)
def regex_answer(completions, answers, prompts, *, pattern: str) -> list[float]:
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"regex_answer: pattern={pattern!r} is not a regular expression ({e})") from None
    if rx.groups < 1:
        raise ValueError(
            f"regex_answer: pattern={pattern!r} has no group; put the answer in one, e.g. r'answer: (\\S+)'"
        )
    out = []
    for text, answer in zip(completions, answers):
        m = rx.search(text)
        got = m.group(1) if m else None
        out.append(1.0 if got is not None and got.strip() in [a.strip() for a in accepted(answer)] else 0.0)
    return out


# A number: an optional sign (not after a letter or digit: '10-5' is ten and five), an optional '$',
# digits with optional thousands commas, an optional decimal part; not inside a word ('x2', '5km', 'H2O').
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-\u2212])?\$?"
    r"(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<frac>\.\d+)?(?![^\W_])"
)


def numbers_in(text: str) -> list[float]:
    """Every number in `text`, normalised ('$1,234.0' -> 1234.0, '−5' -> -5.0), in order."""
    out = []
    for m in _NUMBER.finditer(text):
        value = float(m.group("int").replace(",", "") + (m.group("frac") or ""))
        out.append(-value if m.group("sign") else value)
    return out


def _answer_number(answer: str, reward: str) -> float:
    found = numbers_in(answer)
    if len(found) != 1:
        raise ValueError(
            f"{reward}: the answer {answer!r} holds {len(found)} numbers, not one; give numeric answers "
            "in the data, or use regex_answer / exact_answer for other answers"
        )
    return found[0]


@register("numeric_answer", correctness=True)
def numeric_answer(completions, answers, prompts, *, pick: str = "last", tolerance: float = 0.0) -> list[float]:
    if pick not in ("last", "first"):
        raise ValueError(f"numeric_answer: pick={pick!r} must be 'last' or 'first'")
    if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not tolerance >= 0:
        raise ValueError(f"numeric_answer: tolerance={tolerance!r} must be a number >= 0")
    out = []
    for text, answer in zip(completions, answers):
        wants, found = [_answer_number(a, "numeric_answer") for a in accepted(answer)], numbers_in(text)
        got = (found[-1] if pick == "last" else found[0]) if found else None
        right = got is not None and any(math.isclose(got, w, rel_tol=1e-9, abs_tol=tolerance) for w in wants)
        out.append(1.0 if right else 0.0)
    return out


def boxed_content(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced inside), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


@register("boxed_answer", correctness=True)
def boxed_answer(completions, answers, prompts) -> list[float]:
    out = []
    for text, answer in zip(completions, answers):
        content = boxed_content(text)
        out.append(1.0 if content is not None and any(_boxed_equal(content, a) for a in accepted(answer)) else 0.0)
    return out


def _boxed_equal(content: str, answer: str) -> bool:
    got, want = numbers_in(content), numbers_in(answer)
    if len(got) == 1 and len(want) == 1 and not re.search(r"[^\W\d_]", content + answer):
        return math.isclose(got[0], want[0], rel_tol=1e-9)
    return "".join(content.split()) == "".join(answer.split())


@register("format")
def format_reward(completions, answers, prompts, *, tag: str = "output") -> list[float]:
    rx = tag_pattern(tag)
    out = []
    for text in completions:
        m = rx.search(text)
        if m is None or not m.group(1).strip():
            out.append(0.0)
        elif (text[: m.start()] + text[m.end() :]).strip():
            out.append(0.5)
        else:
            out.append(1.0)
    return out


@register("length_penalty")
def length_penalty(completions, answers, prompts, *, target_chars: int) -> list[float]:
    if not isinstance(target_chars, numbers.Real) or target_chars <= 0:
        raise ValueError(f"length_penalty: target_chars={target_chars!r} must be a number > 0")
    return [max(-1.0, -max(0, len(text) - target_chars) / target_chars) for text in completions]


register("judge")(JudgeReward)


@register("repetition_penalty")
def repetition_penalty(completions, answers, prompts, *, n: int = 3, unit: str = "words") -> list[float]:
    if unit not in ("words", "chars"):
        raise ValueError(f"repetition_penalty: unit={unit!r} must be 'words' or 'chars'")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"repetition_penalty: n={n!r} must be an integer >= 1")
    return [-ngram_repetition(text.split() if unit == "words" else text, n) for text in completions]


# ---------------------------------------------------------------------------------------------
# Resolving a spec entry


def add_import_dirs(spec_dir: str | Path | None = None) -> None:
    """Make 'module:function' rewards next to the spec, or in the working directory, importable: both go
    at the end of sys.path, so they never shadow an installed package."""
    for d in ([spec_dir] if spec_dir is not None else []) + [os.getcwd()]:
        d = str(Path(d).resolve())
        if d not in sys.path:
            sys.path.append(d)


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
        raise ValueError(
            f"{where}.name={spec!r}: importing module {module_name!r} failed: {e}; install what it imports"
        ) from e
    except (Exception, SystemExit) as e:  # a module that calls sys.exit() must not end the command silently
        raise ValueError(
            f"{where}.name={spec!r}: importing module {module_name!r} raised {type(e).__name__}: {e}; fix the module"
        ) from e
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            close = difflib.get_close_matches(part, [n for n in dir(obj) if not n.startswith("_")], n=1)
            maybe = f"did you mean '{module_name}:{close[0]}'? " if close and part == attr_path else ""
            raise ValueError(
                f"{where}.name={spec!r}: module {module_name!r} has no attribute {attr_path!r}; {maybe}{hint}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{where}.name={spec!r}: {attr_path!r} is a {type(obj).__name__}, not a function; {hint}")
    return obj


def resolve(
    cfg: RewardConfig,
    index: int | None = None,
    *,
    group_size: int = 1,
    output_dir=None,
    spec_dir: str | Path | None = None,
) -> Callable[..., list]:
    """The reward function `cfg.name` names, with `cfg.kwargs` bound; call it as
    fn(completions=..., answers=..., prompts=...). `index` (the position in the spec's rewards list)
    only makes error messages point at the right entry; `spec_dir` is the spec's folder."""
    where = f"rewards[{index}]" if index is not None else "reward"
    name = cfg.name
    if name in REGISTRY:
        fn = REGISTRY[name]
    elif ":" in name:
        add_import_dirs(spec_dir)
        fn = _load_user_function(name, where)
    else:
        close = difflib.get_close_matches(name, REGISTRY, n=1)
        maybe = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"{where}.name={name!r} is not a built-in reward; {maybe}give a built-in "
            f"({', '.join(REGISTRY)}) or an importable module:function"
        )
    kwargs = dict(cfg.kwargs)
    if inspect.isclass(fn):  # a reward object, built once with its kwargs (they are checked as it is built)
        context = {"group_size": group_size, "output_dir": output_dir}
        wanted = inspect.signature(fn).parameters
        try:
            return fn(**kwargs, **{k: v for k, v in context.items() if k in wanted and k not in kwargs})
        except ValueError as e:
            raise ValueError(f"{where}.kwargs: {e}") from None
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have none; they fail at the first call instead
        signature = None
    if signature is not None and "group_size" in signature.parameters and "group_size" not in kwargs:
        kwargs["group_size"] = group_size
    if signature is not None:
        _check_call(fn, signature, cfg, kwargs, where)
    if name in REGISTRY:
        try:
            fn(completions=[], answers=[], prompts=[], **kwargs)  # built-ins validate their kwargs first
        except ValueError as e:
            raise ValueError(f"{where}.kwargs: {e}") from None
    return functools.partial(fn, **kwargs)


def _check_call(fn, signature: inspect.Signature, cfg: RewardConfig, kwargs: dict, where: str) -> None:
    """The function can be called with the batch (the data parameters it takes, by name) and the spec's kwargs; a
    user function's required parameters may also be the data's columns: those are checked in RewardComputer.trial."""
    builtin = cfg.name in REGISTRY
    data = takes_of(cfg.name, fn).data
    if "completions" not in data:
        raise ValueError(
            f"{where}: {cfg.name!r} takes {signature}, no 'completions': reward functions are given the batch by "
            "name, so name its data parameters completions (and answers, prompts, the data's columns, if it "
            "reads them) or take **kwargs"
        )
    try:
        (signature.bind if builtin else signature.bind_partial)(**dict.fromkeys(data, []), **kwargs)
    except TypeError as e:
        raise ValueError(
            f"{where}: {cfg.name!r} cannot be called with kwargs={kwargs!r} ({e}); it takes "
            f"{signature}: give {where}.kwargs only its keyword parameters, and name its "
            "data parameters completions, answers, prompts (they are passed by name)"
        ) from None
    _refuse_swallowed_kwargs(fn, signature, cfg, where)


def _refuse_swallowed_kwargs(fn, signature: inspect.Signature, cfg: RewardConfig, where: str) -> None:
    """A function with **kwargs accepts any spec kwarg, a misspelt one too: one it neither names as a parameter
    nor mentions in its docstring is refused (its **kwargs are for the data's columns)."""
    params = signature.parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    doc = inspect.getdoc(fn) or ""
    for key in cfg.kwargs:
        if key not in named and not re.search(rf"(?<![\w]){re.escape(key)}(?![\w])", doc):
            close = difflib.get_close_matches(key, [n for n in named if n not in DATA_PARAMS], n=1)
            maybe = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"{where}.kwargs.{key}: {cfg.name!r} has no parameter {key!r}, and its **kwargs would swallow it "
                f"unread; {maybe}give the function a parameter {key!r} (or mention {key!r} in its docstring if it "
                "reads it from **kwargs)"
            )


DATA_PARAMS = ("completions", "answers", "prompts")


@dataclass(frozen=True)
class Takes:
    """What a reward callable is given: those of DATA_PARAMS it takes (all of them with **kwargs, or when its
    signature cannot be read), the data columns it names, and whether it takes every column (**kwargs)."""

    data: tuple[str, ...] = DATA_PARAMS
    columns: frozenset[str] = frozenset()
    all_columns: bool = False


def takes_of(name: str, fn) -> Takes:
    """What the reward `name` (as the rewards list gives it) is given: a built-in the whole batch and no column, a
    user function what its signature names."""
    return Takes() if name in REGISTRY else parameters_of(fn)


def parameters_of(fn) -> Takes:
    target = fn.func if isinstance(fn, functools.partial) else fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return Takes()
    names = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    every = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    data = DATA_PARAMS if every else tuple(k for k in DATA_PARAMS if k in names)
    return Takes(data, names - set(DATA_PARAMS), every)


component_names = reward_component_names  # metric names of the components (trainer/config.py)


def accuracy_component(
    names: Sequence[str], fns: Sequence[Callable], eval_reward: str | None, given: Sequence[str] = ()
) -> str | None:
    """The component eval/accuracy reads: eval.reward if set — a component's metric name, or a reward's name as the
    rewards list gives it (`given`: 'module:function' too) — else the first correctness reward, else None."""
    if eval_reward is not None:
        if eval_reward in names:
            return eval_reward
        same = [n for n, g in zip(names, given) if g == eval_reward]
        if len(same) == 1:
            return same[0]
        if same:
            raise ValueError(
                f"eval.reward={eval_reward!r} names {len(same)} of the rewards; give the metric name of one "
                f"({', '.join(same)})"
            )
        raise ValueError(
            f"eval.reward={eval_reward!r} is not one of the experiment's rewards "
            f"({', '.join(dict.fromkeys([*names, *given]))}); name one of them, or leave eval.reward unset for the "
            "first correctness reward"
        )
    return next((n for n, fn in zip(names, fns) if is_correctness(fn)), None)


def check_rewards(
    rewards: list[RewardConfig],
    eval_reward: str | None = None,
    spec_dir: str | Path | None = None,
    data: tuple[Sequence, Sequence] | None = None,
    group_size: int = 1,
) -> str | None:
    """Resolve every reward (imports, kwargs) and eval.reward, as the run will, without torch; with `data` (the
    (train, held-out) examples of trainer/data.py) also check the columns against the kwargs and call each user
    function once on placeholder completions (`RewardComputer.trial`). Returns the component eval/accuracy will
    read. With none (no correctness reward) it warns that eval/accuracy will not be reported, once per spec.
    Raises ValueError naming the field."""
    rc = RewardComputer(rewards, group_size=group_size, spec_dir=spec_dir)
    if data is not None:
        rc.trial(*data)
    name = rc.accuracy_name(eval_reward)
    if name is None:
        warnings.warn(
            f"eval/accuracy will not be reported: the rewards ({', '.join(rc.names)}) hold no correctness "
            "reward (numeric_answer, boxed_answer, regex_answer, exact_answer, or a function with "
            "correctness = True); eval/reward is the held-out score. Add one, or set eval.reward",
            stacklevel=2,
        )
    return name


class RewardComputer:
    """All the spec's rewards: `rc(completions, answers, prompts)` -> (weighted total per completion,
    {component name: raw values})."""

    def __init__(
        self, cfgs: list[RewardConfig], *, group_size: int = 1, output_dir=None, spec_dir: str | Path | None = None
    ):
        if not cfgs:
            raise ValueError("rewards is empty; give at least one, e.g. rewards: [{name: numeric_answer}]")
        self.names = component_names(cfgs)
        self.weights = [float(c.weight) for c in cfgs]
        self.fns = [
            resolve(c, i, group_size=group_size, output_dir=output_dir, spec_dir=spec_dir) for i, c in enumerate(cfgs)
        ]
        self.given = [c.name for c in cfgs]  # as the rewards list names them ('module:function' for user functions)
        self.user_defined = {n: c.name for n, c in zip(self.names, cfgs) if c.name not in REGISTRY}
        self.group_size = group_size
        self.takes = {n: takes_of(c.name, fn) for n, c, fn in zip(self.names, cfgs, self.fns)}
        self.step_metrics: dict[str, float] = {}  # what reward objects' metrics() gave for the last batch

    def accuracy_name(self, eval_reward: str | None = None) -> str | None:
        """The component eval/accuracy reads (eval.reward, or the first correctness reward); None when the
        rewards hold no correctness reward: eval/accuracy is then not reported, eval/reward is the score."""
        return accuracy_component(self.names, self.fns, eval_reward, self.given)

    def __call__(
        self, completions: list[str], answers: list, prompts: list, **columns: list
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Score a batch: `columns` are the data's other columns, one value per completion (data.reward_columns)."""
        if not len(completions) == len(answers) == len(prompts):
            raise ValueError(
                f"rewards need one answer and one prompt per completion; got {len(completions)} "
                f"completions, {len(answers)} answers, {len(prompts)} prompts"
            )
        total = [0.0] * len(completions)
        per_component: dict[str, list[float]] = {}
        self.step_metrics = {}
        for name, weight, fn in zip(self.names, self.weights, self.fns):
            values = self._score(name, fn, completions, answers, prompts, columns)
            per_component[name] = values
            total = [t + weight * v for t, v in zip(total, values)]
            if callable(getattr(fn, "metrics", None)):
                self.step_metrics.update(fn.metrics())
        return total, per_component

    def _score(self, name: str, fn, completions, answers, prompts, columns: dict) -> list[float]:
        takes = self.takes[name]
        given = {k: list(v) for k, v in columns.items() if takes.all_columns or k in takes.columns}
        bound = fn.keywords if isinstance(fn, functools.partial) else {}
        clash = next((k for k in given if k in bound), None)
        if clash is not None:
            i = self.names.index(name)
            raise ValueError(
                f"data column {clash!r} and rewards[{i}].kwargs.{clash} both give {self.given[i]!r} its {clash!r}; "
                "rename the column or drop the kwarg"
            )
        try:
            batch = {"completions": completions, "answers": answers, "prompts": prompts}
            raw = fn(**{k: list(batch[k]) for k in takes.data}, **given)
        except (Exception, SystemExit) as e:  # sys.exit() in a reward would end the run with its status, silently
            if name not in self.user_defined:
                raise
            raise RewardError(
                f"reward {name!r} ({self.user_defined[name]}) raised {type(e).__name__}: {e}; "
                f"fix the function (it was given {len(completions)} completions, answers and "
                "prompts)"
            ) from e
        return _checked(name, raw, len(completions))

    def trial(self, train: Sequence, held_out: Sequence = (), prompts: int = 2) -> None:
        """Call each user function once, as a step and an eval will, on placeholder completions (the answer, an
        empty text, the answer in tags, a sentence) for the first `prompts` examples of `train` (G = group_size
        each) and of `held_out` (one each): a function that raises or returns anything but one finite number per
        completion is refused naming it and what it returned, before any model loads. Built-ins are not called
        (the judge would send requests)."""
        batches = [(list(train[:prompts]), self.group_size, "data.source")]
        if held_out:
            batches.append((list(held_out[:prompts]), 1, "data.eval_path"))
        for examples, repeat, field in batches:
            if not examples:
                continue
            completions = [placeholder(e.answer, k * repeat + j) for k, e in enumerate(examples) for j in range(repeat)]
            answers = [e.answer for e in examples for _ in range(repeat)]
            prompts_ = [e.prompt for e in examples for _ in range(repeat)]
            columns = {
                k: [e.columns.get(k) for e in examples for _ in range(repeat)]
                for k in dict.fromkeys(k for e in examples for k in e.columns)
            }
            for i, (name, fn) in enumerate(zip(self.names, self.fns)):
                if name not in self.user_defined:
                    continue
                self._refuse_missing(i, fn, columns)
                try:
                    self._score(name, fn, completions, answers, prompts_, columns)
                except Exception as e:
                    named = "" if f"({self.given[i]})" in str(e) else f" ({self.given[i]})"
                    raise ValueError(
                        f"rewards[{i}]{named}: {e} — found by calling it once, before the model loads, on "
                        f"{len(completions)} placeholder completions of the first {len(examples)} prompts of {field}"
                    ) from None

    def _refuse_missing(self, i: int, fn, columns: dict) -> None:
        """A required parameter that neither the spec's kwargs nor the data's columns give is refused, naming both."""
        target, bound = (fn.func, fn.keywords) if isinstance(fn, functools.partial) else (fn, {})
        try:
            params = inspect.signature(target).parameters.values()
        except (TypeError, ValueError):
            return
        for p in params:
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                if p.name not in DATA_PARAMS and p.name not in bound and p.name not in columns:
                    raise ValueError(
                        f"rewards[{i}]: {self.given[i]!r} needs {p.name!r}, which is neither in rewards[{i}].kwargs "
                        f"nor a column of the data ({', '.join(columns) or 'it has none besides prompt and answer'}); "
                        "give it in kwargs, add the column, or give the parameter a default"
                    )


PLACEHOLDERS = ("{answer}", "", "<output>{answer}</output>", "I am not sure, sorry.", "The answer is {answer}.")


def placeholder(answer, j: int) -> str:
    """The j-th placeholder completion for a row with `answer` (its first accepted answer)."""
    return PLACEHOLDERS[j % len(PLACEHOLDERS)].format(answer=accepted(answer)[0])


def _checked(name: str, values, count: int) -> list[float]:
    if isinstance(values, (str, bytes, dict)) or values is None:
        shown = repr(values)
        raise RewardError(
            f"reward {name!r} returned {shown[:60] + '...' if len(shown) > 60 else shown} "
            f"({type(values).__name__}), not a list; reward functions must return one float per completion ({count})"
        )
    try:
        got = len(values)
    except TypeError:
        raise RewardError(
            f"reward {name!r} returned a {type(values).__name__}, not a list; "
            f"reward functions must return one float per completion ({count})"
        ) from None
    if got != count:
        raise RewardError(
            f"reward {name!r} returned {got} values for {count} completions; "
            "reward functions must return one float per completion"
        )
    out = []
    for i, v in enumerate(values):
        if not isinstance(v, numbers.Real):
            raise RewardError(
                f"reward {name!r} returned {v!r} ({type(v).__name__}) for completion {i}; reward "
                "functions must return finite floats (0.0 for a completion they cannot score)"
            )
        v = float(v)
        if not math.isfinite(v):
            raise RewardError(
                f"reward {name!r} returned {v} for completion {i}; reward functions must return finite floats"
            )
        out.append(v)
    return out
