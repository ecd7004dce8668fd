"""In each training worker (rank): the run's environment actors, reached as one pool.

Multi-turn GRPO runs each episode's environment (TRL's ``environment_factory``) and its tools on
Ray actors of their own (`env_host.EnvironmentHost`), not in the training process: a tool that
sleeps, blocks or crashes never holds the rank, and many episodes' calls overlap on one actor's
threads. Every rank builds the same `EnvironmentPool`; the ranks meet on one set of named
actors. A dead actor, or a call past ``tool_timeout_s``, is an `EnvironmentFault`: the pool has
already put a fresh actor in that slot, and the episode loop decides what becomes of the episode.
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from typing import Any

from ray_trainer._agents.env_host import EnvironmentHost, EnvironmentSpec, environment_tools

__all__ = [
    "EnvironmentFault",
    "EnvironmentHost",
    "EnvironmentPool",
    "EnvironmentSpec",
    "environment_tools",
]


class EnvironmentFault(RuntimeError):
    """An infrastructure fault of an episode's environment: its actor died, or a call ran past tool_timeout_s."""


def _deaths() -> tuple[type[BaseException], ...]:
    """Ray's errors that mean the actor, not the user's code, failed."""
    from ray import exceptions

    return (exceptions.RayActorError, exceptions.WorkerCrashedError)  # with ActorDied/Unavailable


class EnvironmentPool:
    """Runs in each training worker (rank): the run's environment actors as one rank sees them.

    Every rank builds the same pool: actor i of generation g is named ``f"{name}:{i}:{g}"`` in
    `namespace`, got if it exists and created if not (``get_if_exists``), so ranks share one set
    of actors (the first rank to ask creates it, owned by its process, so the actors end with the
    worker group). A rank that finds actor i dead moves slot i to generation g+1 (got or created
    again: two ranks that both see the death meet on the same new actor).

    `open`, `call` and `finish` send and return Ray references at once; `get` waits for one.
    Safe to use from several threads of the rank.
    """

    def __init__(self, spec: EnvironmentSpec, name: str, namespace: str | None = None) -> None:
        import ray

        self.spec = spec
        self.name = name
        self.namespace = namespace
        self.replaced = 0  # how many actors this rank replaced
        self._generations = [0] * spec.workers
        self._created: dict[str, Any] = {}  # the actors this rank created, by name
        self._lock = threading.Lock()  # guards the slots while one is replaced
        self._host = ray.remote(EnvironmentHost)
        self._actors = [self._get_or_create(i, 0) for i in range(spec.workers)]

    def slot(self, key: str) -> int:
        """The slot of an episode key: the same on every rank, and for every call of the key."""
        return zlib.crc32(key.encode()) % self.spec.workers

    def open(self, key: str, env: str | None, row: dict) -> Any:
        """Send `EnvironmentHost.open` for the episode; its reference."""
        return self._actor(key).open.remote(key, env, row)

    def call(self, key: str, calls: list[dict]) -> Any:
        """Send `EnvironmentHost.call` (one turn's tool calls); its reference."""
        return self._actor(key).call.remote(key, calls)

    def finish(self, key: str) -> Any:
        """Send `EnvironmentHost.finish` (reward and snapshot); its reference."""
        return self._actor(key).finish.remote(key)

    def drop(self, key: str) -> None:
        """Forget an abandoned episode, without waiting; never raises (a dead actor is fine)."""
        with contextlib.suppress(Exception):  # the episode is gone either way
            self._actor(key).drop.remote(key)

    def get(self, ref: Any, key: str, timeout_s: float | None = None) -> Any:
        """The value of one reference of `key`'s episode, waited for at most ``tool_timeout_s``
        (or `timeout_s`: what is left of it, for a caller that waited already).

        A dead actor, or a call past the timeout (the actor is killed then: a stuck tool holds
        its thread forever), puts a new actor in the key's slot and raises `EnvironmentFault`;
        an error of the user's code (a reset or a ``get_reward`` that raised) is raised as is.
        """
        import ray
        from ray.exceptions import GetTimeoutError, RayTaskError

        slot = self.slot(key)
        asked = self._id(self.actor(slot))  # the actor in the slot while this call was waited for
        try:
            return ray.get(ref, timeout=self.spec.timeout_s if timeout_s is None else timeout_s)
        except GetTimeoutError:
            self._replace(slot, asked)
            raise EnvironmentFault(
                f"an environment call of episode {key!r} ran past tool_timeout_s="
                f"{self.spec.timeout_s:g} s: environment actor {slot} was killed (with the "
                "episodes it held) and replaced; raise tool_timeout_s if the tools need longer"
            ) from None
        except _deaths() as e:
            if getattr(e, "actor_init_failed", False):
                raise RuntimeError(
                    f"environment actor {slot} could not start: {e}\nThe environment factories "
                    "and tools must be importable by Ray's workers (a module on the runtime "
                    "environment's PYTHONPATH or working_dir, or defined in the driver script)"
                ) from e
            self._replace(slot, getattr(e, "actor_id", None) or asked)
            raise EnvironmentFault(f"environment actor {slot} died: {e}") from e
        except RayTaskError as e:  # the user's code raised in the actor: that error, as is
            if e.cause is None:
                raise
            raise e.cause from e

    def wait(self, refs: list, timeout_s: float) -> tuple[list, list]:
        """``ray.wait`` for the first of `refs` ready, at most `timeout_s`: (ready, not ready)."""
        import ray

        if not refs:
            return [], []
        return ray.wait(list(refs), num_returns=1, timeout=timeout_s)

    def close(self) -> None:
        """Kill the actors this rank created (best effort, never raises); the others' creators
        kill theirs, and Ray ends them all with their owners' processes anyway."""
        import ray

        for actor in self._created.values():
            with contextlib.suppress(Exception):  # gone already, or Ray is shutting down
                ray.kill(actor, no_restart=True)
        self._created.clear()

    def actor(self, slot: int) -> Any:
        """The actor handle now in `slot` (for tests and diagnostics)."""
        with self._lock:
            return self._actors[slot]

    def _actor(self, key: str) -> Any:
        return self.actor(self.slot(key))

    def _name(self, slot: int, generation: int) -> str:
        return f"{self.name}:{slot}:{generation}"

    @staticmethod
    def _id(actor: Any) -> str:
        return actor._actor_id.hex()  # what Ray's death errors name (`RayActorError.actor_id`)

    def _replace(self, slot: int, failed: str) -> None:
        """Kill the slot's actor and move the slot to its next generation, unless the actor
        that failed (its id) is no longer the slot's: another thread of this rank replaced it."""
        import ray

        with self._lock:
            current = self._actors[slot]
            if self._id(current) != failed:
                return
            # dead already, or stuck in a tool: either way it holds nothing to keep
            with contextlib.suppress(Exception):
                ray.kill(current, no_restart=True)
            self._generations[slot] += 1
            self._actors[slot] = self._get_or_create(slot, self._generations[slot])
            self.replaced += 1

    def _get_or_create(self, slot: int, generation: int) -> Any:
        """The actor of `slot` at `generation`: got if a rank created it, else created here.

        What ``options(get_if_exists=True)`` does, step by step, so that the pool knows which
        actors it created (`close` kills those): ask for the name; create it if absent; if
        another rank created it in between (Ray refuses the taken name), get that one.
        """
        import ray
        from ray.exceptions import ActorAlreadyExistsError

        name = self._name(slot, generation)
        try:
            return ray.get_actor(name, namespace=self.namespace)
        except ValueError:
            pass
        res = self.spec.actor_resources
        other = {k: v for k, v in res.items() if k not in ("CPU", "GPU")}
        options = {
            "name": name,
            "namespace": self.namespace,
            "max_concurrency": self.spec.concurrency,
            "max_restarts": 0,
            "num_cpus": res.get("CPU", 0),
            "num_gpus": res.get("GPU", 0),
            **({"resources": other} if other else {}),
        }
        try:
            actor = self._host.options(**options).remote(self.spec)
        except ActorAlreadyExistsError:  # another rank's, created in between: ours to share
            return ray.get_actor(name, namespace=self.namespace)
        self._created[name] = actor
        return actor
