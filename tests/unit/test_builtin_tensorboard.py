"""TensorBoardLogger: the ImportError without a writer, scalars written where expected."""

import importlib.util
import struct

import pytest

from callbacks import CallbackManager, TensorBoardLogger, TrainingContext
from callbacks._serialize import dumps_callbacks, loads_callbacks
from callbacks.builtin import tensorboard as tb

HAVE_WRITER = tb.find_backend() is not None
needs_writer = pytest.mark.skipif(
    not HAVE_WRITER, reason="neither tensorboard nor tensorboardX is installed"
)


def read_scalars(log_dir):
    """{tag: [(step, value)]} from the event files in log_dir (TFRecord framing, Event protos)."""
    if importlib.util.find_spec("tensorboardX") is None:
        pytest.skip("reading event files here uses tensorboardX's protos")
    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_without_tensorboard_construction_says_what_to_install(monkeypatch):
    monkeypatch.setattr(tb.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install 'ray-trainer\[tensorboard\]'"):
        TensorBoardLogger()


def test_backend_preference(monkeypatch):
    installed = {"tensorboard", "torch", "tensorboardX"}
    monkeypatch.setattr(tb.importlib.util, "find_spec", lambda name: name in installed or None)
    assert tb.find_backend() == "torch.utils.tensorboard"
    installed.discard("tensorboard")
    assert tb.find_backend() == "tensorboardX"


@needs_writer
def test_writes_train_and_eval_scalars_to_the_run_dir(tmp_path):
    logger = TensorBoardLogger()
    m = CallbackManager([logger], global_callbacks=[])
    assert {"on_log", "on_evaluate", "on_train_end"} <= m.subscribed_events
    args = {
        "storage_path": str(tmp_path),
        "run_name": "r1",
        "objective_metrics": ["rewards/margins"],
    }
    m.fire("on_train_begin", TrainingContext(run_name="r1", args=args))
    for step, loss in [(10, 2.0), (20, 1.5)]:
        ctx = TrainingContext(
            global_step=step, run_name="r1", args=args, loss=loss, learning_rate=0.5,
            grad_norm=None, throughput=100.0, batch_metrics={"rewards/margins": step / 10},
        )  # fmt: skip
        m.fire("on_log", ctx)
    # an EvalOnSave result: no args in the context; the remembered directory is used
    m.fire(
        "on_evaluate",
        TrainingContext(global_step=20, run_name="r1", val_metrics={"acc": 0.75, "note": "x"}),
        eval_step=20,
    )
    m.fire("on_train_end", TrainingContext(global_step=20, run_name="r1", args=args))
    assert m.errors == []
    assert logger._writer is None  # closed
    log_dir = tmp_path / "r1" / "tensorboard"
    assert logger.resolved_log_dir == str(log_dir)
    scalars = read_scalars(log_dir)
    assert scalars["train/loss"] == [(10, 2.0), (20, 1.5)]
    assert scalars["train/learning_rate"] == [(10, 0.5), (20, 0.5)]
    assert scalars["train/tokens_per_s"] == [(10, 100.0), (20, 100.0)]
    assert scalars["eval/acc"] == [(20, 0.75)]
    assert scalars["train/rewards/margins"] == [(10, 1.0), (20, 2.0)]  # DPO's, TRL's names
    assert "train/grad_norm" not in scalars and "eval/note" not in scalars


@needs_writer
def test_writer_is_not_pickled_and_missing_dir_is_an_error(tmp_path):
    logger = TensorBoardLogger(log_dir=tmp_path / "tb")
    logger.on_log(TrainingContext(global_step=1, loss=1.0))
    assert logger._writer is not None
    try:
        [copy] = loads_callbacks(dumps_callbacks([logger]))
        assert copy._writer is None
    finally:
        logger.close()
    with pytest.raises(RuntimeError, match=r"TensorBoardLogger\(log_dir=...\)"):
        TensorBoardLogger().on_log(TrainingContext(global_step=1, loss=1.0))
