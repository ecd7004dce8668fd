"""Training worker: checkpoints, validation and the end-of-attempt summary.

Runs in each training worker. Every function here is a collective: all ranks call it at the
same boundary (``ray.train.report`` is a barrier; validation all-reduces its sums; the summary
gathers every rank's errors).
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

import ray.train
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ray_trainer import _checkpoint as ckpt
from ray_trainer._contract import WorkerSummary, checkpoint_dir_name
from ray_trainer._lora.config import LORA_STATE, trainable_names
from ray_trainer._models import ModelSpec
from ray_trainer._storage import locate
from ray_trainer._worker.data import count_targets
from ray_trainer._worker.hf_export import export_hf, exports

if TYPE_CHECKING:
    from ray_trainer._worker.setup import WorkerState


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
        part: dict = {}
        extra: list[str] = []
        if s.parallel.sharded:
            extra += _write_shards(s, folder)  # a collective: every rank writes its shards
        elif s.rank == 0:
            part.update(model=model_state(s), optimizer=s.optimizer.state_dict())
        if exports(s):
            extra += export_hf(s, folder)  # under FSDP a collective too
        ckpt.write_rank_part(folder, extra_files=extra, **part, **rank_part(s))
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
        if s.workload.lora_state is not None:  # the base a LoRA checkpoint belongs to
            s.progress.extra[LORA_STATE] = s.workload.lora_state
        part.update(
            scheduler=s.scheduler.state_dict(),
            trainer_state=s.progress,
            model_spec=ModelSpec.of(s.args),
        )
    return part


def _write_shards(s: WorkerState, folder: str) -> list[str]:
    """This rank's DCP shards of model and optimizer in ``<folder>/shards/`` (rank 0 also
    writes the ``.metadata`` of all of them); the files, relative to `folder`."""
    import torch.distributed.checkpoint as dcp

    target = os.path.join(folder, ckpt.SHARDS_DIR)
    state = sharded_state(s)
    # No fsync per file: the folder is a local staging copy that Ray Train uploads next (about
    # half the save time on CPU, bench_memory's probe); a crash before the upload loses it anyway.
    dcp.save(state, storage_writer=dcp.FileSystemWriter(target, sync_files=False))
    return [os.path.join(ckpt.SHARDS_DIR, name) for name in sorted(os.listdir(target))]


def sharded_state(s: WorkerState) -> dict:
    """What DCP saves and loads under FSDP: this rank's shards of the model, each tied weight
    once (under its first name: the others are recorded in the trainer state), and of the
    optimizer (creating its state when it has none yet)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model, optimizer = s.parallel.model, s.optimizer
    aliases = ckpt.tied_aliases(model.named_parameters(remove_duplicate=False))
    s.progress.extra[ckpt.TIED_WEIGHTS] = aliases
    weights = get_model_state_dict(model)
    if lora_run(s):  # the adapters alone: the frozen base is never saved
        weights = trainable(model, weights)
    return {
        "model": {k: v for k, v in weights.items() if k not in aliases},
        "optim": get_optimizer_state_dict(model, optimizer),
    }


def model_state(s: WorkerState) -> dict:
    """DDP: the whole model's state dict, or a LoRA run's adapters alone."""
    module = s.parallel.module()
    state = module.state_dict()
    return trainable(module, state) if lora_run(s) else state


def lora_run(s: WorkerState) -> bool:
    """A LoRA run (a state without args, as the benchmarks build, is not)."""
    return getattr(getattr(s, "args", None), "lora", None) is not None


def trainable(model: torch.nn.Module, state: dict) -> dict:
    """The entries of `state` that training updates (a LoRA run's adapters)."""
    keep = set(trainable_names(model))
    return {k: v for k, v in state.items() if k in keep}


def load_shards(s: WorkerState, shards_dir: str) -> None:
    """Read model and optimizer from DCP shards into this rank's shards (DCP reshards when the
    checkpoint was written by another number of workers). A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, optimizer = s.parallel.model, s.optimizer
    state = sharded_state(s)
    dcp.load(state, storage_reader=dcp.FileSystemReader(shards_dir))
    # A tied weight's other names fill themselves: they are the same parameter.
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(model, optimizer, state["optim"])


def checkpoint_location(s: WorkerState, step: int) -> str:
    """Where the checkpoint of `step` is, as users see it: a local path or a URI."""
    run = locate(s.spec.run_dir, s.args.storage_filesystem)
    return run.child(checkpoint_dir_name(step)).name


def evaluate(s: WorkerState) -> None:
    """Validation pass on this rank's shard, reduced across ranks, then `on_evaluate`."""
    wl, acc = s.workload, s.accelerator
    if wl.val_dataset is None:
        return
    # No DDP hooks (ranks may see different batch counts); under FSDP the sharded model itself,
    # whose every forward is a collective: the sampler pads, so every rank runs as many batches.
    model = s.parallel.module()
    sampler = torch.utils.data.distributed.DistributedSampler(
        wl.val_dataset, num_replicas=s.world_size, rank=s.rank, shuffle=False
    )
    loader = DataLoader(
        wl.val_dataset, batch_size=s.args.batch_size, sampler=sampler, collate_fn=wl.collate_fn
    )
    was_training = model.training
    model.eval()
    loss_sum, count = 0.0, 0  # token-weighted, as the training loss: sums over target counts
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if s.args.eval_max_batches is not None and i >= s.args.eval_max_batches:
                break
            targets = count_targets(batch, wl.shifts_labels)  # on the host, before the copy
            batch = {k: v.to(acc.device) for k, v in batch.items()}
            with acc.autocast():
                loss_sum += float(wl.loss_sum(model, batch, targets))
            count += targets
        # Under FSDP every rank computes them (the model's forward is a collective): rank 0's count.
        computes = wl.rank0_metrics is not None and (s.rank == 0 or s.parallel.sharded)
        extra = wl.rank0_metrics(model) if computes else {}
    model.train(was_training)
    names = sorted(extra) if s.rank == 0 else []
    if s.world_size > 1:
        # Every rank must join; rank 0 tells the others which extra metrics it computed.
        holder = [names]
        dist.broadcast_object_list(holder, src=0)
        names = holder[0]
    mine = [extra.get(n, 0.0) if s.rank == 0 else 0.0 for n in names]
    vec = torch.tensor([loss_sum, count, *mine], dtype=torch.float64)
    if s.world_size > 1:
        vec = vec.to(acc.device)
        dist.all_reduce(vec)
    values = vec.tolist()
    metrics = {"val_loss": values[0] / max(values[1], 1)}
    metrics.update(zip(names, values[2:], strict=True))
    s.ctx.val_metrics = metrics
    s.hooks.fire("on_evaluate", val_metrics=metrics, eval_step=s.progress.global_step)


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
