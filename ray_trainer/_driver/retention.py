"""Driver: the checkpoint retention the callback actor runs.

Runs in the driver, before the workers start. The callback actor ranks and deletes checkpoints
(``_actor/retention.py``): Ray Train is given no ``num_to_keep``, so it keeps every checkpoint
it is handed and never deletes one the actor still ranks or evaluates. Its own list of them
(``RAY_CHECKPOINT_LIST``) is removed before a launch: the run resumes from its newest complete
checkpoint on storage, and Ray Train refuses to start from a list that names a deleted one.
(``ray-trainer status`` shows the actor's ranking: ``_client/status.py``.)
"""

from __future__ import annotations

from ray_trainer._checkpoint.names import RAY_CHECKPOINT_LIST
from ray_trainer._config.args import TrainingArgs
from ray_trainer._contract import Retention
from ray_trainer._storage import Location


def retention_of(args: TrainingArgs) -> Retention | None:
    """What the actor keeps; None when it keeps everything and ranks nothing."""
    if args.num_checkpoints_to_keep is None and args.checkpoint_score_attribute is None:
        return None
    return Retention(
        keep=args.num_checkpoints_to_keep,
        attribute=args.checkpoint_score_attribute,
        order=args.checkpoint_score_order,
    )


def forget_ray_checkpoint_list(run: Location) -> None:
    """Remove Ray Train's list of the run's checkpoints from an earlier launch, if any."""
    run.child(RAY_CHECKPOINT_LIST).delete()
