"""Driver: `TrainingResult`, built from the callback actor's summary.

Runs in the driver. The result has one way back (see ``_contract.py``): the callback actor's
``ActorSummary``, which holds rank 0's end-of-attempt ``WorkerSummary`` when rank 0 got to hand
it over, and the actor's own view of the run otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray_trainer._contract import ActorSummary


@dataclass
class TrainingResult:
    """The outcome of a run.

    Attributes:
        global_step: optimizer steps completed.
        metrics: the last metrics of the run (loss, samples/tokens seen, last validation metrics).
        checkpoint_path: the last complete checkpoint, or None.
        evaluations: evaluation results, each a dict with ``step``, ``checkpoint_path`` and
            ``metrics`` (or ``error``), in step order.
        stopped_early: True when a callback stopped the run before ``max_steps``.
        stop_reason: the name of the callback that asked to stop (or its stated reason).
        callback_errors: dicts with ``callback``, ``event``, ``step``, ``error``.
        events: rank-0 events the callback actor handled, by event.
        unhandled_events: rank-0 events the actor received but did not handle, by event (a
            hung or slow actor-side callback held them past its timeouts, or its queue was full).
        attempts: how many times the worker group started (1 without a restart).
        best_checkpoint_path: the best checkpoint by ``checkpoint_score_attribute`` (None
            without one, or when no checkpoint has a score).
        best_metrics: that checkpoint's metrics: its evaluations' metrics and the ranking
            metric's value (its evaluation's, else the value logged at or before its save).
    """

    global_step: int
    metrics: dict[str, Any]
    checkpoint_path: str | None
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    stopped_early: bool = False
    stop_reason: str | None = None
    callback_errors: list[dict[str, Any]] = field(default_factory=list)
    events: dict[str, int] = field(default_factory=dict)
    attempts: int = 1
    run_name: str = ""
    run_dir: str = ""
    undelivered_events: int = 0
    unhandled_events: dict[str, int] = field(default_factory=dict)
    best_checkpoint_path: str | None = None
    best_metrics: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        """A few human-readable lines, as the CLI prints them."""
        lines = [
            f"run {self.run_name}: {self.global_step} steps, {self.attempts} attempt(s)",
            "metrics: " + ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(self.metrics.items())),
            f"checkpoint: {self.checkpoint_path}",
        ]
        if self.best_checkpoint_path:
            lines.append(f"best checkpoint: {self.best_checkpoint_path}")
        if self.stopped_early:
            lines.append(f"stopped early by: {self.stop_reason}")
        if self.evaluations:
            last = self.evaluations[-1]
            lines.append(f"evaluations: {len(self.evaluations)} (last at step {last.get('step')})")
        if self.callback_errors:
            lines.append(f"callback errors: {len(self.callback_errors)}")
        if self.unhandled_events:
            shown = ", ".join(f"{e} x{n}" for e, n in sorted(self.unhandled_events.items()))
            lines.append(f"events the callback actor did not handle: {shown}")
        return "\n".join(lines)


def build_result(run_name: str, run_dir: str, actor: ActorSummary) -> TrainingResult:
    """The `TrainingResult` of a run that ended without error."""
    worker = actor.worker
    if worker is None:  # rank 0 could not hand its summary over: what the actor saw
        return TrainingResult(
            global_step=actor.last_step,
            metrics={},
            checkpoint_path=actor.last_checkpoint,
            evaluations=actor.evaluations,
            callback_errors=list(actor.callback_errors),
            events=actor.events,
            attempts=actor.attempts,
            run_name=run_name,
            run_dir=run_dir,
            unhandled_events=actor.unhandled_events,
            best_checkpoint_path=actor.best_checkpoint,
            best_metrics=dict(actor.best_metrics),
        )
    metrics = {
        "loss": worker.loss,
        "samples_seen": worker.samples_seen,
        "tokens_seen": worker.tokens_seen,
        "epoch": worker.epoch,
    }
    return TrainingResult(
        global_step=worker.global_step,
        metrics={k: v for k, v in metrics.items() if v is not None} | dict(worker.val_metrics),
        checkpoint_path=worker.checkpoint_path or actor.last_checkpoint,
        evaluations=actor.evaluations,
        stopped_early=worker.stopped_early,
        stop_reason=worker.stop_reason,
        callback_errors=list(worker.callback_errors) + list(actor.callback_errors),
        events=actor.events,
        attempts=actor.attempts,
        run_name=run_name,
        run_dir=run_dir,
        undelivered_events=worker.undelivered_events,
        unhandled_events=actor.unhandled_events,
        best_checkpoint_path=actor.best_checkpoint,
        best_metrics=dict(actor.best_metrics),
    )


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
