"""An elastic run's evaluation reservation: the bundles its EvalOnSave tasks may hold at once,
asked of Ray's autoscaling coordinator at high priority, renewed, and cancelled at the end."""

from __future__ import annotations

import threading

from callbacks import EvalOnSave, TrainerCallback
from ray_trainer._actor import reservation
from ray_trainer._actor.reservation import EvalReservation, eval_bundles


def score(checkpoint_path, step):
    return {"score": 1.0}


def test_one_bundle_per_evaluation_that_may_run_at_once():
    callbacks = [
        EvalOnSave(score, num_gpus=1, num_cpus=2, max_in_flight=2),
        EvalOnSave(score, num_gpus=0, num_cpus=1, resources={"eval_slot": 1}),
        EvalOnSave(score, num_gpus=0, num_cpus=0),  # asks for nothing: nothing to reserve
        TrainerCallback(),
    ]
    assert eval_bundles(callbacks) == [
        {"CPU": 2.0, "GPU": 1.0},
        {"CPU": 2.0, "GPU": 1.0},
        {"CPU": 1.0, "eval_slot": 1.0},
    ]
    assert reservation.reserve("r", [TrainerCallback()]) is None  # no evaluation, no request


class FakeCoordinator:
    """Records the calls the reservation makes (the real one is Ray's detached actor)."""

    def __init__(self):
        self.calls = []
        self.renewed = threading.Event()
        outer = self

        class Method:
            def __init__(self, name):
                self.name = name

            def remote(self, *args, **kwargs):
                outer.calls.append((self.name, args, kwargs))
                if len(outer.calls) > 1:
                    outer.renewed.set()
                return None

        self.request_resources = Method("request")
        self.cancel_request = Method("cancel")


def test_the_request_is_made_at_once_renewed_and_cancelled(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(reservation, "RENEW_S", 0.05)
    coordinator = FakeCoordinator()
    bundles = [{"CPU": 1.0}]
    held = EvalReservation("my-run", bundles, coordinator).start()
    name, _, kwargs = coordinator.calls[0]  # made before start() returned
    assert name == "request" and kwargs["requester_id"] == "ray-trainer-eval:my-run"
    assert kwargs["resources"] == bundles and kwargs["expire_after_s"] == reservation.EXPIRE_S
    assert kwargs["priority"].name == "HIGH"  # served before the workers' request of the same
    assert coordinator.renewed.wait(5.0)
    held.cancel()
    assert coordinator.calls[-1] == ("cancel", ("ray-trainer-eval:my-run",), {})


def test_an_evaluation_that_asks_for_resources_runs_in_the_runs_placement_group():
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    placement = reservation.EvalPlacement("my-run", [{"CPU": 1.0}])
    assert placement.name == "ray-trainer-eval:my-run"  # an actor Ray restarted finds it
    placement.group = group = object()  # what `start` makes
    for asked in [(1, 0, {}), (0, 1, {}), (0, 0, {"eval_slot": 1})]:
        strategy = placement.strategy(*asked)
        assert isinstance(strategy, PlacementGroupSchedulingStrategy), asked
        assert strategy.placement_group is group
        assert strategy.placement_group_bundle_index == -1  # any bundle with room
    assert placement.strategy(0, 0, {}) is None  # asks for nothing: runs anywhere
    assert placement.strategy(0, 0, {"eval_slot": 0}) is None
