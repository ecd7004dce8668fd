"""Every process: a model's safetensors files, read one tensor (or one range of its rows) at a time, and written one whole tensor at a time.

Runs wherever pretrained weights are loaded: each training worker (its own rows of each
tensor), and ``load_model`` in a notebook or an evaluation task (whole tensors). The files are
read through the run's storage layer (pyarrow), so a folder on a bucket is read in place with
ranged reads, never downloaded whole. A safetensors file is an 8-byte little-endian header
length, a JSON header (``name -> dtype, shape, data_offsets``), then each tensor's bytes, C
order: the rows ``[a, b)`` of a tensor are one contiguous byte range, which is what makes a
rank's dim-0 shard of a tensor one read. The writer (`write_weights`, used by the workers'
``hf/`` exports) writes the header from the tensors' shapes first, then streams each tensor, so
that under FSDP no rank ever holds more than its shards and one whole tensor.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ray_trainer._storage import Location

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * 2**20  # a larger header is not a safetensors file


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read; the message names the file."""


@dataclass(frozen=True)
class Entry:
    """Where one tensor is: its file, dtype, shape and the byte offset of its data."""

    file: str  # the file's name in the folder
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # offset of the tensor's first byte in the file

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one index along dim 0); the whole tensor for a 0-d tensor."""
        count = 1
        for size in self.shape[1:]:
            count *= size
        return count * torch.empty(0, dtype=self.dtype).element_size()


def weight_files(folder: Location) -> list[str]:
    """The safetensors files of a model folder: those its index names, else every
    ``*.safetensors`` in it (empty when it has none)."""
    index = folder.child(INDEX_FILE).read_text()
    if index is not None:
        return sorted(set(json.loads(index)["weight_map"].values()))
    return [n for n in folder.listdir() if n.endswith(".safetensors")]


class SafetensorsFiles:
    """The tensors of a folder's safetensors files, by name. Use as a context manager (the
    files stay open inside it); reading is not thread-safe.

    Example:
        >>> with SafetensorsFiles(locate("s3://bucket/models/llama")) as files:
        ...     rows = files.read("lm_head.weight", 0, 1024)  # the first 1024 rows only
    """

    def __init__(self, folder: Location) -> None:
        self.folder = folder
        self._open: dict[str, Any] = {}
        self._scratch: torch.Tensor | None = None  # `read_rows`'s buffer
        self.entries: dict[str, Entry] = {}
        names = weight_files(folder)
        if not names:
            raise SafetensorsError(f"{folder.name}: no *.safetensors files in this folder")
        for name in names:
            self._read_header(name)

    def __enter__(self) -> SafetensorsFiles:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for handle in self._open.values():
            handle.close()
        self._open.clear()
        self._scratch = None

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def _file(self, name: str) -> Any:
        handle = self._open.get(name)
        if handle is None:
            location = self.folder.child(name)
            handle = self._open[name] = location.fs.open_input_file(location.path)
        return handle

    def _read_header(self, file: str) -> None:
        handle = self._file(file)
        where = f"{self.folder.child(file).name}"
        head = bytes(handle.read_at(8, 0))
        if len(head) != 8:
            raise SafetensorsError(f"{where}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > _MAX_HEADER:
            raise SafetensorsError(f"{where}: not a safetensors file (header of {length} bytes)")
        try:
            header = json.loads(bytes(handle.read_at(length, 8)))
        except ValueError as e:
            raise SafetensorsError(f"{where}: corrupt safetensors header ({e})") from None
        header.pop("__metadata__", None)
        for name, info in header.items():
            if info["dtype"] not in _DTYPES:
                raise SafetensorsError(f"{where}: {name} has unsupported dtype {info['dtype']}")
            begin = info["data_offsets"][0]
            self.entries[name] = Entry(
                file, _DTYPES[info["dtype"]], tuple(info["shape"]), 8 + length + begin
            )

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """The tensor `name` in its file's dtype, on CPU; only rows ``[start, stop)`` along
        dim 0 when given (one ranged read). The buffer is new: the caller owns it."""
        entry = self.entries[name]
        rows = entry.shape[0] if entry.shape else 1
        start, stop = start or 0, rows if stop is None else stop
        shape = (stop - start, *entry.shape[1:]) if entry.shape else ()
        out = torch.empty(shape, dtype=entry.dtype)
        nbytes = (stop - start) * entry.row_bytes
        if nbytes:
            self.read_into(out, entry.start + start * entry.row_bytes, entry.file)
        return out

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of `name`, like `read`, but in a buffer that this object
        reuses from call to call (valid until the next call): reading a model chunk by chunk
        allocates once, and leaves no freed chunks behind in the allocator."""
        entry = self.entries[name]
        nbytes = (stop - start) * entry.row_bytes
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        out = self._scratch[:nbytes].view(entry.dtype).view(stop - start, *entry.shape[1:])
        if nbytes:
            self.read_into(out, entry.start + start * entry.row_bytes, entry.file)
        return out

    def read_into(self, out: torch.Tensor, offset: int, file: str) -> None:
        """Fill the contiguous CPU tensor `out` with the bytes of `file` from `offset`."""
        view = out.view(-1).view(torch.uint8).numpy()
        handle = self._file(file)
        handle.seek(offset)
        done = 0
        while done < len(view):
            got = handle.readinto(view[done:])
            if not got:
                raise SafetensorsError(f"{self.folder.child(file).name}: truncated file")
            done += got


#: A file of the export holds at most this many bytes (as save_pretrained's default shards).
MAX_SHARD_BYTES = 5 * 2**30


def write_weights(
    target: str, tensors: dict[str, Any], whole: Callable[[Any], Any], writes: bool
) -> None:
    """Stream `tensors` into safetensors files in `target`, one whole tensor at a time, the
    headers written from the shapes first. ``whole(tensor)`` gives a tensor's whole value; under
    FSDP it is a collective that every rank calls for every tensor, in the same order, and only
    the rank that `writes` (rank 0) holds the result and writes it."""
    names = list(tensors)
    files = _plan(names, tensors)
    if writes:
        os.makedirs(target, exist_ok=True)
    for file_names, file in zip(files, _file_names(len(files)), strict=True):
        out = open(os.path.join(target, file), "wb") if writes else None  # noqa: SIM115
        try:
            if out is not None:
                out.write(_header(file_names, tensors))
            for name in file_names:
                value = whole(tensors[name])
                if out is not None:
                    out.write(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
                del value
        finally:
            if out is not None:
                out.close()
    if writes and len(files) > 1:
        weight_map = {
            n: f for ns, f in zip(files, _file_names(len(files)), strict=True) for n in ns
        }
        total = sum(_nbytes(tensors[n]) for n in names)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(target, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)


def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


def _plan(names: list[str], state: dict[str, Any]) -> list[list[str]]:
    """The weights of each file, in order, each file at most `MAX_SHARD_BYTES` (one weight
    larger than that gets a file of its own)."""
    files: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = _nbytes(state[name])
        if files[-1] and size + n > MAX_SHARD_BYTES:
            files.append([])
            size = 0
        files[-1].append(name)
        size += n
    return files


def _file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(names: list[str], state: dict[str, Any]) -> bytes:
    """The safetensors header of one file (sizes known from the shapes: nothing gathered)."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        tensor = state[name]
        n = _nbytes(tensor)
        entries[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(header)) + header
