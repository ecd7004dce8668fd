"""Driver: what a run asks of the cluster, in one description read by the fit check and by the
embedded Ray's size.

Runs in the driver, before Ray starts and once joined. A run's :class:`Demand` is its training
workers (one worker's Ray resources; the elastic ``min`` a step needs, the ``max`` that may run)
and what it places beside them, each kind a :class:`~ray_trainer._objectives.base.Beside`:

- what the objective places (``beside_workers``: GRPO's rollout engines and reward tasks); a
  later kind of process (an agent's environment actors) adds its entries there, and both
  readers below count it without a change;
- the ``EvalOnSave`` evaluation tasks that may run at once (``max_in_flight``, at least one).

Two readers: the fit check (``resources.py``) places the workers and then each ``needed``
entry, and refuses a run a fixed cluster can never hold; :func:`embedded_cpus` sizes the
embedded local Ray for everything that may hold a CPU at once. What asks for no CPU is not
counted: the callback actor, Ray Train's controller and GRPO's rollout queue ask for none, and
the data's encoding and reference tasks run before the workers start, one CPU each at least.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from callbacks import EvalOnSave
from ray_trainer._actor.reservation import eval_bundles
from ray_trainer._config.args import TrainingArgs
from ray_trainer._objectives import Beside, objective_of
from ray_trainer._placement import CallbackLists

#: The embedded Ray shares each of the machine's cores among at most this many logical CPUs: a
#: run whose steps need more is refused before Ray starts (`num_workers=64` on 2 cores would
#: thrash), and what may run beyond it waits for room.
MAX_SHARE = 4


def per_worker(args: TrainingArgs) -> dict[str, float]:
    """The Ray resources of one training worker."""
    res = dict(args.resources_per_worker) if args.resources_per_worker else {"CPU": 1.0}
    if args.use_gpu:
        res.setdefault("GPU", 1.0)
    return res


def evaluations(lists: CallbackLists) -> list[EvalOnSave]:
    """The run's `EvalOnSave` callbacks (the user's, then the global ones)."""
    entries = [u[1] if isinstance(u, tuple) else u for u in lists["user"]] + lists["global"]
    return [cb for cb in entries if isinstance(cb, EvalOnSave)]


@dataclass(frozen=True)
class Demand:
    """A run's training workers and what it places beside them.

    Args:
        worker: the Ray resources of one training worker.
        workers: ``(needed, at_once)``: the workers a step needs (an elastic run's ``min``) and
            the most that may run (``max``).
        beside: what the run places beside them, in the order the fit check places it.
    """

    worker: dict[str, float]
    workers: tuple[int, int]
    beside: tuple[Beside, ...] = ()

    def at_once(self, resource: str = "CPU") -> float:
        """How much of `resource` everything that may run at once holds."""
        held = self.workers[1] * self.worker.get(resource, 0.0)
        return held + sum(b.at_once * b.resources.get(resource, 0.0) for b in self.beside)

    def asks(self, resource: str) -> bool:
        """Whether anything of the run asks for `resource` (``"GPU"``)."""
        return any(res.get(resource, 0.0) > 0 for _, _, res in self._entries())

    def counts(self, resource: str = "CPU") -> list[tuple[str, int]]:
        """How many of each kind that holds `resource` may run at once, as ``(noun, count)`` in
        the description's order (``[("worker", 2), ("rollout engine", 1), ...]``)."""
        out: dict[str, int] = {}
        for noun, n, res in self._entries():
            if n and res.get(resource, 0.0) > 0:
                out[noun] = out.get(noun, 0) + n
        return list(out.items())

    def _entries(self) -> Iterator[tuple[str, int, dict[str, float]]]:
        yield "worker", self.workers[1], self.worker
        for b in self.beside:
            yield b.noun, b.at_once, b.resources


def run_demand(args: TrainingArgs, lists: CallbackLists | None = None) -> Demand:
    """`args`' demand: its workers, what its objective places beside them and, given its
    callback `lists`, its evaluation tasks."""
    beside = list(objective_of(args.objective).beside_workers(args))
    if lists is not None:
        beside += [Beside("evaluation task", b) for b in eval_bundles(evaluations(lists))]
    return Demand(per_worker(args), (args.min_workers, args.max_workers), tuple(beside))


def embedded_cpus(demand: Demand, cores: float) -> int:
    """The logical CPUs the embedded Ray offers a run on a machine of `cores`: the cores, or
    the CPUs of everything of the run that may run at once where that is more (its processes
    then share the cores), up to :data:`MAX_SHARE` per core. Against that bound the fit check
    refuses what a step needs and cannot have; the rest waits for room."""
    need = math.ceil(demand.at_once("CPU") - 1e-9)  # 2.0000000001 of float sums is 2
    return int(max(cores, min(need, MAX_SHARE * cores)))


def embedded_where(cores: float) -> str:
    """The embedded Ray, as a refusal names it."""
    return (
        f"the embedded Ray (this machine: {cores:g} cores, at most {MAX_SHARE} logical CPUs each)"
    )
