"""Environments and tools for the tests of multi-turn GRPO's environment actors.

Run in the pytest process (as plain objects) and in the environment actors that the integration
tests start, which import them from this module by name (tests/support is on their PYTHONPATH).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time


class Counter:
    """An environment written as in TRL's docs: one tool, and a reward of its own."""

    def __init__(self):
        self.total = 0
        self.seen: dict = {}

    def reset(self, **kwargs) -> str | None:
        self.total = 0
        self.seen = dict(kwargs)
        start = kwargs.get("start")
        return None if start is None else f"Start from {start}."

    def add(self, n: int) -> int:
        """Add a number to the running total.

        Args:
            n: The number to add.

        Returns:
            The new total.
        """
        self.total += n
        return self.total

    def fail(self, why: str) -> None:
        """Raise, with `why` as the error."""
        raise ValueError(why)

    async def add_later(self, n: int) -> int:
        """Add a number after awaiting (an async tool)."""
        await asyncio.sleep(0)
        self.total += n
        return self.total

    @property
    def doubled(self) -> int:  # a property is no tool, and never evaluated to list the tools
        raise AssertionError("a property was evaluated")

    def _private(self) -> None:
        """Not a tool."""

    def get_reward(self) -> float:
        return float(self.total)


class Locked(Counter):
    """A Counter holding a lock: it cannot be pickled, so its episode has no snapshot."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


class NoReward:
    """An environment with no reward of its own."""

    def reset(self, **kwargs) -> str:
        return "ready"

    def where(self) -> int:
        """The process this environment runs in."""
        return os.getpid()


class Sleeper:
    """An environment whose tool sleeps: overlapping calls, a kill in flight, a timeout."""

    def __init__(self):
        self.napping = 0

    def reset(self, **kwargs) -> None:
        if kwargs.get("fail"):
            raise ValueError(f"bad row: {kwargs}")
        return None

    def nap(self, seconds: float) -> float:
        """Sleep, then answer the seconds slept."""
        self.napping += 1
        time.sleep(seconds)
        return seconds

    def naps(self) -> int:
        """How many naps have begun (another call of the episode, answered while one sleeps)."""
        return self.napping

    def where(self) -> int:
        """The process this environment runs in."""
        return os.getpid()


def shout(text: str) -> str:
    """A standalone tool.

    Args:
        text: What to shout.
    """
    return text.upper()


async def whisper(text: str) -> str:
    """A standalone async tool."""
    await asyncio.sleep(0)
    return text.lower()
