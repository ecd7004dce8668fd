"""Training worker: attention over a packed row, each sample on its own, without a T x T mask.

Runs in each training worker of a packed run on a Hugging Face model. transformers keeps packed
samples apart by building a [T, T] block mask from the restarting ``position_ids``; on the CPU
(and on a GPU without flash-attn) SDPA then computes every position against every other, masked:
on a 2,048-token row of 8 samples that was 19x the attention time of the samples alone, here.
So a packed run registers ``ray_trainer_packed`` with transformers' ``AttentionInterface`` and
sets it on the model: the loader hands each packed row's layout (`PackedLayout`, planned on the
host by ``ray_trainer._data.packing``: which positions belong to which sample) as a keyword the
model passes down to attention, which gathers the samples into a padded batch of similar
lengths, runs SDPA causally (the fused kernels, no mask) and scatters the result back. With no
layout (validation, padded batches) it is SDPA with the batch's padding mask.

Under ``torch.compile`` (``compile=True``) the groups would recompile the model for every new
row: their sizes and their number are shapes and list lengths dynamo guards on (issue 49). There
attention reads the layout's ``segments`` instead, one tensor of the row's width (``compile=True``
pads every packed row to the packing budget), and runs SDPA once over the row with a causal mask
that keeps each sample to itself: one graph for every row, at the cost of the T x T attention
the groups avoid (the mask is built on the device from the segments, in the graph). The check in
``packing_check.py`` runs the real model through this path before training.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ray_trainer._data.packing import PackedLayout

NAME = "ray_trainer_packed"


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed: PackedLayout | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature: query [B, H, T, D], key and value
    [B, Hkv, T, D]; returns [B, T, H, D]. Packed rows (B = 1) take their samples one group at a
    time (in one masked SDPA under torch.compile); anything else is causal SDPA with the 2-D
    padding mask the model passed through."""
    gqa = key.shape[1] != query.shape[1]
    if packed is None:
        return _dense(query, key, value, attention_mask, dropout, scaling, gqa), None
    if torch.compiler.is_compiling():  # one graph for every row: see the module's docstring
        return _segments(query, key, value, packed.segments, dropout, scaling, gqa), None
    return _grouped(query, key, value, packed, dropout, scaling, gqa), None


def _grouped(query, key, value, packed: PackedLayout, dropout, scaling, gqa) -> torch.Tensor:
    """A packed row (B = 1) one group of samples at a time: [1, T, H, D]."""
    heads, t = query.shape[1], query.shape[2]
    out = None  # in SDPA's dtype: under autocast, bf16 from an fp32 query (rotary in fp32)
    for gather, keep, place, g, width in packed.groups:
        q, k, v = (_group(x[0], gather, g, width) for x in (query, key, value))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
        )  # [g, H, L, D]
        y = y.transpose(0, 1).reshape(heads, g * width, -1)
        if out is None:
            out = y.new_empty(heads, t, y.shape[-1])
        out.index_copy_(1, place, y.index_select(1, keep))
    return out.unsqueeze(0).transpose(1, 2).contiguous()


def _segments(q, k, v, segments: torch.Tensor, dropout, scaling, gqa) -> torch.Tensor:
    """A packed row (B = 1) in one SDPA, each position seeing the positions before it in its own
    sample (itself included, so no row of the mask is empty): [1, T, H, D]."""
    seg = segments.view(-1)
    t = seg.shape[0]
    keep = (seg[:, None] == seg[None, :]) & _causal(t, q.device)
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=keep[None, None], dropout_p=dropout, scale=scaling, enable_gqa=gqa
    )
    return y.transpose(1, 2).contiguous()


def _group(x: torch.Tensor, gather: torch.Tensor, g: int, width: int) -> torch.Tensor:
    """[H, T, D] -> the group's samples padded: [g, H, L, D]."""
    return x.index_select(1, gather).view(x.shape[0], g, width, x.shape[-1]).transpose(0, 1)


def _causal(t: int, device: Any) -> torch.Tensor:
    """[T, T]: True where a position may attend (itself and the positions before it)."""
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()


def _dense(q, k, v, mask2d, dropout, scaling, gqa) -> torch.Tensor:
    """Causal SDPA over a padded batch: a 2-D mask (1 = token) becomes a [B, 1, T, T] one; a
    batch without padding runs the fused causal kernel."""
    if mask2d is not None and mask2d.dim() == 2 and not bool(mask2d.all()):
        t = q.shape[2]
        keep = mask2d.bool()[:, None, None, :] & _causal(t, q.device)
        keep = keep | torch.eye(t, dtype=torch.bool, device=q.device)  # a pad row sees itself
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, dropout_p=dropout, scale=scaling, enable_gqa=gqa
        )
    elif mask2d is not None and mask2d.dim() == 4:
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask2d, dropout_p=dropout, scale=scaling, enable_gqa=gqa
        )
    else:
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
        )
    return y.transpose(1, 2).contiguous()


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Register `packed_attention` with transformers and set it on a Hugging Face model whose
    attention is SDPA (a model set to eager, flex or flash attention keeps it: transformers
    keeps packed samples apart there, by its mask or by the sequence boundaries). True when
    set."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(
        model, "set_attn_implementation"
    ):
        return False
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, packed_attention)
    model.set_attn_implementation(NAME)
    return getattr(config, "_attn_implementation", None) == NAME
