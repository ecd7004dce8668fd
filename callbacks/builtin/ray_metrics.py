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
_EVAL = "eval_"
_GAUGES = {
    "step": "Global optimizer step",
    "loss": "Training loss (cross-rank average) at the last log",
    "val_loss": "Validation loss (in-loop evaluation) at the last evaluation",
    "learning_rate": "Learning rate at the last log",
    "tokens_per_second": "Training throughput at the last log, tokens per second",
    "mfu_ratio": "Model FLOPs utilisation at the last log (0-1; where the peak is known)",
    "grad_norm": "Global gradient norm before clipping at the last log",
    "workers": "Training workers of the current attempt (an elastic run's size)",
    "save_to_eval_seconds": "Seconds from an EvalOnSave checkpoint's save to its metrics",
}
#: The counters, by the name of their Ray object (``<prefix>_<name>``): Ray 2.60 exports a
#: ``Counter("trainer_events_handled")`` as ``ray_trainer_events_handled_total``.
_COUNTERS = {
    "events_handled": ("Training events handled by the RayMetrics callback", ("run", "event")),
    "events_dropped": (
        "Low-value events dropped on the way to the callback actor (its queue was full)",
        ("run", "event"),
    ),
    "callback_errors": ("Callback errors recorded so far", ("run",)),
    "checkpoints_saved": ("Checkpoints saved (complete on storage)", ("run",)),
}


def _import_ray_metrics() -> Any:
    """``ray.util.metrics``, imported where the callback runs (tests replace this function)."""
    from ray.util import metrics

    return metrics


def sanitize(name: str) -> str:
    """A metric-name fragment: every character outside ``[a-zA-Z0-9_]`` becomes ``_``."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", str(name))


class RayMetrics(TrainerCallback):
    """Export a run's progress, evaluations and callback health to Ray's metrics.

    Runs on the callback actor (``runs_on="actor"``), through ``ray.util.metrics``: the values
    show up in the Ray dashboard's metrics view, on the Prometheus endpoint of the head node,
    and in the ray-trainer Grafana dashboard (``ray-trainer grafana install``). Exported names
    (with the default ``prefix``), every series tagged ``run=<run_name>``:

    - gauges ``ray_trainer_step``, ``ray_trainer_loss``, ``ray_trainer_learning_rate``,
      ``ray_trainer_tokens_per_second``, ``ray_trainer_grad_norm`` and, where the device's peak
      is known (``peak_flops``, or a known GPU), ``ray_trainer_mfu_ratio`` (set at each
      ``on_log``); ``ray_trainer_workers`` (set at each attempt's ``on_train_begin``: an
      elastic run's size);
    - a gauge per metric of the run's objective (those the run's args name in
      ``objective_metrics``: under ``objective="dpo"`` TRL's ``rewards/chosen``,
      ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
      ``logps/rejected``), named with ``/`` as ``_``: ``ray_trainer_rewards_accuracies``;
    - at each ``on_evaluate``: a gauge ``ray_trainer_eval_<metric>`` per evaluation metric name,
      the name sanitized to ``[a-zA-Z0-9_]`` (at most ``MAX_EVAL_GAUGES`` names);
      ``ray_trainer_val_loss`` when the metrics have ``val_loss`` (the in-loop evaluation);
      ``ray_trainer_save_to_eval_seconds`` for an ``EvalOnSave`` result: from its checkpoint's
      save to its metrics;
    - counters ``ray_trainer_events_handled_total`` (tags ``run``, ``event``: the events this
      callback received) and ``ray_trainer_checkpoints_saved_total`` (one per ``on_save``);
    - where the callback actor provides them (``context.callback_errors_total``,
      ``context.events_dropped_total``): counters ``ray_trainer_callback_errors_total`` and
      ``ray_trainer_events_dropped_total`` (tags ``run``, ``event``: low-value events dropped
      on rank 0 or in the actor's queue when the actor fell behind).

    Every counter of the run exists from its first event, at 0: a panel or an alert on
    ``ray_trainer_callback_errors_total`` sees a series, and an increase, from the start. Ray
    prefixes application metrics with ``ray_`` itself, and appends ``_total`` to a counter's
    name, so the metric objects are created without either (``Gauge("trainer_step")`` is
    exported as ``ray_trainer_step``, ``Counter("trainer_events_handled")`` as
    ``ray_trainer_events_handled_total``); a ``prefix`` that does not start with ``ray_``
    still gets it on the endpoint. A Ray gauge that is not set again for about two report
    intervals disappears from the endpoint, so a refresher thread (started with the metrics,
    in the process the callback runs in) re-sets every known gauge every ``report_every_s``,
    events or not, until ``on_train_end``; an event that arrives when a re-set is due re-sets
    them too (counters are cumulative: Ray keeps them). The metric objects and the thread are
    created on the first event (``ray.util.metrics`` is imported there, in the actor) and are
    not pickled.

    Args:
        prefix: the exported name prefix (default ``"ray_trainer"``; the ray-trainer Grafana
            dashboard reads the default).
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
        self._counters: dict[str, Any] = {}
        self._values: dict[str, float] = {}  # gauge suffix -> last value
        self._totals: dict[tuple[str, str], float] = {}  # (counter, event) -> the actor's total
        self._run = ""
        self._last_report: float | None = None
        self._warned_cap = False
        self._lock = threading.Lock()  # the refresher thread and the hooks both set gauges
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_metrics", "_refresher"):
            state[name] = None
        state["_gauges"], state["_counters"], state["_totals"] = {}, {}, {}
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
        logged = context.batch_metrics or {}
        values = {
            "step": context.global_step,
            "loss": context.loss,
            "learning_rate": context.learning_rate,
            "tokens_per_second": throughput_of(context),
            "grad_norm": getattr(context, "grad_norm", None),
            "mfu_ratio": logged.get("mfu"),
        }
        for name, value in objective_metrics(context).items():
            values[sanitize(name)] = value  # rewards/chosen -> ray_trainer_rewards_chosen
        self._event(context, "on_log", values)

    def on_evaluate(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor with each evaluation: sets the eval gauges,
        ``val_loss`` and ``save_to_eval_seconds``: from its checkpoint's save to its metrics."""
        metrics = context.val_metrics or {}
        values = {f"{_EVAL}{sanitize(k)}": v for k, v in metrics.items()}
        values["val_loss"] = metrics.get("val_loss")
        values["save_to_eval_seconds"] = kwargs.get("seconds_after_save")
        self._event(context, "on_evaluate", values)

    def on_save(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor after each checkpoint: counts it."""
        self._event(context, "on_save", {}, saved=True)

    def on_epoch_end(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor at each epoch end: keeps the gauges alive."""
        self._event(context, "on_epoch_end", {})

    def on_train_end(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor once at the end: a last re-set of every gauge, then
        the refresher stops."""
        self._event(context, "on_train_end", {"step": context.global_step}, force=True)
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _event(
        self,
        context: Any,
        event: str,
        values: dict[str, Any],
        force: bool = False,
        saved: bool = False,
    ) -> None:
        if self._metrics is None:
            self._metrics = _import_ray_metrics()
            self._start_refresher()
        with self._lock:
            run = str(context.run_name or (context.args or {}).get("run_name") or "")
            if run != self._run or not self._counters:
                self._run = run
                self._start_counters()
            self._set(values, force)
            self._count(context, event, saved)

    def _set(self, values: dict[str, Any], force: bool) -> None:
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

    def _count(self, context: Any, event: str, saved: bool) -> None:
        run = self._run
        self._counters["events_handled"].inc(1, tags={"run": run, "event": event})
        if saved:
            self._counters["checkpoints_saved"].inc(1, tags={"run": run})
        errors = getattr(context, "callback_errors_total", None)
        if errors is not None:
            self._add("callback_errors", "", errors, {"run": run})
        for name, total in (getattr(context, "events_dropped_total", None) or {}).items():
            self._add("events_dropped", name, total, {"run": run, "event": str(name)})

    def _add(self, counter: str, key: str, total: Any, tags: dict[str, str]) -> None:
        """Increment `counter` by what the actor's running `total` grew since the last event;
        a total seen for the first time starts the series at 0."""
        number = as_float(total)
        if number is None:
            return
        seen = self._totals.get((counter, key))
        if seen is None:
            _start_at_zero(self._counters[counter], tags)
            seen = 0.0
        if number > seen:
            self._counters[counter].inc(number - seen, tags=tags)
        # A smaller total: the actor restarted and counts from 0 again (so does a counter).
        self._totals[(counter, key)] = number

    def _start_counters(self) -> None:
        """The counters of this run, each at 0 where it may stay there (a run with no error,
        no drop, no save still has the series its dashboard panels query)."""
        for name, (description, tag_keys) in _COUNTERS.items():
            if name not in self._counters:
                self._counters[name] = self._metrics.Counter(
                    f"{self.object_prefix}_{name}", description=description, tag_keys=tag_keys
                )
        self._totals = {}
        _start_at_zero(self._counters["checkpoints_saved"], {"run": self._run})

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
        evals = sum(1 for s in self._gauges if s.startswith(_EVAL))
        if suffix.startswith(_EVAL) and evals >= MAX_EVAL_GAUGES:
            if not self._warned_cap:
                logger.warning(
                    "RayMetrics: more than %d evaluation metric names; %r and later ones are "
                    "not exported",
                    MAX_EVAL_GAUGES,
                    suffix[len(_EVAL) :],
                )
                self._warned_cap = True
            return False
        if suffix.startswith(_EVAL):
            description = f"Evaluation metric {suffix[len(_EVAL) :]!r} at the last evaluation"
        else:
            description = _GAUGES.get(suffix, suffix)
        self._gauges[suffix] = self._metrics.Gauge(
            f"{self.object_prefix}_{suffix}", description=description, tag_keys=("run",)
        )
        return True


def _start_at_zero(counter: Any, tags: dict[str, str]) -> None:
    """Create `counter`'s series for `tags` at 0 on the endpoint.

    Ray's ``Counter.inc`` refuses 0 (``value must be >0``), so a counter that has not counted
    yet has no series; Prometheus's advice for labelled counters is to start them at 0, so that
    a query or an alert sees the series, and its first increase, from the start. Ray 2.60's
    ``Counter._record(0)`` (what ``inc`` calls after its check) exports the series at 0 (seen on
    a real endpoint: ``ray_<name>_total{...} 0.0``); on a Ray without it the series appears with
    the first increment instead.
    """
    record = getattr(counter, "_record", None)
    if record is None:
        return
    try:
        record(0.0, tags=tags)
    except Exception as exc:  # another Ray's internals: the series then starts at its first inc
        logger.debug("RayMetrics: could not start %r at 0: %s", counter, exc)


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
