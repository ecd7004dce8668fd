"""Training worker: the end-of-attempt summary, every rank's errors gathered on rank 0.

Runs in each training worker when an attempt ends. A collective: every rank gathers its errors
and stop reason to rank 0, which hands the summary to the callback actor.
"""

from __future__ import annotations

import torch.distributed as dist

from ray_trainer._contract import WorkerSummary
from ray_trainer._worker.checkpoints.saving import checkpoint_location
from ray_trainer._worker.state import WorkerState


def gather_summary(s: WorkerState) -> WorkerSummary | None:
    """Every rank's errors and stop reason, gathered on rank 0 into the attempt's summary
    (None on the other ranks)."""
    mgr = s.hooks.manager
    local = {
        "errors": [{k: v for k, v in vars(e).items() if k != "traceback"} for e in mgr.errors],
        "stop_reason": s.stop_reason,
    }
    gathered = [local]
    if s.world_size > 1:
        gathered = [None] * s.world_size
        dist.all_gather_object(gathered, local)
    if s.rank != 0:
        return None
    p, fwd = s.progress, s.hooks.forwarder
    return WorkerSummary(
        attempt=s.ctx.attempt,
        global_step=p.global_step,
        epoch=p.epoch,
        samples_seen=p.samples_seen,
        tokens_seen=p.tokens_seen,
        loss=s.ctx.loss,
        val_metrics=dict(s.ctx.val_metrics or {}),
        checkpoint_path=checkpoint_location(s, s.last_saved_step)
        if s.last_saved_step > 0
        else None,
        stopped_early=p.global_step < s.total_steps,
        stop_reason=next((g["stop_reason"] for g in gathered if g["stop_reason"]), None),
        callback_errors=[e for g in gathered for e in g["errors"]],
        undelivered_events=fwd.undelivered if fwd is not None else 0,
        dropped_events=dict(fwd.dropped) if fwd is not None else {},
    )
