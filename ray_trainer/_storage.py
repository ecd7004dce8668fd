"""Every process: a run's storage, one pyarrow filesystem through which every file of a run goes.

A run's files live under ``storage_path``: a local or shared path, or a URI that
``pyarrow.fs.FileSystem.from_uri`` opens (``s3://bucket/runs``, ``gs://...``); or, with
``storage_filesystem`` (a ``pyarrow.fs.FileSystem``, as Ray Train's ``RunConfig`` takes), a path
on that filesystem (custom endpoints and credentials). The driver, every worker, the callback
actor and every evaluation task may be on different machines: nothing here assumes a shared
disk. Locations travel between processes as strings (a local absolute path or a URI) plus the
optional filesystem object, which pickles.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs


def is_uri(path: str) -> bool:
    """True for ``scheme://...`` (a bucket or remote filesystem), False for a local path."""
    return "://" in path


@dataclass(frozen=True)
class Location:
    """A file or folder on a run's storage: the filesystem, the path on it, and the name users
    see (a local absolute path, a URI, or the path on a custom filesystem)."""

    fs: Any  # pyarrow.fs.FileSystem
    path: str
    name: str

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def child(self, *parts: str) -> Location:
        """A location below this one."""
        tail = "/".join(p.strip("/") for p in parts)
        return Location(
            self.fs, f"{self.path.rstrip('/')}/{tail}", f"{self.name.rstrip('/')}/{tail}"
        )

    @property
    def basename(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    # ---- reading --------------------------------------------------------------------------

    def exists(self) -> bool:
        return self.fs.get_file_info(self.path).type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        return self.fs.get_file_info(self.path).type == pafs.FileType.Directory

    def size(self) -> int | None:
        """The size of a file in bytes; None when there is no such file."""
        info = self.fs.get_file_info(self.path)
        return info.size if info.type == pafs.FileType.File else None

    def listdir(self) -> list[str]:
        """The names directly below this folder (empty when it does not exist)."""
        selector = pafs.FileSelector(self.path, allow_not_found=True, recursive=False)
        return sorted(info.base_name for info in self.fs.get_file_info(selector))

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as f:
            return f.read()

    def read_text(self) -> str | None:
        """The file's text, or None when there is no such file."""
        try:
            return self.read_bytes().decode()
        except FileNotFoundError:
            return None

    # ---- writing --------------------------------------------------------------------------

    def write_bytes(self, data: bytes) -> None:
        """Write the whole file so that a reader never sees half of it: a local file is
        written to a temporary name and renamed; an object store writes an object whole."""
        parent = self.path.rstrip("/").rsplit("/", 1)[0]
        self.fs.create_dir(parent, recursive=True)
        if self.is_local:
            # Unique to this writer: two threads of one driver may write the same file.
            tmp = f"{self.path}.tmp{os.getpid()}-{threading.get_ident()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
            return
        with self.fs.open_output_stream(self.path) as f:
            f.write(data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def delete(self) -> None:
        """Remove this file or folder; nothing when it does not exist."""
        info = self.fs.get_file_info(self.path)
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(self.path)
        elif info.type == pafs.FileType.File:
            self.fs.delete_file(self.path)

    def upload(self, local: str) -> None:
        """Copy a local file or folder here (replacing files of the same names)."""
        if os.path.isdir(local):
            self.fs.create_dir(self.path, recursive=True)
        else:
            self.fs.create_dir(self.path.rstrip("/").rsplit("/", 1)[0], recursive=True)
        pafs.copy_files(
            local,
            self.path,
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=self.fs,
        )


def locate(path: str, filesystem: Any = None) -> Location:
    """The location of ``path``: on ``filesystem`` when one is given (a path on it), else a
    URI's filesystem, else this machine's (made absolute)."""
    if filesystem is not None:
        return Location(filesystem, path.rstrip("/") or "/", path)
    if is_uri(path):
        scheme, rest = path.split("://", 1)
        fs = _filesystem_for(scheme, rest.split("/", 1)[0])
        return Location(fs, rest.rstrip("/"), path.rstrip("/"))
    local = os.path.abspath(os.path.expanduser(path))
    return Location(pafs.LocalFileSystem(), local, local)


@functools.lru_cache(maxsize=16)
def _filesystem_for(scheme: str, authority: str) -> Any:
    """One filesystem object per scheme and bucket in a process (opening one resolves the
    bucket's region, ~0.2 s)."""
    fs, _ = pafs.FileSystem.from_uri(f"{scheme}://{authority}")
    return fs


@contextlib.contextmanager
def local_copy(location: Location) -> Iterator[str]:
    """A local folder (or file) holding ``location``'s content: itself when it is on this
    machine's filesystem, else a download into a temporary folder, removed afterwards.

    Runs in whichever process needs local files (an evaluation task, a worker resuming, a
    notebook). The download is whole: for a checkpoint, every file of every rank.
    """
    if location.is_local:
        yield location.path
        return
    folder = tempfile.mkdtemp(prefix="ray_trainer_")
    try:
        target = os.path.join(folder, location.basename or "download")
        if location.is_dir():
            os.makedirs(target)
            pafs.copy_files(
                location.path,
                target,
                source_filesystem=location.fs,
                destination_filesystem=pafs.LocalFileSystem(),
            )
        else:
            with open(target, "wb") as f:
                f.write(location.read_bytes())
        yield target
    finally:
        shutil.rmtree(folder, ignore_errors=True)
