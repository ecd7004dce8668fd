"""JsonlLogger: complete valid lines, fields (those `ray-trainer plot` draws among them), run
directory, non-finite values, pickling."""

import json
import os
import time

import pytest

from callbacks import CallbackManager, JsonlLogger, TrainingContext
from callbacks._serialize import dumps_callbacks, loads_callbacks


def manager_for(*callbacks):
    return CallbackManager(list(callbacks), global_callbacks=[])


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert text.endswith("\n"), "the file must only ever contain whole lines"
    return [json.loads(line) for line in text.splitlines()]


def log_ctx(step, storage, **fields):
    base = dict(
        global_step=step,
        epoch=1,
        run_name="run1",
        args={"storage_path": str(storage), "run_name": "run1"},
        loss=1.5,
        learning_rate=1e-3,
        grad_norm=0.75,
        throughput=2000.0,
        samples_seen=step * 8,
        tokens_seen=step * 1024,
    )
    base.update(fields)
    return TrainingContext(**base)


def test_lines_are_whole_and_valid_after_every_event(tmp_path):
    logger = JsonlLogger()
    m = manager_for(logger)
    assert {"on_log", "on_evaluate", "on_save", "on_train_end"} <= m.subscribed_events
    m.fire("on_train_begin", log_ctx(0, tmp_path))
    path = tmp_path / "run1" / "metrics.jsonl"
    assert logger.file_path == str(path)
    before = time.time()
    for i in range(1, 6):
        m.fire("on_log", log_ctx(i * 10, tmp_path))
        # read while the logger still holds the file open: every line is already complete
        records = read_lines(path)
        assert len(records) == i
    assert records[0] == {
        "event": "on_log",
        "step": 10,
        "epoch": 1,
        "time": records[0]["time"],
        "loss": 1.5,
        "learning_rate": 1e-3,
        "grad_norm": 0.75,
        "tokens_per_s": 2000.0,
        "samples_seen": 80,
        "tokens_seen": 10240,
        "mfu": None,  # no peak FLOPs known (a CPU)
        "world_size": 1,
    }
    assert before <= records[0]["time"] <= time.time()
    m.fire("on_train_end", log_ctx(50, tmp_path))
    assert logger._file is None
    assert m.errors == []


def test_evaluate_lines_carry_val_metrics_and_use_the_remembered_run_dir(tmp_path):
    logger = JsonlLogger()
    m = manager_for(logger)
    m.fire("on_log", log_ctx(10, tmp_path))
    # An EvalOnSave result: no args in its context, a checkpoint path, the step as eval_step.
    ctx = TrainingContext(
        global_step=10,
        run_name="run1",
        checkpoint_path="/ckpt/checkpoint_00000010",
        val_metrics={"accuracy": 0.5, "val_loss": float("nan")},
    )
    m.fire("on_evaluate", ctx, eval_step=10, source="EvalOnSave")
    _, record = read_lines(tmp_path / "run1" / "metrics.jsonl")
    assert record["event"] == "on_evaluate" and record["step"] == 10
    assert record["val_metrics"] == {"accuracy": 0.5, "val_loss": "nan"}
    assert record["checkpoint_path"] == "/ckpt/checkpoint_00000010"
    assert "seconds_after_save" not in record  # not given: not written
    assert m.errors == []
    logger.close()


def test_the_fields_the_panels_draw_mfu_world_size_saves_and_save_to_eval(tmp_path):
    m = manager_for(JsonlLogger())
    m.fire("on_log", log_ctx(10, tmp_path, batch_metrics={"mfu": 0.42}, world_size=4))
    m.fire("on_save", log_ctx(10, tmp_path, checkpoint_path="/ckpt/checkpoint_00000010"))
    ctx = TrainingContext(
        global_step=10, run_name="run1", checkpoint_path="/ckpt/checkpoint_00000010",
        val_metrics={"accuracy": 0.5},
    )  # fmt: skip
    m.fire("on_evaluate", ctx, eval_step=10, source="EvalOnSave", seconds_after_save=12.5)
    log, save, evaluation = read_lines(tmp_path / "run1" / "metrics.jsonl")
    assert (log["mfu"], log["world_size"]) == (0.42, 4)
    assert save == {
        "event": "on_save",
        "step": 10,
        "time": save["time"],
        "checkpoint_path": "/ckpt/checkpoint_00000010",
    }
    assert evaluation["seconds_after_save"] == 12.5
    assert evaluation["val_metrics"] == {"accuracy": 0.5}
    assert m.errors == []


def test_non_finite_and_odd_values_stay_valid_json(tmp_path):
    class Scalar:  # like a numpy or torch scalar
        def __float__(self):
            return 0.25

    path = tmp_path / "m.jsonl"
    logger = JsonlLogger(path=path)
    m = manager_for(logger)
    m.fire(
        "on_log",
        TrainingContext(
            global_step=1, loss=float("inf"), grad_norm=float("-inf"), learning_rate=None
        ),
    )
    m.fire(
        "on_evaluate",
        TrainingContext(
            global_step=1, val_metrics={"s": Scalar(), "o": object(), "l": [1.0, float("nan")]}
        ),
    )
    logger.close()
    text = path.read_text()
    for line in text.splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"invalid JSON constant {c}"))
    first, second = read_lines(path)
    assert (first["loss"], first["grad_norm"], first["learning_rate"]) == ("inf", "-inf", None)
    assert second["val_metrics"]["s"] == 0.25
    assert second["val_metrics"]["o"].startswith("<object object")
    assert second["val_metrics"]["l"] == [1.0, "nan"]


def test_explicit_path_appends_and_reopens_after_train_end(tmp_path):
    path = tmp_path / "sub" / "out.jsonl"
    logger = JsonlLogger(path=str(path))
    m = manager_for(logger)
    m.fire("on_log", TrainingContext(global_step=1))
    m.fire("on_train_end", TrainingContext(global_step=1))
    assert logger._file is None  # closed
    m.fire("on_log", TrainingContext(global_step=2))  # e.g. a restarted attempt
    logger.close()
    assert [r["step"] for r in read_lines(path)] == [1, 2]


def test_handle_is_not_pickled(tmp_path):
    logger = JsonlLogger(path=tmp_path / "a.jsonl")
    logger.on_log(TrainingContext(global_step=1))
    assert logger._file is not None
    [copy] = loads_callbacks(dumps_callbacks([logger]))  # would fail on an open file
    assert copy._file is None
    copy.on_log(TrainingContext(global_step=2))
    copy.close()
    logger.close()
    assert [r["step"] for r in read_lines(tmp_path / "a.jsonl")] == [1, 2]


def test_without_path_or_run_dir_is_a_clear_error():
    logger = JsonlLogger()
    m = manager_for(logger)
    m.fire("on_log", TrainingContext(global_step=1))
    [error] = m.errors
    assert "JsonlLogger(path=...)" in error.error


def test_filename_and_expanded_storage_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    logger = JsonlLogger(filename="train.jsonl")
    try:
        logger.on_log(log_ctx(1, "~/results"))
    finally:
        logger.close()
    assert os.path.exists(tmp_path / "results" / "run1" / "train.jsonl")
    with pytest.raises(ValueError, match="filename"):
        JsonlLogger(filename="a/b.jsonl")


def test_dpo_lines_carry_trls_metrics_under_their_names(tmp_path):
    m = manager_for(JsonlLogger())
    dpo = {"rewards/accuracies": 0.75, "logps/chosen": -40.5, "mfu": 0.1, "note": "x"}
    ctx = log_ctx(10, tmp_path, batch_metrics=dpo)
    ctx.args["objective_metrics"] = ["rewards/accuracies", "logps/chosen"]  # as DPO's args say
    m.fire("on_log", ctx)
    (record,) = read_lines(tmp_path / "run1" / "metrics.jsonl")
    assert record["rewards/accuracies"] == 0.75 and record["logps/chosen"] == -40.5
    assert record["mfu"] == 0.1 and "note" not in record  # mfu is a fixed field; others not
    assert m.errors == []


def test_no_path_and_no_run_folder_is_an_error_naming_the_fix():
    logger = JsonlLogger(filename="train.jsonl")
    message = (
        r"^JsonlLogger: no path given .* to put train\.jsonl in; pass JsonlLogger\(path=...\)$"
    )
    with pytest.raises(RuntimeError, match=message):
        logger.on_log(TrainingContext(global_step=1, loss=1.0))
    assert logger._file is None  # nothing opened
