"""Runs on the callback actor (where its logger runs): ``RunFileLogger``, the file loggers' base.

The base of the built-in loggers that write files of a run. It resolves where the logger
writes (an explicit local path; else a name inside the run folder on the run's storage, learned
from the first event) and keeps the open writer out of the pickle. On the callback actor the
context carries ``run_storage``: the file is then written where the actor can (in place on
local or shared storage, a working copy for a bucket) and ``_sync`` puts it on the run's
storage; without it (tests, worker-side use) the file goes to ``<storage_path>/<run_name>``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from callbacks._callback import TrainerCallback
from callbacks.builtin.common import run_dir_of

__all__ = ["RunFileLogger"]

#: At most one upload of a logger's file per this many seconds between the forced ones.
SYNC_EVERY_S = 30.0


class RunFileLogger(TrainerCallback):
    """Base class: ``JsonlLogger`` and ``TensorBoardLogger`` write a file (or a folder) of the
    run, opened lazily where the callback runs and closed (``close``) at ``on_train_end``.

    Subclasses set ``_writer_attr`` (the attribute holding the open file or writer, anything
    with a ``close()``, never pickled), call ``_resolve(context)`` to learn the path, and
    ``_sync()`` after writing.

    Args:
        target: the local path to write; ``None`` for ``<name_in_run_dir>`` in the run folder.
        name_in_run_dir: the file or folder name inside the run folder.
    """

    _writer_attr = "_writer"

    def __init__(self, target: str | os.PathLike[str] | None, name_in_run_dir: str) -> None:
        self._target = os.fspath(target) if target is not None else None
        self._name_in_run_dir = name_in_run_dir
        self._resolved: str | None = None
        self._storage: Any = None  # the actor's RunStorage, when it provided one
        self._last_sync = 0.0
        setattr(self, self._writer_attr, None)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state[self._writer_attr] = None  # an open file cannot travel; reopened where it runs
        state["_storage"] = None
        return state

    def on_train_begin(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor before training: learns the run directory."""
        self._resolve(context)

    def on_train_end(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor once at the end: closes the file or writer (and puts
        it on the run's storage)."""
        self.close()
        self._sync(force=True)

    def close(self) -> None:
        """Flush and close the file or writer (a later event opens it again: a file in append
        mode, a TensorBoard writer as a new event file)."""
        writer = getattr(self, self._writer_attr)
        if writer is not None:
            writer.close()
            setattr(self, self._writer_attr, None)

    @property
    def storage_path(self) -> str | None:
        """Where the file ends up (a local path or a URI; None until known)."""
        if self._storage is not None:
            return self._storage.uri(self._name_in_run_dir)
        return self._resolved

    def _resolve(self, context: Any) -> str | None:
        """The local path written to: the explicit one, else in the run folder (None while no
        event has carried the run's args)."""
        if self._resolved is None:
            storage = getattr(context, "run_storage", None)
            if self._target is not None:
                self._resolved = os.path.abspath(os.path.expanduser(self._target))
            elif storage is not None:
                self._storage = storage
                self._resolved = storage.local_path(self._name_in_run_dir)
            else:
                run_dir = run_dir_of(context)
                if run_dir is not None:
                    self._resolved = os.path.join(run_dir, self._name_in_run_dir)
        return self._resolved

    def _path_to_open(self, context: Any, argument: str) -> str:
        """The local path to open now (`_resolve`'s); a ``RuntimeError`` naming the fix (the
        constructor's `argument`) when none was given and no event has carried the run's args."""
        path = self._resolve(context)
        if path is None:
            cls = type(self).__name__
            raise RuntimeError(
                f"{cls}: no {argument} given and the context has no args['storage_path'] and "
                f"run_name to put {self._name_in_run_dir} in; pass {cls}({argument}=...)"
            )
        return path

    def _sync(self, force: bool = False) -> None:
        """Put the file on the run's storage: at once when ``force``, else at most every
        ``SYNC_EVERY_S`` seconds (nothing to do on local storage)."""
        if self._storage is None:
            return
        now = time.monotonic()
        if force or now - self._last_sync >= SYNC_EVERY_S:
            self._last_sync = now
            self._storage.sync(self._name_in_run_dir)
