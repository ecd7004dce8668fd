"""Training worker: DPO, a micro-batch of preference pairs to the sum of its pair losses.

Runs in each training worker (the module ``ray_trainer._objectives.dpo`` names). Each pair's
loss compares the summed log-probabilities of its two answers under the policy and under the
reference (``dpo_loss.py``: TRL 1.16's losses, split-invariant sums). Its batch layout: the
token cache's sequences as pairs (``dpo_pairs.py``: a pair's two sequences always in one
micro-batch, ``targets`` counting pairs). The reference: precomputed into the token cache (by
the driver's Ray tasks, or under FSDP by the workers at setup: ``dpo_reference.py``), or with
``precompute_reference=False`` computed in the step without gradient (the model with its LoRA
adapters off, else a frozen copy made once the model is placed). Its validation step: the same
loss and TRL's metrics, summed over the validation pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ray_trainer._data.encode import IGNORE_INDEX
from ray_trainer._objectives.dpo import DPO
from ray_trainer._storage import locate
from ray_trainer._worker.model.adaptation import WholeModel
from ray_trainer._worker.objectives.base import WorkerObjective
from ray_trainer._worker.objectives.dpo_loss import (
    DpoSums,
    PairLogps,
    check_dpo_options,
    dpo_sums,
    metrics_from_sums,
    split_pairs,
)
from ray_trainer._worker.objectives.dpo_pairs import PairDataset


def logps_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, sequence: torch.Tensor, num_sequences: int
) -> torch.Tensor:
    """Each sequence's summed target log-probability from full logits (a model the chunked
    loss does not apply to): the same sums as ``chunked_loss.sequence_logprobs``. With no
    target, zeros that still reach the logits (so every parameter gets a zero gradient)."""
    from ray_trainer._worker.model.chunked_loss import shifted_targets

    targets = shifted_targets(labels)
    keep = targets != IGNORE_INDEX
    picked = logits[keep].float()
    out = torch.zeros(num_sequences, dtype=torch.float32, device=logits.device)
    if not picked.numel():
        return out + logits.float().sum() * 0.0
    logp = picked.log_softmax(-1).gather(-1, targets[keep][:, None])[:, 0]
    return out.index_add(0, sequence[keep], logp)


def _logits(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict) and "logits" in outputs:
        return outputs["logits"]
    logits = getattr(outputs, "logits", None)
    if logits is None:
        raise ValueError(
            "objective='dpo' needs the model's logits: return them (a tensor, or `logits` in "
            "the model's output) from forward() when no labels are given"
        )
    return logits


#: The keys a DPO micro-batch carries besides the model's inputs (`dpo_pairs.PairDataset`).
PAIR_KEYS = ("sequence", "ref_logps", "answer_tokens")


@dataclass
class PairOutputs:
    """What a DPO micro-batch's forward returns besides its loss (``on_after_forward``'s
    ``outputs``): each sequence's summed log-probability under the policy and the reference,
    and the metric sums of :data:`METRICS`."""

    logps: torch.Tensor
    ref_logps: torch.Tensor
    metrics: torch.Tensor


class DpoObjective(WorkerObjective):
    """A DPO run's objective: turns a micro-batch of pairs into the SUM of its pair losses (the
    loop divides it by the workload's constant norm, as the SFT token sum), and keeps the step's
    metric sums for the step's all-reduce (`take_sums`).

    Args:
        beta, loss, label_smoothing: ``TrainingArgs.dpo_beta``, ``dpo_loss``,
            ``label_smoothing``.
        chunked: the model computes ``{"logps"}`` itself (``chunked_loss.use_chunked_loss``):
            the head a chunk at a time, no full logits.
        reference: with ``precompute_reference=False``, ``reference(inputs, sequence, n)``
            gives the reference's log-probs of a micro-batch in the step (no gradient); None:
            the batch carries them (``ref_logps``, from the token cache).
        precompute: ``TrainingArgs.precompute_reference``.
    """

    description = DPO
    rows_per_item = 2  # a validation batch holds 2 sequences per pair

    def __init__(
        self,
        beta: float,
        loss: str,
        label_smoothing: float = 0.0,
        chunked: bool = False,
        reference: Callable[..., torch.Tensor] | None = None,
        precompute: bool = True,
    ) -> None:
        check_dpo_options(loss, beta, label_smoothing)
        self.beta, self.loss, self.label_smoothing = beta, loss, label_smoothing
        self.chunked = chunked
        self.reference = reference
        self.precompute = precompute
        self.frozen: list[nn.Module] = []  # an in-step reference without LoRA: its copy
        self._sums: torch.Tensor | None = None  # the step's metric sums so far (device)

    # ---- the workload ------------------------------------------------------------------

    def prepare(self, model: nn.Module, adaptation: Any) -> None:
        """Dropout off (as TRL's ``disable_dropout``), the chunked head if the model has it,
        and with ``precompute_reference=False`` the in-step reference."""
        disable_dropout(model)
        self.chunked = hasattr(_inner(model), "_ray_trainer_chunk_size")
        if not self.precompute:
            self.reference = in_step_reference(self, model, adaptation, self.frozen)

    def dataset(
        self, cached: Any, field: str, args: Any, references: dict[str, str]
    ) -> PairDataset:
        """The cache's sequences as pairs, with their precomputed reference log-probs (the
        driver's tasks wrote them; under FSDP the workers fill them at setup)."""
        reference = None
        if field in references:
            from ray_trainer._reference import read_reference

            where = locate(references[field], args.storage_filesystem)
            reference = read_reference(where)
            # Under FSDP the workers fill it at setup (dpo_reference.py); else the driver did.
            if reference is None and args.strategy != "fsdp":
                raise FileNotFoundError(f"{where.name}: no complete reference log-probs here")
        return PairDataset(cached, reference)

    def after_placement(self, workload: Any, parallel: Any) -> None:
        """An in-step reference without LoRA: a frozen copy of the placed model, made now,
        before any step changes the model."""
        if self.reference is not None and isinstance(workload.adaptation, WholeModel):
            from ray_trainer._worker.objectives.dpo_reference import frozen_copy

            self.frozen.append(frozen_copy(parallel.module()))

    def before_training(self, state: Any, references: dict[str, str]) -> None:
        """The reference log-probs the driver left to the workers (FSDP), computed now."""
        if self.precompute:
            from ray_trainer._worker.objectives.dpo_reference import fill_references

            fill_references(state, references)

    # ---- the step ----------------------------------------------------------------------

    def logps(self, model: Any, inputs: dict[str, Any], sequence: Any, n: int) -> torch.Tensor:
        """The summed log-probability of each of the `n` sequences of `inputs` under `model`."""
        if self.chunked:
            return model(**inputs, sequences=(sequence, n))["logps"]
        without = {k: v for k, v in inputs.items() if k != "labels"}
        return logps_from_logits(_logits(model(**without)), inputs["labels"], sequence, n)

    def sums(self, model: Any, batch: dict[str, Any], pairs: int) -> tuple[DpoSums, PairOutputs]:
        """A micro-batch of `pairs` pairs: its summed loss and metrics, and its outputs."""
        inputs = {k: v for k, v in batch.items() if k not in PAIR_KEYS}
        sequence, n = batch["sequence"], 2 * pairs
        logps = self.logps(model, inputs, sequence, n)
        if self.reference is None:
            ref = batch["ref_logps"][:n]
        else:
            with torch.no_grad():
                ref = self.reference(inputs, sequence, n)
        chosen, rejected = split_pairs(logps)
        ref_chosen, ref_rejected = split_pairs(ref.detach())
        chosen_tokens, rejected_tokens = split_pairs(batch["answer_tokens"][:n])
        pair_logps = PairLogps(
            chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens
        )
        sums = dpo_sums(
            pair_logps, beta=self.beta, loss=self.loss, label_smoothing=self.label_smoothing
        )
        return sums, PairOutputs(logps, ref, sums.metrics)

    def forward(self, model: Any, batch: dict[str, Any], pairs: int) -> tuple[PairOutputs, Any]:
        """A training micro-batch: (outputs, the SUM of its pair losses); its metric sums are
        added to the step's."""
        sums, outputs = self.sums(model, batch, pairs)
        self._sums = sums.metrics if self._sums is None else self._sums + sums.metrics
        return outputs, sums.loss

    def step_loss(
        self, workload: Any, model: Any, batch: dict[str, Any], targets: int
    ) -> tuple[PairOutputs, Any]:
        outputs, total = self.forward(model, batch, targets)
        return outputs, total / workload.norm

    def take_sums(self) -> torch.Tensor | None:
        """The step's metric sums (a device tensor), for its all-reduce; starts the next."""
        sums, self._sums = self._sums, None
        return sums

    def metrics_from_sums(self, sums: Any, targets: float) -> dict[str, float]:
        """The means over the step's pairs, with TRL's names."""
        return metrics_from_sums(sums, targets)

    # ---- validation --------------------------------------------------------------------

    def val_collate(self, workload: Any) -> Any:
        # Pairs are read by their own dataset's collate (a held-out split's indices are its own).
        return workload.val_dataset.collate

    def val_items(self, batch: dict[str, Any]) -> int:
        return len(batch["answer_tokens"]) // 2

    def val_targets(self, workload: Any, batch: dict[str, Any]) -> int:
        return self.val_items(batch)  # the validation loss is the mean over the pairs

    def val_sums(
        self, workload: Any, model: Any, batch: dict[str, Any], targets: int
    ) -> tuple[Any, torch.Tensor]:
        sums, _ = self.sums(model, batch, targets)
        return sums.loss, sums.metrics


def in_step_reference(objective: Any, model: nn.Module, adaptation: Any, frozen: Any) -> Any:
    """``reference(inputs, sequence, n)``: the reference's log-probs computed in the step, with
    no gradient: `model` with its LoRA adapters off (no second copy), else `frozen` (the model
    as DPO started, once setup has placed it: ``frozen[0]``)."""

    def reference(inputs: dict[str, Any], sequence: Any, n: int) -> torch.Tensor:
        if isinstance(adaptation, WholeModel):
            return objective.logps(frozen[0], inputs, sequence, n)
        with adaptation.disabled(model):
            return objective.logps(model, inputs, sequence, n)

    return reference


def disable_dropout(model: nn.Module) -> None:
    """Every dropout of `model` off, as TRL's ``disable_dropout_in_model`` (DPO compares the
    policy with a reference computed without dropout)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def _inner(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def build(args: Any) -> DpoObjective:
    """The DPO objective of a run (``ray_trainer._objectives.dpo`` names this module)."""
    return DpoObjective(
        args.dpo_beta, args.dpo_loss, args.label_smoothing, precompute=args.precompute_reference
    )
