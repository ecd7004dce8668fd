"""``RayMetrics``: export training progress as Ray application metrics (Prometheus, dashboard)."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from callbacks._builtin_common import as_float, throughput_of
from callbacks._callback import TrainerCallback

__all__ = ["RayMetrics"]

logger = logging.getLogger("callbacks")

#: At most this many ``<prefix>_eval_<metric>`` gauges; further metric names are not exported
#: (memory and Prometheus series stay bounded whatever an eval_fn returns).
MAX_EVAL_GAUGES = 64
_RAY_PREFIX = "ray_"
_TRAIN_GAUGES = {
    "step": "Global optimizer step",
    "loss": "Training loss (cross-rank average) at the last log",
    "learning_rate": "Learning rate at the last log",
    "tokens_per_s": "Training throughput at the last log, tokens/s",
}


def _import_ray_metrics() -> Any:
    """``ray.util.metrics``, imported where the callback runs (tests replace this function)."""
    from ray.util import metrics

    return metrics


def sanitize(name: str) -> str:
    """A metric-name fragment: every character outside ``[a-zA-Z0-9_]`` becomes ``_``."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", str(name))


class RayMetrics(TrainerCallback):
    """Export step, loss, learning rate, throughput and evaluation metrics to Ray's metrics.

    Runs on the callback actor (``runs_on="actor"``), through ``ray.util.metrics``: the values
    show up in the Ray dashboard's metrics view and on the Prometheus endpoint of the head node.
    Exported names (with the default ``prefix``), every series tagged ``run=<run_name>``:

    - gauges ``ray_trainer_step``, ``ray_trainer_loss``, ``ray_trainer_learning_rate``,
      ``ray_trainer_tokens_per_s`` (set at each ``on_log``);
    - a gauge ``ray_trainer_eval_<metric>`` per evaluation metric name, the name sanitized to
      ``[a-zA-Z0-9_]`` (set at each ``on_evaluate``; at most ``MAX_EVAL_GAUGES`` names);
    - a gauge ``ray_trainer_callback_errors`` when the actor provides
      ``context.callback_errors_total``;
    - a counter ``ray_trainer_events_handled`` (tags ``run``, ``event``) of the events this
      callback received.

    Ray prefixes application metrics with ``ray_`` itself, so the metric objects are created
    without it (``Gauge("trainer_step")`` is exported as ``ray_trainer_step``); a ``prefix``
    that does not start with ``ray_`` still gets it on the endpoint. A Ray gauge that is not set
    again for about two report intervals disappears from the endpoint, so every event this
    callback receives re-sets all known gauges when ``report_every_s`` has passed since the
    last re-set (a pause with no events at all, e.g. a very long checkpoint, can still let them
    lapse). The metric objects are created on the first event (``ray.util.metrics`` is imported
    there, in the actor) and are not pickled.

    Args:
        prefix: the exported name prefix (default ``"ray_trainer"``).
        report_every_s: the longest time between two re-sets of every gauge, while events
            arrive.

    Example:
        >>> run_training(callbacks=[RayMetrics()])
        >>> # curl http://<head>:<metrics-export-port>/metrics | grep ray_trainer_loss
    """

    def __init__(self, prefix: str = "ray_trainer", report_every_s: float = 5.0) -> None:
        if not prefix or sanitize(prefix) != prefix or prefix[0].isdigit():
            raise ValueError(
                f"RayMetrics: prefix must be letters, digits and '_' and not start with a "
                f"digit, got {prefix!r}"
            )
        if not report_every_s > 0:
            raise ValueError(f"RayMetrics: report_every_s must be > 0, got {report_every_s!r}")
        self.prefix = prefix
        self.report_every_s = float(report_every_s)
        self._clock = time.monotonic
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._metrics: Any = None  # the ray.util.metrics module, once imported
        self._gauges: dict[str, Any] = {}
        self._counter: Any = None
        self._values: dict[str, float] = {}  # gauge suffix -> last value
        self._run = ""
        self._last_report: float | None = None
        self._warned_cap = False

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_metrics", "_counter"):
            state[name] = None
        state["_gauges"] = {}
        return state

    @property
    def object_prefix(self) -> str:
        """The prefix of the metric objects' names: ``prefix`` without Ray's own ``ray_``."""
        p = self.prefix
        return (
            p[len(_RAY_PREFIX) :] if p.startswith(_RAY_PREFIX) and len(p) > len(_RAY_PREFIX) else p
        )

    # -- hooks: every one counts the event and may re-set the gauges -------------------------

    def on_train_begin(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor before training: creates the metrics."""
        self._event(context, "on_train_begin", {"step": context.global_step})

    def on_log(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor at each log: sets the training gauges."""
        throughput = throughput_of(context)
        values = {
            "step": context.global_step,
            "loss": context.loss,
            "learning_rate": context.learning_rate,
            "tokens_per_s": throughput,
        }
        self._event(context, "on_log", values)

    def on_evaluate(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor with each evaluation: sets the eval gauges."""
        values = {f"eval_{sanitize(k)}": v for k, v in (context.val_metrics or {}).items()}
        self._event(context, "on_evaluate", values)

    def on_save(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor after each checkpoint: keeps the gauges alive."""
        self._event(context, "on_save", {})

    def on_epoch_end(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor at each epoch end: keeps the gauges alive."""
        self._event(context, "on_epoch_end", {})

    def on_train_end(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor once at the end: a last re-set of every gauge."""
        self._event(context, "on_train_end", {"step": context.global_step}, force=True)

    # -- internals ---------------------------------------------------------------------------

    def _event(self, context: Any, event: str, values: dict[str, Any], force: bool = False):
        if self._metrics is None:
            self._metrics = _import_ray_metrics()
            self._counter = self._metrics.Counter(
                f"{self.object_prefix}_events_handled",
                description="Training events handled by the RayMetrics callback",
                tag_keys=("run", "event"),
            )
        self._run = str(context.run_name or (context.args or {}).get("run_name") or "")
        errors = getattr(context, "callback_errors_total", None)
        if errors is not None:
            values = {**values, "callback_errors": errors}
        changed = []
        for suffix, value in values.items():
            number = as_float(value)
            if number is None:
                continue
            if suffix not in self._gauges and not self._make_gauge(suffix):
                continue
            self._values[suffix] = number
            changed.append(suffix)
        now = self._clock()
        due = force or self._last_report is None or now - self._last_report >= self.report_every_s
        tags = {"run": self._run}
        for suffix in self._values if due else changed:
            self._gauges[suffix].set(self._values[suffix], tags=tags)
        if due:
            self._last_report = now
        self._counter.inc(1, tags={"run": self._run, "event": event})

    def _make_gauge(self, suffix: str) -> bool:
        evals = sum(1 for s in self._gauges if s.startswith("eval_"))
        if suffix.startswith("eval_") and evals >= MAX_EVAL_GAUGES:
            if not self._warned_cap:
                logger.warning(
                    "RayMetrics: more than %d evaluation metric names; %r and later ones are "
                    "not exported",
                    MAX_EVAL_GAUGES,
                    suffix[len("eval_") :],
                )
                self._warned_cap = True
            return False
        if suffix.startswith("eval_"):
            description = f"Evaluation metric {suffix[len('eval_') :]!r} at the last evaluation"
        elif suffix == "callback_errors":
            description = "Callback errors recorded so far"
        else:
            description = _TRAIN_GAUGES.get(suffix, suffix)
        self._gauges[suffix] = self._metrics.Gauge(
            f"{self.object_prefix}_{suffix}", description=description, tag_keys=("run",)
        )
        return True
