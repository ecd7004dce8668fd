"""``RunFileLogger``: the base of the built-in loggers that write files of a run.

Runs where the logger runs (the callback actor, by default). It resolves where the logger
writes (an explicit path, else a name inside ``<storage_path>/<run_name>``, learned from the
first event that carries the run's args) and keeps the open writer out of the pickle.
"""

from __future__ import annotations

import os
from typing import Any

from callbacks._builtin_common import run_dir_of
from callbacks._callback import TrainerCallback

__all__ = ["RunFileLogger"]


class RunFileLogger(TrainerCallback):
    """Base class: ``JsonlLogger`` and ``TensorBoardLogger`` write a file (or a folder) of the
    run, opened lazily where the callback runs and closed at ``on_train_end``.

    Subclasses set ``_writer_attr`` (the attribute holding the open file or writer, never
    pickled) and call ``_resolve(context)`` to learn the path.

    Args:
        target: the path to write; ``None`` for ``<storage_path>/<run_name>/<name_in_run_dir>``.
        name_in_run_dir: the file or folder name inside the run directory.
    """

    _writer_attr = "_writer"

    def __init__(self, target: str | os.PathLike[str] | None, name_in_run_dir: str) -> None:
        self._target = os.fspath(target) if target is not None else None
        self._name_in_run_dir = name_in_run_dir
        self._resolved: str | None = None
        setattr(self, self._writer_attr, None)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state[self._writer_attr] = None  # an open file cannot travel; reopened where it runs
        return state

    def on_train_begin(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor before training: learns the run directory."""
        self._resolve(context)

    def _resolve(self, context: Any) -> str | None:
        """The path written to: the explicit one, else inside the run directory (None while
        no event has carried the run's args)."""
        if self._resolved is None:
            if self._target is not None:
                self._resolved = os.path.abspath(os.path.expanduser(self._target))
            else:
                run_dir = run_dir_of(context)
                if run_dir is not None:
                    self._resolved = os.path.join(run_dir, self._name_in_run_dir)
        return self._resolved
