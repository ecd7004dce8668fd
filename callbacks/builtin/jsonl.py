"""Runs on the callback actor: ``JsonlLogger``, one JSON line per log, checkpoint and evaluation."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from callbacks.builtin.common import as_float, json_safe, objective_metrics, throughput_of
from callbacks.builtin.run_files import RunFileLogger

__all__ = ["JsonlLogger"]


class JsonlLogger(RunFileLogger):
    """Write the training metrics as JSON lines, for ``tail -f``, pandas or jq.

    Runs on the callback actor (``runs_on="actor"``), so the file is written on the head node.
    Each ``on_log`` appends::

        {"event": "on_log", "step": 120, "epoch": 0, "time": 1767225600.1, "loss": 1.2345,
         "learning_rate": 0.0003, "grad_norm": 0.8, "tokens_per_s": 1234.5,
         "samples_seen": 3840, "tokens_seen": 491520, "mfu": 0.41, "world_size": 2}

    (``mfu`` is None where the device's peak FLOPs are unknown, e.g. on a CPU); each
    ``on_evaluate`` the fields above but ``mfu``/``world_size``, plus ``"val_metrics"`` (and,
    for ``EvalOnSave`` results, ``checkpoint_path`` and ``seconds_after_save``: from the
    checkpoint's save to its metrics); each ``on_save``
    ``{"event": "on_save", "step": 100, "time": ..., "checkpoint_path": "..."}``. These are the
    figures ``ray-trainer plot`` draws. ``time`` is the unix time at which the line was written.
    Non-finite floats are written as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (never
    invalid JSON); other non-JSON values as numbers when they convert, else as strings.

    Each line is written with one unbuffered ``write`` of the whole line in append mode, so a
    reader tailing the file sees whole lines only. On a bucket (``storage_path="s3://..."``)
    the actor writes a local working copy and uploads it whole at most every 30 s, after each
    evaluation and at the end. The file is opened on the first line
    (appending: a resumed run continues it), is not pickled, and is closed at ``on_train_end``.

    Args:
        path: the file to write; default ``<storage_path>/<run_name>/<filename>``.
        filename: the file name inside the run directory when ``path`` is not given.

    Example:
        >>> run_training(callbacks=[JsonlLogger()])
        >>> # then: tail -f ~/ray_results/<run_name>/metrics.jsonl | jq .loss
    """

    _writer_attr = "_file"

    def __init__(self, path: str | os.PathLike[str] | None = None, filename: str = "metrics.jsonl"):
        if not filename or os.sep in filename:
            raise ValueError(f"JsonlLogger: filename must be a plain file name, got {filename!r}")
        super().__init__(path, filename)
        self.path = os.fspath(path) if path is not None else None
        self.filename = filename

    @property
    def file_path(self) -> str | None:
        """The file being written (None until known: the run directory comes with events)."""
        return self._resolved

    def on_log(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor at each log: appends a line."""
        record = self._record(context, "on_log")
        record["mfu"] = as_float((context.batch_metrics or {}).get("mfu"))
        record["world_size"] = context.world_size
        self._append(record, context)

    def on_save(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor after each checkpoint is persisted: appends a line."""
        record = {"event": "on_save", "step": context.global_step, "time": time.time()}
        record["checkpoint_path"] = context.checkpoint_path or kwargs.get("checkpoint_path")
        self._append(record, context)

    def on_evaluate(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor with each evaluation's results: appends a line."""
        record = self._record(context, "on_evaluate")
        record["step"] = kwargs.get("eval_step", context.global_step)
        record["val_metrics"] = dict(context.val_metrics or {})
        if context.checkpoint_path:
            record["checkpoint_path"] = context.checkpoint_path
        if kwargs.get("seconds_after_save") is not None:
            record["seconds_after_save"] = as_float(kwargs["seconds_after_save"])
        self._append(record, context)
        self._sync(force=True)

    # -- internals ---------------------------------------------------------------------------

    @staticmethod
    def _record(context: Any, event: str) -> dict[str, Any]:
        throughput = throughput_of(context)
        return {
            "event": event,
            "step": context.global_step,
            "epoch": context.epoch,
            "time": time.time(),
            "loss": as_float(context.loss),
            "learning_rate": as_float(context.learning_rate),
            "grad_norm": as_float(context.grad_norm),
            "tokens_per_s": as_float(throughput),
            "samples_seen": context.samples_seen,
            "tokens_seen": context.tokens_seen,
            **objective_metrics(context),  # the objective's (DPO's: TRL's rewards/..., logps/...)
        }

    def _append(self, record: dict[str, Any], context: Any) -> None:
        if self._file is None:
            path = self._path_to_open(context, "path")
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self._file = open(path, "ab", buffering=0)  # noqa: SIM115  # closed in on_train_end
        data = (json.dumps(json_safe(record), allow_nan=False) + "\n").encode()
        view = memoryview(data)
        while view:  # one write for a whole line; loop only on a (rare) partial write
            view = view[self._file.write(view) :]
        self._sync()
