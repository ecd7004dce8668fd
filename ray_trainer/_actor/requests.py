"""In the callback actor: save and stop requests from outside the run, and when each took effect.

Runs in the callback actor process. A request comes from ``ray-trainer save``/``stop`` (or
``ray_trainer.save``/``stop``), or from the driver when it gets SIGTERM/SIGINT; the actor hands
it to rank 0 in its next reply (rank 0 sends at least a heartbeat a second), and rank 0 agrees
it with every rank at a step boundary, like a callback's request. The actor then sees it happen:
a save as the next ``on_save``, a stop as the end of the run. ``request`` runs on the actor's
control thread while ``push`` runs on its event thread: the state here is behind one lock.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from callbacks import TrainerControl

#: How many requests `status` shows (the newest last).
KEPT = 10


class OutsideRequests:
    """The requests from outside, the one waiting to go to rank 0, and their outcomes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: TrainerControl | None = None
        self._log: list[dict[str, Any]] = []

    def add(self, kind: str, source: str, step: int | None) -> dict[str, Any]:
        """Queue a ``save`` or ``stop`` for rank 0; the record `status` will show."""
        stop_reason = f"stopped from outside the run: {source}" if kind == "stop" else None
        control = TrainerControl(
            should_save=kind == "save",
            should_training_stop=kind == "stop",
            stop_reason=stop_reason,
        )
        record = {
            "kind": kind,
            "source": source,
            "requested_at": time.time(),
            "requested_at_step": step,
            "delivered_at": None,
            "took_effect_at": None,
            "took_effect_at_step": None,
        }
        with self._lock:
            self._waiting = (self._waiting or TrainerControl()).merge(control, stop_reason)
            self._log = [*self._log, record][-KEPT:]
        return dict(record)

    def take(self) -> TrainerControl | None:
        """The control for the reply being sent now (None when nothing waits)."""
        with self._lock:
            control, self._waiting = self._waiting, None
            if control is not None:
                now = time.time()
                for record in self._log:
                    record["delivered_at"] = record["delivered_at"] or now
        return control

    def stop_reason(self) -> str | None:
        """The reason of a stop asked and not yet acted on (waiting for rank 0, or delivered
        and not yet seen end the run), else None: what a step stuck in its reward functions
        asks (``_rollout/reward_wait.py``), without taking the request."""
        with self._lock:
            if self._waiting is not None and self._waiting.should_training_stop:
                return self._waiting.stop_reason
            for record in reversed(self._log):
                if record["kind"] == "stop" and not record["took_effect_at"]:
                    return f"stopped from outside the run: {record['source']}"
        return None

    def saw_save(self, step: int | None) -> None:
        """Rank 0 saved at `step`: the delivered save requests took effect there."""
        self._took_effect("save", step)

    def saw_end(self, step: int | None) -> None:
        """Rank 0 ended its attempt at `step`: the delivered stop requests took effect."""
        self._took_effect("stop", step)

    def last(self) -> dict[str, Any] | None:
        with self._lock:
            return dict(self._log[-1]) if self._log else None

    def _took_effect(self, kind: str, step: int | None) -> None:
        now = time.time()
        with self._lock:
            for record in self._log:
                if (
                    record["kind"] == kind
                    and record["delivered_at"]
                    and not record["took_effect_at"]
                ):
                    record["took_effect_at"], record["took_effect_at_step"] = now, step
