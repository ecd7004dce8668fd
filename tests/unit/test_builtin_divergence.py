"""DivergenceDetector: EMA, thresholds, warm-up, patience, NaN, stop vs abort, state."""

import math

import pytest

from callbacks import CallbackManager, DivergenceDetector, TrainingContext
from callbacks.builtin.divergence import ABORT_MARKER


def manager_for(*callbacks):
    return CallbackManager(list(callbacks), global_callbacks=[])


def log(manager, step, loss):
    return manager.fire("on_log", TrainingContext(global_step=step, loss=loss))


def test_ema_and_best_follow_the_loss():
    dd = DivergenceDetector(ema_alpha=0.5, warmup_steps=0)
    m = manager_for(dd)
    assert m.has_callbacks("on_log")
    log(m, 1, 4.0)
    log(m, 2, 2.0)
    assert dd.ema == pytest.approx(3.0) and dd.best_ema == pytest.approx(3.0)
    log(m, 3, 5.0)
    assert dd.ema == pytest.approx(4.0) and dd.best_ema == pytest.approx(3.0)


def test_relative_threshold_needs_patience_consecutive_logs():
    dd = DivergenceDetector(threshold_rel=2.0, patience=3, warmup_steps=0, ema_alpha=1.0)
    m = manager_for(dd)
    log(m, 1, 1.0)
    assert not log(m, 2, 2.5).should_training_stop
    assert not log(m, 3, 2.5).should_training_stop
    assert dd.bad == 2
    assert not log(m, 4, 1.5).should_training_stop  # back under 2x best: the count resets
    assert dd.bad == 0
    log(m, 5, 3.0)
    log(m, 6, 3.0)
    control = log(m, 7, 3.0)
    assert control.should_training_stop
    assert control.stop_reason.startswith("DivergenceDetector: loss EMA 3 > 2x best EMA 1")
    assert "for 3 consecutive logs (step 7)" in control.stop_reason
    assert ABORT_MARKER not in control.stop_reason


def test_absolute_threshold():
    dd = DivergenceDetector(threshold_abs=10.0, threshold_rel=None, patience=1, warmup_steps=0)
    dd.ema_alpha = 1.0
    m = manager_for(dd)
    assert not log(m, 1, 9.9).should_training_stop
    control = log(m, 2, 10.5)
    assert control.should_training_stop
    assert "threshold_abs 10" in control.stop_reason


def test_no_relative_check_when_best_is_not_positive():
    dd = DivergenceDetector(threshold_rel=2.0, patience=1, warmup_steps=0, ema_alpha=1.0)
    m = manager_for(dd)
    log(m, 1, -1.0)
    assert not log(m, 2, 0.5).should_training_stop  # -1 * 2 = -2 would always trip


def test_warmup_steps_are_not_checked_but_feed_the_ema():
    dd = DivergenceDetector(threshold_rel=2.0, patience=1, warmup_steps=10, ema_alpha=1.0)
    m = manager_for(dd)
    log(m, 5, 1.0)
    assert not log(m, 10, 100.0).should_training_stop  # step 10 is still warm-up
    assert dd.bad == 0 and dd.best_ema == 1.0
    assert log(m, 11, 100.0).should_training_stop


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_stops_at_once_even_in_warmup(bad):
    dd = DivergenceDetector(warmup_steps=1000, patience=5)
    control = log(manager_for(dd), 3, bad)
    assert control.should_training_stop
    assert control.stop_reason == f"DivergenceDetector: loss is {bad} at step 3"
    assert dd.ema is None  # a non-finite loss never enters the EMA


def test_abort_marks_the_stop_reason():
    dd = DivergenceDetector(action="abort", warmup_steps=0, patience=1, ema_alpha=1.0)
    m = manager_for(dd)
    log(m, 1, 1.0)
    control = log(m, 2, 4.0)
    assert control.should_training_stop
    assert control.stop_reason.startswith("DivergenceDetector(abort): ")
    assert ABORT_MARKER in control.stop_reason
    nan = log(m, 3, float("nan"))
    assert nan.stop_reason == "DivergenceDetector(abort): loss is nan at step 3"


def test_loss_from_batch_metrics_and_missing_loss():
    dd = DivergenceDetector(warmup_steps=0)
    m = manager_for(dd)
    m.fire("on_log", TrainingContext(global_step=1, batch_metrics={"loss": 2.0}))
    assert dd.ema == 2.0
    assert not m.fire("on_log", TrainingContext(global_step=2)).should_training_stop
    assert dd.last_step == 1 and m.errors == []


def test_replayed_steps_do_not_feed_the_ema():
    dd = DivergenceDetector(warmup_steps=0, ema_alpha=0.5)
    m = manager_for(dd)
    log(m, 10, 1.0)
    log(m, 10, 9.0)
    log(m, 5, 9.0)
    assert dd.ema == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"threshold_rel": 1.0},
        {"threshold_abs": math.nan},
        {"patience": 0},
        {"warmup_steps": -1},
        {"ema_alpha": 0.0},
        {"ema_alpha": 1.5},
        {"action": "explode"},
    ],
)
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError, match="DivergenceDetector"):
        DivergenceDetector(**kwargs)


def test_state_round_trip():
    dd = DivergenceDetector(threshold_rel=2.0, patience=2, warmup_steps=0, ema_alpha=1.0)
    m = manager_for(dd)
    log(m, 1, 1.0)
    log(m, 2, 3.0)
    state = m.state_dict()
    assert state == {"DivergenceDetector": {"ema": 3.0, "best_ema": 1.0, "bad": 1, "last_step": 2}}
    fresh = DivergenceDetector(threshold_rel=2.0, patience=2, warmup_steps=0, ema_alpha=1.0)
    m2 = manager_for(fresh)
    m2.load_state_dict(state)
    assert log(m2, 3, 3.0).should_training_stop  # the second consecutive diverged log
