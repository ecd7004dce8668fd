"""MLflowLogger against a real MLflow server and WandbLogger in offline mode, driven with
hand-made contexts as the callback actor would (no Ray): what lands in the tracker, and how a
continued run goes on in the same tracker run. The same loggers inside real runs:
test_ranking_run.py."""

from __future__ import annotations

import time

import pytest
from tracker_support import _free_port, wandb_offline_runs, wandb_run

from callbacks import MLflowLogger, TrainingContext, WandbLogger


def _ctx(run_name, max_steps=20, **fields):
    args = {"storage_path": "/runs", "run_name": run_name, "max_steps": max_steps, "seed": 1}
    return TrainingContext(run_name=run_name, args=args, **fields)


def _train(cb, run_name, steps, max_steps=20, late_eval=None, error=None, **end):
    cb.on_train_begin(_ctx(run_name, max_steps))
    for step in steps:
        cb.on_log(_ctx(run_name, max_steps, global_step=step, loss=1.0 / step, learning_rate=0.1))
    if late_eval is not None:  # an EvalOnSave result of an older checkpoint, arriving late
        ctx = _ctx(run_name, max_steps, global_step=late_eval, val_metrics={"acc": 0.75})
        cb.on_evaluate(ctx, eval_step=late_eval, source="EvalOnSave")
    if error is not None:
        cb.on_exception(_ctx(run_name, max_steps), exception=error)
    cb.on_train_end(_ctx(run_name, max_steps, global_step=steps[-1], **end))


def _history(client, run_id, key):
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def test_mlflow_gets_params_metrics_evaluations_and_the_end_then_continues(mlflow_server):
    client = mlflow_server.client()
    first = MLflowLogger(mlflow_server.uri, "direct")
    _train(first, "mlf", [10, 20], late_eval=10, stop_reason="EarlyStopping: no better")
    run = client.get_run(first.run_id)
    assert run.info.run_name == "mlf" and run.info.status == "FINISHED"
    assert run.data.params["max_steps"] == "20" and run.data.params["seed"] == "1"
    assert run.data.tags["ray_trainer.stop_reason"] == "EarlyStopping: no better"
    assert run.data.tags["ray_trainer.run"] == "/runs/mlf"
    assert _history(client, first.run_id, "train/loss") == [(10, 0.1), (20, 0.05)]
    assert _history(client, first.run_id, "eval/acc") == [(10, 0.75)]  # at its checkpoint's step

    # Continued with a changed field (its state restored from a checkpoint): the same run,
    # the first value kept, the change recorded; then failed.
    second = MLflowLogger(mlflow_server.uri, "direct")
    second.load_state_dict(first.state_dict())
    _train(second, "mlf", [30], max_steps=40, error="worker died")
    run = client.get_run(first.run_id)
    assert run.info.status == "FAILED" and run.data.tags["ray_trainer.error"] == "worker died"
    assert run.data.params["max_steps"] == "20"
    assert run.data.tags["ray_trainer.changed.max_steps"] == "40"
    assert [s for s, _ in _history(client, first.run_id, "train/loss")] == [10, 20, 30]

    # No state (the run crashed before its first checkpoint): found by its tag.
    third = MLflowLogger(mlflow_server.uri, "direct")
    _train(third, "mlf", [40], max_steps=40)
    assert third.run_id == first.run_id
    assert client.get_run(first.run_id).info.status == "FINISHED"


def test_a_down_mlflow_server_costs_an_error_not_a_stall(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cb = MLflowLogger(f"http://127.0.0.1:{_free_port()}", "nowhere", flush_timeout_s=5)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="failed"):
        _train(cb, "down", list(range(1, 201)))
    assert time.monotonic() - started < 60  # bounded by flush_timeout_s, not by the server


def test_wandb_offline_run_files_hold_config_history_evaluations_and_exit(tmp_path):
    first = WandbLogger("proj", mode="offline", dir=str(tmp_path))
    _train(first, "wb", [1, 2, 3], late_eval=2)
    (folder,) = wandb_offline_runs(str(tmp_path))
    run = wandb_run(folder)
    assert run["id"] == first.run_id and run["name"] == "wb"
    assert run["config"]["max_steps"] == "20"
    assert ("*", "trainer/global_step") in run["metrics"]
    train = [
        (h["trainer/global_step"], h["train/loss"]) for h in run["history"] if "train/loss" in h
    ]
    assert train == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    # The late evaluation of step 2 is kept, at step 2 of our step metric.
    assert [
        (h["trainer/global_step"], h["eval/acc"]) for h in run["history"] if "eval/acc" in h
    ] == [(2, 0.75)]
    assert run["exit_code"] == 0

    again = WandbLogger("proj", mode="offline", dir=str(tmp_path))
    again.load_state_dict(first.state_dict())
    _train(again, "wb", [4], error="worker died")
    second = wandb_run(wandb_offline_runs(str(tmp_path))[-1])
    assert second["id"] == first.run_id  # the same W&B run, continued
    assert second["exit_code"] == 1 and second["summary"]["error"] == "worker died"
