"""Training worker: a causal LM's loss, or its targets' log-probabilities, without its logits.

A causal LM's head turns each position's last hidden state into a row of logits over the whole
vocabulary; the usual loss makes every row at once, upcast to fp32, and keeps them for backward:
``positions x vocab x 4`` bytes, and as much again for their gradient (4 GiB each for one
8,192-token sequence at a 128k vocabulary). Here only the positions that have a target are
taken (in chat data most have none), and the head and the cross-entropy run on a chunk of
``chunk_size`` of them at a time under activation checkpointing: forward keeps a chunk's
inputs, never its logits, and backward recomputes one chunk's logits at a time. So no
``[positions, vocab]`` tensor larger than one chunk is ever alive. The head is called as the
module it is, so a LoRA layer on it (peft) trains.

`token_nll` is the primitive: each target's negative log-likelihood, in order. The loss is its
sum (`chunked_loss_sum`); DPO sums the log-probabilities per sequence (`sequence_logprobs`).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ray_trainer._data.encode import IGNORE_INDEX

#: A chunk's fp32 logits are kept near this many bytes (256 positions at a 32k vocabulary) ...
CHUNK_BYTES = 32 * 2**20
#: ... and a chunk has at least this many positions. Each chunk writes and adds a whole
#: gradient of the head's weight (vocab x hidden), whatever its size: with 64-position chunks
#: at a 128k vocabulary that made the step 1.8x slower on CPU than 256-position ones
#: (bench_memory's loss phase), for 96 MiB less at the peak.
MIN_CHUNK = 256


def default_chunk_size(vocab_size: int) -> int:
    """Positions per chunk: one chunk's fp32 logits near `CHUNK_BYTES`, and at least
    `MIN_CHUNK` positions (256 from a 32k vocabulary up: 128 MiB of logits at 128k)."""
    return max(MIN_CHUNK, CHUNK_BYTES // (4 * max(1, vocab_size)))


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """The target of each position of a causal LM: ``labels[t + 1]`` at ``t``, and none at the
    last position (as Hugging Face's ``ForCausalLMLoss`` shifts them)."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def token_nll(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    chunk_size: int,
) -> torch.Tensor:
    """The negative log-likelihood of every target, as one fp32 vector in the order of the
    positions that have one (``targets != -100``). `hidden` is ``[..., positions, dim]`` and
    `targets` ``[..., positions]`` (already shifted). Differentiable w.r.t. `hidden` and the
    head's parameters; only one chunk's logits are alive at a time, forward or backward."""
    if chunk_size < 1:
        raise ValueError(f"loss_chunk_size must be at least 1, got {chunk_size}")
    keep = targets != IGNORE_INDEX
    picked = hidden[keep]  # [N, dim]: the positions that take a loss, and no other
    wanted = targets[keep]
    # Without a gradient (DPO's in-step reference, validation) nothing is kept to recompute.
    run = _checkpointed if torch.is_grad_enabled() else _chunk_nll
    pieces = [
        run(head, h, t)
        for h, t in zip(picked.split(chunk_size), wanted.split(chunk_size), strict=True)
    ]
    if not pieces:
        return picked.new_zeros(0, dtype=torch.float32)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _checkpointed(head: Callable, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return checkpoint(_chunk_nll, head, hidden, targets, use_reentrant=False)


def _chunk_nll(head: Callable, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, reduction="none")


def chunked_loss_sum(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    chunk_size: int,
) -> torch.Tensor:
    """The sum of the targets' negative log-likelihoods (fp32 scalar). With no target at all
    (a rank's filler micro-batch), an exact zero that still reaches every parameter of the head,
    so DDP and FSDP see a gradient for each (a zero one)."""
    nll = token_nll(hidden, targets, head, chunk_size)
    if nll.numel():
        return nll.sum()
    probe = hidden.reshape(-1, hidden.shape[-1])[:1]
    return head(probe).float().sum() * 0.0


def sequence_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    sequence: torch.Tensor,
    num_sequences: int,
    head: Callable[[torch.Tensor], torch.Tensor],
    chunk_size: int,
) -> torch.Tensor:
    """Each sequence's summed target log-probability (fp32, ``[num_sequences]``): what DPO
    compares. `sequence` gives each position's sequence index (``[..., positions]``, the
    shape of `targets`); in a packed row, several sequences share the row."""
    nll = token_nll(hidden, targets, head, chunk_size)
    index = sequence[targets != IGNORE_INDEX]
    out = torch.zeros(num_sequences, dtype=torch.float32, device=hidden.device)
    if not nll.numel():  # no target (a rank's filler): zeros that still reach the head
        probe = hidden.reshape(-1, hidden.shape[-1])[:1]
        return out + head(probe).float().sum() * 0.0
    return out.index_add(0, index, -nll)


# ---- on a Hugging Face causal LM -----------------------------------------------------------

#: The families (``config.model_type``) whose logits are a plain projection of the last hidden
#: states by ``get_output_embeddings()``, checked against their ``forward`` in transformers 5.
CHUNKED_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2"})
#: Config fields that change the logits after the head (softcapping, scales): the model's own
#: loss is kept when one of them is set.
_LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def why_not_chunked(model: torch.nn.Module) -> str | None:
    """Why the chunked loss does not apply to this Hugging Face causal LM (None: it does)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in CHUNKED_FAMILIES:
        return (
            f"model type {kind!r} is not one checked for it ({', '.join(sorted(CHUNKED_FAMILIES))})"
        )
    for name in _LOGIT_CHANGES:
        if getattr(config, name, None) not in (None, 1, 1.0):
            return f"its config sets {name}, which changes the logits after the head"
    if getattr(config, "output_router_logits", False):
        return "it adds a mixture of experts' auxiliary loss"
    if model.get_output_embeddings() is None or _body(model) is None:
        return "it has no output embeddings or no base model to take the hidden states from"
    return None


def _body(model: torch.nn.Module) -> torch.nn.Module | None:
    return getattr(model, getattr(model, "base_model_prefix", ""), None)


def use_chunked_loss(model: torch.nn.Module, chunk_size: int | None) -> str | None:
    """Make `model` (a Hugging Face causal LM, or a peft model around one) compute its loss
    with `chunked_loss_sum` whenever labels are given: its own ``forward`` is replaced on the
    instance, so the model stays the module it is (its parameter names, FSDP2's root). Without
    labels (generation, the packing check) it is the model's own forward. Returns why it does
    not apply, or None once applied."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    reason = why_not_chunked(inner)
    if reason is not None:
        return reason
    inner._ray_trainer_chunk_size = chunk_size or default_chunk_size(inner.config.vocab_size)
    # A method of the instance (a deepcopy of the model binds it to the copy), over the class's
    # own forward (FSDP2 subclasses the class in place; its forward is the model's).
    inner.forward = types.MethodType(_chunked_forward, inner)
    return None


def _chunked_forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None,
                     num_items_in_batch=None, sequences=None, **kwargs):  # fmt: skip
    """A chunked model's forward: with labels, the body, then `chunked_loss_sum` over the
    shifted labels, divided by ``num_items_in_batch`` (the runner's constant norm) or, as the
    model's own loss does without it, by the number of targets. Only the loss is returned.
    With ``sequences=(sequence, n)`` (DPO), ``{"logps"}``: each of the ``n`` sequences' summed
    target log-probability (`sequence_logprobs`), in place of the loss."""
    if labels is None or kwargs.get("inputs_embeds") is not None:
        return type(self).forward(
            self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            labels=labels, num_items_in_batch=num_items_in_batch, **kwargs,
        )  # fmt: skip
    kwargs.pop("use_cache", None)
    shift = kwargs.pop("shift_labels", None)
    outputs = _body(self)(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **kwargs,
    )
    targets = shift if shift is not None else shifted_targets(labels)
    head, chunk = self.get_output_embeddings(), self._ray_trainer_chunk_size
    if sequences is not None:
        sequence, n = sequences
        return {"logps": sequence_logprobs(outputs[0], targets, sequence, n, head, chunk)}
    total = chunked_loss_sum(outputs[0], targets, head, chunk)
    if num_items_in_batch is None:
        num_items_in_batch = (targets != IGNORE_INDEX).sum().clamp(min=1)
    return {"loss": total / num_items_in_batch}


def chunked_body(model: torch.nn.Module) -> torch.nn.Module | None:
    """The base model (the transformer body) of a model `use_chunked_loss` changed, else None:
    what ``compile=True`` compiles, so that the chunk loop stays eager."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _body(inner) if hasattr(inner, "_ray_trainer_chunk_size") else None
