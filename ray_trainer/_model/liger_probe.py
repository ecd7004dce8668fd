"""Driver and workers: whether liger-kernel can run here, and on which model families.

``liger_kernel=True`` is checked in the driver before training (GPU workers, the triton and
liger-kernel packages, a model family liger-kernel patches), and again in each worker, whose
node may differ and whose model is the one built. Nothing here imports liger-kernel or triton:
on a CPU they are absent, and importing liger-kernel without triton fails.
"""

from __future__ import annotations

import importlib.util

#: Whether ``liger_kernel=None`` (the default) turns liger-kernel on where it can run. Off until
#: a GPU lease shows it faster than the chunked loss (bench/gpu tables 1 and 6, docs/gpu.md).
LIGER_BY_DEFAULT = False

#: The Hugging Face families (``config.model_type``) that liger-kernel 0.8.5 patches (RMSNorm,
#: RoPE, SwiGLU) and whose head the chunked loss also takes: their logits are a plain projection
#: of the last hidden states, which liger's fused linear cross-entropy computes without them.
LIGER_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3"})

_FIX = "set liger_kernel=False (or leave it None: on only where it can run and is faster)"


def missing_liger_kernel(use_gpu: bool) -> str | None:
    """What liger-kernel lacks in this process, or None: GPU workers, the triton package and
    the liger-kernel package. Checked in the driver and again in each worker."""
    if not use_gpu:
        return (
            "liger_kernel=True runs liger-kernel's Triton kernels, on GPU workers only: set "
            f"use_gpu=True, or {_FIX}; on the CPU the chunked loss (chunked_loss=True) keeps "
            "the full logits out of memory"
        )
    if importlib.util.find_spec("triton") is None:
        return f"liger_kernel=True needs the triton package (pip install triton), or {_FIX}"
    if importlib.util.find_spec("liger_kernel") is None:
        return (
            "liger_kernel=True needs the liger-kernel package: pip install 'ray-trainer[gpu]' "
            f"(liger-kernel>=0.8.5) on every node, or {_FIX}"
        )
    return None


def unsupported_family(model_type: str | None) -> str | None:
    """Why liger-kernel does not apply to a model of this ``config.model_type`` (None: it
    does)."""
    if model_type in LIGER_FAMILIES:
        return None
    return (
        f"liger_kernel=True: model type {model_type!r} is not one liger-kernel is applied to "
        f"here ({', '.join(sorted(LIGER_FAMILIES))}); {_FIX}"
    )
