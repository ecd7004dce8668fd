"""The rollout queue's actor: every rank's asynchronous rollouts in one place, between the engines and the trainer.

Runs as a Ray actor of its own (:class:`RolloutBuffer`), one per worker-group start of a GRPO run
with ``max_staleness`` k >= 1: rank 0 creates it on its own node, holding no CPU (it waits on
engines and runs the reward functions' Ray tasks), and it ends with rank 0's process. It holds a
``queue.RolloutQueue`` per rank, which follows each request the rank sends: an engine lost with
its node or by itself has its requests sent again at once to the engines left, and each answer is
scored as it comes; the trainer takes its step's rollouts from it, scored. It holds at most k + 1
steps of rollouts per rank. :class:`RemoteQueue` is a rank's handle on it, with the same
interface as a ``RolloutQueue`` in the rank's own process (the unit tests').
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray_trainer._rollout.actor import RemoteEngine
from ray_trainer._rollout.queue import RolloutQueue, Serving, Taken

#: How long one call to the queue's actor may take (a `take` waits for the engine's answer
#: and its scoring: as long as a rollout may).
CALL_TIMEOUT_S = 1800.0


def buffer_name(actor_name: str, attempt: int) -> str:
    """The Ray actor name of a worker-group start's rollout queue."""
    return f"{actor_name}:rollouts:{attempt}"


class RolloutBuffer:
    """The Ray actor (a threaded one: each rank's `take` waits on a thread of its own).

    Args:
        max_staleness: k (see ``queue.RolloutQueue``).
        world_size: the ranks of the worker-group start.
        score: ``score(step, completions)``, a step's completions scored (picklable).
    """

    def __init__(
        self, max_staleness: int, world_size: int, score: Callable[[int, list[Any]], Any]
    ) -> None:
        self.serving = Serving()
        self.queues = [
            RolloutQueue(max_staleness, score, rank=r, serving=self.serving)
            for r in range(world_size)
        ]

    def serve(self, engines: dict[int, Any]) -> None:
        """The serving engines' actors by slot, as rank 0 last agreed them."""
        self.serving.set({slot: RemoteEngine.attach(a) for slot, a in engines.items()})

    def submit(self, rank: int, step: int, slot: int, actor: Any, rows, prompt_ids, params) -> int:
        """Rank `rank`'s rollout request of step `step`, to the engine `actor` (slot `slot`):
        the rank's requests in flight now."""
        queue = self.queues[rank]
        queue.submit(step, slot, RemoteEngine.attach(actor), rows, prompt_ids, params)
        return len(queue)

    def take(self, rank: int, rows: list[int], trainer_version: int) -> Taken:
        return self.queues[rank].take(rows, trainer_version)

    def clear(self, rank: int) -> None:
        self.queues[rank].clear()

    def depths(self) -> list[int]:
        """Each rank's requests in flight."""
        return [len(q) for q in self.queues]


class RemoteQueue:
    """A rank's handle on the run's :class:`RolloutBuffer`: a ``queue.RolloutQueue``'s interface
    (``submit``, ``take``, ``clear``, ``serve``, ``room``, ``len``), each call one Ray call.

    Args:
        actor: the buffer's actor handle.
        rank: this rank.
        max_staleness: k.
    """

    def __init__(self, actor: Any, rank: int, max_staleness: int) -> None:
        self.actor, self.rank, self.max_staleness = actor, rank, max_staleness
        self._count = 0  # this rank's requests in flight (the actor's count, mirrored)

    @classmethod
    def create(
        cls,
        name: str,
        namespace: str,
        max_staleness: int,
        world_size: int,
        score: Callable[[int, list[Any]], Any],
    ) -> RemoteQueue:
        """Rank 0: the buffer's actor, on this node, named `name` (other ranks `attach`)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        options = {
            "name": name, "namespace": namespace, "num_cpus": 0, "max_restarts": 0,
            "max_concurrency": 2 * world_size + 8, "scheduling_strategy": here,
        }  # fmt: skip
        actor = (
            ray.remote(RolloutBuffer).options(**options).remote(max_staleness, world_size, score)
        )
        return cls(actor, 0, max_staleness)

    @classmethod
    def attach(cls, name: str, namespace: str, rank: int, max_staleness: int) -> RemoteQueue:
        import ray

        return cls(ray.get_actor(name, namespace=namespace), rank, max_staleness)

    def __len__(self) -> int:
        return self._count

    def room(self) -> int:
        return self.max_staleness - self._count

    def _get(self, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(
                f"grpo: the rollout queue's actor died ({e}); the worker group restarts from "
                "its last checkpoint, and the prompts in flight are asked for again"
            ) from e

    def serve(self, engines: dict[int, RemoteEngine]) -> None:
        self._get(self.actor.serve.remote({slot: e.actor for slot, e in engines.items()}))

    def submit(
        self,
        step: int,
        slot: int,
        engine: RemoteEngine,
        rows: list[int],
        prompt_ids: list[list[int]],
        params: Any,
    ) -> None:
        ref = self.actor.submit.remote(
            self.rank, step, slot, engine.actor, rows, prompt_ids, params
        )
        self._count = self._get(ref)

    def take(self, rows: list[int], trainer_version: int) -> Taken:
        self._count = max(self._count - 1, 0)
        return self._get(self.actor.take.remote(self.rank, rows, trainer_version))

    def clear(self) -> None:
        self._get(self.actor.clear.remote(self.rank))
        self._count = 0

    def close(self) -> None:
        """Rank 0, at the run's end: the actor ended (it also ends with rank 0's process)."""
        import ray

        ray.kill(self.actor, no_restart=True)


__all__ = ["CALL_TIMEOUT_S", "RemoteQueue", "RolloutBuffer", "buffer_name"]
