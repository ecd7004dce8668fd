"""``CallbackManager``: holds callbacks and dispatches events to them, synchronously.

``fire`` runs the hooks in the calling thread and returns the merged ``TrainerControl``; used
inside the training process (every rank). Its subclass ``AsyncCallbackManager``
(``_manager_async.py``, built directly by the callback actor) shares registration, ordering,
state and error handling, and keeps its dispatch apart.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import warnings
from typing import Any

from callbacks._context import TrainingContext, make_snapshot, snapshot_template
from callbacks._control import NO_CONTROL, TrainerControl
from callbacks._dispatch import CoroutineRunner
from callbacks._errors import CallbackError, ErrorLog
from callbacks._events import ALIASES, EVENTS, resolve_event, unknown_event_message
from callbacks._hooks import hooks_of, is_function
from callbacks._index import CLOSED_INDEX, Registration, build_index
from callbacks._registry import global_callbacks as _current_globals
from callbacks._serialize import unpicklable_state

__all__ = ["CallbackManager"]

logger = logging.getLogger("callbacks")


class _BadReturn(TypeError):
    pass


class CallbackManager:
    """Holds callbacks and calls their hooks for each fired event.

    Order of calls: ``core`` callbacks, then the user's in registration order (objects and
    functions interleaved as added), then global ones. Each hook gets its own
    ``TrainingContext`` snapshot; an exception in a hook is logged and recorded in ``errors``
    and the next hook still runs.

    Args:
        callbacks: callbacks to add (instances, event-named functions, or a list of them).
        core: built-in callbacks that run before the user's.
        global_callbacks: ``None`` takes the global registry as it is now; a list means exactly
            those (the runner passes ``[]`` on workers: globals travel in its list).
        max_queue: bound of an ``AsyncCallbackManager``'s queue; when full,
            ``LOW_VALUE_EVENTS`` are dropped (counted in ``dropped_events``) and other events
            wait for room.
        end_timeout: seconds ``fire("on_train_end")`` and ``close()`` wait for pending events.
        max_errors: how many ``CallbackError`` records ``errors`` keeps (all are counted).
        hook_timeout: seconds one hook may run on an asynchronous manager: an ``async def``
            hook still running then is cancelled, a plain one is reported (it cannot be
            stopped); either way a ``TimeoutError`` is recorded against that callback and
            event. ``None``: no bound. The synchronous manager runs hooks in the caller's
            thread and does not bound them.

    Example:
        >>> manager = CallbackManager([PrintLoss()])
        >>> manager.register("on_save", lambda ctx: print("saved", ctx.checkpoint_path))
        >>> control = manager.fire("on_save", TrainingContext(global_step=5), checkpoint_path="x")
    """

    #: What ``fire`` returns for an event nobody subscribed to.
    _idle_result: Any = NO_CONTROL
    #: Whether ``on_train_end`` always reaches the dispatch (the asynchronous end barrier).
    _end_barrier = False

    def __init__(
        self,
        callbacks: Any = None,
        *,
        core: Any = (),
        global_callbacks: list[Any] | None = None,
        max_queue: int = 10_000,
        end_timeout: float = 60.0,
        max_errors: int = 1000,
        hook_timeout: float | None = None,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self._max_queue = max_queue
        self._hook_timeout = hook_timeout
        self._lock = threading.RLock()
        self._user_state: dict[str, Any] = {}
        self._errors = ErrorLog(max_errors)
        self._runner = CoroutineRunner()
        self._end_timeout = end_timeout
        self._closed = False
        self._handled: dict[str, int] = {}
        globals_ = _current_globals() if global_callbacks is None else list(global_callbacks)
        self._core = [self._prepare(cb) for cb in _as_list(core)]
        self._global = [self._prepare(cb) for cb in globals_]
        self._user: list[Registration] = []
        self._index: dict[str, tuple] = CLOSED_INDEX
        self._start()
        self._commit(self._user)
        if callbacks is not None:
            self.add(callbacks)

    # -- registration ------------------------------------------------------------------------

    def add(self, cb_or_list: Any) -> None:
        """Add a callback instance, an event-named function (``def on_save(ctx)``), or a list.

        Raises:
            TypeError: a class instead of an instance, an object with no hooks, or a function
                not named after an event (use ``register``).
            ValueError: already added, or an invalid ``runs_on``.
        """
        new = [self._prepare(cb) for cb in _as_list(cb_or_list)]
        with self._lock:
            self._commit([*self._user, *new])

    def register(self, event: str, fn: Any) -> None:
        """Call ``fn(context, **kwargs)`` on ``event`` (an event name or an alias).

        Raises:
            ValueError: unknown event (with the valid names and a did-you-mean).
        """
        reg = Registration(fn, hooks_of(fn, resolve_event(event)), is_object=False)
        with self._lock:
            self._commit([*self._user, reg])

    def remove(self, cb_or_type: Any) -> None:
        """Remove a callback instance, every instance of a class, or a registered function.

        Raises:
            ValueError: nothing matching is registered.
        """
        with self._lock:
            before = len(self._core) + len(self._user) + len(self._global)
            self._core = [r for r in self._core if not r.matches(cb_or_type)]
            self._global = [r for r in self._global if not r.matches(cb_or_type)]
            user = [r for r in self._user if not r.matches(cb_or_type)]
            if len(self._core) + len(user) + len(self._global) == before:
                raise ValueError(f"{cb_or_type!r} is not registered with this manager")
            self._commit(user)

    def _prepare(self, cb: Any) -> Registration:
        return Registration(cb, hooks_of(cb), is_object=not is_function(cb))

    def _start(self) -> None:
        """Set up the dispatch machinery (nothing for the synchronous manager)."""

    def _commit(self, user: list[Registration]) -> None:
        """Validate and install a new user list, rebuilding the per-event index."""
        index = build_index(self._core, user, self._global, end_barrier=self._end_barrier)
        self._user, self._regs, self._stateful = user, index.registrations, index.stateful
        self._subscribed, self._subscribed_events = index.subscribed, index.events
        self._index = CLOSED_INDEX if self._closed else index.dispatch

    # -- dispatch ----------------------------------------------------------------------------

    def fire(self, event: str, context: TrainingContext | None = None, **kwargs: Any) -> Any:
        """Deliver ``event`` to its subscribers.

        ``kwargs`` become attributes of every snapshot and are passed to hooks whose signature
        takes them. An event nobody subscribes to costs one dict lookup.

        Returns:
            The merged ``TrainerControl`` (a shared read-only one when nothing was requested:
            merge it into your own, don't mutate it); ``None`` from an asynchronous manager
            (take requests later with ``take_control()``). After ``close()``, a no-op.

        Raises:
            ValueError: unknown event name (with a did-you-mean).
        """
        hooks = self._index.get(event)
        if hooks:
            event = ALIASES.get(event, event)
            template = snapshot_template(context, event, kwargs, self._user_state)
            return self._run(event, hooks, template, kwargs)
        if hooks is None:
            raise ValueError(unknown_event_message(event))
        return self._idle_result

    def _run(
        self, event: str, hooks: tuple, template: dict, kwargs: dict, track: Any = None
    ) -> TrainerControl:
        """Call each hook with its own snapshot; return the merged requests. ``track(name)``,
        when given, is told which hook starts (the asynchronous manager's watchdog)."""
        merged = None
        for name, fn, takes, _ in hooks:  # Hook fields, unpacked: cheaper than attributes
            if track is not None:
                track(name)
            ctx = make_snapshot(template)
            try:
                if kwargs and takes:
                    passed = (
                        kwargs if takes is True else {k: kwargs[k] for k in takes & kwargs.keys()}
                    )
                    result = fn(ctx, **passed)
                else:
                    result = fn(ctx)
                if result is not None:
                    result = self._check_result(name, event, result)
                    if result is not None and result.any:
                        merged = (merged or TrainerControl()).merge(result, name)
                control = ctx.control  # the hook may have set flags, or replaced it
                if control.any:
                    merged = (merged or TrainerControl()).merge(control, name)
            except _BadReturn as exc:
                self._errors.record(name, event, template.get("global_step"), str(exc))
            except Exception as exc:
                self._errors.record_exception(name, event, template.get("global_step"), exc)
        self._handled[event] = self._handled.get(event, 0) + 1
        return NO_CONTROL if merged is None else merged

    def _check_result(self, name: str, event: str, result: Any) -> TrainerControl | None:
        if isinstance(result, TrainerControl):
            return result
        if inspect.isawaitable(result):  # an async def hook: run it to completion
            try:
                result = self._runner.run(result, self._hook_timeout)
            except (asyncio.TimeoutError, TimeoutError):
                raise TimeoutError(
                    f"{name}.{event} ran over the hook timeout of {self._hook_timeout:g} s "
                    "(TrainingArgs.callback_timeout_s) and was cancelled"
                ) from None
            if result is None or isinstance(result, TrainerControl):
                return result
        raise _BadReturn(
            f"TypeError: {name}.{event} returned {type(result).__name__}; "
            "a hook returns None or a TrainerControl"
        )

    def take_control(self) -> TrainerControl | None:
        """The control merged from asynchronously handled events, cleared (None here: a
        synchronous ``fire`` returns its control at once)."""
        return None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event fired so far is handled; False on timeout."""
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Stop accepting events (``fire`` is a no-op afterwards) and, for an asynchronous
        manager, drain its queue (at most ``timeout``, default ``end_timeout``) and stop its
        thread. Idempotent.

        Returns:
            True when everything pending was handled in time.
        """
        with self._lock:
            if self._closed:
                return True
            self._closed = True
            self._index = CLOSED_INDEX
        done = self._drain(self._end_timeout if timeout is None else timeout)
        if done:
            self._runner.close()
        return done

    def _drain(self, timeout: float) -> bool:
        """Handle what is pending before closing; True when done in time."""
        return True

    def __enter__(self) -> CallbackManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{state_key: callback.state_dict()}`` for every stateful callback whose state can
        be saved.

        A ``state_dict()`` that raises, or returns what cloudpickle cannot pickle, is recorded
        as an error against that callback (event ``"state_dict"``) and left out: the checkpoint
        is still written, without that callback's state.
        """
        state = {}
        for key, cb in self._stateful:
            try:
                value = cb.state_dict()
                unpicklable_state(key, value)
            except Exception as exc:
                self._errors.record(
                    key,
                    "state_dict",
                    None,
                    f"{type(exc).__name__}: {exc}; left out of this checkpoint",
                )
                continue
            state[key] = value
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore each stateful callback; a missing key is a warning (it starts fresh)."""
        for key, cb in self._stateful:
            if key not in state:
                warnings.warn(f"no saved state for callback {key!r}; it starts fresh", stacklevel=2)
                continue
            try:
                cb.load_state_dict(state[key])
            except Exception as exc:
                self._errors.record_exception(key, "load_state_dict", None, exc)
        unused = set(state) - {key for key, _ in self._stateful}
        if unused:
            logger.warning("callbacks: saved state for %s has no callback", sorted(unused))

    # -- inspection --------------------------------------------------------------------------

    def has_callbacks(self, event: str) -> bool:
        """True when at least one hook subscribes to ``event`` (an event or an alias)."""
        return bool(self._subscribed[resolve_event(event)])

    def list_callbacks(self, event: str | None = None) -> list[Any]:
        """A new list of the callbacks (subscribed to ``event``, if given), in call order."""
        if event is None:
            return [reg.owner for reg in self._regs]
        owners: list[Any] = []
        for hook in self._subscribed[resolve_event(event)]:
            if not any(owner is hook.owner for owner in owners):
                owners.append(hook.owner)
        return owners

    @property
    def callbacks(self) -> list[Any]:
        """All callback objects and functions, in call order (a new list)."""
        return self.list_callbacks()

    @property
    def events(self) -> frozenset[str]:
        """Every valid event name (``EVENTS``): what ``register`` and ``fire`` accept, aliases
        aside. The events somebody subscribed to are ``subscribed_events``."""
        return EVENTS

    @property
    def subscribed_events(self) -> frozenset[str]:
        """The events with at least one subscriber."""
        return self._subscribed_events

    @property
    def user_state(self) -> dict[str, Any]:
        """A dict that persists across events; every snapshot's ``context.user_state``."""
        return self._user_state

    @property
    def errors(self) -> list[CallbackError]:
        """The recorded callback failures (the first ``max_errors``), as a new list."""
        return self._errors.errors

    @property
    def error_counts(self) -> dict[tuple[str, str], int]:
        """Every failure counted, by (callback, event)."""
        return self._errors.counts

    @property
    def dropped_events(self) -> dict[str, int]:
        """Low-value events dropped because the asynchronous queue was full, by event."""
        return {}

    @property
    def handled_events(self) -> dict[str, int]:
        """How many events with subscribers were handled, by event."""
        return dict(self._handled)

    _mode = "synchronous"

    def __repr__(self) -> str:
        return f"CallbackManager({len(self._regs)} callbacks, {self._mode})"


def _as_list(cb_or_list: Any) -> list[Any]:
    return list(cb_or_list) if isinstance(cb_or_list, (list, tuple)) else [cb_or_list]
