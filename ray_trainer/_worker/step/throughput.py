"""Training worker: honest throughput and MFU, from tokens that are not padding.

Runs in each training worker. A batch's tokens are its attention mask's ones, else its input ids
that are not the dataset's pad id (when the workload knows it), else its positions whose label is
not -100, else every input id: padding never counts. The window
between two logs sums the agreed tokens (every rank's) and this rank's step times; at a log it
gives tokens/s, the padding share and MFU: model FLOPs per token (6 x parameters, plus
attention: 12 x layers x width x sequence length, as in the PaLM paper's appendix) times tokens/s
over the peak of every device (a table of known GPUs, or ``TrainingArgs.peak_flops``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: Dense bf16 tensor-core peaks, FLOP/s, by a substring of the CUDA device name (first match;
#: vendors' data sheets, without sparsity). Anything else: give TrainingArgs.peak_flops.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
)


def count_tokens(batch: dict[str, torch.Tensor], pad_id: int | None = None) -> tuple[Any, int]:
    """(tokens that are not padding, positions) of a batch; the first may be a device tensor
    (counting it on the device needs no sync)."""
    ids = batch.get("input_ids")
    positions = ids.numel() if ids is not None else 0
    mask = batch.get("attention_mask")
    if mask is not None:
        return mask.sum(), positions
    if pad_id is not None and ids is not None:
        return (ids != pad_id).sum(), positions
    labels = batch.get("labels")
    if labels is not None and ids is not None and labels.shape == ids.shape:
        return (labels != -100).sum(), positions
    return positions, positions


def peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """The peak FLOP/s of one device: the override, else the table for a known GPU, else None
    (a CPU, or an unknown GPU)."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs of a token depend on."""

    params: int
    layers: int | None = None
    width: int | None = None


def model_shape(model: torch.nn.Module) -> ModelShape:
    """Parameters (all of them, whole: a sharded DTensor counts its global size), and the
    layers and width a Hugging Face or demo config states (None when unknown)."""
    params = sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    layers = _first(config, ("num_hidden_layers", "n_layer", "n_layers"))
    width = _first(config, ("hidden_size", "n_embd", "d_model"))
    return ModelShape(params, layers, width)


def _first(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def flops_per_token(shape: ModelShape, seq_len: float) -> float:
    """Training FLOPs per token: 6 x parameters (forward and backward of every weight), plus
    the attention scores and their use, 12 x layers x width x sequence length, when known."""
    flops = 6.0 * shape.params
    if shape.layers and shape.width:
        flops += 12.0 * shape.layers * shape.width * seq_len
    return flops


def mfu(tokens_per_s: float, per_token: float, peak: float | None, devices: int) -> float | None:
    """Model FLOPs utilisation: the model's FLOP/s over the peak of every device."""
    if not peak or devices <= 0:
        return None
    return tokens_per_s * per_token / (peak * devices)


class Window:
    """What happened since the last log: agreed tokens and positions, samples, and this rank's
    step time. `close` gives the log's metrics and starts a new window."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.positions = 0.0
        self.samples = 0
        self.seconds = 0.0

    def add_step(self, seconds: float, samples: int) -> None:
        self.seconds += seconds
        self.samples += samples

    def add_agreed(self, tokens: float, positions: float) -> None:
        self.tokens += tokens
        self.positions += positions

    def close(self, shape: ModelShape, peak: float | None, devices: int) -> dict[str, float]:
        """tokens_per_s, padding_share and (with a peak) mfu of the window; then reset."""
        metrics: dict[str, float] = {}
        if self.seconds > 0:
            metrics["tokens_per_s"] = self.tokens / self.seconds
        if self.positions > 0:
            metrics["padding_share"] = 1.0 - self.tokens / self.positions
        if "tokens_per_s" in metrics and self.samples:
            seq_len = self.positions / self.samples
            value = mfu(metrics["tokens_per_s"], flops_per_token(shape, seq_len), peak, devices)
            if value is not None:
                metrics["mfu"] = value
        self.__init__()
        return metrics
