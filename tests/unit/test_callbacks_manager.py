"""CallbackManager in synchronous mode: registration, order, dispatch, controls, errors."""

import asyncio
import functools
import logging
import threading

import pytest

from callbacks import (
    EVENTS,
    CallbackError,
    CallbackManager,
    TrainerCallback,
    TrainerControl,
    TrainingContext,
    register_global_callback,
)
from callbacks._manager_async import AsyncCallbackManager


def make_manager(*callbacks, **kwargs):
    kwargs.setdefault("global_callbacks", [])
    return CallbackManager(list(callbacks), **kwargs)


class Log(TrainerCallback):
    """Appends (name, event) to a shared list on the events it overrides."""

    def __init__(self, calls, label=None):
        self.calls = calls
        self.label = label or type(self).__name__

    def on_log(self, context, **kwargs):
        self.calls.append((self.label, context.event))

    def on_save(self, context, **kwargs):
        self.calls.append((self.label, context.event))


# -- subscription ---------------------------------------------------------------------------


def test_only_overridden_hooks_are_called_and_subscribed():
    calls = []
    manager = make_manager(Log(calls))
    assert manager.subscribed_events == {"on_log", "on_save"}
    for event in sorted(EVENTS):
        manager.fire(event, TrainingContext())
    assert sorted(calls) == [("Log", "on_log"), ("Log", "on_save")]
    assert manager.has_callbacks("on_log") and not manager.has_callbacks("on_step_end")
    assert manager.has_callbacks("on_checkpoint")  # alias of on_save


def test_events_is_empty_without_callbacks():
    manager = make_manager()
    assert manager.subscribed_events == frozenset()
    assert manager.callbacks == []


def test_events_lists_every_valid_event_as_in_megatron_bridge():
    # Ported code checks `event in manager.events` before registering: every valid name.
    manager = make_manager(Log([]))
    assert manager.events == EVENTS
    assert make_manager().events == EVENTS
    assert all(manager.register(e, lambda ctx: None) is None for e in sorted(manager.events))
    assert AsyncCallbackManager(global_callbacks=[]).events == EVENTS


def test_sync_and_async_dispatch_are_separate_classes():
    sync, async_ = make_manager(), AsyncCallbackManager(global_callbacks=[])
    assert type(sync) is CallbackManager and isinstance(async_, AsyncCallbackManager)
    assert not hasattr(sync, "_dispatcher")
    assert sync.fire("on_log") is not None and async_.fire("on_log") is None
    async_.close()


def test_duck_typed_object_is_a_callback():
    calls = []

    class Plain:
        def on_evaluate(self, context):
            calls.append(context.val_metrics)

    manager = make_manager(Plain())
    manager.fire("on_evaluate", TrainingContext(), val_metrics={"loss": 1.0})
    assert calls == [{"loss": 1.0}]
    assert manager.subscribed_events == {"on_evaluate"}


def test_alias_method_names_are_called_for_their_event():
    calls = []

    class Ported(TrainerCallback):
        def on_checkpoint(self, context):
            calls.append(("checkpoint", context.event))

        def on_optimizer_step(self, context):
            calls.append(("optimizer", context.event))

        def on_validation_loss(self, context):
            calls.append(("validation", context.event))

        def on_pre_optimizer_step(self, context):
            calls.append(("pre", context.event))

    manager = make_manager(Ported())
    assert manager.subscribed_events == {
        "on_save",
        "on_after_optimizer_step",
        "on_evaluate",
        "on_before_optimizer_step",
    }
    for event in ("on_save", "on_after_optimizer_step", "on_evaluate", "on_before_optimizer_step"):
        manager.fire(event)
    assert calls == [
        ("checkpoint", "on_save"),
        ("optimizer", "on_after_optimizer_step"),
        ("validation", "on_evaluate"),
        ("pre", "on_before_optimizer_step"),
    ]


def test_event_and_its_alias_on_one_class_both_run():
    calls = []

    class Both(TrainerCallback):
        def on_save(self, context):
            calls.append("on_save")

        def on_checkpoint(self, context):
            calls.append("on_checkpoint")

    make_manager(Both()).fire("on_save")
    assert calls == ["on_save", "on_checkpoint"]


# -- add / register / remove ----------------------------------------------------------------


def test_class_instead_of_instance_is_a_type_error():
    with pytest.raises(TypeError, match=r"pass an instance, e\.g\. Log\(\)"):
        make_manager().add(Log)


def test_object_without_hooks_is_a_type_error():
    with pytest.raises(TypeError, match="a callback is an instance of a TrainerCallback"):
        make_manager().add(object())


def test_subclass_without_overrides_is_a_type_error():
    class Empty(TrainerCallback):
        pass

    with pytest.raises(TypeError, match="has no hooks"):
        make_manager(Empty())


def test_event_named_function_is_registered_for_its_event():
    calls = []

    def on_save(context):
        calls.append("save")

    def on_checkpoint(context):  # alias name
        calls.append("checkpoint")

    manager = make_manager(on_save, on_checkpoint)
    assert manager.subscribed_events == {"on_save"}
    manager.fire("on_save")
    assert calls == ["save", "checkpoint"]


def test_other_function_is_a_type_error_pointing_to_register():
    def notify(context):
        pass

    with pytest.raises(TypeError, match=r"register\(event, fn\)"):
        make_manager().add(notify)

    def on_sav(context):
        pass

    with pytest.raises(TypeError, match="did you mean 'on_save'"):
        make_manager().add(on_sav)


def test_register_accepts_events_and_aliases():
    calls = []
    manager = make_manager()
    manager.register("on_log", lambda ctx: calls.append(("log", ctx.event)))
    manager.register("on_validation_loss", lambda ctx: calls.append(("eval", ctx.event)))
    manager.fire("on_log")
    manager.fire("on_evaluate")
    assert calls == [("log", "on_log"), ("eval", "on_evaluate")]


def test_register_unknown_event_has_did_you_mean():
    with pytest.raises(ValueError, match=r"did you mean 'on_step_end'\?.*Valid events"):
        make_manager().register("on_step_ends", lambda ctx: None)


def test_fire_unknown_event_has_did_you_mean():
    manager = make_manager(Log([]))
    with pytest.raises(ValueError, match="did you mean 'on_log'"):
        manager.fire("on_lgo")


def test_fire_accepts_alias_names():
    calls = []
    manager = make_manager(Log(calls))
    manager.fire("on_checkpoint")
    assert calls == [("Log", "on_save")]


def test_hook_that_cannot_take_the_context_fails_at_add():
    class Bad(TrainerCallback):
        def on_log(self):
            pass

    with pytest.raises(TypeError, match=r"define it as on_log\(self, context, \*\*kwargs\)"):
        make_manager(Bad())


def test_adding_the_same_instance_twice_is_an_error():
    cb = Log([])
    manager = make_manager(cb)
    with pytest.raises(ValueError, match="already added"):
        manager.add(cb)
    assert manager.callbacks == [cb]


def test_add_a_list_is_atomic():
    manager = make_manager()
    with pytest.raises(TypeError):
        manager.add([Log([]), Log])
    assert manager.callbacks == []


def test_remove_by_instance_class_and_function():
    calls = []
    a, b = Log(calls, "a"), Log(calls, "b")

    class Other(TrainerCallback):
        def on_log(self, context):
            calls.append(("other", context.event))

    def fn(context):
        calls.append(("fn", context.event))

    other = Other()
    manager = make_manager(a, b, other)
    manager.register("on_log", fn)
    manager.remove(a)
    assert manager.callbacks == [b, other, fn]
    manager.remove(Log)  # every instance of the class
    assert manager.callbacks == [other, fn]
    manager.remove(fn)
    assert manager.callbacks == [other]
    manager.fire("on_log")
    assert calls == [("other", "on_log")]
    with pytest.raises(ValueError, match="not registered"):
        manager.remove(fn)


def test_remove_bound_method_registration():
    calls = []
    cb = Log(calls)
    manager = make_manager()
    manager.register("on_step_end", cb.on_log)
    manager.remove(cb.on_log)  # a new bound-method object, equal to the registered one
    assert manager.subscribed_events == frozenset()


# -- order ----------------------------------------------------------------------------------


def test_order_core_then_user_interleaved_then_global():
    calls = []
    core = Log(calls, "core")
    glob = Log(calls, "global")
    handle = register_global_callback(glob)
    try:
        manager = CallbackManager([Log(calls, "user1")], core=[core])
    finally:
        handle.remove()

    def on_log(context):
        calls.append(("fn1", context.event))

    manager.add(on_log)
    manager.add(Log(calls, "user2"))
    manager.register("on_log", lambda ctx: calls.append(("fn2", ctx.event)))
    manager.fire("on_log")
    assert [label for label, _ in calls] == ["core", "user1", "fn1", "user2", "fn2", "global"]
    assert manager.list_callbacks("on_log")[0] is core
    assert manager.list_callbacks("on_log")[-1] is glob


def test_list_callbacks_returns_a_copy():
    cb = Log([])
    manager = make_manager(cb)
    listed = manager.list_callbacks()
    listed.clear()
    assert manager.list_callbacks() == [cb]
    by_event = manager.list_callbacks("on_checkpoint")
    assert by_event == [cb]
    by_event.append("junk")
    assert manager.list_callbacks("on_save") == [cb]
    assert manager.list_callbacks("on_step_end") == []
    assert manager.callbacks is not manager.callbacks


# -- kwargs and controls --------------------------------------------------------------------


def test_kwargs_reach_hooks_that_take_them_only():
    got = {}

    class WithKwargs(TrainerCallback):
        def on_save(self, context, **kwargs):
            got["kwargs"] = kwargs

    class WithoutKwargs(TrainerCallback):
        def on_save(self, context):
            got["plain"] = context.path

    def named(context, path=None):
        got["named"] = path

    manager = make_manager(WithKwargs(), WithoutKwargs())
    manager.register("on_save", named)
    manager.fire("on_save", TrainingContext(), path="/p", other=1)
    assert got == {"kwargs": {"path": "/p", "other": 1}, "plain": "/p", "named": "/p"}


def test_partial_and_builtin_functions_can_be_registered():
    seen = []
    manager = make_manager()
    manager.register("on_log", functools.partial(lambda tag, ctx: seen.append(tag), "p"))
    manager.register("on_log", seen.append)  # a builtin method
    manager.fire("on_log")
    assert seen[0] == "p" and isinstance(seen[1], TrainingContext)


def test_controls_from_flags_and_return_values_are_merged():
    class Flagger(TrainerCallback):
        def on_step_end(self, context):
            context.control.should_save = True

    class Stopper(TrainerCallback):
        def on_step_end(self, context):
            return TrainerControl(should_training_stop=True)

    class Evaluator(TrainerCallback):
        def on_step_end(self, context):
            context.control = TrainerControl(should_evaluate=True)  # replacing works too

    result = make_manager(Flagger(), Stopper(), Evaluator()).fire("on_step_end")
    assert result.should_save and result.should_training_stop and result.should_evaluate
    assert not result.should_log
    assert result.stop_reason == "Stopper"


def test_nothing_requested_returns_empty_control():
    result = make_manager(Log([])).fire("on_log")
    assert isinstance(result, TrainerControl) and not result.any


# -- async hooks in the synchronous dispatcher ----------------------------------------------


class AsyncHook(TrainerCallback):
    def __init__(self):
        self.done = []

    async def on_log(self, context, **kwargs):
        await asyncio.sleep(0)
        self.done.append(context.global_step)
        return TrainerControl(should_log=True)


def test_async_hooks_are_awaited():
    cb = AsyncHook()
    manager = make_manager(cb)
    result = manager.fire("on_log", TrainingContext(global_step=3))
    assert cb.done == [3] and result.should_log
    manager.fire("on_log", TrainingContext(global_step=4))  # the private loop is reused
    assert cb.done == [3, 4]
    manager.close()


def test_async_hooks_work_when_fired_inside_a_running_loop():
    cb = AsyncHook()
    manager = make_manager(cb)

    async def main():
        return manager.fire("on_log", TrainingContext(global_step=8))

    result = asyncio.run(main())
    assert cb.done == [8] and result.should_log


def test_async_hook_exception_is_recorded():
    class AsyncBoom(TrainerCallback):
        async def on_log(self, context):
            raise KeyError("async boom")

    manager = make_manager(AsyncBoom())
    manager.fire("on_log", TrainingContext(global_step=2))
    assert [(e.callback, e.event, e.step) for e in manager.errors] == [("AsyncBoom", "on_log", 2)]
    assert "async boom" in manager.errors[0].error


# -- errors ---------------------------------------------------------------------------------


class Boom(TrainerCallback):
    def on_step_end(self, context):
        raise RuntimeError(f"boom at {context.global_step}")


def test_exception_is_isolated_logged_and_recorded(caplog):
    calls = []

    def on_step_end(context):
        calls.append(context.global_step)

    manager = make_manager(Boom(), on_step_end)
    with caplog.at_level(logging.ERROR, logger="callbacks"):
        result = manager.fire("on_step_end", TrainingContext(global_step=12))
    assert calls == [12]  # the next callback still ran
    assert not result.any
    (error,) = manager.errors
    assert isinstance(error, CallbackError)
    assert (error.callback, error.event, error.step) == ("Boom", "on_step_end", 12)
    assert error.error == "RuntimeError: boom at 12"
    assert "Traceback" in error.traceback and "boom at 12" in error.traceback
    (record,) = [r for r in caplog.records if r.name == "callbacks"]
    message = record.getMessage()
    assert "Boom" in message and "on_step_end" in message and "12" in message
    assert "Traceback" in message


def test_callback_error_is_frozen():
    error = CallbackError("cb", "on_log", 1, "E: x", "")
    with pytest.raises(AttributeError):
        error.step = 2


def test_bad_return_value_is_recorded():
    class ReturnsInt(TrainerCallback):
        def on_log(self, context):
            return 42

    manager = make_manager(ReturnsInt())
    result = manager.fire("on_log", TrainingContext(global_step=1))
    assert not result.any
    (error,) = manager.errors
    assert error.callback == "ReturnsInt" and error.event == "on_log" and error.step == 1
    assert "returned int; a hook returns None or a TrainerControl" in error.error


def test_errors_are_bounded_but_counted_and_logs_rate_limited(caplog):
    manager = make_manager(Boom(), max_errors=5)
    with caplog.at_level(logging.ERROR, logger="callbacks"):
        for step in range(250):
            manager.fire("on_step_end", TrainingContext(global_step=step))
    assert len(manager.errors) == 5
    assert [e.step for e in manager.errors] == [0, 1, 2, 3, 4]
    assert manager.error_counts == {("Boom", "on_step_end"): 250}
    records = [r.getMessage() for r in caplog.records if r.name == "callbacks"]
    assert len(records) == 3 + 2  # three tracebacks, then a summary at 100 and 200
    assert sum("Traceback" in m for m in records) == 3
    assert "200 times" in records[-1]


def test_errors_returns_a_copy():
    manager = make_manager(Boom())
    manager.fire("on_step_end")
    manager.errors.clear()
    assert len(manager.errors) == 1


# -- user_state, close ----------------------------------------------------------------------


def test_user_state_persists_across_events_and_callbacks():
    class Counter(TrainerCallback):
        def on_step_end(self, context):
            context.user_state["steps"] = context.user_state.get("steps", 0) + 1

    class Reader(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_step_end(self, context):
            self.seen.append(context.user_state["steps"])

    reader = Reader()
    manager = make_manager(Counter(), reader)
    for _ in range(3):
        manager.fire("on_step_end", TrainingContext())
    assert reader.seen == [1, 2, 3]
    assert manager.user_state == {"steps": 3}


def test_fire_after_close_is_a_noop_and_close_is_idempotent():
    calls = []
    manager = make_manager(Log(calls))
    assert manager.close() is True
    assert manager.close() is True
    result = manager.fire("on_log")
    assert calls == [] and not result.any
    with pytest.raises(ValueError):
        manager.fire("on_nothing")  # still a clear error


def test_manager_as_context_manager_closes():
    calls = []
    with make_manager(Log(calls)) as manager:
        manager.fire("on_log")
    manager.fire("on_log")
    assert calls == [("Log", "on_log")]


def test_handled_events_counts_subscribed_events():
    manager = make_manager(Log([]))
    for _ in range(3):
        manager.fire("on_log")
    manager.fire("on_step_end")  # no subscriber: not counted
    assert manager.handled_events == {"on_log": 3}
    assert manager.dropped_events == {}
    assert manager.take_control() is None
    assert manager.flush() is True


def test_fire_from_several_threads():
    lock = threading.Lock()
    seen = []

    def on_log(context):
        with lock:
            seen.append(context.global_step)

    manager = make_manager(on_log)
    threads = [
        threading.Thread(
            target=lambda base=i: [
                manager.fire("on_log", TrainingContext(global_step=base * 100 + k))
                for k in range(50)
            ]
        )
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(seen) == sorted(b * 100 + k for b in range(4) for k in range(50))


def test_register_needs_a_callable():
    with pytest.raises(TypeError, match="needs a callable"):
        make_manager().register("on_log", "not a function")


def test_hook_with_required_extra_argument_fails_at_add():
    def on_save(context, path):
        pass

    with pytest.raises(TypeError, match="cannot be called with the context"):
        make_manager(on_save)
