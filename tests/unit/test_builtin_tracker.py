"""The tracker loggers' machinery without a tracker: the bounded background sender, what the
hooks queue (names, steps, outcome), the state that continues a tracker run, and MLflow's
parameter rule. Real MLflow and W&B runs: tests/integration/test_trackers.py."""

from __future__ import annotations

import json
import pickle
import threading
import time

import pytest
from waiting import wait_until

from callbacks import MLflowLogger, TrainingContext, WandbLogger
from callbacks.builtin.tracker import BackgroundSender, TrackerLogger, flat_params, stable_id


class _Recorder(TrackerLogger):
    """A tracker that records the calls of the sender thread; `gate` can hold them."""

    def __init__(self, **kwargs):
        super().__init__(None, kwargs.pop("log_best_model", False), **kwargs)
        self.calls: list = []
        self.gate = threading.Event()
        self.gate.set()

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("gate")
        return state

    def _open(self, args, run_name, identity):
        self.gate.wait()
        self.run_id = self.run_id or "run-1"
        self.calls.append(("open", run_name, identity, args.get("max_steps")))

    def _send(self, points):
        self.gate.wait()
        self.calls.append(("send", points))

    def _finish(self, outcome):
        self.calls.append(("finish", outcome))

    def _upload(self, local_dir, checkpoint, metrics):
        self.calls.append(("upload", checkpoint, metrics))


def _ctx(**fields):
    base = {"run_name": "r", "args": {"storage_path": "/s", "run_name": "r", "max_steps": 9}}
    return TrainingContext(**{**base, **fields})


def test_the_sender_never_waits_drops_beyond_its_bound_and_survives_failures():
    release = threading.Event()
    seen: list = []

    def handle(batch):
        release.wait()
        if "bad" in batch:
            raise ConnectionError("tracker down")
        seen.extend(batch)

    sender = BackgroundSender("t", handle, max_queue=5)
    sender.put("first")  # taken by the thread, which then blocks in handle
    wait_until(lambda: not sender._items, 5, "the thread to take the first batch", interval=0.01)
    accepted = [sender.put(i) for i in range(8)]  # while the tracker hangs
    assert accepted == [True] * 5 + [False] * 3 and sender.dropped == 3
    assert sender.flush(timeout=0.2) is False  # bounded
    release.set()
    assert sender.flush(timeout=10)
    sender.put("bad")  # this batch fails: logged and counted, and the thread goes on
    assert sender.flush(timeout=10)
    sender.put("after")
    assert sender.close(timeout=10)
    assert seen[:6] == ["first", 0, 1, 2, 3, 4] and seen[-1] == "after"
    assert sender.failures == 1 and "tracker down" in sender.last_error
    assert sender.put("late") is False  # closed


def test_hooks_queue_train_and_eval_metrics_at_their_steps_and_the_outcome():
    cb = _Recorder(max_queue=100, flush_timeout_s=10)
    cb.on_train_begin(_ctx())
    cb.on_log(_ctx(global_step=10, loss=2.0, learning_rate=0.1, batch_metrics={"mfu": 0.3}))
    cb.on_log(_ctx(global_step=20, loss=1.5, batch_metrics={"note": "text"}))
    cb.on_evaluate(_ctx(global_step=20, val_metrics={"acc": 0.5, "x": None}), eval_step=10)
    cb.on_train_end(_ctx(global_step=20, stop_reason="EarlyStopping: no better"))
    assert cb.calls[0] == ("open", "r", "/s/r", 9)
    points = [p for c in cb.calls if c[0] == "send" for p in c[1]]
    assert points[0][0] == 10 and points[0][1]["train/loss"] == 2.0
    assert points[0][1]["train/mfu"] == 0.3 and points[0][1]["train/learning_rate"] == 0.1
    assert "train/note" not in points[1][1] and "train/grad_norm" not in points[1][1]
    assert points[2] == (10, {"eval/acc": 0.5})  # the evaluation's own step, not the latest
    finish = cb.calls[-1][1]
    assert finish["status"] == "finished" and finish["stopped_early"]
    assert finish["stop_reason"].startswith("EarlyStopping")


def test_a_failed_run_ends_failed_and_a_restart_clears_it():
    cb = _Recorder(max_queue=100, flush_timeout_s=10)
    cb.on_exception(_ctx(), exception="worker died")
    cb.on_train_begin(_ctx())  # Ray Train restarted the workers: the run goes on
    cb.on_exception(_ctx(), exception="again")
    cb.on_train_end(_ctx())
    assert cb.calls[-1][1]["status"] == "failed" and cb.calls[-1][1]["error"] == "again"


def test_a_hung_tracker_never_holds_up_the_hooks_and_the_end_is_bounded():
    cb = _Recorder(max_queue=50, flush_timeout_s=0.5)
    cb.gate.clear()  # the tracker never answers
    started = time.monotonic()
    for step in range(1, 501):
        cb.on_log(_ctx(global_step=step, loss=1.0))
    with pytest.raises(RuntimeError) as err:
        cb.on_train_end(_ctx())
    assert time.monotonic() - started < 30  # hooks only queue; the end waited ~flush_timeout_s
    assert "flush_timeout_s" in str(err.value) and "dropped" in str(err.value)
    cb.gate.set()


def test_the_tracker_run_id_travels_in_the_state_and_threads_do_not_pickle():
    cb = _Recorder(max_queue=10, flush_timeout_s=10)
    cb.on_train_begin(_ctx())
    cb.on_train_end(_ctx())
    assert cb.state_dict() == {"run_id": "run-1"}
    again = pickle.loads(pickle.dumps(cb))  # cloudpickle does the same in the driver
    assert again._sender is None and again.run_id == "run-1"
    fresh = _Recorder(max_queue=10, flush_timeout_s=10)
    fresh.load_state_dict({"run_id": "run-1"})
    assert fresh.run_id == "run-1"


def test_best_model_upload_goes_before_the_end(tmp_path):
    (tmp_path / "ckpt" / "hf").mkdir(parents=True)
    cb = _Recorder(max_queue=10, flush_timeout_s=10, log_best_model=True)
    ctx = _ctx(checkpoint_path=str(tmp_path / "other"))
    ctx.best_checkpoint_path, ctx.best_metrics = str(tmp_path / "ckpt"), {"acc": 1.0}
    cb.on_train_end(ctx)
    assert [c[0] for c in cb.calls] == ["open", "upload", "finish"]
    assert cb.calls[1][1:] == (str(tmp_path / "ckpt"), {"acc": 1.0})


def test_params_leave_unused_hooks_out_and_are_bounded():
    params = flat_params({"max_steps": 5, "on_log": None, "callbacks": ["A"], "demo": "x" * 900})
    assert params == {"max_steps": "5", "callbacks": "['A']", "demo": "x" * 497 + "..."}
    assert stable_id("/s/r") == stable_id("/s/r") != stable_id("/s/q")


def test_mlflow_keeps_the_first_params_and_tags_the_changed_ones():
    class Client:
        def __init__(self):
            self.batches = []

        def log_batch(self, run_id, params=(), tags=()):
            self.batches.append(({p.key: p.value for p in params}, {t.key: t.value for t in tags}))

    class Run:
        class info:
            run_id = "abc"

        class data:
            params = {"lr": "0.1", "max_steps": "10"}

    client = Client()
    logger = MLflowLogger("http://127.0.0.1:1")
    logger._log_params(client, Run, {"lr": "0.1", "max_steps": "20", "seed": "3"})
    assert client.batches == [({"seed": "3"}, {}), ({}, {"ray_trainer.changed.max_steps": "20"})]


def test_constructors_check_their_arguments_and_need_no_tracker(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ValueError, match="tracking_uri"):
        MLflowLogger()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert MLflowLogger().tracking_uri == "http://mlflow:5000"  # read in the driver
    with pytest.raises(ValueError, match="mode"):
        WandbLogger("p", mode="offine")
    with pytest.raises(ValueError, match="max_queue"):
        WandbLogger("p", max_queue=0)
    assert WandbLogger("p", mode="offline").runs_on == "actor"


def _samples_file(tmp_path):
    path = tmp_path / "checkpoint_00000004" / "eval" / "qa.jsonl"
    path.parent.mkdir(parents=True)
    rows = [
        {"row": 0, "prompt": "2 + 2 =", "answer": "4", "reference": "4",
         "scores": {"exact_match": 1.0}, "finish_reason": "stop", "answer_tokens": 1},
        {"row": 1, "prompt": [{"role": "user", "content": "hi"}], "answer": "yo",
         "reference": ["hi", "hello"], "scores": {"exact_match": 0.0, "chars": 2.0},
         "finish_reason": "length", "answer_tokens": 2},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path), rows


def test_mlflow_logs_an_evaluations_samples_file_as_an_artifact_at_its_step(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a real store, no server
    path, _ = _samples_file(tmp_path)
    uri = f"file://{tmp_path}/mlruns"
    cb = MLflowLogger(uri, experiment_name="samples")
    cb.on_train_begin(_ctx())
    metrics = {"qa/exact_match": 0.5, "qa/samples": path}
    cb.on_evaluate(_ctx(global_step=9, val_metrics=metrics), eval_step=4)
    cb.on_train_end(_ctx(global_step=9))
    client = MlflowClient(tracking_uri=uri)
    artifacts = client.list_artifacts(cb.run_id, "samples/step_00000004")
    assert [a.path for a in artifacts] == ["samples/step_00000004/qa.jsonl"]
    local = client.download_artifacts(cb.run_id, "samples/step_00000004/qa.jsonl", str(tmp_path))
    with open(local) as logged_file, open(path) as original:
        assert logged_file.read() == original.read()
    logged = client.get_run(cb.run_id).data.metrics
    assert logged["eval/qa/exact_match"] == 0.5 and "eval/qa/samples" not in logged


def test_wandb_logs_an_evaluations_samples_as_a_table_at_its_step(tmp_path):
    import wandb

    class Run:
        def __init__(self):
            self.logged = []

        def log(self, values):
            self.logged.append(values)

    class Offline(WandbLogger):  # W&B's own calls are stubbed; the table is W&B's
        def _open(self, args, run_name, identity):
            self._run = Run()

        def _finish(self, outcome):
            pass

    path, rows = _samples_file(tmp_path)
    cb = Offline("p", mode="disabled")
    cb.on_evaluate(_ctx(global_step=9, val_metrics={"qa/exact_match": 0.5, "qa/samples": path}),
                   eval_step=4)  # fmt: skip
    cb.on_train_end(_ctx(global_step=9))
    run = cb._run
    tables = [v for values in run.logged for v in values.values() if isinstance(v, wandb.Table)]
    assert len(tables) == 1
    logged = next(values for values in run.logged if "eval/qa/samples" in values)
    assert logged["trainer/global_step"] == 4
    table = logged["eval/qa/samples"]
    assert table.columns == [
        "row", "prompt", "answer", "reference", "finish_reason", "answer_tokens", "chars",
        "exact_match",
    ]  # fmt: skip
    assert table.data[0] == [0, "2 + 2 =", "4", "4", "stop", 1, None, 1.0]
    assert json.loads(table.data[1][1]) == rows[1]["prompt"]
    assert json.loads(table.data[1][3]) == ["hi", "hello"] and table.data[1][6] == 2.0
