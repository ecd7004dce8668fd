"""Training worker: the in-loop validation pass, reduced across ranks, then ``on_evaluate``.

Runs in each training worker at the boundaries ``eval_every_steps`` names. A collective: every
rank runs it at the same boundary (it all-reduces its sums; under FSDP every forward is one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

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
    objective = wl.objective  # its validation step: the loss it trains with, its metrics
    loader = DataLoader(
        wl.val_dataset,
        batch_size=s.args.batch_size,
        sampler=sampler,
        collate_fn=objective.val_collate(wl),
    )
    was_training = model.training
    model.eval()
    loss_sum, count = 0.0, 0  # weighted as the training loss: sums over target counts
    own_sums = torch.zeros(len(objective.description.metrics), dtype=torch.float64)
    # The sampler pads the last ranks by repeating the first samples: those count for nothing.
    real, seen = len(range(s.rank, len(wl.val_dataset), s.world_size)), 0
    rows = objective.rows_per_item  # a batch's rows per item (DPO: 2 per pair)
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if s.args.eval_max_batches is not None and i >= s.args.eval_max_batches:
                break
            items = objective.val_items(batch)
            keep, seen = max(0, min(items, real - seen)), seen + items
            if 0 < keep < items:
                batch = _first(batch, keep * rows, items * rows)
            # On the host, before the copy: what the loss sums over (labels scored; DPO: pairs).
            targets = objective.val_targets(wl, batch)
            batch = {k: v.to(acc.device) for k, v in batch.items()}
            with acc.autocast():  # a batch of repeats only: run (a collective), count nothing
                loss, sums = objective.val_sums(wl, model, batch, targets)
            if keep:
                loss_sum += float(loss)
                if sums is not None:
                    own_sums += sums.double().cpu()
            count += targets if keep else 0
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
    vec = torch.cat([torch.tensor([loss_sum, count, *mine], dtype=torch.float64), own_sums])
    if s.world_size > 1:
        vec = vec.to(acc.device)
        dist.all_reduce(vec)
    values = vec.tolist()
    metrics = {"val_loss": values[0] / max(values[1], 1)}
    metrics.update(zip(names, values[2 : 2 + len(names)], strict=True))
    # The objective's metrics (DPO's val_rewards/accuracies, ...: means over the pairs).
    own = objective.metrics_from_sums(values[2 + len(names) :], values[1])
    metrics.update({f"val_{k}": v for k, v in own.items()})
    s.ctx.val_metrics = metrics
    s.hooks.fire("on_evaluate", val_metrics=metrics, eval_step=s.progress.global_step)


def _first(batch: dict, rows: int, all_rows: int) -> dict:
    """The batch's first `rows` rows: every value with one row per row of the batch (DPO: per
    sequence) is cut, the rest kept as it is."""
    return {
        k: v[:rows] if isinstance(v, torch.Tensor) and v.dim() and len(v) == all_rows else v
        for k, v in batch.items()
    }
