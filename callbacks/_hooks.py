"""Turning a callback (an object or a function) into the hooks a manager calls.

Inspection happens once, when a callback is added; ``fire`` only walks prebuilt tuples.
Runs in whichever process builds a ``CallbackManager`` (driver, worker, callback actor).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

from callbacks._events import ALIASES, EVENT_ORDER, EVENTS, suggest_event

__all__ = [
    "RUNS_ON",
    "Hook",
    "callback_name",
    "hooks_of",
    "is_function",
    "noop_hook",
    "runs_on_of",
]

#: Where a callback may run: the callback actor, rank 0's training process, or every rank's.
RUNS_ON: tuple[str, ...] = ("actor", "rank0", "all_ranks")

_NOOP_MARK = "_callbacks_noop_hook"
_WHAT_IS_A_CALLBACK = (
    "a callback is an instance of a TrainerCallback subclass that overrides at least one "
    "on_<event>(self, context, **kwargs) hook, or a function registered with "
    "manager.register(event, fn)"
)


class Hook(NamedTuple):
    """One callable subscribed to one event."""

    callback: str  # the callback's name, for errors and logs
    fn: Callable[..., Any]
    kwargs: bool | frozenset[str]  # True: takes **kwargs; a set: the names it takes; False: none
    owner: Any  # the callback object or function that was added


def noop_hook(fn: Callable) -> Callable:
    """Mark a base-class hook as a no-op, so that only overridden hooks are subscribed."""
    setattr(fn, _NOOP_MARK, True)
    return fn


def callback_name(cb: Any) -> str:
    """A readable name for a callback object or function (for errors and logs)."""
    name = getattr(cb, "name", None) if not is_function(cb) else None
    if isinstance(name, str):
        return name
    if is_function(cb):
        return getattr(cb, "__qualname__", None) or getattr(cb, "__name__", None) or repr(cb)
    return type(cb).__name__


def runs_on_of(cb: Any) -> str:
    """Where a callback runs: its ``runs_on`` attribute, ``"actor"`` when it has none.

    Raises:
        ValueError: ``runs_on`` is not one of ``"actor"``, ``"rank0"``, ``"all_ranks"``.
    """
    owner = getattr(cb, "__self__", None)  # a bound method runs where its callback runs
    runs_on = getattr(cb, "runs_on", None) or getattr(owner, "runs_on", "actor")
    if runs_on not in RUNS_ON:
        raise ValueError(
            f"callback {callback_name(cb)!r} has runs_on={runs_on!r}; "
            f"use one of {', '.join(map(repr, RUNS_ON))}"
        )
    return runs_on


def hooks_of(cb: Any, event: str | None = None) -> list[tuple[str, Hook]]:
    """The (event, hook) pairs of a callback, in a stable order.

    ``event`` given: ``cb`` is a callable registered for that (already resolved) event.
    Otherwise ``cb`` is a callback object (its overridden ``on_<event>`` methods, aliases
    included) or a function named after an event or alias.

    Raises:
        TypeError: a class instead of an instance, an object with no hooks, a function not
            named after an event, or a hook that cannot be called as ``hook(context)``.
        ValueError: an invalid ``runs_on``.
    """
    if isinstance(cb, type):
        raise TypeError(
            f"got the class {cb.__name__}, not an instance: pass an instance, "
            f"e.g. {cb.__name__}() instead of {cb.__name__}"
        )
    runs_on_of(cb)
    name = callback_name(cb)
    if event is not None:
        if not callable(cb):
            raise TypeError(f"register({event!r}, fn) needs a callable, got {type(cb).__name__}")
        return [(event, _hook(name, cb, event, cb))]
    if is_function(cb):
        fn_name = getattr(cb, "__name__", "")
        target = fn_name if fn_name in EVENTS else ALIASES.get(fn_name)
        if target is None:
            guess = suggest_event(fn_name)
            hint = f" (did you mean {guess!r}?)" if guess else ""
            raise TypeError(
                f"function {fn_name!r} is not named after an event{hint}; "
                f"register it with manager.register(event, fn), e.g. register('on_save', fn)"
            )
        return [(target, _hook(name, cb, target, cb))]
    pairs = []
    for attr in (*EVENT_ORDER, *ALIASES):
        fn = getattr(cb, attr, None)
        if fn is None or not callable(fn) or getattr(fn, _NOOP_MARK, False):
            continue
        target = ALIASES.get(attr, attr)
        pairs.append((target, _hook(name, fn, attr, cb)))
    if not pairs:
        raise TypeError(f"{name} ({type(cb).__name__}) has no hooks: {_WHAT_IS_A_CALLBACK}")
    return pairs


def is_function(obj: Any) -> bool:
    """True for functions, methods, builtins and partials (callbacks registered per event)."""
    return (
        inspect.isfunction(obj)
        or inspect.ismethod(obj)
        or inspect.isbuiltin(obj)
        or isinstance(obj, functools.partial)
    )


def _hook(name: str, fn: Callable, event: str, owner: Any) -> Hook:
    return Hook(name, fn, _kwargs_mode(name, fn, event), owner)


def _kwargs_mode(name: str, fn: Callable, event: str) -> bool | frozenset[str]:
    """Which ``fire`` kwargs a hook accepts, decided once from its signature."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: pass the context only
        return False
    try:
        sig.bind(None)
    except TypeError:
        raise TypeError(
            f"hook {event} of {name!r} cannot be called with the context: "
            f"define it as {event}(self, context, **kwargs) (or fn(context, **kwargs))"
        ) from None
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return True
    if params and params[0].kind is not inspect.Parameter.VAR_POSITIONAL:
        params = params[1:]  # the first one receives the context
    named = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return named or False
