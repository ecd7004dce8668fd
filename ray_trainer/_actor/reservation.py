"""Callback actor: an elastic run's evaluation resources, reserved so that Ray Train never
counts them as room for a worker, nor takes them.

Runs in the callback actor. Two holds, made when the actor starts (the driver waits for it
before an elastic run's `fit`, so both come before Ray Train's controller asks for workers):

- **In Ray's autoscaling coordinator** (`EvalReservation`). Ray Train sizes an elastic worker
  group from the reservations of that coordinator (the actor Ray Data and Ray Train share to
  divide the cluster's nodes), which counts node totals: resources held by this run's own
  evaluation tasks would look free, Ray Train would choose a size it cannot place, and the
  group would wait for a placement until its start timed out. So the actor reserves there what
  its `EvalOnSave` tasks may hold at once, under a requester of its own, at the same (high)
  priority as the workers' request, and earlier: the coordinator serves it first. It is renewed
  well inside the coordinator's expiry, and cancelled at the end of the run. On an autoscaling
  cluster the coordinator also forwards the request to the autoscaler.
- **In a placement group** (`EvalPlacement`), which the evaluation tasks run in. The
  coordinator steers the size Ray Train chooses, but not where its workers land: right after a
  node is lost, Ray Train 2.60 first restarts the group at its old size, and that start took an
  evaluation's idle CPU whenever no evaluation held it at that moment (the evaluations then
  waited until the group changed again). The group holds the bundles for the run; Ray moves
  them to another node if theirs is lost. It is named after the run: an actor that Ray restarted
  takes the group it made before, if Ray kept it.

The coordinator is internal to Ray (``ray.data._internal``, Ray 2.60): if it cannot be reached,
a warning says so once and the run goes on without that hold.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("ray_trainer")

#: The coordinator forgets a request after this long; it is renewed every `RENEW_S`.
EXPIRE_S = 180.0
RENEW_S = 30.0
#: How long the actor's start waits for the evaluations' placement group (an autoscaler may need
#: minutes to add its node: the run goes on, and the evaluations wait for the group).
PLACEMENT_WAIT_S = 20.0


def eval_bundles(callbacks: list[Any]) -> list[dict[str, float]]:
    """One resource bundle per evaluation task the run's `EvalOnSave` callbacks may run at
    once (their `max_in_flight`; an elastic run caps an unbounded one at 1)."""
    from callbacks.builtin.eval_on_save import EvalOnSave

    bundles = []
    for cb in callbacks:
        if isinstance(cb, EvalOnSave):
            bundle = {"CPU": float(cb.num_cpus), "GPU": float(cb.num_gpus), **cb.resources}
            bundle = {k: float(v) for k, v in bundle.items() if v}
            bundles += [bundle] * (cb.max_in_flight or 1)
    return [b for b in bundles if b]


class EvalReservation:
    """The coordinator request for `bundles`, renewed by a daemon thread until `cancel`."""

    def __init__(self, run_name: str, bundles: list[dict[str, float]], coordinator: Any) -> None:
        self.requester = f"ray-trainer-eval:{run_name}"
        self.bundles = bundles
        self._coordinator = coordinator
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="eval-reservation", daemon=True)

    def start(self) -> EvalReservation:
        self._request()  # at once: before Ray Train's controller asks for the workers
        self._thread.start()
        return self

    def _request(self) -> None:
        import ray
        from ray.data._internal.cluster_autoscaler.base_autoscaling_coordinator import (
            ResourceRequestPriority,
        )

        ray.get(
            self._coordinator.request_resources.remote(
                requester_id=self.requester,
                resources=self.bundles,
                expire_after_s=EXPIRE_S,
                priority=ResourceRequestPriority.HIGH,
            ),
            timeout=30,
        )

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                self._request()
            except Exception as e:  # the coordinator restarting: the next renewal tries again
                logger.warning("could not renew the evaluation reservation: %s", e)

    def cancel(self) -> None:
        """Give the reserved resources back (the run has ended)."""
        import ray

        self._stop.set()
        try:
            ray.get(self._coordinator.cancel_request.remote(self.requester), timeout=10)
        except Exception as e:  # it expires by itself after EXPIRE_S
            logger.warning("could not cancel the evaluation reservation: %s", e)


class EvalPlacement:
    """A placement group holding `bundles` for the run, and the scheduling strategy that puts
    an evaluation task asking for resources into it (a task asking for none stays outside)."""

    def __init__(self, run_name: str, bundles: list[dict[str, float]]) -> None:
        self.name = f"ray-trainer-eval:{run_name}"
        self.bundles = bundles
        self.group: Any = None

    def start(self, wait_s: float = PLACEMENT_WAIT_S) -> EvalPlacement:
        """Create the group, or take the one this run's actor made before Ray restarted it."""
        from ray.util.placement_group import get_placement_group, placement_group

        try:
            self.group = get_placement_group(self.name)
        except ValueError:  # none yet
            self.group = placement_group(self.bundles, strategy="PACK", name=self.name)
        if not self.group.wait(timeout_seconds=wait_s):
            logger.warning(
                "the evaluations' resources %s are not placed after %.0f s; evaluations wait "
                "for them (an autoscaler may be adding their node)",
                self.bundles,
                wait_s,
            )
        return self

    def strategy(self, num_cpus: float, num_gpus: float, resources: dict[str, float]) -> Any:
        """Where an evaluation task asking for these resources runs: in any bundle with room
        (None: it asks for nothing, and runs anywhere)."""
        if not (num_cpus or num_gpus or any(resources.values())):
            return None
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=-1)

    def cancel(self) -> None:
        """Give the bundles back (the run has ended)."""
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.group)
        except Exception as e:  # it goes with the actor anyway
            logger.warning("could not remove the evaluations' placement group: %s", e)


@dataclass
class Reservations:
    """An elastic run's holds on its evaluations' resources (see the module's text)."""

    placement: EvalPlacement
    coordinator: EvalReservation | None

    def cancel(self) -> None:
        if self.coordinator is not None:
            self.coordinator.cancel()
        self.placement.cancel()


def reserve(run_name: str, callbacks: list[Any]) -> Reservations | None:
    """Hold the evaluations' resources of an elastic run: a placement group, and a request in
    Ray's autoscaling coordinator (left out, warned, when it cannot be reached). None when the
    evaluations ask for nothing."""
    bundles = eval_bundles(callbacks)
    if not bundles:
        return None
    placement = EvalPlacement(run_name, bundles).start()
    return Reservations(placement, _request(run_name, bundles))


def _request(run_name: str, bundles: list[dict[str, float]]) -> EvalReservation | None:
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        return EvalReservation(run_name, bundles, get_or_create_autoscaling_coordinator()).start()
    except Exception as e:
        logger.warning(
            "elastic run %s: could not reserve its evaluations' resources %s in Ray's "
            "autoscaling coordinator (%s); Ray Train may count them as room for a worker",
            run_name,
            bundles,
            e,
        )
        return None
