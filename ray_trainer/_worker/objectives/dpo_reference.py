"""Training worker: DPO's reference log-probs computed by the worker group itself, before training.

Runs in each training worker at setup, when the driver left a reference folder to fill: a
sharded model (``strategy="fsdp"``) fits no single task, so the workers run it forward only,
sharded, while their GPUs are still free and the model is still the reference (setup runs
before a checkpoint is loaded). Every rank scores every ``world``-th sequence of the cache (the
same number of forwards on every rank: under FSDP each is a collective), the ranks gather the
values, and rank 0 writes them and the folder's meta; every rank keeps the whole array.
Also here: the frozen copy an in-step reference uses without LoRA.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ray_trainer._reference import sequence_logps, write_meta, write_piece
from ray_trainer._storage import locate
from ray_trainer._worker.objectives.dpo_pairs import PairDataset

logger = logging.getLogger("ray_trainer")


def fill_references(s: Any, references: dict[str, str]) -> None:
    """Give every pair dataset of the workload without reference log-probs its values,
    computed here (all ranks) and written to its folder in `references` (rank 0)."""
    wl = s.workload
    datasets = [ds for ds in (wl.train_dataset, wl.val_dataset) if isinstance(ds, PairDataset)]
    done: dict[str, np.ndarray] = {}
    for field, ds in zip(("data", "val_data"), datasets, strict=False):
        if ds.reference is not None:
            continue
        key = ds.cache.location.name
        if key not in done:
            name = references.get(field) or references.get("data")
            done[key] = _compute(s, ds, locate(name, s.args.storage_filesystem))
        ds.reference = done[key]
    for ds in datasets:  # a held-out split shares its cache (and values) with the training set
        if ds.reference is None:
            ds.reference = done.get(ds.cache.location.name)


def _compute(s: Any, ds: PairDataset, location: Any) -> np.ndarray:
    started = time.perf_counter()
    wl, rank, world = s.workload, s.rank, s.world_size
    n = len(ds.cache)
    mine = list(range(rank, n, world))
    per_rank = -(-n // world)
    padded = mine + [mine[-1] if mine else 0] * (per_rank - len(mine))
    objective = wl.objective
    module = s.parallel.module()

    def batch_logps(model: Any, ids: Any, labels: Any, mask: Any) -> Any:
        rows = ids.shape[0]
        sequence = torch.arange(rows, device=ids.device)[:, None].expand_as(ids)
        inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        with wl.adaptation.disabled(model):
            return objective.logps(model, inputs, sequence, rows)

    was_training = module.training
    module.eval()
    values = sequence_logps(
        module, ds.cache.samples(padded), ds.pad_id, s.accelerator.device,
        s.accelerator.autocast, batch_logps=batch_logps,
    )  # fmt: skip
    module.train(was_training)
    parts: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(parts, (mine, values[: len(mine)]))
    else:
        parts = [(mine, values[: len(mine)])]
    whole = np.zeros(n, dtype=np.float32)
    for rows, got in parts:
        whole[rows] = got
    wall = time.perf_counter() - started
    if rank == 0:
        write_piece(location, 0, whole)
        write_meta(
            location, [(0, n)], wall_s=round(wall, 3), tasks=0, device=s.accelerator.device.type,
            dtype=str(s.accelerator.mixed_precision), model=str(s.args.model),
            computed_by=f"{world} training worker(s), sharded",
            quantize_base=(s.args.lora or {}).get("quantize_base"),
        )  # fmt: skip
        print(f"reference log-probs of {n} sequences computed by the workers in {wall:.1f} s")
    if world > 1:
        dist.barrier()
    return whole


def frozen_copy(module: torch.nn.Module) -> torch.nn.Module:
    """The model as DPO starts, frozen, for an in-step reference without LoRA: a second copy
    of every weight on the device (docs/preference.md says what it costs)."""
    frozen = copy.deepcopy(module).eval()
    frozen.requires_grad_(False)
    return frozen
