"""Driver and environment actors (tests): the ``multiply`` tool as an environment, with faults.

:class:`Multiplier` is the tool of ``ray_trainer._demo.agents`` (a tiny model warmed up to call
it) as an environment in TRL's shape, with faults that a test arms through files: the first
call of an armed run ends its actor's process, the next one sleeps past any
``tool_timeout_s``. The model and the prompts are re-exported from the demo.
"""

from __future__ import annotations

import os
import signal
import time

from callbacks import TrainerCallback
from ray_trainer._demo.agents import make_tool_model, multiply, product_prompts

__all__ = ["ArmCrash", "Multiplier", "make_tool_model", "multiply", "product_prompts"]


class Multiplier:
    """The ``multiply`` tool as an environment (TRL's shape): ``reset`` keeps the row's answer,
    ``get_reward`` is 1.0 when the tool was called with a product equal to it. With `faults`
    (a folder), the first call of the run ends its actor's process, the second sleeps 60 s
    (past the test's ``tool_timeout_s``), and the first once the folder holds ``armed`` kills
    the training worker whose pid is in ``rank1.pid`` (a crash with episodes in flight); each
    fault happens once, marked by a file there."""

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
    for name, act in (
        ("died", lambda: os._exit(1)),
        ("stuck", lambda: time.sleep(60)),
        ("crashed", lambda: _kill_worker(folder)),
    ):
        if name == "crashed" and not os.path.exists(os.path.join(folder, "armed")):
            return
        try:
            fd = os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.close(fd)
        act()
        return


def _kill_worker(folder: str) -> None:
    with open(os.path.join(folder, "rank1.pid")) as f:
        os.kill(int(f.read()), signal.SIGKILL)


class ArmCrash(TrainerCallback):
    """Every rank, first attempt: rank 1 writes its pid to `folder`'s ``rank1.pid`` as training
    begins; rank 0 writes ``armed`` once the checkpoint of step `step` is saved, so the next
    tool call (step `step` + 1's episodes in flight) kills rank 1 (``Multiplier``)."""

    runs_on = "all_ranks"

    def __init__(self, folder: str, step: int = 1) -> None:
        self.folder, self.step = folder, step

    def on_train_begin(self, context, **kwargs):
        if context.rank == 1 and context.attempt == 0:
            with open(os.path.join(self.folder, "rank1.pid"), "w") as f:
                f.write(str(os.getpid()))

    def on_save(self, context, **kwargs):
        if context.rank == 0 and context.attempt == 0 and context.global_step == self.step:
            open(os.path.join(self.folder, "armed"), "w").close()
