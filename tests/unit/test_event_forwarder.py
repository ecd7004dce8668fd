"""The rank-0 forwarding policy with a stand-in actor: batching, bounds, what may be dropped."""

from __future__ import annotations

import concurrent.futures
import threading

from waiting import wait_until

from callbacks import TrainerControl, TrainingContext
from ray_trainer._contract import BatchReply
from ray_trainer._worker.step.event_forwarder import EventForwarder


class FakeActor:
    """Records `push` calls; each reply is a future that the test completes (or never does)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, list]] = []
        self.replies: dict[int, concurrent.futures.Future] = {}
        outer = self

        class _Ref:
            def __init__(self, seq: int) -> None:
                self.seq = seq

            def future(self) -> concurrent.futures.Future:
                return outer.replies.setdefault(self.seq, concurrent.futures.Future())

        class _Push:
            def remote(self, batch):
                outer.calls.append((batch.attempt, batch.seq, batch.events))
                outer.dropped.append(batch.dropped)
                return _Ref(batch.seq)

        class _StartAttempt:
            def remote(self, attempt, world_size=1):
                outer.attempts.append(attempt)

        self.attempts: list[int] = []
        self.dropped: list[dict | None] = []  # each batch's running count of dropped events
        self.push = _Push()
        self.start_attempt = _StartAttempt()

    def reply(self, seq: int, control: dict | None = None) -> None:
        """The actor acknowledges batch `seq`, with the control requests of its callbacks."""
        self.replies[seq].set_result(
            BatchReply(ack=seq, control=TrainerControl(**control) if control else None)
        )


def make(actor, **kw):
    events = frozenset({"on_log", "on_step_end", "on_save", "on_before_forward"})
    return EventForwarder("x", events, attempt=0, namespace="n", actor=actor, **kw)


def test_events_are_batched_and_urgent_events_go_at_once():
    actor = FakeActor()
    fwd = make(actor, max_batch=4, flush_interval_s=60)
    ctx = TrainingContext(global_step=1)
    for _ in range(3):
        fwd.push("on_step_end", ctx, {})
    assert actor.calls == []  # below the batch size, within the interval: nothing sent yet
    fwd.push("on_step_end", ctx, {})
    assert len(actor.calls) == 1 and len(actor.calls[0][2]) == 4
    fwd.push("on_save", ctx, {"checkpoint_path": "/c"})
    assert len(actor.calls) == 2 and actor.calls[1][2][0][0] == "on_save"
    assert [c[1] for c in actor.calls] == [1, 2]  # sequence numbers


def test_live_objects_are_never_shipped():
    actor = FakeActor()
    fwd = make(actor, max_batch=1)
    fwd.push("on_before_forward", TrainingContext(model=object()), {"batch": 1, "micro_step": 0})
    _event, wire, kwargs = actor.calls[0][2][0]
    assert kwargs == {"micro_step": 0} and "model" not in wire


def test_buffer_is_bounded_and_only_low_value_events_are_dropped():
    actor = FakeActor()
    fwd = make(actor, max_batch=2, max_in_flight=1, max_buffer=10, flush_interval_s=60)
    ctx = TrainingContext()
    fwd.push("on_log", ctx, {})
    fwd.push("on_log", ctx, {})  # one batch in flight, never acknowledged: the actor is stuck
    for _ in range(100):
        fwd.push("on_log", ctx, {})
    assert len(fwd._buffer) <= 10 + 2  # bounded (checked each time a batch would be sent)
    assert fwd.dropped["on_log"] >= 80 and len(actor.calls) == 1
    fwd.push("on_save", ctx, {"checkpoint_path": "/c"})  # never dropped, and never held back
    assert len(actor.calls) == 2 and actor.calls[1][2][-1][0] == "on_save"
    assert fwd._buffer == [] and "on_save" not in fwd.dropped


def test_an_urgent_event_goes_at_once_past_the_in_flight_bound():
    """The actor is behind (every allowed batch unacknowledged): an `on_save` still goes out at
    once, with the events waiting before it, in order; ordinary events keep waiting."""
    actor = FakeActor()
    fwd = make(actor, max_batch=1, max_in_flight=2, flush_interval_s=60)
    ctx = TrainingContext()
    fwd.push("on_step_end", ctx, {})
    fwd.push("on_step_end", ctx, {})
    fwd.push("on_log", ctx, {})  # two in flight, none acknowledged: this one waits
    assert len(actor.calls) == 2 and [e for e, _, _ in fwd._buffer] == ["on_log"]
    fwd.push("on_save", ctx, {"checkpoint_path": "/c"})
    assert len(actor.calls) == 3
    assert [e for e, _, _ in actor.calls[2][2]] == ["on_log", "on_save"]
    assert [c[1] for c in actor.calls] == [1, 2, 3]


def test_replies_bring_control_back_and_close_waits_for_acks():
    actor = FakeActor()
    fwd = make(actor, max_batch=1, poll_interval_s=0)
    fwd.push("on_step_end", TrainingContext(global_step=5), {})
    assert fwd.poll_control() is None  # not acknowledged yet
    actor.reply(1, {"should_training_stop": True, "stop_reason": "Alarm"})
    control = fwd.poll_control()
    assert control.should_training_stop and control.stop_reason == "Alarm"
    fwd.push("on_log", TrainingContext(), {})
    actor.reply(2)
    fwd.close(timeout=1)
    assert fwd.undelivered == 0


def test_close_counts_what_was_never_acknowledged():
    actor = FakeActor()
    fwd = make(actor, max_batch=1)
    fwd.push("on_step_end", TrainingContext(), {})
    fwd.push("on_step_end", TrainingContext(), {})
    fwd.close(timeout=0.05)
    assert fwd.undelivered == 2


def test_batches_carry_the_running_count_of_dropped_events_once_there_is_one():
    """The actor's metrics learn rank 0's drops from the batches: nothing is added to a batch
    before the first drop (no per-event work), then each carries the running count."""
    actor = FakeActor()
    fwd = make(actor, max_batch=2, max_in_flight=1, max_buffer=10, flush_interval_s=60)
    ctx = TrainingContext()
    fwd.push("on_log", ctx, {})
    fwd.push("on_log", ctx, {})  # in flight, never acknowledged
    assert actor.dropped == [None]
    for _ in range(30):
        fwd.push("on_log", ctx, {})
    fwd.push("on_save", ctx, {"checkpoint_path": "/c"})
    assert actor.dropped[-1] == {"on_log": fwd.dropped["on_log"]} and fwd.dropped["on_log"] > 0
    assert actor.dropped[-1] is not fwd.dropped  # a copy: later drops do not change a sent batch


def test_an_event_before_the_loop_stalls_is_sent_within_the_interval_by_the_timer():
    """The loop pushes one `on_log` and then stalls (a long step, a held hook, a rollout): no
    push and no step boundary follow, yet the batch goes once the interval has passed."""
    actor = FakeActor()
    sent = threading.Event()
    push = actor.push.remote
    actor.push.remote = lambda batch: (sent.set(), push(batch))[1]
    fwd = make(actor, max_batch=256, flush_interval_s=0.05)
    assert fwd._timer is None  # nothing pushed: no thread
    fwd.push("on_log", TrainingContext(global_step=3), {"logs": {"loss": 1.0}})
    assert actor.calls == []  # within the interval: kept
    assert sent.wait(10), "the timer never sent the waiting event"
    assert [(c[1], [e[0] for e in c[2]]) for c in actor.calls] == [(1, ["on_log"])]
    # Later events go the same way, in order, and close stops the timer.
    fwd.push("on_step_end", TrainingContext(global_step=4), {})
    wait_until(lambda: len(actor.calls) == 2, 10, "the second batch")
    assert actor.calls[1][1] == 2
    actor.reply(1)
    actor.reply(2)
    fwd.close(timeout=5)
    assert not fwd._timer.is_alive()
