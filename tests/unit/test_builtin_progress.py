"""ProgressBar: line format, TTY redraw vs plain lines, ETA, every_n_logs, summary."""

import io
import sys

import pytest

from callbacks import CallbackManager, ProgressBar, TrainingContext
from callbacks._serialize import dumps_callbacks, loads_callbacks


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make(stream, **kwargs):
    bar = ProgressBar(stream=stream, **kwargs)
    bar._clock = clock = Clock()
    return bar, clock, CallbackManager([bar], global_callbacks=[])


def log_ctx(step, **fields):
    base = dict(
        global_step=step,
        max_steps=1000,
        run_name="demo",
        loss=1.23456,
        learning_rate=3e-4,
        throughput=1234.4,
        elapsed_time=0.5,
    )
    base.update(fields)
    return TrainingContext(**base)


def test_log_line_format_on_a_plain_stream():
    out = io.StringIO()
    _, clock, m = make(out)
    assert {"on_log", "on_evaluate", "on_train_end"} <= m.subscribed_events
    m.fire("on_log", log_ctx(100))
    clock.now += 10.0
    m.fire("on_log", log_ctx(120))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[demo] step 100/1000 (10%) loss 1.2346 lr 3.0e-04 1,234 tok/s ETA")
    # 20 steps in 10 s -> 2 steps/s -> 880 steps left take 440 s
    assert lines[1] == "[demo] step 120/1000 (12%) loss 1.2346 lr 3.0e-04 1,234 tok/s ETA 0:07:20"
    assert "\r" not in out.getvalue()
    assert out.getvalue().endswith("\n")


def test_a_grpo_log_line_shows_the_rollout_engines_serving():
    out = io.StringIO()
    _, _, m = make(out)
    m.fire(
        "on_log",
        TrainingContext(global_step=7, run_name="r", batch_metrics={"rollout/engines": 2.0}),
    )
    assert out.getvalue() == "[r] step 7 engines 2\n"


def test_missing_fields_are_left_out():
    out = io.StringIO()
    _, _, m = make(out)
    m.fire("on_log", TrainingContext(global_step=7, run_name="r"))
    assert out.getvalue() == "[r] step 7\n"


def test_tty_redraws_in_place_and_ends_the_line_before_other_output():
    out = FakeTTY()
    _, clock, m = make(out)
    m.fire("on_log", log_ctx(100, throughput=123456.0))
    clock.now += 10
    m.fire("on_log", log_ctx(120, throughput=None))  # shorter: padded over the old one
    text = out.getvalue()
    assert text.count("\r") == 2 and "\n" not in text
    first, second = text.split("\r")[1:]
    assert len(second) == len(first) and second.rstrip().endswith("ETA 0:07:20")
    m.fire("on_evaluate", TrainingContext(global_step=120, run_name="demo", val_metrics={"a": 1}))
    assert out.getvalue().endswith(" \n[demo] eval step 120: a 1\n")


def test_eta_from_arrival_rate_and_fallback_to_step_time():
    bar, clock, m = make(io.StringIO())
    m.fire("on_log", log_ctx(10, elapsed_time=0.25))
    # one log: no span yet, so the rate comes from the step time (4 steps/s)
    assert bar.steps_per_second() == pytest.approx(4.0)
    clock.now += 0.2  # a batch of events arriving together: too short a span to trust
    m.fire("on_log", log_ctx(20, elapsed_time=0.25))
    assert bar.steps_per_second() == pytest.approx(4.0)
    clock.now += 4.8
    m.fire("on_log", log_ctx(30, elapsed_time=0.25))
    assert bar.steps_per_second() == pytest.approx(20 / 5.0)
    assert bar.eta(100) == pytest.approx(25.0)
    assert bar.eta(0) == 0.0


def test_eta_uses_only_the_recent_logs():
    bar, clock, m = make(io.StringIO())
    for step in range(0, 200, 10):  # slow at first: 10 steps per 10 s
        m.fire("on_log", log_ctx(step))
        clock.now += 10
    for step in range(200, 400, 10):  # then 10 steps per 1 s
        m.fire("on_log", log_ctx(step))
        clock.now += 1
    assert bar.steps_per_second() == pytest.approx(10.0)


def test_no_eta_without_max_steps_or_rate():
    out = io.StringIO()
    _, _, m = make(out)
    m.fire("on_log", log_ctx(5, max_steps=None, elapsed_time=None))
    assert "ETA" not in out.getvalue() and "%" not in out.getvalue()


def test_every_n_logs():
    out = io.StringIO()
    _, _, m = make(out, every_n_logs=3)
    for step in range(1, 8):
        m.fire("on_log", log_ctx(step))
    steps = [line.split()[2] for line in out.getvalue().splitlines()]
    assert steps == ["1/1000", "4/1000", "7/1000"]


def test_evaluate_and_summary_lines():
    out = io.StringIO()
    _, clock, m = make(out)
    m.fire("on_train_begin", TrainingContext(run_name="demo"))
    clock.now += 125
    m.fire(
        "on_evaluate",
        TrainingContext(global_step=0, run_name="demo", val_metrics={"val_loss": 0.5, "n": 3}),
        eval_step=400,
    )
    m.fire(
        "on_train_end",
        TrainingContext(
            global_step=400, max_steps=1000, run_name="demo", loss=0.25, stop_reason="EarlyStopping"
        ),
    )
    assert out.getvalue().splitlines() == [
        "[demo] eval step 400: val_loss 0.5000 n 3",
        "[demo] done at step 400/1000 in 0:02:05 loss 0.2500 (stopped: EarlyStopping)",
    ]
    assert m.errors == []


def test_default_stream_is_stdout_at_call_time_and_pickles(capsys):
    bar = ProgressBar()
    [copy] = loads_callbacks(dumps_callbacks([bar]))
    copy.on_log(TrainingContext(global_step=3, run_name="x"))
    assert capsys.readouterr().out == "[x] step 3\n"


def test_std_streams_pickle_by_name():
    bar = ProgressBar(stream=sys.stderr)
    [copy] = loads_callbacks(dumps_callbacks([bar]))
    assert copy.stream == "stderr"


def test_invalid_every_n_logs():
    with pytest.raises(ValueError, match="every_n_logs"):
        ProgressBar(every_n_logs=0)
