"""The event names of the training loop, their aliases, and name resolution.

Pure data and string helpers: importable in any process (driver, worker, actor).
"""

from __future__ import annotations

import difflib

__all__ = [
    "ALIASES",
    "EVENTS",
    "LOW_VALUE_EVENTS",
    "NEVER_DROPPED_EVENTS",
    "resolve_event",
]

#: Every event the training loop fires, in the order a run usually meets them.
EVENT_ORDER: tuple[str, ...] = (
    "on_init_end",
    "on_train_begin",
    "on_epoch_begin",
    "on_step_begin",
    "on_before_forward",
    "on_after_forward",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_after_optimizer_step",
    "on_log",
    "on_evaluate",
    "on_save",
    "on_load_checkpoint",
    "on_step_end",
    "on_epoch_end",
    "on_train_end",
    "on_exception",
)
EVENTS: frozenset[str] = frozenset(EVENT_ORDER)

#: Names accepted for code ported from elsewhere, in ``register`` and as hook method names.
ALIASES: dict[str, str] = {
    "on_pre_optimizer_step": "on_before_optimizer_step",
    "on_optimizer_step": "on_after_optimizer_step",
    "on_checkpoint": "on_save",
    "on_validation_loss": "on_evaluate",
}

#: Events a full queue may drop (counted, never silently): frequent, and the next one supersedes.
LOW_VALUE_EVENTS: frozenset[str] = frozenset(
    {
        "on_log",
        "on_step_begin",
        "on_step_end",
        "on_before_forward",
        "on_after_forward",
        "on_before_backward",
        "on_after_backward",
    }
)

#: Events that are always delivered: a forwarding policy waits for room rather than drop these.
NEVER_DROPPED_EVENTS: frozenset[str] = frozenset(
    {
        "on_save",
        "on_evaluate",
        "on_train_begin",
        "on_train_end",
        "on_exception",
        "on_load_checkpoint",
    }
)

_ALL_NAMES = tuple(EVENT_ORDER) + tuple(ALIASES)


def suggest_event(name: str, cutoff: float = 0.6) -> str | None:
    """The event or alias closest to ``name`` (difflib), or None when nothing is close."""
    matches = difflib.get_close_matches(name, _ALL_NAMES, n=1, cutoff=cutoff)
    return matches[0] if matches else None


def unknown_event_message(name: object) -> str:
    """An error message for an unknown event name, with a did-you-mean and the valid names."""
    guess = suggest_event(name) if isinstance(name, str) else None
    hint = f"; did you mean {guess!r}?" if guess else ""
    aliases = ", ".join(f"{a} (= {e})" for a, e in ALIASES.items())
    return (
        f"unknown event {name!r}{hint} Valid events: {', '.join(EVENT_ORDER)}. Aliases: {aliases}."
    )


def resolve_event(name: str) -> str:
    """Return the event ``name`` stands for (itself, or the event of an alias).

    Raises:
        ValueError: ``name`` is neither an event nor an alias; the message lists the valid
            events and the closest match.
    """
    if not isinstance(name, str):
        raise ValueError(unknown_event_message(name))
    if name in EVENTS:
        return name
    event = ALIASES.get(name)
    if event is None:
        raise ValueError(unknown_event_message(name))
    return event
