"""Select on one set, judge on another (DESIGN.md, fourth round): how a sweep's held-out rows are dealt into selection
prompts — what trials are scored, pruned and ranked on — and confirmation prompts, which no trial decision reads and
on which the verdict is made (sweeps/confirmation.py).

The rule, recorded on the study (user attr `ballast.split`, `Split` as JSON) so every worker, resume and page reads
the same one:

- **split**: a held-out set of at least 2 × `confirm.min_prompts` rows is dealt by a seeded shuffle (the sweep's
  `seed`; trainer/config.py `split_indices`): `confirm.share` of the rows are confirmation rows, the rest selection
  rows, each part in the held-out set's order. A trial's spec carries `eval.split: {part: selection, ...}`, so its
  in-training and final evals score the selection rows alone; the baseline is scored on every row once and read
  part by part.
- **file**: `confirm.data` names a file of the user's own confirmation rows (the forms data.source takes); every
  held-out row is then a selection row.
- **none**: a held-out set too small to split (and no `confirm.data`): every row is a selection row, nothing is kept
  back, and the verdict says its gain is measured on the prompts that chose the winner, with the optimism that
  carries (sweeps/statistics.py `winners_curse`).

`selection_score` and `selection_eval` are the public face other searches use (a population ranks its members on the
selection score, never on confirmation rows).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

from trainer.config import split_indices

SPLIT_ATTR = "ballast.split"  # study user attr: Split as JSON


@dataclass
class Split:
    """Which held-out rows select and which confirm."""

    kind: Literal["split", "file", "none"]
    n_held_out: int  # rows of the trials' held-out set (data.*)
    seed: int = 0
    confirm_share: float = 0.5
    selection_rows: list[int] = field(default_factory=list)  # indices into the held-out set
    confirmation_rows: list[int] = field(default_factory=list)  # kind 'split': indices into the held-out set
    confirmation_file: str | None = None  # kind 'file': the user's rows
    n_confirmation: int = 0  # confirmation prompts (rows of the split, or of the file)
    reason: str = ""  # kind 'none': why nothing was kept back

    @property
    def n_selection(self) -> int:
        return len(self.selection_rows)

    @property
    def confirms(self) -> bool:
        return self.kind != "none"

    def selection(self, values: list[float]) -> list[float]:
        """The selection rows' entries of a per-prompt list over the whole held-out set."""
        return [values[i] for i in self.selection_rows] if self.kind == "split" else list(values)

    def confirmation(self, values: list[float]) -> list[float]:
        """The confirmation rows' entries of a per-prompt list over the whole held-out set (kind 'split')."""
        return [values[i] for i in self.confirmation_rows]

    def selection_eval(self) -> dict | None:
        """The `eval.split` a trial's spec carries: its evals score the selection rows alone (None: every row)."""
        if self.kind != "split":
            return None
        return {"part": "selection", "confirm_share": self.confirm_share, "seed": self.seed}

    def confirmation_eval(self) -> dict | None:
        """The `eval.split` of a confirmation eval on the held-out set's confirmation rows (kind 'split')."""
        if self.kind != "split":
            return None
        return {"part": "confirmation", "confirm_share": self.confirm_share, "seed": self.seed}

    def describe(self) -> str:
        """One line: what selects and what confirms."""
        if self.kind == "split":
            return (
                f"held-out set of {self.n_held_out} prompts split (seed {self.seed}): {self.n_selection} selection "
                f"prompts rank and prune the trials, {self.n_confirmation} confirmation prompts no trial decision reads"
            )
        if self.kind == "file":
            return (
                f"the {self.n_held_out} held-out prompts select; {self.n_confirmation} confirmation prompts from "
                f"{self.confirmation_file} judge"
            )
        return f"not split: {self.reason}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Split:
        return cls(**json.loads(text))


def plan_split(n_held_out: int, seed: int, share: float, min_prompts: int, data: str | None = None, n_file: int = 0):
    """The rule above, for a held-out set of `n_held_out` rows (and `n_file` rows in the user's `data` file)."""
    everything = list(range(n_held_out))
    if data is not None:
        return Split("file", n_held_out, seed, share, everything, [], data, n_file)
    n_confirm = round(n_held_out * share)
    if min(n_confirm, n_held_out - n_confirm) < min_prompts:
        reason = (
            f"the held-out set has {n_held_out} prompts and each part needs at least {min_prompts} "
            f"(confirm.min_prompts); raise data.num_eval_prompts (or give confirm.data) to confirm on prompts the "
            "search never saw"
        )
        return Split("none", n_held_out, seed, share, everything, reason=reason)
    selection, confirmation = split_indices(n_held_out, seed, share)
    return Split("split", n_held_out, seed, share, selection, confirmation, n_confirmation=len(confirmation))


def load_split(study) -> Split | None:
    text = study.user_attrs.get(SPLIT_ATTR)
    return Split.from_json(text) if text else None


def selection_score(per_prompt: list[float], split: Split | None, whole_held_out: bool = False) -> float:
    """The selection score of per-prompt scores: their mean over the selection rows. `whole_held_out`: the list covers
    every held-out row (the baseline's) and is read on the selection rows; else it is a trial's, which scored the
    selection rows alone."""
    values = split.selection(per_prompt) if whole_held_out and split is not None else per_prompt
    return sum(values) / len(values)
