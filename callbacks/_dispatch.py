"""The ordered asynchronous dispatcher and the runner for ``async def`` hooks.

``AsyncDispatcher`` is used by an ``AsyncCallbackManager``, i.e. on the callback actor:
``fire`` enqueues and returns; one background thread handles the events one at a time, in the
order they were fired, and runs ``async def`` hooks on an event loop it owns.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["AsyncDispatcher", "CoroutineRunner"]


class CoroutineRunner:
    """Runs the awaitable an ``async def`` hook returned, to completion, from synchronous code.

    Uses its own event loop in the calling thread; when that thread already runs a loop (or
    another thread is using ours), runs the awaitable on a short-lived helper thread instead.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def run(self, awaitable: Awaitable[Any], timeout: float | None = None) -> Any:
        """Run ``awaitable`` to completion; past ``timeout`` seconds it is cancelled and
        ``asyncio.TimeoutError`` is raised."""
        if timeout is not None:
            awaitable = asyncio.wait_for(_wrap(awaitable), timeout)
        if not _loop_running() and self._lock.acquire(blocking=False):
            try:
                if self._loop is None or self._loop.is_closed():
                    self._loop = asyncio.new_event_loop()
                    # an unclosed manager must not leak the loop's sockets
                    weakref.finalize(self, self._loop.close)
                return self._loop.run_until_complete(awaitable)
            finally:
                self._lock.release()
        return _run_in_helper_thread(awaitable)

    def close(self) -> None:
        with self._lock:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.close()


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def _wrap(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def _run_in_helper_thread(awaitable: Awaitable[Any]) -> Any:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = asyncio.run(_wrap(awaitable))
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name="callbacks-async-hook", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


class AsyncDispatcher:
    """A bounded FIFO of events and the one thread that handles them in order.

    Args:
        handle: called on the dispatcher thread with each item, one at a time.
        max_queue: queue bound; see ``submit`` for what happens when it is full.
    """

    def __init__(self, handle: Callable[[Any], None], max_queue: int) -> None:
        self._handle = handle
        self._max_queue = max_queue
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._submitted = 0  # sequence number of the last event enqueued
        self._done = 0  # sequence number of the last event handled
        self._stopping = False
        self.dropped: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="callbacks-dispatcher", daemon=True)
        self._thread.start()

    @property
    def on_dispatcher_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, event: str, item: Any, droppable: bool) -> int | None:
        """Enqueue ``item``; return its sequence number, or None when dropped or stopped.

        When the queue is full, a ``droppable`` event is dropped and counted in ``dropped``;
        any other event waits for room.
        """
        with self._cond:
            while len(self._queue) >= self._max_queue and not self._stopping:
                if droppable or self.on_dispatcher_thread:  # the thread cannot wait for itself
                    self.dropped[event] = self.dropped.get(event, 0) + 1
                    return None
                self._cond.wait()
            if self._stopping:
                return None
            self._submitted += 1
            self._queue.append(item)
            self._cond.notify_all()
            return self._submitted

    def wait_for(self, seq: int | None = None, timeout: float | None = None) -> bool:
        """Wait until event ``seq`` (default: the last enqueued) and all before it are handled."""
        if self.on_dispatcher_thread:
            return False  # would wait for itself
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._submitted if seq is None else seq
            while self._done < target:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                if not self._thread.is_alive():
                    return False
                self._cond.wait(remaining)
            return True

    def pending(self) -> int:
        with self._cond:
            return self._submitted - self._done

    def stop(self, timeout: float | None) -> bool:
        """Stop the thread once the queue is empty; True when it ended within ``timeout``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if not self.on_dispatcher_thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return  # stopping and drained
                item = self._queue.popleft()
                self._cond.notify_all()  # room for a producer waiting on a full queue
            try:
                self._handle(item)
            finally:
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()
