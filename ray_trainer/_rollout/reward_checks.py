"""Reward task (or the driving worker): what a reward function returned, checked; its failures worded.

Runs where a reward function is called: a step's reward task (``rewards.call_reward``), or the
process that drives the rollouts when it scores in-process. No Ray, no torch beyond a
one-element tensor's ``float``.

A function returns one reward per completion: a finite number, or None or NaN to abstain (TRL
1.16's "unscorable": it counts for none of the sums). Anything else fails the step with a
:class:`RewardError` naming the function and the row: a value that is not a number, a bool,
``inf`` or ``-inf`` (they would turn the step's rewards and advantages into ``inf`` and NaN,
and train on them), a count other than the step's completions. The message of a failure ends
with one line that says it all (the function, the row, the error): the driver's
``RunFailedError`` quotes a worker's error by its last line.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any


class RewardError(RuntimeError):
    """A reward function failed on a step's completions: the message names the function, the
    row (its completion's index in the step, its prompt's ledger position) and the traceback."""


def checked_rewards(name: str, out: Any, count: int, where: Callable[[int], str]) -> list[float]:
    """`out`, reward function `name`'s return on `count` completions, as floats (None and NaN
    become NaN); `where(i)` names completion `i` in an error.

    Raises:
        RewardError: not one value per completion; a value that is not a number (a bool, a
            string, a tensor of more than one element); ``inf`` or ``-inf``.
    """
    if not isinstance(out, (list, tuple)) or len(out) != count:
        got = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
        raise RewardError(
            f"reward function {name!r} returned {got} for {count} completions; return "
            "a list of one reward (a number, or None to abstain) per completion"
        )
    return [_reward(name, value, i, where) for i, value in enumerate(out)]


def _reward(name: str, value: Any, i: int, where: Callable[[int], str]) -> float:
    if value is None:
        return math.nan
    number = _number(value)
    if number is None:
        raise RewardError(
            f"reward function {name!r} returned {_shown(value)} for {where(i)}; a reward is a "
            "number, or None to abstain"
        )
    if math.isinf(number):
        raise RewardError(
            f"reward function {name!r} returned {number} for {where(i)}; a reward must be "
            "finite (None or NaN abstains, as in TRL): clip it, or return None for a "
            "completion it cannot score"
        )
    return number


def _number(value: Any) -> float | None:
    """`value` as a float, or None when it is no number (a bool is none)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # an int beyond a float: as good as infinite
            return math.inf if value > 0 else -math.inf
    numel = getattr(value, "numel", None)  # a torch tensor of one element
    if callable(numel) and getattr(value, "dtype", None) is not None and numel() == 1:
        return float(value)
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def raised_summary(name: str, error: str, where: str) -> str:
    """The last line of a raising function's error: function, error and row in one line.
    `error` is the traceback's own last line (``ZeroDivisionError: division by zero``)."""
    return f"reward function {name!r} raised {error} on {where}"


def last_line(trace: str) -> str:
    """A formatted traceback's last line: the error's type and message."""
    lines = [line for line in trace.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "an error"


def prompts_of(prompt_index: Sequence[int] | None) -> str:
    """The data's prompts of a step's completions, for a message (``prompts 3, 5 of the
    data``), in ledger order, each once; empty when unknown."""
    if not prompt_index:
        return ""
    rows = sorted(set(prompt_index))
    shown = ", ".join(map(str, rows[:16]))
    if len(rows) > 16:
        shown += f" and {len(rows) - 16} more"
    return f" (prompt{'s' if len(rows) > 1 else ''} {shown} of the data)"
