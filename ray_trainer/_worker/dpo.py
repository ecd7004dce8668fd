"""Training worker: the DPO objective, from each sequence's summed log-probabilities.

Runs in each training worker (and wherever a validation pass scores pairs). Its inputs are, per
pair, the summed log-probability of the chosen and of the rejected answer's tokens under the
policy (differentiable: ``chunked_loss.sequence_logprobs`` gives them, also from a packed row)
and under the reference (constants: precomputed, or a no-grad pass), and for IPO each answer's
token count. The losses are TRL 1.16's (``DPOTrainer``), per pair:

- ``"sigmoid"``: ``-log sigmoid(beta * (chosen log-ratio - rejected log-ratio))``, each
  log-ratio ``log pi(answer) - log ref(answer)`` summed over the answer's tokens. With
  ``label_smoothing`` ``e > 0`` it is conservative DPO, as TRL before 1.0 computed ``"sigmoid"``:
  ``-(1 - e) log sigmoid(z) - e log sigmoid(-z)`` (TRL 1.16 reads ``label_smoothing`` in other
  loss types only; at ``e = 0``, the default, the two are one formula).
- ``"ipo"``: ``(chosen log-ratio / chosen tokens - rejected log-ratio / rejected tokens
  - 1 / (2 beta))^2``: the log-ratios averaged over each answer's tokens.

**Split invariance.** A step's loss is the mean over every pair of the global batch, whatever
the split into ``batch_size``, ``grad_accum_steps`` and ranks. So :func:`dpo_sums` returns the
SUM of this micro-batch's pair losses; the caller divides it by a constant (as the loop's
``Workload.norm`` does for token sums) and scales the gradients by ``norm x world / global
pairs`` once the step's all-reduce has counted the pairs, exactly as for the SFT token sum.

**Metrics** (:data:`METRICS`, TRL's names) are means over the pairs of the global batch too: each
micro-batch gives their sums (:attr:`DpoSums.metrics`, detached), which the step adds over
micro-batches and all-reduces over ranks with the pair count, and :func:`metrics_from_sums` turns
into means. Never average per-rank means: ranks may hold different numbers of pairs.

A micro-batch lays its sequences out pair by pair: sequence ``2i`` is pair ``i``'s chosen answer,
``2i + 1`` its rejected one (:func:`split_pairs`), so a pair is never split across micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ray_trainer._config.args import DPO_LOSSES
from ray_trainer._data.encode import IGNORE_INDEX

#: The metrics of a DPO step, with TRL's names (so dashboards carry over), in the order of
#: :attr:`DpoSums.metrics`.
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def check_dpo_options(loss: str, beta: float, label_smoothing: float = 0.0) -> None:
    """Refuse DPO options that TRL's losses do not define; the error names the field and the
    fix. Cheap: call it where the options are set (the driver), and it runs again per call."""
    if loss not in DPO_LOSSES:
        raise ValueError(
            f"dpo_loss must be one of {', '.join(map(repr, DPO_LOSSES))}, got {loss!r}"
        )
    if not beta > 0:
        raise ValueError(f"dpo_beta must be positive (TRL's default is 0.1), got {beta!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(
            f"label_smoothing must be in [0, 0.5) (the probability that a pair's preference is "
            f"flipped), got {label_smoothing!r}"
        )
    if label_smoothing and loss != "sigmoid":
        raise ValueError(
            f"label_smoothing={label_smoothing!r} with dpo_loss={loss!r}: label_smoothing "
            "makes the sigmoid loss conservative DPO (cDPO), it has no meaning for IPO; set "
            "label_smoothing=0, or use dpo_loss='sigmoid'"
        )


def split_pairs(per_sequence: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen, rejected)`` of a micro-batch's per-sequence values laid out pair by pair
    (sequence ``2i`` chosen, ``2i + 1`` rejected): each ``[pairs]``, views of the input."""
    if per_sequence.dim() != 1 or per_sequence.numel() % 2:
        raise ValueError(
            "split_pairs takes a 1-D tensor of an even number of sequences (chosen, rejected, "
            f"chosen, ...), got shape {tuple(per_sequence.shape)}"
        )
    pairs = per_sequence.view(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def pair_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each pair's loss (``[pairs]``, differentiable w.r.t. the policy's log-probs), as TRL
    1.16's ``DPOTrainer`` computes it. All inputs are ``[pairs]``; the token counts (each
    answer's tokens, at least 1 counted) are needed by ``"ipo"`` only."""
    check_dpo_options(loss, beta, label_smoothing)
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    if loss == "sigmoid":
        z = beta * (chosen_ratio - rejected_ratio)
        if not label_smoothing:
            return -F.logsigmoid(z)
        return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    if chosen_tokens is None or rejected_tokens is None:
        raise ValueError(
            "dpo_loss='ipo' averages each answer's log-ratio over its tokens: pass "
            "chosen_tokens and rejected_tokens (each answer's token count)"
        )
    per_token = chosen_ratio / _count(chosen_tokens, chosen_ratio) - rejected_ratio / _count(
        rejected_tokens, rejected_ratio
    )
    return (per_token - 1 / (2 * beta)) ** 2


def _count(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(tokens, device=like.device).to(like.dtype).clamp(min=1.0)


def metric_sums(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
) -> torch.Tensor:
    """The sums over these pairs of each of :data:`METRICS` (fp32 ``[6]``, detached): the
    rewards ``beta x log-ratio``, whether the chosen reward is the higher, their margin, and
    the policy's summed log-probs. Add them over micro-batches and ranks with the pair count;
    :func:`metrics_from_sums` makes the means."""
    chosen = beta * (policy_chosen - ref_chosen).detach().float()
    rejected = beta * (policy_rejected - ref_rejected).detach().float()
    return torch.stack(
        [
            chosen.sum(),
            rejected.sum(),
            (chosen > rejected).float().sum(),
            (chosen - rejected).sum(),
            policy_chosen.detach().float().sum(),
            policy_rejected.detach().float().sum(),
        ]
    )


def metrics_from_sums(sums: torch.Tensor | list[float], pairs: float) -> dict[str, float]:
    """The means over ``pairs`` pairs of :data:`METRICS`, from their summed :func:`metric_sums`
    (all-reduced over ranks first); empty when there were no pairs. Reads the values to the
    host: a CPU-GPU sync when ``sums`` is on a GPU."""
    if pairs <= 0:
        return {}
    values = sums.tolist() if isinstance(sums, torch.Tensor) else list(sums)
    if len(values) != len(METRICS):
        raise ValueError(
            f"expected {len(METRICS)} metric sums ({', '.join(METRICS)}), got {len(values)}"
        )
    return {name: value / pairs for name, value in zip(METRICS, values, strict=True)}


@dataclass
class DpoSums:
    """One micro-batch's share of a DPO step: ``loss``, the SUM of its pairs' losses (a
    differentiable fp32 scalar: divide by the global pair count, or a constant that the
    gradients' scale corrects, before backward); ``metrics``, the sums of :data:`METRICS`
    (detached); ``pairs``, how many pairs it holds."""

    loss: torch.Tensor
    metrics: torch.Tensor
    pairs: int


def dpo_sums(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> DpoSums:
    """A micro-batch's summed DPO loss and metric sums (see :class:`DpoSums`). Inputs as
    :func:`pair_losses`. With no pair (a rank's filler micro-batch), the loss is an exact zero
    that still depends on ``policy_chosen``, so every parameter gets a (zero) gradient."""
    ref_chosen, ref_rejected = (r.to(policy_chosen.device) for r in (ref_chosen, ref_rejected))
    losses = pair_losses(
        policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=beta, loss=loss,
        label_smoothing=label_smoothing, chosen_tokens=chosen_tokens,
        rejected_tokens=rejected_tokens,
    )  # fmt: skip
    total = losses.sum() if losses.numel() else policy_chosen.sum() * 0.0
    sums = metric_sums(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=beta)
    return DpoSums(total.float(), sums, int(policy_chosen.numel()))


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The mean loss over the pairs given and their metrics, as one TRL step over one batch
    reports them: for a batch held whole in one process (a validation pass on rank 0, tests).
    In training use :func:`dpo_sums`, which a split batch adds up exactly."""
    sums = dpo_sums(
        policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=beta, loss=loss,
        label_smoothing=label_smoothing, chosen_tokens=chosen_tokens,
        rejected_tokens=rejected_tokens,
    )  # fmt: skip
    return sums.loss / max(sums.pairs, 1), metrics_from_sums(sums.metrics, sums.pairs)


# -- the objective of a DPO run: a micro-batch of pairs to its loss ------------------------------


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


#: The keys a DPO micro-batch carries besides the model's inputs (the loader's `PairDataset`).
PAIR_KEYS = ("sequence", "ref_logps", "answer_tokens")


@dataclass
class PairOutputs:
    """What a DPO micro-batch's forward returns besides its loss (``on_after_forward``'s
    ``outputs``): each sequence's summed log-probability under the policy and the reference,
    and the metric sums of :data:`METRICS`."""

    logps: torch.Tensor
    ref_logps: torch.Tensor
    metrics: torch.Tensor


class DpoObjective:
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
    """

    def __init__(
        self,
        beta: float,
        loss: str,
        label_smoothing: float = 0.0,
        chunked: bool = False,
        reference: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        check_dpo_options(loss, beta, label_smoothing)
        self.beta, self.loss, self.label_smoothing = beta, loss, label_smoothing
        self.chunked = chunked
        self.reference = reference
        self._sums: torch.Tensor | None = None  # the step's metric sums so far (device)

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
        tokens = batch["answer_tokens"][:n]
        chosen, rejected = split_pairs(logps)
        ref_chosen, ref_rejected = split_pairs(ref.detach())
        chosen_tokens, rejected_tokens = split_pairs(tokens)
        sums = dpo_sums(
            chosen, rejected, ref_chosen, ref_rejected, beta=self.beta, loss=self.loss,
            label_smoothing=self.label_smoothing, chosen_tokens=chosen_tokens,
            rejected_tokens=rejected_tokens,
        )  # fmt: skip
        return sums, PairOutputs(logps, ref, sums.metrics)

    def forward(self, model: Any, batch: dict[str, Any], pairs: int) -> tuple[PairOutputs, Any]:
        """A training micro-batch: (outputs, the SUM of its pair losses); its metric sums are
        added to the step's."""
        sums, outputs = self.sums(model, batch, pairs)
        self._sums = sums.metrics if self._sums is None else self._sums + sums.metrics
        return outputs, sums.loss

    def take_sums(self) -> torch.Tensor | None:
        """The step's metric sums (a device tensor), for its all-reduce; starts the next."""
        sums, self._sums = self._sums, None
        return sums
