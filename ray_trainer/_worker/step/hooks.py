"""Training worker: firing events inside a training process.

Runs in every training worker (one Ray Train worker process per rank). Worker-side callbacks
(``runs_on="rank0"``/``"all_ranks"``) run here, synchronously, with the live model in the
context. On rank 0, the events the callback actor needs are handed to a forwarder, which
batches them to the actor without waiting (see ``event_forwarder.py``).

Control requests made by any callback accumulate in ``pending`` until the loop starts a step's
all-reduce (just before the last micro-batch's backward), which agrees them across ranks for
that step's boundary.
"""

from __future__ import annotations

from typing import Any, Protocol

from callbacks import CallbackManager, TrainerControl, TrainingContext
from ray_trainer._contract import WorkerSummary

_NO_REQUEST = TrainerControl()  # read-only by convention: the loop only reads the flags


class Forwarder(Protocol):
    """Ships rank-0 events to the callback actor; see `forward.EventForwarder`."""

    events: frozenset[str]
    undelivered: int

    def push(self, event: str, context: TrainingContext, kwargs: dict[str, Any]) -> None: ...

    def poll_control(self, context: TrainingContext | None = None) -> TrainerControl | None: ...

    def close(self, timeout: float, summary: WorkerSummary | None = None) -> None: ...


class Hooks:
    """The loop's one way to fire an event: `hooks.fire("on_save", checkpoint_path=p)`.

    An event nobody subscribed to costs one set lookup: no context update, no allocation.
    """

    def __init__(
        self,
        manager: CallbackManager,
        context: TrainingContext,
        forwarder: Forwarder | None = None,
        preemption_notice: Any = None,
    ) -> None:
        self.manager = manager
        self.context = context
        self.forwarder = forwarder
        self.local_events = manager.subscribed_events
        self.forward_events = forwarder.events if forwarder is not None else frozenset()
        self.active = self.local_events | self.forward_events
        self.pending = TrainerControl()
        # A callable, True once when Ray says a node of this run is about to be preempted.
        self.preemption_notice = preemption_notice

    def fire(self, event: str, **kwargs: Any) -> None:
        if event not in self.active:
            return
        ctx = self.context
        ctx.event = event
        if event in self.local_events:
            control = self.manager.fire(event, ctx, **kwargs)
            if control.any:
                self.pending.merge(control, control.stop_reason or "callback")
        if event in self.forward_events:
            self.forwarder.push(event, ctx, kwargs)

    def take_pending(self) -> TrainerControl:
        """The requests made since the last call (local, from the actor, and a save when a
        node is about to be preempted); resets them."""
        if self.preemption_notice is not None and self.preemption_notice():
            self.pending.merge(TrainerControl(should_save=True), "preemption notice")
        if self.forwarder is not None:
            remote = self.forwarder.poll_control(self.context)
            if remote is not None and remote.any:
                self.pending.merge(remote, remote.stop_reason or "actor callback")
        if not self.pending.any:
            return _NO_REQUEST  # the common case: nothing to swap, nothing allocated
        pending, self.pending = self.pending, TrainerControl()
        return pending

    def close(self, timeout: float, summary: WorkerSummary | None = None) -> None:
        """End of the attempt: rank 0 delivers what is pending and the summary to the actor
        (waiting at most `timeout`); the manager stops taking events."""
        if self.forwarder is not None:
            self.forwarder.close(timeout, summary)
        self.manager.close()
