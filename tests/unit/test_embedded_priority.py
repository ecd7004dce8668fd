"""The embedded Ray starts its workers (the training ranks) at its daemons' priority."""

from __future__ import annotations

import ray

from ray_trainer._driver import console


def _start(monkeypatch) -> dict:
    """`start_embedded_ray` with `ray.init` replaced; what it sets in the environment stays in
    a copy (a variable it sets would otherwise outlive the test: `delenv` of a variable that is
    not there records nothing to undo)."""
    seen = {}
    monkeypatch.setattr(console.os, "environ", dict(console.os.environ))

    def fake_init(**options):
        seen["niceness"] = console.os.environ.get("RAY_worker_niceness")
        seen["options"] = options

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(console, "filter_ray_noise", lambda: True)
    console.start_embedded_ray(2, dashboard=False)
    return seen


def test_workers_start_at_niceness_zero(monkeypatch):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    monkeypatch.delenv("RAY_TRAIN_ENABLE_STATE_TRACKING", raising=False)
    assert _start(monkeypatch)["niceness"] == "0"


def test_a_niceness_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("RAY_worker_niceness", "10")
    monkeypatch.delenv("RAY_TRAIN_ENABLE_STATE_TRACKING", raising=False)
    assert _start(monkeypatch)["niceness"] == "10"
