"""Preparation tasks, driver and workers: the run's token cache on storage, written once, read by
every worker.

A source's records, encoded once for the run (tokens, loss mask, lengths), live under
``<storage_path>/.ray_trainer/data-cache/<fingerprint>/``: per piece ``tokens-NNNNN.npy``
(int32), ``mask-NNNNN.npy`` (uint8, 1 where the label is the token, 0 where it is -100) and
``offsets-NNNNN.npy`` (int64, where each sample starts), written by the preparation task that
encoded the piece (:func:`write_piece`, on any node; a piece that Ray Data's ``map_batches``
encoded does not know its place in the source, so its files are named by a digest of their
content instead of ``NNNNN``, and ``meta.json`` lists each piece's name in order); then ``lengths.npy`` and ``targets.npy``
(per sample: tokens, and positions the model scores) and ``meta.json`` last, by the driver
(:func:`write_meta`). A cache without ``meta.json`` is incomplete and is rebuilt. A source of
preference pairs stores each kept pair as two consecutive samples of one piece, chosen at ``2i``
and rejected at ``2i + 1`` (its meta says ``"pairs"`` and ``"pair_format"``). Workers open it
with :class:`TokenCache` and read only the samples they train on: memory-mapped on a local or
shared disk, ranged reads on a bucket. Packing plans are not cached: they depend on the seed, the
epoch and the number of workers, and are computed by the workers.
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_trainer._data.encode import IGNORE_INDEX
from ray_trainer._storage import Location

CACHE_VERSION = 1
CACHE_DIR = ("data-cache",)
META_FILE = "meta.json"


def cache_location(storage: Location, fingerprint: str) -> Location:
    """Where the cache of `fingerprint` lives under a run's `storage_path`."""
    return storage.child(".ray_trainer", *CACHE_DIR, fingerprint)


@dataclass
class PieceResult:
    """What a preparation task reports for its piece (small: it travels back to the driver)."""

    index: int
    lengths: np.ndarray  # int32, tokens per kept sample
    targets: np.ndarray  # int32, positions the model scores per kept sample (labels after shift)
    records: int  # records (or preference pairs) read
    truncated: int  # samples (or pairs) cut to max_length
    dropped: int  # records with no label left, or pairs whose prompt fills max_length (not kept)
    dropped_where: list[str]  # where the first few of them are
    cpu_s: float = 0.0  # the task's CPU time
    name: str | None = None  # its files' name, when not its index (`write_piece`)


def write_piece(
    location: Location, index: int | None, samples: list[tuple[list[int], list[int]]]
) -> str:
    """Write one piece's samples (``(input_ids, labels)`` each) into the cache folder, as piece
    `index`, or, with no index, under a digest of its content (a piece whose place in the
    source its writer does not know); returns the name its files have."""
    lengths = np.fromiter((len(ids) for ids, _ in samples), dtype=np.int64, count=len(samples))
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.fromiter((t for ids, _ in samples for t in ids), np.int32, int(offsets[-1]))
    labels = np.fromiter((t for _, lab in samples for t in lab), np.int64, int(offsets[-1]))
    mask = (labels != IGNORE_INDEX).astype(np.uint8)
    arrays = (("tokens", tokens), ("mask", mask), ("offsets", offsets))
    if index is None:
        digest = hashlib.sha256()
        for _, array in arrays:
            digest.update(array.tobytes())
        name = digest.hexdigest()[:20]
    else:
        name = f"{index:05d}"
    for kind, array in arrays:
        location.child(f"{kind}-{name}.npy").write_bytes(_npy(array))
    return name


def write_meta(location: Location, meta: dict[str, Any], results: list[PieceResult]) -> None:
    """The driver's last word on a cache: per-sample lengths and targets, then ``meta.json``
    (the marker that the cache is complete)."""
    results = sorted(results, key=lambda r: r.index)
    for name in ("lengths", "targets"):  # one file's bytes at a time: 4 bytes a sample
        npy = _joined_npy([getattr(r, name) for r in results], np.int32)
        location.child(f"{name}.npy").write_bytes(npy)
        del npy
    pieces = [
        {"index": r.index, "samples": len(r.lengths), **({"name": r.name} if r.name else {})}
        for r in results
    ]
    body = {**meta, "samples": sum(len(r.lengths) for r in results), "pieces": pieces}
    write_folder_meta(location, CACHE_VERSION, body)


def read_meta(location: Location) -> dict[str, Any] | None:
    """The meta of a complete cache of this version, or None (missing, partial, other version)."""
    return read_folder_meta(location, CACHE_VERSION)


def write_folder_meta(location: Location, version: int, body: dict[str, Any]) -> None:
    """Write `body`, stamped with its format's `version`, as the ``meta.json`` of a folder
    written in pieces (the token cache, a reference folder beside it): the last file written,
    the marker that the folder is complete."""
    text = json.dumps({"version": version, **body}, indent=1, sort_keys=True)
    location.child(META_FILE).write_text(text)


def read_folder_meta(location: Location, version: int) -> dict[str, Any] | None:
    """The ``meta.json`` of a complete folder of format `version`, or None (missing: the
    folder is partial; another version: it is stale)."""
    text = location.child(META_FILE).read_text()
    if text is None:
        return None
    meta = json.loads(text)
    return meta if meta.get("version") == version else None


def _joined_npy(parts: list[np.ndarray], dtype: Any) -> bytearray:
    """The ``.npy`` file of `parts` joined into one 1-D array, built in place: the joined
    array is never held apart from the file's bytes (the driver's memory, on a large source,
    is per sample)."""
    count = sum(len(part) for part in parts)
    head = io.BytesIO()
    fmt = np.lib.format
    fmt.write_array_header_1_0(
        head,
        {"descr": fmt.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (count,)},
    )
    start = head.tell()
    out = bytearray(start + count * np.dtype(dtype).itemsize)
    out[:start] = head.getvalue()
    if parts:
        np.concatenate(parts, out=np.frombuffer(out, dtype=dtype, count=count, offset=start))
    return out


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


class TokenCache:
    """A complete token cache, opened in a training worker; `sample(i)` reads sample i only.

    Local (or shared) storage is memory-mapped: the pages of the samples read are the only ones
    loaded. A bucket is read with one ranged read per sample (`samples` reads a batch of them
    from a small thread pool). Thread-safe for reads.
    """

    def __init__(self, location: Location) -> None:
        self.location = location
        meta = read_meta(self.location)
        if meta is None:
            raise FileNotFoundError(f"{location.name}: no complete token cache here")
        self.meta = meta
        self.lengths = self._load("lengths.npy")
        self.targets = self._load("targets.npy")
        counts = [p["samples"] for p in meta["pieces"]]
        self._names = [p.get("name") or f"{p['index']:05d}" for p in meta["pieces"]]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._offsets: dict[int, np.ndarray] = {}
        self._arrays: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample i's token ids (int64) and labels (-100 where no loss is taken)."""
        piece = int(np.searchsorted(self._starts, i, side="right")) - 1
        offsets = self._piece_offsets(piece)
        j = i - int(self._starts[piece])
        lo, hi = int(offsets[j]), int(offsets[j + 1])
        ids = self._slice("tokens", piece, lo, hi).astype(np.int64)
        mask = self._slice("mask", piece, lo, hi).astype(bool)
        return ids, np.where(mask, ids, IGNORE_INDEX)

    def samples(self, indices: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Several samples; read in parallel from a bucket, in turn from a local disk."""
        if self.location.is_local or len(indices) < 2:
            return [self.sample(i) for i in indices]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(8, len(indices))) as pool:
            return list(pool.map(self.sample, indices))

    # ---- internals -------------------------------------------------------------------------

    def _load(self, name: str) -> np.ndarray:
        return np.load(io.BytesIO(self.location.child(name).read_bytes()), allow_pickle=False)

    def _piece_offsets(self, piece: int) -> np.ndarray:
        offsets = self._offsets.get(piece)
        if offsets is None:
            offsets = self._load(f"offsets-{self._names[piece]}.npy")
            with self._lock:
                self._offsets[piece] = offsets
        return offsets

    def _slice(self, kind: str, piece: int, lo: int, hi: int) -> np.ndarray:
        array = self._arrays.get((kind, piece))
        if array is None:
            with self._lock:
                array = self._arrays.get((kind, piece)) or self._open(
                    f"{kind}-{self._names[piece]}.npy"
                )
                self._arrays[(kind, piece)] = array
        return array[lo:hi]

    def _open(self, name: str) -> Any:
        location = self.location.child(name)
        if self.location.is_local:
            return np.load(location.path, mmap_mode="r", allow_pickle=False)
        return _RemoteArray(location)


class _RemoteArray:
    """A 1-D ``.npy`` file on a bucket, sliced with ranged reads (never downloaded whole)."""

    def __init__(self, location: Location) -> None:
        self.file = location.fs.open_input_file(location.path)
        head = io.BytesIO(self.file.read_at(256, 0))
        fmt = np.lib.format
        read = fmt.read_array_header_1_0 if fmt.read_magic(head) == (1, 0) else None
        shape, _, dtype = (read or fmt.read_array_header_2_0)(head)
        self.dtype, self.length, self.start = np.dtype(dtype), shape[0], head.tell()

    def __getitem__(self, s: slice) -> np.ndarray:
        lo, hi = s.start, min(s.stop, self.length)
        size = self.dtype.itemsize
        data = self.file.read_at((hi - lo) * size, self.start + lo * size)
        return np.frombuffer(data, dtype=self.dtype)
