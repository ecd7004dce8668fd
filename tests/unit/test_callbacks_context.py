"""TrainingContext: fields, snapshot isolation, wire format."""

import copy
import pickle
import time

from callbacks import CallbackManager, TrainerCallback, TrainerControl, TrainingContext

FIELDS = [
    "event",
    "global_step",
    "epoch",
    "samples_seen",
    "tokens_seen",
    "loss",
    "learning_rate",
    "grad_norm",
    "elapsed_time",
    "throughput",
    "cuda_mem_allocated",
    "batch_metrics",
    "val_metrics",
    "checkpoint_path",
    "args",
    "rank",
    "world_size",
    "local_rank",
    "is_world_process_zero",
    "is_local_process_zero",
    "run_name",
    "attempt",
    "max_steps",
    "control",
    "user_state",
    "model",
    "optimizer",
    "lr_scheduler",
    "batch",
    "outputs",
    "exception",
    "stop_reason",
]


def test_every_field_has_a_default():
    ctx = TrainingContext()
    for name in FIELDS:
        assert hasattr(ctx, name), name
    assert ctx.global_step == 0 and ctx.epoch == 0 and ctx.attempt == 0
    assert ctx.loss is None and ctx.model is None and ctx.exception is None
    assert ctx.batch_metrics == {} and ctx.val_metrics == {} and ctx.args == {}
    assert ctx.user_state == {}
    assert isinstance(ctx.control, TrainerControl)


def test_mutable_defaults_are_per_instance():
    a, b = TrainingContext(), TrainingContext()
    a.batch_metrics["x"] = 1
    a.user_state["y"] = 2
    assert b.batch_metrics == {} and b.user_state == {}
    assert a.control is not b.control


def test_keywords_set_fields_and_unknown_become_attributes():
    ctx = TrainingContext(global_step=7, loss=1.5, my_extra="hi")
    assert ctx.global_step == 7 and ctx.loss == 1.5 and ctx.my_extra == "hi"


def test_repr_mentions_event_and_step():
    text = repr(TrainingContext(event="on_save", global_step=3))
    assert "on_save" in text and "global_step=3" in text


def test_to_wire_drops_live_objects_and_reprs_exception():
    model = object()
    ctx = TrainingContext(
        global_step=4,
        loss=0.5,
        model=model,
        optimizer=object(),
        batch=[1, 2],
        outputs=object(),
        lr_scheduler=object(),
        exception=RuntimeError("boom"),
        batch_metrics={"acc": 0.9},
        user_state={"k": 1},
    )
    wire = ctx.to_wire()
    for name in ("model", "optimizer", "lr_scheduler", "batch", "outputs", "control", "user_state"):
        assert name not in wire
    assert wire["exception"] == "RuntimeError('boom')"
    assert wire["global_step"] == 4 and wire["batch_metrics"] == {"acc": 0.9}
    pickle.dumps(wire)  # plain and picklable


def test_to_wire_copies_dicts_and_keeps_only_plain_extras():
    metrics = {"acc": 0.9}
    ctx = TrainingContext(batch_metrics=metrics, note="text", handle=object())
    wire = ctx.to_wire()
    metrics["acc"] = 0.1  # the loop reuses its dict after sending
    assert wire["batch_metrics"] == {"acc": 0.9}
    assert wire["note"] == "text"
    assert "handle" not in wire


def test_from_wire_round_trip_has_no_live_objects():
    ctx = TrainingContext(global_step=9, loss=0.25, model=object(), val_metrics={"loss": 1.0})
    back = TrainingContext.from_wire(ctx.to_wire())
    assert back.global_step == 9 and back.loss == 0.25 and back.val_metrics == {"loss": 1.0}
    assert back.model is None and back.optimizer is None
    assert isinstance(back.control, TrainerControl) and back.user_state == {}


def test_to_wire_is_cheap():
    ctx = TrainingContext(global_step=1, loss=0.5, batch_metrics={"a": 1.0, "b": 2.0})
    n = 2000
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            ctx.to_wire()
        best = min(best, (time.perf_counter() - start) / n)
    assert best < 20e-6  # ~1 µs here; a generous bound so a busy machine does not flake


class Mutator(TrainerCallback):
    def on_log(self, context, **kwargs):
        context.loss = 999.0
        context.global_step = -1
        context.batch_metrics["injected"] = True
        context.val_metrics["injected"] = True
        context.args["injected"] = True
        context.new_attribute = "x"


class Recorder(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_log(self, context, **kwargs):
        self.seen.append(
            (
                context.loss,
                context.global_step,
                dict(context.batch_metrics),
                dict(context.val_metrics),
                dict(context.args),
                hasattr(context, "new_attribute"),
            )
        )


def test_snapshot_isolation_between_callbacks_and_caller():
    recorder = Recorder()
    manager = CallbackManager([Mutator(), recorder], global_callbacks=[])
    ctx = TrainingContext(loss=1.0, global_step=5, batch_metrics={"acc": 0.5}, args={"lr": 1})
    manager.fire("on_log", ctx)
    assert recorder.seen == [(1.0, 5, {"acc": 0.5}, {}, {"lr": 1}, False)]
    # the caller's context is untouched too
    assert ctx.loss == 1.0 and ctx.global_step == 5
    assert ctx.batch_metrics == {"acc": 0.5} and ctx.val_metrics == {} and ctx.args == {"lr": 1}
    assert not hasattr(ctx, "new_attribute")


def test_empty_dicts_are_not_shared_between_snapshots():
    recorder = Recorder()
    manager = CallbackManager([Mutator(), recorder], global_callbacks=[])
    ctx = TrainingContext()
    manager.fire("on_log", ctx)
    assert recorder.seen[0][2:5] == ({}, {}, {})
    assert ctx.batch_metrics == {}


def test_live_objects_are_shared_not_copied():
    model, batch = object(), [1, 2, 3]
    got = {}

    def on_step_end(context):
        got["model"], got["batch"] = context.model, context.batch

    manager = CallbackManager([on_step_end], global_callbacks=[])
    manager.fire("on_step_end", TrainingContext(model=model, batch=batch))
    assert got["model"] is model and got["batch"] is batch


def test_snapshot_does_not_deepcopy(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("copy.deepcopy called")

    monkeypatch.setattr(copy, "deepcopy", forbidden)
    recorder = Recorder()
    CallbackManager([recorder], global_callbacks=[]).fire(
        "on_log", TrainingContext(batch_metrics={"a": [1]})
    )
    assert len(recorder.seen) == 1


def test_each_snapshot_gets_a_fresh_control_and_event_name():
    controls, events = [], []

    class Grab(TrainerCallback):
        def on_checkpoint(self, context):  # alias: fires for on_save
            controls.append(context.control)
            events.append(context.event)

    caller_ctx = TrainingContext()
    manager = CallbackManager([Grab(), Grab()], global_callbacks=[])
    manager.fire("on_checkpoint", caller_ctx)
    assert len(controls) == 2
    assert controls[0] is not controls[1]
    assert all(control is not caller_ctx.control for control in controls)
    assert events == ["on_save", "on_save"]


def test_fire_kwargs_land_on_the_snapshot_not_on_the_callers_context():
    seen = {}

    def on_save(context):
        seen["path"] = context.checkpoint_path
        seen["extra"] = context.extra

    ctx = TrainingContext()
    CallbackManager([on_save], global_callbacks=[]).fire(
        "on_save", ctx, checkpoint_path="/ckpt/5", extra=1
    )
    assert seen == {"path": "/ckpt/5", "extra": 1}
    assert ctx.checkpoint_path is None and not hasattr(ctx, "extra")
