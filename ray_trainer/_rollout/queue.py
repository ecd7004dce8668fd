"""Rollout queue actor: the bookkeeping of requests in flight, answered, re-sent and scored ahead (no Ray).

Runs where a run's asynchronous rollouts are kept (``max_staleness`` k >= 1): in the rollout
queue's actor (``buffer.py``), one per worker-group start, which holds a :class:`RolloutQueue`
for each rank; or in the test process that drives one. A rank's queue holds the requests it
sent for the loader's next steps, oldest first, at most k of them while a step trains (with the
step's own, k + 1 steps of rollouts: memory does not grow with the run). Each request is
followed on a thread of its own from the moment it is sent:

1. the engine's answer is awaited; an engine found dead has the request sent again, at once and
   by the queue itself, to another serving engine (:class:`Serving`: the set rank 0 last agreed,
   shared by every rank's queue), each re-send noted (``Request.resent``) for the ledger;
2. once answered, the completions are scored (the reward functions run while the trainer
   trains the step before).

A step then takes its request (:meth:`RolloutQueue.take`): the completions at most k versions
behind the trainer's, the rows to sample again (any of a prompt's completions older: counted
as dropped; or every row, when no engine was left to re-send to), and the scoring when nothing
is missing. An engine is anything with ``submit`` and ``result`` (``actor.RemoteEngine``; a fake
in the unit tests).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray_trainer._rollout.actor import RolloutEngineDied

#: Re-sends of one request after engine losses before its rows go back to the trainer, which
#: samples them itself (waiting for an engine to come up if none is left).
MAX_RESENDS = 4


class Background:
    """One job on a daemon thread of its own (it never holds the process at its exit): its
    result, or its error raised again, when :meth:`result` is asked."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        thread.name = "grpo-rollout"
        thread.start()

    def _run(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:  # raised again in the step that takes it
            self._error = e
        finally:
            self._done.set()

    def result(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


class Serving:
    """The serving engines as rank 0 last agreed them (slot -> engine), shared by every rank's
    queue: where a lost engine's requests are sent again."""

    def __init__(self) -> None:
        self._engines: dict[int, Any] = {}
        self._lock = threading.Lock()

    def set(self, engines: dict[int, Any]) -> None:
        with self._lock:
            self._engines = dict(engines)

    def other(self, rank: int, tried: set[int]) -> tuple[int, Any] | None:
        """An engine for `rank`'s request that none of `tried` answered: the ``rank % n``-th of
        the serving slots left (as ranks are assigned), or None when none is left."""
        with self._lock:
            left = sorted(s for s in self._engines if s not in tried)
            if not left:
                return None
            slot = left[rank % len(left)]
            return slot, self._engines[slot]


@dataclass
class Request:
    """A rollout request in flight: the step (0-based) and prompt rows it is for, what it asks,
    the engine's slot, the engine and its reference for the answer, when it was sent
    (``time.time()``), the slots it was sent to again after losses, and once answered, the
    engine's answer (None: no engine was left to answer it)."""

    step: int
    rows: list[int]
    prompt_ids: list[list[int]]
    params: Any
    slot: int
    engine: Any
    ticket: Any
    submitted: float
    resent: list[int] = field(default_factory=list)
    answer: tuple[list[Any], float, float] | None = None
    answered: threading.Event = field(default_factory=threading.Event)
    follow: Background | None = None  # answer, re-sends and scoring


@dataclass
class Taken:
    """What a step got from its request: the completions it keeps, the rows to sample again
    now (stale, or no engine was left), how many completions were dropped as too old, the
    engine's time on the request and, of it, the part that ran before the trainer asked
    (hidden behind the previous step), the slots the request was sent to again after losses;
    with no completion missing, the step's scoring done in the background and its time."""

    kept: list[Any] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    dropped: int = 0
    generation_s: float = 0.0
    overlap_s: float = 0.0
    died: bool = False
    resent: list[int] = field(default_factory=list)
    scored: Any = None  # the completions scored in the background (None: score them now)
    reward_s: float = 0.0  # the background's scoring time


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
        score: ``score(step, completions)``, the step's completions scored (rewards and
            advantages), run once they are answered; None: the trainer scores them.
        rank: the rank whose requests these are (where a re-send goes: :meth:`Serving.other`).
        serving: the engines a lost engine's requests are sent to again (None: not re-sent).
        clock: the wall clock the engine's times are compared with (``time.time``).
    """

    def __init__(
        self,
        max_staleness: int,
        score: Callable[[int, list[Any]], Any] | None = None,
        *,
        rank: int = 0,
        serving: Serving | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_staleness < 1:
            raise ValueError(f"a rollout queue needs max_staleness >= 1, got {max_staleness}")
        self.max_staleness = max_staleness
        self.score, self.rank = score, rank
        self.serving = serving if serving is not None else Serving()
        self.clock = clock
        self.requests: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self.requests)

    def room(self) -> int:
        """How many more requests may be sent now."""
        return self.max_staleness - len(self.requests)

    def serve(self, engines: dict[int, Any]) -> None:
        """The serving engines (slot -> engine), as agreed: where lost requests go again."""
        self.serving.set(engines)

    def submit(
        self,
        step: int,
        slot: int,
        engine: Any,
        rows: list[int],
        prompt_ids: list[list[int]],
        params: Any,
    ) -> None:
        """Send the rollout of step `step`'s prompts (`rows`) to `engine` (slot `slot`),
        without waiting; it is followed in the background (answer, re-sends, scoring)."""
        if self.room() <= 0:
            raise RuntimeError(
                f"grpo: {len(self.requests)} rollout requests in flight already, the most that "
                f"max_staleness={self.max_staleness} allows"
            )
        ticket = engine.submit(prompt_ids, params, rows)
        request = Request(step, list(rows), prompt_ids, params, slot, engine, ticket, self.clock())
        request.follow = Background(self._follow, request)
        self.requests.append(request)

    def _follow(self, request: Request) -> tuple[Any, float] | None:
        """On the request's thread: its answer, sent again to another serving engine each time
        its engine is found dead (up to ``MAX_RESENDS``), then scored: (scored, seconds)."""
        tried = {request.slot}
        try:
            while True:
                try:
                    request.answer = request.engine.result(request.ticket)
                    break
                except RolloutEngineDied:
                    other = self.serving.other(self.rank, tried)
                    if other is None or len(request.resent) >= MAX_RESENDS:
                        return None  # the trainer samples the rows itself
                    slot, engine = other
                    tried.add(slot)
                    request.resent.append(slot)
                    request.engine = engine
                    request.ticket = engine.submit(request.prompt_ids, request.params, request.rows)
        finally:
            request.answered.set()
        if self.score is None:
            return None
        started = time.perf_counter()
        scored = self.score(request.step, request.answer[0])
        return scored, time.perf_counter() - started

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
        asked = self.clock()
        request.answered.wait()
        if request.answer is None:  # an error while awaiting it is raised here
            request.follow.result()
            return Taken(missing=list(rows), died=True, resent=request.resent)
        completions, started, ended = request.answer
        kept, missing, dropped = split_stale(completions, trainer_version, self.max_staleness)
        taken = Taken(
            kept=kept, missing=missing, dropped=dropped, resent=request.resent,
            generation_s=max(ended - started, 0.0),
            overlap_s=max(min(ended, asked) - max(started, request.submitted), 0.0),
        )  # fmt: skip
        if not missing:  # a reward function's error: raised
            outcome = request.follow.result()
            if outcome is not None:
                taken.scored, taken.reward_s = outcome
        return taken

    def clear(self) -> None:
        """Forget every request in flight (their answers are never read)."""
        self.requests.clear()

    def close(self) -> None:
        """Nothing to end in this process (the actor's handle, ``buffer.RemoteQueue``, ends it)."""


__all__ = [
    "MAX_RESENDS",
    "Background",
    "Request",
    "RolloutQueue",
    "Serving",
    "Taken",
    "ages",
    "split_stale",
]
