"""A population of LoRA adapters over one frozen base model that exploits and explores as it trains (population-based
training, Jaderberg et al. 2017), GRPO's hyperparameters found as schedules at the cost of one population run.

The members are concurrent trials (trainer/multi.py): each a GRPOTrainer with its own adapter, optimizer, scheduler,
sampler, health gate and RNG over the one shared base model; every round all members' rollouts are sampled in one
engine call and each trains on its own. trainer/pbt.py decides who copies whom. The choices, on purpose:

- **The knobs are a schedule.** A member's beta, peak learning rate and repetition penalty are its trainer's schedule
  (`grpo.schedule`: segments {step, beta, learning_rate, repetition_penalty}); a copy appends a segment from the next
  step on. lora.r is fixed per member (an adapter's rank cannot change) and travels with the adapter it is copied with.
- **Ranked on the selection split.** Each member evaluates every `ready` steps (`eval.every = ready`, the spec's eval
  on the held-out selection rows: the caller sets `eval.split`); its objective metric is its score.
- **Exploit is an in-memory fork of the whole training state**: adapter weights, optimizer and scheduler state,
  sampler position, health gate, KL-lag snapshots, step, schedule, and the RNG — so the copy goes on exactly as its
  source would, and the winner's schedule replays as a plain run. The copy's trainer is rebuilt with its source's
  settings (its rank, its seed) and verified like `fork:`: its logprob fingerprint must equal its source's.
- **Members share the data order and rollout seeds** (data.seed, rollout.seed): a round compares members on the same
  prompts and random numbers. Their optim.seed differs (seed + index): their initial adapters and dropout differ.
- **Checkpoints of the whole population** at every ranking step and at the end: each member's checkpoint (the lone-run
  format, trainer/checkpoint.py), then `population.json` (step, members' settings and scores, lineage), written
  atomically last. A resume loads each member's checkpoint of that step (newer ones, from a save cut short, are
  dropped); decisions are seeded per step, so the resumed population equals the uninterrupted one.
- **Ctrl-C / SIGTERM** stop at the end of the round: the population is saved there and the result says so.

    population = Population(root, policy, ready=4, objective="eval/reward", total=20)
    population.start(member_configs(base_cfg, policy, population=8, ready=4))   # or population.resume()
    result = population.run()
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import checkpoint as ckpt
from .config import SCHEDULED, InputError, TrainerConfig
from .loop import Callbacks, SafePoint, TrainingError
from .model import compare_fingerprint, logprob_fingerprint
from .multi import ConcurrentTrials, TrialJob, _Trial
from .pbt import POPULATION_FILE, Policy, Replacement, decide, initial_hparams, rank

NEVER = 10**9  # a member's own checkpoint cadence: the population saves them all together


@dataclass
class Member:
    index: int
    trial: _Trial
    cfg: TrainerConfig  # what its trainer is built with: its root ancestor's settings (rank, seed)
    hparams: dict  # the policy's knobs in force (dotted names), and its fixed ones
    score: float | None = None
    collapsed: str | None = None
    reward: float | None = None  # its last step's mean training reward (what the progress line shows)

    @property
    def name(self) -> str:
        return member_name(self.index)


@dataclass
class PopulationResult:
    step: int
    winner: int | None  # the best healthy member on the last ranking
    scores: dict[int, float]
    events: list[dict]  # every replacement: member, source, step, reason, hparams, explored, fingerprint_diff
    members: list[dict] = field(default_factory=list)  # index, name, hparams, schedule, cfg, checkpoint, collapsed
    interrupted: str | None = None


def member_name(index: int) -> str:
    return f"member-{index:02d}"


def member_configs(base: TrainerConfig, policy: Policy, population: int, ready: int) -> list[TrainerConfig]:
    """Each member's settings: the base spec with its drawn fixed knobs (lora.r), its own optim.seed, its starting
    knobs as the first segment of its schedule, and the population's eval and checkpoint cadence."""
    out = []
    for index, hp in enumerate(initial_hparams(policy, population)):
        data = base.model_dump(mode="json")
        for dotted, value in hp.items():
            if dotted not in SCHEDULED:
                section, key = dotted.split(".", 1)
                data[section][key] = value
        data["optim"]["seed"] = base.optim.seed + index
        data["grpo"]["schedule"] = [{"step": 1, **schedule_values(hp)}]
        data["eval"].update(every=ready, on_start=False)
        data["checkpoint"].update(every=NEVER, keep_last=max(2, base.checkpoint.keep_last))
        out.append(TrainerConfig.model_validate(data))
    return out


def schedule_values(hparams: dict) -> dict:
    """The schedule segment's fields of a member's knobs: {beta, learning_rate, repetition_penalty} present."""
    return {short: hparams[dotted] for dotted, short in SCHEDULED.items() if dotted in hparams}


@dataclass
class Round:
    """One step of the whole population, as `Population(on_round=...)` is told it: for the progress a person watches."""

    step: int
    total: int
    rewards: dict[int, float | None]  # each member's mean training reward this step
    ranking: list[int] | None  # on a ranking step, the members best first on the selection score
    scores: dict[int, float]  # the last ranking's selection scores ({} before the first)
    replaced: list[dict]  # this step's replacements (the lineage events: member, source, reason, explored, ...)
    collapsed: dict[int, str]  # the members whose health gate tripped this step, and why


class Population(ConcurrentTrials):
    """P members trained together for `total` steps; `callbacks_for(index)`: a member's callbacks (its MLflow run);
    `on_replace(event)`: told each replacement (its lineage record); `on_round(round)`: told each step's end."""

    def __init__(
        self,
        root: Path,
        policy: Policy,
        ready: int,
        objective: str,
        total: int,
        callbacks_for: Callable[[int], Sequence[Callbacks]] = lambda index: (),
        on_replace: Callable[[dict], None] | None = None,
        verify_tolerance: float = 1e-5,
        on_round: Callable[[Round], None] | None = None,
    ):
        if ready < 1 or total % ready:
            raise InputError(f"pbt.ready is {ready} and optim.steps {total}; make optim.steps a multiple of pbt.ready")
        super().__init__(slots=NEVER)
        self.root, self.policy, self.ready, self.objective, self.total = Path(root), policy, ready, objective, total
        self.callbacks_for, self.on_replace, self.tolerance = callbacks_for, on_replace, verify_tolerance
        self.on_round = on_round
        self.members: list[Member] = []
        self.scores: dict[int, float] = {}  # the last ranking's
        self.events: list[dict] = []
        self.step = 0

    # ------------------------------------------------------------------ start, resume

    def start(self, cfgs: list[TrainerConfig]) -> None:
        """A fresh population, one member per config (member_configs)."""
        self._serve(cfgs)
        for index, cfg in enumerate(cfgs):
            trial = self._start(self._job(index, cfg))
            hparams = {**fixed_of(cfg, self.policy), **_knobs(trial.trainer.hyperparameters_at(1))}
            self.members.append(Member(index, trial, cfg, hparams))

    def resume(self) -> int:
        """The population as its last save left it (population.json and each member's checkpoint of that step);
        returns that step. Checkpoints newer than it (a save cut short) are dropped first."""
        state = read_state(self.root)
        if state is None:
            raise InputError(f"{self.root}: no {POPULATION_FILE} to resume; start the population without --resume")
        self.step, self.events = state["step"], state["events"]
        self.scores = {int(k): v for k, v in state["scores"].items()}
        self._serve([TrainerConfig.model_validate(record["cfg"]) for record in state["members"]])
        for record in state["members"]:
            cfg = TrainerConfig.model_validate(record["cfg"])
            _drop_checkpoints_after(self.root / member_name(record["index"]) / "checkpoints", self.step)
            trial = self._start(self._job(record["index"], cfg))
            with self._active(trial):  # the member's RNG is its checkpoint's after this
                trial.trainer.resume()
            member = Member(record["index"], trial, cfg, record["hparams"], record["score"], record.get("collapsed"))
            self.members.append(member)
        return self.step

    def _serve(self, cfgs: list[TrainerConfig]) -> None:
        """With rollout.engine: vllm, the one server the members share serves all P adapters in a batch, up to the
        largest rank any member has (a copy takes its source's rank, so no later member has a larger one)."""
        self.slots, self.max_lora_rank = len(cfgs), max(cfg.lora.r for cfg in cfgs)

    def _job(self, index: int, cfg: TrainerConfig) -> TrialJob:
        name = member_name(index)
        return TrialJob(name, cfg, self.root / name, callbacks=tuple(self.callbacks_for(index)))

    # ------------------------------------------------------------------ the run

    def run(self) -> PopulationResult:
        """Train to `total`: each round every member steps; on ranking steps the bottom copies the top; a collapsed
        member is replaced at once; the population is saved on ranking steps, at the end and when interrupted."""
        with SafePoint() as safe_point:
            for step in range(self.step + 1, self.total + 1):
                collapsed = self._round(step)
                why = {i: str(self.members[i].collapsed) for i in collapsed}
                ready = step % self.ready == 0
                if ready:
                    self.scores = {m.index: _nan(m.score) for m in self.members}
                rewards = {m.index: m.reward for m in self.members}
                events = len(self.events)
                if step < self.total:
                    hparams = {m.index: m.hparams for m in self.members}
                    for r in decide(self.policy, step, hparams, self.scores or None, collapsed, ready):
                        self._replace(r)
                self.step = step
                if self.on_round is not None:
                    ranking = rank(self.policy, self.scores) if ready else None
                    report = Round(step, self.total, rewards, ranking, dict(self.scores), self.events[events:], why)
                    self.on_round(report)
                if ready or step == self.total or safe_point.received:
                    self.save()
                if safe_point.received:
                    return self.result(interrupted=safe_point.received)
        return self.result()

    def _round(self, step: int) -> set[int]:
        """Every member's step `step`: rollouts in one engine call, then each member's update, metrics and gate.
        Returns the members that collapsed (health gate, or a step that failed as training does: TrainingError)."""
        t0 = time.perf_counter()
        batches = self._sample([m.trial for m in self.members])
        failed = [b for b in batches.values() if isinstance(b, Exception)]
        if failed:  # a member's rollouts failed: the population's run fails with it, its last save kept
            raise failed[0]
        collapsed = set()
        for m in self.members:
            t = m.trial.trainer
            with self._active(m.trial):
                try:
                    metrics = t.train_on(step, batches[m.trial.adapter], t0)
                    metrics.update({f"pbt/{k}": v for k, v in t.hyperparameters_at(step).items()})
                    stopped = t.log_step(step, metrics)
                    m.score = metrics.get(self.objective, m.score)
                    m.reward = metrics.get("reward")
                except TrainingError as e:  # a non-finite gradient: replaced as a collapsed member is
                    t.step, stopped = step, f"failed: {e}"
            if stopped:
                m.collapsed = stopped
                collapsed.add(m.index)
        return collapsed

    # ------------------------------------------------------------------ exploit: an in-memory, verified fork

    def _replace(self, r: Replacement) -> None:
        """Member r.member becomes a copy of r.source's whole training state, with r.hparams from the next step."""
        src, dst = self.members[r.source], self.members[r.member]
        state = self._state_of(src.trial)
        with self._active(src.trial):
            fingerprint = logprob_fingerprint(src.trial.trainer.model, src.trial.trainer.tokenizer, self.shared.device)
        self._release(dst.trial)  # on vLLM, its adapter leaves the server
        dst.trial, dst.cfg = self._start(self._job(dst.index, src.cfg)), src.cfg
        state["schedule"].append({"step": r.step + 1, **schedule_values(r.hparams)})
        _load_state(dst.trial, state)
        with self._active(dst.trial):
            t = dst.trial.trainer
            diff = compare_fingerprint(t.model, t.tokenizer, self.shared.device, fingerprint)
        if not diff <= self.tolerance:
            raise RuntimeError(
                f"step {r.step}: {dst.name}'s copy of {member_name(r.source)} does not reproduce its logprob "
                f"fingerprint (max |diff| {diff:.3g} > {self.tolerance}); the in-memory fork failed"
            )
        dst.hparams, dst.score, dst.collapsed = dict(r.hparams), src.score, None
        event = {**asdict(r), "fingerprint_diff": diff}
        self.events.append(event)
        if self.on_replace is not None:
            self.on_replace(event)

    def _state_of(self, trial: _Trial) -> dict:
        """Everything a member's training goes on from, copied (not shared with the member)."""
        t = trial.trainer
        return {
            "weights": [p.detach().clone() for p in t.params],
            "optimizer": copy.deepcopy(t.optimizer.state_dict()),
            "scheduler": copy.deepcopy(t.scheduler.state_dict()),
            "sampler": copy.deepcopy(t.sampler.state_dict()),
            "gate": copy.deepcopy(t.gate.state_dict()),
            "lagged": copy.deepcopy(list(t.lagged)),
            "step": t.step,
            "num_tokens": t.num_tokens,
            "schedule": copy.deepcopy(t.schedule),
            "rng": copy.deepcopy(trial.rng),
        }

    # ------------------------------------------------------------------ save, result

    def save(self) -> Path:
        """Every member's checkpoint of this step, then population.json (atomically, last: what a resume reads)."""
        for m in self.members:
            with self._active(m.trial):
                m.trial.trainer.save()
        ckpt.fault_point("kill-in-population-save", self.step)
        state = {
            "step": self.step,
            "scores": self.scores,
            "events": self.events,
            "members": [
                {
                    "index": m.index,
                    "cfg": m.cfg.model_dump(mode="json"),
                    "hparams": m.hparams,
                    "score": m.score,
                    "collapsed": m.collapsed,  # a member the gate stopped at the last step is no winner on a resume
                }
                for m in self.members
            ],
        }
        path = self.root / POPULATION_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, path)
        return path

    def result(self, interrupted: str | None = None) -> PopulationResult:
        healthy = {m.index: self.scores.get(m.index, math.nan) for m in self.members if not m.collapsed}
        winner = next((i for i in rank(self.policy, healthy) if not math.isnan(healthy[i])), None)
        members = [
            {
                "index": m.index,
                "name": m.name,
                "hparams": m.hparams,
                "schedule": m.trial.trainer.schedule,
                "cfg": m.cfg.model_dump(mode="json"),
                "checkpoint": str(ckpt.latest_checkpoint(m.trial.trainer.ckpt_root).path),
                "collapsed": m.collapsed,
            }
            for m in self.members
        ]
        return PopulationResult(self.step, winner, dict(self.scores), self.events, members, interrupted)


def _load_state(trial: _Trial, state: dict) -> None:
    t = trial.trainer
    with torch.no_grad():
        for p, w in zip(t.params, state["weights"], strict=True):
            p.copy_(w)
    t.optimizer.load_state_dict(state["optimizer"])
    t.scheduler.load_state_dict(state["scheduler"])
    t.sampler.load_state_dict(state["sampler"])
    t.gate.load_state_dict(state["gate"])
    t.lagged.clear()
    t.lagged.extend(state["lagged"])
    t.step, t.num_tokens, t.schedule = state["step"], state["num_tokens"], state["schedule"]
    trial.rng = state["rng"]


def fixed_of(cfg: TrainerConfig, policy: Policy) -> dict:
    """The values of the policy's fixed (categorical) knobs in a member's settings."""
    data = cfg.model_dump()
    return {dotted: data[dotted.split(".")[0]][dotted.split(".", 1)[1]] for dotted in policy.fixed}


def _knobs(hp: dict) -> dict:
    """A trainer's hyperparameters_at() under the dotted names of the knobs."""
    return {dotted: hp[short] for dotted, short in SCHEDULED.items()}


def _nan(score: float | None) -> float:
    return math.nan if score is None else float(score)


def read_state(root: Path) -> dict | None:
    path = Path(root) / POPULATION_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _drop_checkpoints_after(root: Path, step: int) -> None:
    if root.is_dir():
        for d in root.iterdir():
            s = ckpt.parse_step_dir(d.name)
            if s is not None and s > step:
                shutil.rmtree(d)


def ancestry(events: list[dict], member: int, last_step: int) -> dict[int, int]:
    """Whose history a member's is, step by step: {step: the member slot that trained that step of its lineage}. A
    replacement at step s of `member` by `source` makes steps <= s the source's (and so on back)."""
    owner, out = member, {}
    for step in range(last_step, 0, -1):
        for e in events:
            if e["member"] == owner and e["step"] == step:
                owner = e["source"]
        out[step] = owner
    return out
