"""Training worker: SFT, the next-token loss (the model's own loss, or ``loss_fn``), per micro-batch.

Runs in each training worker. The loss of a step is the mean over every target token of its
global batch (``workload.py`` says how the micro-batches' sums add up to it): a model that takes
``num_items_in_batch`` returns its token-loss sum over the workload's ``norm`` itself; any other
model (or a ``loss_fn``) returns the mean over the micro-batch's targets, weighted here by their
count; a micro-batch with no target (a rank's filler, a chat row truncated before its answer)
contributes an exact zero that still reaches every parameter. Its batch layout is the token
cache's own (the loader's ``CachedDataset``: padded or packed samples) or the user's
``Dataset`` and collate; its validation step is the same loss, summed over the batch's targets.
"""

from __future__ import annotations

from typing import Any

import torch

from ray_trainer._objectives.sft import SFT
from ray_trainer._worker.objectives.base import WorkerObjective
from ray_trainer._worker.step.micro_batches import count_targets, ignores_labels
from ray_trainer._worker.workload import zero_loss


class SftObjective(WorkerObjective):
    """The next-token loss (and any model's own loss: the demo's, a plain PyTorch model's)."""

    description = SFT

    def targets_per_sample(self, args: Any, cached: bool) -> int:
        # A token cache's samples score up to max_length tokens each; a user's Dataset: 1 each.
        return args.max_length if cached else 1

    def step_loss(
        self, workload: Any, model: torch.nn.Module, batch: dict[str, Any], targets: int
    ) -> tuple[Any, torch.Tensor]:
        # A filler without labels to ignore repeats real samples: not the model's own sum.
        if workload.sums_itself and (targets or ignores_labels(batch)):
            outputs = model(**batch, num_items_in_batch=workload.norm)
            return outputs, workload.loss_fn(outputs, batch)
        outputs = model(**batch)
        if targets == 0:  # every rank still runs backward (DDP, FSDP): a zero on the graph
            return outputs, zero_loss(outputs, batch)
        return outputs, workload.loss_fn(outputs, batch) * (targets / workload.norm)

    def val_targets(self, workload: Any, batch: dict[str, Any]) -> int:
        return count_targets(batch, workload.shifts_labels)

    def val_sums(
        self, workload: Any, model: torch.nn.Module, batch: dict[str, Any], targets: int
    ) -> tuple[Any, None]:
        if workload.sums_itself:
            return workload.loss_fn(model(**batch, num_items_in_batch=1.0), batch), None
        outputs = model(**batch)  # even with no target: under FSDP a forward is a collective
        return (0.0 if targets == 0 else workload.loss_fn(outputs, batch) * targets), None


def build(args: Any) -> SftObjective:
    """The SFT objective of a run (``ray_trainer._objectives.sft`` names this module)."""
    return SftObjective()
