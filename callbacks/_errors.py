"""Recording callback failures: bounded in memory, rate-limited in the log.

Used by a ``CallbackManager`` in whichever process it runs; thread-safe (the asynchronous
dispatcher records from its own thread).
"""

from __future__ import annotations

import logging
import threading
import traceback as tb
from dataclasses import dataclass

__all__ = ["CallbackError"]

logger = logging.getLogger("callbacks")

#: Tracebacks logged per (callback, event) before switching to periodic summaries.
FULL_LOGS = 3
#: After that, one summary line every this many occurrences.
SUMMARY_EVERY = 100


@dataclass(frozen=True)
class CallbackError:
    """One failure of a callback: an exception, a bad return value or a dispatcher timeout.

    Args:
        callback: the callback's name (``"<dispatcher>"`` for a dispatcher timeout).
        event: the event being handled.
        step: ``context.global_step`` at the event, when known.
        error: ``"ExceptionType: message"``.
        traceback: the formatted traceback (empty when there is none).
    """

    callback: str
    event: str
    step: int | None
    error: str
    traceback: str


class ErrorLog:
    """Keeps the first ``max_errors`` records and counts every occurrence."""

    def __init__(self, max_errors: int = 1000) -> None:
        self.max_errors = max_errors
        self._lock = threading.Lock()
        self._errors: list[CallbackError] = []
        self._counts: dict[tuple[str, str], int] = {}

    @property
    def errors(self) -> list[CallbackError]:
        with self._lock:
            return list(self._errors)

    @property
    def counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def record_exception(
        self, callback: str, event: str, step: int | None, exc: BaseException
    ) -> None:
        text = "".join(tb.format_exception(type(exc), exc, exc.__traceback__))
        self.record(callback, event, step, f"{type(exc).__name__}: {exc}", text)

    def record(
        self, callback: str, event: str, step: int | None, error: str, traceback: str = ""
    ) -> None:
        key = (callback, event)
        with self._lock:
            count = self._counts[key] = self._counts.get(key, 0) + 1
            if len(self._errors) < self.max_errors:
                self._errors.append(CallbackError(callback, event, step, error, traceback))
        if count <= FULL_LOGS:
            last = " (further ones are counted, and summarised every 100)" if count == 3 else ""
            logger.error(
                "callback %r failed in %s at step %s: %s%s\n%s",
                callback, event, step, error, last, traceback.rstrip(),
            )  # fmt: skip
        elif count % SUMMARY_EVERY == 0:
            logger.error(
                "callback %r failed in %s %d times so far (latest at step %s: %s)",
                callback, event, count, step, error,
            )  # fmt: skip
