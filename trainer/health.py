"""Text-health detectors and the health gate — one home for both the per-step collapse metrics of
training and the artifact probe's classifier, so a "repetition loop" means the same thing in both.

The detectors, and the thresholds they use (module constants below, named for what they tune):

* `ngram_repetition(tokens, n=3)` — the share of a sequence's n-grams that repeat an n-gram seen
  earlier in the same sequence: (number of n-grams - number of distinct n-grams) / number of
  n-grams. 0.0 when the sequence has fewer than n + 1 items (at most one n-gram, nothing to
  repeat). Works on token ids, on a string (characters) or on a list of words. A sequence that is
  one token over and over tends to 1.0 (the gate's default threshold, on token ids, is 0.6).
* `unique_token_ratio(tokens)` — distinct / total; 1.0 for an empty sequence.
* `garbage_score(text)` — the weighted share of characters that are not ordinary text:
  weight 1 for control characters (other than tab, newline, carriage return), the replacement
  character U+FFFD and lone surrogates (bytes that failed to decode, with errors='replace' or
  'surrogateescape'), private-use and unassigned code points; weight 1/2 for unusual symbols
  (Unicode categories So and Sk outside ASCII — emoji, dingbats, pictographs — and invisible format
  characters such as zero-width spaces). Printable ASCII is always ordinary, so source code with
  braces, operators and indentation scores 0, and so do letters, digits, punctuation and math
  symbols of any script, and box-drawing characters (tables, `tree` output).
  `is_garbage(text)` is `garbage_score(text) > GARBAGE_THRESHOLD` (0.15): a stray U+FFFD at the end
  of a long completion cut mid-character does not make it garbage; random bytes do (decoded as
  UTF-8 with replacement, about half the characters are U+FFFD, score ~0.55; decoded as Latin-1, a
  quarter are control characters, score ~0.27). A text that is over 30% emoji also counts as
  garbage, and so does a lone emoji. Not caught: random *printable ASCII* — character statistics
  cannot tell it from code; the repetition and format detectors and the rewards see it instead.
* `repetition_loop(text)` — a degenerate loop, checked in this order, first hit wins:
    - lines: a block of 1 to LOOP_MAX_BLOCK_LINES consecutive lines repeated back to back at least
      LOOP_MIN_LINE_COPIES (3) times. Blank lines are ignored; indentation counts (so the closing
      braces of nested blocks are different lines); the block must contain a letter or digit.
    - words: within one line, a run of 1 to LOOP_MAX_WORD_PERIOD words repeated back to back —
      at least LOOP_MIN_WORD_COPIES (4) copies of a single word ("the the the the", "= = = = ="),
      at least LOOP_MIN_PHRASE_COPIES (3) copies of a longer phrase with at least two words that
      hold a letter or digit (so a markdown table row "| 0 | 0 | 0 |" is not a loop).
    - characters: a unit of 1 to LOOP_MAX_CHAR_PERIOD characters containing a letter or digit,
      repeated back to back at least LOOP_MIN_CHAR_COPIES (4) times over at least LOOP_MIN_CHAR_SPAN
      (20) characters ("abcabcabc...", "aaaa..."); runs of "=", "-" or spaces (rules, banners,
      indentation) and a 16-digit hex constant are not loops.
  A few similar lines of code, a short answer, a markdown list or a JSON object are not loops.

`classify()` names what is wrong with one completion, as a list of reason strings. Each reason is
a code from `REASONS`, optionally followed by ': ' and a human-readable detail:

    'repetition_loop: line "foo" x7'      repetition_loop() found a loop (its description)
    'length_cap: stopped at 32 tokens (max_tokens=32)'   the engine's finish_reason was 'length'
    'format_missing: no <output>...</output> pair'        (or '<output></output> is empty')
    'garbage: score 0.64 (control, undecodable or unusual characters)'
    'too_long: 812 chars > 3 x expected 120'

`reason_code(reason)` strips the detail. Reasons come in the order of `REASONS`.

`batch_health()` gives the per-step collapse metrics (health/ngram_repetition and
health/unique_token_ratio on completion token ids, health/garbage_ratio on texts), and
`HealthGate` watches those and a few trainer metrics against `HealthConfig`: a signal beyond its
threshold for `patience` consecutive steps stops the run with 'collapsed: ...'. A signal absent
from a step's metrics or NaN leaves its counter as it was (no evidence either way); a value back in
range resets it. Steps before `min_step` are not counted at all.
"""
from __future__ import annotations

import functools
import json
import math
import re
import unicodedata
from typing import Optional, Sequence

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

SHOW_CHARS = 40  # longest snippet quoted in a description

REASONS = ("repetition_loop", "length_cap", "format_missing", "garbage", "too_long")

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
    """Weighted share of characters that are not ordinary text (0.0 for an empty text)."""
    if not text:
        return 0.0
    return sum(_char_weight(ch) for ch in text) / len(text)


def is_garbage(text: str) -> bool:
    return garbage_score(text) > GARBAGE_THRESHOLD


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


def _line_loop(text: str) -> Optional[str]:
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    for start, p, copies in _periodic_runs(lines, LOOP_MAX_BLOCK_LINES):
        block = lines[start:start + p]
        if copies >= LOOP_MIN_LINE_COPIES and _has_alnum("".join(block)):
            if p == 1:
                return f"line {_show(block[0].strip())} x{copies}"
            return f"{p} lines {_show(' / '.join(b.strip() for b in block))} x{copies}"
    return None


def _word_loop(text: str) -> Optional[str]:
    for line in text.splitlines():
        words = line.split()
        for start, p, copies in _periodic_runs(words, LOOP_MAX_WORD_PERIOD):
            phrase = words[start:start + p]
            if p == 1 and copies >= LOOP_MIN_WORD_COPIES:
                return f"word {_show(phrase[0])} x{copies}"
            if p > 1 and copies >= LOOP_MIN_PHRASE_COPIES and sum(map(_has_alnum, phrase)) >= 2:
                return f"words {_show(' '.join(phrase))} x{copies}"
    return None


_CHAR_LOOP = re.compile(r"(.{1,%d}?)\1{%d,}" % (LOOP_MAX_CHAR_PERIOD, LOOP_MIN_CHAR_COPIES - 1), re.DOTALL)


def _char_loop(text: str) -> Optional[str]:
    pos = 0
    while (m := _CHAR_LOOP.search(text, pos)) is not None:
        unit = m.group(1)
        if _has_alnum(unit) and len(m.group(0)) >= LOOP_MIN_CHAR_SPAN:
            return f"chars {_show(unit)} x{len(m.group(0)) // len(unit)}"
        # A loop with a letter or digit cannot start deep inside a rejected periodic run (its unit
        # would be made of the run's characters), so skip all but the run's last two max periods.
        pos = max(m.start() + 1, m.end() - 2 * LOOP_MAX_CHAR_PERIOD)
    return None


def repetition_loop(text: str) -> Optional[str]:
    """A short description of the first repetition loop found ('line "foo" x7', 'word "the" x12',
    'chars "abc" x30', '2 lines "a / b" x5'), or None."""
    return _line_loop(text) or _word_loop(text) or _char_loop(text)


# ---------------------------------------------------------------------------------------------
# Tags (the required answer format; rewards.py uses the same helpers)

@functools.lru_cache(maxsize=64)
def tag_pattern(tag: str) -> re.Pattern:
    """The first `<tag>...</tag>` pair (shortest content); group 1 is the content."""
    if not tag or not re.fullmatch(r"[\w.:-]+", tag):
        raise ValueError(f"tag={tag!r} is not a tag name; give letters, digits, '_', '.', ':' or '-', e.g. 'output'")
    return re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)


def tagged_content(text: str, tag: str) -> Optional[str]:
    """The content of the first `<tag>...</tag>` pair, unstripped; None when there is no pair."""
    m = tag_pattern(tag).search(text)
    return None if m is None else m.group(1)


# ---------------------------------------------------------------------------------------------
# One completion: what is wrong with it

def reason_code(reason: str) -> str:
    """'repetition_loop: line "foo" x7' -> 'repetition_loop'."""
    return reason.split(":", 1)[0].strip()


def classify(text: str, token_ids: Sequence[int], finish_reason: str, max_tokens: int,
             format_tag: Optional[str] = None, expected_length: Optional[int] = None,
             length_factor: float = 3.0) -> list[str]:
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
    score = garbage_score(text)
    if score > GARBAGE_THRESHOLD:
        reasons.append(f"garbage: score {score:.2f} (control, undecodable or unusual characters)")
    if expected_length is not None and len(text) > length_factor * expected_length:
        reasons.append(f"too_long: {len(text)} chars > {length_factor:g} x expected {expected_length}")
    return reasons


# ---------------------------------------------------------------------------------------------
# One step: collapse metrics

def batch_health(texts: list[str], token_ids: list[list[int]]) -> dict[str, float]:
    """Means over the step's completions (NaN for an empty batch): 3-gram repetition and unique-token
    ratio of the completion token ids, and the share of texts that are garbage."""
    if len(texts) != len(token_ids):
        raise ValueError(f"batch_health: {len(texts)} texts but {len(token_ids)} token id lists; give one of each per completion")
    if not texts:
        return {NGRAM_REPETITION: math.nan, UNIQUE_TOKEN_RATIO: math.nan, GARBAGE_RATIO: math.nan}
    n = len(texts)
    return {
        NGRAM_REPETITION: sum(ngram_repetition(ids, 3) for ids in token_ids) / n,
        UNIQUE_TOKEN_RATIO: sum(unique_token_ratio(ids) for ids in token_ids) / n,
        GARBAGE_RATIO: sum(is_garbage(t) for t in texts) / n,
    }


# ---------------------------------------------------------------------------------------------
# The gate

# metric name -> (HealthConfig field holding its threshold, what it means when it is too high)
GATE_SIGNALS: dict[str, tuple[str, str]] = {
    "completions/clipped_ratio": ("clipped_ratio_max", "completions keep running into max_tokens"),
    NGRAM_REPETITION: ("ngram_repetition_max", "completions repeat themselves"),
    GARBAGE_RATIO: ("garbage_ratio_max", "completions are turning into non-text"),
    "kl": ("kl_max", "the policy has drifted far from the reference"),
    "rollout/logprob_diff_max": (
        "logprob_diff_max",
        "engine and trainer disagree on logprobs of the same tokens: a stale or double-applied adapter, "
        "or a mismatched sampling configuration"),
}


class HealthGate:
    """Stops a collapsing run: `update()` returns 'collapsed: ...' once a signal has been beyond its
    HealthConfig threshold for `patience` consecutive steps (each signal counted on its own)."""

    def __init__(self, cfg: HealthConfig):
        self.cfg = cfg
        self.consecutive: dict[str, int] = {name: 0 for name in GATE_SIGNALS}

    def update(self, step: int, metrics: dict[str, float]) -> Optional[str]:
        if not self.cfg.enabled or step < self.cfg.min_step:
            return None
        tripped = []
        for name, (field, meaning) in GATE_SIGNALS.items():
            value = metrics.get(name)
            if value is None or math.isnan(value):
                continue
            threshold = getattr(self.cfg, field)
            self.consecutive[name] = self.consecutive[name] + 1 if value > threshold else 0
            if self.consecutive[name] >= self.cfg.patience:
                count = self.consecutive[name]
                tripped.append(f"{name}={value:.4g} > {threshold:g} for {count} consecutive step{'s' * (count != 1)} ({meaning})")
        return "collapsed: " + "; ".join(tripped) if tripped else None

    def state_dict(self) -> dict:
        return {"consecutive": dict(self.consecutive)}

    def load_state_dict(self, state: dict) -> None:
        counts = state["consecutive"]
        self.consecutive = {name: int(counts.get(name, 0)) for name in GATE_SIGNALS}
