"""`PANELS` and `RayMetrics` agree: every metric a panel queries is one that RayMetrics exports
(with a stand-in for ``ray.util.metrics`` and Ray 2.60's naming: ``ray_`` in front, ``_total``
after a counter's name). The integration test (test_prometheus.py) checks the same on a real
Prometheus."""

from __future__ import annotations

import re
import types

from callbacks import CallbackManager, RayMetrics, TrainingContext
from callbacks.builtin import ray_metrics
from ray_trainer._monitoring.panels import EVAL_PREFIX, PANELS

_NAME = re.compile(r"\b(ray_trainer_\w+)\{")


def _exported(monkeypatch) -> set[str]:
    """The names one short run's events make RayMetrics export, as Ray 2.60 names them."""
    kinds: dict[str, str] = {}

    class Metric:
        def __init__(self, kind, name, **_):
            kinds[name] = kind

        def set(self, value, tags=None):
            pass

        inc = _record = set

    module = types.SimpleNamespace(
        Gauge=lambda name, **kw: Metric("gauge", name, **kw),
        Counter=lambda name, **kw: Metric("counter", name, **kw),
    )
    monkeypatch.setattr(ray_metrics, "_import_ray_metrics", lambda: module)
    cb = RayMetrics()
    manager = CallbackManager([cb], global_callbacks=[])
    actor = {"callback_errors_total": 0, "events_dropped_total": {"on_log": 0}}
    base = {"run_name": "r", **actor}
    manager.fire("on_train_begin", TrainingContext(world_size=2, **base))
    log = {"loss": 1.0, "learning_rate": 0.1, "throughput": 5.0, "grad_norm": 1.0}
    manager.fire(
        "on_log", TrainingContext(global_step=1, batch_metrics={"mfu": 0.1}, **log, **base)
    )
    manager.fire("on_evaluate", TrainingContext(val_metrics={"val_loss": 0.5}, **base))
    manager.fire("on_save", TrainingContext(checkpoint_path="/c", **base))
    manager.fire(
        "on_evaluate", TrainingContext(val_metrics={"acc": 1.0}, **base), seconds_after_save=2.0
    )
    manager.fire("on_train_end", TrainingContext(**base))
    return {f"ray_{n}_total" if k == "counter" else f"ray_{n}" for n, k in kinds.items()}


def test_every_metric_a_panel_queries_is_exported_by_ray_metrics(monkeypatch):
    exported = _exported(monkeypatch)
    queried = {name for panel in PANELS for s in panel.series for name in _NAME.findall(s.expr)}
    assert queried, "no metric name found in the panels' queries"
    assert queried <= exported, f"queried but not exported: {sorted(queried - exported)}"
    assert {f"{EVAL_PREFIX}val_loss", f"{EVAL_PREFIX}acc"} <= exported  # the repeat panel's


def test_no_exported_name_that_is_not_an_evaluation_starts_with_the_eval_prefix(monkeypatch):
    # The repeating panel takes every ray_trainer_eval_* name: nothing else may look like one.
    evals = {n for n in _exported(monkeypatch) if n.startswith(EVAL_PREFIX)}
    assert evals == {f"{EVAL_PREFIX}val_loss", f"{EVAL_PREFIX}acc"}
