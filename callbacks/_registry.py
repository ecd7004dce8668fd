"""The one module-level registry: global callbacks, added to every manager built afterwards.

Lives in the driver process (where ``with MyCallback(): run_training(...)`` runs); the runner
ships the globals to workers inside its callback list, so workers build managers with
``global_callbacks=[]``.
"""

from __future__ import annotations

import threading
from typing import Any

from callbacks._hooks import hooks_of

__all__ = ["GlobalCallbackHandle", "global_callbacks", "register_global_callback"]

_lock = threading.Lock()
_registry: list[GlobalCallbackHandle] = []  # the explicit global state; see global_callbacks()


class GlobalCallbackHandle:
    """The registration of one global callback; ``remove()`` undoes it (idempotent)."""

    __slots__ = ("callback",)

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def remove(self) -> None:
        """Unregister this callback; later managers will not get it. Safe to call twice."""
        with _lock:
            for i, handle in enumerate(_registry):
                if handle is self:
                    del _registry[i]
                    return

    def __enter__(self) -> GlobalCallbackHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"GlobalCallbackHandle({self.callback!r})"


def register_global_callback(callback: Any) -> GlobalCallbackHandle:
    """Register a callback for every ``CallbackManager`` built from now on (in this process).

    Returns a handle whose ``remove()`` unregisters it. Validated like ``CallbackManager.add``.

    Example:
        >>> handle = register_global_callback(PrintLoss())
        >>> run_training(max_steps=10)  # PrintLoss runs in this run
        >>> handle.remove()
    """
    hooks_of(callback)  # fail now, not in a manager later
    handle = GlobalCallbackHandle(callback)
    with _lock:
        _registry.append(handle)
    return handle


def global_callbacks() -> list[Any]:
    """A copy of the currently registered global callbacks, in registration order."""
    with _lock:
        return [handle.callback for handle in _registry]


def unregister_last(callback: Any) -> None:
    """Remove the most recent registration of ``callback`` (used by ``with callback:``)."""
    with _lock:
        for i in range(len(_registry) - 1, -1, -1):
            if _registry[i].callback is callback:
                del _registry[i]
                return
