"""Runs on the callback actor: ``TrackerLogger``, the base of the experiment-tracker loggers.

Its hooks (``runs_on="actor"``) only put work on a bounded queue; one daemon thread
(``BackgroundSender``) sends it to the tracker, batching the metrics of consecutive logs into
one call. A tracker that is down or slow costs logged errors and, once the queue is full,
dropped metrics (counted), never a stalled actor: its other callbacks (``EvalOnSave``,
``EarlyStopping``) go on. At ``on_train_end`` the queue is flushed for at most
``flush_timeout_s``, and any failure is reported as this callback's error.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from callbacks._callback import TrainerCallback
from callbacks._events import ALIASES, EVENTS
from callbacks.builtin.common import as_float

__all__ = ["BackgroundSender", "TrackerLogger", "flat_params", "run_identity"]

logger = logging.getLogger("callbacks")

#: The longest text a parameter value gets (MLflow's oldest servers refuse longer ones).
MAX_PARAM_CHARS = 500


class BackgroundSender:
    """A bounded queue of items and one daemon thread handing them, in order, to `handle`
    (a list of the items queued so far, at most `max_batch`). `put` never waits."""

    def __init__(self, name: str, handle: Callable[[list[Any]], None], max_queue: int = 10_000):
        self.name = name
        self.handle = handle
        self.max_queue = max_queue
        self.max_batch = 1000
        self.dropped = 0
        self.failures = 0
        self.last_error: str | None = None
        self._items: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-sender", daemon=True)
        self._thread.start()

    def put(self, item: Any) -> bool:
        """Queue `item`; False (and counted) when the queue is full or closed."""
        with self._cond:
            if self._closed or len(self._items) >= self.max_queue:
                self.dropped += 1
                if self.dropped == 1:
                    logger.warning(
                        "%s: the tracker is behind; dropping what does not fit", self.name
                    )
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far was handled; False after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._items or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """Flush (bounded), then stop taking items; the thread ends once idle."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    return
                n = min(len(self._items), self.max_batch)
                batch = [self._items.popleft() for _ in range(n)]
                self._busy = True
            try:
                self.handle(batch)
            except Exception as e:  # the tracker failed: log, count, go on with the next batch
                self.failures += 1
                self.last_error = f"{type(e).__name__}: {e}"
                if self.failures == 1 or self.failures % 100 == 0:
                    logger.warning(
                        "%s: sending failed (%d so far): %s", self.name, self.failures, e
                    )
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def flat_params(args: dict[str, Any]) -> dict[str, str]:
    """The run's TrainingArgs as tracker parameters: text, at most ``MAX_PARAM_CHARS`` each;
    the unused per-event hook fields are left out."""
    out = {}
    for key, value in sorted(args.items()):
        if (key in EVENTS or key in ALIASES) and not value:
            continue
        text = str(value)
        out[key] = text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - 3] + "..."
    return out


def run_identity(context: Any) -> str | None:
    """What names one ray-trainer run across launches: ``<storage_path>/<run_name>``."""
    args = getattr(context, "args", None) or {}
    name = getattr(context, "run_name", None) or args.get("run_name")
    return f"{args.get('storage_path')}/{name}" if name else None


def stable_id(text: str, length: int = 16) -> str:
    """A tracker-safe id derived from `text` (letters and digits)."""
    return hashlib.sha1(text.encode()).hexdigest()[:length]


class TrackerLogger(TrainerCallback):
    """Base class: queue the run's parameters, metrics, evaluations and end for a tracker.

    Subclasses implement, all called on the sender thread: ``_open(args, run_name, identity)``
    (create or continue the tracker run; set ``self.run_id``), ``_send(points)`` (a list of
    ``(step, {name: value})``), ``_finish(outcome)`` and ``_upload(local_dir, metrics)``.

    Metric names: ``train/<name>`` for each log (loss, learning rate, gradient norm and the
    log's other numbers), ``eval/<name>`` for each evaluation, at the checkpoint's step.
    """

    runs_on = "actor"

    def __init__(
        self,
        run_name: str | None,
        log_best_model: bool,
        max_queue: int,
        flush_timeout_s: float,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"{type(self).__name__}: max_queue must be >= 1, got {max_queue}")
        if not flush_timeout_s > 0:
            raise ValueError(f"{type(self).__name__}: flush_timeout_s must be > 0")
        self.run_name = run_name
        self.log_best_model = log_best_model
        self.max_queue = max_queue
        self.flush_timeout_s = flush_timeout_s
        self.run_id: str | None = None  # the tracker's run: in the state, so a resume continues it
        self._sender: BackgroundSender | None = None
        self._storage: Any = None  # the actor's RunStorage (context.run_storage), if any
        self._open_with: tuple[dict[str, Any], str, str | None] | None = None
        self._opened = False  # on the sender thread: the tracker run is open
        self._error: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_sender"] = state["_storage"] = None  # made again where it runs
        state["_opened"] = False
        return state

    # ---- hooks (the callback actor's dispatcher thread: each only queues) ------------------

    def on_train_begin(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor at each start of the workers: opens the tracker run."""
        self._error = None  # a restart after a failure: the run goes on
        self._start(context)

    def on_log(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor at each log: queues the ``train/*`` metrics."""
        values = {
            "loss": context.loss,
            "learning_rate": context.learning_rate,
            "grad_norm": context.grad_norm,
            "samples_seen": context.samples_seen,
            "tokens_seen": context.tokens_seen,
            **(context.batch_metrics or {}),
        }
        self._queue_metrics(context, context.global_step, "train/", values)

    def on_evaluate(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor with each evaluation: queues ``eval/*`` at its step."""
        step = kwargs.get("eval_step", context.global_step)
        self._queue_metrics(context, step, "eval/", context.val_metrics or {})

    def on_exception(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor when training failed: the run will end as failed."""
        self._error = str(kwargs.get("exception") or context.exception or "failed")

    def on_train_end(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor once at the end: the outcome (and the best model), then
        waits up to ``flush_timeout_s`` for the sends; raises if the tracker missed anything."""
        sender = self._start(context)
        outcome = {
            "status": "failed" if self._error else "finished",
            "error": self._error,
            "stopped_early": bool(context.stop_reason),
            "stop_reason": context.stop_reason,
            "global_step": context.global_step,
        }
        if self.log_best_model:
            best = getattr(context, "best_checkpoint_path", None) or context.checkpoint_path
            metrics = getattr(context, "best_metrics", None) or {}
            if best:
                sender.put(("call", lambda: self._upload_checkpoint(best, metrics)))
        sender.put(("call", lambda: self._finish(outcome)))
        done = sender.close(self.flush_timeout_s)
        problems = []
        if not done:
            problems.append(f"not done after flush_timeout_s={self.flush_timeout_s:g} s")
        if sender.failures:
            problems.append(f"{sender.failures} send(s) failed, last: {sender.last_error}")
        if sender.dropped:
            problems.append(f"{sender.dropped} item(s) dropped (the queue was full)")
        self._sender = None
        if problems:
            raise RuntimeError(f"{type(self).__name__}: " + "; ".join(problems))

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id")

    # ---- for subclasses (the sender thread) ------------------------------------------------

    def _open(self, args: dict[str, Any], run_name: str, identity: str | None) -> None:
        raise NotImplementedError

    def _send(self, points: list[tuple[int, dict[str, float]]]) -> None:
        raise NotImplementedError

    def _finish(self, outcome: dict[str, Any]) -> None:
        raise NotImplementedError

    def _upload(self, local_dir: str, checkpoint: str, metrics: dict[str, Any]) -> None:
        raise NotImplementedError

    # ---- internals -------------------------------------------------------------------------

    def _start(self, context: Any) -> BackgroundSender:
        """The sender, started on the first event with the run's args (queued first: open)."""
        self._storage = self._storage or getattr(context, "run_storage", None)
        if self._sender is None:
            args = dict(getattr(context, "args", None) or {})
            name = self.run_name or getattr(context, "run_name", None) or args.get("run_name")
            self._open_with = (args, str(name or "ray-trainer"), run_identity(context))
            self._sender = BackgroundSender(type(self).__name__, self._handle, self.max_queue)
        return self._sender

    def _queue_metrics(self, context: Any, step: Any, prefix: str, values: dict) -> None:
        numbers = {f"{prefix}{k}": v for k, v in values.items() if as_float(v) is not None}
        if numbers:
            self._start(context).put(("metrics", int(step or 0), numbers))

    def _handle(self, batch: list[Any]) -> None:
        """On the sender thread: open the tracker run (until that works), then the items in
        order, the metrics of consecutive items in one send. A batch that fails is not retried."""
        if not self._opened:
            self._open(*self._open_with)
            self._opened = True
        points: list[tuple[int, dict[str, float]]] = []
        for item in batch:
            if item[0] == "metrics":
                points.append((item[1], {k: float(v) for k, v in item[2].items()}))
                continue
            if points:
                self._send(points)
                points = []
            item[1]()
        if points:
            self._send(points)

    def _upload_checkpoint(self, checkpoint: str, metrics: dict[str, Any]) -> None:
        """The checkpoint's ``hf/`` export as an artifact, from a local copy when on a bucket."""
        import contextlib
        import os

        hf = checkpoint.rstrip("/") + "/hf"
        storage = self._storage
        copy = storage.local_copy(hf) if storage is not None else contextlib.nullcontext(hf)
        with copy as local:
            if not os.path.isdir(local):
                raise FileNotFoundError(f"log_best_model: {hf} does not exist (no hf/ export)")
            self._upload(local, checkpoint, metrics)
