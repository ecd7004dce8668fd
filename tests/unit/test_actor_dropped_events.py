"""The callback actor's count of dropped events, as `RayMetrics` reads it from the context."""

from __future__ import annotations

from ray_trainer._actor.actor import dropped_by_event


def test_every_droppable_event_is_there_at_zero_before_any_drop():
    assert dropped_by_event(["on_log", "on_step_end"], []) == {"on_log": 0, "on_step_end": 0}


def test_rank0_attempts_and_the_actor_queue_add_up_by_event():
    attempt0, attempt1, queue = {"on_log": 5}, {"on_log": 2, "on_step_end": 1}, {"on_log": 3}
    totals = dropped_by_event(["on_log"], [attempt0, attempt1, queue])
    assert totals == {"on_log": 10, "on_step_end": 1}
