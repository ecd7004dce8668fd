"""Callback actor: an elastic run's evaluation resources, reserved so that Ray Train never
counts them as room for a worker.

Runs in the callback actor. Ray Train sizes an elastic worker group from the reservations of
Ray's autoscaling coordinator (the actor Ray Data and Ray Train share to divide the cluster's
nodes), which counts node totals: resources held by this run's own evaluation tasks would look
free, Ray Train would choose a size it cannot place, and the group would wait for a placement
until its start timed out. So the actor reserves, in that coordinator, what its `EvalOnSave`
tasks may hold at once, under a requester of its own. The request is made when the actor starts,
before Ray Train's controller makes its own, and at the same (high) priority: the coordinator
serves the earlier one first, so the workers are sized from what the evaluations leave. It is
renewed well inside the coordinator's expiry, and cancelled at the end of the run. On an
autoscaling cluster the coordinator also forwards the request to the autoscaler.

The coordinator is internal to Ray (``ray.data._internal``, Ray 2.60): if it cannot be reached,
a warning says so once and the run goes on without the reservation (`reserve` returns None).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger("ray_trainer")

#: The coordinator forgets a request after this long; it is renewed every `RENEW_S`.
EXPIRE_S = 180.0
RENEW_S = 30.0


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


def reserve(run_name: str, callbacks: list[Any]) -> EvalReservation | None:
    """Reserve the evaluations' resources of an elastic run; None when there is nothing to
    reserve, or Ray's coordinator cannot be reached (warned)."""
    bundles = eval_bundles(callbacks)
    if not bundles:
        return None
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
