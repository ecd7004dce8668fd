"""Training worker: the DPO loss and metrics, from each answer's summed log-probabilities.

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

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ray_trainer._objectives.dpo import DPO_LOSSES, METRICS


@dataclass(frozen=True)
class PairLogps:
    """What a batch of pairs' loss is computed from, each ``[pairs]``: the summed
    log-probability of the chosen and of the rejected answer under the policy (differentiable)
    and under the reference (constants), and each answer's token count (at least 1 counted;
    needed by ``"ipo"`` only)."""

    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor | None = None
    rejected_tokens: torch.Tensor | None = None

    @property
    def pairs(self) -> int:
        return int(self.policy_chosen.numel())


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
    logps: PairLogps, *, beta: float, loss: str = "sigmoid", label_smoothing: float = 0.0
) -> torch.Tensor:
    """Each pair's loss (``[pairs]``, differentiable w.r.t. the policy's log-probs), as TRL
    1.16's ``DPOTrainer`` computes it."""
    check_dpo_options(loss, beta, label_smoothing)
    chosen_ratio = logps.policy_chosen - logps.ref_chosen
    rejected_ratio = logps.policy_rejected - logps.ref_rejected
    if loss == "sigmoid":
        z = beta * (chosen_ratio - rejected_ratio)
        if not label_smoothing:
            return -F.logsigmoid(z)
        return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    if logps.chosen_tokens is None or logps.rejected_tokens is None:
        raise ValueError(
            "dpo_loss='ipo' averages each answer's log-ratio over its tokens: give the pairs' "
            "chosen_tokens and rejected_tokens (each answer's token count)"
        )
    per_token = chosen_ratio / _count(logps.chosen_tokens, chosen_ratio) - rejected_ratio / (
        _count(logps.rejected_tokens, rejected_ratio)
    )
    return (per_token - 1 / (2 * beta)) ** 2


def _count(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(tokens, device=like.device).to(like.dtype).clamp(min=1.0)


def metric_sums(logps: PairLogps, *, beta: float) -> torch.Tensor:
    """The sums over these pairs of each of :data:`METRICS` (fp32 ``[6]``, detached): the
    rewards ``beta x log-ratio``, whether the chosen reward is the higher, their margin, and
    the policy's summed log-probs. Add them over micro-batches and ranks with the pair count;
    :func:`metrics_from_sums` makes the means."""
    chosen = beta * (logps.policy_chosen - logps.ref_chosen).detach().float()
    rejected = beta * (logps.policy_rejected - logps.ref_rejected).detach().float()
    return torch.stack(
        [
            chosen.sum(),
            rejected.sum(),
            (chosen > rejected).float().sum(),
            (chosen - rejected).sum(),
            logps.policy_chosen.detach().float().sum(),
            logps.policy_rejected.detach().float().sum(),
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
    logps: PairLogps, *, beta: float, loss: str = "sigmoid", label_smoothing: float = 0.0
) -> DpoSums:
    """A micro-batch's summed DPO loss and metric sums (see :class:`DpoSums`). With no pair
    (a rank's filler micro-batch), the loss is an exact zero that still depends on
    ``policy_chosen``, so every parameter gets a (zero) gradient."""
    device = logps.policy_chosen.device
    refs = (logps.ref_chosen.to(device), logps.ref_rejected.to(device))
    logps = replace(logps, ref_chosen=refs[0], ref_rejected=refs[1])
    losses = pair_losses(logps, beta=beta, loss=loss, label_smoothing=label_smoothing)
    total = losses.sum() if losses.numel() else logps.policy_chosen.sum() * 0.0
    return DpoSums(total.float(), metric_sums(logps, beta=beta), logps.pairs)


def dpo_loss(
    logps: PairLogps, *, beta: float, loss: str = "sigmoid", label_smoothing: float = 0.0
) -> tuple[torch.Tensor, dict[str, float]]:
    """The mean loss over the pairs given and their metrics, as one TRL step over one batch
    reports them: for a batch held whole in one process (a validation pass on rank 0, tests).
    In training use :func:`dpo_sums`, which a split batch adds up exactly."""
    sums = dpo_sums(logps, beta=beta, loss=loss, label_smoothing=label_smoothing)
    return sums.loss / max(sums.pairs, 1), metrics_from_sums(sums.metrics, sums.pairs)
