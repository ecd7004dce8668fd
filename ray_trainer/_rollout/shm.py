"""In the rollout actor: a weight sync's buckets staged in shared memory (``/dev/shm``) for vLLM.

The ``"vllm"`` engine's weights live in its generation child's engine process, not in the
actor, so a bucket cannot be copied into them in place. `ShmReceiver` is the engine's
`weights.Receiver`: it checks each bucket as every engine's receiver does (names, sizes, each
element covered once, every tensor by the end), but its tensors are shapes only (torch's
``meta`` device), and it hands back the tensors that a bucket completed, whole: a tensor cut over
several buckets is joined here first, in a buffer of its own size (the only copy it keeps).

The engine writes those tensors into a file of shared memory in the safetensors format
(`write_safetensors`: an 8-byte header length, a JSON header naming each tensor's dtype, shape
and byte range, then the bytes), asks the child to load it (`load_request`), and removes the file
when the child has answered. The child's engine process reads the file with safetensors, mapped,
without a copy through the pipe. A LoRA sync writes the whole adapter into one such file beside an
``adapter_config.json`` (`adapter_file_name`): the folder vLLM loads as a new LoRA id.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from ray_trainer._rollout.weights import Bucket, Entry, Receiver, canonical

#: safetensors' dtype codes, by torch dtype name.
DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1}  # fmt: skip
#: The file vLLM (and peft) read a LoRA adapter's tensors from.
ADAPTER_FILE = "adapter_model.safetensors"
#: In an engine's folder while weights posted during a request wait: the vLLM child pauses the
#: request at its next decoding step's end when it finds it (``engine_vllm.VllmEngine.posted``).
PAUSE_FILE = "posted"


def shm_folder(prefix: str = "ray-trainer-rollout") -> Path:
    """A new folder for one engine's sync files: in ``/dev/shm`` (memory, not disk) where the
    machine has it, else in the temporary folder; the folders of engines whose process has
    ended are removed first (`remove_stale`)."""
    root = Path("/dev/shm")
    if not (root.is_dir() and os.access(root, os.W_OK)):
        root = Path(tempfile.gettempdir())
    remove_stale(root, prefix)
    folder = root / f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    folder.mkdir(mode=0o700)
    return folder


def remove_stale(root: Path, prefix: str) -> list[Path]:
    """Remove the folders ``<prefix>-<pid>-*`` under `root` whose process has ended: a run's
    engine actors are killed with their worker group (and the generation child with them), so
    no one removed them; the next engine on the machine does. Returns those removed."""
    removed = []
    for folder in root.glob(f"{prefix}-*-*"):
        pid = folder.name[len(prefix) + 1 :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def safetensors_header(tensors: list[tuple[str, str, list[int], int]]) -> bytes:
    """The header of a safetensors file of `tensors` (name, torch dtype name, shape, bytes),
    their bytes laid one after the other in that order: its length (8 bytes, little endian)
    and its JSON, padded with spaces to a multiple of 8 bytes."""
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        if name in header:
            raise ValueError(f"{name}: twice in one safetensors file")
        code = DTYPES.get(dtype)
        if code is None:
            raise ValueError(f"{name}: dtype {dtype} has no safetensors code; use {list(DTYPES)}")
        numel = 1
        for size in shape:
            numel *= int(size)
        if numel * _ITEMSIZE[code] != nbytes:
            raise ValueError(
                f"{name}: {nbytes} bytes for a {dtype} tensor of shape {tuple(shape)} "
                f"({numel * _ITEMSIZE[code]} bytes)"
            )
        header[name] = {"dtype": code, "shape": [int(s) for s in shape],
                        "data_offsets": [offset, offset + nbytes]}  # fmt: skip
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_safetensors(path: Path, tensors: list[tuple[str, str, list[int], Any]]) -> int:
    """Write `tensors` (name, torch dtype name, shape, their bytes: a flat ``uint8`` array or
    any buffer) to `path` as a safetensors file; returns the bytes of tensor data written."""
    sizes = [(n, d, s, memoryview(b).nbytes) for n, d, s, b in tensors]
    header = safetensors_header(sizes)
    with open(path, "wb") as f:
        f.write(header)
        for *_, data in tensors:
            f.write(memoryview(data).cast("B"))
    return sum(size for *_, size in sizes)


#: The child's request lines that open and close a full-weight sync (vLLM's in-place reload).
BEGIN_REQUEST = {"op": "begin_weights"}
END_REQUEST = {"op": "weights_loaded"}


def load_request(path: Path) -> dict[str, Any]:
    """The child's request line that loads the full-weight tensors in the file at `path`."""
    return {"op": "load_weights", "path": str(path)}


def adapter_request(folder: Path) -> dict[str, Any]:
    """The child's request line that loads the LoRA adapter in `folder` under a new LoRA id."""
    return {"op": "load_adapter", "path": str(folder)}


def adapter_file_name(name: str) -> str:
    """A peft parameter's name as an adapter file holds it: without the adapter's name
    (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``), as peft saves it."""
    parts = name.split(".")
    for at, part in enumerate(parts[:-1]):
        if part.startswith("lora_") and at + 2 < len(parts):
            return ".".join(parts[: at + 1] + parts[at + 2 :])
    return name


class ShmReceiver(Receiver):
    """The receiver of the ``"vllm"`` engine, in the rollout actor: `tensors` are the engine's
    weights' shapes (``meta`` tensors, by name); each `load` checks a bucket and keeps the
    tensors it completed for `take`. Slices of one tensor are joined in a buffer of its size."""

    def __init__(self, tensors: dict[str, Any], what: str = "every weight") -> None:
        super().__init__(tensors, what)
        self._parts: dict[str, Any] = {}  # name -> the flat bytes of a tensor being joined
        self._whole: list[tuple[str, str, list[int], Any]] = []

    def begin(self, version: int) -> None:
        super().begin(version)
        self._parts.clear()
        self._whole.clear()

    def take(self) -> list[tuple[str, str, list[int], Any]]:
        """The tensors completed since the last call: (name, dtype, shape, flat bytes). A
        whole tensor from one bucket is a view of that bucket's payload: write it before the
        bucket is released."""
        whole, self._whole = self._whole, []
        return whole

    def _copy(self, entry: Entry, target: Any, bucket: Bucket) -> None:
        import numpy as np

        name = canonical(entry.name)
        size = _ITEMSIZE[DTYPES[entry.dtype]] if entry.dtype in DTYPES else None
        if size is None:
            raise ValueError(f"{entry.name}: dtype {entry.dtype} cannot be staged for vLLM")
        piece = bucket.data[entry.offset : entry.offset + entry.numel * size]
        shape = list(target.shape)
        if entry.numel == entry.total:
            self._whole.append((name, entry.dtype, shape, piece))
            return
        buffer = self._parts.get(name)
        if buffer is None:
            buffer = self._parts[name] = np.empty(entry.total * size, dtype=np.uint8)
        buffer[entry.start * size : (entry.start + entry.numel) * size] = piece
        if self._covered.get(name, 0) + entry.numel == entry.total:
            self._whole.append((name, entry.dtype, shape, self._parts.pop(name)))
