"""`wait_until`: the one way a test waits for asynchronous work (a file, a process, a report).

Runs in whatever process calls it: the pytest process, a driver script, or a Ray worker, the
callback actor or an evaluation task (through PYTHONPATH, see `support_paths`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], timeout: float, what: str, *, interval: float = 0.1
) -> T:
    """Call `predicate` every `interval` seconds until it returns a truthy value, and return that
    value; once `timeout` seconds have passed without one, fail with an AssertionError that names
    `what` and the timeout. The predicate is always called at least once, and once more at the
    deadline; an exception it raises (a process that exited, say) goes straight to the caller.

    A bounded wait whose outcome the test judges afterwards (rather than failing here) suppresses
    the AssertionError: ``with contextlib.suppress(AssertionError): wait_until(...)``.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(min(interval, left))
