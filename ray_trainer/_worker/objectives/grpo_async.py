"""Training worker: asynchronous GRPO rollouts, requested ahead and taken within a staleness bound.

Runs in each training worker, for ``grpo.max_staleness`` k >= 1 (k = 0 is the synchronous step
and never comes here). Each rank keeps its own :class:`RolloutQueue`: the rollout requests it
sent its engine for the loader's next steps, oldest first, at most k of them while a step trains
(with the step's own, k + 1 steps of rollouts held: memory does not grow with the run). A step:

1. takes the request of its own prompts (:meth:`RolloutQueue.take`: the trainer waits only if
   the engine has not answered yet);
2. the engines take the trainer's weights when due (``grpo_engines.Engines.sync``: an engine
   actor runs its calls one at a time, so a sync lands between two requests, never inside one);
3. keeps the completions sampled at most k versions behind the trainer's, and drops the rest,
   counted (``rollout/stale_dropped``): their prompts are sampled again at once by the policy
   as it is, for this same step, so no prompt is skipped or repeated; so are the prompts of a
   request whose engine died;
4. requests the rollouts of the steps ahead, up to k of them (:meth:`RolloutQueue.submit`),
   sampled by the weights just synced while this step's rewards and training run.

The queue follows the loader's order of steps, which is the prompt ledger: a checkpoint records
the steps trained, so a resume requests again every step whose rollout was in flight (and the
queue starts empty). Pure bookkeeping: an engine is anything with ``submit``, ``done`` and
``result`` (``_rollout/actor.RemoteEngine``; a fake in the unit tests), so no Ray here.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray_trainer._rollout.actor import RolloutEngineDied


@dataclass
class Request:
    """A rollout request in flight: the prompt rows of the step it is for, the engine it went
    to and that engine's reference for the answer, and when it was sent (``time.time()``)."""

    rows: list[int]
    engine: Any
    ticket: Any
    submitted: float


@dataclass
class Taken:
    """What a step got from its request: the completions it keeps, the rows to sample again
    now (stale, or their engine died), how many completions were dropped as too old, whether
    the answer was there when the trainer asked, the engine's time on the request and, of it,
    the part that ran before the trainer asked (hidden behind the previous step)."""

    kept: list[Any] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    dropped: int = 0
    ready: bool = False
    generation_s: float = 0.0
    overlap_s: float = 0.0
    died: bool = False


def split_stale(
    completions: Sequence[Any], trainer_version: int, max_staleness: int
) -> tuple[list[Any], list[int], int]:
    """The completions within the bound (``trainer_version - version <= max_staleness``), the
    prompt rows to sample again (any of a prompt's completions older: its whole group goes,
    so every group trained is whole), and the count of completions dropped."""
    old = {c.prompt_index for c in completions if trainer_version - c.version > max_staleness}
    kept = [c for c in completions if c.prompt_index not in old]
    rows = list(dict.fromkeys(c.prompt_index for c in completions if c.prompt_index in old))
    return kept, rows, len(completions) - len(kept)


def ages(completions: Sequence[Any], trainer_version: int) -> list[int]:
    """Each completion's age: the trainer's version minus the one that sampled it."""
    return [trainer_version - c.version for c in completions]


class RolloutQueue:
    """One rank's rollout requests in flight, oldest first, in the loader's order of steps.

    Args:
        max_staleness: k, the most versions a trained completion may lag the trainer; also
            the most requests kept in flight while a step trains.
        clock: the wall clock the engine's times are compared with (``time.time``).
    """

    def __init__(self, max_staleness: int, clock: Callable[[], float] = time.time) -> None:
        if max_staleness < 1:
            raise ValueError(f"a rollout queue needs grpo.max_staleness >= 1, got {max_staleness}")
        self.max_staleness = max_staleness
        self.clock = clock
        self.requests: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self.requests)

    def room(self) -> int:
        """How many more requests may be sent now."""
        return self.max_staleness - len(self.requests)

    def submit(
        self, engine: Any, rows: list[int], prompt_ids: list[list[int]], params: Any
    ) -> None:
        """Send the rollout of the next step's prompts (`rows`) to `engine`, without waiting."""
        if self.room() <= 0:
            raise RuntimeError(
                f"grpo: {len(self.requests)} rollout requests in flight already, the most that "
                f"max_staleness={self.max_staleness} allows"
            )
        ticket = engine.submit(prompt_ids, params, rows)
        self.requests.append(Request(list(rows), engine, ticket, self.clock()))

    def take(self, rows: list[int], trainer_version: int) -> Taken:
        """The answer of the oldest request, which must be for `rows` (this step's prompts),
        split by the staleness bound. No request (the first step of an epoch or of a worker
        group's start): every row is missing, to be sampled now."""
        if not self.requests:
            return Taken(missing=list(rows))
        request = self.requests.popleft()
        if request.rows != list(rows):  # the queue follows the loader: a bug if not
            self.requests.clear()
            raise RuntimeError(
                f"grpo: the rollout request in flight is for prompts {request.rows[:4]}..., the "
                f"step's are {list(rows)[:4]}...; the queue lost the loader's order"
            )
        ready = bool(request.engine.done(request.ticket))
        asked = self.clock()
        try:
            completions, started, ended = request.engine.result(request.ticket)
        except RolloutEngineDied:
            return Taken(missing=list(rows), ready=ready, died=True)
        kept, missing, dropped = split_stale(completions, trainer_version, self.max_staleness)
        return Taken(
            kept=kept, missing=missing, dropped=dropped, ready=ready,
            generation_s=max(ended - started, 0.0),
            overlap_s=max(min(ended, asked) - max(started, request.submitted), 0.0),
        )  # fmt: skip

    def clear(self) -> None:
        """Forget every request in flight (their answers are never read)."""
        self.requests.clear()


__all__ = ["Request", "RolloutQueue", "Taken", "ages", "split_stale"]
