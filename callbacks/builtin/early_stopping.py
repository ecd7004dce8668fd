"""Runs on the callback actor: ``EarlyStopping``, to stop once an eval metric stops improving."""

from __future__ import annotations

import math
from typing import Any

from callbacks._callback import TrainerCallback
from callbacks.builtin.common import as_float

__all__ = ["EarlyStopping"]

_MODES = ("min", "max")


class EarlyStopping(TrainerCallback):
    """Request a stop after ``patience`` evaluations without improvement of ``metric``.

    Runs on the callback actor (``runs_on="actor"``), on ``on_evaluate``: in-loop validation
    and ``EvalOnSave`` results both arrive there with ``context.val_metrics``. An evaluation
    improves when its value beats the best so far by more than ``min_delta`` (lower for
    ``mode="min"``, higher for ``mode="max"``); otherwise it counts towards ``patience``, and
    reaching it requests a stop (the runner saves a final checkpoint) with a ``stop_reason``
    such as ``"EarlyStopping: val_loss did not improve for 3 evaluations (best 1.23 at step
    400)"``.

    Ordering: only an evaluation of a step *newer* than the newest one already considered
    counts. ``EvalOnSave`` results may arrive out of order (a slow evaluation of step 400 after
    a fast one of step 500); the older one is ignored, since a later model was already judged.
    The same rule ignores evaluations repeated after a restart (already counted) and a second
    source reporting the same step.

    A missing ``metric`` raises ``ValueError`` naming the metrics available (the manager
    records it as a callback error) until the metric has been seen once; after that,
    evaluations without it (another source, e.g. in-loop validation next to ``EvalOnSave``)
    are skipped. A NaN or infinite value requests a stop at once when ``check_finite``.

    Stateful: ``best``, ``best_step``, ``wait`` and the newest step considered are saved in
    every checkpoint and restored on resume.

    Args:
        metric: the key in ``val_metrics`` to watch, e.g. ``"val_loss"``.
        mode: ``"min"`` (lower is better) or ``"max"``.
        patience: evaluations without improvement before stopping (at least 1).
        min_delta: the smallest change that counts as an improvement (>= 0).
        check_finite: stop at once when the metric is NaN or infinite.

    Example:
        >>> run_training(eval_every_steps=100, callbacks=[
        ...     EarlyStopping("val_loss", patience=3, min_delta=0.01)])
    """

    def __init__(
        self,
        metric: str,
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        check_finite: bool = True,
    ) -> None:
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"EarlyStopping: metric must be a non-empty string, got {metric!r}")
        if mode not in _MODES:
            raise ValueError(f"EarlyStopping: mode must be 'min' or 'max', got {mode!r}")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping: patience must be an int >= 1, got {patience!r}")
        if not min_delta >= 0:
            raise ValueError(f"EarlyStopping: min_delta must be >= 0, got {min_delta!r}")
        self.metric = metric
        self.mode = mode
        self.patience = patience
        self.min_delta = float(min_delta)
        self.check_finite = check_finite
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0
        self.last_step: int | None = None
        self.metric_seen = False

    def on_evaluate(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor with each evaluation's ``val_metrics``."""
        step = kwargs.get("eval_step", context.global_step)
        if self.last_step is not None and step <= self.last_step:
            return  # older than (or as old as) a result already considered
        metrics = context.val_metrics or {}
        if self.metric not in metrics:
            if self.metric_seen:
                return  # another evaluation source that does not compute this metric
            available = ", ".join(sorted(map(str, metrics))) or "none"
            raise ValueError(
                f"EarlyStopping: metric {self.metric!r} is not in val_metrics of step {step} "
                f"(available: {available}); pass one of those names, or return "
                f"{self.metric!r} from your eval_fn"
            )
        value = as_float(metrics[self.metric])
        if value is None:
            raise ValueError(
                f"EarlyStopping: val_metrics[{self.metric!r}] at step {step} is "
                f"{metrics[self.metric]!r}, not a number"
            )
        self.metric_seen = True
        self.last_step = step
        control = context.control
        if self.check_finite and not math.isfinite(value):
            control.should_training_stop = True
            control.stop_reason = f"EarlyStopping: {self.metric} is {value} at step {step}"
            return
        if self._improved(value):
            self.best, self.best_step, self.wait = value, step, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            control.should_training_stop = True
            best = (
                f"best {self.best:.6g} at step {self.best_step}"
                if self.best is not None
                else "no finite value yet"
            )
            times = f"{self.wait} evaluation{'s' if self.wait > 1 else ''}"
            control.stop_reason = (
                f"EarlyStopping: {self.metric} did not improve for {times} ({best})"
            )

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return math.isfinite(value)
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_step": self.best_step,
            "wait": self.wait,
            "last_step": self.last_step,
            "metric_seen": self.metric_seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state["best"]
        self.best_step = state["best_step"]
        self.wait = int(state["wait"])
        self.last_step = state.get("last_step")
        self.metric_seen = bool(state.get("metric_seen", self.best is not None))
