"""Operating a live run (issue 16), the pure parts: heartbeats that carry requests from outside,
the actor's record of them, the console filter, the signals' exit codes, preemption notices."""

from __future__ import annotations

from callbacks import CallbackManager, TrainingContext
from ray_trainer._actor.requests import OutsideRequests
from ray_trainer._driver import console
from ray_trainer._driver.signals import exit_code_of, stop_reason_of
from ray_trainer._worker.step import event_forwarder
from ray_trainer._worker.step.hooks import Hooks


def test_rank_0_sends_a_heartbeat_with_its_progress_when_nothing_else_went(monkeypatch):
    from test_event_forwarder import FakeActor, make

    actor = FakeActor()
    fwd = make(actor, max_batch=100, flush_interval_s=60)
    ctx = TrainingContext(global_step=7, loss=1.5)
    assert fwd.poll_control(ctx) is None and actor.calls == []  # sent something recently
    monkeypatch.setattr(event_forwarder, "HEARTBEAT_S", 0.0)
    fwd.poll_control(ctx)
    [(_attempt, seq, events)] = actor.calls
    assert events == [] and seq == 1
    actor.reply(1, {"should_save": True})  # the heartbeat's reply brings a request back
    fwd.poll_interval_s = 0
    assert fwd.poll_control(ctx).should_save


def test_outside_requests_go_out_once_and_record_when_they_took_effect():
    requests = OutsideRequests()
    record = requests.add("save", "ray-trainer save", step=12)
    assert record["requested_at_step"] == 12 and record["delivered_at"] is None
    requests.saw_save(13)  # not delivered yet: not its save
    assert requests.last()["took_effect_at"] is None
    control = requests.take()
    assert control.should_save and not control.should_training_stop
    assert requests.take() is None  # handed to rank 0 once
    requests.saw_save(15)
    last = requests.last()
    assert last["took_effect_at_step"] == 15 and last["took_effect_at"] >= last["requested_at"]
    requests.add("stop", "SIGTERM to the driver", step=20)
    stop = requests.take()
    assert stop.should_training_stop and stop.stop_reason == stop_reason_of("SIGTERM")
    requests.saw_end(22)
    assert requests.last()["took_effect_at_step"] == 22


def test_signals_map_to_exit_codes():
    assert exit_code_of(stop_reason_of("SIGTERM")) == 143
    assert exit_code_of(stop_reason_of("SIGINT")) == 130
    assert exit_code_of("EarlyStopping") is None and exit_code_of(None) is None


def test_the_console_filter_drops_only_the_harmless_lines():
    printed = []

    class Dispatcher:
        def __init__(self):
            import threading

            self._lock = threading.Lock()
            self.handlers = [("ray_print_logs", printed.append), ("other", lambda d: None)]

    fake = Dispatcher()
    import ray._private.ray_logging as ray_logging

    real = ray_logging.global_worker_stdstream_dispatcher
    ray_logging.global_worker_stdstream_dispatcher = fake
    try:
        assert console.filter_ray_noise()
        assert not console.filter_ray_noise()  # already in place: not wrapped twice
    finally:
        ray_logging.global_worker_stdstream_dispatcher = real
    handle = fake.handlers[0][1]
    noise = "Failed to query Ray Train Controller actor state. State API may be unavailable."
    handle({"lines": [noise], "pid": 1})
    handle({"lines": ["step 10 loss 1.2", noise], "pid": 2})
    assert printed == [{"lines": ["step 10 loss 1.2"], "pid": 2}]


def test_the_dashboard_line_says_where_and_about_authentication():
    # On or off is Ray's own answer: test_driver_console_embedded_ray.py sets each mode.
    line = console.dashboard_line("http://127.0.0.1:8266")
    assert "http://127.0.0.1:8266 (this machine only)" in line
    assert line.endswith(("authentication is on", "authentication is off"))
    assert "no Ray dashboard" in console.dashboard_line(None)
    assert 8265 <= console.free_dashboard_port() < 8300 or console.free_dashboard_port() == 0


def test_a_preemption_notice_asks_for_one_save():
    notices = iter([False, True, False])
    hooks = Hooks(
        CallbackManager(global_callbacks=[]), TrainingContext(), None, lambda: next(notices)
    )
    assert not hooks.take_pending().any
    requested = hooks.take_pending()
    assert requested.should_save and not requested.stops
    assert not hooks.take_pending().any
