"""Training worker: asynchronous GRPO rollouts, requested ahead and taken within a staleness bound.

Runs in each training worker, for ``max_staleness`` k >= 1 (k = 0 is the synchronous step
and never comes here). Each rank keeps its own :class:`RolloutQueue`: the rollout requests it
sent its engine for the loader's next steps, oldest first, at most k of them while a step trains
(with the step's own, k + 1 steps of rollouts held: memory does not grow with the run). A step:

1. takes the request of its own prompts (:meth:`RolloutQueue.take`: the trainer waits only if
   the engine has not answered yet, or its rewards are not in): each request's completions are
   scored as soon as the engine answers, on a thread of the worker's own (the reward
   functions' Ray tasks run while the step before trains);
2. the engines take the trainer's weights when due (``grpo_engines.Engines.sync``: an engine
   actor runs its calls one at a time, so a sync lands between two requests, never inside one);
3. keeps the completions sampled at most k versions behind the trainer's, and drops the rest,
   counted (``rollout/stale_dropped``): their prompts are sampled again at once by the policy
   as it is, for this same step, so no prompt is skipped or repeated; so are the prompts of a
   request whose engine died (the step's completions are then scored again, together);
4. requests the rollouts of the steps ahead, up to k of them (:meth:`RolloutQueue.submit`),
   sampled by the weights just synced while this step's rewards and training run.

The queue follows the loader's order of steps, which is the prompt ledger: a checkpoint records
the steps trained, so a resume requests again every step whose rollout was in flight (and the
queue starts empty). Pure bookkeeping: an engine is anything with ``submit`` and
``result`` (``_rollout/actor.RemoteEngine``; a fake in the unit tests), so no Ray here.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray_trainer._rollout.actor import RolloutEngineDied


class Background:
    """One job on a daemon thread of its own (it never holds the process at its exit): its
    result, or its error raised again, when :meth:`result` is asked."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        thread.name = "grpo-rewards"
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


@dataclass
class Request:
    """A rollout request in flight: the prompt rows of the step it is for, the engine it went
    to and that engine's reference for the answer, when it was sent (``time.time()``), and
    its scoring in the background (None: scored when taken)."""

    rows: list[int]
    engine: Any
    ticket: Any
    submitted: float
    scoring: Background | None = None


@dataclass
class Taken:
    """What a step got from its request: the completions it keeps, the rows to sample again
    now (stale, or their engine died), how many completions were dropped as too old, the
    engine's time on the request and, of it, the part that ran before the trainer asked
    (hidden behind the previous step); with no completion missing, the step's scoring done in
    the background and its time."""

    kept: list[Any] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    dropped: int = 0
    generation_s: float = 0.0
    overlap_s: float = 0.0
    died: bool = False
    scored: Any = None  # the completions scored in the background (None: score them now)
    reward_s: float = 0.0  # the background's scoring time


def _score_when_answered(request: Request, score: Callable[[list[Any]], Any]) -> Any:
    """On the background thread: `request`'s completions, once the engine answers, scored;
    with the scoring's seconds (None: the engine died, the step samples the rows again)."""
    try:
        completions, _, _ = request.engine.result(request.ticket)
    except RolloutEngineDied:
        return None
    started = time.perf_counter()
    return score(completions), time.perf_counter() - started


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
            raise ValueError(f"a rollout queue needs max_staleness >= 1, got {max_staleness}")
        self.max_staleness = max_staleness
        self.clock = clock
        self.requests: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self.requests)

    def room(self) -> int:
        """How many more requests may be sent now."""
        return self.max_staleness - len(self.requests)

    def submit(
        self,
        engine: Any,
        rows: list[int],
        prompt_ids: list[list[int]],
        params: Any,
        score: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        """Send the rollout of the next step's prompts (`rows`) to `engine`, without waiting;
        with `score`, its completions are scored by it in the background once they come."""
        if self.room() <= 0:
            raise RuntimeError(
                f"grpo: {len(self.requests)} rollout requests in flight already, the most that "
                f"max_staleness={self.max_staleness} allows"
            )
        ticket = engine.submit(prompt_ids, params, rows)
        request = Request(list(rows), engine, ticket, self.clock())
        if score is not None:
            request.scoring = Background(_score_when_answered, request, score)
        self.requests.append(request)

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
        try:
            completions, started, ended = request.engine.result(request.ticket)
        except RolloutEngineDied:
            return Taken(missing=list(rows), died=True)
        kept, missing, dropped = split_stale(completions, trainer_version, self.max_staleness)
        taken = Taken(
            kept=kept, missing=missing, dropped=dropped,
            generation_s=max(ended - started, 0.0),
            overlap_s=max(min(ended, asked) - max(started, request.submitted), 0.0),
        )  # fmt: skip
        if request.scoring is not None and not missing:  # a reward function's error: raised
            outcome = request.scoring.result()
            if outcome is not None:
                taken.scored, taken.reward_s = outcome
        return taken

    def clear(self) -> None:
        """Forget every request in flight (their answers are never read)."""
        self.requests.clear()


__all__ = ["Background", "Request", "RolloutQueue", "Taken", "ages", "split_stale"]
