"""Driver: the checkpoint retention the callback actor runs, and what a start cleans up.

Runs in the driver, before the workers start. The callback actor ranks and deletes checkpoints
(``_actor/retention.py``): Ray Train is given no ``num_to_keep``, so it keeps every checkpoint
it is handed and never deletes one the actor still ranks or evaluates. Its own list of them
(``RAY_CHECKPOINT_LIST``) is removed before a launch: the run resumes from its newest complete
checkpoint on storage, and Ray Train refuses to start from a list that names a deleted one.
(``ray-trainer status`` shows the actor's ranking: ``_client/status.py``.)

The actor deletes only checkpoints this run's saves wrote: each save id starts with the run's id
(`record_run`, kept in ``run.json`` across resumes of the run). Once the run holds its folder's
lease (``lease.py``), `remove_crashed_saves` deletes what saves that crashed left behind.
"""

from __future__ import annotations

import logging
import re
import secrets

from ray_trainer._checkpoint import cut_off
from ray_trainer._checkpoint.names import RAY_CHECKPOINT_LIST, checkpoint_names
from ray_trainer._config.args import TrainingArgs
from ray_trainer._contract import Retention
from ray_trainer._driver.checks.inputs import read_run_record, write_run_record
from ray_trainer._driver.run_fingerprint import fingerprint
from ray_trainer._storage import Location

logger = logging.getLogger("ray_trainer")

#: What `Location.write_bytes` and the lease leave beside a file when their writer dies
#: between the write and the rename: ``<name>.tmp<pid>-<thread>`` and ``lease.json.<hex>``.
_TEMP_FILE = re.compile(r".+\.tmp\d+-\d+|lease\.json\.[0-9a-f]{12}")


def retention_of(args: TrainingArgs, run_id: str | None = None) -> Retention | None:
    """What the actor keeps; None when it keeps everything and ranks nothing. `run_id`: whose
    saves it may delete (`record_run`)."""
    if args.num_checkpoints_to_keep is None and args.checkpoint_score_attribute is None:
        return None
    return Retention(
        keep=args.num_checkpoints_to_keep,
        attribute=args.checkpoint_score_attribute,
        order=args.checkpoint_score_order,
        run_id=run_id,
    )


def record_run(run: Location, args: TrainingArgs) -> str:
    """Write ``run.json`` (what the run trains, its name and its id) and return the run's id:
    the id already there when the folder holds this same run (a resume), else a new one."""
    previous = read_run_record(run) or {}
    trains = fingerprint(args)
    run_id = previous.get("run_id") if previous.get("fingerprint") == trains else None
    run_id = run_id or secrets.token_hex(6)
    write_run_record(run, {"fingerprint": trains, "run_name": args.run_name, "run_id": run_id})
    return run_id


def forget_ray_checkpoint_list(run: Location) -> None:
    """Remove Ray Train's list of the run's checkpoints from an earlier launch, if any."""
    run.child(RAY_CHECKPOINT_LIST).delete()


def remove_crashed_saves(run: Location) -> list[str]:
    """Delete what saves that crashed left in the run folder: checkpoint folders where a rank's
    manifest is missing (a save cut off while writing; never a complete checkpoint, nor one
    whose manifests cannot be read) and writers' temporary files. The names deleted.

    Runs in the driver once it holds the run folder's lease (no other run writes there) and
    before any worker starts (no save of this run is in flight)."""
    removed = []
    names = run.listdir()
    for name in checkpoint_names(names):
        if cut_off(run.child(name)):
            removed.append(name)
    removed += [name for name in names if _TEMP_FILE.fullmatch(name)]
    for name in removed:
        try:
            run.child(name).delete()
        except OSError as e:  # the next start tries again
            logger.warning("could not remove %s: %s", run.child(name).name, e)
    if removed:
        logger.warning("%s: removed what crashed saves left: %s", run.name, ", ".join(removed))
    return removed
