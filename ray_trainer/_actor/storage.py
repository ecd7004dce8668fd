"""In the callback actor: where actor-side callbacks write the run's own files.

Runs in the callback actor process. ``JsonlLogger``, ``TensorBoardLogger`` and ``WandbLogger``
write ``metrics.jsonl``, event files and W&B's files into the run folder; they get a
``RunStorage`` as ``context.run_storage`` (which also gives the trackers a local copy of a
checkpoint's ``hf/`` to upload). On local (or shared) storage a file is written in place; on a bucket
it is written to a local working copy that ``sync`` uploads whole (an object store cannot
append), so every file of the run ends up on the run's storage.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from ray_trainer._storage import local_copy, locate


class RunStorage:
    """The run folder on storage, for callbacks that write files of their own."""

    def __init__(self, run_dir: str, filesystem: Any = None) -> None:
        self.run = locate(run_dir, filesystem)
        self.filesystem = filesystem
        self._work_dir: str | None = None

    def local_path(self, name: str) -> str:
        """Where to write `name` (a file or folder of the run) on this machine."""
        target = self.run.child(name)
        if target.is_local:
            return target.path
        if self._work_dir is None:
            self._work_dir = tempfile.mkdtemp(prefix="ray_trainer_run_files_")
        return os.path.join(self._work_dir, name)

    def uri(self, name: str) -> str:
        """Where `name` lives on the run's storage, as users see it."""
        return self.run.child(name).name

    def sync(self, name: str) -> None:
        """Upload the working copy of `name` to the run's storage (nothing on local storage)."""
        target = self.run.child(name)
        if target.is_local:
            return
        local = self.local_path(name)
        if os.path.exists(local):
            target.upload(local)

    @contextlib.contextmanager
    def local_copy(self, path: str) -> Iterator[str]:
        """A local file or folder holding `path` (a path or URI on the run's storage, e.g. a
        checkpoint's ``hf/``): itself on local storage, else a download removed afterwards."""
        with local_copy(locate(path, self.filesystem)) as local:
            yield local

    def close(self) -> None:
        """Remove the working copies (after the last sync)."""
        if self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None
