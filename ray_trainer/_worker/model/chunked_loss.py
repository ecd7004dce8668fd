"""Training worker: a causal LM's loss, or its targets' log-probabilities, without its logits.

A causal LM's head turns each position's last hidden state into a row of logits over the whole
vocabulary; the usual loss makes every row at once, upcast to fp32, and keeps them for backward:
``positions x vocab x 4`` bytes, and as much again for their gradient (4 GiB each for one
8,192-token sequence at a 128k vocabulary). Here the head and the cross-entropy run on a chunk
of ``chunk_size`` positions at a time, so no ``[positions, vocab]`` tensor larger than one chunk
is ever alive. The loss of a plain linear head (`_FusedNllSum`) computes each chunk's gradients
in forward and backward only scales them; on the CPU it takes only the positions that have a
target (in chat data most have none), on a GPU every position at fixed shapes (no host sync).
Other heads (a LoRA layer on ``lm_head``, called as the module it is, so it trains) and the
per-token primitive run each chunk under activation checkpointing: forward keeps a chunk's
inputs, never its logits, and backward recomputes one chunk's logits at a time.

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


#: On a GPU a chunk's fp32 logits are kept near this many bytes (2,000 positions at a 128k
#: vocabulary). There every chunk's fixed cost (writing and adding a whole gradient of the head's
#: weight) is paid in memory bandwidth: 256-position chunks made a GPT-2 124M step 1.46x slower
#: than the model's own loss on an H100 (2026-11-26), 2,048-position ones 1.19x.
CHUNK_BYTES_GPU = 2**30

#: On a GPU the head's three products per chunk run on tensor-core kernels only when every
#: dimension is a multiple of this: a vocabulary that is not (GPT-2's 50,257) is padded to one
#: with rows of zeros whose logits are set to -inf, and a chunk's positions are rounded down to
#: one. Unpadded, an H100 ran GPT-2's head products on a Turing-era kernel (``cutlass_75 ...
#: s1688gemm``): 15.7 ms of a 36.9 ms compiled step (2026-11-27); nanoGPT pads its vocabulary to
#: 50,304 for the same reason.
GPU_ALIGN = 64


def default_chunk_size(vocab_size: int, device_type: str = "cpu") -> int:
    """Positions per chunk: one chunk's fp32 logits near `CHUNK_BYTES` (on a GPU
    `CHUNK_BYTES_GPU`, rounded down to a multiple of `GPU_ALIGN`), and at least `MIN_CHUNK`
    positions (256 from a 32k vocabulary up: 128 MiB of logits at 128k)."""
    if device_type != "cpu":
        size = CHUNK_BYTES_GPU // (4 * max(1, vocab_size))
        return max(MIN_CHUNK, size // GPU_ALIGN * GPU_ALIGN)
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
    if torch.is_grad_enabled() and _plain_linear(head):
        return _fused_sum(hidden, targets, head, chunk_size)
    nll = token_nll(hidden, targets, head, chunk_size)
    if nll.numel():
        return nll.sum()
    return _zero_through(hidden, head)


def _zero_through(hidden: torch.Tensor, head: Callable) -> torch.Tensor:
    """An exact zero that reaches every parameter of the head (a zero gradient for each)."""
    probe = hidden.reshape(-1, hidden.shape[-1])[:1]
    return head(probe).float().sum() * 0.0


def _plain_linear(head: Callable) -> bool:
    """A head whose logits are ``F.linear(hidden, weight, bias)`` and nothing else (not a LoRA
    layer, not a subclass that adds to it): the fused loss may take its weight directly."""
    return type(head) is torch.nn.Linear


def _fused_sum(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: torch.nn.Linear,
    chunk_size: int,
    select: bool | None = None,
    align: int | None = None,
) -> torch.Tensor:
    """`chunked_loss_sum` for a plain linear head: each chunk's gradients are computed in
    forward (`_FusedNllSum`), so backward recomputes nothing. On the CPU only the positions
    with a target are taken (their count is read at once, which costs nothing there); on a GPU
    every position is, at fixed shapes, so the host never waits for the device and a compiled
    step keeps one graph: positions without a target add a zero (`select` overrides which).
    On a GPU the vocabulary is padded to a multiple of `GPU_ALIGN` (`align` overrides it)."""
    if chunk_size < 1:
        raise ValueError(f"loss_chunk_size must be at least 1, got {chunk_size}")
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    on_cpu = hidden.device.type == "cpu"
    if on_cpu if select is None else select:
        keep = flat_t != IGNORE_INDEX
        flat_h, flat_t = flat_h[keep], flat_t[keep]
        if not flat_t.numel():
            return _zero_through(hidden, head)
    if align is None:
        align = 1 if on_cpu else GPU_ALIGN
    return _FusedNllSum.apply(flat_h, head.weight, head.bias, flat_t, chunk_size, align)


class _FusedNllSum(torch.autograd.Function):
    """The summed negative log-likelihood of `targets` under ``F.linear(hidden, weight, bias)``,
    a chunk of positions at a time, with the gradients of hidden, weight and bias computed in
    the same pass (softmax minus the target's one-hot, through the head's two products) and
    kept for backward, which only scales them by the loss's incoming gradient. Per chunk, only
    its fp32 log-probabilities and their softmax in the products' dtype are alive. Under
    autocast the products run in its dtype (as the head's own forward and backward would), each
    chunk's weight gradient added to an fp32 sum. With `align` above 1 the vocabulary is
    padded to a multiple of it (zero rows whose logits are -inf: they take no probability and
    get no gradient), so that every product has aligned dimensions."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, align=1):  # type: ignore[override]
        want_h, want_w, want_b = ctx.needs_input_grad[:3]  # only what autograd will ask for
        dtype = torch.get_autocast_dtype(hidden.device.type)
        if not torch.is_autocast_enabled(hidden.device.type):
            dtype = hidden.dtype  # QLoRA's bf16 head computes in the run's dtype (nf4.py)
        vocab = weight.shape[0]
        pad = -vocab % align
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        if pad:  # one copy of the head a step (tens of MB), for products at full speed
            w = F.pad(w, (0, 0, 0, pad))
            b = None if b is None else F.pad(b, (0, pad))
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=weight.device) if want_w else None  # fmt: skip
        grad_b = torch.zeros(b.shape, dtype=torch.float32, device=bias.device) if want_b else None  # fmt: skip
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start : start + chunk_size].to(dtype)
            t = targets[start : start + chunk_size]
            valid = (t != IGNORE_INDEX).unsqueeze(1)
            picked = t.clamp(min=0).unsqueeze(1)
            # Three passes over the chunk's logits: the product (in its dtype), log-softmax
            # (fp32 out) and exp (back into the product's dtype): the memory traffic is what
            # this costs on a GPU. Positions without a target are masked on the hidden side.
            logits = F.linear(h, w, b)
            if pad:
                logits[:, vocab:] = float("-inf")
            logp = F.log_softmax(logits, -1, dtype=torch.float32)
            del logits
            picked_logp = logp.gather(1, picked)
            total -= (picked_logp * valid).sum()
            # d(nll)/d(logits): softmax minus the target's one-hot (the target's entry from
            # fp32, so p - 1 is rounded once, as autograd's cross-entropy does).
            g = logp.exp_() if dtype == torch.float32 else torch.exp(logp, out=torch.empty_like(logp, dtype=dtype))  # fmt: skip
            del logp
            g.scatter_(1, picked, (picked_logp.exp_() - 1).to(dtype))
            mask = valid.to(dtype)
            if grad_h is not None:
                grad_h[start : start + chunk_size] = (g @ w) * mask
            if grad_w is not None:
                grad_w += g.t() @ (h * mask)
            if grad_b is not None:
                grad_b += (mask.t() @ g).squeeze(0)
        # The hidden states' gradient is saved as activations are (activation offloading may
        # move it); the head's are kept on the device as the parameters are.
        ctx.save_for_backward(*(() if grad_h is None else (grad_h,)))
        ctx.head_grads = tuple(None if g is None else g[:vocab] for g in (grad_w, grad_b))
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        grads = (ctx.saved_tensors[0] if ctx.saved_tensors else None, *ctx.head_grads)
        scaled = [
            None if g is None else (g * grad_out).to(dtype)
            for g, dtype in zip(grads, ctx.dtypes, strict=True)
        ]
        return (*scaled, None, None, None)


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
    # None: `default_chunk_size` on the device the hidden states are on, at each call.
    inner._ray_trainer_chunk_size = chunk_size
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
    if chunk is None:
        chunk = default_chunk_size(self.config.vocab_size, outputs[0].device.type)
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
