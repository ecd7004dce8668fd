"""AsyncCallbackManager: the ordered background dispatcher of the callback actor."""

import asyncio
import threading
import time

import pytest
from waiting import wait_until

from callbacks import TrainerCallback, TrainerControl, TrainingContext
from callbacks._manager_async import AsyncCallbackManager

WAIT = 10.0  # upper bound for anything that should happen promptly


def make_manager(*callbacks, **kwargs):
    kwargs.setdefault("global_callbacks", [])
    return AsyncCallbackManager(list(callbacks), **kwargs)


class Gate(TrainerCallback):
    """Blocks on_log until released; signals when it started and when it returned (released or
    not)."""

    def __init__(self):
        self.started = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()
        self.done = []

    def on_log(self, context):
        self.started.set()
        try:
            assert self.release.wait(WAIT)
            self.done.append(context.global_step)
        finally:
            self.returned.set()


class Record(TrainerCallback):
    def __init__(self):
        self.steps = []
        self.threads = set()

    def on_log(self, context):
        self.steps.append(context.global_step)
        self.threads.add(threading.current_thread().name)

    def on_save(self, context):
        self.steps.append(("save", context.global_step))


def test_fire_returns_at_once_with_none():
    gate = Gate()
    manager = make_manager(gate)
    try:
        assert manager.fire("on_log", TrainingContext(global_step=1)) is None
        assert gate.started.wait(WAIT)
        assert gate.done == []  # still running in the background
    finally:
        gate.release.set()
        assert manager.close(WAIT)
    assert gate.done == [1]


def test_events_are_handled_in_order_on_one_thread():
    record = Record()
    manager = make_manager(record)

    def produce():
        for step in range(500):
            manager.fire("on_log", TrainingContext(global_step=step))
            if step % 100 == 0:
                manager.fire("on_save", TrainingContext(global_step=step))

    producer = threading.Thread(target=produce)
    producer.start()
    producer.join(WAIT)
    assert manager.flush(WAIT)
    expected = []
    for step in range(500):
        expected.append(step)
        if step % 100 == 0:
            expected.append(("save", step))
    assert record.steps == expected
    assert record.threads == {"callbacks-dispatcher"}
    assert manager.handled_events == {"on_log": 500, "on_save": 5}
    manager.close()


def test_on_train_end_waits_for_earlier_events_and_its_callbacks():
    sleep_s = 0.3

    class Slow(TrainerCallback):
        def __init__(self):
            self.finished = []

        def on_log(self, context):
            time.sleep(sleep_s)  # the slow work being waited for
            self.finished.append("log")

        def on_train_end(self, context):
            self.finished.append("end")

    slow = Slow()
    manager = make_manager(slow)
    start = time.monotonic()
    manager.fire("on_log", TrainingContext())
    manager.fire("on_train_end", TrainingContext())
    waited = time.monotonic() - start
    assert slow.finished == ["log", "end"]
    assert waited >= sleep_s
    assert manager.errors == []
    manager.close()


def test_unsubscribed_on_train_end_still_waits():
    gate = Gate()
    manager = make_manager(gate)
    manager.fire("on_log", TrainingContext(global_step=3))
    assert gate.started.wait(WAIT)
    threading.Timer(0.1, gate.release.set).start()
    manager.fire("on_train_end")
    assert gate.done == [3]
    manager.close()


def test_end_timeout_is_respected_and_recorded():
    gate = Gate()
    manager = make_manager(gate, end_timeout=0.2)
    try:
        manager.fire("on_log", TrainingContext(global_step=7))
        start = time.monotonic()
        assert manager.fire("on_train_end", TrainingContext(global_step=7)) is None
        assert time.monotonic() - start >= 0.2
        assert not gate.returned.is_set()  # it gave up on the hook the test still holds
        (error,) = manager.errors
        assert error.callback == "<dispatcher>" and error.event == "on_train_end"
        assert error.step == 7 and "TimeoutError" in error.error
        assert manager.flush(0.05) is False
    finally:
        gate.release.set()
    assert manager.flush(WAIT) is True
    assert manager.close(WAIT)


def test_close_drains_stops_and_is_idempotent():
    record = Record()
    manager = make_manager(record)
    for step in range(20):
        manager.fire("on_log", TrainingContext(global_step=step))
    assert manager.close(WAIT) is True
    assert record.steps == list(range(20))
    assert not manager._dispatcher._thread.is_alive()
    assert manager.close(WAIT) is True
    assert manager.fire("on_log", TrainingContext(global_step=99)) is None
    assert manager.fire("on_train_end") is None  # no wait, no error after close
    assert record.steps == list(range(20))
    assert manager.errors == []


def test_close_timeout_returns_false_when_a_callback_hangs():
    gate = Gate()
    manager = make_manager(gate)
    manager.fire("on_log")
    assert gate.started.wait(WAIT)
    assert manager.close(0.1) is False
    assert not gate.returned.is_set()  # it gave up on the hook the test still holds
    gate.release.set()


def test_async_hooks_run_on_the_dispatcher_loop():
    class AsyncCb(TrainerCallback):
        def __init__(self):
            self.loops = []

        async def on_log(self, context):
            self.loops.append(asyncio.get_running_loop())
            await asyncio.sleep(0)
            return TrainerControl(should_evaluate=True)

    cb = AsyncCb()
    manager = make_manager(cb)
    manager.fire("on_log")
    manager.fire("on_log")
    assert manager.flush(WAIT)
    assert len(cb.loops) == 2 and cb.loops[0] is cb.loops[1]  # one loop, owned by the thread
    assert manager.take_control().should_evaluate
    manager.close()


def test_controls_accumulate_until_taken():
    class StopAtFive(TrainerCallback):
        def on_log(self, context):
            if context.global_step == 5:
                context.control.should_training_stop = True

    class SaveOnEval(TrainerCallback):
        def on_evaluate(self, context):
            return TrainerControl(should_save=True)

    manager = make_manager(StopAtFive(), SaveOnEval())
    for step in range(8):
        manager.fire("on_log", TrainingContext(global_step=step))
    manager.fire("on_evaluate")
    assert manager.flush(WAIT)
    control = manager.take_control()
    assert control.should_training_stop and control.should_save
    assert control.stop_reason == "StopAtFive"
    assert manager.take_control() is None
    manager.close()


def test_errors_are_isolated_in_async_mode():
    class Boom(TrainerCallback):
        def on_log(self, context):
            raise ValueError("async boom")

    record = Record()
    manager = make_manager(Boom(), record)
    manager.fire("on_log", TrainingContext(global_step=4))
    assert manager.flush(WAIT)
    assert record.steps == [4]
    assert [(e.callback, e.event, e.step) for e in manager.errors] == [("Boom", "on_log", 4)]
    manager.close()


def test_caller_can_reuse_its_dicts_after_fire():
    seen = []

    class Read(TrainerCallback):
        def on_log(self, context):
            seen.append(dict(context.batch_metrics))

    gate = Gate()
    manager = make_manager(gate, Read())
    metrics = {"loss": 1.0}
    manager.fire("on_log", TrainingContext(batch_metrics=metrics))
    metrics["loss"] = 2.0  # the loop reuses its dict while the event waits in the queue
    gate.release.set()
    assert manager.flush(WAIT)
    assert seen == [{"loss": 1.0}]
    manager.close()


def test_full_queue_drops_only_low_value_events():
    gate = Gate()
    record = Record()
    manager = make_manager(gate, record, max_queue=2)
    manager.fire("on_log", TrainingContext(global_step=0))
    assert gate.started.wait(WAIT)  # the dispatcher is busy with step 0; the queue is empty
    for step in range(1, 11):
        manager.fire("on_log", TrainingContext(global_step=step))  # 2 fit, 8 dropped
    assert manager.dropped_events == {"on_log": 8}

    saver = threading.Thread(target=manager.fire, args=("on_save", TrainingContext(global_step=11)))
    saver.start()
    saver.join(0.2)
    assert saver.is_alive()  # a never-dropped event waits for room instead
    gate.release.set()
    saver.join(WAIT)
    assert not saver.is_alive()
    assert manager.flush(WAIT)
    assert record.steps == [0, 1, 2, ("save", 11)]
    assert manager.dropped_events == {"on_log": 8}
    assert manager.handled_events == {"on_log": 3, "on_save": 1}
    manager.close()


def test_close_releases_a_producer_waiting_for_room():
    gate = Gate()
    manager = make_manager(gate, Record(), max_queue=1)
    manager.fire("on_log")
    assert gate.started.wait(WAIT)
    manager.fire("on_log")  # fills the queue
    saver = threading.Thread(target=manager.fire, args=("on_save",))
    saver.start()
    saver.join(0.1)
    assert saver.is_alive()
    closer = threading.Thread(target=manager.close, args=(WAIT,))
    closer.start()
    gate.release.set()
    saver.join(WAIT)
    closer.join(WAIT)
    assert not saver.is_alive() and not closer.is_alive()


@pytest.mark.parametrize("max_queue", [0, -1])
def test_max_queue_must_be_positive(max_queue):
    with pytest.raises(ValueError, match="max_queue"):
        make_manager(Record(), max_queue=max_queue)


def test_async_mode_reports_only_real_subscriptions():
    manager = make_manager(Record())
    assert manager.subscribed_events == {"on_log", "on_save"}
    assert not manager.has_callbacks("on_train_end")  # the end barrier is not a subscriber
    assert manager.list_callbacks("on_train_end") == []
    assert manager.fire("on_step_end") is None  # unsubscribed: None too in async mode
    manager.close()


# -- bounded hooks (TrainingArgs.callback_timeout_s on the callback actor) ----------------------


class HangsAsync(TrainerCallback):
    async def on_log(self, context, **kwargs):
        await asyncio.Event().wait()  # never set: hangs until cancelled


class HangsPlain(TrainerCallback):
    def __init__(self) -> None:
        self.release = threading.Event()
        self.returned = threading.Event()

    def on_log(self, context, **kwargs):
        self.release.wait(60)  # a plain hook that blocks (released by the test)
        self.returned.set()


class SaveSeen(TrainerCallback):
    def __init__(self) -> None:
        self.saves = []

    def on_save(self, context, **kwargs):
        self.saves.append(context.global_step)


def test_an_async_hook_over_the_timeout_is_cancelled_and_recorded_against_it():
    saver = SaveSeen()
    manager = make_manager(HangsAsync(), saver, hook_timeout=0.2)
    manager.fire("on_log", TrainingContext(global_step=3))
    manager.fire("on_save", TrainingContext(global_step=3))
    assert manager.flush(timeout=10)  # the hang was cancelled: the queue moved on
    assert saver.saves == [3]
    [error] = manager.errors
    assert (error.callback, error.event, error.step) == ("HangsAsync", "on_log", 3)
    assert "ran over the hook timeout of 0.2 s" in error.error and "cancelled" in error.error
    assert manager.handled_events == {"on_log": 1, "on_save": 1}
    manager.close()


def test_a_plain_hook_over_the_timeout_is_reported_and_what_waits_is_not_handled():
    hang, saver = HangsPlain(), SaveSeen()
    manager = make_manager(hang, saver, hook_timeout=0.2, end_timeout=0.5)
    manager.fire("on_log", TrainingContext(global_step=5))
    manager.fire("on_save", TrainingContext(global_step=5))
    wait_until(lambda: manager.errors, 10, "the watchdog's report", interval=0.05)
    [error] = manager.errors
    assert (error.callback, error.event, error.step) == ("HangsPlain", "on_log", 5)
    assert "cannot be cancelled" in error.error
    # The hung on_log itself and the on_save behind it.
    assert "2 event(s) not yet handled; HangsPlain.on_log running for" in manager.waiting_for()
    manager.fire("on_train_end", TrainingContext(global_step=5))  # bounded by end_timeout
    assert not hang.returned.is_set()  # it gave up on the hook the test still holds
    assert saver.saves == [] and manager.handled_events == {}  # the blocked events: not handled
    end = manager.errors[-1]
    assert end.event == "on_train_end" and "HangsPlain.on_log running" in end.error
    hang.release.set()
    assert manager.close(timeout=10)
    assert saver.saves == [5]
