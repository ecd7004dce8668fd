"""Training worker: the GRPO policy loss and its metrics, from token sums (TRL 1.16's losses).

Runs in each training worker. Its inputs are one micro-batch's completion tokens, laid out flat
(:class:`CompletionTokens`: every tensor ``[tokens]``, each token's completion in ``sequence``,
so padded and packed rows alike), with per completion its advantage:

- ``logps``: the policy's log-probability of each completion token at the sampling
  temperature (logits divided by it), differentiable;
- ``old_logps``: the policy's before this batch's first optimizer step (None: ``logps``
  detached, TRL's shortcut when ``num_iterations == 1``);
- ``sampling_logps``: the rollout engine's (``Completion.logprobs``), for the importance-sampling
  correction of the engine/trainer mismatch (:func:`importance_ratio`);
- ``ref_logps``: the reference's (the model as it started), with ``beta > 0``;
- ``entropy``: each position's entropy (a metric only); ``mask``: 0 for the tokens of a
  completion ``mask_truncated_completions`` drops.

Per token, as TRL 1.16's ``GRPOTrainer._compute_loss``: the ratio ``r = exp(logps - old)`` (per
completion, of the mean log-ratio, with ``importance_sampling_level="sequence"``), the clipped
objective ``-min(r A, clamp(r, 1 - epsilon, 1 + epsilon_high) A)``, times the importance-sampling
ratio, plus ``beta`` times the KL ``exp(ref - logps) - (ref - logps) - 1`` (times ``r``: TRL's
default ``use_bias_correction_kl``).

**Split invariance.** The step's loss is a SUM over its tokens divided by a count of the whole
step, never a mean per micro-batch: :func:`grpo_sums` returns a micro-batch's sum
(:attr:`GrpoSums.loss`) and its counts, the caller adds them over micro-batches and ranks, and
:func:`denominator` turns the step's counts into the divisor (the loop divides by a constant and
corrects the gradients' scale once the counts are all-reduced, as for the SFT token sum):

- ``"dapo"``: the tokens of the generation batch per optimizer step (TRL's ``num_items_in_batch``
  over ``steps_per_generation``); with one generation per step, the step's tokens;
- ``"bnpo"``: the step's tokens. TRL normalises by the micro-batch's own tokens, which makes
  its loss depend on the split; equal when a step is one micro-batch;
- ``"grpo"``: each completion's token sum over its own length, summed, over the step's
  completions (a completion is never split over micro-batches);
- ``"dr_grpo"``: the step's completions times ``max_completion_length``.

**Metrics** (:data:`LOSS_METRICS`, TRL's names) are sums too (:attr:`GrpoSums.sums`, added over
micro-batches and ranks) except two extremes (:attr:`GrpoSums.maxima`, reduced with MAX):
``clip_ratio/low_min`` and ``clip_ratio/high_max``. TRL averages each micro-batch's means over
the step; here the means are over the step's tokens: equal when a step is one micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ray_trainer._objectives.grpo import IMPORTANCE_SAMPLING, LOSS_METRICS, LOSS_TYPES


@dataclass(frozen=True)
class CompletionTokens:
    """One micro-batch's completion tokens, flat: each tensor ``[tokens]`` except
    ``advantages`` (``[completions]``). ``sequence[i]`` is token ``i``'s completion, in
    ``0 .. completions - 1``; ``mask`` (None: all ones) is 0 for tokens that take no loss."""

    logps: torch.Tensor
    sequence: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    sampling_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    @property
    def completions(self) -> int:
        return int(self.advantages.numel())

    @classmethod
    def from_padded(
        cls, completion_mask: torch.Tensor, advantages: torch.Tensor, **per_token: torch.Tensor
    ) -> CompletionTokens:
        """From TRL's layout: ``[completions, T]`` tensors right-padded, ``completion_mask`` 1
        on each completion's tokens (before ``mask_truncated_completions``: pass that one as
        ``mask``, ``[completions, T]`` too)."""
        keep = completion_mask.bool()
        rows = torch.arange(keep.shape[0], device=keep.device)[:, None].expand_as(keep)
        flat = {k: (v[keep] if v is not None else None) for k, v in per_token.items()}
        return cls(sequence=rows[keep], advantages=advantages.reshape(-1), **flat)


@dataclass
class GrpoSums:
    """One micro-batch's share of a GRPO step. ``loss``: the SUM its tokens add to the step's
    loss numerator (differentiable fp32: divide by :func:`denominator` of the step's counts, or
    by a constant the gradients' scale corrects); ``sums``: fp32 ``[7]``, detached, added over
    micro-batches and ranks: the KL, entropy and clip sums of :data:`LOSS_METRICS`, then the
    counts ``tokens`` (that take the loss) and ``completions``; ``maxima``: fp32 ``[2]``, reduced
    with MAX: ``-clip_ratio/low_min`` and ``clip_ratio/high_max`` (``-inf``: none)."""

    loss: torch.Tensor
    sums: torch.Tensor
    maxima: torch.Tensor

    @property
    def tokens(self) -> float:
        return float(self.sums[5])

    @property
    def completions(self) -> float:
        return float(self.sums[6])


def check_loss_options(loss_type: str, epsilon: float, epsilon_high: float) -> None:
    """Refuse options TRL's losses do not define (the driver's ``GrpoConfig`` refuses them
    first; this guards direct calls)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"grpo.loss_type must be one of {', '.join(map(repr, LOSS_TYPES))}, got {loss_type!r}"
        )
    if not 0 < epsilon < 1 or not epsilon_high > 0:
        raise ValueError(
            f"grpo.epsilon must be in (0, 1) and grpo.epsilon_high positive, got {epsilon!r} "
            f"and {epsilon_high!r} (TRL's default: 0.2 for both)"
        )


def _per_sequence(values: torch.Tensor, sequence: torch.Tensor, n: int) -> torch.Tensor:
    """Each completion's sum of ``values`` (``[tokens]``) as ``[n]`` (differentiable)."""
    out = torch.zeros(n, dtype=values.dtype, device=values.device)
    return out.index_add(0, sequence, values)


def engine_old_logps(sampling_logps: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """The old log-probs of an asynchronous step (``max_staleness`` >= 1): the engine's
    own (``sampling_logps``, of the policy version that sampled each completion), as TRL's
    ``AsyncGRPOTrainer`` takes them, so the clipped ratio ``exp(logps - old)`` corrects for
    the completions' staleness; a token the engine gave no log-prob for (NaN) takes the
    policy's own, detached (ratio 1). The mismatch weight of :func:`importance_ratio`
    (``exp(old - sampling)``) is then 1 wherever it is defined."""
    return torch.where(torch.isnan(sampling_logps), logps.detach(), sampling_logps)


def importance_ratio(
    tokens: CompletionTokens,
    mode: str | None,
    cap: float | None = 3.0,
    low: float | None = None,
) -> torch.Tensor | None:
    """Each token's importance-sampling weight correcting for the engine's sampling
    distribution (``sampling_logps``) against the trainer's (``old_logps``, else ``logps``
    detached), as TRL 1.16 computes ``importance_sampling_ratio``: ``exp`` of the per-token
    difference (``token_*``) or of its sum over the completion (``sequence_*``), zeroed outside
    ``[low, cap]`` (``*_mask``) or clamped to it (``*_truncate``). None when ``mode`` is None or
    there are no engine log-probs. Constant (no gradient); NaN engine log-probs count as equal."""
    if mode is None or tokens.sampling_logps is None:
        return None
    if mode not in IMPORTANCE_SAMPLING:
        raise ValueError(
            f"grpo.importance_sampling must be one of {', '.join(IMPORTANCE_SAMPLING)} or None, "
            f"got {mode!r}"
        )
    old = tokens.logps.detach() if tokens.old_logps is None else tokens.old_logps
    mask = _mask(tokens)
    diff = torch.nan_to_num((old.detach() - tokens.sampling_logps.to(old.device)) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = _per_sequence(diff, tokens.sequence, tokens.completions)[tokens.sequence]
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=cap)
    low_v = -math.inf if low is None else low
    high_v = math.inf if cap is None else cap
    return ratio.masked_fill((ratio < low_v) | (ratio > high_v), 0.0)


def _mask(tokens: CompletionTokens) -> torch.Tensor:
    if tokens.mask is None:
        return torch.ones_like(tokens.logps, dtype=torch.float32).detach()
    return tokens.mask.to(device=tokens.logps.device, dtype=torch.float32)


def grpo_sums(
    tokens: CompletionTokens,
    *,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    importance_sampling_level: str = "token",
    importance_sampling_ratio: torch.Tensor | None = None,
) -> GrpoSums:
    """A micro-batch's loss numerator and metric sums (see :class:`GrpoSums`).
    ``importance_sampling_ratio`` is :func:`importance_ratio`'s (None: no correction). With no
    token (a rank's filler micro-batch), the loss is an exact zero that still depends on
    ``logps``, so every parameter gets a (zero) gradient."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    check_loss_options(loss_type, epsilon, eps_high)
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(
            "grpo.importance_sampling_level must be 'token' or 'sequence', got "
            f"{importance_sampling_level!r}"
        )
    logps = tokens.logps.float()
    n, seq = tokens.completions, tokens.sequence.to(logps.device)
    mask = _mask(tokens)
    lengths = _per_sequence(mask, seq, n)  # tokens that take the loss, per completion
    old = logps.detach() if tokens.old_logps is None else tokens.old_logps.to(logps).detach()
    log_ratio = logps - old
    if importance_sampling_level == "sequence":
        per_seq = _per_sequence(log_ratio * mask, seq, n) / lengths.clamp(min=1.0)
        log_ratio = per_seq[seq]
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + eps_high)
    advantages = tokens.advantages.to(logps).detach()
    adv = advantages[seq]
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if importance_sampling_ratio is not None:
        per_token = per_token * importance_sampling_ratio.to(logps).detach()
    kl = None
    if beta != 0.0:
        if tokens.ref_logps is None:
            raise ValueError("grpo.beta > 0 takes the KL against the reference: give ref_logps")
        delta = tokens.ref_logps.to(logps).detach() - logps
        kl = (torch.exp(delta) - delta - 1) * coef_1  # TRL's use_bias_correction_kl
        per_token = per_token + beta * kl
    weighted = per_token * mask
    if loss_type == "grpo":
        weighted = weighted / lengths.clamp(min=1.0)[seq]
    loss = weighted.sum() if weighted.numel() else logps.sum() * 0.0
    return GrpoSums(
        loss,
        *_metric_sums(tokens, mask, lengths, coef_1, adv, kl, epsilon, eps_high,
                      importance_sampling_level),
    )  # fmt: skip


def _metric_sums(
    tokens: CompletionTokens,
    mask: torch.Tensor,
    lengths: torch.Tensor,
    coef_1: torch.Tensor,
    adv: torch.Tensor,
    kl: torch.Tensor | None,
    epsilon: float,
    eps_high: float,
    level: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        n, seq = tokens.completions, tokens.sequence.to(mask.device)
        coef = coef_1.detach()
        low = ((coef < 1 - epsilon) & (adv < 0)).float()
        high = ((coef > 1 + eps_high) & (adv > 0)).float()
        region = torch.maximum(low, high)
        zero = mask.new_zeros(())
        entropy = zero if tokens.entropy is None else (tokens.entropy.float() * mask).sum()
        kl_sum = zero if kl is None else (kl.detach() * mask).sum()
        if level == "sequence":  # one ratio per completion: clip fractions over completions
            first = _first_token(seq, n)
            low_seq, high_seq = _at(low, first, n), _at(high, first, n)
            clip = [low_seq.sum(), high_seq.sum(), torch.maximum(low_seq, high_seq).sum()]
            seen = first >= 0  # every completion with a token counts, masked or not (TRL's)
        else:
            clip = [(x * mask).sum() for x in (low, high, region)]
            low_seq = _per_sequence(low * mask, seq, n) / lengths
            high_seq = _per_sequence(high * mask, seq, n) / lengths
            seen = lengths > 0  # TRL's NaN for a completion with no token, then nan-min/max
        neg_inf = torch.tensor(-math.inf, device=mask.device)
        low_min = torch.where(seen, -low_seq, neg_inf).max() if n else neg_inf
        high_max = torch.where(seen, high_seq, neg_inf).max() if n else neg_inf
        sums = torch.stack(
            [kl_sum, entropy, *clip, mask.sum(), torch.tensor(float(n), device=mask.device)]
        ).float()
        return sums, torch.stack([low_min, high_max]).float()


def _first_token(seq: torch.Tensor, n: int) -> torch.Tensor:
    """Each completion's first token's index (``-1``: it has none here)."""
    index = torch.arange(seq.numel(), device=seq.device)
    first = torch.full((n,), seq.numel(), dtype=torch.long, device=seq.device)
    first = first.scatter_reduce(0, seq, index, reduce="amin")
    return torch.where(first < seq.numel(), first, torch.full_like(first, -1))


def _at(values: torch.Tensor, first: torch.Tensor, n: int) -> torch.Tensor:
    return torch.where(first >= 0, values[first.clamp(min=0)], values.new_zeros(n))


def denominator(
    loss_type: str,
    *,
    tokens: float,
    completions: float,
    max_completion_length: int,
    generation_tokens: float | None = None,
    steps_per_generation: int = 1,
) -> float:
    """What the step's summed loss is divided by, from the step's counts over every
    micro-batch and rank (module docstring): ``tokens`` that take the loss, ``completions``,
    and for ``"dapo"`` the ``generation_tokens`` of the generation batch it came from (None:
    ``tokens``) spread over ``steps_per_generation`` optimizer steps. At least 1."""
    if loss_type == "grpo":
        value = completions
    elif loss_type == "dr_grpo":
        value = completions * max_completion_length
    elif loss_type == "bnpo":
        value = tokens
    elif loss_type == "dapo":
        value = (tokens if generation_tokens is None else generation_tokens) / steps_per_generation
        value = max(value, 1.0 / steps_per_generation)  # TRL clamps the count at 1
    else:
        check_loss_options(loss_type, 0.2, 0.2)
    return max(float(value), 1.0) if loss_type != "dapo" else float(value)


def metrics_from_sums(
    sums: torch.Tensor | list[float],
    maxima: torch.Tensor | list[float],
    *,
    beta: float = 0.0,
    importance_sampling_level: str = "token",
) -> dict[str, float]:
    """The step's :data:`LOSS_METRICS` from its reduced sums and maxima (``kl`` only with
    ``beta > 0``, as TRL). Means over the tokens that take the loss (the clip fractions over
    completions at ``importance_sampling_level="sequence"``); 0 where there are none, as TRL's
    ``global_masked_mean``; ``trained_tokens`` says how many there were. Reads the values to
    the host: a CPU-GPU sync when they are on a GPU."""
    values = sums.tolist() if isinstance(sums, torch.Tensor) else list(sums)
    extremes = maxima.tolist() if isinstance(maxima, torch.Tensor) else list(maxima)
    kl, entropy, low, high, region, tokens, completions = values
    per_token = max(tokens, 1.0)
    per_clip = max(completions, 1.0) if importance_sampling_level == "sequence" else per_token
    out = {
        "kl": kl / per_token,
        "entropy": entropy / per_token,
        "clip_ratio/low_mean": low / per_clip,
        "clip_ratio/high_mean": high / per_clip,
        "clip_ratio/region_mean": region / per_clip,
        "clip_ratio/low_min": -extremes[0] if extremes[0] != -math.inf else math.nan,
        "clip_ratio/high_max": extremes[1] if extremes[1] != -math.inf else math.nan,
        "trained_tokens": tokens,
    }
    if beta == 0.0:
        del out["kl"]
    assert set(out) <= set(LOSS_METRICS)
    return out


def grpo_loss(
    tokens: CompletionTokens,
    *,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    importance_sampling_level: str = "token",
    importance_sampling_ratio: torch.Tensor | None = None,
    max_completion_length: int = 512,
    generation_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of a batch held whole in one process (one micro-batch, one rank: a test, a
    validation pass) and its metrics, as one TRL step over that batch reports them. In
    training use :func:`grpo_sums` and :func:`denominator`, which a split batch adds up
    exactly."""
    sums = grpo_sums(
        tokens, loss_type=loss_type, beta=beta, epsilon=epsilon, epsilon_high=epsilon_high,
        importance_sampling_level=importance_sampling_level,
        importance_sampling_ratio=importance_sampling_ratio,
    )  # fmt: skip
    divisor = denominator(
        loss_type, tokens=sums.tokens, completions=sums.completions,
        max_completion_length=max_completion_length, generation_tokens=generation_tokens,
    )  # fmt: skip
    metrics = metrics_from_sums(
        sums.sums, sums.maxima, beta=beta, importance_sampling_level=importance_sampling_level
    )
    return sums.loss / divisor, metrics
