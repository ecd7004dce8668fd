"""Training worker: the in-loop validation pass, reduced across ranks, then ``on_evaluate``.

Runs in each training worker at the boundaries ``eval_every_steps`` names. A collective: every
rank runs it at the same boundary (it all-reduces its sums; under FSDP every forward is one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ray_trainer._worker.loader import count_targets
from ray_trainer._worker.state import WorkerState


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
