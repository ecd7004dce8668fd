"""Training worker: the attempt number of a worker-group start, and the checkpoint it resumes.

Runs in each training worker at the start of every worker-group start (attempt). Rank 0 keeps
the attempt counter of the launch in ``<run_dir>/.ray_trainer/attempts-<launch_id>`` on the
run's storage (only the workers read it; it survives a restart of the worker group and of the
callback actor), and removes the checkpoint folders that saves cut off newer than the one the
attempt resumes from, before any save of the attempt. The model is the run's own, built from
its arguments: a resume reads weights, optimizer, scheduler and rank parts from the checkpoint
(only the files its manifests list, stored as its trainer state says), never how to build it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import ray.train
import torch.distributed as dist

from ray_trainer import _checkpoint as ckpt
from ray_trainer._checkpoint import safe
from ray_trainer._checkpoint.names import CHECKPOINT_PREFIX, checkpoint_names
from ray_trainer._contract import RunSpec
from ray_trainer._storage import Location, locate
from ray_trainer._worker.checkpoints.async_save import publish
from ray_trainer._worker.checkpoints.saving import published_step, sharded_state
from ray_trainer._worker.state import WorkerState

logger = logging.getLogger("ray_trainer")

_META = ".ray_trainer"


def agree_attempt(spec: RunSpec, run: Location, rank: int, world: int) -> int:
    """Rank 0 counts this start of the worker group; every rank learns the count."""
    holder = [_bump_attempt(run, spec.launch_id) if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _bump_attempt(run: Location, launch_id: str) -> int:
    counter = run.child(_META, f"attempts-{launch_id}")
    previous = int(counter.read_text() or -1)
    counter.write_text(str(previous + 1))  # written whole: a reader never sees half a file
    return previous + 1


def maybe_resume(s: WorkerState) -> None:
    """Restore from the run's newest complete checkpoint (after a restart, or when a new call
    continues the run), else from `resume_from`.

    The newest complete checkpoint in storage is preferred to `ray.train.get_checkpoint()`: Ray
    Train registers a reported checkpoint only when its controller next polls (~2 s), so a crash
    right after a save would otherwise restart from an older one (or from scratch).
    """
    reported = ray.train.get_checkpoint()
    location = next(ckpt.complete_checkpoints(s.run), None)
    ours = location is not None  # this run's own newest complete checkpoint
    if location is None and reported is not None:
        location = s.run.child(os.path.basename(reported.path.rstrip("/")))
    if location is None and s.args.resume_from is not None:
        location = locate(s.args.resume_from)  # a checkpoint of another run: its own storage
    if s.rank == 0:  # before any save of this attempt: none may write into their leftovers
        remove_cut_off_saves(s.run, after=-1 if location is None else _step(location.basename))
    if location is None:
        return
    with ckpt.open_checkpoint(location) as checkpoint:
        written_with = checkpoint.state.strategy
        if written_with != s.args.strategy:
            raise ckpt.CheckpointError(
                f"{checkpoint.name} was written with strategy={written_with!r}; continue "
                f"with strategy={written_with!r} (this run has {s.args.strategy!r})"
            )
        part = restore_state(
            checkpoint, s.parallel, s.optimizer, s.scheduler, s.workload.adaptation, s.rank
        )
        p = s.progress = checkpoint.state
    if part["rng"] is not None:
        ckpt.set_rng_state(part["rng"])
    s.hooks.manager.load_state_dict(part["callbacks"])
    s.hooks.manager.user_state.update(part["user_state"])
    s.last_saved_step = p.global_step
    saved = {"global_step": p.global_step, "epoch": p.epoch, "samples_seen": p.samples_seen,
             "tokens_seen": p.tokens_seen, "loss": None}  # fmt: skip
    step_world = s.loader.step_world  # an elastic run's max: its steps are the same at any size
    p.epoch, p.step_in_epoch = position_after(
        p.epoch, p.step_in_epoch, s.steps_per_epoch, p.world_size, step_world
    )
    p.world_size = step_world
    ctx = s.ctx
    ctx.global_step, ctx.epoch = p.global_step, p.epoch
    ctx.samples_seen, ctx.tokens_seen = p.samples_seen, p.tokens_seen
    if s.rank == 0:  # on the console: where this attempt continues from
        print(
            f"[{s.args.run_name}] attempt {ctx.attempt} on {s.world_size} worker(s): resumed "
            f"from {location.name} (step {p.global_step})",
            flush=True,
        )
    if ours and _unpublished(s, p.global_step):
        # Written by every rank, but the group died before the boundary that would have
        # published it (an asynchronous save), or between its report and its `on_save`: it
        # counts from now, as any other, before training goes on from it.
        publish(s, p.global_step, location, saved)
    s.hooks.fire("on_load_checkpoint", checkpoint_path=location.name)


def restore_state(
    checkpoint: ckpt.LocalCheckpoint,
    parallel: Any,
    optimizer: Any,
    scheduler: Any,
    adaptation: Any,
    rank: int,
) -> dict[str, Any]:
    """Every rank: read the verified `checkpoint`'s model and optimizer (its DCP shards, a
    collective, under FSDP: how it was written is its trainer state's word) and scheduler into
    the live objects; this rank's part (RNG, callback state, user_state). What does not fit
    them is a `CheckpointError` naming the checkpoint."""
    if checkpoint.sharded:
        # A collective: every rank reads its shards.
        load_shards(parallel.model, optimizer, adaptation, checkpoint.shards_dir)
    else:  # a LoRA checkpoint holds the adapters alone: the adaptation loads them
        model_state = checkpoint.model_state()  # model.pt, which the manifests list
        with _fitting(checkpoint.name, "model"):
            adaptation.load(parallel.module(), model_state, checkpoint.name)
        optim = checkpoint.optimizer()
        with _fitting(checkpoint.name, "optimizer"):
            optimizer.load_state_dict(optim)
    state = checkpoint.scheduler()
    if state is not None:
        if not isinstance(state, dict) or not set(state) <= set(scheduler.state_dict()):
            raise ckpt.CheckpointError(
                f"{checkpoint.name}/{ckpt.SCHEDULER_FILE}: not this run's scheduler state"
            )
        with _fitting(checkpoint.name, "scheduler"):
            scheduler.load_state_dict(state)
    return checkpoint.rank_part(rank)


@contextlib.contextmanager
def _fitting(name: str, what: str) -> Iterator[None]:
    """A checkpoint's state that the live `what` refuses, as a `CheckpointError` naming it."""
    try:
        yield
    except ckpt.CheckpointError:
        raise
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ckpt.CheckpointError(
            f"{name}: its {what} state does not fit this run's {what} ({first[:300]})"
        ) from None


def remove_cut_off_saves(run: Location, after: int) -> list[str]:
    """Rank 0, at the start of an attempt: delete the checkpoint folders newer than step
    `after` (the one this attempt resumes from) that a save cut off (a manifest missing,
    `ckpt.cut_off`), so that a save of this attempt never writes into what a crashed one left
    (e.g. the shards of a rank that an elastic run no longer has, which readers refuse:
    ``format.check_unlisted``). No save is in flight: the attempt's group has just started."""
    removed = []
    for name in checkpoint_names(run.listdir()):
        if _step(name) > after and ckpt.cut_off(run.child(name)):
            try:
                run.child(name).delete()
            except OSError as e:  # left for the driver's next start
                logger.warning("could not remove %s: %s", run.child(name).name, e)
                continue
            removed.append(name)
    if removed:
        logger.warning("%s: removed what saves cut off left: %s", run.name, ", ".join(removed))
    return removed


def _step(name: str) -> int:
    digits = name[len(CHECKPOINT_PREFIX) :]
    return int(digits) if name.startswith(CHECKPOINT_PREFIX) and digits.isdigit() else -1


def _unpublished(s: WorkerState, step: int) -> bool:
    """Whether the checkpoint of `step` never got its `on_save` (rank 0 reads; all learn)."""
    holder = [published_step(s.run) < step if s.rank == 0 else None]
    if s.world_size > 1:
        dist.broadcast_object_list(holder, src=0)
    return bool(holder[0])


def position_after(
    epoch: int, step_in_epoch: int, steps_per_epoch: int, saved_world: int = 1, world: int = 1
) -> tuple[int, int]:
    """Where a resumed run continues: (epoch, optimizer steps already taken in it).

    Continued by another number of workers, the samples of the epoch already consumed stay
    consumed: the sampler deals the epoch's shuffled order round-robin, so the first k steps of
    W workers took its first k * W micro-batches; the new workers skip as many (rounded down to
    whole steps). A checkpoint saved at the last step of an epoch continues with the next epoch
    (firing `on_epoch_begin` and at once `on_epoch_end` for the finished one would be noise).
    """
    if saved_world != world:
        step_in_epoch = step_in_epoch * saved_world // world
    if step_in_epoch >= steps_per_epoch:
        return epoch + 1, 0
    return epoch, step_in_epoch


def load_shards(model: Any, optimizer: Any, adaptation: Any, shards_dir: str) -> None:
    """Read model and optimizer from DCP shards into this rank's shards (DCP reshards when the
    checkpoint was written by another number of workers). A collective. The shards'
    ``.metadata`` is read by an unpickler that builds DCP's records alone (`safe.dcp_reader`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = sharded_state(model, optimizer, adaptation)
    with safe.shard_errors(shards_dir):  # all ranks raise it: DCP scatters a rank's failure
        dcp.load(state, storage_reader=safe.dcp_reader(shards_dir, shards_dir))
    # A tied weight's other names fill themselves: they are the same parameter.
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(model, optimizer, state["optim"])
