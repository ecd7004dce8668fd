"""Driver and environment actors (tests): the ``multiply`` tool as an environment, with faults.

:class:`Multiplier` is the tool of ``ray_trainer._demo.agents`` (a tiny model warmed up to call
it) as an environment in TRL's shape, with faults that a test arms through files: the first
call of an armed run ends its actor's process, the next one sleeps past any
``tool_timeout_s``. The model and the prompts are re-exported from the demo.
"""

from __future__ import annotations

import os
import time

from ray_trainer._demo.agents import make_tool_model, multiply, product_prompts

__all__ = ["Multiplier", "make_tool_model", "multiply", "product_prompts"]


class Multiplier:
    """The ``multiply`` tool as an environment (TRL's shape): ``reset`` keeps the row's answer,
    ``get_reward`` is 1.0 when the tool was called with a product equal to it. With `faults`
    (a folder), the first call of the run ends its actor's process, the second sleeps 60 s
    (past the test's ``tool_timeout_s``); each fault happens once, marked by a file there."""

    def __init__(self, faults: str | None = None):
        self.faults = faults
        self.answer = None
        self.product = None

    def reset(self, answer: str = "", **kwargs) -> str | None:
        self.answer, self.product = answer, None
        return None

    def multiply(self, a: int, b: int) -> int:
        """Multiply two whole numbers.

        Args:
            a: The first number.
            b: The second number.

        Returns:
            Their product.
        """
        if self.faults:
            _fault_once(self.faults)
        self.product = a * b
        return self.product

    def get_reward(self) -> float:
        return 1.0 if str(self.product) == self.answer else 0.0


def _fault_once(folder: str) -> None:
    for name, act in (("died", lambda: os._exit(1)), ("stuck", lambda: time.sleep(60))):
        try:
            fd = os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.close(fd)
        act()
        return
