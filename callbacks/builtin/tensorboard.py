"""Runs on the callback actor: ``TensorBoardLogger``, scalars as TensorBoard event files."""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

from callbacks.builtin.common import as_float, objective_metrics, throughput_of
from callbacks.builtin.run_files import RunFileLogger

__all__ = ["TensorBoardLogger"]

#: Writer modules, in order of preference: (module with ``SummaryWriter``, packages it needs).
_BACKENDS = (
    ("torch.utils.tensorboard", ("tensorboard", "torch")),
    ("tensorboardX", ("tensorboardX",)),
)


def find_backend() -> str | None:
    """The module whose ``SummaryWriter`` will be used, or None when none is installed."""
    for module, needs in _BACKENDS:
        if all(importlib.util.find_spec(name) is not None for name in needs):
            return module
    return None


class TensorBoardLogger(RunFileLogger):
    """Write scalars for TensorBoard: ``train/*`` at each log, ``eval/*`` at each evaluation.

    Runs on the callback actor (``runs_on="actor"``), so event files are written on the head
    node, by default to ``<storage_path>/<run_name>/tensorboard``. Uses
    ``torch.utils.tensorboard`` when the ``tensorboard`` package is installed, else
    ``tensorboardX`` when that is; constructing it with neither installed raises
    ``ImportError``. Scalars: ``train/loss``, ``train/learning_rate``, ``train/grad_norm``,
    ``train/tokens_per_s`` and ``eval/<metric>`` for every numeric evaluation metric, each at
    its global step. The writer is created on the first event, flushed after each evaluation,
    closed at ``on_train_end``, and never pickled.

    Args:
        log_dir: the event-file directory; default ``<storage_path>/<run_name>/tensorboard``.

    Example:
        >>> run_training(callbacks=[TensorBoardLogger()])
        >>> # then: tensorboard --logdir ~/ray_results
    """

    def __init__(self, log_dir: str | os.PathLike[str] | None = None) -> None:
        backend = find_backend()
        if backend is None:
            raise ImportError(
                "TensorBoardLogger needs the tensorboard package: "
                "pip install 'ray-trainer[tensorboard]' (or pip install tensorboardX)"
            )
        super().__init__(log_dir, "tensorboard")
        self.backend = backend
        self.log_dir = os.fspath(log_dir) if log_dir is not None else None

    @property
    def resolved_log_dir(self) -> str | None:
        """The directory written to (None until known: the run directory comes with events)."""
        return self._resolved

    def on_log(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor at each log: writes the ``train/*`` scalars."""
        throughput = throughput_of(context)
        scalars = {
            "train/loss": context.loss,
            "train/learning_rate": context.learning_rate,
            "train/grad_norm": context.grad_norm,
            "train/tokens_per_s": throughput,
            **{f"train/{k}": v for k, v in objective_metrics(context).items()},
        }
        self._write(context, scalars, context.global_step, flush=False)

    def on_evaluate(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor with each evaluation: writes the ``eval/*`` scalars."""
        scalars = {f"eval/{k}": v for k, v in (context.val_metrics or {}).items()}
        self._write(context, scalars, kwargs.get("eval_step", context.global_step), flush=True)

    # -- internals ---------------------------------------------------------------------------

    def _write(self, context: Any, scalars: dict[str, Any], step: int, flush: bool) -> None:
        if self._writer is None:
            log_dir = self._path_to_open(context, "log_dir")
            writer_class = importlib.import_module(self.backend).SummaryWriter
            self._writer = writer_class(log_dir=log_dir)
        for tag, value in scalars.items():
            number = as_float(value)
            if number is not None:
                self._writer.add_scalar(tag, number, global_step=step)
        if flush:
            self._writer.flush()
            self._sync(force=True)
