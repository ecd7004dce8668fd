"""In the callback actor: launching evaluation tasks and collecting their results.

Runs inside the callback actor process. `EvalOnSave.on_save` (on the actor's dispatcher thread)
calls `EvalTracker.launch`, which starts ``eval_fn(checkpoint_path, step)`` as a Ray task with
the requested resources and returns at once. A watcher thread collects finished tasks, cancels
the ones past their timeout, records every outcome, and fires ``on_evaluate`` on the actor-side
callbacks for each success. A task that no live node can run is submitted all the same when the
cluster has an autoscaler (its pending demand is what makes the autoscaler start a node), and
otherwise recorded as "cannot be scheduled" at once. Each outcome reaches the `listener` (the
checkpoint ranking) before the evaluation stops counting as in flight (`pending_paths`).

An ``eval_fn`` whose ``persistent`` attribute is true (``GenerationEval(keep_engine=True)``)
runs instead in one evaluator actor per ``EvalOnSave``, created when the callback actor starts
(so its resources are held for the run, in the elastic run's placement group like the tasks'),
which keeps the function object, and so its warm engine, between checkpoints. Ray restarts an
evaluator that dies once; the call that was running is recorded as an evaluation error. The
evaluators are ended at the end of the run (`close`), and die with the callback actor.
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
    saved_at: float = 0.0  # wall clock when its checkpoint's on_save reached the actor
    seconds_after_save: float | None = None  # from saved_at to its outcome, once recorded
    closing: bool = False  # its outcome is being recorded (by the watcher or by wait_all)
    on_actor: bool = False  # a call of an evaluator actor (cancelled without force)


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
        self._evaluators: dict[Any, Any] = {}  # EvalOnSave's key -> its evaluator actor

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
        key: Any = None,
    ) -> None:
        """Start one evaluation task (or a call of `source`'s evaluator actor, for a persistent
        `eval_fn`: the evaluator of `key`, one per ``EvalOnSave``); waits (on the actor only)
        while `max_in_flight` are running."""
        saved_at = time.time()  # called from on_save: the checkpoint is persisted by now
        missing = _unavailable(num_cpus, num_gpus, resources or {})
        if missing:
            self._record(step, checkpoint_path, source, error=f"cannot be scheduled: {missing}")
            return
        with self._cond:
            while max_in_flight is not None and self._count(source) >= max_in_flight:
                self._cond.wait(0.5)
            on_actor = bool(getattr(eval_fn, "persistent", False))
            if on_actor:
                evaluator = self.evaluator(
                    source if key is None else key, eval_fn, num_cpus, num_gpus, resources
                )
                ref = evaluator.run.remote(checkpoint_path, step, self.filesystem)
            else:
                global _REMOTE_EVAL
                if _REMOTE_EVAL is None:
                    _REMOTE_EVAL = ray.remote(_run_eval)
                # eval_fn travels as an argument: a function, a lambda or a callable object.
                ref = _REMOTE_EVAL.options(
                    **self._options(num_cpus, num_gpus, resources), max_retries=0
                ).remote(eval_fn, checkpoint_path, step, self.filesystem)
            deadline = time.monotonic() + timeout_s if timeout_s else None
            self._in_flight[ref] = _Pending(
                step, checkpoint_path, source, deadline, saved_at, on_actor=on_actor
            )
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="eval-watcher", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def _options(
        self, num_cpus: float, num_gpus: float, resources: dict[str, float] | None
    ) -> dict[str, Any]:
        options: dict[str, Any] = {
            "num_cpus": num_cpus, "num_gpus": num_gpus, "resources": resources or {},
        }  # fmt: skip
        if self.placement is not None:  # into the resources the run holds for it
            strategy = self.placement.strategy(num_cpus, num_gpus, resources or {})
            if strategy is not None:
                options["scheduling_strategy"] = strategy
        return options

    def evaluator(
        self,
        key: Any,
        eval_fn: Any,
        num_cpus: float = 1,
        num_gpus: float = 0,
        resources: dict[str, float] | None = None,
    ) -> Any:
        """The evaluator actor of `key` (an ``EvalOnSave``), created at the first call (the
        callback actor's start makes one for each persistent ``EvalOnSave``): it holds its
        resources for the run."""
        with self._cond:
            actor = self._evaluators.get(key)
            if actor is None:
                global _REMOTE_EVALUATOR
                if _REMOTE_EVALUATOR is None:
                    _REMOTE_EVALUATOR = ray.remote(_Evaluator)
                actor = _REMOTE_EVALUATOR.options(
                    **self._options(num_cpus, num_gpus, resources),
                    max_restarts=1,
                    max_task_retries=0,
                ).remote(eval_fn)
                self._evaluators[key] = actor
            return actor

    def close(self, timeout: float = 30.0) -> None:
        """End the evaluator actors: each closes its function (its engine) within `timeout`,
        then is killed, so no engine outlives the run."""
        with self._cond:
            actors, self._evaluators = list(self._evaluators.values()), {}
        closing = [a.close.remote() for a in actors]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=timeout)
        for actor in actors:
            ray.kill(actor, no_restart=True)

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
            self._cancel(ref)
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
                self._cancel(ref)
                self._close(ref, error="timed out; cancelled")

    def _cancel(self, ref: Any) -> None:
        """A task is killed; a call of an evaluator actor is interrupted (Ray cannot force an
        actor's call; its function drops the engine it was using)."""
        p = self._in_flight.get(ref)
        try:
            ray.cancel(ref, force=not (p is not None and p.on_actor))
        except Exception:  # already finished, or its worker gone
            logger.debug("cancelling %s failed", ref, exc_info=True)

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
        self.manager.fire(
            "on_evaluate",
            context,
            eval_step=p.step,
            source=p.source,
            seconds_after_save=p.seconds_after_save,
        )

    def _close(self, ref: Any, **outcome: Any) -> _Pending | None:
        """Record an in-flight evaluation's outcome (once), then stop counting it in flight."""
        with self._cond:
            p = self._in_flight.get(ref)
            if p is None or p.closing:
                return None
            p.closing = True
        p.seconds_after_save = round(time.time() - p.saved_at, 3)
        self._record(
            p.step, p.checkpoint_path, p.source, seconds_after_save=p.seconds_after_save, **outcome
        )
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

    `eval_fn` gets a local folder holding the checkpoint, verified first as every reader of
    checkpoints verifies one (``open_checkpoint``): complete, every listed file matching the
    SHA-256 its manifest lists, and no file that a reader opens (``model.pt``, ``shards/``,
    ``hf/``...) there unlisted, else the evaluation fails with the `CheckpointError` that says
    why. The folder is the checkpoint itself on local or shared storage, else a download into
    this task's own temporary folder (removed after). ``load_model`` of that folder inside
    `eval_fn` does not hash it again. The checkpoint's own path or URI is passed as
    ``checkpoint_uri=`` when `eval_fn` takes it, and the run's ``storage_filesystem`` (when one
    is set) as ``filesystem=``.
    """
    from ray_trainer._checkpoint import open_checkpoint
    from ray_trainer._storage import locate

    with open_checkpoint(locate(checkpoint_path, filesystem)) as checkpoint:
        kwargs: dict[str, Any] = {}
        if _takes_keyword(eval_fn, "checkpoint_uri"):
            kwargs["checkpoint_uri"] = checkpoint_path
        if filesystem is not None and _takes_keyword(eval_fn, "filesystem"):
            kwargs["filesystem"] = filesystem  # the run's storage_filesystem, to write back
        return eval_fn(checkpoint.folder, step, **kwargs)


class _Evaluator:
    """An evaluator actor: keeps one ``EvalOnSave``'s persistent `eval_fn` (and whatever it
    keeps, a warm engine) for the run; each call evaluates one checkpoint as `_run_eval`
    does."""

    def __init__(self, eval_fn: Any) -> None:
        self.eval_fn = eval_fn

    def run(self, checkpoint_path: str, step: int, filesystem: Any = None) -> Any:
        return _run_eval(self.eval_fn, checkpoint_path, step, filesystem)

    def close(self) -> None:
        close = getattr(self.eval_fn, "close", None)
        if callable(close):
            close()


def _takes_keyword(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


_REMOTE_EVAL: Any = None
_REMOTE_EVALUATOR: Any = None


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
