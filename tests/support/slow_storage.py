"""A storage filesystem that writes slowly, and can crash the process writing a chosen file.

`slow_filesystem(...)` is a ``pyarrow.fs.PyFileSystem`` over this machine's disk, passed as
``TrainingArgs.storage_filesystem`` (paths on it are local absolute paths). Every file written
through it waits ``per_file_s`` when opened and ``per_mb_s`` for each MiB written, as network
storage would; the first process to open a file whose path contains ``crash_on`` (once, marked
by the file ``crash_marker``) exits at once, as a worker killed mid-write. Imported by the test
process and, through PYTHONPATH, by Ray workers and the callback actor (it pickles by name).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from callbacks import TrainerCallback


class _SlowWriter:
    """A file object that writes through to a local file, slowly."""

    def __init__(self, path: str, per_mb_s: float) -> None:
        self._f = open(path, "wb")  # noqa: SIM115  (closed by close())
        self.per_mb_s = per_mb_s
        self.closed = False

    def write(self, data: Any) -> int:
        n = len(memoryview(data).cast("B"))
        if self.per_mb_s:
            time.sleep(self.per_mb_s * n / 2**20)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self.closed:
            self._f.close()
            self.closed = True

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._f.tell()


class SlowHandler(pafs.FileSystemHandler):
    """LocalFileSystem, with slow writes and an optional crash (see the module docstring)."""

    def __init__(
        self,
        per_file_s: float = 0.0,
        per_mb_s: float = 0.0,
        crash_on: str | None = None,
        crash_marker: str | None = None,
    ) -> None:
        self.local = pafs.LocalFileSystem()
        self.per_file_s, self.per_mb_s = per_file_s, per_mb_s
        self.crash_on, self.crash_marker = crash_on, crash_marker

    def __reduce__(self):
        return SlowHandler, (self.per_file_s, self.per_mb_s, self.crash_on, self.crash_marker)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SlowHandler) and self.__reduce__() == other.__reduce__()

    def __hash__(self) -> int:
        return hash(self.__reduce__()[1])

    def get_type_name(self) -> str:
        return "slow-local"

    def normalize_path(self, path: str) -> str:
        return path

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.local.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.local.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise OSError("refusing to delete the root")

    def delete_file(self, path: str) -> None:
        self.local.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.local.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.local.copy_file(src, dest)

    def open_input_stream(self, path: str) -> Any:
        return self.local.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        return self.local.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any = None) -> Any:
        if self.crash_on and self.crash_on in path and not os.path.exists(self.crash_marker):
            with open(self.crash_marker, "w") as f:
                f.write(f"{os.getpid()} {path}\n")
            os._exit(17)  # a worker killed while it writes
        if self.per_file_s:
            time.sleep(self.per_file_s)
        return pa.PythonFile(_SlowWriter(path, self.per_mb_s), mode="w")

    def open_append_stream(self, path: str, metadata: Any = None) -> Any:
        return self.local.open_append_stream(path)


def slow_filesystem(**options: Any) -> pafs.PyFileSystem:
    """A storage filesystem over this machine's disk that writes slowly (see `SlowHandler`)."""
    return pafs.PyFileSystem(SlowHandler(**options))


class CompleteAtOnSave(TrainerCallback):
    """Rank 0, in the training process: at each `on_save`, whether the checkpoint it announces
    already passes `verify` (every rank's files written), appended as JSON lines to `path`."""

    runs_on = "rank0"

    def __init__(self, path: str) -> None:
        self.path = path

    def on_save(self, context: Any, **kwargs: Any) -> None:
        import json

        from ray_trainer import CheckpointError
        from ray_trainer._checkpoint import verify

        try:
            step, error = verify(context.checkpoint_path).global_step, None
        except CheckpointError as e:
            step, error = None, str(e)
        record = {
            "announced": context.global_step,
            "verified": step,
            "error": error,
            "path": context.checkpoint_path,
            "attempt": context.attempt,
            "t": time.monotonic(),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
