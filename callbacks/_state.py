"""Callback state for checkpoints: which callbacks are stateful, and their keys.

Runs in the training process (rank 0 saves, every rank restores) and on the callback actor.
"""

from __future__ import annotations

from typing import Any

from callbacks._callback import TrainerCallback

__all__ = ["assign_state_keys", "is_stateful"]


def is_stateful(cb: Any) -> bool:
    """A callback is stateful when it defines both ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(cb, "state_dict", None)) and callable(
        getattr(cb, "load_state_dict", None)
    )


def assign_state_keys(callbacks: list[Any]) -> list[tuple[str, Any]]:
    """The (state_key, callback) pairs of the stateful callbacks, in order.

    The n-th further instance of a class that keeps the default ``state_key`` gets
    ``"<qualname>#n"``, stored on the instance (deterministic in registration order).

    Raises:
        ValueError: two stateful callbacks end up with the same key.
    """
    pairs: list[tuple[str, Any]] = []
    defaults: list[tuple[TrainerCallback, str]] = []
    seen: dict[str, int] = {}
    for cb in callbacks:
        if not is_stateful(cb):
            continue
        if isinstance(cb, TrainerCallback) and type(cb).state_key is TrainerCallback.state_key:
            base = type(cb).__qualname__
            n = seen[base] = seen.get(base, -1) + 1
            key = base if n == 0 else f"{base}#{n}"
            defaults.append((cb, key))
        else:
            key = getattr(cb, "state_key", None) or type(cb).__qualname__
        pairs.append((key, cb))
    keys = [key for key, _ in pairs]
    clashes = sorted({key for key in keys if keys.count(key) > 1})
    if clashes:
        raise ValueError(
            f"stateful callbacks share the state_key {', '.join(map(repr, clashes))}; "
            "give each a distinct state_key so their checkpoint state does not collide"
        )
    for cb, key in defaults:
        cb._state_key = key
    return pairs
