"""Shipping callbacks with cloudpickle: round trips and clear errors for unpicklable ones."""

import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from callbacks import (
    CallbackManager,
    CallbackPicklingError,
    TrainerCallback,
    TrainingContext,
)
from callbacks._serialize import dumps_callbacks, loads_callbacks, validate_picklable

REPO = Path(__file__).resolve().parents[2]


class Threshold(TrainerCallback):
    def __init__(self, limit, name="t"):
        self.limit = limit
        self.label = name
        self.seen = 0

    def on_log(self, context):
        self.seen += 1


def fire_all(callbacks, event, **fields):
    manager = CallbackManager(callbacks, global_callbacks=[])
    return manager.fire(event, TrainingContext(**fields))


def test_round_trip_keeps_constructor_args_and_state():
    cb = Threshold(0.5, name="x")
    cb.seen = 41
    (back,) = loads_callbacks(dumps_callbacks([cb]))
    assert isinstance(back, Threshold) and back is not cb
    assert (back.limit, back.label, back.seen) == (0.5, "x", 41)
    fire_all([back], "on_log")
    assert back.seen == 42


def test_round_trip_of_closures_and_lambdas():
    collected = []
    factor = 3

    def on_step_end(context):
        collected.append(context.global_step * factor)

    double = lambda ctx: ctx.user_state.__setitem__("double", ctx.global_step * 2)  # noqa: E731
    fn, lam = loads_callbacks(dumps_callbacks([on_step_end, double]))
    manager = CallbackManager([fn], global_callbacks=[])
    manager.register("on_step_end", lam)
    manager.fire("on_step_end", TrainingContext(global_step=5))
    assert manager.user_state == {"double": 10}
    # the closure cell travelled by value: the copy appends to its own list
    assert collected == []
    assert fn.__closure__ is not None
    assert [c.cell_contents for c in fn.__closure__ if isinstance(c.cell_contents, list)] == [[15]]


def test_round_trip_of_a_class_defined_in_a_function():
    def make():
        class Local(TrainerCallback):
            def __init__(self):
                self.calls = 0

            def on_save(self, context):
                self.calls += 1

        return Local()

    (back,) = loads_callbacks(dumps_callbacks([make()]))
    fire_all([back], "on_save")
    assert type(back).__name__ == "Local" and back.calls == 1


def test_round_trip_of_a_main_module_class_in_a_fresh_interpreter(tmp_path):
    payload = tmp_path / "cbs.pkl"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writer = textwrap.dedent(
        f"""
        from callbacks import TrainerCallback
        from callbacks._serialize import dumps_callbacks

        class MainCallback(TrainerCallback):
            def __init__(self, greeting):
                self.greeting = greeting
                self.calls = []

            def on_train_begin(self, context):
                self.calls.append(self.greeting + " " + str(context.global_step))

        cb = MainCallback("hello")
        cb.calls.append("before")
        open({str(payload)!r}, "wb").write(dumps_callbacks([cb, lambda ctx: None]))
        """
    )
    reader = textwrap.dedent(
        f"""
        from callbacks import CallbackManager, TrainingContext
        from callbacks._serialize import loads_callbacks

        cb, fn = loads_callbacks(open({str(payload)!r}, "rb").read())
        manager = CallbackManager([cb], global_callbacks=[])
        manager.fire("on_train_begin", TrainingContext(global_step=3))
        print(type(cb).__module__, type(cb).__name__, cb.calls)
        """
    )
    for script in (writer, reader):
        result = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
    assert result.stdout.split(maxsplit=2) == [
        "__main__",
        "MainCallback",
        "['before', 'hello 3']\n",
    ]


def test_validate_returns_the_bytes():
    data = validate_picklable([Threshold(1)])
    (back,) = loads_callbacks(data)
    assert back.limit == 1


class AlertCallback(TrainerCallback):
    def __init__(self):
        self.client = socket.socket()
        self.level = "warn"

    def on_log(self, context):
        pass


def test_unpicklable_attribute_is_named():
    bad = AlertCallback()
    try:
        with pytest.raises(CallbackPicklingError) as info:
            validate_picklable([Threshold(1), bad])
    finally:
        bad.client.close()
    message = str(info.value)
    assert message.startswith(
        "callback 'AlertCallback' (callbacks[1]) cannot be pickled: attribute 'self.client' "
        "holds a socket.socket (TypeError: cannot pickle 'socket' object)"
    )
    assert "create it lazily in on_train_begin, or drop it in __getstate__" in message
    assert isinstance(info.value, TypeError)


def test_unpicklable_value_inside_a_dict_attribute_is_named():
    class Holder(TrainerCallback):
        def __init__(self):
            self.resources = {"ok": 1, "lock": threading.Lock()}

        def on_log(self, context):
            pass

    with pytest.raises(CallbackPicklingError, match=r"attribute 'self\.resources\['lock'\]' holds"):
        validate_picklable([Holder()])


def test_lambda_closing_over_a_lock_names_the_variable():
    lock = threading.Lock()
    callback = lambda ctx: lock.acquire()  # noqa: E731
    with pytest.raises(CallbackPicklingError) as info:
        validate_picklable([callback])
    message = str(info.value)
    assert "callback '" in message and "(callbacks[0])" in message
    assert "closure variable 'lock' holds a _thread.lock" in message


def test_attribute_holding_a_closure_names_both():
    lock = threading.RLock()

    class WithHook(TrainerCallback):
        def __init__(self):
            self.notify = lambda: lock

        def on_log(self, context):
            pass

    with pytest.raises(CallbackPicklingError) as info:
        validate_picklable([WithHook()])
    assert "attribute 'self.notify' -> closure variable 'lock' holds a _thread.RLock" in str(
        info.value
    )


def test_pickles_but_cannot_be_unpickled_names_the_callback():
    class Fragile(TrainerCallback):
        def __init__(self):
            self.device = "cuda:0"

        def on_log(self, context):
            pass

        def __setstate__(self, state):
            raise RuntimeError("needs a GPU")

    with pytest.raises(CallbackPicklingError) as info:
        validate_picklable([Threshold(1), Fragile()])
    message = str(info.value)
    assert "'Fragile' (callbacks[1]) pickles but cannot be unpickled" in message
    assert "RuntimeError: needs a GPU" in message


def test_single_callback_is_accepted():
    (back,) = loads_callbacks(validate_picklable(Threshold(2)))
    assert back.limit == 2


def test_loads_rejects_non_lists():
    import cloudpickle

    with pytest.raises(TypeError, match="list of callbacks"):
        loads_callbacks(cloudpickle.dumps({"not": "a list"}))


def test_a_lock_deep_inside_nested_dicts_is_named_with_its_whole_path():
    class Deep(TrainerCallback):
        def __init__(self):
            self.config = {"a": {"b": {"c": {"lock": threading.Lock()}}}}

        def on_log(self, context, **kwargs):
            pass

    with pytest.raises(CallbackPicklingError) as info:
        validate_picklable([Deep()])
    assert "self.config['a']['b']['c']['lock']" in str(info.value)
    assert "_thread.lock" in str(info.value)


def test_labels_name_where_a_callback_was_given():
    lock = threading.Lock()

    def on_save(context):
        return lock

    with pytest.raises(CallbackPicklingError) as info:
        validate_picklable([on_save], labels=["on_save"])
    assert "(on_save)" in str(info.value) and "callbacks[0]" not in str(info.value)


def test_unpicklable_state_names_the_callback_and_the_value():
    from callbacks._serialize import unpicklable_state

    unpicklable_state("Fine", {"n": 1, "xs": [1, 2]})  # passes
    with pytest.raises(CallbackPicklingError) as info:
        unpicklable_state("Locky", {"n": 1, "guard": {"lock": threading.Lock()}})
    msg = str(info.value)
    assert "state_dict() of callback 'Locky'" in msg and "['guard']['lock']" in msg


def test_a_state_dict_that_cannot_be_pickled_is_left_out_and_recorded():
    from callbacks import CallbackManager

    class Locky(TrainerCallback):
        def on_log(self, context, **kwargs):
            pass

        def state_dict(self):
            return {"lock": threading.Lock()}

        def load_state_dict(self, state):
            pass

    class Counts(Locky):
        def state_dict(self):
            return {"n": 3}

    manager = CallbackManager([Locky(), Counts()], global_callbacks=[])
    state = manager.state_dict()
    assert list(state.values()) == [{"n": 3}] and next(iter(state)).endswith("Counts")
    [error] = manager.errors  # the checkpoint keeps the rest; this one is recorded
    assert error.callback.endswith("Locky") and error.event == "state_dict"
    assert "cannot be pickled" in error.error and "left out of this checkpoint" in error.error
