"""On rank 0 of the training workers (sending) and in the rollout actor (loading): weights in buckets.

A weight sync moves the trainer's weights into a rollout engine a bucket at a time, each bucket
at most ``max_bytes`` of payload, so that neither side ever holds a second copy of the model:

- the sender (`buckets`) consumes ``(name, tensor)`` pairs lazily and cuts them into buckets,
  a tensor larger than a bucket into slices of its flat view. Under FSDP the pairs come from
  `full_tensors`, which gathers one parameter at a time (a collective: every rank iterates it,
  in the same order; only rank 0 sends what it yields);
- the receiver (`Receiver`, in the engine) copies each slice into its own tensor in place, and
  at the end of the sync checks that every tensor it must receive was covered exactly.

A bucket's payload is one flat byte array (numpy), which Ray's object store hands to the actor
without a copy. Names are compared without the prefixes that wrappers add (DDP's ``module.``,
``torch.compile``'s ``_orig_mod.``, activation checkpointing's), so the trainer's wrapped
model and the engine's plain one agree.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

#: The default bound of one bucket's payload.
DEFAULT_BUCKET_BYTES = 64 * 2**20
_WRAPPER_PARTS = re.compile(
    r"(?:^|(?<=\.))(?:_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\."
)


class WeightSyncError(RuntimeError):
    """A weight sync that cannot be applied or is incomplete; the message names the tensors."""


@dataclass(frozen=True)
class Entry:
    """One slice of one tensor in a bucket: elements ``start .. start+numel`` of the flat
    tensor called `name` (of `total` elements, `dtype`), at byte `offset` of the payload."""

    name: str
    start: int
    numel: int
    total: int
    dtype: str
    offset: int


@dataclass
class Bucket:
    """What one transfer carries: its entries and their payload, one flat ``uint8`` array."""

    entries: list[Entry]
    data: Any  # numpy.ndarray of uint8

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def canonical(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (``module.``, ``_orig_mod.`` ...)."""
    name = _WRAPPER_PARTS.sub("", name)
    return name[len("module.") :] if name.startswith("module.") else name


def full_tensors(named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Each ``(name, tensor)`` of `named` whole: a sharded one (an FSDP2 ``DTensor``) gathered
    with ``full_tensor()`` when it is reached, so only one parameter is ever whole at a time.
    Under FSDP every rank must iterate it to the end, in the same order."""
    for name, tensor in named:
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor


def buckets(
    named: Iterable[tuple[str, Any]], max_bytes: int = DEFAULT_BUCKET_BYTES, dtype: Any = None
) -> Iterator[Bucket]:
    """The sender: `named`'s tensors (cast to `dtype` when given) in buckets of at most
    `max_bytes` of payload each, in order; a tensor is read when the previous bucket has been
    taken, so a generator that gathers one parameter at a time keeps its memory bound."""
    import numpy as np
    import torch

    if not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"bucket bytes must be a positive integer, got {max_bytes!r}")
    entries: list[Entry] = []
    pieces: list[Any] = []
    size = 0

    def flush() -> Bucket:
        nonlocal entries, pieces, size
        data = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint8)
        bucket = Bucket(entries, data)
        entries, pieces, size = [], [], 0
        return bucket

    for name, tensor in named:
        flat = tensor.detach()
        if dtype is not None:
            flat = flat.to(dtype)
        flat = flat.to("cpu").contiguous().view(-1)
        itemsize, total = flat.element_size(), flat.numel()
        kind = str(flat.dtype).removeprefix("torch.")
        if itemsize > max_bytes:
            raise ValueError(
                f"a bucket of {max_bytes} bytes cannot hold one {kind} element of {name}"
            )
        if total == 0:
            entries.append(Entry(name, 0, 0, 0, kind, size))
            continue
        start = 0
        while start < total:
            room = (max_bytes - size) // itemsize
            if room == 0:
                yield flush()
                continue
            n = min(room, total - start)
            piece = flat[start : start + n].view(torch.uint8).numpy()
            entries.append(Entry(name, start, n, total, kind, size))
            pieces.append(piece)  # a view: copied once, into the bucket, at flush
            size += n * itemsize
            start += n
        if size >= max_bytes:
            yield flush()
    if entries:
        yield flush()


class Receiver:
    """The loading side of a sync, in the engine: copies each bucket's slices into `tensors`
    (its weights by name, in place) and checks at the end that each was covered exactly.

    Runs in the rollout actor (or the process that holds the engine), one call at a time.
    """

    def __init__(self, tensors: dict[str, Any], what: str = "every weight") -> None:
        self.tensors = {canonical(n): t for n, t in tensors.items()}
        self.what = what  # for the errors: "every weight", "the LoRA adapter"
        self.pending: int | None = None  # the version being synced, between begin and finish
        self._covered: dict[str, int] = {}
        self._bytes = 0
        self._started = 0.0

    @property
    def syncing(self) -> bool:
        """A sync has begun and not finished: the weights may be part old, part new."""
        return self.pending is not None

    def begin(self, version: int) -> None:
        """Start receiving `version` (a sync left unfinished before is dropped: it will be
        covered again)."""
        self.pending = int(version)
        self._covered = {}
        self._bytes = 0
        self._started = time.perf_counter()

    def load(self, bucket: Bucket) -> int:
        """Copy `bucket`'s slices into the tensors; returns its payload's bytes."""
        if self.pending is None:
            raise WeightSyncError("a bucket arrived outside a sync: call begin_sync first")
        for e in bucket.entries:
            target = self.tensors.get(canonical(e.name))
            if target is None:
                raise WeightSyncError(self._unknown(e.name))
            if e.total != target.numel():
                raise WeightSyncError(
                    f"{e.name}: {e.total} elements sent, the engine's has {target.numel()} "
                    f"({tuple(target.shape)}); the engine and the trainer build different models"
                )
            done = self._covered.get(canonical(e.name), 0) + e.numel
            if done > e.total:
                raise WeightSyncError(f"{e.name}: sent more than once in sync {self.pending}")
            if e.numel:  # an empty tensor is covered by its entry alone
                self._copy(e, target, bucket)
            self._covered[canonical(e.name)] = done
        self._bytes += bucket.nbytes
        return bucket.nbytes

    def _copy(self, entry: Entry, target: Any, bucket: Bucket) -> None:
        """Copy one checked slice of `bucket` into `target` (in place; a backend whose weights
        live in another process overrides it)."""
        import numpy as np
        import torch

        kind = getattr(torch, entry.dtype)
        nbytes = entry.numel * torch.empty(0, dtype=kind).element_size()
        raw = np.array(bucket.data[entry.offset : entry.offset + nbytes])  # own, writable memory
        with torch.no_grad():
            target.view(-1)[entry.start : entry.start + entry.numel].copy_(
                torch.from_numpy(raw).view(kind)
            )

    def finish(self, version: int) -> dict[str, Any]:
        """End the sync of `version`: every tensor covered exactly, else `WeightSyncError`
        (and the sync stays open: the engine does not sample from mixed weights)."""
        if self.pending != version:
            raise WeightSyncError(f"finish_sync({version}) but the sync open is {self.pending}")
        missing = [n for n, t in self.tensors.items() if self._covered.get(n, 0) != t.numel()]
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise WeightSyncError(
                f"sync {version} did not send {self.what}: {shown} missing or incomplete"
            )
        summary = {
            "version": version,
            "bytes": self._bytes,
            "tensors": len(self._covered),
            "seconds": time.perf_counter() - self._started,
        }
        self.pending = None
        return summary

    def _unknown(self, name: str) -> str:
        what = f"the engine holds {self.what}"
        if ".lora_" in name or self.what == "every weight":
            return f"{name}: no such weight in the engine ({what})"
        return f"{name}: not a LoRA adapter weight; {what}: send the adapter only"


@dataclass
class SyncStats:
    """One sync as the sender saw it: its ``sync/seconds`` and ``sync/bytes`` metrics."""

    version: int
    seconds: float
    bytes: int
    buckets: int
    tensors: int
    largest_bucket: int
    receiver: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        return {"sync/seconds": self.seconds, "sync/bytes": float(self.bytes)}
