"""The embedded Ray starts its workers (the training ranks) at its daemons' priority."""

from __future__ import annotations

import pytest
import ray

from ray_trainer._driver import console


def _start(monkeypatch, dashboard: bool = False) -> dict:
    """`start_embedded_ray` with `ray.init` replaced; what it sets in the environment stays in
    a copy (a variable it sets would otherwise outlive the test: `delenv` of a variable that is
    not there records nothing to undo)."""
    seen = {}
    monkeypatch.setattr(console.os, "environ", dict(console.os.environ))

    def fake_init(**options):
        seen["niceness"] = console.os.environ.get("RAY_worker_niceness")
        seen["watcher"] = console.os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER")
        seen["poll"] = console.os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")
        seen["options"] = options

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(console, "filter_ray_noise", lambda: True)
    console.start_embedded_ray(2, dashboard=dashboard)
    return seen


def test_workers_start_at_niceness_zero(monkeypatch):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    monkeypatch.delenv("RAY_TRAIN_ENABLE_STATE_TRACKING", raising=False)
    assert _start(monkeypatch)["niceness"] == "0"


def test_a_niceness_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("RAY_worker_niceness", "10")
    monkeypatch.delenv("RAY_TRAIN_ENABLE_STATE_TRACKING", raising=False)
    assert _start(monkeypatch)["niceness"] == "10"


def test_no_preemption_watcher_on_the_embedded_ray_and_nothing_left_in_the_driver(monkeypatch):
    """Ray's processes (its controller reads the variable) start without Ray Train's preemption
    watcher; the driver's own environment is as it was after the start."""
    monkeypatch.delenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", raising=False)
    assert _start(monkeypatch, dashboard=True)["watcher"] == "0"
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in console.os.environ


def test_the_controller_polls_every_quarter_second_on_the_embedded_ray(monkeypatch):
    """Ray's processes start with the controller's poll at 0.25 s, gone from the driver's own
    environment after the start; a value the user set is kept."""
    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    assert _start(monkeypatch)["poll"] == "0.25"
    assert "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" not in console.os.environ
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "5")
    assert _start(monkeypatch)["poll"] == "5"
    assert console.os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "5"


def test_a_preemption_watcher_setting_the_user_made_is_kept(monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1")
    assert _start(monkeypatch)["watcher"] == "1"
    assert console.os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "1"


def _settings(monkeypatch, dashboard_url: str) -> tuple[str | None, str | None]:
    """The state-tracking value inside `ray_train_settings` against a cluster with or without a
    dashboard, and after it."""
    import ray._private.worker as ray_worker

    monkeypatch.setattr(ray_worker, "get_dashboard_url", lambda: dashboard_url)
    with console.ray_train_settings():
        inside = console.os.environ.get("RAY_TRAIN_ENABLE_STATE_TRACKING")
    return inside, console.os.environ.get("RAY_TRAIN_ENABLE_STATE_TRACKING")


def test_state_tracking_follows_whether_the_cluster_has_a_dashboard(monkeypatch):
    """On where a dashboard would show the run, off where there is none (no state actor polling
    a state API that is not there), for each run of one driver process; gone after each, so a
    process the driver starts later (a run with a dashboard of its own) decides for itself."""
    monkeypatch.setattr(console.os, "environ", dict(console.os.environ))
    console.os.environ.pop("RAY_TRAIN_ENABLE_STATE_TRACKING", None)
    assert _settings(monkeypatch, "") == ("0", None)
    assert _settings(monkeypatch, "127.0.0.1:8265") == ("1", None)
    assert _settings(monkeypatch, "") == ("0", None)


def test_state_tracking_the_user_set_is_kept(monkeypatch):
    monkeypatch.setattr(console.os, "environ", dict(console.os.environ))
    console.os.environ["RAY_TRAIN_ENABLE_STATE_TRACKING"] = "1"
    assert _settings(monkeypatch, "") == ("1", "1")


def test_the_embedded_ray_is_a_new_instance_even_beside_a_ray_start_cluster(monkeypatch):
    """Without address, ray.init joins the cluster of /tmp/ray/ray_current_cluster (a `ray
    start` on this machine), which refuses num_cpus; "local" always starts a new instance."""
    monkeypatch.delenv("RAY_TRAIN_ENABLE_STATE_TRACKING", raising=False)
    options = _start(monkeypatch)["options"]
    assert options["address"] == "local" and options["num_cpus"] == 2


@pytest.mark.parametrize(
    ("mode", "said"), [("disabled", "off"), ("DISABLED", "off"), ("token", "on")]
)
def test_the_token_authentication_line_asks_ray(monkeypatch, mode, said):
    """Ray's own answer, not a string compare of ours ("DISABLED" is off for Ray too)."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    from ray._raylet import Config

    with monkeypatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", mode)
        Config.initialize("")  # Ray reads the mode into its config: as ray.init does
        try:
            assert is_token_auth_enabled() is (said == "on")
            line = console.dashboard_line("http://127.0.0.1:8265")
        finally:
            patch.undo()  # the environment as it was, then Ray's config read from it again
            Config.initialize("")
    assert line.endswith(f"Ray's token authentication is {said}"), line
    assert "a new instance" in line
