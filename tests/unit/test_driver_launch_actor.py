"""The driver's wait for the callback actor (`launch.wait_for_actor`, an elastic run's): a
start that outlasts `callback_timeout_s` is a RunFailedError naming the field and the fix, and
the actor is removed; never Ray's bare GetTimeoutError. `ray.get` and `ray.kill` replaced: no
Ray starts here."""

from __future__ import annotations

import pytest
import ray
from ray.exceptions import GetTimeoutError

from ray_trainer import RunFailedError, TrainingArgs
from ray_trainer._driver import launch


def _launch() -> launch.Launch:
    return launch.Launch(spec=None, actor="the actor", actor_ready="its ready reference")


def test_an_actor_that_does_not_start_in_time_fails_the_run_naming_the_field(monkeypatch):
    asked, killed = [], []

    def late(ref, timeout):
        asked.append((ref, timeout))
        raise GetTimeoutError("Get timed out: some object(s) not ready.")

    monkeypatch.setattr(ray, "get", late)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: killed.append((actor, no_restart)))
    args = TrainingArgs(model="demo", data="demo", run_name="r", callback_timeout_s=7)
    with pytest.raises(RunFailedError) as failed:
        launch.wait_for_actor(_launch(), args)
    message = str(failed.value)
    assert "callback_timeout_s=7 s" in message and "'r'" in message
    assert "Raise callback_timeout_s" in message and "nothing was trained" in message
    assert asked == [("its ready reference", 7.0)]
    assert killed == [("the actor", True)]


def test_an_actor_that_starts_is_waited_for_once(monkeypatch):
    asked = []
    monkeypatch.setattr(ray, "get", lambda ref, timeout: asked.append(timeout))
    monkeypatch.setattr(ray, "kill", lambda *a, **k: pytest.fail("a started actor was killed"))
    launch.wait_for_actor(_launch(), TrainingArgs(model="demo", data="demo"))
    assert asked == [60.0]
