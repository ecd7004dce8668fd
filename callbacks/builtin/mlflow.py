"""Runs on the callback actor: ``MLflowLogger``, a run's params, metrics and end in MLflow."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from callbacks.builtin.generation.samples import local_samples, samples_of
from callbacks.builtin.tracker import TrackerLogger, flat_params

__all__ = ["MLflowLogger"]

#: MLflow's limits per ``log_batch`` call.
_MAX_METRICS, _MAX_PARAMS = 1000, 100
#: The tag naming the ray-trainer run a tracker run belongs to (to find it again).
RUN_TAG = "ray_trainer.run"
_STATUS = {"finished": "FINISHED", "failed": "FAILED"}


class MLflowLogger(TrackerLogger):
    """Log the run to an MLflow tracking server.

    Runs on the callback actor (``runs_on="actor"``): the training workers pay nothing, and
    every call to MLflow is made by a background thread with a bounded queue (see
    ``TrackerLogger``), so a server that is down or slow costs logged errors, never a stalled
    actor. It logs:

    * the run's ``TrainingArgs`` as parameters (at the first event);
    * each log's metrics as ``train/<name>`` at its global step, and each evaluation's
      (``EvalOnSave`` or in-loop) as ``eval/<name>`` at its checkpoint's step;
    * an evaluation's samples file (``GenerationEval``'s ``<name>/samples``) as the artifact
      ``samples/step_<step>/<name>.jsonl``;
    * the end: status ``FINISHED`` (with tags ``ray_trainer.stopped_early`` and
      ``ray_trainer.stop_reason`` when a callback stopped it) or ``FAILED`` (tag
      ``ray_trainer.error``);
    * with ``log_best_model``, the best checkpoint's ``hf/`` export (by
      ``checkpoint_score_attribute``; else the newest checkpoint) as the artifact ``best_model``.

    A resumed or continued run (same ``run_name``) continues the same MLflow run: its id is in
    this callback's state (saved in every checkpoint), and a run tagged ``ray_trainer.run`` with
    the run's ``<storage_path>/<run_name>`` is found otherwise. MLflow parameters cannot change:
    a continued run whose ``TrainingArgs`` changed keeps the first values and records each new
    one as a tag ``ray_trainer.changed.<field>``.

    Args:
        tracking_uri: the tracking server (``http://host:5000``, ``databricks``, ...); default
            ``MLFLOW_TRACKING_URI`` as set where the driver runs. It must be reachable from the
            head node, where the callback actor runs.
        experiment_name: created if it does not exist.
        run_name: the MLflow run's name; default the run's ``run_name``.
        log_best_model: upload the best checkpoint's ``hf/`` at the end (needs a Hugging Face
            model; a large model needs a larger ``flush_timeout_s`` and
            ``TrainingArgs.callback_timeout_s``).
        max_queue: queued items beyond this are dropped (counted, reported at the end).
        flush_timeout_s: how long the end waits for the queue to drain.

    Example:
        >>> run_training(callbacks=[MLflowLogger("http://mlflow:5000", "fine-tuning")])
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment_name: str = "ray-trainer",
        run_name: str | None = None,
        log_best_model: bool = False,
        max_queue: int = 10_000,
        flush_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(run_name, log_best_model, max_queue, flush_timeout_s)
        tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not tracking_uri:
            raise ValueError(
                "MLflowLogger needs tracking_uri (or MLFLOW_TRACKING_URI), a server the head "
                "node can reach, e.g. MLflowLogger('http://mlflow-host:5000')"
            )
        if not experiment_name:
            raise ValueError("MLflowLogger: experiment_name must be a non-empty string")
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self._client: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_client"] = None
        return state

    def on_evaluate(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor with each evaluation: queues ``eval/*`` at its step,
        and its samples files as artifacts."""
        super().on_evaluate(context, **kwargs)
        step = int(kwargs.get("eval_step", context.global_step) or 0)
        for path in samples_of(context.val_metrics).values():
            self._start(context).put(("call", functools.partial(self._log_samples, path, step)))

    # ---- the sender thread -----------------------------------------------------------------

    def _log_samples(self, path: str, step: int) -> None:
        with local_samples(path, self._storage) as local:
            self._client.log_artifact(self.run_id, local, artifact_path=f"samples/step_{step:08d}")

    def _open(self, args: dict[str, Any], run_name: str, identity: str | None) -> None:
        from mlflow import MlflowClient

        client = self._client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = client.get_experiment_by_name(self.experiment_name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else client.create_experiment(self.experiment_name)
        )
        run = self._find(client, experiment_id, identity)
        if run is None:
            tags = {RUN_TAG: identity} if identity else {}
            run = client.create_run(experiment_id, run_name=run_name, tags=tags)
        elif run.info.status != "RUNNING":
            client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        self._log_params(client, run, flat_params(args))

    def _find(self, client: Any, experiment_id: str, identity: str | None) -> Any:
        """The MLflow run to continue: the one in the state, else the newest tagged with this
        ray-trainer run; None for a new run."""
        if self.run_id:
            try:
                return client.get_run(self.run_id)
            except Exception:  # deleted on the server: look by tag, or start a new one
                pass
        if not identity:
            return None
        escaped = identity.replace("'", "\\'")
        found = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{RUN_TAG}` = '{escaped}'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        return found[0] if found else None

    def _log_params(self, client: Any, run: Any, params: dict[str, str]) -> None:
        """New parameters as parameters; changed ones as ``ray_trainer.changed.<key>`` tags."""
        from mlflow.entities import Param, RunTag

        logged = dict(run.data.params)
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        changed = [
            RunTag(f"ray_trainer.changed.{k}", v)
            for k, v in params.items()
            if k in logged and logged[k] != v
        ]
        for i in range(0, len(new), _MAX_PARAMS):
            client.log_batch(run.info.run_id, params=new[i : i + _MAX_PARAMS])
        if changed:
            client.log_batch(run.info.run_id, tags=changed)

    def _send(self, points: list[tuple[int, dict[str, float]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for step, values in points for k, v in values.items()]
        for i in range(0, len(metrics), _MAX_METRICS):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + _MAX_METRICS])

    def _finish(self, outcome: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        tags = [RunTag("ray_trainer.global_step", str(outcome["global_step"]))]
        if outcome["stopped_early"]:
            tags.append(RunTag("ray_trainer.stopped_early", "true"))
            tags.append(RunTag("ray_trainer.stop_reason", str(outcome["stop_reason"])))
        if outcome["error"]:
            tags.append(RunTag("ray_trainer.error", str(outcome["error"])[:5000]))
        self._client.log_batch(self.run_id, tags=tags)
        self._client.set_terminated(self.run_id, status=_STATUS[outcome["status"]])

    def _upload(self, local_dir: str, checkpoint: str, metrics: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        self._client.log_artifacts(self.run_id, local_dir, artifact_path="best_model")
        self._client.log_batch(
            self.run_id, tags=[RunTag("ray_trainer.best_checkpoint", checkpoint)]
        )
