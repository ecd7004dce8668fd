"""Training worker: the step's one all-reduce of control, loss and tokens across ranks.

Runs in each training worker, once per optimizer step. Every rank must start this collective
at the same point of the step (just before its last micro-batch's backward), so that it runs
while backward and the optimizer step compute; the loop reads the result at the boundary. The
control travels as a ``TrainerControl``: encoded into numbers here, summed over ranks, decoded
back here. A flag set on any rank is set on every rank after the sum.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from callbacks import TrainerControl

#: The ``TrainerControl`` flags, in the order they ride in the all-reduce after loss and tokens.
FLAGS: tuple[str, ...] = (
    "should_training_stop",
    "should_save",
    "should_evaluate",
    "should_log",
    "should_abort",
)
_LOSS, _TOKENS, _FIRST_FLAG = 0, 1, 2


def encode(control: TrainerControl) -> list[float]:
    """The flags of ``control`` as numbers (1.0 set, 0.0 not)."""
    return [1.0 if getattr(control, flag) else 0.0 for flag in FLAGS]


def decode(values: list[float]) -> TrainerControl:
    """The control whose flags are set where the summed ``values`` are positive."""
    return TrainerControl(**{flag: values[i] > 0 for i, flag in enumerate(FLAGS)})


class Agreement:
    """The step's all-reduce of ``[loss, tokens, *flags]``, summed over ranks, in flight; and
    this rank's own requests that went into it."""

    def __init__(
        self, loss_sum: Any, tokens: Any, requested: TrainerControl, device: Any, world: int
    ) -> None:
        self.requested = requested
        values = torch.tensor([0.0, 0.0, *encode(requested)], dtype=torch.float64, device=device)
        values[_LOSS] = loss_sum
        values[_TOKENS] = tokens
        self.values = values
        # Asynchronous: the loop does not wait here (a blocking all-reduce at the boundary cost
        # 3-5% of a 50 ms step). All ranks must reach this collective.
        self.work = dist.all_reduce(values, async_op=True) if world > 1 else None

    def result(self) -> tuple[float, float, TrainerControl]:
        """(summed loss, summed tokens, agreed control); waits if the all-reduce still runs
        (it rarely does: it overlapped backward and the optimizer step)."""
        if self.work is not None:
            self.work.wait()
        values = self.values.tolist()  # on a GPU, a CPU-GPU sync point
        return values[_LOSS], values[_TOKENS], decode(values[_FIRST_FLAG:])
