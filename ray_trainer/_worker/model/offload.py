"""Training worker: saved activations moved to host memory in forward, back for backward.

``offload_activations=True``. What autograd saves for backward (each layer's inputs, and under
activation checkpointing only the checkpointed blocks' inputs) stays on the GPU until backward
reads it, a few GiB for long sequences. `ActivationOffload` is a pair of
``saved_tensors_hooks`` around each micro-batch's forward: a saved tensor of at least
`min_bytes` that is not a parameter is copied into pinned host memory on a side stream (the
copy overlaps the forward's next kernels; the tensor's GPU memory returns to the allocator once
the copy is done), and copied back when backward unpacks it. Parameters (FSDP2's gathered ones
too) and small tensors stay where they are.

On a machine without a GPU there is nothing to move: the runner says so once and trains as
usual. The hook logic is the same with ``host_copies=True`` on CPU (unpinned copies), which is
how the unit tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: Saved tensors smaller than this stay on the device: the copy would cost more than it frees.
MIN_BYTES = 1 << 20


@dataclass
class _Offloaded:
    device: torch.device
    host: torch.Tensor
    event: Any  # the side stream's copy-done event (None on CPU)


@dataclass
class ActivationOffload:
    """Enter around a forward: its saved activations go to the host (see the module's text).
    `offloaded` and `offloaded_bytes` count what was moved since it was built."""

    device: torch.device
    min_bytes: int = MIN_BYTES
    host_copies: bool = False  # on CPU: copy anyway (the unit tests' way to check the hooks)
    offloaded: int = 0
    offloaded_bytes: int = 0
    _stream: Any = field(default=None, repr=False)
    _hooks: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    @property
    def active(self) -> bool:
        return self.device.type == "cuda" or self.host_copies

    def __enter__(self) -> ActivationOffload:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def pack(self, tensor: torch.Tensor) -> Any:
        size = tensor.numel() * tensor.element_size()
        if size < self.min_bytes or isinstance(tensor, torch.nn.Parameter):
            return tensor
        if tensor.device.type == "cpu" and not self.host_copies:
            return tensor
        pinned = tensor.device.type == "cuda"
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
        event = None
        if pinned:
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the value is written
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
                event = stream.record_event()
            tensor.record_stream(stream)  # its memory is reused only after the copy
        else:
            host.copy_(tensor)
        self.offloaded += 1
        self.offloaded_bytes += size
        return _Offloaded(tensor.device, host, event)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.event is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.event)
        return packed.host.to(packed.device, non_blocking=packed.event is not None)


def build_offload(enabled: bool, device: torch.device, rank: int) -> ActivationOffload | None:
    """The run's offloader, or None: not asked for, or no GPU (said once, by rank 0)."""
    if not enabled:
        return None
    if device.type != "cuda":
        if rank == 0:
            print(
                "ray-trainer: offload_activations=True has nothing to move without a GPU "
                f"(device {device}); training as usual",
                flush=True,
            )
        return None
    return ActivationOffload(device)
