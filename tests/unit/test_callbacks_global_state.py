"""Global callbacks, callback state (state_key, state_dict) and the cost of idle events."""

import gc
import os
import tracemalloc
import warnings

import pytest

import callbacks
import callbacks._manager as callbacks_manager
from callbacks import (
    CallbackManager,
    TrainerCallback,
    TrainingContext,
    global_callbacks,
    register_global_callback,
)


class Saver(TrainerCallback):
    def __init__(self, value=0):
        self.value = value

    def on_save(self, context):
        self.value += 1

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


class Stateless(TrainerCallback):
    def on_save(self, context):
        pass


# -- global registry ------------------------------------------------------------------------


def test_register_global_callback_and_handle_remove_is_idempotent():
    cb = Stateless()
    handle = register_global_callback(cb)
    assert global_callbacks() == [cb]
    manager = CallbackManager()
    assert manager.callbacks == [cb]
    handle.remove()
    handle.remove()
    assert global_callbacks() == []
    assert manager.callbacks == [cb]  # the registry was read at construction
    assert CallbackManager().callbacks == []


def test_global_callbacks_returns_a_copy():
    handle = register_global_callback(Stateless())
    try:
        copy = global_callbacks()
        copy.clear()
        assert len(global_callbacks()) == 1
    finally:
        handle.remove()


def test_global_callbacks_list_overrides_registry():
    handle = register_global_callback(Stateless())
    try:
        assert CallbackManager(global_callbacks=[]).callbacks == []
        explicit = Stateless()
        assert CallbackManager(global_callbacks=[explicit]).callbacks == [explicit]
    finally:
        handle.remove()


def test_global_already_in_user_list_runs_once():
    cb = Saver()
    with cb:
        manager = CallbackManager([cb])
    manager.fire("on_save")
    assert cb.value == 1 and manager.callbacks == [cb]


def test_register_global_validates():
    with pytest.raises(TypeError, match="pass an instance"):
        register_global_callback(Stateless)
    assert global_callbacks() == []


def test_handle_as_context_manager():
    with register_global_callback(Stateless()) as handle:
        assert global_callbacks() == [handle.callback]
    assert global_callbacks() == []


def test_remove_global_from_one_manager_only():
    cb = Stateless()
    with cb:
        first, second = CallbackManager(), CallbackManager()
    first.remove(cb)
    assert first.callbacks == [] and second.callbacks == [cb]


# -- state ----------------------------------------------------------------------------------


def test_state_keys_are_distinct_and_deterministic():
    a, b, c = Saver(), Saver(), Saver()
    manager = CallbackManager([a, Stateless(), b, c], global_callbacks=[])
    assert [a.state_key, b.state_key, c.state_key] == ["Saver", "Saver#1", "Saver#2"]
    assert set(manager.state_dict()) == {"Saver", "Saver#1", "Saver#2"}
    manager.remove(a)
    assert [b.state_key, c.state_key] == ["Saver", "Saver#1"]  # registration order again


def test_state_dict_round_trip():
    a, b = Saver(1), Saver(10)
    manager = CallbackManager([a, b, Stateless()], global_callbacks=[])
    for _ in range(2):
        manager.fire("on_save")
    state = manager.state_dict()
    assert state == {"Saver": {"value": 3}, "Saver#1": {"value": 12}}

    a2, b2 = Saver(), Saver()
    restored = CallbackManager([a2, b2, Stateless()], global_callbacks=[])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored.load_state_dict(state)
    assert (a2.value, b2.value) == (3, 12)


def test_missing_state_is_a_warning_not_an_error():
    cb = Saver(5)
    manager = CallbackManager([cb], global_callbacks=[])
    with pytest.warns(UserWarning, match="no saved state for callback 'Saver'"):
        manager.load_state_dict({})
    assert cb.value == 5


def test_failing_load_state_dict_is_recorded():
    class BadLoad(Saver):
        def load_state_dict(self, state):
            raise ValueError("corrupt")

    manager = CallbackManager([BadLoad()], global_callbacks=[])
    manager.load_state_dict({"test_failing_load_state_dict_is_recorded.<locals>.BadLoad": {}})
    assert [e.event for e in manager.errors] == ["load_state_dict"]


def test_clashing_custom_state_keys_are_an_error():
    class Custom(Saver):
        @property
        def state_key(self):
            return "same"

    manager = CallbackManager([Custom()], global_callbacks=[])
    with pytest.raises(ValueError, match="share the state_key 'same'"):
        manager.add(Custom())
    assert len(manager.callbacks) == 1


def test_duck_typed_stateful_object():
    class Plain:
        state_key = "plain"

        def __init__(self):
            self.n = 0

        def on_log(self, context):
            self.n += 1

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    manager = CallbackManager([Plain()], global_callbacks=[])
    manager.fire("on_log")
    assert manager.state_dict() == {"plain": {"n": 1}}


# -- cost of an unsubscribed event ----------------------------------------------------------


def test_unsubscribed_fire_does_not_allocate(monkeypatch):
    snapshots = []
    real_snapshot = callbacks_manager.make_snapshot
    monkeypatch.setattr(
        callbacks_manager, "make_snapshot", lambda t: snapshots.append(1) or real_snapshot(t)
    )
    manager = CallbackManager([Stateless()], global_callbacks=[])
    ctx = TrainingContext()
    fire = manager.fire

    def run(n):
        for _ in range(n):
            fire("on_step_end", ctx)
            fire("on_before_forward")

    package = tracemalloc.Filter(True, os.path.join(os.path.dirname(callbacks.__file__), "*"))
    run(100)  # warm up caches
    gc.collect()
    tracemalloc.start()
    try:
        run(10)
        before_total = tracemalloc.get_traced_memory()[0]
        run(10_000)
        after_total = tracemalloc.get_traced_memory()[0]
        before = tracemalloc.take_snapshot().filter_traces([package])
        run(10_000)
        after = tracemalloc.take_snapshot().filter_traces([package])
    finally:
        tracemalloc.stop()
    assert after_total - before_total < 256  # 20k calls: nothing per call
    assert sum(stat.size_diff for stat in after.compare_to(before, "lineno")) == 0
    assert snapshots == []  # no snapshot built
    assert manager.handled_events == {}
    manager.fire("on_save")  # a subscribed event does build one (the patch is live)
    assert snapshots == [1]


def test_unsubscribed_fire_returns_the_shared_empty_control():
    manager = CallbackManager([Stateless()], global_callbacks=[])
    assert manager.fire("on_log") is manager.fire("on_step_end")
