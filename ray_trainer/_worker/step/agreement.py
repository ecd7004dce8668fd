"""Training worker: the step's one all-reduce of control, loss and token counts across ranks.

Runs in each training worker, once per optimizer step. Every rank starts this collective at the
same point of the step (just before its last micro-batch's backward), so that it runs while
backward and the optimizer step compute. The control travels as a ``TrainerControl``: encoded
into numbers here, summed over ranks, decoded back here; a flag set on any rank is set on every
rank after the sum.

Reading the result must not stall the CPU behind the GPU: on a GPU the summed values reach
pinned host memory through a non-blocking copy on a side stream, ordered after the all-reduce
only, with an event; the loop reads a step's agreement one step later (by then the copy is long
done), and at once only where it must (log, evaluation, save and stop boundaries: see
``loop.after_boundary``). On a CPU (gloo) the values are already in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from callbacks import TrainerControl

#: The ``TrainerControl`` flags, in the order they ride in the all-reduce after the numbers.
FLAGS: tuple[str, ...] = (
    "should_training_stop",
    "should_save",
    "should_evaluate",
    "should_log",
    "should_abort",
)
_LOSS, _TARGETS, _TOKENS, _POSITIONS, _FIRST_FLAG = 0, 1, 2, 3, 4


def encode(control: TrainerControl) -> list[float]:
    """The flags of ``control`` as numbers (1.0 set, 0.0 not)."""
    return [1.0 if getattr(control, flag) else 0.0 for flag in FLAGS]


def decode(values: list[float]) -> TrainerControl:
    """The control whose flags are set where the summed ``values`` are positive."""
    return TrainerControl(**{flag: values[i] > 0 for i, flag in enumerate(FLAGS)})


@dataclass(frozen=True)
class Agreed:
    """A step's values summed over every rank."""

    loss_sum: float  # the micro-batches' token-loss sums over `norm`, summed over ranks
    targets: float  # labels the model scored (the loss's denominator)
    tokens: float  # sample tokens: not padding, not filler
    positions: float  # every position of every batch, padding included
    control: TrainerControl
    extra: tuple[float, ...] = ()  # numbers of the loop's own, summed (async_save.py's)
    sums: tuple[float, ...] = ()  # the objective's metric sums (DPO's), summed over ranks


class Agreement:
    """The step's all-reduce of ``[loss, targets, tokens, positions, *flags, *extra, *sums]``,
    in flight; and this rank's own requests that went into it. Read once with `result`; the
    gradients' scale (`scale`) is read from it on the device, before the optimizer step.
    `extra` are numbers of the loop's own that every rank must agree on too (asynchronous
    checkpoints: which save each rank has written), summed like the rest; `sums` are the
    objective's own device values (DPO's metric sums over the step's pairs)."""

    def __init__(
        self,
        loss_sum: Any,
        counts: list[int],
        requested: TrainerControl,
        device: Any,
        world: int,
        copy_stream: Any = None,
        extra: tuple[float, ...] = (),
        sums: torch.Tensor | None = None,
    ) -> None:
        self.requested = requested
        self.world = world
        flags = encode(requested)
        self.n_sums = 0 if sums is None else sums.numel()
        # Built on the host, then copied without blocking: ``torch.tensor(..., device=cuda)``
        # copies from pageable memory and waits for the stream, i.e. for this step's whole
        # forward, every step. From pinned memory the copy is queued like a kernel.
        on_gpu = torch.device(device).type == "cuda"
        host = torch.tensor(
            [0.0, *map(float, counts), *flags, *extra, *[0.0] * self.n_sums],
            dtype=torch.float64,
            pin_memory=on_gpu,
        )
        values = host.to(device, non_blocking=True)
        values[_LOSS] = loss_sum  # a device tensor: no sync
        if sums is not None:  # device values too (DPO's metric sums): no sync
            values[values.numel() - self.n_sums :] = sums
        self.values = values
        # All ranks must reach this collective. Asynchronous: the loop does not wait here.
        self.work = dist.all_reduce(values, async_op=True) if world > 1 else None
        self._host: torch.Tensor | None = None
        self._event: Any = None
        if copy_stream is not None:
            self._copy_to_host(values, copy_stream)
        self._agreed: Agreed | None = None
        self.recorded = False  # its numbers went into the progress and the log window

    def _copy_to_host(self, values: torch.Tensor, stream: Any) -> None:
        """Queue the copy to pinned host memory on a side stream that waits for the
        all-reduce only (not for the backward and optimizer kernels queued after it)."""
        stream.wait_stream(torch.cuda.current_stream(values.device))  # values were written there
        with torch.cuda.stream(stream):
            if self.work is not None:
                self.work.wait()  # this stream waits for the all-reduce; the CPU does not
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(stream)
        values.record_stream(stream)

    def scale(self, norm: float) -> torch.Tensor:
        """The factor that turns every rank's summed gradients of token-loss sums over `norm`
        into the gradient of the mean over the global batch's targets: norm x world / targets.
        A device tensor: on a GPU the stream waits for the all-reduce, the CPU does not."""
        if self.work is not None:
            self.work.wait()  # queued before the gradients' own all-reduce: done by now
        targets = self.values[_TARGETS].clamp(min=1.0)
        return (norm * self.world / targets).to(torch.float32)

    def result(self) -> Agreed:
        """The summed values. Waits for this agreement alone: on a GPU for its copy to host
        (done long ago when read one step late), on a CPU for the all-reduce."""
        if self._agreed is None:
            if self._event is not None:
                self._event.synchronize()
                values = self._host.tolist()
            else:
                if self.work is not None:
                    self.work.wait()
                values = self.values.tolist()
            end, last = _FIRST_FLAG + len(FLAGS), len(values) - self.n_sums
            self._agreed = Agreed(
                values[_LOSS], values[_TARGETS], values[_TOKENS], values[_POSITIONS],
                decode(values[_FIRST_FLAG:end]), tuple(values[end:last]), tuple(values[last:]),
            )  # fmt: skip
        return self._agreed


class SoloAgreement(Agreement):
    """One rank on a CPU: nothing to sum over ranks, and the numbers are on the host already,
    so the step's agreement is the rank's own numbers as they are. No tensor is built, written
    or read back (what a host-bound step spends on that: ``bench/runner/bench_host_step.py``);
    the values are those `Agreement` would give: the loss read once, when the result is read."""

    def __init__(
        self,
        loss_sum: Any,
        counts: list[int],
        requested: TrainerControl,
        extra: tuple[float, ...] = (),
        sums: torch.Tensor | None = None,
    ) -> None:
        self.requested = requested
        self.world = 1
        self.work = None
        self._loss_sum, self._counts, self._extra, self._sums = loss_sum, counts, extra, sums
        self._agreed: Agreed | None = None
        self.recorded = False

    def scale(self, norm: float) -> float:  # type: ignore[override]
        """The gradients' factor as a host float (`scale_and_clip_` multiplies by it as the
        all-reduce's float32 tensor would, and skips a factor of exactly 1)."""
        return norm / max(self._counts[0], 1)

    def result(self) -> Agreed:
        if self._agreed is None:
            targets, tokens, positions = map(float, self._counts)
            sums = () if self._sums is None else tuple(self._sums.double().tolist())
            self._agreed = Agreed(
                float(self._loss_sum), targets, tokens, positions,
                decode(encode(self.requested)), tuple(map(float, self._extra)), sums,
            )  # fmt: skip
        return self._agreed


def agree(
    loss_sum: Any,
    counts: list[int],
    requested: TrainerControl,
    device: Any,
    world: int,
    copy_stream: Any = None,
    extra: tuple[float, ...] = (),
    sums: torch.Tensor | None = None,
) -> Agreement:
    """The step's agreement: `SoloAgreement` for one rank on a CPU, else the all-reduce. (One
    GPU rank keeps the all-reduce's host copy: reading a device loss directly would wait for the
    next step's queued kernels.)"""
    if world == 1 and torch.device(device).type == "cpu":
        return SoloAgreement(loss_sum, counts, requested, extra, sums)
    return Agreement(loss_sum, counts, requested, device, world, copy_stream, extra, sums)
