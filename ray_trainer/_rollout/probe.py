"""On rank 0 of the training workers: does the engine hold the trainer's weights? The probe.

After each weight sync the engine scores a fixed probe completion (its prompt and tokens, chosen
once) and the trainer scores it with its own forward; ``rollout/logprob_diff`` is the largest
difference of their per-token log-probs. The ``hf`` engine in fp32 on the same weights is exact
to 1e-5; a bigger difference is a sync that missed a weight, another dtype, or another engine's
numerics (vLLM's: reported, not bounded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The probe's metric: the largest absolute per-token log-prob difference.
PROBE_METRIC = "rollout/logprob_diff"


@dataclass(frozen=True)
class Probe:
    """A fixed completion both sides score: token ids, and the sampling temperature."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    temperature: float = 1.0

    @classmethod
    def of(cls, completion: Any, temperature: float = 1.0) -> Probe:
        """The probe of a `Completion` (the first of a run's first rollout, say)."""
        return cls(tuple(completion.prompt_ids), tuple(completion.completion_ids), temperature)


def trainer_logprobs(model: Any, probe: Probe) -> list[float]:
    """The trainer's side: one plain forward of the probe's whole sequence through `model`
    (no padding, every logit), ``log_softmax(logits / temperature)`` at each completion token."""
    import torch

    ids = torch.tensor([[*probe.prompt_ids, *probe.completion_ids]])
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=ids.to(device)).logits[0].float()
    start = len(probe.prompt_ids) - 1
    scores = logits[start : start + len(probe.completion_ids)] / probe.temperature
    target = torch.tensor(probe.completion_ids, device=device).unsqueeze(-1)
    return torch.log_softmax(scores, dim=-1).gather(-1, target).squeeze(-1).tolist()


def logprob_diff(engine: list[float], trainer: list[float]) -> float:
    """The largest absolute difference of two per-token log-prob lists of one completion."""
    if len(engine) != len(trainer) or not engine:
        raise ValueError(
            f"the probe's log-probs differ in length: the engine's {len(engine)}, the "
            f"trainer's {len(trainer)}; both must score the same completion"
        )
    return max(abs(a - b) for a, b in zip(engine, trainer, strict=True))


def probe_metrics(engine: list[float], trainer: list[float]) -> dict[str, float]:
    """``{"rollout/logprob_diff": ...}`` for the step's metrics."""
    return {PROBE_METRIC: logprob_diff(engine, trainer)}
