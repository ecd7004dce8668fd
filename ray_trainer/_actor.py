"""The callback actor: one per run, on the head node, running the actor-side callbacks.

`CallbackActor` runs in its own Ray actor process on the head node (it takes no CPU). It
receives rank-0 events in batches (`push`), hands them in order to an asynchronous
`CallbackManager` (one dispatcher thread: events are handled one at a time, in the order rank 0
produced them), launches evaluation tasks for `EvalOnSave`, answers `status` queries from other
drivers, and returns control requests in its replies. Ray restarts it if it dies
(`max_restarts=-1`); the constructor then restores its callbacks' state from the newest
checkpoint that has it, and rank 0 sends the unacknowledged batches again.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Any

import cloudpickle
import ray

from callbacks import TrainingContext
from ray_trainer._checkpoint import CheckpointError, verify
from ray_trainer._evaluation import EvalTracker
from ray_trainer._placement import build_manager, keep_for_actor, unpack

logger = logging.getLogger("ray_trainer")

NAMESPACE = "ray_trainer"
ACTOR_STATE_FILE = "actor_state.pkl"
_STATUS_FIELDS = (
    "global_step",
    "max_steps",
    "epoch",
    "loss",
    "learning_rate",
    "throughput",
    "samples_seen",
)


def actor_name(run_name: str) -> str:
    return f"ray-trainer:{run_name}"


class _ActorStateWriter:
    """The last `on_save` callback on the actor: writes the actor callbacks' state beside the
    checkpoint, after every other actor callback handled that `on_save`."""

    runs_on = "actor"

    def __init__(self) -> None:
        self.manager: Any = None

    def on_save(self, context: TrainingContext, **kwargs: Any) -> None:
        path = context.checkpoint_path
        if not path or not os.path.isdir(path):
            return
        state = {
            "callbacks": self.manager.state_dict(),
            "user_state": dict(self.manager.user_state),
        }
        tmp = os.path.join(path, f".{ACTOR_STATE_FILE}.tmp")
        with open(tmp, "wb") as f:
            cloudpickle.dump(state, f)
        os.replace(tmp, os.path.join(path, ACTOR_STATE_FILE))


class CallbackActor:
    def __init__(
        self,
        packed: list[Any],
        run_name: str,
        run_dir: str,
        *,
        max_queue: int = 10_000,
        end_timeout_s: float = 60.0,
        eval_timeout_s: float = 600.0,
        push_wait_s: float = 0.05,
    ) -> None:
        lists = unpack(ray.get(packed[0]))
        writer = _ActorStateWriter()
        lists = {**lists, "global": [*lists["global"], writer]}
        self.manager = build_manager(
            lists, keep_for_actor, asynchronous=True, max_queue=max_queue, end_timeout=end_timeout_s
        )
        writer.manager = self.manager
        self.run_name = run_name
        self.run_dir = run_dir
        self.end_timeout_s = end_timeout_s
        self.eval_timeout_s = eval_timeout_s
        self.push_wait_s = push_wait_s
        self.evals = EvalTracker(self.manager, run_name)
        self.received: collections.Counter[str] = collections.Counter()
        self.duplicates = 0
        self.ended = False
        self.saw_exception = False
        self.restored_from = self._restore()
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._last_seq: dict[int, int] = {}
        self._status: dict[str, Any] = {"started_at": time.time()}

    def ready(self) -> dict[str, Any]:
        """Called once by the driver: the actor was built and its callbacks unpickled."""
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def push(self, attempt: int, seq: int, batch: list[tuple[str, dict, dict]]) -> dict[str, Any]:
        """Handle one batch of rank-0 events, in order; reply with the ack and any control."""
        if seq <= self._last_seq.get(attempt, 0):
            self.duplicates += 1
            return {"ack": seq, "control": None}
        for event, wire, kwargs in batch:
            self.received[event] += 1
            self._status.update({k: wire.get(k) for k in _STATUS_FIELDS})
            if event == "on_train_end":
                self._end(wire, kwargs)
                continue
            if event == "on_exception":
                self.saw_exception = True
            context = TrainingContext.from_wire(wire)
            context.eval_launcher = self.evals
            context.callback_errors_total = sum(self.manager.error_counts.values())
            self.manager.fire(event, context, **kwargs)
        self.evals.last_wire = wire
        self._last_seq[attempt] = seq
        # Give quick callbacks a moment, so their requests ride on this reply (rank 0 never waits
        # for it: it collects the reply at a later step boundary).
        self.manager.flush(timeout=self.push_wait_s)
        control = self.manager.take_control()
        return {"ack": seq, "control": vars(control).copy() if control and control.any else None}

    def end(self, error: str | None = None) -> bool:
        """Called by the driver after training: when rank 0 died before it could, fire
        `on_exception` (with the error text) and `on_train_end`. Idempotent; True if it fired."""
        if self.ended:
            return False
        wire = {k: self._status.get(k) for k in _STATUS_FIELDS if k in self._status}
        wire.update(run_name=self.run_name, is_world_process_zero=True)
        if error is not None and not self.saw_exception:
            context = TrainingContext.from_wire({**wire, "event": "on_exception"})
            self.manager.fire("on_exception", context, exception=error)
            self.saw_exception = True
        self._end({**wire, "event": "on_train_end"}, {})
        return True

    def status(self) -> dict[str, Any]:
        """A snapshot for `ray-trainer status`: progress, evaluations so far, callback errors."""
        errors = self.manager.errors
        return {
            "run_name": self.run_name,
            **self._status,
            "events": dict(self.received),
            "evaluations": self.evals.sorted_results()[-5:],
            "num_evaluations": len(self.evals.results),
            "evaluations_in_flight": self.evals.in_flight(),
            "callback_errors": [vars(e) for e in errors[-5:]],
            "num_callback_errors": sum(self.manager.error_counts.values()),
            "restarted": self.restarted,
            "ended": self.ended,
        }

    def summary(self) -> dict[str, Any]:
        """Everything `TrainingResult` takes from the actor, at the end of the run."""
        return {
            "events": dict(self.received),
            "evaluations": self.evals.sorted_results(),
            "callback_errors": [
                {k: v for k, v in vars(e).items() if k != "traceback"} for e in self.manager.errors
            ],
            "dropped_events": dict(self.manager.dropped_events),
            "duplicates": self.duplicates,
            "restarted": self.restarted,
            "restored_from": self.restored_from,
        }

    # ---- internals -------------------------------------------------------------------------

    def _end(self, wire: dict[str, Any], kwargs: dict[str, Any]) -> None:
        """Every queued event, then every in-flight evaluation, then `on_train_end`."""
        if self.ended:
            return
        self.manager.flush(timeout=self.end_timeout_s)
        self.evals.wait_all(timeout=self.eval_timeout_s)
        self.manager.flush(timeout=self.end_timeout_s)  # the on_evaluate events just fired
        context = TrainingContext.from_wire(wire)
        self.manager.fire("on_train_end", context, **kwargs)  # waits, bounded by end_timeout
        self.ended = True

    def _restore(self) -> str | None:
        """Load the actor callbacks' state from the newest checkpoint that has it."""
        if not os.path.isdir(self.run_dir):
            return None
        for name in sorted(os.listdir(self.run_dir), reverse=True):
            path = os.path.join(self.run_dir, name)
            state_file = os.path.join(path, ACTOR_STATE_FILE)
            if not name.startswith("checkpoint_") or not os.path.exists(state_file):
                continue
            try:
                verify(path)
                with open(state_file, "rb") as f:
                    state = cloudpickle.load(f)
            except (CheckpointError, OSError, EOFError) as e:
                logger.warning("skipping actor state in %s: %s", path, e)
                continue
            self.manager.load_state_dict(state["callbacks"])
            self.manager.user_state.update(state["user_state"])
            return path
        return None


def start_actor(packed_ref: Any, run_name: str, run_dir: str, **options: Any) -> tuple[Any, Any]:
    """Create the run's callback actor on the head node (no CPU, restarted if it dies).

    Returns the handle and the `ready()` reference without waiting for it: the actor starts
    while Ray Train starts the workers (rank 0 finds it by name and its calls queue until the
    actor is up). Get the reference to surface a constructor error.
    """
    remote_cls = ray.remote(CallbackActor)
    actor = remote_cls.options(
        name=actor_name(run_name),
        namespace=NAMESPACE,
        num_cpus=0,
        resources={"node:__internal_head__": 0.001},
        max_restarts=-1,
        max_task_retries=-1,
        max_concurrency=1,  # one call at a time: batches are handled in the order they arrive
    ).remote([packed_ref], run_name, run_dir, **options)
    return actor, actor.ready.remote()
