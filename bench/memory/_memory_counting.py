"""Runs in bench_memory's rank processes: the bytes of a rank's training state.

What counts as a rank's bytes of parameters, gradients and optimizer state: for a DTensor its
local shard (``to_local()``), for a plain tensor the whole of it. Shared by the state phase
(``bench_memory.py``) and the LoRA phase (``_memory_lora.py``); pure, unit-tested in
tests/unit/test_bench_memory.py.
"""

from __future__ import annotations

from typing import Any


def local_bytes(tensor: Any) -> int:
    """Bytes this rank holds of `tensor`: a DTensor's local shard, else the whole tensor."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def state_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (each tied parameter
    once: `parameters()` yields it once)."""
    import torch

    params = list(model.parameters())
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            local_bytes(v)
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ),
    }
