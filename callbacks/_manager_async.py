"""``AsyncCallbackManager``: the ordered asynchronous manager of the callback actor.

Built directly by its caller (the callback actor). ``fire`` enqueues and returns ``None``; one
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

    With ``hook_timeout``, an ``async def`` hook still running after that long is cancelled; a
    plain hook cannot be, so a watchdog thread records it against its callback and event once
    it runs over (the events behind it wait: ``waiting_for()`` says on what).
    """

    _idle_result = None
    _end_barrier = True
    _mode = "asynchronous"

    def _start(self) -> None:
        self._control_lock = threading.Lock()
        self._pending_control: TrainerControl | None = None
        self._dispatcher = AsyncDispatcher(self._handle, self._max_queue)
        # The hook running now on the dispatcher thread: [callback, event, step, started].
        self._current: list[Any] | None = None
        self._handling: tuple[str, Any] = ("", None)  # event and step being handled
        self._watchdog_stop = threading.Event()
        if self._hook_timeout is not None:
            threading.Thread(target=self._watch, name="callbacks-watchdog", daemon=True).start()

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
        if dispatcher.wait_for(seq, self._end_timeout):
            if hooks is BARRIER:  # nobody subscribed: handled once everything before it was
                self._handled[event] = self._handled.get(event, 0) + 1
        else:
            self._errors.record(
                _DISPATCHER,
                event,
                template.get("global_step"),
                f"TimeoutError: on_train_end waited {self._end_timeout:g} s for earlier events "
                f"and its callbacks; {self.waiting_for()}",
            )

    def _handle(self, item: tuple) -> None:
        """Runs on the dispatcher thread, one event at a time."""
        event, hooks, template, kwargs = item
        self._handling = (event, template.get("global_step"))
        try:
            control = self._run(event, hooks, template, kwargs, track=self._track)
        except Exception as exc:  # a bug here must not end the dispatcher thread
            self._errors.record_exception(_DISPATCHER, event, template.get("global_step"), exc)
            return
        finally:
            self._current = None
        if control.any:
            with self._control_lock:
                pending = self._pending_control or TrainerControl()
                self._pending_control = pending.merge(control, control.stop_reason)

    def _track(self, name: str) -> None:
        event, step = self._handling
        self._current = [name, event, step, time.monotonic(), False]

    def _watch(self) -> None:
        """The watchdog thread: records a plain hook that runs over ``hook_timeout`` (an async
        one is cancelled at the timeout; the grace keeps the two from both reporting)."""
        limit = self._hook_timeout + min(1.0, self._hook_timeout)
        while not self._watchdog_stop.wait(min(1.0, self._hook_timeout / 4)):
            current = self._current
            if current is None or current[4] or time.monotonic() - current[3] < limit:
                continue
            current[4] = True  # reported once per call
            name, event, step = current[:3]
            self._errors.record(
                name,
                event,
                step,
                f"TimeoutError: {name}.{event} has run for over {self._hook_timeout:g} s, the "
                "hook timeout (TrainingArgs.callback_timeout_s); a plain hook cannot be "
                "cancelled, so the events after it wait for it",
            )

    def waiting_for(self) -> str:
        """What is still pending, for people waiting on it: queued events and the hook that
        runs now (and for how long)."""
        pending = self._dispatcher.pending()
        current = self._current
        text = f"{pending} event(s) not yet handled"
        if current is not None:
            text += f"; {current[0]}.{current[1]} running for {time.monotonic() - current[3]:.1f} s"
        return text

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
            logger.warning("callbacks: after %g s at close, %s", timeout, self.waiting_for())
        self._watchdog_stop.set()
        return self._dispatcher.stop(max(0.0, deadline - time.monotonic())) and done

    @property
    def dropped_events(self) -> dict[str, int]:
        """Low-value events dropped because the queue was full, by event."""
        return dict(self._dispatcher.dropped)
