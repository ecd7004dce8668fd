"""Runs in the eval task (writing) and on the callback actor (reading, for the trackers): the
samples file of a ``GenerationEval``, ``<checkpoint>/eval/<name>.jsonl``.

Written on the checkpoint's own storage whole or not at all (a temporary file renamed on a
filesystem; one whole object on a bucket); the evaluation's metrics name it under
``<name>/samples``, where ``MLflowLogger`` and ``WandbLogger`` find it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

__all__ = ["SAMPLES_KEY", "local_samples", "samples_of", "write_samples"]

logger = logging.getLogger("callbacks")

#: The key of the metrics dict that names the samples file: ``<name>/samples`` (not a number).
SAMPLES_KEY = "samples"


def samples_of(metrics: dict[str, Any] | None) -> dict[str, str]:
    """The samples files an evaluation's metrics name: ``{"<name>": path or URI}`` for each key
    ``<name>/samples`` holding text (``GenerationEval``'s); the trackers log them."""
    suffix = "/" + SAMPLES_KEY
    return {
        key[: -len(suffix)]: value
        for key, value in (metrics or {}).items()
        if key.endswith(suffix) and isinstance(value, str) and value
    }


@contextlib.contextmanager
def local_samples(path: str, storage: Any = None) -> Iterator[str]:
    """A local file holding the samples file at `path` (a path or URI on the run's storage):
    itself when local, else a copy (through `storage`, the actor's ``RunStorage``, or
    ``pyarrow.fs`` for a URI) removed afterwards."""
    if storage is not None:
        with storage.local_copy(path) as local:
            yield local
        return
    if "://" not in path:
        yield path
        return
    import tempfile

    import pyarrow.fs

    fs, inner = pyarrow.fs.FileSystem.from_uri(path)
    with tempfile.TemporaryDirectory(prefix="ray_trainer_samples_") as tmp:
        local = os.path.join(tmp, os.path.basename(inner))
        with fs.open_input_stream(inner) as src, open(local, "wb") as dst:
            dst.write(src.read())
        yield local


def write_samples(
    rows: list[dict[str, Any]],
    local: str,
    uri: str | None,
    relative: str,
    filesystem: Any,
) -> str | None:
    """Write the samples under the checkpoint, whole or not at all; where they are, or None
    when the checkpoint's own storage cannot be reached from here (then only a warning)."""
    text = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows)
    own = uri or local
    if filesystem is None and "://" not in own:
        target = own if os.path.isdir(own) else None
        if target is None:
            logger.warning(
                "GenerationEval: the checkpoint %s is not reachable from this task; the samples "
                "were not kept",
                own,
            )
            return None
        path = os.path.join(target, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex}")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)  # atomic: a reader sees the old file or the new one whole
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        return path
    import pyarrow.fs

    if filesystem is not None:
        fs, inner = filesystem, own
    else:
        fs, inner = pyarrow.fs.FileSystem.from_uri(own)
    inner = f"{inner.rstrip('/')}/{relative}"
    fs.create_dir(os.path.dirname(inner), recursive=True)
    if fs.type_name == "local":
        tmp = f"{os.path.dirname(inner)}/.{os.path.basename(inner)}.{uuid.uuid4().hex}"
        with fs.open_output_stream(tmp) as f:
            f.write(text.encode("utf-8"))
        fs.move(tmp, inner)
    else:  # an object store makes an object visible only once it is whole
        with fs.open_output_stream(inner) as f:
            f.write(text.encode("utf-8"))
    return f"{own.rstrip('/')}/{relative}"
