"""RayMetrics: names, tags, values, periodic re-set, laziness; with a fake ray.util.metrics."""

import importlib.util
import math
import threading
import types

import pytest

from callbacks import CallbackManager, RayMetrics, TrainingContext
from callbacks._serialize import dumps_callbacks, loads_callbacks
from callbacks.builtin import ray_metrics as rm


class FakeMetric:
    def __init__(self, registry, kind, name, description="", tag_keys=None):
        self.kind, self.name, self.description, self.tag_keys = kind, name, description, tag_keys
        self.records = []  # (value, tags)
        registry[name] = self

    def set(self, value, tags=None):
        assert isinstance(value, (int, float)), value
        assert set(tags) == set(self.tag_keys), tags
        self.records.append((value, dict(tags)))

    def inc(self, value=1.0, tags=None):
        assert value > 0, "Ray's Counter.inc refuses a value <= 0"
        assert set(tags) == set(self.tag_keys), tags
        self.records.append((value, dict(tags)))

    def _record(self, value, tags=None):  # what Ray's inc calls after its check: 0 is taken
        assert self.kind == "counter" and value == 0, value
        assert set(tags) == set(self.tag_keys), tags
        self.records.append((value, dict(tags)))

    def __reduce__(self):
        raise TypeError("a metric object cannot be pickled")


@pytest.fixture
def fake_metrics(monkeypatch):
    """A stand-in for ray.util.metrics: {name: FakeMetric} of every metric created."""
    registry = {}
    module = types.SimpleNamespace(
        Gauge=lambda name, **kw: FakeMetric(registry, "gauge", name, **kw),
        Counter=lambda name, **kw: FakeMetric(registry, "counter", name, **kw),
    )
    imports = []
    monkeypatch.setattr(rm, "_import_ray_metrics", lambda: imports.append(1) or module)
    registry["_imports"] = imports
    return registry


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make(**kwargs):
    cb = RayMetrics(**kwargs)
    cb._clock = clock = Clock()
    return cb, clock, CallbackManager([cb], global_callbacks=[])


def log_ctx(step, **fields):
    base = dict(global_step=step, run_name="r1", loss=1.5, learning_rate=1e-3, throughput=900.0)
    base.update(fields)
    return TrainingContext(**base)


def last(metric):
    return metric.records[-1]


def test_nothing_is_created_or_imported_before_the_first_event(fake_metrics):
    cb, _, m = make()
    assert fake_metrics["_imports"] == [] and cb._gauges == {}
    assert {
        "on_log",
        "on_evaluate",
        "on_train_begin",
        "on_train_end",
        "on_save",
    } <= m.subscribed_events
    m.fire("on_log", log_ctx(1))
    assert fake_metrics["_imports"] == [1]


def test_log_sets_training_gauges_with_names_and_run_tag(fake_metrics):
    _, _, m = make()
    m.fire("on_log", log_ctx(10, grad_norm=0.75, batch_metrics={"mfu": 0.25}))
    names = {n for n in fake_metrics if n != "_imports"}
    gauges = {
        "trainer_step",
        "trainer_loss",
        "trainer_learning_rate",
        "trainer_tokens_per_second",
        "trainer_grad_norm",
        "trainer_mfu_ratio",
    }  # exported by Ray as ray_trainer_*
    counters = {
        "trainer_events_handled",
        "trainer_events_dropped",
        "trainer_callback_errors",
        "trainer_checkpoints_saved",
    }  # exported by Ray 2.60 as ray_trainer_*_total
    assert names == gauges | counters
    assert {fake_metrics[n].kind for n in gauges} == {"gauge"}
    assert {fake_metrics[n].kind for n in counters} == {"counter"}
    assert fake_metrics["trainer_step"].tag_keys == ("run",)
    assert last(fake_metrics["trainer_step"]) == (10.0, {"run": "r1"})
    assert last(fake_metrics["trainer_loss"]) == (1.5, {"run": "r1"})
    assert last(fake_metrics["trainer_learning_rate"]) == (1e-3, {"run": "r1"})
    assert last(fake_metrics["trainer_tokens_per_second"]) == (900.0, {"run": "r1"})
    assert last(fake_metrics["trainer_grad_norm"]) == (0.75, {"run": "r1"})
    assert last(fake_metrics["trainer_mfu_ratio"]) == (0.25, {"run": "r1"})
    counter = fake_metrics["trainer_events_handled"]
    assert counter.tag_keys == ("run", "event")
    assert counter.records == [(1, {"run": "r1", "event": "on_log"})]
    assert m.errors == []


def test_no_gauge_for_what_a_log_lacks(fake_metrics):
    # A CPU run without peak_flops has no MFU; a step without clipping may have no grad norm.
    _, _, m = make()
    m.fire("on_log", log_ctx(1, batch_metrics={"step_time": 0.1}))
    assert "trainer_mfu_ratio" not in fake_metrics and "trainer_grad_norm" not in fake_metrics
    assert "trainer_step_time" not in fake_metrics


def test_eval_gauges_one_per_sanitized_metric_name(fake_metrics):
    _, _, m = make()
    ctx = TrainingContext(
        global_step=5, run_name="r1", val_metrics={"val/loss": 0.5, "exact-match": 1, "note": "x"}
    )
    m.fire("on_evaluate", ctx, eval_step=5)
    assert last(fake_metrics["trainer_eval_val_loss"]) == (0.5, {"run": "r1"})
    assert last(fake_metrics["trainer_eval_exact_match"]) == (1.0, {"run": "r1"})
    assert "trainer_eval_note" not in fake_metrics  # not a number: not exported
    assert m.errors == []


def test_the_seconds_from_save_to_metrics_is_a_gauge_outside_the_eval_names(fake_metrics):
    # Not eval_*: the repeating evaluation panel of the dashboard takes every eval_* gauge.
    _, _, m = make()
    ctx = TrainingContext(global_step=5, run_name="r1", val_metrics={"acc": 0.5})
    m.fire("on_evaluate", ctx, eval_step=5, seconds_after_save=12.5)
    assert last(fake_metrics["trainer_save_to_eval_seconds"]) == (12.5, {"run": "r1"})
    assert not [n for n in fake_metrics if n.startswith("trainer_eval_") and "seconds" in n]
    m.fire("on_evaluate", ctx, eval_step=5)  # an in-loop validation: no such time
    assert len(fake_metrics["trainer_save_to_eval_seconds"].records) == 1


def test_validation_loss_is_its_own_gauge_and_an_eval_gauge(fake_metrics):
    _, _, m = make()
    m.fire("on_evaluate", TrainingContext(run_name="r1", val_metrics={"val_loss": 0.8}))
    assert last(fake_metrics["trainer_val_loss"]) == (0.8, {"run": "r1"})
    assert last(fake_metrics["trainer_eval_val_loss"]) == (0.8, {"run": "r1"})
    m.fire("on_evaluate", TrainingContext(run_name="r1", val_metrics={"accuracy": 0.5}))
    assert len(fake_metrics["trainer_val_loss"].records) == 1  # no val_loss: not set again


def test_checkpoints_saved_counter_starts_at_zero_and_counts_saves(fake_metrics):
    _, _, m = make()
    m.fire("on_log", log_ctx(1))
    saved = fake_metrics["trainer_checkpoints_saved"]
    assert saved.records == [(0.0, {"run": "r1"})]  # the series exists before the first save
    m.fire("on_save", TrainingContext(run_name="r1", checkpoint_path="/c/1"))
    m.fire("on_save", TrainingContext(run_name="r1", checkpoint_path="/c/2"))
    assert saved.records[1:] == [(1, {"run": "r1"}), (1, {"run": "r1"})]


def test_eval_gauges_are_bounded(fake_metrics, monkeypatch):
    monkeypatch.setattr(rm, "MAX_EVAL_GAUGES", 2)
    _, _, m = make()
    m.fire("on_evaluate", TrainingContext(val_metrics={"a": 1, "b": 2, "c": 3}))
    assert sorted(n for n in fake_metrics if "eval" in n) == ["trainer_eval_a", "trainer_eval_b"]


def test_gauges_are_reset_on_any_event_at_most_every_report_interval(fake_metrics):
    _, clock, m = make(report_every_s=5.0)
    m.fire("on_log", log_ctx(1))
    m.fire("on_evaluate", TrainingContext(run_name="r1", val_metrics={"acc": 0.5}))
    loss, acc = fake_metrics["trainer_loss"], fake_metrics["trainer_eval_acc"]
    assert (len(loss.records), len(acc.records)) == (1, 1)
    clock.now += 2.0
    m.fire("on_save", TrainingContext(run_name="r1"))  # too soon: nothing re-set
    assert (len(loss.records), len(acc.records)) == (1, 1)
    m.fire("on_log", log_ctx(2, loss=1.25))  # sets the log gauges, not the eval ones
    assert (len(loss.records), len(acc.records)) == (2, 1)
    clock.now += 3.5  # 5.5 s since the first (re-)set: any event re-sets every gauge
    m.fire("on_save", TrainingContext(run_name="r1"))
    assert last(loss) == (1.25, {"run": "r1"}) and last(acc) == (0.5, {"run": "r1"})
    assert (len(loss.records), len(acc.records)) == (3, 2)
    events = [tags["event"] for _, tags in fake_metrics["trainer_events_handled"].records]
    assert events == ["on_log", "on_evaluate", "on_save", "on_log", "on_save"]


def test_train_end_always_resets(fake_metrics):
    _, _, m = make()
    m.fire("on_log", log_ctx(7))
    m.fire("on_train_end", TrainingContext(global_step=8, run_name="r1"))
    assert last(fake_metrics["trainer_step"]) == (8.0, {"run": "r1"})
    assert len(fake_metrics["trainer_loss"].records) == 2


def test_callback_errors_counter_follows_the_actors_total(fake_metrics):
    _, _, m = make()
    m.fire("on_log", log_ctx(1))
    errors = fake_metrics["trainer_callback_errors"]
    assert errors.records == []  # no total from an actor: no series
    m.fire("on_log", log_ctx(2), callback_errors_total=0)
    assert errors.records == [(0.0, {"run": "r1"})]  # at 0: a panel sees the series
    m.fire("on_log", log_ctx(3), callback_errors_total=3)
    m.fire("on_log", log_ctx(4), callback_errors_total=3)  # no new error: no increment
    m.fire("on_log", log_ctx(5), callback_errors_total=5)
    assert errors.records[1:] == [(3.0, {"run": "r1"}), (2.0, {"run": "r1"})]
    m.fire("on_log", log_ctx(6), callback_errors_total=1)  # a restarted actor counts from 0
    m.fire("on_log", log_ctx(7), callback_errors_total=2)
    assert errors.records[3:] == [(1.0, {"run": "r1"})]


def test_dropped_events_counter_by_event_starts_every_event_at_zero(fake_metrics):
    _, _, m = make()
    m.fire("on_log", log_ctx(1), events_dropped_total={"on_log": 0, "on_step_end": 0})
    dropped = fake_metrics["trainer_events_dropped"]
    assert dropped.tag_keys == ("run", "event")
    assert sorted(dropped.records, key=str) == [
        (0.0, {"run": "r1", "event": "on_log"}),
        (0.0, {"run": "r1", "event": "on_step_end"}),
    ]
    m.fire("on_log", log_ctx(2), events_dropped_total={"on_log": 40, "on_step_end": 0})
    m.fire("on_log", log_ctx(3), events_dropped_total={"on_log": 55, "on_step_end": 0})
    assert dropped.records[2:] == [
        (40.0, {"run": "r1", "event": "on_log"}),
        (15.0, {"run": "r1", "event": "on_log"}),
    ]


def test_none_and_nan_values(fake_metrics):
    _, _, m = make()
    m.fire("on_log", log_ctx(1, loss=None, learning_rate=float("nan")))
    assert "trainer_loss" not in fake_metrics  # never set: no series yet
    assert math.isnan(last(fake_metrics["trainer_learning_rate"])[0])


def test_custom_prefix(fake_metrics):
    _, _, m = make(prefix="myjob")
    m.fire("on_log", log_ctx(1))
    assert "myjob_step" in fake_metrics  # exported as ray_myjob_step
    assert RayMetrics(prefix="ray_x").object_prefix == "x"
    with pytest.raises(ValueError, match="prefix"):
        RayMetrics(prefix="bad-name")
    with pytest.raises(ValueError, match="report_every_s"):
        RayMetrics(report_every_s=0)


def test_metric_objects_are_not_pickled(fake_metrics):
    cb, _, m = make()
    m.fire("on_log", log_ctx(1))
    state = cb.__getstate__()
    assert state["_gauges"] == {} and state["_counters"] == {} and state["_metrics"] is None
    [copy] = loads_callbacks(dumps_callbacks([cb]))
    copy.on_log(log_ctx(2))  # recreated lazily
    assert copy._gauges and fake_metrics["_imports"] == [1, 1]


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_real_ray_metrics_objects_need_no_running_cluster():
    import ray

    was_initialized = ray.is_initialized()  # the integration tests' session may be up
    cb = RayMetrics()
    cb.on_log(log_ctx(1))
    cb.on_evaluate(TrainingContext(run_name="r1", val_metrics={"val_loss": 0.5}))
    assert set(cb._gauges) >= {"step", "loss", "eval_val_loss", "val_loss"}
    assert type(cb._gauges["step"]).__module__ == "ray.util.metrics"
    # Counters start at 0 through Ray's own record path (Counter.inc refuses 0).
    cb.on_log(log_ctx(2, callback_errors_total=0, events_dropped_total={"on_log": 0}))
    assert type(cb._counters["callback_errors"]).__module__ == "ray.util.metrics"
    assert ray.is_initialized() == was_initialized  # creating them started no Ray


def test_gauges_are_re_set_between_events_by_the_refresher(fake_metrics):
    # Ray drops a gauge not set within about two report intervals: the values must be set
    # again while no event arrives (a long checkpoint, an idle actor).
    cb = RayMetrics(report_every_s=0.05)
    m = CallbackManager([cb], global_callbacks=[])
    m.fire("on_log", log_ctx(1))
    loss = fake_metrics["trainer_loss"]
    refreshed = threading.Event()
    real_set = loss.set

    def watched_set(value, tags=None):
        real_set(value, tags)
        if len(loss.records) >= 3:
            refreshed.set()

    loss.set = watched_set
    assert refreshed.wait(timeout=10), "no re-set without events"
    assert all(r == (1.5, {"run": "r1"}) for r in loss.records)
    thread = cb._refresher
    m.fire("on_train_end", TrainingContext(global_step=1, run_name="r1"))
    assert cb._refresher is None and not thread.is_alive()  # stopped at the end of the run


def test_refresher_is_not_pickled_and_restarts_where_the_callback_runs(fake_metrics):
    cb = RayMetrics(report_every_s=0.05)
    cb.on_log(log_ctx(1))
    assert cb._refresher is not None and cb._refresher.is_alive()
    [copy] = loads_callbacks(dumps_callbacks([cb]))
    assert copy._refresher is None
    copy.on_log(log_ctx(2))
    assert copy._refresher is not None and copy._refresher.is_alive()
    cb.close()
    copy.close()
    assert cb._refresher is None and copy._refresher is None


def test_each_attempt_sets_the_worker_count(fake_metrics):
    _, clock, m = make()
    m.fire("on_train_begin", TrainingContext(global_step=0, run_name="r1", world_size=2))
    assert last(fake_metrics["trainer_workers"]) == (2.0, {"run": "r1"})
    clock.now += 1  # an elastic run restarted on fewer workers
    m.fire("on_train_begin", TrainingContext(global_step=40, run_name="r1", world_size=1))
    assert last(fake_metrics["trainer_workers"]) == (1.0, {"run": "r1"})


def test_dpo_metrics_are_gauges_with_slashes_as_underscores(fake_metrics):
    _, _, m = make()
    dpo = {"rewards/accuracies": 0.75, "rewards/margins": 0.5, "logps/chosen": -40.0}
    args = {"objective_metrics": ["rewards/chosen", *dpo]}  # the names DPO's args carry
    m.fire("on_log", log_ctx(10, args=args, batch_metrics={**dpo, "step_time": 0.1, "mfu": 0.2}))
    assert last(fake_metrics["trainer_rewards_accuracies"]) == (0.75, {"run": "r1"})
    assert last(fake_metrics["trainer_rewards_margins"]) == (0.5, {"run": "r1"})
    assert last(fake_metrics["trainer_logps_chosen"]) == (-40.0, {"run": "r1"})
    # Only an objective's own metrics: the rest of batch_metrics is not exported here.
    assert "trainer_step_time" not in fake_metrics and "trainer_mfu" not in fake_metrics
    assert last(fake_metrics["trainer_mfu_ratio"]) == (0.2, {"run": "r1"})  # as mfu_ratio
    m.fire("on_evaluate", log_ctx(10, val_metrics={"val_rewards/accuracies": 0.9}))
    assert last(fake_metrics["trainer_eval_val_rewards_accuracies"]) == (0.9, {"run": "r1"})
