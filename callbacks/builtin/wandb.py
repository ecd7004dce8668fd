"""Runs on the callback actor: ``WandbLogger``, the run's parameters, metrics and end in W&B."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from callbacks.builtin.generation.samples import local_samples, samples_of
from callbacks.builtin.tracker import TrackerLogger, flat_params, stable_id

__all__ = ["WandbLogger"]

#: Our own step metric: W&B drops a point whose ``step=`` is lower than its last one (a late
#: evaluation, steps logged again after a crash), so every point carries this instead.
STEP_METRIC = "trainer/global_step"
_MODES = (None, "online", "offline", "disabled")
#: The most rows of a samples file that go into its ``wandb.Table``.
MAX_TABLE_ROWS = 10_000
_SAMPLE_COLUMNS = ("row", "prompt", "answer", "reference", "finish_reason", "answer_tokens")


class WandbLogger(TrackerLogger):
    """Log the run to Weights & Biases.

    Runs on the callback actor (``runs_on="actor"``); every W&B call (``wandb.init`` included)
    is made by a background thread with a bounded queue (see ``TrackerLogger``), so W&B being
    unreachable costs logged errors, never a stalled actor. It logs:

    * the run's ``TrainingArgs`` as the W&B config (a continued run updates changed values);
    * each log's metrics as ``train/<name>`` and each evaluation's as ``eval/<name>``, all
      plotted against ``trainer/global_step`` (``define_metric``): W&B's own step only grows,
      so a late evaluation result or a step logged again after a restart would be dropped;
    * an evaluation's samples file (``GenerationEval``'s ``<name>/samples``) as a
      ``wandb.Table`` ``eval/<name>/samples`` (its first ``MAX_TABLE_ROWS`` rows: prompt,
      answer, reference, finish reason, answer tokens, then one column per score);
    * the end: exit code 0 (summary ``stopped_early``/``stop_reason`` when a callback stopped
      it) or 1 when training failed (summary ``error``);
    * with ``log_best_model``, the best checkpoint's ``hf/`` export (by
      ``checkpoint_score_attribute``; else the newest checkpoint) as a ``model`` artifact.

    A resumed or continued run (same ``run_name``) continues the same W&B run: its id is in this
    callback's state, else derived from ``<storage_path>/<run_name>``. The run's files go to
    ``dir``, by default the run folder (``<storage_path>/<run_name>/wandb``; on a bucket a local
    copy uploaded at the end), where ``wandb sync`` finds an offline run.

    Args:
        project: the W&B project.
        mode: ``"online"``, ``"offline"`` or ``"disabled"``; default ``WANDB_MODE`` where the
            actor runs, else online.
        entity: the W&B team or user (default: the API key's).
        run_name: the W&B run's display name; default the run's ``run_name``.
        dir: a local folder for W&B's files on the head node.
        log_best_model: upload the best checkpoint's ``hf/`` at the end.
        max_queue, flush_timeout_s: as for ``MLflowLogger``.

    Example:
        >>> run_training(callbacks=[WandbLogger(project="fine-tuning", mode="offline")])
    """

    def __init__(
        self,
        project: str,
        mode: str | None = None,
        entity: str | None = None,
        run_name: str | None = None,
        dir: str | os.PathLike[str] | None = None,
        log_best_model: bool = False,
        max_queue: int = 10_000,
        flush_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(run_name, log_best_model, max_queue, flush_timeout_s)
        if not project:
            raise ValueError("WandbLogger: project must be a non-empty string")
        if mode not in _MODES:
            raise ValueError(f"WandbLogger: mode must be one of {_MODES}, got {mode!r}")
        self.project = project
        self.mode = mode
        self.entity = entity
        self.dir = os.fspath(dir) if dir is not None else None
        self._run: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_run"] = None
        return state

    @property
    def files_dir(self) -> str | None:
        """Where W&B writes this run's files (known once the run is open)."""
        return getattr(getattr(self._run, "settings", None), "sync_dir", None)

    def on_train_end(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor once at the end: finishes the W&B run, then puts its
        files on the run's storage."""
        try:
            super().on_train_end(context, **kwargs)
        finally:
            if self._storage is not None and self.dir is None:
                self._storage.sync("wandb")

    def on_evaluate(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor with each evaluation: queues ``eval/*`` at its step,
        and its samples files as tables."""
        super().on_evaluate(context, **kwargs)
        step = int(kwargs.get("eval_step", context.global_step) or 0)
        for name, path in samples_of(context.val_metrics).items():
            put = functools.partial(self._log_samples, name, path, step)
            self._start(context).put(("call", put))

    # ---- the sender thread -----------------------------------------------------------------

    def _log_samples(self, name: str, path: str, step: int) -> None:
        import wandb

        with local_samples(path, self._storage) as local, open(local, encoding="utf-8") as f:
            samples = [json.loads(line) for line, _ in zip(f, range(MAX_TABLE_ROWS), strict=False)]
        scores = sorted({k for s in samples for k in s.get("scores") or {}})
        table = wandb.Table(columns=[*_SAMPLE_COLUMNS, *scores])
        for s in samples:
            cells = [_cell(s.get(c)) for c in _SAMPLE_COLUMNS]
            table.add_data(*cells, *[(s.get("scores") or {}).get(k) for k in scores])
        self._run.log({f"eval/{name}/samples": table, STEP_METRIC: step})

    def _open(self, args: dict[str, Any], run_name: str, identity: str | None) -> None:
        import wandb

        if self.run_id is None:
            self.run_id = stable_id(identity) if identity else wandb.util.generate_id()
        folder = self.dir
        if folder is None and self._storage is not None:  # W&B adds the "wandb" folder itself
            folder = os.path.dirname(self._storage.local_path("wandb"))
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
        self._run = wandb.init(
            project=self.project,
            entity=self.entity,
            id=self.run_id,
            name=run_name,
            resume="allow",
            mode=self.mode,
            dir=folder,
            config=flat_params(args),
            allow_val_change=True,
            reinit="create_new",
            settings=wandb.Settings(console="off", quiet=True),
        )
        self._run.define_metric(STEP_METRIC)
        self._run.define_metric("*", step_metric=STEP_METRIC)

    def _send(self, points: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in points:
            self._run.log({**values, STEP_METRIC: step})

    def _finish(self, outcome: dict[str, Any]) -> None:
        summary = {"global_step": outcome["global_step"]}
        if outcome["stopped_early"]:
            summary.update(stopped_early=True, stop_reason=str(outcome["stop_reason"]))
        if outcome["error"]:
            summary["error"] = str(outcome["error"])
        self._run.summary.update(summary)
        self._run.finish(exit_code=1 if outcome["status"] == "failed" else 0)
        _flush_files()

    def _upload(self, local_dir: str, checkpoint: str, metrics: dict[str, Any]) -> None:
        import wandb

        plain = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}
        artifact = wandb.Artifact(
            f"{self._run.name or self.run_id}-best",
            type="model",
            metadata={"checkpoint": checkpoint, **plain},
        )
        artifact.add_dir(local_dir)
        self._run.log_artifact(artifact, aliases=["best"])


def _cell(value: Any) -> Any:
    """A table cell: text as is, chat messages and lists of references as JSON text."""
    return value if value is None or isinstance(value, (str, int, float)) else json.dumps(value)


def _flush_files() -> None:
    """W&B's service writes a finished run's files out whole only when it stops: stop it when
    no other W&B run of this process is active (a later run starts a new one)."""
    import contextlib

    import wandb
    from wandb.sdk import wandb_setup

    if wandb_setup.singleton().most_recent_active_run is None:
        # W&B exits when its service failed: never end the actor for that.
        with contextlib.suppress(SystemExit):
            wandb.teardown()
