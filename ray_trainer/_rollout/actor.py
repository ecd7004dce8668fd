"""In the rollout actor (its class) and on rank 0 of the training workers (its handle): an engine on Ray.

`RolloutActor` is the Ray actor that holds one rollout engine for a run, on resources of its own
(``rollout_resources``: ``{"CPU": 1}``, ``{"GPU": 0.3}`` beside a worker's 0.7 ...). It is
built once; new weights arrive through the object store (``transport.ObjectStoreTransport``),
never by restarting it. `RemoteEngine` is how the trainer side uses it: generate, sync, probe,
each waiting with a timeout, and a dead actor raised as `RolloutEngineDied` (or seen by
`alive`, or by `state` without waiting).

Its calls run one at a time, in the order sent, so a sync sent after a request waits for it;
except `post`, `probed` and `info`, in a concurrency group of their own (`CONTROL`), answered
while a request runs: an asynchronous run posts each version's weights (put in the object store once,
``transport.post_weights``) and the engine takes them at its next request boundary: between two
batches of a request for ``hf``, between two decoding steps for ``vllm`` (at once when idle), so
the trainer never waits for the requests ahead of a sync (the engines' pause-and-update). Ray does not restart it (``max_restarts=0``): replacing
it, and syncing the replacement, is the training loop's policy (``grpo_pool.py``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable
from math import inf
from typing import Any

from ray_trainer._rollout.engine import EngineSpec, SamplingParams
from ray_trainer._rollout.engines import build_engine, resolve_backend
from ray_trainer._rollout.probe import Probe
from ray_trainer._rollout.transport import ObjectStoreTransport, PostedWeights, sync_weights
from ray_trainer._rollout.types import Completion
from ray_trainer._rollout.weights import DEFAULT_BUCKET_BYTES, Bucket, SyncStats

#: The actor's concurrency group for `post`, `probed` and `info`: one thread beside its
#: requests'.
CONTROL = "control"


class RolloutEngineDied(RuntimeError):
    """The rollout engine's actor died (its process ended, or its node was lost)."""


class RolloutActor:
    """The Ray actor's class: one engine of `backend` built from `spec` (and `state_dict`).

    Runs in its own Ray worker process; Ray runs its calls one at a time, so a sync's buckets
    and a rollout never interleave. `post`, `probed` and `info` run on a thread of their own
    (the `CONTROL` group): a version posted while a request runs is loaded by the request's
    thread at its next boundary; one posted to an idle engine is loaded at once.
    """

    def __init__(
        self, backend: str, spec: EngineSpec, state_dict: dict[str, Any] | None = None
    ) -> None:
        self.backend = resolve_backend(backend, spec)
        self.engine = build_engine(self.backend, spec, state_dict)
        self.first_version: Any = None  # the policy version of its first request
        self.requests = 0
        self._lock = threading.Lock()  # guards `_posted`
        self._busy = threading.Lock()  # held by a call of the request thread, while it runs
        #: A version posted and not taken yet: (version, its buckets' references, the probe).
        self._posted: tuple[int, list[Any], Probe | None] | None = None
        self._probed: dict[int, list[float]] = {}  # the probe's log-probs of the last taken
        self.boundaries = 0  # request boundaries passed inside requests (weights fixed there)
        self.engine.on_boundary = self._at_boundary

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        prompt_indices: list[int] | None = None,
    ) -> list[Completion]:
        with self._busy:
            return self._generate(prompts, params, prompt_indices)

    def generate_timed(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        prompt_indices: list[int] | None = None,
    ) -> tuple[list[Completion], float, float]:
        """`generate`, with the wall-clock times (``time.time()``) it began and ended: an
        asynchronous rollout's caller sees how much of it ran while it trained."""
        with self._busy:
            started = time.time()
            completions = self._generate(prompts, params, prompt_indices)
            return completions, started, time.time()

    def _generate(
        self, prompts: list[list[int]], params: SamplingParams, prompt_indices: list[int] | None
    ) -> list[Completion]:
        self._take_posted()
        if not self.requests:
            self.first_version = self.engine.version
        self.requests += 1
        return self.engine.generate(prompts, params, prompt_indices)

    def logprobs(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float
    ) -> list[float]:
        with self._busy:
            return self.engine.logprobs(prompt_ids, completion_ids, temperature)

    def begin_sync(self, version: int) -> None:
        with self._busy:
            self.engine.begin_sync(version)

    def load_bucket(self, bucket: Bucket) -> int:
        with self._busy:
            return self.engine.load_bucket(bucket)

    def finish_sync(self, version: int) -> dict[str, Any]:
        with self._busy:
            return self.engine.finish_sync(version)

    def post(self, version: int, refs: list[Any], probe: Probe | None = None) -> int:
        """Policy `version`'s buckets (`refs`, read when taken): loaded now, then `probe`
        scored (`probed`), when the engine is idle; else held for the running request's next
        boundary (a version posted before and not taken yet is passed over). Answered while a
        request runs (`CONTROL`); returns the version the engine holds now."""
        with self._lock:
            self._posted = (int(version), list(refs), probe)
        if self._busy.acquire(blocking=False):  # idle: nothing to pause, load it here
            try:
                self._take_posted()
            finally:
                self._busy.release()
        else:  # a request runs: its engine may take them inside it (vLLM: between two steps)
            self.engine.posted()
        return self.engine.version

    def probed(self, version: int) -> list[float] | None:
        """The probe's log-probs the engine took right after loading posted `version` (None:
        not loaded yet, or passed over for a newer one)."""
        return self._probed.get(int(version))

    def _at_boundary(self) -> None:
        """A boundary inside a request (`RolloutEngine.boundary`): posted weights taken, then
        counted, so that once `info` shows it the batch after it samples with those weights."""
        self._take_posted()
        self.boundaries += 1

    def _take_posted(self) -> None:
        """Load the version posted, if any: at a request boundary (on the request's thread),
        or when posted to an idle engine (the caller holds `_busy` either way)."""
        with self._lock:
            posted, self._posted = self._posted, None
        if posted is None:
            return
        version, refs, probe = posted
        self.engine.begin_sync(version)
        for ref in refs:
            self.engine.load_bucket(_fetched(ref))
        self.engine.finish_sync(version)
        if probe is not None:
            self._probed = {
                version: self.engine.logprobs(
                    list(probe.prompt_ids), list(probe.completion_ids), probe.temperature
                )
            }

    def info(self) -> dict[str, Any]:
        """Who answers: the backend, the policy version held, the device, the process id, the
        requests answered, the version that answered the first, and the boundaries passed
        inside requests (``hf``: a batch's start; ``vllm``: a decoding step's)."""
        device = getattr(self.engine, "device", None)
        return {
            "backend": self.backend,
            "version": self.engine.version,
            "device": None if device is None else str(device),
            "pid": os.getpid(),
            "requests": self.requests,
            "first_version": self.first_version,
            "boundaries": self.boundaries,
        }

    def close(self) -> None:
        self.engine.close()


def _fetched(ref: Any) -> Bucket:
    """A posted bucket: read from the object store (a bucket itself: an engine in-process)."""
    if isinstance(ref, Bucket):
        return ref
    import ray

    return ray.get(ref)


def actor_options(resources: dict[str, float] | None) -> dict[str, Any]:
    """Ray's actor options for ``rollout_resources`` (``{"CPU": 1}``, ``{"GPU": 0.3}``, custom
    resources), fractions allowed; a resource left out is not taken."""
    rest = dict(resources if resources is not None else {"CPU": 1})
    for key, value in rest.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < inf:
            raise ValueError(
                f"rollout_resources[{key!r}] must be a number >= 0, got {value!r} "
                '(e.g. {"CPU": 1} or {"GPU": 0.3})'
            )
    return {
        "num_cpus": float(rest.pop("CPU", 0)),
        "num_gpus": float(rest.pop("GPU", 0)),
        "resources": {k: float(v) for k, v in rest.items()},
    }


class RemoteEngine:
    """A rollout engine in its Ray actor, as the trainer side drives it.

    Args:
        backend: ``"hf"``, ``"vllm"`` or ``"auto"``.
        spec: how the engine builds its model (`EngineSpec`).
        resources: the actor's ``rollout_resources`` (default ``{"CPU": 1}``).
        state_dict: weights to start from instead of the spec's.
        timeout_s: the longest one call (a rollout, a bucket) may take.
        options: more Ray actor options (``name``, ``scheduling_strategy`` ...).
    """

    def __init__(
        self,
        backend: str,
        spec: EngineSpec,
        resources: dict[str, float] | None = None,
        *,
        state_dict: dict[str, Any] | None = None,
        timeout_s: float = 600.0,
        **options: Any,
    ) -> None:
        import ray

        remote = ray.remote(concurrency_groups={CONTROL: 1})(RolloutActor).options(
            **actor_options(resources), max_restarts=0, max_task_retries=0, **options
        )
        self.actor = remote.remote(backend, spec, state_dict)
        self.timeout_s = timeout_s
        self._up = False
        self._ping = self._info()  # answered once the engine's model is loaded

    @classmethod
    def attach(cls, actor: Any, timeout_s: float = 600.0) -> RemoteEngine:
        """A handle on an engine actor another process created (found by its name)."""
        engine = cls.__new__(cls)
        engine.actor, engine.timeout_s = actor, timeout_s
        engine._up, engine._ping = True, None
        return engine

    def state(self) -> str:
        """``"starting"`` (its actor is pending or loading its model), ``"up"`` or ``"dead"``,
        without waiting: one ``info`` call in flight at a time, read when answered (answered
        while a request runs: `CONTROL`)."""
        import ray

        if self._ping is None:
            self._ping = self._info()
        ready, _ = ray.wait([self._ping], timeout=0)
        if not ready:
            return "up" if self._up else "starting"
        try:
            ray.get(self._ping)
        except ray.exceptions.RayError:
            return "dead"
        self._up, self._ping = True, self._info()
        return "up"

    @staticmethod
    def wait_any(engines: list[RemoteEngine], timeout_s: float) -> None:
        """Return when one of `engines` may have changed `state` (an ``info`` answered or
        failed), or after `timeout_s`."""
        import ray

        pings = [e._ping for e in engines if e._ping is not None]
        if pings:
            ray.wait(pings, num_returns=1, timeout=timeout_s)
        else:
            time.sleep(min(timeout_s, 0.1))

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        prompt_indices: list[int] | None = None,
    ) -> list[Completion]:
        """The engine's completions (see `RolloutEngine.generate`)."""
        return self._get(self.actor.generate.remote(prompts, params, prompt_indices))

    def submit(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        prompt_indices: list[int] | None = None,
    ) -> Any:
        """Request a rollout without waiting: the reference of ``generate_timed``'s answer
        (take it with :meth:`result`). The actor runs its calls one at a time, in order, so a
        sync sent after this request lands after it: between requests."""
        return self.actor.generate_timed.remote(prompts, params, prompt_indices)

    def result(self, ref: Any) -> tuple[list[Completion], float, float]:
        """A submitted request's completions and times (waits up to the call timeout)."""
        return self._get(ref)

    def sync(
        self,
        named: Iterable[tuple[str, Any]],
        version: int,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: Any = None,
    ) -> SyncStats:
        """Send `named`'s tensors as policy `version`, a bucket at a time through the object
        store (see `transport.sync_weights`)."""
        import ray

        transport = ObjectStoreTransport(self.actor, self.timeout_s)
        try:
            return sync_weights(transport, named, version, bucket_bytes=bucket_bytes, dtype=dtype)
        except ray.exceptions.RayActorError as e:
            raise RolloutEngineDied(f"the rollout engine died during sync {version}: {e}") from e

    def post(self, posted: PostedWeights, probe: Probe | None = None) -> int:
        """Hand `posted` to the engine without waiting for its requests: it loads them at
        its next request boundary, then scores `probe` (read it with `probed`). Answered at
        once; the version the engine holds now."""
        call = self.actor.post.options(concurrency_group=CONTROL)
        return self._get(call.remote(posted.version, list(posted.refs), probe))

    def probed(self, version: int) -> list[float] | None:
        """The engine's probe log-probs on posted `version`, once it has loaded it (else None)."""
        return self._get(self.actor.probed.options(concurrency_group=CONTROL).remote(version))

    def probe(self, probe: Probe) -> list[float]:
        """The engine's per-token log-probs of the probe completion."""
        return self._get(
            self.actor.logprobs.remote(
                list(probe.prompt_ids), list(probe.completion_ids), probe.temperature
            )
        )

    def info(self) -> dict[str, Any]:
        """The actor's `RolloutActor.info`, answered while a request runs."""
        return self._get(self._info())

    def _info(self) -> Any:
        return self.actor.info.options(concurrency_group=CONTROL).remote()

    def alive(self, timeout_s: float = 10.0) -> bool:
        """Whether the actor answers within `timeout_s` (False once it has died)."""
        import ray

        try:
            ray.get(self._info(), timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False
        return True

    def close(self, timeout_s: float = 60.0) -> None:
        """Let the engine free what it holds (the ``"vllm"`` engine: its child, vLLM's
        processes, its files in ``/dev/shm``), then end the actor; a dead one is only ended."""
        import ray

        gone = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)
        with contextlib.suppress(*gone):
            ray.get(self.actor.close.remote(), timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        """End the actor (and its engine) now. Ray ends it asynchronously: a call sent right
        after may still be answered; `alive` turns False once it is gone."""
        import ray

        ray.kill(self.actor, no_restart=True)

    def _get(self, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.RayActorError as e:
            raise RolloutEngineDied(f"the rollout engine died: {e}") from e
