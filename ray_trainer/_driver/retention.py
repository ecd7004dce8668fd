"""Driver (and the terminal's ``status``): the checkpoint retention the callback actor runs.

Runs in the driver, before the workers start. The callback actor ranks and deletes checkpoints
(``_actor/retention.py``): Ray Train is given no ``num_to_keep``, so it keeps every checkpoint
it is handed and never deletes one the actor still ranks or evaluates. Its own list of them
(``RAY_CHECKPOINT_LIST``) is removed before a launch: the run resumes from its newest complete
checkpoint on storage, and Ray Train refuses to start from a list that names a deleted one.
``format_checkpoints`` turns the actor's ranking into ``ray-trainer status`` lines.
"""

from __future__ import annotations

from typing import Any

from ray_trainer._checkpoint.names import RAY_CHECKPOINT_LIST
from ray_trainer._config import TrainingArgs
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


def format_checkpoints(status: dict[str, Any]) -> list[str]:
    """The best checkpoint and each checkpoint's evaluations (best first when ranked)."""
    rows, ranked_by = status.get("checkpoints") or [], status.get("ranked_by")
    lines = []
    if ranked_by:
        best = status.get("best_checkpoint")
        value = (status.get("best_metrics") or {}).get(ranked_by)
        shown = f"{best} ({ranked_by} {_metric(value)})" if best else "none scored yet"
        lines.append(f"  best        {shown}")
    if rows:
        order = f", best first by {ranked_by} ({status.get('order')})" if ranked_by else ""
        lines.append(f"  checkpoints {status.get('num_checkpoints', len(rows))}{order}")
    for row in rows:
        name = str(row.get("name") or row.get("checkpoint_path", "")).rsplit("/", 1)[-1]
        metrics = ", ".join(f"{k} {_metric(v)}" for k, v in sorted(row["metrics"].items()))
        state = " (evaluating)" if row.get("evaluating") else ""
        state += f" ({row['failures']} failed)" if row.get("failures") else ""
        lines.append(f"    {name}  step {row.get('step')}{state}: {metrics or '-'}")
    return lines


def _metric(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
