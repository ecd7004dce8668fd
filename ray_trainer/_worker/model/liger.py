"""Training worker: liger-kernel's Triton kernels and fused linear cross-entropy on a causal LM.

With ``liger_kernel`` on (True, or None where `LIGER_BY_DEFAULT` says so), a Hugging Face
causal LM of a family liger-kernel patches (`LIGER_FAMILIES`) on a GPU worker gets liger's
RMSNorm, RoPE and SwiGLU (``_apply_liger_kernel_to_instance``, as HF Trainer applies it), and
its next-token loss is liger's fused linear cross-entropy: the head and the cross-entropy run a
chunk of positions at a time in Triton, never holding the full logits, in place of the chunked
loss's `_FusedNllSum`. The chunked loss stays under it for everything else (DPO's per-sequence
log-probs, ``compile=True`` compiling the body only): `use_liger` applies `use_chunked_loss`
first and only takes over the summed loss. Nothing here imports liger-kernel until it is
applied: without triton (on a CPU) it cannot be imported.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

from ray_trainer._config.args import TrainingArgs
from ray_trainer._data.encode import IGNORE_INDEX
from ray_trainer._model.liger_probe import (
    LIGER_BY_DEFAULT,
    missing_liger_kernel,
    unsupported_family,
)
from ray_trainer._worker.model.chunked_loss import (
    shifted_targets,
    use_chunked_loss,
    why_not_chunked,
)

logger = logging.getLogger("ray_trainer")


def liger_wanted(args: TrainingArgs) -> bool:
    """Whether the run asks for liger-kernel: ``liger_kernel``, or the measured default."""
    return LIGER_BY_DEFAULT if args.liger_kernel is None else args.liger_kernel


def why_not_liger(model: torch.nn.Module, use_gpu: bool) -> str | None:
    """Why liger-kernel cannot run on `model` (a Hugging Face causal LM, or a peft model around
    one) in this worker, or None: no GPU here, triton or liger-kernel missing, a family it does
    not patch, a head that is not a plain linear layer (LoRA on ``lm_head``), or logits changed
    after the head."""
    if use_gpu and not torch.cuda.is_available():
        return "liger_kernel=True: this worker sees no GPU (torch.cuda.is_available() is False)"
    problem = missing_liger_kernel(use_gpu)
    if problem:
        return problem
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    problem = unsupported_family(getattr(getattr(inner, "config", None), "model_type", None))
    if problem:
        return problem
    reason = why_not_chunked(inner)
    if reason is not None:
        return f"liger_kernel=True: the fused linear cross-entropy does not apply: {reason}"
    if type(inner.get_output_embeddings()) is not torch.nn.Linear:
        return (
            "liger_kernel=True: the model's head is not a plain linear layer (LoRA on lm_head?), "
            "whose weight liger's fused linear cross-entropy takes; keep lm_head out of the "
            "LoRA targets, or set liger_kernel=False"
        )
    return None


def use_liger(model: torch.nn.Module, args: TrainingArgs) -> str | None:
    """Apply liger-kernel to `model` (the run asks for it: `liger_wanted`) where it can run
    here: None once applied, else why not. Raises when ``liger_kernel=True`` and it cannot run
    (the driver has checked what it could; this worker's node, packages or model may differ);
    with the default (None) the caller falls back to the chunked loss instead."""
    reason = why_not_liger(model, args.use_gpu)
    if reason is not None:
        if args.liger_kernel:
            raise RuntimeError(reason)
        return reason
    # It applies: why_not_liger has asked why_not_chunked, of a subset of its families.
    use_chunked_loss(model, args.loss_chunk_size)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    _apply_kernels(inner)
    # Over the chunked forward (a method of the instance: a deepcopy binds it to the copy).
    inner._ray_trainer_chunked_forward = inner.forward
    inner.forward = types.MethodType(_liger_forward, inner)
    return None


def _apply_kernels(model: torch.nn.Module) -> None:
    """liger-kernel's RMSNorm, RoPE and SwiGLU on this instance; its losses stay off (the loss
    is `_liger_forward`'s)."""
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(
        model=model, fused_linear_cross_entropy=False, cross_entropy=False
    )


def fused_linear_ce_sum(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
) -> torch.Tensor:
    """The summed cross-entropy of ``F.linear(hidden, weight, bias)`` against `targets` (fp32
    scalar; -100 ignored), by liger-kernel's fused linear cross-entropy. `hidden` is
    ``[positions, dim]``, `targets` ``[positions]``. It reads the count of targets on the host
    (one host-device sync per call, inside liger-kernel)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(
        hidden, weight, targets, bias, ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _liger_forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None,
                   num_items_in_batch=None, sequences=None, **kwargs):  # fmt: skip
    """A liger model's forward: with labels, the body, then `fused_linear_ce_sum` over the
    shifted labels, divided by ``num_items_in_batch`` (the runner's constant norm) or, as the
    model's own loss does without it, by the number of targets. Only the loss is returned.
    Anything else (no labels, DPO's ``sequences``, ``inputs_embeds``): the chunked forward."""
    if labels is None or sequences is not None or kwargs.get("inputs_embeds") is not None:
        return self._ray_trainer_chunked_forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            labels=labels, num_items_in_batch=num_items_in_batch, sequences=sequences, **kwargs,
        )  # fmt: skip
    kwargs.pop("use_cache", None)
    shift = kwargs.pop("shift_labels", None)
    body = getattr(self, self.base_model_prefix)
    outputs = body(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **kwargs,
    )
    hidden = outputs[0]
    targets = shift if shift is not None else shifted_targets(labels)
    head = self.get_output_embeddings()
    weight = head.weight  # QLoRA's bf16 head (nf4.py): in the hidden states' dtype
    weight = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
    total = fused_linear_ce_sum(
        hidden.reshape(-1, hidden.shape[-1]), weight, head.bias, targets.reshape(-1)
    )
    if num_items_in_batch is None:
        num_items_in_batch = (targets != IGNORE_INDEX).sum().clamp(min=1)
    return {"loss": total / num_items_in_batch}


def liger_applied(model: Any) -> bool:
    """Whether `use_liger` changed this model (or the model inside a peft model)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return hasattr(inner, "_ray_trainer_chunked_forward")
