"""The worker side of the tests' toy objective (``toy_objective.py``): a label-smoothed token loss.

Each target token's loss is ``(1 - e) x cross-entropy + e x the mean over the vocabulary of
-log p``: torch's ``cross_entropy(label_smoothing=e)``, summed over the micro-batch's targets and
divided by the workload's norm, as SFT's token sum is. Its batch layout is the token cache's own
(SFT's); its validation step is the same sum without gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ray_trainer._data.encode import IGNORE_INDEX
from ray_trainer._worker.objectives.base import WorkerObjective
from ray_trainer._worker.step.micro_batches import count_targets


def smoothed_sum(logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> torch.Tensor:
    """The label-smoothed loss summed over the targets of a causal LM's batch (shifted)."""
    scored = logits[..., :-1, :].flatten(0, -2).float()
    targets = labels[..., 1:].flatten()
    return F.cross_entropy(
        scored, targets, ignore_index=IGNORE_INDEX, label_smoothing=smoothing, reduction="sum"
    )


class SmoothedSft(WorkerObjective):
    """SFT whose token loss is label-smoothed by ``TrainingArgs.label_smoothing``."""

    def __init__(self, smoothing: float) -> None:
        self.smoothing = smoothing

    def targets_per_sample(self, args: Any, cached: bool) -> int:
        return args.max_length if cached else 1

    def _logits(self, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[Any, torch.Tensor]:
        outputs = model(**{k: v for k, v in batch.items() if k != "labels"})
        return outputs, outputs["logits"] if isinstance(outputs, dict) else outputs.logits

    def step_loss(
        self, workload: Any, model: torch.nn.Module, batch: dict[str, Any], targets: int
    ) -> tuple[Any, torch.Tensor]:
        outputs, logits = self._logits(model, batch)
        return outputs, smoothed_sum(logits, batch["labels"], self.smoothing) / workload.norm

    def val_targets(self, workload: Any, batch: dict[str, Any]) -> int:
        return count_targets(batch, workload.shifts_labels)

    def val_sums(
        self, workload: Any, model: torch.nn.Module, batch: dict[str, Any], targets: int
    ) -> tuple[Any, None]:
        _, logits = self._logits(model, batch)
        return smoothed_sum(logits, batch["labels"], self.smoothing), None


def build(args: Any) -> SmoothedSft:
    """The toy objective of a run (``toy_objective.SMOOTHED_SFT`` names this module)."""
    return SmoothedSft(args.label_smoothing)
