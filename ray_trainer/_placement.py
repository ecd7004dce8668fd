"""Every process: which callbacks run where, and building the manager for one process.

Runs in the driver (to split subscriptions), in each training worker and in the callback actor.
The driver ships one cloudpickled dict ``{"core": [...], "user": [...], "global": [...]}``; a
user entry is a callback object or an ``(event, function)`` pair from a flat ``on_<event>`` field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from callbacks import CallbackManager
from callbacks._hooks import runs_on_of
from callbacks._serialize import dumps_callbacks, loads_callbacks

CallbackLists = dict[str, list[Any]]


def _where(item: Any) -> str:
    return runs_on_of(item[1] if isinstance(item, tuple) else item)


def keep_for_worker(rank: int, actor_available: bool = True) -> Callable[[Any], bool]:
    """Which entries a training worker of `rank` runs (actor-side ones go to rank 0 only when
    there is no callback actor; every run has one, so only tools use `actor_available=False`)."""

    def keep(item: Any) -> bool:
        where = _where(item)
        if where == "all_ranks":
            return True
        if where == "rank0":
            return rank == 0
        return rank == 0 and not actor_available  # no actor: actor-side callbacks run on rank 0

    return keep


def keep_for_actor(item: Any) -> bool:
    return _where(item) == "actor"


def build_manager(
    lists: CallbackLists,
    keep: Callable[[Any], bool],
    manager_class: type[CallbackManager] = CallbackManager,
    **kwargs: Any,
) -> CallbackManager:
    """A manager over the entries `keep` selects, in contract order: core, user, global
    (`manager_class`: the actor passes `AsyncCallbackManager`)."""
    manager = manager_class(
        core=[c for c in lists["core"] if keep(c)],
        global_callbacks=[c for c in lists["global"] if keep(c)],
        **kwargs,
    )
    for item in lists["user"]:
        if not keep(item):
            continue
        if isinstance(item, tuple):
            manager.register(item[0], item[1])
        else:
            manager.add(item)
    return manager


def subscribed_events(lists: CallbackLists, keep: Callable[[Any], bool]) -> frozenset[str]:
    """Events some selected callback subscribes to (known before training starts)."""
    return build_manager(lists, keep).subscribed_events


def pack(lists: CallbackLists) -> bytes:
    """Cloudpickle the three lists for `ray.put` (driver side)."""
    return dumps_callbacks([lists["core"], lists["user"], lists["global"]])


def unpack(data: bytes) -> CallbackLists:
    """The inverse of `pack` (in a worker or the callback actor)."""
    core, user, global_ = loads_callbacks(data)
    return {"core": core, "user": user, "global": global_}
