"""Training worker, rank 0: batched, never-blocking event forwarding to the callback actor.

Runs in the rank-0 training process only, on the training loop's thread, and on one daemon
thread of its own (the flush timer) once an event was pushed.

Policy (documented in docs/behaviour.md, "Forwarding to the callback actor"):

* Only events that some actor-side callback subscribes to are forwarded (the set is fixed before
  training starts); an unsubscribed event costs the loop one set lookup.
* An event costs rank 0 one `to_wire()` (a small dict of plain fields) and a list append. Events
  are sent in batches, one Ray actor call per batch (~1 ms of the sending process's CPU here,
  its Ray threads included): when `max_batch` (256) events are waiting, when the oldest has
  waited `flush_interval_s` (250 ms; checked at each event and step, and by the flush timer, so
  an event logged before the loop stalls, in a long step, a held hook or a rollout, still
  reaches the actor within the interval), or at once for `on_save`,
  `on_evaluate`, `on_train_begin`, `on_train_end`, `on_exception` and `on_load_checkpoint`
  (these even past `max_in_flight`, taking the waiting events with them). So
  rank 0 makes about 4 calls a second for ordinary events, well under 1% of a core, however
  many events there are; with steps longer than the window, one call per step.
* Nothing waits for the actor: a batch is sent with `.remote()` and its reply, a future that Ray
  completes from its own thread, is checked later without waiting. At most `max_in_flight`
  batches are unacknowledged; beyond that events wait in a buffer of at most `max_buffer` events. When that buffer is full, low-value
  events (`on_log`, per-micro-batch and per-step events) are dropped oldest first and counted;
  `on_save`, `on_evaluate`, `on_train_begin`, `on_train_end` and `on_exception` never are.
* Every batch carries a sequence number and stays on rank 0 until the actor acknowledges it; a
  batch whose call failed (the actor died) is sent again after Ray restarts the actor, and the
  actor ignores a sequence number it has already handled.
* Control requests from actor-side callbacks come back in the replies (a ``BatchReply`` with
  a ``TrainerControl``) and are merged into the rank-0 requests when the loop next starts a
  step's all-reduce (`poll_control`).
* At the end of an attempt, `close` delivers what is left and then the attempt's
  ``WorkerSummary`` (``CallbackActor.finish``): the way the result reaches the driver.

The messages are the contract's (``ray_trainer/_contract.py``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from typing import Any

import ray

from callbacks import TrainerControl, TrainingContext
from ray_trainer._contract import (
    HEARTBEAT_S,
    LIVE_KWARGS,
    URGENT_EVENTS,
    BatchReply,
    EventBatch,
    WireEvent,
    WorkerSummary,
)

logger = logging.getLogger("ray_trainer")


class EventForwarder:
    def __init__(
        self,
        actor_name: str,
        events: frozenset[str],
        *,
        attempt: int,
        namespace: str,
        world_size: int = 1,
        max_batch: int = 256,
        flush_interval_s: float = 0.25,
        max_in_flight: int = 4,
        max_buffer: int = 10_000,
        poll_interval_s: float = 0.005,
        actor: Any = None,
    ) -> None:
        self.actor = actor if actor is not None else ray.get_actor(actor_name, namespace=namespace)
        self.events = events
        self.attempt = attempt
        self.max_batch = max_batch
        self.flush_interval_s = flush_interval_s
        self.max_in_flight = max_in_flight
        self.max_buffer = max_buffer
        self.poll_interval_s = poll_interval_s
        self.dropped: collections.Counter[str] = collections.Counter()
        self.undelivered = 0
        self._buffer: list[WireEvent] = []
        self._oldest = 0.0
        self._flush_at = max_batch
        self._in_flight: collections.deque[list[Any]] = collections.deque()  # [reply, batch]
        self._seq = 0
        self._last_poll = 0.0
        self._last_send = time.monotonic()
        self._control: TrainerControl | None = None
        self.dead = False
        # The loop and the flush timer share the buffer and the batches in flight: one lock,
        # held for a push (uncontended but for the timer's flush: ~0.1 us an event), and the
        # timer's wake-up, signalled only when the buffer goes from empty to not.
        self._lock = threading.Lock()
        self._due = threading.Condition(self._lock)
        self._timer: threading.Thread | None = None
        self._closing = False
        # The actor counts worker-group starts, and their sizes (an elastic run's change).
        self.actor.start_attempt.remote(attempt, world_size)

    def push(self, event: str, context: TrainingContext, kwargs: dict[str, Any]) -> None:
        """Queue one event (called by the loop); may send a batch, never waits."""
        if self.dead:
            self.undelivered += 1
            return
        wire = context.to_wire()
        shipped = {k: v for k, v in kwargs.items() if k not in LIVE_KWARGS} if kwargs else kwargs
        with self._lock:
            if not self._buffer:
                self._oldest = time.monotonic()
                self._wake_timer()
            self._buffer.append((event, wire, shipped))
            if event in URGENT_EVENTS:
                # Past the in-flight bound too: evaluations and the checkpoint ranking hang on
                # an `on_save`, and a busy actor or a rank-0 callback that holds the loop must
                # not keep it on rank 0 (the batch takes the waiting events with it; rare).
                self._flush(force=True)
            elif (
                len(self._buffer) >= self._flush_at
                or time.monotonic() - self._oldest >= self.flush_interval_s
            ):
                self._flush()

    def poll_control(self, context: TrainingContext | None = None) -> TrainerControl | None:
        """Once per step (when the loop starts the step's all-reduce): send what is due (a
        heartbeat with `context`'s progress when nothing went for `HEARTBEAT_S`), collect the
        replies that arrived, without waiting."""
        now = time.monotonic()
        with self._lock:
            if self._buffer and now - self._oldest >= self.flush_interval_s:
                self._flush()
            elif now - self._last_send >= HEARTBEAT_S and context is not None and not self.dead:
                self._heartbeat(context, now)
            if self._in_flight and now - self._last_poll >= self.poll_interval_s:
                self._last_poll = now
                self._collect(timeout=0)
            control, self._control = self._control, None
        return control

    def close(self, timeout: float, summary: WorkerSummary | None = None) -> None:
        """End of the attempt: send everything and wait for the acknowledgements, then hand
        the actor the attempt's summary; all within `timeout`."""
        deadline = time.monotonic() + timeout
        self._stop_timer()  # from here on the loop's thread alone
        while self._buffer or self._in_flight:
            self._flush(force=True)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._collect(timeout=min(left, 1.0))
        lost = sum(len(entry[1].events) for entry in self._in_flight) + len(self._buffer)
        if lost:
            logger.warning("%d event(s) could not be delivered to the callback actor", lost)
        self.undelivered += lost
        if summary is None or self.dead:
            return
        summary.undelivered_events = self.undelivered
        summary.dropped_events = dict(self.dropped)
        try:
            ray.get(
                self.actor.finish.remote(summary),
                timeout=max(1.0, deadline - time.monotonic()),
            )
        except Exception as e:  # the driver then builds the result from the actor's own view
            logger.warning("could not hand the run summary to the callback actor: %s", e)

    # ---- the flush timer -------------------------------------------------------------------

    def _wake_timer(self) -> None:
        """(Lock held; the buffer just got its first event.) Start the timer on the first
        event of the attempt, or wake it: it flushes once the event has waited the interval."""
        if self._timer is None:
            self._timer = threading.Thread(target=self._watch, name="ray-trainer-events")
            self._timer.daemon = True  # never holds the process at its exit
            self._timer.start()
        else:
            self._due.notify()

    def _watch(self) -> None:
        """The timer's thread: sleeps while the buffer is empty; otherwise until its oldest
        event has waited `flush_interval_s`, then flushes what the loop has not."""
        with self._lock:
            while not self._closing:
                if not self._buffer or self.dead:
                    self._due.wait()
                    continue
                left = self._oldest + self.flush_interval_s - time.monotonic()
                if left > 0:
                    self._due.wait(left)
                    continue
                try:
                    self._flush()  # at the in-flight bound: tried again an interval later
                except Exception as e:  # Ray shutting down: the loop's own flushes carry on
                    logger.warning("the event flush timer stopped: %s", e)
                    return

    def _stop_timer(self) -> None:
        with self._lock:
            self._closing = True
            self._due.notify()
        if self._timer is not None:
            self._timer.join(timeout=5.0)

    # ---- internals -------------------------------------------------------------------------

    def _flush(self, force: bool = False) -> None:
        if not self._buffer:
            return
        if len(self._in_flight) >= self.max_in_flight and not force:
            self._collect(timeout=0)
            if len(self._in_flight) >= self.max_in_flight:
                # The actor is behind: try again after another `max_batch` events (or at the
                # next step boundary), not on every event.
                self._flush_at = len(self._buffer) + self.max_batch
                self._oldest = time.monotonic()
                self._shed()
                return
        self._flush_at = self.max_batch
        self._seq += 1
        batch = EventBatch(self.attempt, self._seq, self._buffer)
        self._buffer = []
        self._send(batch)

    def _heartbeat(self, context: TrainingContext, now: float) -> None:
        """An empty batch with the progress: its reply brings control from outside the run."""
        if len(self._in_flight) >= self.max_in_flight:
            return
        self._seq += 1
        self._send(EventBatch(self.attempt, self._seq, [], progress=context.to_wire()))

    def _send(self, batch: EventBatch) -> None:
        self._last_send = time.monotonic()
        if self.dropped:  # a batch, not an event, pays for it; and only once events were dropped
            batch.dropped = dict(self.dropped)
        self._in_flight.append([_reply(self.actor.push.remote(batch)), batch])

    def _give_up(self) -> None:
        self.undelivered += sum(len(entry[1].events) for entry in self._in_flight) + len(
            self._buffer
        )
        self._in_flight.clear()
        self._buffer = []
        self.events = frozenset()
        self.dead = True

    def _shed(self) -> None:
        """The actor is behind: keep the buffer bounded by dropping low-value events."""
        excess = len(self._buffer) - self.max_buffer
        if excess <= 0:
            return
        kept = []
        for item in self._buffer:
            if excess > 0 and item[0] not in URGENT_EVENTS:
                self.dropped[item[0]] += 1
                excess -= 1
            else:
                kept.append(item)
        self._buffer = kept

    def _collect(self, timeout: float) -> None:
        """Take the replies that are ready, in order; resend a batch whose call failed."""
        while self._in_flight:
            future, batch = self._in_flight[0]
            if not future.done():
                if timeout <= 0:
                    return
                concurrent.futures.wait([future], timeout=timeout)
                if not future.done():
                    return
            try:
                reply: BatchReply = future.result()
            except ray.exceptions.ActorUnavailableError as e:
                logger.warning(
                    "callback actor unavailable (%s); sending batch %d again", e, batch.seq
                )
                self._in_flight[0][0] = _reply(self.actor.push.remote(batch))
                return
            except ray.exceptions.RayActorError as e:
                # Ray retries calls while it restarts the actor (max_task_retries=-1), so an
                # error here means the actor is gone for good: stop forwarding, count the loss.
                logger.error("callback actor died for good (%s); actor-side events are lost", e)
                self._give_up()
                return
            self._in_flight.popleft()
            incoming = reply.control
            if incoming is not None and incoming.any:
                if self._control is None:
                    self._control = incoming
                else:
                    self._control.merge(incoming, incoming.stop_reason or "actor callback")


def _reply(ref: Any) -> concurrent.futures.Future:
    """The reply of a `push` call as a future: Ray completes it from its own thread, so checking
    it costs the loop ~5 µs (a `ray.wait(timeout=0)` on a pending reference costs ~50-200 µs)."""
    return ref.future()
