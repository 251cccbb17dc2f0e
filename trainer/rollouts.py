"""Rollouts sampled ahead of training: the batches of steps s+1 … s+k while the trainer updates on step s.

`rollout.max_off_policy_steps: k` (0: synchronous, the default). The choices, on purpose:

- A fixed schedule, not "the freshest weights": the batch of step s is sampled by policy version
  max(0, s-1-k), version v being the policy after v finished steps (synchronous training: s-1). Which weights
  sampled a batch is a function of its step alone, so with the per-step seed (rollout.seed, s) an
  uninterrupted and a resumed run sample the same tokens; each prompt is seeded by its position in the batch too
  (`prompt_seeds`), so it samples the same tokens whatever else shares its batch. Every completion records its version;
  `sampling/staleness/{mean,max}` say how many versions behind the trained weights it is, and a batch more
  than k behind is never trained on (StaleRolloutError).
- Overlap where the engine allows it: an engine with `overlaps_training` (vLLM: another process; offline: it
  only reads a file) generates on a background thread while the trainer computes. The HF engine samples the
  trainer's own model object on the trainer's device, which the update is changing: its batches are made in
  the trainer's thread at the start of a step (same schedule and staleness, no overlap — for studying
  off-policy training on one device, not for speed).
- One version on the engine at a time: version s-1 is pushed (`sync_weights`, with vLLM's served-policy
  check) at the start of step s, once the batches of the version before are done — in steady state those are
  the very batches the trainer needs next, so the wait costs nothing. It is also why, with one engine, k = 2
  is no faster than k = 1: it only keeps one more batch ready.
- In flight at a checkpoint = saved with it: batches sampled and not yet trained on go into the trainer state
  (`state_dict`: tokens, logprobs, texts, versions) with the prompt sampler's position after them, so a resume
  trains on exactly those. Batches are made up to optim.steps, not past it: a run extended on resume samples
  its first new batches from the checkpoint's weights (fresher than the schedule, never staler).
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass

from . import distributed
from .config import TrainerConfig
from .data import PromptSampler
from .engines.base import Completion, SamplingParams


class StaleRolloutError(RuntimeError):
    """A batch sampled by weights more versions behind than rollout.max_off_policy_steps allows."""


def rollout_seed(seed: int, step: int) -> int:
    """The sampling seed of step `step`'s batch: a function of (rollout.seed, step) alone."""
    return seed * 1_000_003 + step


def prompt_seeds(seed: int, step: int, positions: range | list[int]) -> list[int]:
    """The sampling seed of each prompt of step `step`'s batch, by its position in the whole (global) batch: a
    function of (rollout.seed, step, position) alone, so the prompt at position i samples the same completions
    whether the batch is sampled in one process or sharded across ranks."""
    base = rollout_seed(seed, step)
    return [int.from_bytes(hashlib.sha256(f"{base}/{i}".encode()).digest()[:8], "little") >> 1 for i in positions]


def sampling_version(step: int, max_off_policy_steps: int) -> int:
    """The policy version (finished steps) whose weights sample the batch of `step` on the fixed schedule."""
    return max(0, step - 1 - max_off_policy_steps)


@dataclass
class RolloutBatch:
    step: int  # the step that trains on it
    prompt_indices: list[int]  # into the training set, prompts_per_step of them
    completions: list[Completion]  # num_generations per prompt, grouped by prompt
    versions: list[int]  # per completion: finished steps of the weights the engine sampled it with
    generate_s: float  # the engine's wall time for the batch (off the step's path when overlapped)

    def versions_behind(self, trained_version: int) -> list[int]:
        return [trained_version - v for v in self.versions]

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "prompt_indices": self.prompt_indices,
            "versions": self.versions,
            "generate_s": self.generate_s,
            "completions": [asdict(c) for c in self.completions],
        }

    @classmethod
    def from_json(cls, d: dict) -> RolloutBatch:
        return cls(
            step=d["step"],
            prompt_indices=list(d["prompt_indices"]),
            versions=list(d["versions"]),
            generate_s=d["generate_s"],
            completions=[Completion(**c) for c in d["completions"]],
        )


class RolloutProducer:
    """Makes each step's batch on the fixed schedule, up to k steps ahead; `take(step, model)` hands it over."""

    def __init__(
        self, cfg: TrainerConfig, engine, sampler: PromptSampler, prompt_ids: Callable[[int], list[int]], episodes=None
    ):
        """episodes: (EpisodeRunner, the training examples) when data.environment is set: each completion is then a
        multi-turn episode run through the engine turn by turn (trainer/episodes.py)."""
        self.engine, self.sampler, self.prompt_ids, self.episodes = engine, sampler, prompt_ids, episodes
        self.rollout, self.k, self.last_step = cfg.rollout, cfg.rollout.max_off_policy_steps, cfg.optim.steps
        self.prompts_per_step, self.group_size = cfg.grpo.prompts_per_step, cfg.grpo.num_generations
        self.next_step: int | None = None  # the next batch whose prompts are drawn
        self.made: dict[int, Future] = {}  # step -> its batch (done, or being generated)
        self.background = _Worker() if self.k > 0 and getattr(engine, "overlaps_training", False) else None

    def take(self, step: int, model) -> RolloutBatch:
        """The batch of `step`. First the weights of version step-1 go to the engine (after the batches of the
        version before are done), then the batches up to step + k are started with them. A step not made ahead
        (the first, or one taken again or out of order) starts the schedule afresh from it."""
        self._wait_all()
        if step not in self.made:
            self.made, self.next_step = {}, step
        self.engine.sync_weights(model, step)  # version step - 1, named for the step that pushes it
        while self.next_step <= min(step + self.k, max(self.last_step, step)):
            self._start(self.next_step, version=step - 1)
            self.next_step += 1
        batch = self.made.pop(step).result()
        behind = max(batch.versions_behind(step - 1))
        if behind > self.k:
            raise StaleRolloutError(
                f"step {step}: its rollouts were sampled {behind} policy versions ago (version {min(batch.versions)}), "
                f"beyond rollout.max_off_policy_steps={self.k}; they are not trained on — resume with the spec the "
                "run started with, or start the run afresh"
            )
        return batch

    def request(self, step: int) -> tuple[list[int], list[list[int]], SamplingParams]:
        """(prompt indices, prompt token ids, sampling settings) of `step`'s batch, drawn now as `take` would draw
        them, for a caller that samples several producers' batches in one engine call and trains on each at once
        (trainer/multi.py: concurrent trials; synchronous, rollout.max_off_policy_steps: 0)."""
        self.made, self.next_step = {}, step + 1
        return self._request(step)

    def _request(self, step: int) -> tuple[list[int], list[list[int]], SamplingParams]:
        indices = self.sampler.next_batch(self.prompts_per_step)  # the global batch's, on every rank
        world = distributed.world()
        positions = distributed.shard_range(len(indices), world.rank, world.size)  # this rank's whole groups
        indices = [indices[i] for i in positions]
        prompts = [self.prompt_ids(i) for i in indices]
        seed = rollout_seed(self.rollout.seed, step)
        seeds = prompt_seeds(self.rollout.seed, step, positions)
        return indices, prompts, SamplingParams.from_rollout(self.rollout, n=self.group_size, seed=seed, seeds=seeds)

    def _start(self, step: int, version: int) -> None:
        indices, prompts, params = self._request(step)

        def generate() -> RolloutBatch:
            started = time.perf_counter()
            if self.episodes is None:
                groups = self.engine.generate(prompts, params)
            else:
                runner, examples = self.episodes
                where = [f"data.source row {i}" for i in indices]
                groups = runner.run(self.engine, [examples[i] for i in indices], params, where)
            completions = [c for group in groups for c in group]
            return RolloutBatch(step, indices, completions, [version] * len(completions), time.perf_counter() - started)

        self.made[step] = self.background.submit(generate) if self.background else _finished(generate())

    def _wait_all(self) -> None:
        for future in self.made.values():
            future.result()  # waits; an engine's error in the background is raised here, in the trainer's thread

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """The batches made and not yet trained on (waited for), and where the next one starts. Under torchrun each
        rank holds its shard of every batch; every rank calls this and gets the global batches, as one process
        would have made them (the ranks' shards joined in rank order)."""
        self._wait_all()
        batches = [self.made[s].result() for s in sorted(self.made)]
        if distributed.world().distributed:
            batches = [_joined(parts) for parts in zip(*distributed.gather([batches]))]
        return {"next_step": self.next_step, "batches": [b.to_json() for b in batches]}

    def load_state_dict(self, state: dict | None) -> None:
        """After the sampler's own state: the saved batches are the next ones trained on — each rank's shard of them,
        whatever the world size that saved them."""
        self.made = {}
        if not state:
            self.next_step = None
            return
        for d in state["batches"]:
            batch = _shard(RolloutBatch.from_json(d), self.group_size)
            self.made[batch.step] = _finished(batch)
        self.next_step = state["next_step"]

    def close(self) -> None:
        """Stop taking work; a generation still running ends with the engine (closed after this)."""
        if self.background:
            self.background.stop()


def _joined(parts: Sequence[RolloutBatch]) -> RolloutBatch:
    """The ranks' shards of one step's batch, in rank order: the global batch."""
    return RolloutBatch(
        step=parts[0].step,
        prompt_indices=[i for p in parts for i in p.prompt_indices],
        completions=[c for p in parts for c in p.completions],
        versions=[v for p in parts for v in p.versions],
        generate_s=max(p.generate_s for p in parts),
    )


def _shard(batch: RolloutBatch, group_size: int) -> RolloutBatch:
    """This rank's whole groups of a global batch (`distributed.shard_range`, as `_request` draws them)."""
    world = distributed.world()
    if not world.distributed:
        return batch
    prompts = distributed.shard_range(len(batch.prompt_indices), world.rank, world.size)
    rows = slice(prompts.start * group_size, prompts.stop * group_size)
    return RolloutBatch(
        step=batch.step,
        prompt_indices=batch.prompt_indices[prompts.start : prompts.stop],
        completions=batch.completions[rows],
        versions=batch.versions[rows],
        generate_s=batch.generate_s,
    )


def _finished(batch: RolloutBatch) -> Future:
    future: Future = Future()
    future.set_result(batch)
    return future


class _Worker:
    """One daemon thread running jobs in order: an engine request that never returns cannot keep the process
    alive at exit (the engine's own timeouts end it otherwise)."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="ballast-rollouts", daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], RolloutBatch]) -> Future:
        future: Future = Future()
        self.jobs.put((fn, future))
        return future

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 — handed to the trainer by Future.result()
                    future.set_exception(e)

    def stop(self) -> None:
        self.jobs.put(None)
