"""On rank 0 of the training workers: how a weight sync's buckets reach a rollout engine.

`sync_weights` is the whole sender: it opens a sync of a policy version on the engine, sends
the buckets of ``weights.buckets`` one at a time through a `WeightTransport`, and closes the
sync, which the engine checks. The transports, registered in `TRANSPORTS`:

- ``"object_store"``: the engine is a Ray actor (``actor.py``); each bucket is put in Ray's
  object store and loaded by the actor before the next one is put, so at most one bucket is in
  flight;
- ``"local"``: the engine is in this process (tests, and an engine beside the trainer).

An NCCL transport (vLLM's weight-transfer engine, GPU to GPU) would be a third entry here; it
is not built.

`post_weights` is the other way, for engines that keep sampling while the trainer moves on (an
asynchronous run): every bucket of a version is put in the object store once, for every engine,
and each engine loads them at its next request boundary (``actor.RolloutActor.post``): the
trainer never waits for a request ahead of the sync, at the cost of one copy of the synced
weights in the object store per version still being read (two at most).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ray_trainer._rollout.weights import DEFAULT_BUCKET_BYTES, Bucket, SyncStats, buckets


class WeightTransport(abc.ABC):
    """Carries one sync to one engine: open it, deliver buckets in order, close it."""

    @abc.abstractmethod
    def begin(self, version: int) -> None:
        """Open a sync of policy `version` on the engine."""

    @abc.abstractmethod
    def deliver(self, bucket: Bucket) -> None:
        """Hand one bucket to the engine; returns once the engine has loaded it."""

    @abc.abstractmethod
    def finish(self, version: int) -> dict[str, Any]:
        """Close the sync; the engine's summary (it raises when the sync was incomplete)."""


class LocalTransport(WeightTransport):
    """To an engine in this process: its methods, called directly."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def begin(self, version: int) -> None:
        self.engine.begin_sync(version)

    def deliver(self, bucket: Bucket) -> None:
        self.engine.load_bucket(bucket)

    def finish(self, version: int) -> dict[str, Any]:
        return self.engine.finish_sync(version)


class ObjectStoreTransport(WeightTransport):
    """To an engine in a Ray actor (its handle): each bucket through Ray's object store, put,
    loaded by the actor, then released before the next one is put."""

    def __init__(self, actor: Any, timeout_s: float | None = 600.0) -> None:
        self.actor = actor
        self.timeout_s = timeout_s

    def begin(self, version: int) -> None:
        import ray

        ray.get(self.actor.begin_sync.remote(version), timeout=self.timeout_s)

    def deliver(self, bucket: Bucket) -> None:
        import ray

        ref = ray.put(bucket)
        try:  # the ref as a top-level argument: the actor reads the payload without a copy
            ray.get(self.actor.load_bucket.remote(ref), timeout=self.timeout_s)
        finally:
            del ref  # released now: the object store never holds two buckets of one sync

    def finish(self, version: int) -> dict[str, Any]:
        import ray

        return ray.get(self.actor.finish_sync.remote(version), timeout=self.timeout_s)


#: The weight transports by name.
TRANSPORTS: dict[str, type[WeightTransport]] = {
    "local": LocalTransport,
    "object_store": ObjectStoreTransport,
}


def transport_of(name: str, target: Any, **options: Any) -> WeightTransport:
    """The transport called `name` to `target` (an engine, or an actor's handle)."""
    try:
        cls = TRANSPORTS[name]
    except KeyError:
        raise ValueError(
            f"unknown weight transport {name!r}; the transports are {', '.join(TRANSPORTS)}"
        ) from None
    return cls(target, **options)


def sync_weights(
    transport: WeightTransport,
    named: Iterable[tuple[str, Any]],
    version: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: Any = None,
) -> SyncStats:
    """Send `named`'s tensors (every weight, or a LoRA adapter's) to the engine as policy
    `version`, in buckets of at most `bucket_bytes`, cast to `dtype` when given (the engine's,
    to send fewer bytes). Runs on rank 0; under FSDP `named` is ``weights.full_tensors(...)``,
    which the other ranks iterate beside it."""
    started = time.perf_counter()
    transport.begin(version)
    sent = count = largest = 0
    names: set[str] = set()
    for bucket in buckets(named, bucket_bytes, dtype):
        transport.deliver(bucket)
        sent += bucket.nbytes
        count += 1
        largest = max(largest, bucket.nbytes)
        names.update(e.name for e in bucket.entries)
    summary = transport.finish(version)
    return SyncStats(
        version=version,
        seconds=time.perf_counter() - started,
        bytes=sent,
        buckets=count,
        tensors=len(names),
        largest_bucket=largest,
        receiver=dict(summary or {}),
    )


@dataclass(frozen=True)
class PostedWeights:
    """A policy version's buckets, put in Ray's object store once for every engine.

    Attributes:
        version: the policy version they hold.
        refs: one object reference per bucket, in order (every weight, or the adapter's).
        bytes: the payload put, once (not once per engine).
    """

    version: int
    refs: tuple[Any, ...]
    bytes: int


def post_weights(
    named: Iterable[tuple[str, Any]],
    version: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: Any = None,
) -> PostedWeights:
    """Put `named`'s tensors in the object store as policy `version`, in buckets of at most
    `bucket_bytes` (cast to `dtype` when given), for engines to load when they are ready
    (``RemoteEngine.post``). The caller holds the result until every engine has had it: the
    objects live while it, or an engine that has not loaded them yet, holds a reference."""
    import ray

    refs, sent = [], 0
    for bucket in buckets(named, bucket_bytes, dtype):
        refs.append(ray.put(bucket))
        sent += bucket.nbytes
    return PostedWeights(version, tuple(refs), sent)
