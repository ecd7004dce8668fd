"""Training worker: the rollout engines' membership, which serve, which join, which were lost (no Ray).

Runs in each training worker. ``rollout_workers=(min, max)`` gives the pool ``max`` slots; rank
0 starts an engine in each (a Ray actor placed by Ray's scheduler wherever
``rollout_resources`` fit: one that cannot be placed yet stays pending). The ranks agree on the
serving set at step points, so that every rank names the same engines in a weight sync (a
collective under FSDP): each round is one MAX all-reduce of a vector (:meth:`EnginePool.vote`)
that carries rank 0's view (each slot's generation + 1 when its engine is up, else 0) and every
rank's report of the engine it saw die (its generation + 1). From the agreed vector every rank
draws the same change (:meth:`EnginePool.apply`): the lost leave, the up join (the caller syncs
a joiner before its first request), and rank 0 starts a replacement of each lost one in the
background (a new generation of the slot). Rank ``r`` samples from the ``r % n``-th serving
engine (:meth:`EnginePool.assign`). With fewer serving than needed (``min`` at the first step;
one once every engine is lost) rank 0 waits for joiners, bounded: past the timeout the vector
carries an error that every rank raises.

An engine here is anything with ``state()`` (``"up"``, ``"starting"`` or ``"dead"``, without
waiting) and ``kill()``: ``_rollout/actor.RemoteEngine`` in a run, a fake in the unit tests.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

UP, STARTING, DEAD = "up", "starting", "dead"
#: Deaths of a slot's engines before any came up, in a row, after which the slot is left
#: empty (an engine that cannot start, e.g. its model does not load, is not started forever).
MAX_FAILED_STARTS = 3
#: How long rank 0 waits for engines to come up: ``min`` of them at the first step, one when
#: every engine was lost (a vLLM engine loads in about a minute on a CPU).
ENGINE_WAIT_S = 600.0


class EnginesUnavailable(RuntimeError):
    """Too few rollout engines came up within the wait (every rank raises it at once)."""


@dataclass
class Slot:
    """One of the pool's ``max`` places: its engine (None: none started, or, off rank 0, not
    serving), the engine's generation, whether it serves, and starts that failed in a row."""

    engine: Any = None
    generation: int = 0
    serving: bool = False
    failed_starts: int = 0


@dataclass
class Change:
    """What a round changed: the slots that joined (to sync before their first request) and
    those lost (their requests in flight sampled again elsewhere)."""

    joined: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)


class EnginePool:
    """The rollout engines of a worker-group start, as one rank sees them.

    Args:
        low: ``min`` of ``rollout_workers``, the engines the first step waits for.
        high: ``max``, the engines asked for (one per slot).
        rank: this rank (0 starts, polls and replaces the engines).
        start: rank 0, ``start(index, generation)``: a new engine for a slot (returns at once).
        attach: other ranks, ``attach(index, generation)``: a handle on rank 0's engine.
        wait: rank 0, ``wait(engines, seconds)``: returns when one of `engines` may have
            changed state, or after `seconds`.
        clock: seconds, for the waits' deadlines.
    """

    def __init__(
        self,
        low: int,
        high: int,
        rank: int,
        start: Callable[[int, int], Any] | None = None,
        attach: Callable[[int, int], Any] | None = None,
        wait: Callable[[list[Any], float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait_s: float = ENGINE_WAIT_S,
    ) -> None:
        self.low, self.high, self.rank = low, high, rank
        self._start, self._attach, self._wait = start, attach, wait
        self.clock, self.wait_s = clock, wait_s
        self.slots = [Slot() for _ in range(high)]
        self.replaced = 0  # engines started again after one was lost

    # ---- every rank -------------------------------------------------------------------------

    @property
    def serving(self) -> list[int]:
        """The slots whose engines serve, in order (the same list on every rank)."""
        return [i for i, s in enumerate(self.slots) if s.serving]

    def __len__(self) -> int:
        return len(self.serving)

    def engine(self, index: int) -> Any:
        return self.slots[index].engine

    def slot_of(self, rank: int) -> int:
        """The slot rank `rank` samples from (the ``rank % n``-th serving one)."""
        serving = self.serving
        if not serving:
            raise EnginesUnavailable("grpo: no rollout engine is serving")
        return serving[rank % len(serving)]

    def assign(self, rank: int) -> Any:
        return self.slots[self.slot_of(rank)].engine

    def vote(self, lost: Sequence[int] = (), need: int = 0) -> list[float]:
        """This rank's vector for the round's MAX all-reduce: ``high`` values of rank 0's view
        (0 elsewhere), ``high`` of the slots this rank saw die (their generation + 1), and
        rank 0's error (its wait's seconds when fewer than `need` engines came up in it, else 0)."""
        view = [0.0] * self.high
        error = 0.0
        if self.rank == 0:
            view, short = self._poll(need)
            error = self.wait_s if short else 0.0
        died = [0.0] * self.high
        for i in lost:
            died[i] = self.slots[i].generation + 1.0
        return [*view, *died, error]

    def apply(self, agreed: Sequence[float], need: int = 0) -> Change:
        """The round's change from the agreed vector, the same on every rank: an engine that
        was seen dead, or is no longer up in rank 0's view, leaves; an engine up joins. Rank 0
        ends the lost engines and starts their replacements (pending until placeable)."""
        n = self.high
        view, died, error = agreed[:n], agreed[n : 2 * n], agreed[2 * n]
        if error:
            raise EnginesUnavailable(
                f"grpo: fewer than {need} rollout engine(s) came up in {error:g}s "
                f"(rollout_workers: {self.low} to {self.high}): the engines' rollout_resources "
                "fit on no node, or their model does not load (see the engine actors' logs); "
                "lower rollout_workers' min or rollout_resources, or add nodes"
            )
        change = Change()
        for i, slot in enumerate(self.slots):
            if slot.serving and (died[i] == slot.generation + 1 or view[i] != slot.generation + 1):
                slot.serving = False
                change.lost.append(i)
                if self.rank != 0:
                    slot.engine = None  # rank 0 ends it and starts the slot's next generation
            elif not slot.serving and view[i] > 0 and died[i] != view[i]:
                slot.serving = True
                if self.rank != 0:
                    slot.generation = int(view[i]) - 1
                    slot.engine = self._attach(i, slot.generation)
                change.joined.append(i)
        if self.rank == 0:
            for i in change.lost:
                self._replace(i)
        return change

    # ---- rank 0 -----------------------------------------------------------------------------

    def fill(self, started: dict[int, Any] | None = None) -> None:
        """Rank 0: an engine in every slot (`started`: those made already, generation 0)."""
        for i, slot in enumerate(self.slots):
            if slot.engine is None:
                made = (started or {}).get(i)
                slot.engine = made if made is not None else self._start(i, slot.generation)

    def _replace(self, i: int) -> None:
        slot = self.slots[i]
        if slot.engine is not None:
            with contextlib.suppress(Exception):  # gone already: nothing to end
                slot.engine.kill()
        slot.generation += 1
        slot.engine = None
        if slot.failed_starts < MAX_FAILED_STARTS:
            self.replaced += 1
            slot.engine = self._start(i, slot.generation)

    def _states(self) -> list[str]:
        """Each slot's engine's state now; an engine that died before serving is replaced
        here (no other rank knew it), up to :data:`MAX_FAILED_STARTS` times in a row."""
        states = []
        for i, slot in enumerate(self.slots):
            state = DEAD if slot.engine is None else slot.engine.state()
            if state == DEAD and not slot.serving and slot.engine is not None:
                slot.failed_starts += 1
                self._replace(i)
                state = STARTING if slot.engine is not None else DEAD
            elif state == UP:
                slot.failed_starts = 0
            states.append(state)
        return states

    def _poll(self, need: int) -> tuple[list[float], bool]:
        """Rank 0's view (waiting, bounded, until `need` engines are up) and whether it fell
        short."""
        deadline = self.clock() + self.wait_s
        while True:
            states = self._states()
            up = sum(s == UP for s in states)
            left = deadline - self.clock()
            starting = [
                s.engine for s, st in zip(self.slots, states, strict=True) if st == STARTING
            ]
            if up >= need or left <= 0 or not starting:
                view = [
                    s.generation + 1.0 if st == UP else 0.0
                    for s, st in zip(self.slots, states, strict=True)
                ]
                return view, up < need
            self._wait(starting, min(left, 5.0))


__all__ = [
    "DEAD",
    "ENGINE_WAIT_S",
    "MAX_FAILED_STARTS",
    "STARTING",
    "UP",
    "Change",
    "EnginePool",
    "EnginesUnavailable",
    "Slot",
]
