"""Training worker: the in-loop validation pass, reduced across ranks, then ``on_evaluate``.

Runs in each training worker at the boundaries ``eval_every_steps`` names. A collective: every
rank runs it at the same boundary (it all-reduces its sums; under FSDP every forward is one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ray_trainer._worker.dpo import METRICS, metrics_from_sums
from ray_trainer._worker.state import WorkerState
from ray_trainer._worker.step.micro_batches import count_targets


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
    # Pairs are read by their own dataset's collate (a held-out split's indices are its own).
    collate = wl.val_dataset.collate if wl.objective is not None else wl.collate_fn
    loader = DataLoader(
        wl.val_dataset, batch_size=s.args.batch_size, sampler=sampler, collate_fn=collate
    )
    was_training = model.training
    model.eval()
    loss_sum, count = 0.0, 0  # token-weighted, as the training loss: sums over target counts
    pair_sums = torch.zeros(len(METRICS), dtype=torch.float64)  # DPO: the metrics' sums
    # The sampler pads the last ranks by repeating the first samples: those count for nothing.
    real, seen = len(range(s.rank, len(wl.val_dataset), s.world_size)), 0
    pairs = wl.objective is not None
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if s.args.eval_max_batches is not None and i >= s.args.eval_max_batches:
                break
            items = _items(batch, pairs)
            keep, seen = max(0, min(items, real - seen)), seen + items
            if 0 < keep < items:
                batch = _first(batch, keep * (2 if pairs else 1), items * (2 if pairs else 1))
            # On the host, before the copy: labels scored (DPO: pairs, 2 rows each).
            targets = _items(batch, pairs) if pairs else count_targets(batch, wl.shifts_labels)
            batch = {k: v.to(acc.device) for k, v in batch.items()}
            with acc.autocast():  # a batch of repeats only: run (a collective), count nothing
                if pairs:  # the DPO loss of the validation pairs, and TRL's metrics
                    sums, _ = wl.objective.sums(model, batch, targets)
                    if keep:
                        loss_sum += float(sums.loss)
                        pair_sums += sums.metrics.double().cpu()
                else:
                    loss = wl.loss_sum(model, batch, targets)
                    loss_sum += float(loss) if keep else 0.0
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
    vec = torch.cat([torch.tensor([loss_sum, count, *mine], dtype=torch.float64), pair_sums])
    if s.world_size > 1:
        vec = vec.to(acc.device)
        dist.all_reduce(vec)
    values = vec.tolist()
    metrics = {"val_loss": values[0] / max(values[1], 1)}
    metrics.update(zip(names, values[2 : 2 + len(names)], strict=True))
    if wl.objective is not None:  # val_rewards/accuracies, ...: means over the pairs
        sums = values[2 + len(names) :]
        metrics.update({f"val_{k}": v for k, v in metrics_from_sums(sums, values[1]).items()})
    s.ctx.val_metrics = metrics
    s.hooks.fire("on_evaluate", val_metrics=metrics, eval_step=s.progress.global_step)


def _items(batch: dict, pairs: bool) -> int:
    """The samples of a validation batch (DPO: its pairs)."""
    if pairs:
        return len(batch["answer_tokens"]) // 2
    return len(next(iter(batch.values())))


def _first(batch: dict, rows: int, all_rows: int) -> dict:
    """The batch's first `rows` rows: every value with a row per sample (DPO: per sequence)
    is cut, the rest kept as it is."""
    return {
        k: v[:rows] if isinstance(v, torch.Tensor) and v.dim() and len(v) == all_rows else v
        for k, v in batch.items()
    }
