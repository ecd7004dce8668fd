"""In the callback actor: ranking the run's checkpoints and deleting those not kept.

Runs in the callback actor process. `CheckpointKeeper` is the actor's first callback: it records
each save before any other callback sees it, so an evaluation that ``EvalOnSave`` launches finds
its checkpoint in the ranking however soon it ends. Its `pruner` is the actor's last callback
(after the state writer), so every other callback has handled a save (``EvalOnSave`` has
launched its evaluation) before anything is deleted. The keeper learns:

* the ranking metric's value from ``on_log`` and rank 0's in-loop ``on_evaluate`` (the last
  value at or before each save), and each save from ``on_save``, on the dispatcher thread;
* each evaluation's outcome from the ``EvalTracker`` (``record_evaluation``, on its watcher
  thread), before the tracker stops counting that evaluation as in flight: a checkpoint is
  always either still being evaluated or already scored, never deleted in between.

Only checkpoints that this run's own saves wrote are ever deleted: those it heard of through
``on_save``, and complete folders whose rank-0 manifest names a save of this run
(``Retention.run_id``). Any other complete folder found in the run folder ranks, unscored, but
stays (it was copied there, or written by another run before the lease existed).

The ranking lives in ``RANKING_FILE`` in the run folder, written whole after every change and
before any deletion; a restarted actor, a new driver continuing the run and ``status`` read it.
Ray Train's own ``num_to_keep`` stays unset: it cannot rank by results that arrive after its
``report``.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from ray_trainer._actor.ranking import Ranking, StepHistory, as_score
from ray_trainer._checkpoint import check_complete, manifest_name
from ray_trainer._checkpoint.names import RANKING_FILE, checkpoint_names
from ray_trainer._contract import Retention
from ray_trainer._errors import CheckpointError
from ray_trainer._storage import Location

logger = logging.getLogger("ray_trainer")

#: Context fields a ranking metric may name besides ``batch_metrics`` keys (the logs).
_LOGGED_FIELDS = ("loss", "learning_rate", "grad_norm", "throughput")


class CheckpointKeeper:
    """Ranks the run's checkpoints by `retention.attribute`; its `pruner` deletes what is not
    kept."""

    runs_on = "actor"

    def __init__(self, retention: Retention, run: Location) -> None:
        self.retention = retention
        self.ranking = Ranking(retention.attribute, retention.order, retention.keep)
        self.run = run
        self.tracker: Any = None  # the actor's EvalTracker: which evaluations are in flight
        self._lock = threading.Lock()  # the ranking and its file: dispatcher + watcher threads
        # The metric's logged values and rank 0's in-loop validations, by step, until the saves
        # they belong to arrive (an asynchronous save's on_save comes steps later).
        self._logged = StepHistory()
        self._in_loop = StepHistory()
        self.pruner = CheckpointPruner(self)
        self._load()

    # ---- hooks (the actor's dispatcher thread) ---------------------------------------------

    def on_log(self, context: Any, **kwargs: Any) -> None:
        name = self.retention.attribute
        if name is None:
            return
        value = (context.batch_metrics or {}).get(name)
        if value is None and name in _LOGGED_FIELDS:
            value = getattr(context, name, None)
        if as_score(value) is not None:
            self._logged.record(int(context.global_step), float(value))

    def on_evaluate(self, context: Any, **kwargs: Any) -> None:
        if "source" in kwargs:  # an EvalOnSave result: recorded by record_evaluation already
            return
        metrics = dict(context.val_metrics or {})  # rank 0's in-loop validation
        step = int(kwargs.get("eval_step", context.global_step))
        self._in_loop.record(step, metrics)
        value = metrics.get(self.retention.attribute) if self.retention.attribute else None
        if as_score(value) is not None:
            self._logged.record(step, float(value))

    def on_save(self, context: Any, **kwargs: Any) -> None:
        path = context.checkpoint_path
        if not path:
            return
        step = int(context.global_step)
        logged, metrics = self._logged.at_or_before(step), self._in_loop.at(step)
        self._logged.saved(step)
        self._in_loop.saved(step)
        with self._lock:
            self.ranking.saved(_name(path), step, logged, metrics)
            self._write()

    # ---- from the evaluation tracker (its watcher thread) ----------------------------------

    def record_evaluation(self, checkpoint_path: str, metrics: dict[str, Any] | None) -> None:
        """An evaluation of `checkpoint_path` ended: its metrics, or None when it failed."""
        with self._lock:
            if self.ranking.evaluated(_name(checkpoint_path), metrics):
                self._write()

    # ---- for the actor ---------------------------------------------------------------------

    def best(self) -> tuple[str | None, dict[str, Any]]:
        """The best checkpoint's path and metrics (the ranking metric's value included)."""
        with self._lock:
            entry = self.ranking.best()
            if entry is None:
                return None, {}
            metrics = {**entry.logged, **entry.metrics}
            metrics[self.ranking.attribute] = self.ranking.score(entry)
            return self.run.child(entry.name).name, metrics

    def rows(self) -> list[dict[str, Any]]:
        """The ranking, best first, each row with the checkpoint's path and evaluations."""
        pending = self._pending()
        with self._lock:
            rows = self.ranking.rows(pending)
        for row in rows:
            row["checkpoint_path"] = self.run.child(row["name"]).name
        return rows

    # ---- internals -------------------------------------------------------------------------

    def _pending(self) -> set[str]:
        tracker = self.tracker
        return {_name(p) for p in tracker.pending_paths()} if tracker is not None else set()

    def prune(self) -> None:
        """Delete the checkpoints not kept (only this run's own: `Ranking.to_delete`). The
        ranking file names them as being deleted first, so a crash in between leaves a folder
        that the next start deletes, never a dangling entry."""
        if self.ranking.keep is None:
            return
        pending = self._pending()
        with self._lock:
            gone = self.ranking.to_delete(pending)
            if not gone:
                return
            for entry in gone:
                self.ranking.forget(entry.name)
                self.ranking.deleting.add(entry.name)
            self._write()
        self._delete([entry.name for entry in gone])

    def _delete(self, names: list[str]) -> None:
        """Delete these own checkpoint folders, then drop them from the ranking's list of
        folders being deleted (one that fails stays there: a later start retries)."""
        done = []
        for name in names:
            folder = self.run.child(name)
            try:
                folder.delete()
                done.append(name)
            except OSError as e:
                logger.warning("could not delete %s: %s", folder.name, e)
        with self._lock:
            self.ranking.deleting.difference_update(done)
            self._write()

    def _write(self) -> None:
        """The ranking file, whole (the caller holds the lock)."""
        data = json.dumps(self.ranking.to_dict(), indent=1, default=str)
        try:
            self.run.child(RANKING_FILE).write_text(data)
        except OSError as e:
            logger.warning("could not write %s: %s", self.run.child(RANKING_FILE).name, e)

    def _load(self) -> None:
        """The saved ranking, matched with the checkpoint folders on storage: entries whose
        folder is gone are dropped; complete folders it does not know join it unscored and not
        own (retention never deletes them); own folders whose deletion a crash cut short go."""
        text = self.run.child(RANKING_FILE).read_text()
        if text:
            try:
                self.ranking.load(json.loads(text))
            except (ValueError, KeyError, TypeError) as e:
                logger.warning("ignoring %s: %s", self.run.child(RANKING_FILE).name, e)
        on_storage = set(checkpoint_names(self.run.listdir()))
        for name in list(self.ranking.entries):
            if name not in on_storage:
                self.ranking.forget(name)
        unfinished = sorted(self.ranking.deleting & on_storage)
        self.ranking.deleting &= on_storage
        for name in sorted(on_storage - set(self.ranking.entries) - self.ranking.deleting):
            folder = self.run.child(name)
            if _complete(folder):
                own = written_by(folder, self.retention.run_id)
                self.ranking.saved(name, int(name.rsplit("_", 1)[-1]), own=own)
        if text or self.ranking.entries:
            self._write()
        if unfinished:
            self._delete(unfinished)


class CheckpointPruner:
    """The keeper's deleting half, the actor's last callback: after a save (every other callback
    has seen it), after an evaluation's result, and at the end."""

    runs_on = "actor"

    def __init__(self, keeper: CheckpointKeeper) -> None:
        self.keeper = keeper

    def on_save(self, context: Any, **kwargs: Any) -> None:
        self.keeper.prune()

    def on_evaluate(self, context: Any, **kwargs: Any) -> None:
        self.keeper.prune()

    def on_train_end(self, context: Any, **kwargs: Any) -> None:
        self.keeper.prune()


def _name(path: str) -> str:
    """A checkpoint's folder name, from its path or URI."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def written_by(folder: Location, run_id: str | None) -> bool:
    """True when rank 0's manifest of the checkpoint `folder` names a save of the run `run_id`
    (its save id is ``<run_id>.<launch>.<attempt>``); False when it does not or cannot say."""
    if run_id is None:
        return False
    try:
        save = json.loads(folder.child(manifest_name(0)).read_text() or "{}").get("save")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(save, str) and save.startswith(f"{run_id}.")


def _complete(folder: Location) -> bool:
    try:
        check_complete(folder)
    except (CheckpointError, OSError, ValueError):
        return False
    return True
