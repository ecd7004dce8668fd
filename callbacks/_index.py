"""The per-event index through which a ``CallbackManager`` dispatches.

Built once per ``add``/``register``/``remove`` so that ``fire`` does a single dict lookup: every
event and alias maps to a tuple of hooks, empty when nobody subscribes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from callbacks._events import ALIASES, EVENT_ORDER, EVENTS
from callbacks._hooks import Hook, callback_name
from callbacks._state import assign_state_keys

__all__ = ["BARRIER", "CLOSED_INDEX", "Index", "Registration", "build_index"]

#: Asynchronous mode: on_train_end always reaches the dispatcher (it is the end barrier).
BARRIER: tuple = (None,)
#: Installed by ``close()``: every name maps to no hooks, so ``fire`` becomes a no-op.
CLOSED_INDEX: dict[str, tuple] = {name: () for name in (*EVENTS, *ALIASES)}


class Registration:
    """One ``add``/``register`` call: the object or function and its (event, hook) pairs."""

    __slots__ = ("is_object", "owner", "pairs")

    def __init__(self, owner: Any, pairs: list[tuple[str, Hook]], is_object: bool) -> None:
        self.owner = owner
        self.pairs = pairs
        self.is_object = is_object

    def matches(self, target: Any) -> bool:
        """Whether ``remove(target)`` removes this registration."""
        if isinstance(target, type):
            return self.is_object and isinstance(self.owner, target)
        # functions compare with ==: a bound method is a new object each time it is looked up
        return self.owner is target or (not self.is_object and self.owner == target)


class Index(NamedTuple):
    dispatch: dict[str, tuple]  # every event and alias -> hooks (what fire looks up)
    subscribed: dict[str, tuple]  # every event -> its hooks, in call order
    events: frozenset[str]  # events with at least one hook
    registrations: list[Registration]  # in call order: core, user, global
    stateful: list[tuple[str, Any]]  # (state_key, callback)


def build_index(
    core: list[Registration],
    user: list[Registration],
    global_: list[Registration],
    *,
    end_barrier: bool,
) -> Index:
    """Order the hooks (core, user as added, then globals not already present) per event.

    Raises:
        ValueError: a callback added twice for the same event, or clashing state keys.
    """
    seen: set[tuple[int, str]] = set()
    for reg in (*core, *user):
        keys = {(id(reg.owner), event) for event, _ in reg.pairs}
        twice = sorted(event for _, event in keys & seen)
        if twice:
            raise ValueError(f"{callback_name(reg.owner)} is already added for {twice[0]}")
        seen |= keys
    regs = [*core, *user]
    owned = {id(reg.owner) for reg in regs}
    for reg in global_:  # a global callback also in the list (or registered twice) runs once
        if id(reg.owner) not in owned:
            owned.add(id(reg.owner))
            regs.append(reg)
    stateful = assign_state_keys([reg.owner for reg in regs if reg.is_object])
    buckets: dict[str, list[Hook]] = {event: [] for event in EVENT_ORDER}
    for reg in regs:
        for event, hook in reg.pairs:
            buckets[event].append(hook)
    subscribed = {event: tuple(hooks) for event, hooks in buckets.items()}
    dispatch = dict(subscribed)
    if end_barrier and not dispatch["on_train_end"]:
        dispatch["on_train_end"] = BARRIER
    for alias, event in ALIASES.items():
        dispatch[alias] = dispatch[event]
    events = frozenset(event for event, hooks in subscribed.items() if hooks)
    return Index(dispatch, subscribed, events, regs, stateful)
