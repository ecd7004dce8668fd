"""The callback actor process (one per run, on the head node): runs the actor-side callbacks.

`CallbackActor` runs in its own Ray actor process on the head node (it takes no CPU). It
receives rank-0 events in batches (`push`), hands them in order to an asynchronous
`CallbackManager` (one dispatcher thread: events are handled one at a time, in the order rank 0
produced them), launches evaluation tasks for `EvalOnSave`, answers `status` queries from other
drivers, and returns control requests in its replies. At the end of each attempt rank 0 hands it
the attempt's summary (`finish`); the driver then takes the run's result from `summary()`. Ray
restarts it if it dies (`max_restarts=-1`); the constructor then restores its callbacks' state
from the newest checkpoint that has it, and rank 0 sends the unacknowledged batches again.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any

import ray

from callbacks import TrainerControl, TrainingContext
from callbacks._manager_async import AsyncCallbackManager
from ray_trainer._actor.evaluation import EvalTracker
from ray_trainer._actor.requests import OutsideRequests
from ray_trainer._actor.retention import CheckpointKeeper
from ray_trainer._actor.state import ActorStateWriter
from ray_trainer._actor.storage import RunStorage
from ray_trainer._contract import (
    NAMESPACE,
    REQUESTS,
    URGENT_EVENTS,
    ActorSummary,
    BatchReply,
    EventBatch,
    Retention,
    WorkerSummary,
    actor_name,
)
from ray_trainer._placement import CallbackLists, build_manager, keep_for_actor, unpack
from ray_trainer._storage import locate

logger = logging.getLogger("ray_trainer")

#: How often an elastic run's actor looks for nodes that joined.
NODE_POLL_S = 1.0

_STATUS_FIELDS = (
    "global_step",
    "max_steps",
    "epoch",
    "loss",
    "learning_rate",
    "throughput",
    "samples_seen",
    "attempt",
    "world_size",
)


class CallbackActor:
    """Runs in the callback actor process. `packed` is the driver's cloudpickled callback
    lists (bytes: small constructor arguments stay out of the object store, so a restart
    never depends on an object that may be gone). `end_timeout_s` (the run's
    `callback_timeout_s`) bounds each actor-side hook and each wait at the end."""

    def __init__(
        self,
        packed: bytes,
        run_name: str,
        run_dir: str,
        *,
        max_queue: int = 10_000,
        end_timeout_s: float = 60.0,
        eval_timeout_s: float = 600.0,
        push_wait_s: float = 0.05,
        filesystem: Any = None,
        retention: Retention | None = None,
        max_workers: int | None = None,
    ) -> None:
        lists = unpack(packed)
        # An elastic run (`max_workers` given): its evaluations hold what they reserved (one
        # at a time unless bounded), and a node that joins gets a save before the group grows.
        evals = [c for c in lists["user"] + lists["global"] if keep_for_actor(c)]
        self.reservation = _reserve(run_name, evals) if max_workers else None
        run = locate(run_dir, filesystem)  # the run folder, located once in this process
        self.writer = ActorStateWriter(run)
        self.keeper = CheckpointKeeper(retention, run) if retention else None
        lists = with_own_callbacks(lists, self.writer, self.keeper)
        self.manager = build_manager(
            lists,
            keep_for_actor,
            manager_class=AsyncCallbackManager,
            max_queue=max_queue,
            end_timeout=end_timeout_s,
            hook_timeout=end_timeout_s,
        )
        self.writer.manager = self.manager
        self.run_name = run_name
        self.run_dir = run_dir
        self.end_timeout_s = end_timeout_s
        self.eval_timeout_s = eval_timeout_s
        self.push_wait_s = push_wait_s
        self.storage = RunStorage(run_dir, filesystem)
        self.evals = EvalTracker(self.manager, run_name, filesystem, self.storage)
        if self.reservation is not None:
            self.evals.placement = self.reservation.placement
        if self.keeper is not None:
            self.keeper.tracker = self.evals
            self.evals.listener = self.keeper.record_evaluation
        _start_evaluators(self.evals, evals)
        self.received: collections.Counter[str] = collections.Counter()
        self.duplicates = 0
        self.ended = False
        self._ending = False  # end() under way: no request can still act
        self._exception_attempt: int | None = None  # the attempt whose on_exception arrived
        self._train_end: tuple | None = None  # rank 0's last on_train_end: wire, kwargs, attempt
        self.attempts = 0
        self.worker_summary: WorkerSummary | None = None
        self.restored_from = self.writer.restore()
        self.restarted = _was_restarted()
        if max_workers:
            threading.Thread(
                target=self._save_when_a_node_joins, args=(max_workers,), daemon=True
            ).start()
        self.requests = OutsideRequests()
        self._last_seq: dict[int, int] = {}
        # Low-value events rank 0 forwards (what actor-side callbacks subscribe to): the ones a
        # full buffer or queue may drop. Rank 0's drop counts arrive with its batches.
        self._droppable = sorted(self.manager.subscribed_events - URGENT_EVENTS)
        self._rank0_dropped: dict[int, dict[str, int]] = {}
        self._status: dict[str, Any] = {"started_at": time.time()}

    def ready(self) -> dict[str, Any]:
        """Called once by the driver: the actor was built and its callbacks unpickled."""
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def start_attempt(self, attempt: int, world_size: int | None = None) -> None:
        """Called by rank 0 when a worker group starts (fire-and-forget), with its size: a
        change of size (an elastic run that lost or regained workers) is printed, and kept
        for `ray-trainer status`."""
        self.attempts = max(self.attempts, attempt + 1)
        if world_size is None:
            return
        sizes = self._status.setdefault("worker_sizes", [])
        if sizes and sizes[-1]["world_size"] != world_size:
            print(
                f"[{self.run_name}] attempt {attempt}: training on {world_size} worker(s), "
                f"was {sizes[-1]['world_size']}",
                flush=True,
            )
        sizes.append({"attempt": attempt, "world_size": world_size, "at": time.time()})
        del sizes[:-20]  # the recent changes are enough to show
        self._status["world_size"] = world_size

    def push(self, batch: EventBatch) -> BatchReply:
        """Handle one batch of rank-0 events, in order; reply with the ack and any control."""
        self.attempts = max(self.attempts, batch.attempt + 1)
        if batch.seq <= self._last_seq.get(batch.attempt, 0):
            self.duplicates += 1
            return BatchReply(ack=batch.seq)
        if batch.dropped:  # rank 0 dropped events since the attempt began: its running count
            self._rank0_dropped[batch.attempt] = batch.dropped
        if batch.progress is not None:  # a heartbeat
            self._status.update({k: batch.progress.get(k) for k in _STATUS_FIELDS})
        wire: dict[str, Any] = {}
        for event, wire, kwargs in batch.events:
            self.received[event] += 1
            self._status.update({k: wire.get(k) for k in _STATUS_FIELDS})
            if event == "on_log":  # the objective's own metrics (DPO's rewards/..., logps/...)
                logged = wire.get("batch_metrics") or {}
                named = (wire.get("args") or {}).get("objective_metrics") or ()
                own = {k: logged[k] for k in named if k in logged}
                if own:
                    self._status["objective_metrics"] = own
            if event == "on_save":
                self.requests.saw_save(wire.get("global_step"))
            if event == "on_train_end":
                # The end of an attempt: another may follow (a restart), so the actor-side
                # on_train_end waits for the driver's end() and gets this context then.
                self._train_end = (wire, kwargs, batch.attempt)
                self.requests.saw_end(wire.get("global_step"))
                continue
            if event == "on_exception":
                self._exception_attempt = batch.attempt
            self.manager.fire(event, self._context(wire), **kwargs)
        if wire:
            self.evals.last_wire = wire
        self._last_seq[batch.attempt] = batch.seq
        # Give quick callbacks a moment, so their requests ride on this reply (rank 0 never waits
        # for it: it collects the reply at a later step boundary).
        self.manager.flush(timeout=self.push_wait_s)
        control = self.manager.take_control()
        outside = self.requests.take()
        if outside is not None:
            control = (control or TrainerControl()).merge(outside, outside.stop_reason)
        return BatchReply(ack=batch.seq, control=control)

    @ray.method(concurrency_group="control")
    def request(self, kind: str, source: str) -> dict[str, Any]:
        """A ``save`` or ``stop`` from outside the run (the control thread: answered even while
        the actor ends the run). It reaches every rank at one agreed step boundary within the
        actor's lag. Refused, with the reason, when the run has ended."""
        if kind not in REQUESTS:
            raise ValueError(f"unknown request {kind!r}; use one of {', '.join(REQUESTS)}")
        step = self._status.get("global_step")
        if self.ended or self._ending:
            return {"accepted": False, "run_name": self.run_name, "step": step,
                    "message": f"run {self.run_name} has ended (at step {step})"}  # fmt: skip
        record = self.requests.add(kind, source, step)
        return {"accepted": True, "run_name": self.run_name, "step": step, "request": record}

    @ray.method(concurrency_group="control")
    def stop_requested(self) -> str | None:
        """The reason of a stop from outside not yet acted on, else None (the control thread:
        a worker whose reward functions do not return asks it between waits)."""
        return self.requests.stop_reason()

    def finish(self, summary: WorkerSummary) -> None:
        """Called by rank 0 at the end of an attempt, after its last batch: the workers' view of
        the run, which `summary()` hands to the driver."""
        self.worker_summary = summary
        self.attempts = max(self.attempts, summary.attempt + 1)

    def end(self, error: str | None = None) -> dict[str, Any]:
        """Called by the driver once training is over (no attempt will follow): the actor-side
        `on_train_end`, once per run, with the context of rank 0's last `on_train_end`; when rank
        0 died before it could send one, `on_exception` (with the error text) first, then
        `on_train_end` with what the actor last heard. Idempotent. Says whether it fired and
        whether the callbacks printed meanwhile (the driver then waits for Ray to forward it)."""
        if self.ended:
            return {"fired": False, "printed": False, "pid": os.getpid()}
        self._ending = True
        before = _stdout_position()
        last_attempt = self.attempts - 1
        if self._train_end is not None and self._train_end[2] == last_attempt:
            wire, kwargs, _ = self._train_end
        else:
            wire = {k: self._status.get(k) for k in _STATUS_FIELDS if k in self._status}
            wire.update(run_name=self.run_name, is_world_process_zero=True)
            wire, kwargs = {**wire, "event": "on_train_end"}, {}
        if error is not None and self._exception_attempt != last_attempt:
            context = self._context({**wire, "event": "on_exception"})
            self.manager.fire("on_exception", context, exception=error)
        self._end(wire, kwargs)
        printed = _stdout_position() != before
        return {"fired": True, "printed": printed, "pid": os.getpid()}

    @ray.method(concurrency_group="control")
    def status(self) -> dict[str, Any]:
        """A snapshot for `ray-trainer status`: progress, evaluations so far, callback errors,
        the last request from outside (the control thread: answered while the actor is busy)."""
        errors = self.manager.errors
        return {
            "last_request": self.requests.last(),
            "run_name": self.run_name,
            **self._status,
            "events": dict(self.received),
            "events_handled": self.handled(),
            "evaluations": self.evals.sorted_results()[-5:],
            "num_evaluations": len(self.evals.results),
            "evaluations_in_flight": self.evals.in_flight(),
            **self._checkpoints(limit=10),
            "callback_errors": [vars(e) for e in errors[-5:]],
            "num_callback_errors": sum(self.manager.error_counts.values()),
            "restarted": self.restarted,
            "ended": self.ended,
        }

    def handled(self) -> dict[str, int]:
        """Rank-0 events the actor-side callbacks handled, by event (the `on_evaluate` events
        of evaluation results are the actor's own: not counted)."""
        handled = self.manager.handled_events
        if self.evals.fired:
            handled["on_evaluate"] = handled.get("on_evaluate", 0) - self.evals.fired
        return {e: n for e, n in handled.items() if n > 0 and e in self.received}

    def summary(self) -> ActorSummary:
        """Everything `TrainingResult` takes, at the end of the run (the one way back)."""
        handled = self.handled()
        unhandled = {e: n - handled.get(e, 0) for e, n in self.received.items()}
        best, best_metrics = self.keeper.best() if self.keeper else (None, {})
        return ActorSummary(
            worker=self.worker_summary,
            attempts=self.attempts,
            last_step=int(self._status.get("global_step") or 0),
            last_checkpoint=self.writer.last_checkpoint,
            events=handled,
            unhandled_events={e: n for e, n in unhandled.items() if n > 0},
            evaluations=self.evals.sorted_results(),
            callback_errors=[
                {k: v for k, v in vars(e).items() if k != "traceback"} for e in self.manager.errors
            ],
            dropped_events=dict(self.manager.dropped_events),
            duplicates=self.duplicates,
            restarted=self.restarted,
            restored_from=self.restored_from,
            best_checkpoint=best,
            best_metrics=best_metrics,
        )

    # ---- internals -------------------------------------------------------------------------

    def _end(self, wire: dict[str, Any], kwargs: dict[str, Any]) -> None:
        """Every queued event, then every in-flight evaluation, then `on_train_end`; each wait
        bounded (callback_timeout_s, eval_timeout_s) and announced when it has to wait."""
        if self.ended:
            return
        self._drain("the queued events")
        if self.evals.in_flight():
            logger.warning(
                "callback actor: waiting up to %g s (eval_timeout_s) for %d evaluation(s)",
                self.eval_timeout_s,
                self.evals.in_flight(),
            )
        self.evals.wait_all(timeout=self.eval_timeout_s)
        self.evals.close()  # the evaluator actors (warm engines) end with the run
        self._drain("the evaluation results")  # the on_evaluate events just fired
        context = self._context(wire)
        if self.keeper is not None:  # e.g. for trackers that upload the best model
            context.best_checkpoint_path, context.best_metrics = self.keeper.best()
        self.manager.fire("on_train_end", context, **kwargs)  # waits, bounded by end_timeout
        self.ended = True
        if self.reservation is not None:
            self.reservation.cancel()
        self.storage.close()  # the callbacks synced their files in on_train_end

    def _save_when_a_node_joins(self, max_workers: int) -> None:
        """An elastic run below its `max_workers`: when a node joins the cluster, ask for a
        save at once. Ray Train grows the group at its next resize check by restarting it from
        the latest checkpoint; this one is then recent, and few steps are trained twice."""
        known: set[str] | None = None
        while not self.ended:
            try:
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            except Exception:  # the GCS busy or restarting: look again
                alive = known or set()
            size = self._status.get("world_size")
            if known is not None and alive - known and size is not None and size < max_workers:
                step = self._status.get("global_step")
                self.requests.add(
                    "save", "elastic run: a node joined, saving before it grows", step
                )
            known = alive
            time.sleep(NODE_POLL_S)

    def _context(self, wire: dict[str, Any]) -> TrainingContext:
        """The context actor-side callbacks get: the wire fields, plus what only the actor
        has (the evaluation launcher, the run's storage for files of their own)."""
        context = TrainingContext.from_wire(wire)
        context.eval_launcher = self.evals
        context.run_storage = self.storage
        context.callback_errors_total = sum(self.manager.error_counts.values())
        context.events_dropped_total = self.dropped_totals()
        return context

    def dropped_totals(self) -> dict[str, int]:
        """Events dropped so far, by event (`dropped_by_event`: rank 0's and this actor's)."""
        return dropped_by_event(
            self._droppable, [*self._rank0_dropped.values(), self.manager.dropped_events]
        )

    def _checkpoints(self, limit: int) -> dict[str, Any]:
        """For ``status``: the best checkpoint and the checkpoints with their evaluations (the
        ranking when there is one, else the newest evaluated checkpoints)."""
        if self.keeper is not None:
            rows = self.keeper.rows()
            best, metrics = self.keeper.best()
            retention = self.keeper.retention
            return {
                "best_checkpoint": best,
                "best_metrics": metrics,
                "ranked_by": retention.attribute,
                "order": retention.order,
                "checkpoints": rows[:limit],
                "num_checkpoints": len(rows),
            }
        rows: dict[str, dict[str, Any]] = {}
        for r in self.evals.sorted_results():
            path = r["checkpoint_path"]
            row = rows.setdefault(path, {"checkpoint_path": path, "step": r["step"], "metrics": {}})
            row["metrics"].update(r.get("metrics") or {})
            row["failures"] = row.get("failures", 0) + ("error" in r)
        newest = sorted(rows.values(), key=lambda r: -r["step"])
        return {"checkpoints": newest[:limit], "num_checkpoints": len(newest)}

    def _drain(self, what: str) -> None:
        if self.manager.flush(timeout=0.5):
            return
        logger.warning(
            "callback actor: waiting up to %g s (callback_timeout_s) for %s: %s",
            self.end_timeout_s,
            what,
            self.manager.waiting_for(),
        )
        if not self.manager.flush(timeout=self.end_timeout_s):
            logger.warning(
                "callback actor: gave up waiting for %s: %s; they count as not handled",
                what,
                self.manager.waiting_for(),
            )


def _stdout_position() -> int | None:
    """How much this process wrote to stdout so far (Ray sends it to a log file)."""
    import sys

    try:
        sys.stdout.flush()
        return sys.stdout.tell()
    except (OSError, ValueError, AttributeError):
        return None


def with_own_callbacks(
    lists: CallbackLists, writer: ActorStateWriter, keeper: CheckpointKeeper | None
) -> CallbackLists:
    """The user's lists with the actor's own callbacks: the keeper first, so a save is in the
    ranking before an evaluation of it can end (``EvalOnSave`` launches it from ``on_save``);
    the state writer, then the keeper's pruner, last: checkpoints are deleted once every other
    callback saw the save."""
    if keeper is None:
        return {**lists, "global": [*lists["global"], writer]}
    return {
        "core": [keeper, *lists["core"]],
        "user": lists["user"],
        "global": [*lists["global"], writer, keeper.pruner],
    }


def dropped_by_event(droppable: list[str], counts: list[dict[str, int]]) -> dict[str, int]:
    """Runs in the callback actor: the events dropped so far, by event, summed over `counts`
    (each rank-0 attempt's forwarder, as its batches report, and the actor's own queue);
    every event of `droppable` (the low-value ones actor-side callbacks subscribe to) is
    there, at 0 until one is dropped, so that `RayMetrics` starts its counter at 0."""
    totals = dict.fromkeys(droppable, 0)
    for count in counts:
        for event, n in count.items():
            totals[event] = totals.get(event, 0) + n
    return totals


def _was_restarted() -> bool:
    """Whether Ray restarted this actor (read from the GCS actor table, as Ray's deprecated
    `was_current_actor_reconstructed` does)."""
    try:
        from ray._private.state import actors

        info = actors(actor_id=ray.get_runtime_context().get_actor_id())
        return bool(info) and info.get("NumRestarts", 0) != 0
    except Exception:  # no GCS answer: assume a first start
        return False


def _start_evaluators(tracker: EvalTracker, callbacks: list[Any]) -> None:
    """An evaluator actor for each ``EvalOnSave`` whose function is persistent, made now, so
    that it holds its resources (and starts its engine) for the whole run."""
    from callbacks.builtin.eval_on_save import EvalOnSave

    for cb in callbacks:
        if isinstance(cb, EvalOnSave) and getattr(cb.eval_fn, "persistent", False):
            tracker.evaluator(id(cb), cb.eval_fn, cb.num_cpus, cb.num_gpus, cb.resources)


def _reserve(run_name: str, callbacks: list[Any]) -> Any:
    from callbacks.builtin.eval_on_save import EvalOnSave
    from ray_trainer._actor.reservation import reserve

    for cb in callbacks:
        if isinstance(cb, EvalOnSave) and cb.max_in_flight is None:
            cb.max_in_flight = 1
    return reserve(run_name, callbacks)


def start_actor(packed: bytes, run_name: str, run_dir: str, **options: Any) -> tuple[Any, Any]:
    """Create the run's callback actor on the head node (no CPU, restarted if it dies).

    Runs in the driver. Returns the handle and the `ready()` reference without waiting for it:
    the actor starts while Ray Train starts the workers (rank 0 finds it by name and its calls
    queue until the actor is up). Get the reference to surface a constructor error.
    """
    # Requests and status queries have their own thread (the "control" concurrency group), so
    # they are answered while a batch is handled; events are handled one call at a time.
    remote_cls = ray.remote(concurrency_groups={"control": 2})(CallbackActor)
    actor = remote_cls.options(
        name=actor_name(run_name),
        namespace=NAMESPACE,
        num_cpus=0,
        resources={"node:__internal_head__": 0.001},
        max_restarts=-1,
        max_task_retries=-1,
        max_concurrency=1,  # one event call at a time: batches are handled in arrival order
    ).remote(packed, run_name, run_dir, **options)
    return actor, actor.ready.remote()
