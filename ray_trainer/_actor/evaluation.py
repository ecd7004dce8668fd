"""In the callback actor: launching evaluation tasks and collecting their results.

Runs inside the callback actor process. `EvalOnSave.on_save` (on the actor's dispatcher thread)
calls `EvalTracker.launch`, which starts ``eval_fn(checkpoint_path, step)`` as a Ray task with
the requested resources and returns at once. A watcher thread collects finished tasks, cancels
the ones past their timeout, records every outcome, and fires ``on_evaluate`` on the actor-side
callbacks for each success. A task that no live node can run is submitted all the same when the
cluster has an autoscaler (its pending demand is what makes the autoscaler start a node), and
otherwise recorded as "cannot be scheduled" at once. Each outcome reaches the `listener` (the
checkpoint ranking) before the evaluation stops counting as in flight (`pending_paths`).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from callbacks import CallbackManager, TrainingContext
from ray_trainer._cluster import can_grow, live_nodes, missing

logger = logging.getLogger("ray_trainer")


@dataclass
class _Pending:
    step: int
    checkpoint_path: str
    source: str
    deadline: float | None
    closing: bool = False  # its outcome is being recorded (by the watcher or by wait_all)


class EvalTracker:
    """Launches and watches evaluation tasks; keeps their results (bounded by `max_results`)."""

    def __init__(
        self,
        manager: CallbackManager,
        run_name: str,
        filesystem: Any = None,
        run_storage: Any = None,
        max_results: int = 10_000,
    ) -> None:
        self.manager = manager
        self.run_name = run_name
        self.filesystem = filesystem  # the run's storage_filesystem, for the tasks
        self.run_storage = run_storage
        self.max_results = max_results
        self.results: list[dict[str, Any]] = []
        self.results_dropped = 0
        self.fired = 0  # on_evaluate events fired for results (not rank 0's)
        self._in_flight: dict[Any, _Pending] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.last_wire: dict[str, Any] = {}
        # Told every outcome: (checkpoint path, metrics or None when it failed).
        self.listener: Callable[[str, dict[str, Any] | None], None] | None = None
        # An elastic run's placement group for its evaluations (`reservation.EvalPlacement`).
        self.placement: Any = None

    def launch(
        self,
        eval_fn: Any,
        checkpoint_path: str,
        step: int,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        resources: dict[str, float] | None = None,
        timeout_s: float | None = None,
        max_in_flight: int | None = None,
        source: str = "EvalOnSave",
    ) -> None:
        """Start one evaluation task; waits (on the actor only) while `max_in_flight` are running."""
        missing = _unavailable(num_cpus, num_gpus, resources or {})
        if missing:
            self._record(step, checkpoint_path, source, error=f"cannot be scheduled: {missing}")
            return
        with self._cond:
            while max_in_flight is not None and self._count(source) >= max_in_flight:
                self._cond.wait(0.5)
            global _REMOTE_EVAL
            if _REMOTE_EVAL is None:
                _REMOTE_EVAL = ray.remote(_run_eval)
            options: dict[str, Any] = {}
            if self.placement is not None:  # into the resources the run holds for it
                strategy = self.placement.strategy(num_cpus, num_gpus, resources or {})
                options = {"scheduling_strategy": strategy} if strategy is not None else {}
            # eval_fn travels as an argument: a function, a lambda or a callable object alike.
            ref = _REMOTE_EVAL.options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                resources=resources or {},
                max_retries=0,
                **options,
            ).remote(eval_fn, checkpoint_path, step, self.filesystem)
            deadline = time.monotonic() + timeout_s if timeout_s else None
            self._in_flight[ref] = _Pending(step, checkpoint_path, source, deadline)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="eval-watcher", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def in_flight(self) -> int:
        with self._cond:
            return len(self._in_flight)

    def pending_paths(self) -> set[str]:
        """The checkpoints with an evaluation still running (or waiting for its slot)."""
        with self._cond:
            return {p.checkpoint_path for p in self._in_flight.values()}

    def wait_all(self, timeout: float) -> None:
        """Wait for every in-flight evaluation, up to `timeout`; cancel and record the rest."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._in_flight and time.monotonic() < deadline:
                self._cond.wait(min(0.2, max(0.0, deadline - time.monotonic())))
            left = list(self._in_flight)
        for ref in left:
            ray.cancel(ref, force=True)
            self._close(ref, error=f"not finished {timeout:g} s after training ended; cancelled")

    def sorted_results(self) -> list[dict[str, Any]]:
        return sorted(self.results, key=lambda r: r["step"])

    # ---- watcher thread --------------------------------------------------------------------

    def _watch(self) -> None:
        while True:
            with self._cond:
                refs = list(self._in_flight)
                if not refs:
                    self._cond.wait(0.5)
                    continue
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.2)
            for ref in ready:
                self._finish(ref)
            now = time.monotonic()
            with self._cond:
                expired = [
                    r
                    for r, p in self._in_flight.items()
                    if p.deadline is not None and now > p.deadline
                ]
            for ref in expired:
                ray.cancel(ref, force=True)
                self._close(ref, error="timed out; cancelled")

    def _finish(self, ref: Any) -> None:
        try:
            value = ray.get(ref)  # ready: does not wait
        except Exception as e:  # the eval task raised or died: record it, never raise
            self._close(ref, error=_short(e))
            return
        metrics = dict(value) if isinstance(value, dict) else {"value": value}
        p = self._close(ref, metrics=metrics)
        if p is None:
            return
        # The latest rank-0 fields (args, run_name, ...), with the checkpoint's step and path.
        context = TrainingContext.from_wire(
            {
                **self.last_wire,
                "event": "on_evaluate",
                "global_step": p.step,
                "run_name": self.run_name,
                "checkpoint_path": p.checkpoint_path,
                "val_metrics": metrics,
            }
        )
        context.run_storage = self.run_storage
        self.fired += 1
        self.manager.fire("on_evaluate", context, eval_step=p.step, source=p.source)

    def _close(self, ref: Any, **outcome: Any) -> _Pending | None:
        """Record an in-flight evaluation's outcome (once), then stop counting it in flight."""
        with self._cond:
            p = self._in_flight.get(ref)
            if p is None or p.closing:
                return None
            p.closing = True
        self._record(p.step, p.checkpoint_path, p.source, **outcome)
        with self._cond:
            self._in_flight.pop(ref, None)
            self._cond.notify_all()
        return p

    def _record(self, step: int, path: str, source: str, **outcome: Any) -> None:
        if "error" in outcome:
            logger.warning("evaluation of step %d (%s) failed: %s", step, path, outcome["error"])
        if self.listener is not None:
            try:
                self.listener(path, outcome.get("metrics"))
            except Exception:  # the ranking must not lose the evaluation's own record
                logger.exception("recording the evaluation of %s in the ranking failed", path)
        entry = {"step": step, "checkpoint_path": path, "source": source, **outcome}
        with self._cond:
            if len(self.results) >= self.max_results:
                self.results_dropped += 1
                return
            self.results.append(entry)

    def _count(self, source: str) -> int:
        return sum(1 for p in self._in_flight.values() if p.source == source)


def _run_eval(eval_fn: Any, checkpoint_path: str, step: int, filesystem: Any = None) -> Any:
    """The body of every evaluation task: runs wherever Ray places it.

    `eval_fn` gets a local folder holding the checkpoint: the checkpoint itself on local or
    shared storage, else a download into this task's own temporary folder (removed after).
    The checkpoint's own path or URI is passed as ``checkpoint_uri=`` when `eval_fn` takes it.
    """
    from ray_trainer._storage import local_copy, locate

    with local_copy(locate(checkpoint_path, filesystem)) as local:
        if _takes_keyword(eval_fn, "checkpoint_uri"):
            return eval_fn(local, step, checkpoint_uri=checkpoint_path)
        return eval_fn(local, step)


def _takes_keyword(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


_REMOTE_EVAL: Any = None


def _unavailable(num_cpus: float, num_gpus: float, resources: dict[str, float]) -> str | None:
    """Why the task can never run, or None: some live node can run it, or the cluster can
    grow (an autoscaler sees the pending task's demand and may start a node that has the
    resources; `EvalOnSave`'s timeout, else the end of the run, bounds the wait)."""
    reason = missing({"CPU": num_cpus, "GPU": num_gpus, **resources}, live_nodes())
    if reason is None or can_grow():
        return None
    return reason + " and the cluster has no autoscaler to add one"


def _short(e: BaseException) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"
