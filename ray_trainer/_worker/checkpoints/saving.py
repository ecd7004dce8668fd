"""Training worker: saving a checkpoint, and the assembly that the asynchronous save shares.

Runs in each training worker. `save` is a collective: all ranks call it at the same boundary
(``ray.train.report`` is a barrier; under FSDP every rank writes its own shards). A checkpoint
is assembled the same way whether it is written now or in the background (``async_save.py``):
`state_to_save` says what this rank saves of model and optimizer (live tensors, which the
asynchronous save stages into copies first), `write_state` writes it, the export writes its
weights, and `rank_part` is this rank's small part (callbacks, RNG, trainer state).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import ray.train
import torch

from ray_trainer import _checkpoint as ckpt
from ray_trainer._checkpoint.names import checkpoint_dir_name
from ray_trainer._lora.config import LORA_STATE
from ray_trainer._model.spec import ModelSpec
from ray_trainer._worker.state import WorkerState


def save(s: WorkerState, final: bool = False) -> None:
    """Write a checkpoint through `ray.train.report` (a barrier across ranks), then `on_save`;
    with ``async_checkpoint``, stage it and write it in the background (`async_save.py`;
    `final`: the run's last save, which waits for its write).

    Under DDP rank 0 writes the whole model and optimizer; under FSDP every rank writes its own
    shards with torch.distributed.checkpoint, in parallel, and nothing whole is gathered for the
    resumable state. The ``hf/`` export of a Hugging Face model is in place before `on_save`
    fires, so an evaluation task launched from it can load it.
    """
    if s.saves is not None:
        s.saves.save(s, final)
        return
    p = s.progress
    with tempfile.TemporaryDirectory(prefix="ray_trainer_ckpt_") as folder:
        # Under FSDP both are collectives: every rank writes its shards, then joins the export.
        files = write_state(folder, state_to_save(s), s.rank, s.parallel.sharded)
        if s.export is not None:
            files += s.export.write(folder, s.rank)
        ckpt.write_rank_part(folder, extra_files=files, **rank_part(s))
        metrics = {"global_step": p.global_step, "epoch": p.epoch, "loss": s.ctx.loss}
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(folder),
            checkpoint_dir_name=checkpoint_dir_name(p.global_step),
        )
    s.last_saved_step = p.global_step
    path = checkpoint_location(s, p.global_step)
    s.ctx.checkpoint_path = path
    s.hooks.fire("on_save", checkpoint_path=path)
    mark_published(s, p.global_step)


def state_to_save(s: WorkerState) -> dict[str, Any] | None:
    """What this rank saves of model and optimizer, live: under FSDP its shards (recording the
    tied weights in the trainer state), under DDP the whole on rank 0 (None elsewhere)."""
    model = s.parallel.model
    if s.parallel.sharded:
        named = model.named_parameters(remove_duplicate=False)
        s.progress.extra[ckpt.TIED_WEIGHTS] = ckpt.tied_aliases(named)
        return sharded_state(model, s.optimizer, s.workload.adaptation)
    if s.rank != 0:
        return None
    module = s.parallel.module()
    weights = s.workload.adaptation.trainable(module, module.state_dict())
    return {"model": weights, "optim": s.optimizer.state_dict()}


def sharded_state(model: torch.nn.Module, optimizer: Any, adaptation: Any) -> dict[str, Any]:
    """What DCP saves and loads under FSDP: this rank's shards of the model, each tied weight
    once (under its first name), of what training updates (`adaptation`: a LoRA run's adapters
    alone, the frozen base is never saved), and of the optimizer (creating its state when it
    has none yet)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    aliases = ckpt.tied_aliases(model.named_parameters(remove_duplicate=False))
    weights = adaptation.trainable(model, get_model_state_dict(model))
    return {
        "model": {k: v for k, v in weights.items() if k not in aliases},
        "optim": get_optimizer_state_dict(model, optimizer),
    }


def write_state(
    folder: str, state: dict[str, Any] | None, rank: int, sharded: bool, group: Any = None
) -> list[str]:
    """Write `state` (`state_to_save`'s, live or staged) into `folder`: under FSDP this rank's
    DCP shards in ``shards/`` (rank 0 also the ``.metadata``; a collective on `group`, default
    the training group), under DDP ``model.pt`` and ``optimizer.pt``. The files this rank
    wrote, relative to `folder` (ranks that share a folder write different files)."""
    if state is None:
        return []
    if not sharded:
        for name, key in ((ckpt.MODEL_FILE, "model"), (ckpt.OPTIMIZER_FILE, "optim")):
            torch.save(state[key], os.path.join(folder, name))
        return [ckpt.MODEL_FILE, ckpt.OPTIMIZER_FILE]
    import torch.distributed.checkpoint as dcp

    target = os.path.join(folder, ckpt.SHARDS_DIR)
    # No fsync per file: the folder is a local staging copy that Ray Train (or the background
    # save) uploads next (about half the save time on CPU); a crash before the upload loses it.
    writer = dcp.FileSystemWriter(target, sync_files=False)
    dcp.save(state, storage_writer=writer, process_group=group)
    mine = [
        n
        for n in os.listdir(target)
        if n.startswith(f"__{rank}_") or (rank == 0 and n == ".metadata")
    ]
    return [os.path.join(ckpt.SHARDS_DIR, n) for n in sorted(mine)]


def rank_part(s: WorkerState) -> dict:
    """This rank's small part of a checkpoint (`write_rank_part`'s arguments): its callbacks'
    state, and on rank 0 the trainer state, the scheduler and how to build the model."""
    manager = s.hooks.manager
    part = {
        "rank": s.rank,
        "world_size": s.world_size,
        "callback_state": manager.state_dict(),
        "user_state": dict(manager.user_state),
        "save_id": f"{s.spec.launch_id}.{s.ctx.attempt}",  # this attempt's save of the step
    }
    if s.rank == 0:
        s.progress.strategy = s.args.strategy
        record = s.workload.adaptation.record
        if record is not None:  # the base a LoRA checkpoint belongs to
            s.progress.extra[LORA_STATE] = record
        s.progress.extra["objective"] = s.args.objective
        part.update(
            scheduler=s.scheduler.state_dict(),
            trainer_state=s.progress,
            model_spec=ModelSpec.of(s.args).record(),
        )
    return part


def checkpoint_location(s: WorkerState, step: int) -> str:
    """Where the checkpoint of `step` is, as users see it: a local path or a URI."""
    return s.run.child(checkpoint_dir_name(step)).name


#: ``<run>/.ray_trainer/published``: the step of the newest checkpoint whose `on_save` has fired
#: (rank 0 writes it after each). A complete checkpoint newer than it was written but never
#: published (the group died between its write and its publication): a resume publishes it.
_PUBLISHED = (".ray_trainer", "published")


def mark_published(s: WorkerState, step: int) -> None:
    """Rank 0, after a checkpoint's `on_save`: record its step as the newest published."""
    if s.rank == 0:
        s.run.child(*_PUBLISHED).write_text(str(step))  # written whole


def published_step(run: Any) -> int:
    """The step of the run's newest published checkpoint (-1: none yet)."""
    text = run.child(*_PUBLISHED).read_text()
    return int(text) if text else -1
