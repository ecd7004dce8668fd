"""``AsyncCallbackManager``: the ordered asynchronous manager of the callback actor.

Built by ``CallbackManager(asynchronous=True)``. ``fire`` enqueues and returns ``None``; one
background thread (``AsyncDispatcher``) handles the events one at a time, in the order they were
fired, and merges the control requests of its hooks for ``take_control()``. Runs in the callback
actor process (and in unit tests); registration, ordering, state and errors are the
synchronous manager's.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from callbacks._context import detach_template, snapshot_template
from callbacks._control import TrainerControl
from callbacks._dispatch import AsyncDispatcher
from callbacks._events import ALIASES, LOW_VALUE_EVENTS, unknown_event_message
from callbacks._index import BARRIER
from callbacks._manager import CallbackManager

__all__ = ["AsyncCallbackManager"]

logger = logging.getLogger("callbacks")

_DISPATCHER = "<dispatcher>"


class AsyncCallbackManager(CallbackManager):
    """A ``CallbackManager`` whose ``fire`` enqueues; one thread handles events in order.

    ``on_train_end`` is the end barrier: firing it waits (up to ``end_timeout``) until every
    earlier event and its own hooks are handled. When the queue is full, ``LOW_VALUE_EVENTS``
    are dropped and counted (``dropped_events``); other events wait for room.
    """

    _idle_result = None
    _end_barrier = True
    _mode = "asynchronous"

    def _start(self) -> None:
        self._control_lock = threading.Lock()
        self._pending_control: TrainerControl | None = None
        self._dispatcher = AsyncDispatcher(self._handle, self._max_queue)

    def fire(self, event: str, context: Any = None, **kwargs: Any) -> None:
        """Enqueue ``event`` for its subscribers and return ``None`` (see ``CallbackManager``)."""
        hooks = self._index.get(event)
        if hooks:
            self._enqueue(ALIASES.get(event, event), hooks, context, kwargs)
            return None
        if hooks is None:
            raise ValueError(unknown_event_message(event))
        return None

    def _enqueue(self, event: str, hooks: tuple, context: Any, kwargs: dict) -> None:
        dispatcher = self._dispatcher
        template = snapshot_template(context, event, kwargs, self._user_state)
        seq = None
        if hooks is not BARRIER:
            detach_template(template)  # the caller may reuse its dicts once fire returns
            item = (event, hooks, template, kwargs)
            seq = dispatcher.submit(event, item, droppable=event in LOW_VALUE_EVENTS)
        if event != "on_train_end" or dispatcher.on_dispatcher_thread:
            return  # only on_train_end waits (and a hook firing it cannot wait for itself)
        if not dispatcher.wait_for(seq, self._end_timeout):
            self._errors.record(
                _DISPATCHER,
                event,
                template.get("global_step"),
                f"TimeoutError: on_train_end waited {self._end_timeout:g} s for earlier events "
                f"and its callbacks; {dispatcher.pending()} event(s) still pending",
            )

    def _handle(self, item: tuple) -> None:
        """Runs on the dispatcher thread, one event at a time."""
        event, hooks, template, kwargs = item
        try:
            control = self._run(event, hooks, template, kwargs)
        except Exception as exc:  # a bug here must not end the dispatcher thread
            self._errors.record_exception(_DISPATCHER, event, template.get("global_step"), exc)
            return
        if control.any:
            with self._control_lock:
                pending = self._pending_control or TrainerControl()
                self._pending_control = pending.merge(control, control.stop_reason)

    def take_control(self) -> TrainerControl | None:
        """Return and clear the control merged from the events handled so far (or None)."""
        with self._control_lock:
            control, self._pending_control = self._pending_control, None
        return control

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event fired so far is handled; False on timeout."""
        return self._dispatcher.wait_for(None, timeout)

    def _drain(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        done = self._dispatcher.wait_for(None, timeout)
        if not done:
            logger.warning(
                "callbacks: %d event(s) still pending after %g s at close",
                self._dispatcher.pending(),
                timeout,
            )
        return self._dispatcher.stop(max(0.0, deadline - time.monotonic())) and done

    @property
    def dropped_events(self) -> dict[str, int]:
        """Low-value events dropped because the queue was full, by event."""
        return dict(self._dispatcher.dropped)
