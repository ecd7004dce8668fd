"""Runs on the callback actor: ``DivergenceDetector``, to stop (or abort) a diverging run."""

from __future__ import annotations

import math
from typing import Any

from callbacks._callback import TrainerCallback
from callbacks.builtin.common import as_float

__all__ = ["ABORT_MARKER", "DivergenceDetector"]

#: The tag in the ``stop_reason`` of an abort, for people reading logs and results; the runner
#: acts on ``TrainerControl.should_abort``, never on this text.
ABORT_MARKER = "(abort)"
_ACTIONS = ("stop", "abort")


class DivergenceDetector(TrainerCallback):
    """Request a stop when the training loss diverges or becomes NaN/Inf.

    Runs on the callback actor (``runs_on="actor"``), on ``on_log``. It keeps an exponential
    moving average of the loss (``ema = alpha * loss + (1 - alpha) * ema``) and the lowest EMA
    so far. A log is *diverged* when the EMA exceeds ``best * threshold_rel`` (only while the
    best EMA is positive) or ``threshold_abs``; ``patience`` consecutive diverged logs after the
    warm-up (``global_step > warmup_steps``) request a stop. A NaN or infinite loss requests one
    at once, even during warm-up. The EMA and its best are tracked from the first log.

    ``action="stop"`` stops like any callback (the runner saves a final checkpoint).
    ``action="abort"`` sets ``TrainerControl.should_abort``: the run stops without a final
    checkpoint (the previous checkpoints stay), and the ``stop_reason`` starts with
    ``"DivergenceDetector(abort)"``.

    Logs of a step not newer than the last one seen (events delivered again after a restart)
    are ignored for the EMA. Stateful: EMA, best EMA, the consecutive count and the last step
    are saved in every checkpoint.

    Args:
        threshold_abs: diverged when the loss EMA exceeds this value (None: no absolute limit).
        threshold_rel: diverged when the loss EMA exceeds the best EMA times this (> 1;
            None: no relative limit).
        patience: consecutive diverged logs (after warm-up) before acting (at least 1).
        warmup_steps: steps up to which only NaN/Inf is checked.
        ema_alpha: weight of the newest loss in the EMA, in (0, 1].
        action: ``"stop"`` (save a final checkpoint) or ``"abort"`` (do not).

    Example:
        >>> run_training(callbacks=[DivergenceDetector(threshold_rel=2.0, patience=5,
        ...                                            action="abort")])
    """

    def __init__(
        self,
        threshold_abs: float | None = None,
        threshold_rel: float | None = 3.0,
        patience: int = 3,
        warmup_steps: int = 50,
        ema_alpha: float = 0.1,
        action: str = "stop",
    ) -> None:
        if threshold_rel is not None and not threshold_rel > 1:
            raise ValueError(
                f"DivergenceDetector: threshold_rel must be > 1 (or None), got {threshold_rel!r}"
            )
        if threshold_abs is not None and math.isnan(threshold_abs):
            raise ValueError("DivergenceDetector: threshold_abs must be a number or None, got nan")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"DivergenceDetector: patience must be an int >= 1, got {patience!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(
                f"DivergenceDetector: warmup_steps must be an int >= 0, got {warmup_steps!r}"
            )
        if not 0 < ema_alpha <= 1:
            raise ValueError(f"DivergenceDetector: ema_alpha must be in (0, 1], got {ema_alpha!r}")
        if action not in _ACTIONS:
            raise ValueError(
                f"DivergenceDetector: action must be 'stop' or 'abort', got {action!r}"
            )
        self.threshold_abs = threshold_abs
        self.threshold_rel = threshold_rel
        self.patience = patience
        self.warmup_steps = warmup_steps
        self.ema_alpha = float(ema_alpha)
        self.action = action
        self.ema: float | None = None
        self.best_ema: float | None = None
        self.bad = 0
        self.last_step: int | None = None

    def on_log(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor at each log with the cross-rank average loss."""
        loss = context.loss
        if loss is None:
            loss = (context.batch_metrics or {}).get("loss")
        loss = as_float(loss)
        if loss is None:
            return
        step = context.global_step
        if not math.isfinite(loss):
            self._request(context, f"loss is {loss} at step {step}")
            return
        if self.last_step is not None and step <= self.last_step:
            return
        self.last_step = step
        a = self.ema_alpha
        self.ema = loss if self.ema is None else a * loss + (1 - a) * self.ema
        if self.best_ema is None or self.ema < self.best_ema:
            self.best_ema = self.ema
        if step <= self.warmup_steps:
            return
        why = self._diverged(self.ema)
        if why is None:
            self.bad = 0
            return
        self.bad += 1
        if self.bad >= self.patience:
            self._request(context, f"{why} for {self.bad} consecutive logs (step {step})")

    def _diverged(self, ema: float) -> str | None:
        """Why the EMA counts as diverged, or None."""
        if self.threshold_abs is not None and ema > self.threshold_abs:
            return f"loss EMA {ema:.4g} > threshold_abs {self.threshold_abs:g}"
        best = self.best_ema
        rel = self.threshold_rel
        if rel is not None and best is not None and best > 0 and ema > best * rel:
            return f"loss EMA {ema:.4g} > {rel:g}x best EMA {best:.4g}"
        return None

    def _request(self, context: Any, why: str) -> None:
        tag = (
            f"DivergenceDetector{ABORT_MARKER}" if self.action == "abort" else "DivergenceDetector"
        )
        context.control.should_training_stop = True
        if self.action == "abort":
            context.control.should_abort = True  # stop without a final checkpoint
        context.control.stop_reason = f"{tag}: {why}"

    def state_dict(self) -> dict[str, Any]:
        return {
            "ema": self.ema,
            "best_ema": self.best_ema,
            "bad": self.bad,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema = state["ema"]
        self.best_ema = state["best_ema"]
        self.bad = int(state["bad"])
        self.last_step = state.get("last_step")
