"""Text-health detectors and the health gate — one home for both the per-step collapse metrics of
training and the artifact probe's classifier, so a "repetition loop" means the same thing in both.

Detectors (thresholds are the module constants below, named for what they tune; each function's docstring
gives its rules): `ngram_repetition`, `unique_token_ratio`, `garbage_score` / `symbol_soup` / `is_garbage`
(undecodable bytes, control characters, emoji soup — never code or other scripts), `repetition_loop` (repeated
lines, words, characters, and near-identical lines that differ only in numbers). `classify()` names what is
wrong with one completion as reason strings ('repetition_loop: line "foo" x7', 'length_cap: ...',
'format_missing: ...', 'garbage: ...', 'too_long: ...'); `reason_code()` strips the detail.

`batch_health()` gives a step's collapse metrics and `hacking_signals()` its reward-hacking signals
(length-reward correlation within groups, group diversity). `HealthGate` watches them, the trainer's own
metrics and trends over steps against `HealthConfig`: a signal beyond its threshold for `patience` consecutive
steps stops the run with 'collapsed: ...' (for hacking: 'collapsed: ... (reward hacking: ...)'), so the run's
status and the sweep pruner act on both alike. Not caught: random *printable ASCII* — character statistics
cannot tell it from code; the repetition and format detectors and the rewards see it instead.
"""

from __future__ import annotations

import functools
import json
import math
import re
import unicodedata
from collections.abc import Sequence
from typing import NamedTuple

from .config import HealthConfig

# ---------------------------------------------------------------------------------------------
# Tuning constants of the detectors (see the module docstring)

GARBAGE_THRESHOLD = 0.15
GARBAGE_UNUSUAL_WEIGHT = 0.5

LOOP_MAX_BLOCK_LINES = 8
LOOP_MIN_LINE_COPIES = 3
LOOP_MAX_WORD_PERIOD = 32
LOOP_MIN_WORD_COPIES = 4
LOOP_MIN_PHRASE_COPIES = 3
LOOP_MAX_CHAR_PERIOD = 64
LOOP_MIN_CHAR_COPIES = 4
LOOP_MIN_CHAR_SPAN = 20
LOOP_NUMBERED_MIN_LETTERS = 3
LOOP_MIN_NUMBERED_COPIES = 12
LOOP_MIN_PATTERN_COPIES = 16

SOUP_MIN_SYMBOLS = 8
SOUP_MIN_SHARE = 0.5

SHOW_CHARS = 40  # longest snippet quoted in a description

REASONS = ("repetition_loop", "length_cap", "format_missing", "garbage", "too_long")
REASON_MEANINGS = {
    "repetition_loop": "the text loops: a line, a phrase or a run of characters repeated back to back",
    "length_cap": "generation stopped at max_tokens instead of ending by itself",
    "format_missing": "the answer format the experiment asks for (a <tag>...</tag> pair) is missing or empty",
    "garbage": "a large share of control, undecodable or unusual characters (symbol or emoji soup)",
    "too_long": "far longer than an answer to this prompt should be",
}

# metric names produced by batch_health()
NGRAM_REPETITION = "health/ngram_repetition"
UNIQUE_TOKEN_RATIO = "health/unique_token_ratio"
GARBAGE_RATIO = "health/garbage_ratio"


# ---------------------------------------------------------------------------------------------
# Sequence statistics


def ngram_repetition(tokens: Sequence, n: int = 3) -> float:
    """Share of n-grams that repeat an earlier n-gram of the same sequence; 0.0 below n + 1 items."""
    if n < 1:
        raise ValueError(f"ngram_repetition: n={n} must be >= 1")
    seq = list(tokens)
    total = len(seq) - n + 1
    if total < 2:
        return 0.0
    distinct = len(set(zip(*(seq[k:] for k in range(n)))))
    return (total - distinct) / total


def unique_token_ratio(tokens: Sequence) -> float:
    """Distinct items / items; 1.0 for an empty sequence."""
    seq = list(tokens)
    return len(set(seq)) / len(seq) if seq else 1.0


# ---------------------------------------------------------------------------------------------
# Garbage


def _char_weight(ch: str) -> float:
    if " " <= ch <= "~" or ch in "\t\n\r":
        return 0.0
    if ch == "\ufffd":
        return 1.0
    if "\u2500" <= ch <= "\u259f":  # box drawing and block elements: tables, trees
        return 0.0
    cat = unicodedata.category(ch)
    if cat in ("Cc", "Cs", "Co", "Cn"):
        return 1.0
    if cat in ("So", "Sk", "Cf"):
        return GARBAGE_UNUSUAL_WEIGHT
    return 0.0


def garbage_score(text: str) -> float:
    """Weighted share of characters that are not ordinary text (0.0 for an empty text).

    Weight 1 for control characters (other than tab, newline, carriage return), U+FFFD and lone surrogates
    (bytes that failed to decode), private-use and unassigned code points; weight 1/2 for unusual symbols (So and
    Sk outside ASCII — emoji, dingbats — and invisible format characters). Printable ASCII, letters, digits,
    punctuation and math symbols of any script and box drawing are ordinary, so code scores 0. `is_garbage` is
    `garbage_score > GARBAGE_THRESHOLD` (0.15): a stray U+FFFD at the end of a long completion is not garbage;
    random bytes are (~0.55 as UTF-8 with replacement, ~0.27 as Latin-1).
    """
    if not text:
        return 0.0
    return sum(_char_weight(ch) for ch in text) / len(text)


def _is_symbol(ch: str) -> bool:
    return ord(ch) > 0x7F and not "\u2500" <= ch <= "\u259f" and unicodedata.category(ch) in ("So", "Sk", "Co")


_WORD = re.compile(r"[^\W_]+")


def symbol_soup(text: str) -> str | None:
    """'12 symbols or emoji to 5 words' when emoji and symbols crowd out the words, else None.

    At least SOUP_MIN_SYMBOLS (8) emoji/pictographs (So, Sk, private use; not box drawing) and at least
    SOUP_MIN_SHARE (half) of symbols + words. Counted against words, not characters, because spaces and long
    words dilute a per-character score. An emoji bullet list ("✅ Drink water") or a few emoji in a sentence
    are text.
    """
    symbols = sum(map(_is_symbol, text))
    if symbols < SOUP_MIN_SYMBOLS:
        return None
    words = len(_WORD.findall(text))
    if symbols < SOUP_MIN_SHARE * (symbols + words):
        return None
    return f"{symbols} symbols or emoji to {words} words"


def is_garbage(text: str) -> bool:
    return garbage_score(text) > GARBAGE_THRESHOLD or symbol_soup(text) is not None


# ---------------------------------------------------------------------------------------------
# Repetition loops


def _show(s: str) -> str:
    if len(s) > SHOW_CHARS:
        s = s[:SHOW_CHARS] + "…"
    return json.dumps(s, ensure_ascii=False)


def _has_alnum(s: str) -> bool:
    return any(ch.isalnum() for ch in s)


def _periodic_runs(items: list, max_period: int):
    """Yield (start, period, copies) for every maximal run where items[i] == items[i + period]."""
    n = len(items)
    for p in range(1, min(max_period, n // 2) + 1):
        i = 0
        while i + p < n:
            if items[i] != items[i + p]:
                i += 1
                continue
            j = i
            while j + p < n and items[j] == items[j + p]:
                j += 1
            # items[i : j + p] is periodic with period p
            yield i, p, (j - i + p) // p
            i = j + 1


_DIGITS = re.compile(r"\d+")
NUMBERED = ", differing only in numbers"


def _mask_numbers(s: str) -> str:
    return _DIGITS.sub("0", s)


def _numbered_copies(unit: str) -> int | None:
    """Copies a unit (digits masked) needs to be a numbered loop; None for one that never is."""
    if sum(ch.isalpha() for ch in unit) >= LOOP_NUMBERED_MIN_LETTERS:
        return LOOP_MIN_NUMBERED_COPIES
    if len(_DIGITS.findall(unit)) >= 2:
        return LOOP_MIN_PATTERN_COPIES
    return None


def _line_loop(text: str, numbered: bool = False) -> str | None:
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    items = [_mask_numbers(ln) for ln in lines] if numbered else lines
    for start, p, copies in _periodic_runs(items, LOOP_MAX_BLOCK_LINES):
        unit = "".join(items[start : start + p])
        need = _numbered_copies(unit) if numbered else (LOOP_MIN_LINE_COPIES if _has_alnum(unit) else None)
        if need is not None and copies >= need:
            block, tail = lines[start : start + p], NUMBERED if numbered else ""
            if p == 1:
                return f"line {_show(block[0].strip())} x{copies}{tail}"
            return f"{p} lines {_show(' / '.join(b.strip() for b in block))} x{copies}{tail}"
    return None


def _word_loop(text: str, numbered: bool = False) -> str | None:
    for line in text.splitlines():
        words = line.split()
        items = [_mask_numbers(w) for w in words] if numbered else words
        for start, p, copies in _periodic_runs(items, LOOP_MAX_WORD_PERIOD):
            phrase = words[start : start + p]
            if numbered:
                need = _numbered_copies(" ".join(items[start : start + p]))
                if need is not None and copies >= need:
                    return f"words {_show(' '.join(phrase))} x{copies}{NUMBERED}"
            elif p == 1 and copies >= LOOP_MIN_WORD_COPIES:
                return f"word {_show(phrase[0])} x{copies}"
            elif p > 1 and copies >= LOOP_MIN_PHRASE_COPIES and sum(map(_has_alnum, phrase)) >= 2:
                return f"words {_show(' '.join(phrase))} x{copies}"
    return None


_CHAR_LOOP = re.compile(rf"(.{{1,{LOOP_MAX_CHAR_PERIOD}}}?)\1{{{LOOP_MIN_CHAR_COPIES - 1},}}", re.DOTALL)


def _char_loop(text: str, numbered: bool = False) -> str | None:
    if numbered:
        text = _mask_numbers(text)
    pos = 0
    while (m := _CHAR_LOOP.search(text, pos)) is not None:
        unit, copies = m.group(1), len(m.group(0)) // len(m.group(1))
        if numbered:
            need = _numbered_copies(unit)
            if need is not None and copies >= need and len(m.group(0)) >= LOOP_MIN_CHAR_SPAN:
                return f"chars {_show(unit)} x{copies}{NUMBERED} (digits shown as 0)"
        elif _has_alnum(unit) and len(m.group(0)) >= LOOP_MIN_CHAR_SPAN:
            return f"chars {_show(unit)} x{copies}"
        # A loop with a letter or digit cannot start deep inside a rejected periodic run (its unit
        # would be made of the run's characters), so skip all but the run's last two max periods.
        pos = max(m.start() + 1, m.end() - 2 * LOOP_MAX_CHAR_PERIOD)
    return None


def repetition_loop(text: str) -> str | None:
    """A short description of the first repetition loop found ('line "foo" x7', 'word "the" x12',
    'chars "abc" x30', '2 lines "a / b" x5', 'line "41. Add." x30, differing only in numbers'), or None.

    Checked in this order, first hit wins:
    - lines: a block of 1 to LOOP_MAX_BLOCK_LINES consecutive lines repeated back to back at least
      LOOP_MIN_LINE_COPIES (3) times (blank lines ignored; indentation counts; the block holds a letter or digit);
    - words: within one line, at least LOOP_MIN_WORD_COPIES (4) copies of one word, or LOOP_MIN_PHRASE_COPIES (3)
      of a phrase with two words holding a letter or digit (a table row "| 0 | 0 |" is not a loop);
    - characters: a unit of 1 to LOOP_MAX_CHAR_PERIOD characters with a letter or digit, repeated at least
      LOOP_MIN_CHAR_COPIES (4) times over LOOP_MIN_CHAR_SPAN (20) characters (rules "====" are not loops);
    - numbered: the same three with every run of digits as one placeholder ("41. Add the numbers." / "42. ...",
      timestamps): a unit with 3+ letters needs LOOP_MIN_NUMBERED_COPIES (12) copies, one of numbers and
      punctuation LOOP_MIN_PATTERN_COPIES (16); a bare number per unit never counts, so number lists, a 12-row
      times table or a 10-epoch training log are not loops.
    """
    return (
        _line_loop(text)
        or _word_loop(text)
        or _char_loop(text)
        or _line_loop(text, numbered=True)
        or _word_loop(text, numbered=True)
        or _char_loop(text, numbered=True)
    )


# ---------------------------------------------------------------------------------------------
# Tags (the required answer format; rewards.py uses the same helpers)


@functools.lru_cache(maxsize=64)
def tag_pattern(tag: str) -> re.Pattern:
    """The first `<tag>...</tag>` pair (shortest content); group 1 is the content."""
    if not tag or not re.fullmatch(r"[\w.:-]+", tag):
        raise ValueError(f"tag={tag!r} is not a tag name; give letters, digits, '_', '.', ':' or '-', e.g. 'output'")
    return re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)


def tagged_content(text: str, tag: str) -> str | None:
    """The content of the first `<tag>...</tag>` pair, unstripped; None when there is no pair."""
    m = tag_pattern(tag).search(text)
    return None if m is None else m.group(1)


# ---------------------------------------------------------------------------------------------
# One completion: what is wrong with it


def reason_code(reason: str) -> str:
    """'repetition_loop: line "foo" x7' -> 'repetition_loop'."""
    return reason.split(":", 1)[0].strip()


def classify(
    text: str,
    token_ids: Sequence[int],
    finish_reason: str,
    max_tokens: int,
    format_tag: str | None = None,
    expected_length: int | None = None,
    length_factor: float = 3.0,
) -> list[str]:
    """Reasons this completion is malformed, in the order of REASONS; [] for a healthy one.

    expected_length is in characters (e.g. the length of a reference answer); too_long fires when
    len(text) > length_factor * expected_length."""
    reasons = []
    loop = repetition_loop(text)
    if loop:
        reasons.append(f"repetition_loop: {loop}")
    if finish_reason == "length":
        reasons.append(f"length_cap: stopped at {len(token_ids)} tokens (max_tokens={max_tokens})")
    if format_tag is not None:
        content = tagged_content(text, format_tag)
        if content is None:
            reasons.append(f"format_missing: no <{format_tag}>...</{format_tag}> pair")
        elif not content.strip():
            reasons.append(f"format_missing: <{format_tag}></{format_tag}> is empty")
    score, soup = garbage_score(text), symbol_soup(text)
    if score > GARBAGE_THRESHOLD:
        reasons.append(f"garbage: score {score:.2f} (control, undecodable or unusual characters)")
    elif soup is not None:
        reasons.append(f"garbage: symbol soup ({soup})")
    if expected_length is not None and len(text) > length_factor * expected_length:
        reasons.append(f"too_long: {len(text)} chars > {length_factor:g} x expected {expected_length}")
    return reasons


# ---------------------------------------------------------------------------------------------
# One step: collapse metrics


def batch_health(texts: list[str], token_ids: list[list[int]]) -> dict[str, float]:
    """Means over the step's completions (NaN for an empty batch): 3-gram repetition and unique-token
    ratio of the completion token ids, and the share of texts that are garbage."""
    if len(texts) != len(token_ids):
        raise ValueError(
            f"batch_health: {len(texts)} texts but {len(token_ids)} token id lists; give one of each per completion"
        )
    if not texts:
        return {NGRAM_REPETITION: math.nan, UNIQUE_TOKEN_RATIO: math.nan, GARBAGE_RATIO: math.nan}
    n = len(texts)
    return {
        NGRAM_REPETITION: sum(ngram_repetition(ids, 3) for ids in token_ids) / n,
        UNIQUE_TOKEN_RATIO: sum(unique_token_ratio(ids) for ids in token_ids) / n,
        GARBAGE_RATIO: sum(is_garbage(t) for t in texts) / n,
    }


# ---------------------------------------------------------------------------------------------
# Reward hacking, read inside the step's groups (the G completions of one prompt are contiguous)

LENGTH_REWARD_CORR = "hacking/length_reward_corr"
LENGTH_REWARD_CORR_TREND = "hacking/length_reward_corr_trend"
GROUP_DIVERSITY = "hacking/group_diversity"
CORRECTNESS_RISE = "hacking/correctness_rise"
OTHER_REWARD_RISE = "hacking/other_reward_rise"
TRAIN_REWARD_RISE = "hacking/train_reward_rise"
EVAL_RISE = "hacking/eval_rise"
DIVERSITY_NGRAM = 3  # group_diversity compares token 3-grams
SPREAD_EPS = 1e-9  # rewards of a group closer than this (relative) are equal: float noise is no spread


def _groups(values: Sequence, group_size: int) -> list:
    if group_size < 1 or len(values) % group_size:
        raise ValueError(f"{len(values)} completions do not split into groups of {group_size}; give whole groups")
    return [values[i : i + group_size] for i in range(0, len(values), group_size)]


def _deviations(values: Sequence[float]) -> list[float]:
    """Each value minus the group's mean; all 0 for a group without spread (float noise included)."""
    lo, hi = min(values), max(values)
    if hi - lo <= SPREAD_EPS * max(1.0, abs(lo), abs(hi)):
        return [0.0] * len(values)
    mean = sum(values) / len(values)
    return [v - mean for v in values]


def length_reward_corr(lengths: Sequence[int], rewards: Sequence[float], group_size: int) -> float:
    """Pooled within-group Pearson correlation of completion length and reward: every length and reward minus its
    group's mean, all groups together; NaN when no group has spread in length or none in reward. Pooled rather than
    averaged over groups, so each group weighs by its spread: where a right answer moves the reward by 1 and a longer
    one by 0.1 the correlation stays low, and where only length moves it the correlation is 1."""
    dl = [d for g in _groups([float(n) for n in lengths], group_size) for d in _deviations(g)]
    dr = [d for g in _groups(list(rewards), group_size) for d in _deviations(g)]
    sll, srr = sum(d * d for d in dl), sum(d * d for d in dr)
    if sll == 0 or srr == 0:
        return math.nan
    return sum(a * b for a, b in zip(dl, dr)) / math.sqrt(sll * srr)


def _ngram_set(tokens: Sequence, n: int) -> set:
    seq = list(tokens)
    return {tuple(seq)} if 0 < len(seq) < n else set(zip(*(seq[k:] for k in range(n))))


def group_diversity(token_ids: Sequence[Sequence[int]], group_size: int, n: int = DIVERSITY_NGRAM) -> float:
    """Mean over groups of how little the G completions share: U = distinct n-grams of the whole group, S = the sum of
    each completion's own distinct n-grams (so repetition inside one completion does not count), and
    (U / S - 1/G) / (1 - 1/G): 0 when every completion has the same n-grams (the same text), 1 when no two share one.
    A completion shorter than n is one n-gram; groups of empty completions are skipped; NaN when none is left or G=1."""
    if group_size < 2:
        return math.nan
    values = []
    for group in _groups(list(token_ids), group_size):
        sets = [_ngram_set(ids, n) for ids in group]
        total = sum(len(s) for s in sets)
        if total:
            values.append((len(set().union(*sets)) / total - 1 / group_size) / (1 - 1 / group_size))
    return sum(values) / len(values) if values else math.nan


def hacking_signals(token_ids: Sequence[Sequence[int]], rewards: Sequence[float], group_size: int) -> dict[str, float]:
    """The step's own reward-hacking signals: hacking/length_reward_corr (length in tokens against the total reward)
    and hacking/group_diversity. The trends over steps come from HealthGate.observe."""
    return {
        LENGTH_REWARD_CORR: length_reward_corr([len(ids) for ids in token_ids], rewards, group_size),
        GROUP_DIVERSITY: group_diversity(token_ids, group_size),
    }


def trend(values: Sequence[float]) -> tuple[float, float]:
    """(rise, t) of a least-squares line through equally spaced values: rise = slope x (len - 1), the change the line
    makes across them; t = slope / its standard error (+-inf for a perfect line, 0 for a flat one). NaN, NaN below 3."""
    n = len(values)
    if n < 3:
        return math.nan, math.nan
    xm, ym = (n - 1) / 2, sum(values) / n
    sxx = sum((x - xm) ** 2 for x in range(n))
    slope = sum((x - xm) * (y - ym) for x, y in enumerate(values)) / sxx
    residual = sum((y - ym - slope * (x - xm)) ** 2 for x, y in enumerate(values))
    scale = max(1.0, max(abs(v) for v in values))
    if residual <= (SPREAD_EPS * scale) ** 2 * n:
        t = 0.0 if abs(slope) <= SPREAD_EPS * scale else math.copysign(math.inf, slope)
    else:
        t = slope / math.sqrt(residual / (n - 2) / sxx)
    return slope * (n - 1), t


# ---------------------------------------------------------------------------------------------
# The gate


class Alarm(NamedTuple):
    """A gate signal: the HealthConfig field holding its threshold and what it means beyond it; `below`: it trips
    below the threshold instead of above; `also`: (metric, field, below) of a second signal that must be beyond its
    own threshold in the same step (reward hacking is one signal rising *while* another does not); `patience`: the
    HealthConfig field counting the consecutive evaluations it needs; `per`: what one evaluation is; `on_policy`: it
    counts only in steps whose batch the current weights sampled (see `counts_in`)."""

    field: str
    meaning: str
    below: bool = False
    also: tuple[str, str, bool] | None = None
    patience: str = "patience"
    per: str = "step"
    on_policy: bool = False


def counts_in(alarm: Alarm, metrics: dict[str, float]) -> bool:
    """Whether the alarm reads this step. An on-policy alarm skips a step trained on a batch sampled ahead
    (rollout.max_off_policy_steps, sampling/staleness/max > 0): its engine-vs-trainer logprob difference is then
    mostly the intended policy lag, which the rollout correction weighs; the served-policy check after every sync
    is what catches a stale adapter there."""
    return not (alarm.on_policy and (metrics.get("sampling/staleness/max") or 0) > 0)


GATE_SIGNALS: dict[str, Alarm] = {
    "completions/clipped_ratio": Alarm("clipped_ratio_max", "completions keep running into max_tokens"),
    NGRAM_REPETITION: Alarm("ngram_repetition_max", "completions repeat themselves"),
    GARBAGE_RATIO: Alarm("garbage_ratio_max", "completions are turning into non-text"),
    "kl": Alarm("kl_max", "the policy has drifted far from the reference"),
    "sampling/sampling_logp_difference/max": Alarm(
        "logprob_diff_max",
        "engine and trainer disagree on logprobs of the same tokens: a stale or double-applied adapter, "
        "or a mismatched sampling configuration",
        on_policy=True,
    ),
    LENGTH_REWARD_CORR: Alarm(
        "length_reward_corr_max",
        "reward hacking: within a prompt's group the longer completions are paid more, so the reward pays length",
    ),
    GROUP_DIVERSITY: Alarm(
        "group_diversity_min",
        "the completions of a prompt are converging on one text: no spread left to learn from",
        below=True,
    ),
    OTHER_REWARD_RISE: Alarm(
        "other_reward_rise_max",
        "reward hacking: a reward component rises while the correctness reward falls, so it pays wrong answers",
        also=(CORRECTNESS_RISE, "correctness_rise_min", True),
    ),
    TRAIN_REWARD_RISE: Alarm(
        "train_reward_rise_max",
        "reward hacking: the training reward rises while the held-out score does not",
        also=(EVAL_RISE, "eval_rise_min", True),
        patience="divergence_patience",
        per="eval point",
    ),
}
TRENDS = (OTHER_REWARD_RISE, CORRECTNESS_RISE)  # count only when their line is significant (HealthConfig.trend_min_t)


class HealthGate:
    """Stops a collapsing or reward-hacking run: `update()` returns 'collapsed: ...' once a signal has been beyond
    its HealthConfig threshold for `patience` consecutive steps (each signal counted on its own).

    `observe()` keeps the windows the trends are read over and returns them as the step's metrics: the trend of
    hacking/length_reward_corr, the rise of the correctness component (`correctness`) and of the paying component
    that rose most (`weights`: a component with weight 0 pays nothing) over the last `trend_window` steps, and at
    an eval step the rises of the training reward and of the held-out score over the last `divergence_window` eval
    points. The trend alarms count only in a step that went through observe(). The windows are part of
    state_dict, so a resumed run reads the same trends as an uninterrupted one.

    A signal absent from a step's metrics or NaN leaves its counter as it was (no evidence either way); a value
    back in range resets it; steps before `min_step` are not counted. The trends are least-squares lines over
    `trend_window` steps, counted only `trend_min_t` standard errors from flat (a small batch's noise is no trend);
    the train-vs-held-out divergence reads `divergence_window` eval points (none without eval.every).
    """

    def __init__(self, cfg: HealthConfig, correctness: str | None = None, weights: dict[str, float] | None = None):
        self.cfg, self.correctness = cfg, correctness
        self.paying = {name: w for name, w in (weights or {}).items() if w != 0 and name != correctness}
        self.consecutive: dict[str, int] = {name: 0 for name in GATE_SIGNALS}
        self.steps: list[dict] = []  # the last trend_window steps: length/reward correlation, component means
        self.evals: list[list[float]] = []  # the last divergence_window eval points: [training reward, held-out score]
        self.since_eval: list[float] = [0.0, 0]  # training reward summed since the last eval point, steps
        self.significant: dict[str, bool] = {}  # the last observed step's trends whose |t| >= trend_min_t
        self.detail: dict[str, str] = {}  # what a trend alarm saw (components, window), for its reason

    # -------------------------------------------------------------------- the windows
    def observe(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Add the step to the windows; returns hacking/length_reward_corr_trend, hacking/correctness_rise and
        hacking/other_reward_rise (NaN until the window is full, or without such a component), hacking/train_reward_rise
        and hacking/eval_rise (NaN but at an eval step with divergence_window eval points seen)."""
        out = {
            LENGTH_REWARD_CORR_TREND: math.nan,
            CORRECTNESS_RISE: math.nan,
            OTHER_REWARD_RISE: math.nan,
            TRAIN_REWARD_RISE: math.nan,
            EVAL_RISE: math.nan,
        }
        names = [n for n in (self.correctness, *self.paying) if n and f"rewards/{n}/mean" in metrics]
        now = {n: float(metrics[f"rewards/{n}/mean"]) for n in names}
        now[LENGTH_REWARD_CORR] = _finite(metrics.get(LENGTH_REWARD_CORR))  # no reward is named with a "/"
        self.steps = (self.steps + [now])[-self.cfg.trend_window :]
        corr = [s[LENGTH_REWARD_CORR] for s in self.steps if s[LENGTH_REWARD_CORR] is not None]
        out[LENGTH_REWARD_CORR_TREND] = trend(corr)[0]
        self.significant = {}
        if len(self.steps) == self.cfg.trend_window:
            out.update(self._component_rises(step, names))
        self.since_eval = [self.since_eval[0] + float(metrics["reward"]), self.since_eval[1] + 1]
        held_out = _finite(metrics.get("eval/accuracy", metrics.get("eval/reward")))
        if held_out is not None:
            out.update(self._divergence(held_out, "eval/accuracy" if "eval/accuracy" in metrics else "eval/reward"))
        return out

    def _component_rises(self, step: int, names: list[str]) -> dict[str, float]:
        min_t, out, seen = self.cfg.trend_min_t, {}, []
        rises = {n: trend([s.get(n, math.nan) for s in self.steps]) for n in names}
        if self.correctness in rises:
            rise, t = rises.pop(self.correctness)
            out[CORRECTNESS_RISE], self.significant[CORRECTNESS_RISE] = rise, t <= -min_t
            seen.append(f"rewards/{self.correctness}/mean {rise:+.3g} (t={t:.3g})")
        if rises:  # the paying component that rose most (a penalty, with a negative weight, pays when it falls)
            name = max(rises, key=lambda n: math.copysign(1, self.paying[n]) * rises[n][0])
            rise, t = (math.copysign(1, self.paying[name]) * v for v in rises[name])
            out[OTHER_REWARD_RISE], self.significant[OTHER_REWARD_RISE] = rise, t >= min_t
            seen.insert(0, f"rewards/{name}/mean {rise:+.3g} (t={t:.3g})")
        self.detail[OTHER_REWARD_RISE] = f"{', '.join(seen)} over steps {step - len(self.steps) + 1}-{step}"
        return out

    def _divergence(self, held_out: float, score: str) -> dict[str, float]:
        window = self.cfg.divergence_window
        self.evals = (self.evals + [[self.since_eval[0] / self.since_eval[1], held_out]])[-window:]
        self.since_eval = [0.0, 0]
        if len(self.evals) < window:
            return {TRAIN_REWARD_RISE: math.nan, EVAL_RISE: math.nan}
        train, held = self.evals[-1][0] - self.evals[0][0], self.evals[-1][1] - self.evals[0][1]
        self.detail[TRAIN_REWARD_RISE] = (
            f"mean training reward since each eval point {train:+.3g}, "
            f"{score} {held:+.3g} over the last {window} eval points"
        )
        return {TRAIN_REWARD_RISE: train, EVAL_RISE: held}

    # -------------------------------------------------------------------- the verdict
    def update(self, step: int, metrics: dict[str, float]) -> str | None:
        if not self.cfg.enabled or step < self.cfg.min_step:
            return None
        tripped = []
        for name, alarm in GATE_SIGNALS.items():
            if not counts_in(alarm, metrics):
                continue
            checks = [(name, alarm.field, alarm.below)] + ([alarm.also] if alarm.also else [])
            values = [metrics.get(metric) for metric, _, _ in checks]
            if any(v is None or math.isnan(v) for v in values):
                continue
            beyond = all(self._beyond(metric, v, field, below) for (metric, field, below), v in zip(checks, values))
            self.consecutive[name] = self.consecutive[name] + 1 if beyond else 0
            count = self.consecutive[name]
            if count >= getattr(self.cfg, alarm.patience):
                said = " while ".join(
                    f"{metric}={v:.4g} {'<' if below else '>'} {getattr(self.cfg, field):g}"
                    for (metric, field, below), v in zip(checks, values)
                )
                seen = f": {self.detail[name]}" if name in self.detail else ""
                per = alarm.per + "s" * (count != 1)
                tripped.append(f"{said} for {count} consecutive {per} ({alarm.meaning}{seen})")
        return "collapsed: " + "; ".join(tripped) if tripped else None

    def _beyond(self, metric: str, value: float, field: str, below: bool) -> bool:
        if metric in TRENDS and not self.significant.get(metric, False):
            return False
        threshold = getattr(self.cfg, field)
        return value < threshold if below else value > threshold

    def state_dict(self) -> dict:
        return {
            "consecutive": dict(self.consecutive),
            "steps": [dict(s) for s in self.steps],
            "evals": [list(e) for e in self.evals],
            "since_eval": list(self.since_eval),
            "significant": dict(self.significant),
            "detail": dict(self.detail),
        }

    def load_state_dict(self, state: dict) -> None:
        counts = state["consecutive"]
        self.consecutive = {name: int(counts.get(name, 0)) for name in GATE_SIGNALS}
        self.steps = [dict(s) for s in state.get("steps", [])]
        self.evals = [list(e) for e in state.get("evals", [])]
        self.since_eval = list(state.get("since_eval", [0.0, 0]))
        self.significant = dict(state.get("significant", {}))
        self.detail = dict(state.get("detail", {}))


def _finite(value) -> float | None:
    """A finite float, or None for a metric that is absent, NaN or infinite."""
    return None if value is None or not math.isfinite(value) else float(value)
