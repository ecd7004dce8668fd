"""Runs on the callback actor: ``RayMetrics``, training progress as Ray application metrics."""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from typing import Any

from callbacks._callback import TrainerCallback
from callbacks.builtin.common import as_float, objective_metrics, throughput_of

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
    "workers": "Training workers of the current attempt (an elastic run's size)",
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
      ``ray_trainer_tokens_per_s`` (set at each ``on_log``), and ``ray_trainer_workers`` (set
      at each attempt's ``on_train_begin``: an elastic run's size);
    - under ``objective="dpo"``, a gauge per logged metric of TRL's (``rewards/chosen``,
      ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
      ``logps/rejected``), named with ``/`` as ``_``: ``ray_trainer_rewards_accuracies``;
    - a gauge ``ray_trainer_eval_<metric>`` per evaluation metric name, the name sanitized to
      ``[a-zA-Z0-9_]`` (set at each ``on_evaluate``; at most ``MAX_EVAL_GAUGES`` names), and
      ``ray_trainer_eval_seconds_after_save``: from an ``EvalOnSave`` checkpoint's save to its
      metrics;
    - a gauge ``ray_trainer_callback_errors`` when the actor provides
      ``context.callback_errors_total``;
    - a counter ``ray_trainer_events_handled`` (tags ``run``, ``event``) of the events this
      callback received.

    Ray prefixes application metrics with ``ray_`` itself, so the metric objects are created
    without it (``Gauge("trainer_step")`` is exported as ``ray_trainer_step``); a ``prefix``
    that does not start with ``ray_`` still gets it on the endpoint. A Ray gauge that is not set
    again for about two report intervals disappears from the endpoint, so a refresher thread
    (started with the metrics, in the process the callback runs in) re-sets every known gauge
    every ``report_every_s``, events or not, until ``on_train_end``; an event that arrives when
    a re-set is due re-sets them too. The metric objects and the thread are created on the
    first event (``ray.util.metrics`` is imported there, in the actor) and are not pickled.

    Args:
        prefix: the exported name prefix (default ``"ray_trainer"``).
        report_every_s: the longest time between two re-sets of every gauge (keep it under
            Ray's metrics report interval, 10 s by default).

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
        self._lock = threading.Lock()  # the refresher thread and the hooks both set gauges
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_metrics", "_counter", "_refresher"):
            state[name] = None
        state["_gauges"] = {}
        del state["_lock"], state["_stop"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def close(self) -> None:
        """Stop the refresher thread (the gauges then lapse after two report intervals)."""
        self._stop.set()
        thread, self._refresher = self._refresher, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    @property
    def object_prefix(self) -> str:
        """The prefix of the metric objects' names: ``prefix`` without Ray's own ``ray_``."""
        p = self.prefix
        return (
            p[len(_RAY_PREFIX) :] if p.startswith(_RAY_PREFIX) and len(p) > len(_RAY_PREFIX) else p
        )

    # -- hooks: every one counts the event and may re-set the gauges -------------------------

    def on_train_begin(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor before each attempt: creates the metrics, and sets the
        worker count (it changes when an elastic run loses or regains workers)."""
        values = {"step": context.global_step, "workers": context.world_size}
        self._event(context, "on_train_begin", values)

    def on_log(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor at each log: sets the training gauges."""
        throughput = throughput_of(context)
        values = {
            "step": context.global_step,
            "loss": context.loss,
            "learning_rate": context.learning_rate,
            "tokens_per_s": throughput,
        }
        for name, value in objective_metrics(context).items():
            values[sanitize(name)] = value  # rewards/chosen -> ray_trainer_rewards_chosen
        self._event(context, "on_log", values)

    def on_evaluate(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor with each evaluation: sets the eval gauges, and
        ``eval_seconds_after_save``: from its checkpoint's save to its metrics."""
        values = {f"eval_{sanitize(k)}": v for k, v in (context.val_metrics or {}).items()}
        if kwargs.get("seconds_after_save") is not None:
            values["eval_seconds_after_save"] = kwargs["seconds_after_save"]
        self._event(context, "on_evaluate", values)

    def on_save(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor after each checkpoint: keeps the gauges alive."""
        self._event(context, "on_save", {})

    def on_epoch_end(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor at each epoch end: keeps the gauges alive."""
        self._event(context, "on_epoch_end", {})

    def on_train_end(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor once at the end: a last re-set of every gauge, then
        the refresher stops."""
        self._event(context, "on_train_end", {"step": context.global_step}, force=True)
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _event(self, context: Any, event: str, values: dict[str, Any], force: bool = False):
        if self._metrics is None:
            self._metrics = _import_ray_metrics()
            self._counter = self._metrics.Counter(
                f"{self.object_prefix}_events_handled",
                description="Training events handled by the RayMetrics callback",
                tag_keys=("run", "event"),
            )
            self._start_refresher()
        with self._lock:
            self._set(context, event, values, force)

    def _set(self, context: Any, event: str, values: dict[str, Any], force: bool) -> None:
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

    def _start_refresher(self) -> None:
        self._stop.clear()
        # The thread holds the callback weakly: a dropped callback's thread ends by itself.
        self._refresher = threading.Thread(
            target=_refresh_until_stopped,
            args=(weakref.ref(self), self._stop, self.report_every_s),
            name="RayMetrics-refresher",
            daemon=True,
        )
        self._refresher.start()

    def refresh(self) -> None:
        """Re-set every known gauge to its last value (what the refresher thread calls)."""
        with self._lock:
            tags = {"run": self._run}
            for suffix, value in self._values.items():
                self._gauges[suffix].set(value, tags=tags)
            self._last_report = self._clock()

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


def _refresh_until_stopped(ref: Any, stop: threading.Event, every_s: float) -> None:
    """The refresher thread: re-sets the gauges every ``every_s`` until stopped."""
    while not stop.wait(every_s):
        callback = ref()
        if callback is None:
            return
        try:
            callback.refresh()
        except Exception as exc:  # a metrics failure must not kill the thread silently
            logger.warning("RayMetrics: re-setting the gauges failed: %s", exc)
        del callback
