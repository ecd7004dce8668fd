"""EarlyStopping: patience, min_delta, modes, NaN, ordering, missing metrics, state."""

import pytest

from callbacks import CallbackManager, EarlyStopping, TrainingContext
from callbacks._serialize import dumps_callbacks, loads_callbacks


def manager_for(*callbacks):
    return CallbackManager(list(callbacks), global_callbacks=[])


def evaluate(manager, step, **metrics):
    """Fire on_evaluate like the runner does; return the merged control."""
    ctx = TrainingContext(global_step=step, val_metrics=metrics)
    return manager.fire("on_evaluate", ctx, eval_step=step)


def test_stops_after_patience_evaluations_without_improvement():
    es = EarlyStopping("val_loss", patience=3)
    m = manager_for(es)
    assert m.has_callbacks("on_evaluate")
    for step, loss in [(100, 2.0), (200, 1.23), (300, 1.5), (400, 1.3)]:
        assert not evaluate(m, step, val_loss=loss).should_training_stop
    assert es.wait == 2
    control = evaluate(m, 500, val_loss=1.24)
    assert control.should_training_stop
    assert control.stop_reason == (
        "EarlyStopping: val_loss did not improve for 3 evaluations (best 1.23 at step 200)"
    )
    assert m.errors == []


def test_an_improvement_resets_the_count():
    es = EarlyStopping("val_loss", patience=2)
    m = manager_for(es)
    evaluate(m, 1, val_loss=1.0)
    evaluate(m, 2, val_loss=1.1)
    assert es.wait == 1
    evaluate(m, 3, val_loss=0.9)
    assert (es.wait, es.best, es.best_step) == (0, 0.9, 3)
    assert not evaluate(m, 4, val_loss=0.95).should_training_stop
    assert evaluate(m, 5, val_loss=0.95).should_training_stop


def test_min_delta_requires_an_improvement_larger_than_it():
    es = EarlyStopping("val_loss", patience=5, min_delta=0.1)
    m = manager_for(es)
    evaluate(m, 1, val_loss=1.0)
    evaluate(m, 2, val_loss=0.95)  # better, but by less than min_delta
    assert (es.wait, es.best) == (1, 1.0)
    evaluate(m, 3, val_loss=0.85)  # better by 0.15
    assert (es.wait, es.best, es.best_step) == (0, 0.85, 3)


def test_mode_max():
    es = EarlyStopping("accuracy", mode="max", patience=2, min_delta=0.01)
    m = manager_for(es)
    evaluate(m, 1, accuracy=0.5)
    evaluate(m, 2, accuracy=0.7)
    assert (es.best, es.wait) == (0.7, 0)
    evaluate(m, 3, accuracy=0.705)  # within min_delta
    assert es.wait == 1
    control = evaluate(m, 4, accuracy=0.6)
    assert control.should_training_stop
    assert "accuracy did not improve for 2 evaluations (best 0.7 at step 2)" in control.stop_reason


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_value_stops_at_once(bad):
    es = EarlyStopping("val_loss", patience=10)
    m = manager_for(es)
    evaluate(m, 1, val_loss=1.0)
    control = evaluate(m, 2, val_loss=bad)
    assert control.should_training_stop
    assert control.stop_reason == f"EarlyStopping: val_loss is {bad} at step 2"


def test_non_finite_without_check_finite_counts_as_no_improvement():
    es = EarlyStopping("val_loss", patience=2, check_finite=False)
    m = manager_for(es)
    evaluate(m, 1, val_loss=1.0)
    assert not evaluate(m, 2, val_loss=float("nan")).should_training_stop
    assert es.best == 1.0 and es.wait == 1
    assert evaluate(m, 3, val_loss=float("nan")).should_training_stop


def test_first_value_nan_without_check_finite_has_no_best():
    es = EarlyStopping("val_loss", patience=1, check_finite=False)
    control = evaluate(manager_for(es), 1, val_loss=float("nan"))
    assert control.should_training_stop
    assert control.stop_reason.endswith("for 1 evaluation (no finite value yet)")


def test_older_or_repeated_steps_are_ignored():
    es = EarlyStopping("accuracy", mode="max", patience=1)
    m = manager_for(es)
    evaluate(m, 500, accuracy=0.8)
    # A slow EvalOnSave result of an older checkpoint arrives late: ignored, even if worse.
    assert not evaluate(m, 400, accuracy=0.1).should_training_stop
    assert not evaluate(m, 500, accuracy=0.1).should_training_stop  # same step again
    assert (es.best, es.wait, es.last_step) == (0.8, 0, 500)
    assert evaluate(m, 600, accuracy=0.1).should_training_stop


def test_missing_metric_is_a_recorded_error_naming_the_available_ones():
    es = EarlyStopping("val_acc")
    m = manager_for(es)
    control = evaluate(m, 10, val_loss=1.0, exact_match=0.5)
    assert not control.should_training_stop
    [error] = m.errors
    assert error.callback == "EarlyStopping" and error.event == "on_evaluate"
    assert "ValueError" in error.error
    assert "'val_acc'" in error.error and "exact_match, val_loss" in error.error


def test_missing_metric_after_it_was_seen_is_skipped():
    es = EarlyStopping("accuracy", mode="max", patience=1)
    m = manager_for(es)
    evaluate(m, 100, accuracy=0.5)
    evaluate(m, 200, val_loss=1.0)  # in-loop validation without the metric
    assert m.errors == []
    assert es.last_step == 100  # not considered: a later EvalOnSave result of 150 still counts
    assert evaluate(m, 150, accuracy=0.4).should_training_stop


def test_non_numeric_metric_is_an_error():
    es = EarlyStopping("val_loss")
    with pytest.raises(ValueError, match="not a number"):
        es.on_evaluate(TrainingContext(global_step=1, val_metrics={"val_loss": "high"}))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "low"},
        {"patience": 0},
        {"min_delta": -0.1},
        {"metric": ""},
    ],
)
def test_invalid_arguments(kwargs):
    kwargs = {"metric": "val_loss", **kwargs}
    with pytest.raises(ValueError, match="EarlyStopping"):
        EarlyStopping(**kwargs)


def test_state_round_trip_through_the_manager_and_pickle():
    es = EarlyStopping("val_loss", patience=3)
    m = manager_for(es)
    evaluate(m, 100, val_loss=1.0)
    evaluate(m, 200, val_loss=1.2)
    evaluate(m, 300, val_loss=1.1)
    state = m.state_dict()
    assert state == {
        "EarlyStopping": {
            "best": 1.0,
            "best_step": 100,
            "wait": 2,
            "last_step": 300,
            "metric_seen": True,
        }
    }
    [fresh] = loads_callbacks(dumps_callbacks([EarlyStopping("val_loss", patience=3)]))
    m2 = manager_for(fresh)
    m2.load_state_dict(state)
    assert not evaluate(m2, 300, val_loss=5.0).should_training_stop  # already considered
    control = evaluate(m2, 400, val_loss=1.05)
    assert control.should_training_stop
    assert "(best 1 at step 100)" in control.stop_reason
